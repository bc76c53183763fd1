#!/usr/bin/env bash
# Starts / stops a local S3-compatible server (moto's `moto_server`, installed by scripts/setup.sh into
# .cache/venv-openai) on loopback, for the object-storage lake tests (`--lake s3://bucket/prefix`).
#   scripts/s3.sh start [PORT] [DIR]   prints the endpoint URL; PID in DIR/s3.pid
#   scripts/s3.sh stop  [DIR]
# Defaults: PORT=19500, DIR=.cache/s3. Tests use NEXTSTATE_TEST_S3=http://127.0.0.1:PORT; the server keeps
# its buckets in memory (a restart empties it).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/service.sh
cmd=${1:-start}
case "$cmd" in
  start)
    port=${2:-19500}; dir=${3:-.cache/s3}
    [ -x .cache/venv-openai/bin/moto_server ] || { echo "s3.sh: .cache/venv-openai/bin/moto_server missing; run scripts/setup.sh" >&2; exit 1; }
    service_start s3 "$port" "$dir" "http://127.0.0.1:$port" .cache/venv-openai/bin/moto_server -H 127.0.0.1 -p "$port"
    ;;
  stop) service_stop s3 "${2:-.cache/s3}" ;;
  *) echo "usage: s3.sh start [PORT] [DIR] | stop [DIR]" >&2; exit 2 ;;
esac
