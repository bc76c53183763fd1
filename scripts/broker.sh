#!/usr/bin/env bash
# Starts / stops a local Kafka-protocol broker (noida-db, installed by scripts/setup.sh) on loopback.
#   scripts/broker.sh start [PORT] [DATA_DIR]   prints the bootstrap address; PID in DATA_DIR/broker.pid
#   scripts/broker.sh stop  [DATA_DIR]          SIGTERM (noida-db keeps its data across a clean stop)
# Defaults: PORT=19092, DATA_DIR=.cache/broker. Tests use NEXTSTATE_TEST_BROKERS=127.0.0.1:PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-start}
case "$cmd" in
  start)
    port=${2:-19092}; dir=${3:-.cache/broker}
    mkdir -p "$dir"
    if [ -f "$dir/broker.pid" ] && kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null; then
      echo "127.0.0.1:$port"; exit 0
    fi
    [ -x .tools/noida-db ] || { echo "broker.sh: .tools/noida-db missing; run scripts/setup.sh" >&2; exit 1; }
    # Run the binary itself (not the Python wrapper) so the PID we hold is the broker's.
    nohup .tools/noida-db start --only kafka --host 127.0.0.1 --kafka-port "$port" --data-dir "$dir/data" \
      >"$dir/broker.log" 2>&1 &
    echo $! > "$dir/broker.pid"
    for _ in $(seq 1 100); do
      if (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then echo "127.0.0.1:$port"; exit 0; fi
      sleep 0.1
    done
    echo "broker.sh: broker did not open port $port; log:" >&2; cat "$dir/broker.log" >&2; exit 1
    ;;
  stop)
    dir=${2:-.cache/broker}
    if [ -f "$dir/broker.pid" ]; then
      pid=$(cat "$dir/broker.pid")
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      rm -f "$dir/broker.pid"
    fi
    ;;
  *) echo "usage: broker.sh start [PORT] [DATA_DIR] | stop [DATA_DIR]" >&2; exit 2 ;;
esac
