#!/usr/bin/env python3
"""Storage of long sessions: bytes the lake's `interactions` table spends against the session's unique
content. Each interaction row stores its whole request history, so a session of n turns stores O(n^2)
messages; Parquet's ZSTD pages take some of that back. Per log: `nextstate ingest` into a fresh lake, then

- raw: the string columns of every row, uncompressed (what Arrow holds in memory after a read, and about
  what the bus carries per record);
- unique: per session, each distinct request message (canonical JSON) and each distinct value of the
  other string columns once, uncompressed;
- on disk: the table's Parquet files as the ingest wrote them (their number and row split vary from run to
  run with the embedded sinks' timing); on disk compacted: the same after `nextstate compact
  --retain-secs 0` (one file per partition);
- unique_zstd: the unique content compressed with ZSTD level 3 (the lake's codec), the floor a
  message-once layout could reach.

Prints one `BENCH {json}` line per log. Needs pyarrow.

    python3 benches/lake_storage.py --bin target/release/nextstate [LOG...]
"""
import argparse, glob, json, os, subprocess, sys, tempfile

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data")
LOGS = [
    os.path.join(DATA, "agent-logs", "swe-agent__gpt4__pydicom__pydicom-1458.traj"),
    os.path.join(DATA, "agent-logs", "mini-swe-agent__claude-sonnet-4__test_output.json"),
    os.path.join(DATA, "agent-logs", "tau-bench__gpt-4o-airline.json"),
    os.path.join(DATA, "agent-logs-2026", "openclaw__session-v3__f967d602.jsonl"),
]


def measure(bin_path, log, tmp):
    lake = os.path.join(tmp, os.path.basename(log))
    subprocess.run([bin_path, "ingest", "--lake", lake, log], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    files = sorted(glob.glob(f"{lake}/interactions/date=*/*.parquet"))
    disk = sum(os.path.getsize(f) for f in files)
    t = pa.concat_tables([pq.read_table(f) for f in files])
    str_cols = [f.name for f in t.schema if f.type in (pa.string(), pa.large_string())]
    rows = t.select(str_cols + (["session_id"] if "session_id" not in str_cols else [])).to_pylist()
    raw = 0
    uniq = {}
    turns = {}
    for r in rows:
        raw += sum(len(r[c].encode()) for c in str_cols if r[c])
        u = uniq.setdefault(r["session_id"], set())
        turns[r["session_id"]] = turns.get(r["session_id"], 0) + 1
        for m in json.loads(r["request_messages"] or "[]"):
            u.add("m:" + json.dumps(m, sort_keys=True))
        for c in str_cols:
            if c != "request_messages" and r[c]:
                u.add(c + ":" + r[c])
    unique = b"".join(x.encode() for sid in sorted(uniq) for x in sorted(uniq[sid]))
    unique_zstd = len(pa.compress(unique, codec="zstd", asbytes=True))
    subprocess.run([bin_path, "compact", "--lake", lake, "--table", "interactions", "--retain-secs", "0"], check=True, capture_output=True)
    compacted = sorted(glob.glob(f"{lake}/interactions/date=*/*.parquet"))
    disk_compacted = sum(os.path.getsize(f) for f in compacted)
    return {"bench": "storage", "log": os.path.basename(log), "sessions": len(uniq), "turns": len(rows), "max_turns": max(turns.values()),
            "raw_kb": raw / 1e3, "unique_kb": len(unique) / 1e3, "disk_kb": disk / 1e3, "unique_zstd_kb": unique_zstd / 1e3,
            "raw_over_unique": raw / len(unique), "disk_over_unique_zstd": disk / unique_zstd, "files": len(files),
            "disk_compacted_kb": disk_compacted / 1e3, "files_compacted": len(compacted), "disk_compacted_over_unique_zstd": disk_compacted / unique_zstd}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("logs", nargs="*")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for log in a.logs or LOGS:
            if not os.path.isfile(log):
                print(f"missing log {log}", file=sys.stderr)
                sys.exit(1)
            print("BENCH " + json.dumps(measure(a.bin, log, tmp)), flush=True)


if __name__ == "__main__":
    main()
