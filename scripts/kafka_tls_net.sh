#!/usr/bin/env bash
# A Kafka broker that can only be reached over TLS, for tests/bus_lake/kafka_tls.rs (needs root, iproute2, socat).
#
# Two network namespaces joined by a veth pair (10.213.0.1 <-> 10.213.0.2, private to this machine):
#   <name>-b (broker side): noida-db on its own 127.0.0.1:PORT, plus a plain TCP forwarder on
#                           10.213.0.2:PORT to it; nothing else reaches the broker.
#   <name>-c (client side): a TLS terminator (socat, OpenSSL) on 127.0.0.1:PORT with the given
#                           certificate, forwarding to 10.213.0.2:PORT.
# The broker advertises 127.0.0.1:PORT, which inside the client namespace is the TLS terminator, so
# every connection a Kafka client in <name>-c makes (bootstrap, produce, fetch, group coordinator) is TLS.
#
#   scripts/kafka_tls_net.sh up NAME PORT CERT KEY DIR   start; run clients with `ip netns exec NAME-c ...`
#   scripts/kafka_tls_net.sh down NAME DIR               stop everything and delete the namespaces
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: kafka_tls_net.sh up NAME PORT CERT KEY DIR | down NAME DIR}
name=${2:?name}
case "$cmd" in
  up)
    port=${3:?port}; cert=$(realpath "${4:?cert}"); key=$(realpath "${5:?key}"); dir=$(realpath -m "${6:?dir}")
    mkdir -p "$dir"
    for t in ip socat; do command -v $t >/dev/null || { echo "kafka_tls_net.sh: $t not found (apt-get install iproute2 socat)" >&2; exit 1; }; done
    [ -x .tools/noida-db ] || { echo "kafka_tls_net.sh: .tools/noida-db missing; run scripts/setup.sh" >&2; exit 1; }
    ip netns add "$name-b"
    ip netns add "$name-c"
    ip link add "$name-vc" type veth peer name "$name-vb"
    ip link set "$name-vb" netns "$name-b"
    ip link set "$name-vc" netns "$name-c"
    ip -n "$name-b" addr add 10.213.0.2/30 dev "$name-vb"
    ip -n "$name-c" addr add 10.213.0.1/30 dev "$name-vc"
    for ns in "$name-b" "$name-c"; do ip -n "$ns" link set lo up; done
    ip -n "$name-b" link set "$name-vb" up
    ip -n "$name-c" link set "$name-vc" up
    ip netns exec "$name-b" setsid .tools/noida-db start --only kafka --host 127.0.0.1 --kafka-port "$port" \
      --data-dir "$dir/data" >"$dir/broker.log" 2>&1 < /dev/null &
    echo $! > "$dir/broker.pid"
    ip netns exec "$name-b" setsid socat "TCP-LISTEN:$port,bind=10.213.0.2,fork,reuseaddr" "TCP:127.0.0.1:$port" \
      >"$dir/forward.log" 2>&1 < /dev/null &
    echo $! > "$dir/forward.pid"
    ip netns exec "$name-c" setsid socat "OPENSSL-LISTEN:$port,bind=127.0.0.1,fork,reuseaddr,cert=$cert,key=$key,verify=0" \
      "TCP:10.213.0.2:$port" >"$dir/tls.log" 2>&1 < /dev/null &
    echo $! > "$dir/tls.pid"
    for _ in $(seq 1 100); do
      if ip netns exec "$name-b" bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null \
        && ip netns exec "$name-c" bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null; then
        echo "127.0.0.1:$port"; exit 0
      fi
      sleep 0.1
    done
    echo "kafka_tls_net.sh: the broker or the TLS terminator did not open port $port" >&2
    cat "$dir"/*.log >&2
    exit 1
    ;;
  down)
    dir=${3:?dir}
    for p in tls forward broker; do
      if [ -f "$dir/$p.pid" ]; then kill -TERM "$(cat "$dir/$p.pid")" 2>/dev/null || true; fi
    done
    # Whatever still runs in the namespaces (socat's forked children) ends with them.
    for ns in "$name-c" "$name-b"; do
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    done
    ;;
  *) echo "usage: kafka_tls_net.sh up NAME PORT CERT KEY DIR | down NAME DIR" >&2; exit 2 ;;
esac
