//! Kafka → Parquet exactly-once: the lake sinks (`nextstate run --only sinks`) are killed with SIGKILL
//! repeatedly while records stream in through the real broker; afterwards every record is in the lake
//! exactly once (counted by key with SQL). The same test runs with the lake on object storage:
//! `--lake s3://…` on a local S3-compatible server (scripts/s3.sh) and `--lake az://…` on the Azure Blob
//! Storage emulator (scripts/azurite.sh).
//!
//! Bounded: a SIGKILL leaves the process's consumer-group members behind. Kafka expires them after
//! `session.timeout.ms`; noida-db 0.2.3 never does (it keeps electing the dead member as the group
//! leader, so the group never gets an assignment again — the hang this test used to show). The sink
//! processes therefore use static membership (`--group-instance-id`, Kafka KIP-345): the restarted
//! process takes over its dead member at once. `[bus] max_poll_interval_ms` is 10 s (the rebalance
//! timeout). Every process is waited for with a deadline and killed when the test ends.
use crate::common;

use std::time::Duration;

use common::Proc;

use nextstate::bus::{Bus, BusConfig};
use nextstate::lake::Lake;
use nextstate::schema::Interaction;
use rand::{Rng, SeedableRng};

fn interaction(i: usize) -> Interaction {
    let session = format!("s{}", i % 37);
    let req = format!(r#"[{{"role":"user","content":"question {i} {}"}}]"#, "x".repeat(200));
    let resp = format!("answer {i}");
    Interaction {
        policy_version: Some(0),
        finish_reason: Some("stop".into()),
        prompt_token_ids: Some(vec![1, 2, 3]),
        response_token_ids: Some(vec![4, 5]),
        rollout_logprobs: Some(vec![-0.1, -0.2]),
        source_format: "test".into(),
        source_line: Some(i as i64),
        ingest_time: 1_764_000_000_000,
        // event times span two dates
        ..Interaction::new(&session, i as i32, &req, &resp, 1_764_000_000_000 + (i as i64) * 60_000)
    }
}

fn spawn_sinks(pipeline: &std::path::Path, brokers: &str, prefix: &str, lake: &std::path::Path, until_idle: bool, log: &std::path::Path) -> Proc {
    let mut a = common::args(&["run", "--only", "sinks", "--group-instance-id", "sinks-0", "--pipeline", &pipeline.display().to_string()]);
    a.extend(common::args(&["--brokers", brokers, "--topic-prefix", prefix, "--lake", &lake.display().to_string()]));
    if until_idle {
        a.push("--until-idle".into());
    }
    Proc::spawn("sinks", &a, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_repeatedly_lose_nothing_and_duplicate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    sinks_killed_repeatedly(dir.path(), dir.path().join("lake")).await;
}

/// The same with the lake on object storage: a file is one conditional PUT, so a range re-written after
/// a kill leaves the first copy. On a local S3-compatible server (`--lake s3://…`, moto) ...
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_repeatedly_on_object_storage_lose_nothing_and_duplicate_nothing() {
    on_object_storage(common::s3_lake).await;
}

/// ... and on the Azure Blob Storage emulator (`--lake az://…`, Azurite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_repeatedly_on_azure_blob_storage_lose_nothing_and_duplicate_nothing() {
    on_object_storage(common::azure_lake).await;
}

/// [`sinks_killed_repeatedly`] with the lake that `store` makes (`common::s3_lake`, `common::azure_lake`).
async fn on_object_storage(store: fn(&std::path::Path) -> Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store(&dir.path().join("state")) else { return };
    sinks_killed_repeatedly(dir.path(), std::path::PathBuf::from(url)).await;
}

async fn sinks_killed_repeatedly(dir: &std::path::Path, lake_dir: std::path::PathBuf) {
    const N: usize = 3000;
    let brokers = common::brokers();
    let prefix = common::prefix();
    let pipeline = dir.join("p.toml");
    std::fs::write(&pipeline, "name = \"eo\"\nmethod = \"combined\"\n[bus]\npartitions = 3\nmax_poll_interval_ms = 10000\n[sink]\nroll_ms = 250\nbatch = 200\n").unwrap();
    let log = dir.join("sinks.log");

    let bus = Bus::connect(BusConfig { brokers: Some(brokers.clone()), topic_prefix: prefix.clone(), partitions: 3, ..Default::default() }).await.unwrap();
    bus.ensure_topics(&["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "dead_letters"]).await.unwrap();
    let producer = bus.producer().unwrap();
    // a few duplicates of the same key as an at-least-once upstream would send them
    let dupes = 50;
    let feeder = tokio::spawn(async move {
        for i in 0..N {
            producer.send(&interaction(i), None).await.unwrap();
            if i < dupes {
                producer.send(&interaction(i), None).await.unwrap();
            }
            if i % 100 == 0 {
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        }
    });

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let rounds = 5;
    for _ in 0..rounds {
        let mut child = spawn_sinks(&pipeline, &brokers, &prefix, &lake_dir, false, &log);
        tokio::time::sleep(Duration::from_millis(rng.gen_range(2_000..9_000))).await;
        child.kill(); // SIGKILL
    }
    tokio::time::timeout(Duration::from_secs(120), feeder).await.expect("feeder finished within 120 s").unwrap();
    let mut last = spawn_sinks(&pipeline, &brokers, &prefix, &lake_dir, true, &log);
    let (status, last) = tokio::task::spawn_blocking(move || (last.wait_for(Duration::from_secs(150)), last)).await.unwrap();
    assert!(status.is_some_and(|s| s.success()), "the until-idle sinks did not finish within 150 s: {status:?}\n{}", last.log_tail(200));

    let lake = Lake::open(&lake_dir).unwrap();
    let total = nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM interactions").await.unwrap();
    let distinct = nextstate::sql::scalar_i64(&lake, "SELECT count(DISTINCT interaction_id) FROM interactions").await.unwrap();
    assert_eq!(distinct, N as i64, "no loss");
    assert_eq!(total, N as i64, "no duplicates");
    let dates = nextstate::sql::scalar_i64(&lake, "SELECT count(DISTINCT date) FROM interactions").await.unwrap();
    assert_eq!(dates, 3, "rows partitioned by event date");
}
