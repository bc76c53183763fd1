#!/usr/bin/env bash
# Starts / stops a local Azure Blob Storage emulator (Azurite's blob service, installed by scripts/setup.sh
# into .cache/azurite) on loopback, for the object-storage lake tests (`--lake az://container/prefix`).
#   scripts/azurite.sh start [PORT] [DIR]          prints the blob endpoint URL; PID in DIR/azurite.pid
#   scripts/azurite.sh stop  [DIR]
#   scripts/azurite.sh container NAME [ENDPOINT]   creates container NAME (exit 0 also when it exists)
# Defaults: PORT=19600, DIR=.cache/azurite-data, ENDPOINT=http://127.0.0.1:19600. Tests use
# NEXTSTATE_TEST_AZURE=http://127.0.0.1:PORT; the lake's client reaches it with AZURE_STORAGE_USE_EMULATOR=true
# and AZURITE_BLOB_STORAGE_URL=<endpoint> (the well-known account devstoreaccount1 and its public key). The
# server keeps its containers in memory (a restart empties it); DIR holds its PID and log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/service.sh
cmd=${1:-start}
case "$cmd" in
  start)
    port=${2:-19600}; dir=${3:-.cache/azurite-data}
    bin=.cache/azurite/node_modules/.bin/azurite-blob
    [ -x "$bin" ] || { echo "azurite.sh: $bin missing; run scripts/setup.sh" >&2; exit 1; }
    # Run node on the entry script itself (not the .bin shim) so the PID we hold is the server's.
    service_start azurite "$port" "$dir" "http://127.0.0.1:$port" node "$(readlink -f "$bin")" \
      --blobHost 127.0.0.1 --blobPort "$port" --inMemoryPersistence --skipApiVersionCheck --loose --silent --disableTelemetry
    ;;
  stop) service_stop azurite "${2:-.cache/azurite-data}" ;;
  container)
    # Create Container (PUT /<account>/<name>?restype=container) signed with the emulator's SharedKey.
    name=${2:?container name}; endpoint=${3:-http://127.0.0.1:19600}
    node - "$endpoint" "$name" <<'EOF'
const crypto = require("crypto"), http = require("http");
const [endpoint, name] = process.argv.slice(2);
const account = "devstoreaccount1";
const key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
const headers = { "x-ms-date": new Date().toUTCString(), "x-ms-version": "2021-12-02" };
const canon = Object.keys(headers).sort().map((k) => `${k}:${headers[k]}`).join("\n");
const toSign = ["PUT", "", "", "", "", "", "", "", "", "", "", "", canon, `/${account}/${account}/${name}\nrestype:container`].join("\n");
const sig = crypto.createHmac("sha256", Buffer.from(key, "base64")).update(toSign, "utf8").digest("base64");
headers.Authorization = `SharedKey ${account}:${sig}`;
headers["Content-Length"] = "0";
const req = http.request(`${endpoint}/${account}/${name}?restype=container`, { method: "PUT", headers }, (res) => {
  let body = "";
  res.on("data", (c) => (body += c));
  res.on("end", () => {
    if (res.statusCode === 201 || res.statusCode === 409) process.exit(0);
    console.error(`azurite.sh: create container ${name}: HTTP ${res.statusCode} ${body}`);
    process.exit(1);
  });
});
req.on("error", (e) => { console.error(`azurite.sh: create container ${name}: ${e.message}`); process.exit(1); });
req.end();
EOF
    ;;
  *) echo "usage: azurite.sh start [PORT] [DIR] | stop [DIR] | container NAME [ENDPOINT]" >&2; exit 2 ;;
esac
