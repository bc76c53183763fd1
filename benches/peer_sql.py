#!/usr/bin/env python3
"""Peer benchmark for benches/sql.rs: DuckDB over the same lake's Parquet files, same queries.

    python3 benches/peer_sql.py --lake DIR [--repeats 3] [--threads 2] [--layout LABEL]

Each query runs on a fresh connection whose views read `DIR/<table>/date=*/*.parquet` (Hive partitioning,
the `date` column), so file listing and Parquet metadata are timed as for a `nextstate sql` call, like
the Rust side. Prints `BENCH {json}` lines with the best and median wall time and the result rows (JSON),
which must equal DataFusion's. Needs `duckdb` (a bench dependency, not used by nextstate).
"""

import argparse
import json
import os
import time

import duckdb

# Same text as QUERIES in benches/sql.rs.
QUERIES = [
    ("count", "SELECT count(*) AS turns FROM interactions"),
    ("group_by_session", "SELECT count(*) AS sessions, max(turns) AS max_turns, min(turns) AS min_turns FROM (SELECT session_id, count(*) AS turns FROM interactions GROUP BY session_id) t"),
    ("join_samples_judgments", "SELECT j.score, count(*) AS samples, sum(s.reward) AS reward FROM samples s JOIN judgments j ON s.judgment_id = j.judgment_id GROUP BY j.score ORDER BY j.score"),
]


def connect(lake, threads):
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    for table in ("interactions", "judgments", "samples"):
        if os.path.isdir(os.path.join(lake, table)):
            glob = os.path.join(lake, table, "date=*", "*.parquet")
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{glob}', hive_partitioning = true)")
    return con


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lake", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--layout", default="as written", help="label of the lake's file layout, copied into the results")
    args = ap.parse_args()
    for name, q in QUERIES:
        if name.startswith("join") and not os.path.isdir(os.path.join(args.lake, "samples")):
            print("BENCH " + json.dumps({"bench": "sql", "case": name, "engine": "duckdb", "layout": args.layout, "skipped": "no samples table"}))
            continue
        times, rows = [], None
        for _ in range(args.repeats):
            t = time.perf_counter()
            con = connect(args.lake, args.threads)
            cur = con.execute(q)
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
            times.append(time.perf_counter() - t)
            con.close()
        times.sort()
        result = "\n".join(json.dumps(r, default=float) for r in rows)
        print("BENCH " + json.dumps({"bench": "sql", "case": name, "engine": "duckdb", "layout": args.layout, "version": duckdb.__version__, "threads": args.threads,
                                     "query": q, "best_s": times[0], "median_s": times[len(times) // 2], "repeats": args.repeats, "result": result}))


if __name__ == "__main__":
    main()
