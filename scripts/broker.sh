#!/usr/bin/env bash
# Starts / stops a local Kafka-protocol broker (noida-db, installed by scripts/setup.sh) on loopback.
#   scripts/broker.sh start [PORT] [DATA_DIR]   prints the bootstrap address; PID in DATA_DIR/broker.pid
#   scripts/broker.sh stop  [DATA_DIR]          SIGTERM (noida-db keeps its data across a clean stop, but 0.2.3 can lose a produce acknowledged while it saves: stop its clients first)
# Defaults: PORT=19092, DATA_DIR=.cache/broker. Tests use NEXTSTATE_TEST_BROKERS=127.0.0.1:PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/service.sh
cmd=${1:-start}
case "$cmd" in
  start)
    port=${2:-19092}; dir=${3:-.cache/broker}
    [ -x .tools/noida-db ] || { echo "broker.sh: .tools/noida-db missing; run scripts/setup.sh" >&2; exit 1; }
    # Run the binary itself (not the Python wrapper) so the PID we hold is the broker's.
    service_start broker "$port" "$dir" "127.0.0.1:$port" \
      .tools/noida-db start --only kafka --host 127.0.0.1 --kafka-port "$port" --data-dir "$dir/data"
    ;;
  stop) service_stop broker "${2:-.cache/broker}" ;;
  *) echo "usage: broker.sh start [PORT] [DATA_DIR] | stop [DATA_DIR]" >&2; exit 2 ;;
esac
