//! `nextstate compact`: a lake of many small files becomes a few large ones with identical query
//! results and the same record of durable offsets (exactly-once unchanged), and readers that run during
//! compaction (the pipeline's `Lake::read_table` and `nextstate sql`) always see every row exactly once.
use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nextstate::lake::compact::{compact_table, CompactOptions};
use nextstate::lake::{kafka_stem, Lake};
use nextstate::schema::{schema_of, Interaction, Table};
use nextstate::sql::{query, render, OutputFormat};

const DAY: i64 = 1_764_000_000_000; // 2025-11-24

fn interaction(i: usize, day: i64) -> Interaction {
    let req = format!(r#"[{{"role":"user","content":"question {i}"}}]"#);
    Interaction::new(&format!("s{}", i % 13), i as i32, &req, &format!("answer {i}"), day + i as i64)
}

/// Writes `rows` of ids `ids` as the sink's file of `partition` starting at offset `first`.
fn sink_file(lake: &Lake, partition: i32, first: i64, ids: std::ops::Range<usize>, day: i64) -> i64 {
    let rows: Vec<Interaction> = ids.map(|i| interaction(i, day)).collect();
    let refs: Vec<&Interaction> = rows.iter().collect();
    let last = first + rows.len() as i64 - 1;
    let date = nextstate::lake::date_of(day);
    lake.write_file::<Interaction>(&date, &kafka_stem("cluster-1", "ns.interactions", partition, first, last), &refs).unwrap();
    last + 1
}

fn sql(lake: &Lake, rt: &tokio::runtime::Runtime, q: &str) -> String {
    render(&rt.block_on(query(lake, q)).unwrap(), OutputFormat::Csv).unwrap()
}

const QUERIES: &[&str] = &[
    "SELECT count(*) AS n, count(DISTINCT interaction_id) AS ids FROM interactions",
    "SELECT session_id, count(*) AS turns, min(turn_index) AS lo, max(turn_index) AS hi FROM interactions GROUP BY session_id ORDER BY session_id",
    "SELECT date, count(*) AS n FROM interactions GROUP BY date ORDER BY date",
];

#[test]
fn compact_merges_small_files_and_changes_no_result() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    // Partitions 0 and 1: 10 files of 20 rows each, contiguous offsets, on two dates; partition 2: a gap
    // between offsets 99 and 200 (files are merged on each side of it, not across it); a direct writer's
    // three files.
    let mut id = 0;
    for p in 0..2 {
        let mut next = 0;
        for f in 0..10 {
            let day = if f < 5 { DAY } else { DAY + 86_400_000 };
            next = sink_file(&lake, p, next, id..id + 20, day);
            id += 20;
        }
    }
    let mut next = 0;
    for _ in 0..5 {
        next = sink_file(&lake, 2, next, id..id + 20, DAY);
        id += 20;
    }
    let mut next = next + 100;
    for _ in 0..5 {
        next = sink_file(&lake, 2, next, id..id + 20, DAY);
        id += 20;
    }
    for seq in 1..=3 {
        lake.write_rows(&(id..id + 7).map(|i| interaction(i, DAY)).collect::<Vec<_>>(), "ingest-a", seq).unwrap();
        id += 7;
    }
    let total = id;
    assert_eq!(lake.files(Interaction::NAME).unwrap().len(), 33);
    let before: Vec<String> = QUERIES.iter().map(|q| sql(&lake, &rt, q)).collect();
    assert!(before[0].contains(&format!("{total},{total}")), "{}", before[0]);
    let offsets = lake.next_offsets(Interaction::NAME).unwrap();
    let keys = lake.keys::<Interaction>().unwrap();

    // The CLI, keeping the merged-away files for readers (the default retention).
    let lake_arg = dir.path().display().to_string();
    let (ok, out, err) = common::run_bin(&["compact", "--lake", &lake_arg, "--table", "interactions", "--target-mb", "1"]);
    assert!(ok, "compact failed: {err}");
    // p0, p1: one file per date each (4); p2: one file each side of the gap (2); the writer: 1
    assert!(out.contains("compact interactions: files 33 -> 7 (33 merged into 7"), "{out}");
    assert!(out.contains("covered files deleted=0 kept=33"), "{out}");
    assert_eq!(lake.files(Interaction::NAME).unwrap().len(), 7);
    let after: Vec<String> = QUERIES.iter().map(|q| sql(&lake, &rt, q)).collect();
    assert_eq!(after, before, "identical query results while the covered files are still there");
    assert_eq!(lake.next_offsets(Interaction::NAME).unwrap(), offsets, "the durable offsets are unchanged");
    assert_eq!(lake.keys::<Interaction>().unwrap(), keys);
    assert_eq!(lake.read_table::<Interaction>().unwrap().len(), total);

    // Retention 0: the covered files go; a second compaction has nothing to merge.
    let s = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &CompactOptions { target_bytes: 1 << 20, retain: Duration::ZERO }).unwrap();
    assert_eq!((s.merged, s.covered_deleted, s.files_after), (0, 33, 7), "{s:?}");
    let parquet_files = walk(dir.path().join("interactions").as_path());
    assert_eq!(parquet_files, 7, "only the merged files are left on disk");
    let after: Vec<String> = QUERIES.iter().map(|q| sql(&lake, &rt, q)).collect();
    assert_eq!(after, before);

    // An unknown table is refused with the list of tables.
    let (ok, _, err) = common::run_bin(&["compact", "--lake", &lake_arg, "--table", "nope"]);
    assert!(!ok && err.contains("--table nope: not a lake table (tables: interactions, signals"), "{err}");
}

