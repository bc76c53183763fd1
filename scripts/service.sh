# Shared by scripts/broker.sh, scripts/s3.sh and scripts/azurite.sh (sourced): a loopback service run in
# the background with its PID in a file, started once and waited for until its port accepts connections.
#   service_start NAME PORT DIR PRINT CMD...   prints PRINT once 127.0.0.1:PORT accepts (or it already ran)
#   service_stop NAME DIR                      SIGTERM, then SIGKILL after 5 s
service_start() {
  local name=$1 port=$2 dir=$3 print=$4; shift 4
  mkdir -p "$dir"
  if [ -f "$dir/$name.pid" ] && kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null; then
    echo "$print"; return 0
  fi
  nohup "$@" >"$dir/$name.log" 2>&1 &
  echo $! > "$dir/$name.pid"
  for _ in $(seq 1 150); do
    if (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then echo "$print"; return 0; fi
    sleep 0.1
  done
  echo "$name: did not open port $port; log:" >&2; cat "$dir/$name.log" >&2; return 1
}

service_stop() {
  local name=$1 dir=$2
  if [ -f "$dir/$name.pid" ]; then
    local pid
    pid=$(cat "$dir/$name.pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  fi
}
