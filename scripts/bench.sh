#!/usr/bin/env bash
# Runs every benchmark (release build) with its peer/ceiling in the same run and writes docs/BENCHMARKS.md
# from the measured output (scripts/bench_report.py; no figure is typed by hand).
#
#   scripts/bench.sh                      all sections
#   NEXTSTATE_BENCH_SECTIONS=sink,sql scripts/bench.sh   a subset (the others read "not measured")
#
# Sections: ingest (benches/ingest.rs), sink (benches/sink.rs, needs a broker), sql (benches/sql.rs +
# benches/peer_sql.py), stages (benches/stages.rs), train (benches/train.rs + benches/peer_train.py),
# model (benches/model.rs + benches/peer_model.py + scripts/peft_parity.py, needs peft), serve (benches/serve.rs
# static and continuous batching + benches/peer_serve.py), proxy (benches/proxy.rs, needs a broker),
# storage (benches/lake_storage.py: lake bytes of long sessions against their unique content, needs pyarrow).
# Environment:
#   LIBTORCH (required by the build), CARGO_TARGET_DIR (default target)
#   NEXTSTATE_BENCH_PYTHON   Python with torch, transformers, peft, duckdb (default: python3)
#   NEXTSTATE_BENCH_BROKERS  Kafka bootstrap (default: 127.0.0.1:19092 if open, else scripts/broker.sh start)
#   NEXTSTATE_BENCH_RECORDS / _SCALE_RECORDS / _TURNS / _STEPS   sizes (see each bench's docs)
#   NEXTSTATE_BENCH_LAKE     the sql section's lake (default $CARGO_TARGET_DIR/bench-lake-<turns>, made if absent)
#   NEXTSTATE_BENCH_SQL_REPEATS   runs per query and engine in the sql section (default 7)
#   NEXTSTATE_BENCH_OUT      where raw outputs go (default $CARGO_TARGET_DIR/bench-run)
#   NEXTSTATE_BENCH_KEEP=1   keep the other sections' raw outputs in OUT (re-run some sections only);
#                            the report then says which sections ran at which time
# Benchmarks run with OMP_NUM_THREADS=1 and one libtorch/PyTorch thread on both sides.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
export OMP_NUM_THREADS=1
PY=${NEXTSTATE_BENCH_PYTHON:-python3}
SECTIONS=${NEXTSTATE_BENCH_SECTIONS:-ingest,sink,sql,stages,train,model,serve,proxy,storage}
OUT=${NEXTSTATE_BENCH_OUT:-$CARGO_TARGET_DIR/bench-run}
MODEL=models/smollm2-135m-instruct
[ "${NEXTSTATE_BENCH_KEEP:-0}" = 1 ] || rm -rf "$OUT"
mkdir -p "$OUT"
has() { [[ ",$SECTIONS," == *",$1,"* ]]; }

# Machine facts.
{
  echo "nproc=$(getconf _NPROCESSORS_ONLN)"
  echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "mem=$(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src benches Cargo.toml || echo '+uncommitted')"
  echo "rustc=$(rustc --version)"
  echo "python=$("$PY" --version 2>&1)"
  echo "loadavg_start=$(cut -d' ' -f1-3 /proc/loadavg)"
  echo "nice=$(nice)"
  echo "sections=$SECTIONS"
} > "$OUT/machine.new"
if [ -f "$OUT/machine.txt" ] && [ "${NEXTSTATE_BENCH_KEEP:-0}" = 1 ]; then
  # keep the first run's facts, add this run's date, commit, load and sections
  grep -E '^(date|commit|loadavg_start|sections)=' "$OUT/machine.new" | sed 's/^\([a-z_]*\)=/\1_rerun=/' >> "$OUT/machine.txt"
else
  mv "$OUT/machine.new" "$OUT/machine.txt"
fi
rm -f "$OUT/machine.new"

echo "bench.sh: building benches (release)" >&2
if ! cargo bench --no-run --bench ingest --bench sink --bench proxy --bench sql --bench stages --bench train --bench model --bench serve > "$OUT/build.log" 2>&1; then
  echo "bench.sh: build failed, see $OUT/build.log" >&2; tail -30 "$OUT/build.log" >&2; exit 1
fi

# run NAME CMD...: records the command, output and exit status of one benchmark.
run() {
  local name=$1; shift
  echo "$*" > "$OUT/$name.cmd"
  echo "bench.sh: $name: $*" >&2
  rm -f "$OUT/$name".{out,err,rc,secs}
  local t0=$SECONDS
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo $? > "$OUT/$name.rc"
  echo $((SECONDS - t0)) > "$OUT/$name.secs"
  grep -h '^BENCH ' "$OUT/$name.out" >&2 || tail -5 "$OUT/$name.err" >&2
}