fn walk(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| if e.path().is_dir() { walk(&e.path()) } else { e.file_name().to_string_lossy().ends_with(".parquet") as usize })
        .sum()
}

#[test]
fn readers_during_compaction_see_every_row_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    // 128 files of 8 rows in one partition: rounds of merges with a doubling target take it to 1 file.
    let mut next = 0;
    for f in 0..128 {
        next = sink_file(&lake, 0, next, f * 8..f * 8 + 8, DAY);
    }
    let total = 128 * 8;
    let one_file = std::fs::metadata(&lake.files(Interaction::NAME).unwrap()[0].path).unwrap().len();
    let done = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|k| {
            let (lake, done, reads) = (lake.clone(), done.clone(), reads.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                while !done.load(Ordering::SeqCst) {
                    if k == 0 {
                        let rows = lake.read_table::<Interaction>().unwrap();
                        let ids: std::collections::HashSet<&str> = rows.iter().map(|r| r.interaction_id.as_str()).collect();
                        assert_eq!((rows.len(), ids.len()), (total, total), "read_table during compaction");
                    } else {
                        let out = sql(&lake, &rt, QUERIES[0]);
                        assert!(out.contains(&format!("{total},{total}")), "sql during compaction: {out}");
                    }
                    reads.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let mut rounds = 0;
    let mut target = 2 * one_file;
    while lake.files(Interaction::NAME).unwrap().len() > 1 {
        let s = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &CompactOptions { target_bytes: target, retain: Duration::from_secs(600) })
            .unwrap();
        assert!(s.merged > 0, "round {rounds} merged nothing: {s:?}");
        target *= 2;
        rounds += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    done.store(true, Ordering::SeqCst);
    for r in readers {
        r.join().expect("a reader saw an inconsistent lake");
    }
    assert!(rounds >= 3, "{rounds} rounds");
    assert!(reads.load(Ordering::SeqCst) >= 4, "readers ran during compaction");
    // A second compaction of the same table at the same time is refused (the lock).
    let lock = std::fs::File::create(dir.path().join("_state/compact/interactions.lock")).unwrap();
    lock.lock().unwrap();
    let e = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &CompactOptions::default()).unwrap_err();
    assert!(e.to_string().contains("another `nextstate compact` is compacting table interactions"), "{e}");
}
