#!/usr/bin/env bash
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Builds the cargo-fuzz targets in fuzz/ (ingest: every log adapter and format detection; judge_vote:
# the PRM-answer parser) and runs each (or the TARGETs named) for SECONDS (default 60) with libFuzzer. Exits non-zero on the
# first crash (the crashing input is in fuzz/artifacts/<target>/; reproduce with
# `cargo fuzz run <target> <file>` and turn it into a test in tests/bus_lake/bad_input/ before fixing).
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Nightly features are enabled on the stable toolchain
# with RUSTC_BOOTSTRAP=1 (FUZZ_TOOLCHAIN=nightly to use a nightly instead). The first build compiles
# every dependency again with coverage instrumentation (datafusion, arrow, rdkafka, tch: long; see
# the report in the commit history); later builds are incremental.
#
# Environment: FUZZ_TARGET_DIR (default fuzz/target), FUZZ_SANITIZER (none|address, default none:
# the code under test is safe Rust, and ASan doubles the build), FUZZ_RELEASE=1 for an optimised
# build (default: dev profile, much cheaper to build), FUZZ_JOBS (parallel fuzzing processes per
# target, default 1), FUZZ_MAX_LEN (longest input, bytes, default 262144: the fixtures are up to
# ~100 KB; 4096 gives many more executions per second), LIBTORCH (default .libtorch).
set -euo pipefail

secs=${1:-60}
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then targets=(ingest judge_vote); fi
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
# The resolved path: torch-sys rebuilds whenever the LIBTORCH string changes. The fuzz binaries
# link libtorch dynamically and carry no rpath to it.
export LIBTORCH=${LIBTORCH:-$(readlink -f "$root/.libtorch")}
export LD_LIBRARY_PATH=$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$root/fuzz/target}
export RUSTC_BOOTSTRAP=1
toolchain=${FUZZ_TOOLCHAIN:-stable}
flags=(-s "${FUZZ_SANITIZER:-none}")
if [[ "${FUZZ_RELEASE:-0}" != 1 ]]; then flags+=(--dev); fi

t0=$(date +%s)
cargo "+$toolchain" fuzz build "${flags[@]}"
echo "fuzz.sh: build took $(( $(date +%s) - t0 )) s"

# Seed corpora: the real-log fixtures, each prefixed by its format's byte (the ingest target reads
# the first byte as the index into Format::ALL), and a few judge answers.
formats=(openclaw openai-chat tau-bench swe-agent mini-swe-agent openhands toolbench agentbench)
mkdir -p corpus/ingest corpus/judge_vote
for f in "$root"/tests/fixtures/agent-logs/*; do
    name=$(basename "$f")
    for i in "${!formats[@]}"; do
        fmt=${formats[$i]}
        if [[ "$name" == *"__${fmt}"* || "$name" == "${fmt}__"* ]]; then
            { printf "\\x$(printf %02x "$i")"; cat "$f"; } > "corpus/ingest/seed-$name"
        fi
    done
done
for s in '\boxed{1}' 'so the answer is \boxed{-1}.' '\boxed{ 0 } then \boxed{+1}' '\boxed{10}' 'no box' '\boxed{-' '\boxed{2}'; do
    printf '%s' "$s" > "corpus/judge_vote/seed-$(printf '%s' "$s" | sha256sum | cut -c1-12)"
done

status=0
for target in "${targets[@]}"; do
    log=$(mktemp)
    echo "fuzz.sh: $target for $secs s"
    if cargo "+$toolchain" fuzz run "${flags[@]}" --jobs "${FUZZ_JOBS:-1}" "$target" -- -max_total_time="$secs" -max_len="${FUZZ_MAX_LEN:-262144}" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1; then
        execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
        cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
        echo "fuzz.sh: $target ok: ${execs:-?} executions in $secs s ($cov; corpus $(ls corpus/$target | wc -l) inputs)"
    else
        status=1
        tail -60 "$log"
        echo "fuzz.sh: $target CRASHED; inputs in fuzz/artifacts/$target/:" && ls -1 "artifacts/$target" 2>/dev/null || true
    fi
    rm -f "$log"
done
exit $status