crit=$CARGO_TARGET_DIR/criterion
if has ingest; then
  rm -rf "$crit/tau-bench"
  run ingest cargo bench --bench ingest -- --measurement-time 5 --warm-up-time 1
fi
brokers() {
  if [ -z "${BROKERS:-}" ]; then
    BROKERS=${NEXTSTATE_BENCH_BROKERS:-}
    if [ -z "$BROKERS" ]; then
      if (exec 3<>/dev/tcp/127.0.0.1/19092) 2>/dev/null; then BROKERS=127.0.0.1:19092; else BROKERS=$(bash scripts/broker.sh start); fi
    fi
  fi
  echo "$BROKERS"
}
if has sink; then
  BROKERS=$(brokers)
  run sink cargo bench --bench sink -- "brokers=$BROKERS"
fi
if has sql; then
  LAKE=${NEXTSTATE_BENCH_LAKE:-$CARGO_TARGET_DIR/bench-lake-${NEXTSTATE_BENCH_TURNS:-1000000}}
  # 7 runs per query and engine: single runs of these 0.1-0.5 s queries move by +-20 % on 2 shared cores
  REPEATS=${NEXTSTATE_BENCH_SQL_REPEATS:-7}
  run sql cargo bench --bench sql -- "lake=$LAKE" "repeats=$REPEATS"
  run sql_peer "$PY" benches/peer_sql.py --lake "$LAKE" --threads "$(getconf _NPROCESSORS_ONLN)" --repeats "$REPEATS"
  # The same rows after `nextstate compact` (covered files deleted at once): both engines read the
  # compacted files.
  if [ ! -f "$LAKE-compacted/_complete.json" ] && [ -f "$LAKE/_complete.json" ]; then
    rm -rf "$LAKE-compacted" && cp -r "$LAKE" "$LAKE-compacted" && rm "$LAKE-compacted/_complete.json" &&
      "$CARGO_TARGET_DIR/release/nextstate" compact --lake "$LAKE-compacted" --retain-secs 0 > "$OUT/sql_compact.log" 2>&1 &&
      cp "$LAKE/_complete.json" "$LAKE-compacted/"
  fi
  if [ -f "$LAKE-compacted/_complete.json" ]; then
    run sql_compacted cargo bench --bench sql -- "lake=$LAKE-compacted" "layout=compacted" "repeats=$REPEATS"
    run sql_peer_compacted "$PY" benches/peer_sql.py --lake "$LAKE-compacted" --threads "$(getconf _NPROCESSORS_ONLN)" --layout compacted --repeats "$REPEATS"
  else
    echo "bench.sh: compacting a copy of $LAKE failed, see $OUT/sql_compact.log" >&2
  fi
fi
if has stages; then
  run stages cargo bench --bench stages
fi
if has train; then
  run train cargo bench --bench train
  run train_peer "$PY" benches/peer_train.py --model "$MODEL" --threads 1 --steps "${NEXTSTATE_BENCH_STEPS:-3}"
  # 8 × 2,000 tokens: one timed step after the warm-up (each is minutes on one thread); the peer with
  # two samples per pass and gradient checkpointing (in one pass it needs more than 24 GB)
  run train_2k cargo bench --bench train -- case=lora_binary_b8_2k steps=1
  run train_2k_peer "$PY" benches/peer_train.py --model "$MODEL" --threads 1 --steps 1 --case lora_binary_b8_2k --micro 2 --grad-ckpt
fi
if has model; then
  rm -rf "$crit/model"
  run model cargo bench --bench model -- --measurement-time 10 --warm-up-time 1
  run model_peer "$PY" benches/peer_model.py --model "$MODEL" --threads 1 --repeats 3
  # PEFT parity of LoRA checkpoints: peft + transformers load our adapter folder, logits within 1e-4
  run peft_parity "$PY" scripts/peft_parity.py --model "$MODEL"
fi
if has serve; then
  # one process per mode, so each peak RSS is that mode's own
  run serve_static cargo bench --bench serve -- mode=static
  run serve_continuous cargo bench --bench serve -- mode=continuous
  run serve_peer "$PY" benches/peer_serve.py --model "$MODEL" --threads 1
fi
if has proxy; then
  BROKERS=$(brokers)
  run proxy cargo bench --bench proxy -- "brokers=$BROKERS"
fi
if has storage; then
  run storage "$PY" benches/lake_storage.py --bin "$CARGO_TARGET_DIR/release/nextstate"
fi
echo "loadavg_end=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"

mkdir -p docs
"$PY" scripts/bench_report.py "$OUT" "$crit" > docs/BENCHMARKS.md
echo "bench.sh: wrote docs/BENCHMARKS.md (raw outputs in $OUT)" >&2
