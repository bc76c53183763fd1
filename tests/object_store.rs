//! The lake on object storage (`--lake s3://bucket/prefix`) against a local S3-compatible server
//! (moto, started by scripts/s3.sh): the lake's files, offsets, keys and rows; an idempotent re-write
//! of an offset range (one conditional PUT); SQL with the live-file rule; stray objects named; the
//! documented `ingest` → `run --only signals` → `sql` sequence of a new user. The kill -9 exactly-once
//! test on object storage is in tests/exactly_once.rs.
mod common;

use nextstate::lake::{kafka_stem, Lake, StrayReason};
use nextstate::schema::{DeadLetter, Interaction, Lineage, Table};

fn dl(i: i64) -> DeadLetter {
    let mut d = DeadLetter::new("test", "x", format!("reason {i}"), format!("payload {i}").as_bytes(), Lineage { source_line: Some(i), ..Default::default() });
    d.created_time = 1_764_000_000_000 + i * 3_600_000; // 2025-11-24, a new date every 24 rows
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lake_on_object_storage_keeps_the_lake_rules() {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = common::s3_lake(&dir.path().join("state")) else { return };
    let lake = Lake::open(&url).unwrap();
    assert!(lake.remote().is_some());
    // A direct writer's rows over two dates, and two sink files of partition 3.
    let rows: Vec<DeadLetter> = (0..30).map(dl).collect();
    assert_eq!(lake.write_rows(&rows, "w1", 1).unwrap().len(), 2, "one object per date");
    let extra: Vec<DeadLetter> = (100..110).map(dl).collect();
    let refs: Vec<&DeadLetter> = extra.iter().collect();
    let stem = kafka_stem("c1", "ns.dead_letters", 3, 10, 14);
    lake.write_file::<DeadLetter>("2025-11-24", &stem, &refs[..5]).unwrap();
    // the same offset range again (a sink restarted after a crash) leaves the first copy
    let other: Vec<&DeadLetter> = extra[5..].iter().collect();
    lake.write_file::<DeadLetter>("2025-11-24", &stem, &other).unwrap();
    lake.write_file::<DeadLetter>("2025-11-24", &kafka_stem("c1", "ns.dead_letters", 3, 15, 19), &refs[5..]).unwrap();

    assert_eq!(lake.tables(), vec!["dead_letters".to_string()]);
    let files = lake.files(DeadLetter::NAME).unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    assert!(files.iter().all(|f| f.bytes > 0));
    assert_eq!(lake.next_offsets(DeadLetter::NAME).unwrap().get(&("c1".into(), "ns.dead_letters".into(), 3)), Some(&20));
    let mut back = lake.read_table::<DeadLetter>().unwrap();
    back.sort_by_key(|d| d.source_line);
    let mut want: Vec<DeadLetter> = rows.iter().chain(&extra).cloned().collect();
    want.sort_by_key(|d| d.source_line);
    assert_eq!(back, want, "every row once, the first copy of the re-written range");
    assert_eq!(lake.keys::<DeadLetter>().unwrap().len(), 40);

    // SQL over the bucket, with the Hive date column.
    let n = nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM dead_letters").await.unwrap();
    let dates = nextstate::sql::scalar_i64(&lake, "SELECT count(DISTINCT date) FROM dead_letters").await.unwrap();
    assert_eq!((n, dates), (40, 2));
    // A merged range covers the files inside it, for SQL too (the live-file rule).
    let all: Vec<&DeadLetter> = extra.iter().collect();
    lake.write_file::<DeadLetter>("2025-11-24", &kafka_stem("c1", "ns.dead_letters", 3, 10, 19), &all).unwrap();
    assert_eq!(lake.files(DeadLetter::NAME).unwrap().len(), 3);
    assert_eq!(lake.covered_files(DeadLetter::NAME).unwrap().len(), 2);
    assert_eq!(nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM dead_letters").await.unwrap(), 40);

    // An object under a name the lake does not write is named, with what reads it.
    let r = lake.remote().unwrap();
    r.put_new(&r.path("dead_letters/date=2025-11-24/mine.parquet"), b"x".to_vec()).unwrap();
    r.put_new(&r.path("dead_letters/loose.parquet"), b"x".to_vec()).unwrap();
    let strays: Vec<StrayReason> = lake.stray_files(DeadLetter::NAME).unwrap().into_iter().map(|(_, why)| why).collect();
    assert_eq!(strays, vec![StrayReason::ForeignName, StrayReason::OutsideDateFolder]);

    // Compaction is refused on object storage, saying so.
    let e = nextstate::lake::compact::compact(&lake, &nextstate::schema::all_schemas(), &Default::default()).unwrap_err();
    assert!(e.to_string().contains("is on object storage; compaction is implemented for local lakes only"), "{e}");
}

#[test]
fn ingest_run_and_sql_with_the_lake_on_object_storage() {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = common::s3_lake(&dir.path().join("state")) else { return };
    let log = common::data("agent-logs/swe-agent__gpt4__pydicom__pydicom-1458.traj");
    if !log.is_file() {
        common::missing(&format!("{} (../shared/data)", log.display()));
        return;
    }
    let pipeline = common::root().join("pipelines/combined.toml");
    let (ok, out, err) = common::run_bin(&["ingest", "--lake", &url, &log.display().to_string()]);
    assert!(ok, "ingest: {err}");
    assert!(out.contains("sink interactions: rows_written=12"), "{out}");
    let (ok, out, err) = common::run_bin(&["run", "--pipeline", &pipeline.display().to_string(), "--only", "signals", "--until-idle", "--lake", &url]);
    assert!(ok, "run --only signals: {err}");
    assert!(out.contains("stage signals: interactions=12"), "{out}");
    let (ok, out, err) = common::run_bin(&["sql", "--lake", &url, "--format", "csv", "SELECT count(*) AS n, count(DISTINCT interaction_id) AS ids FROM signals"]);
    assert!(ok, "sql: {err}");
    assert_eq!(out.trim(), "n,ids\n12,12", "every turn's signal, once, in the bucket");
    let lake = Lake::open(&url).unwrap();
    assert_eq!(lake.read_table::<Interaction>().unwrap().len(), 12);
}
