#!/usr/bin/env bash
# The whole test suite (the README's test command; .ci/run calls it):
#   set-up (idempotent: libtorch, broker, model, build), a real Kafka-protocol broker, a local
#   S3-compatible server (moto) and an Azure Blob Storage emulator (Azurite) on loopback,
#   `cargo test` (unit, integration, real model, real broker), and the Python client checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# libtorch's OpenMP pool fights the other work on two cores (../shared/docs/BUILD.md).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
BROKER_DIR=.cache/test-broker
rm -rf "$BROKER_DIR/data"
NEXTSTATE_TEST_BROKERS=$(bash scripts/broker.sh start 19192 "$BROKER_DIR")
export NEXTSTATE_TEST_BROKERS
S3_DIR=.cache/test-s3
NEXTSTATE_TEST_S3=$(bash scripts/s3.sh start 19500 "$S3_DIR")
export NEXTSTATE_TEST_S3
AZURE_DIR=.cache/test-azurite
NEXTSTATE_TEST_AZURE=$(bash scripts/azurite.sh start 19600 "$AZURE_DIR")
export NEXTSTATE_TEST_AZURE
trap 'bash scripts/broker.sh stop "$BROKER_DIR"; bash scripts/s3.sh stop "$S3_DIR"; bash scripts/azurite.sh stop "$AZURE_DIR"' EXIT
echo "[test] broker at $NEXTSTATE_TEST_BROKERS, S3-compatible server at $NEXTSTATE_TEST_S3, Azure emulator at $NEXTSTATE_TEST_AZURE"
# cargo-nextest (on the project's machines) runs tests of different binaries side by side, two at a time
# on two cores, where `cargo test` runs one binary after another and idles a core through each binary's
# one long test (ablate, demo); it does not run doc-tests, so `cargo test --doc` follows.
# NEXTSTATE_TEST_RUNNER=cargo uses `cargo test` alone.
if [ "${NEXTSTATE_TEST_RUNNER:-nextest}" = nextest ] && command -v cargo-nextest >/dev/null 2>&1; then
  rc=0
  cargo nextest run --no-fail-fast --test-threads "${NEXTSTATE_TEST_THREADS:-2}" "$@" || rc=$?
  cargo test --doc "$@" || rc=$?
  exit $rc
fi
cargo test --no-fail-fast "$@"
