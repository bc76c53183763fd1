//! The lake on object storage against local servers: `--lake s3://bucket/prefix` on an S3-compatible
//! server (moto, started by scripts/s3.sh) and `--lake az://container/prefix` on the Azure Blob Storage
//! emulator (Azurite, scripts/azurite.sh). Each test body below runs once per store, as `s3::<name>` and
//! `az::<name>` ([`on_each_store`]): the lake's files, offsets, keys and rows; an idempotent re-write
//! of an offset range (one conditional PUT); SQL with the live-file rule; stray objects named; the
//! documented `ingest` → `run --only signals` → `sql` sequence of a new user; `nextstate compact` on the
//! bucket (merged objects, identical results, retention, the lock object); trainer checkpoints uploaded
//! to the bucket and resumed bit-exactly on a machine without them. The kill -9 exactly-once test on
//! object storage is in tests/bus_lake/exactly_once.rs.
use crate::common;

use std::path::Path;
use std::time::Duration;

use nextstate::lake::compact::{compact_table, CompactLock, CompactOptions};
use nextstate::lake::{kafka_stem, Lake, StrayReason};
use nextstate::schema::{schema_of, DeadLetter, Interaction, Lineage, Table};

fn dl(i: i64) -> DeadLetter {
    let mut d = DeadLetter::new("test", "x", format!("reason {i}"), format!("payload {i}").as_bytes(), Lineage { source_line: Some(i), ..Default::default() });
    d.created_time = 1_764_000_000_000 + i * 3_600_000; // 2025-11-24, a new date every 24 rows
    d
}

/// A fresh lake on one object store (`common::s3_lake`, `common::azure_lake`): its URL, `None` after
/// `common::missing` when the store's server cannot be had.
type StoreLake = fn(&Path) -> Option<String>;

/// Runs each named test body (`async` or `sync`, taking a [`StoreLake`]) once per object store: tests
/// `s3::<body>` (moto) and `az::<body>` (Azurite).
macro_rules! on_each_store {
    ($($kind:ident $body:ident),* $(,)?) => {
        mod s3 {
            $(on_each_store!(@test $kind $body s3_lake);)*
        }
        mod az {
            $(on_each_store!(@test $kind $body azure_lake);)*
        }
    };
    (@test async $body:ident $lake:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $body() {
            super::$body(super::common::$lake).await
        }
    };
    (@test sync $body:ident $lake:ident) => {
        #[test]
        fn $body() {
            super::$body(super::common::$lake)
        }
    };
}

on_each_store! {
    async a_lake_on_object_storage_keeps_the_lake_rules,
    sync ingest_run_and_sql_with_the_lake_on_object_storage,
    async compact_on_object_storage_merges_small_objects_and_changes_no_result,
    sync checkpoints_go_to_the_bucket_and_resume_bit_exactly_without_the_local_folder,
}
use checkpoints::checkpoints_go_to_the_bucket_and_resume_bit_exactly_without_the_local_folder;

async fn a_lake_on_object_storage_keeps_the_lake_rules(store: StoreLake) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store(&dir.path().join("state")) else { return };
    let lake = Lake::open(&url).unwrap();
    assert!(lake.remote().is_some());
    // A direct writer's rows over two dates, and two sink files of partition 3.
    let rows: Vec<DeadLetter> = (0..30).map(dl).collect();
    assert_eq!(lake.write_rows(&rows, "w1", 1).unwrap().len(), 2, "one object per date");
    let extra: Vec<DeadLetter> = (100..110).map(dl).collect();
    let refs: Vec<&DeadLetter> = extra.iter().collect();
    let stem = kafka_stem("c1", "ns.dead_letters", 3, 10, 14);
    let first = lake.write_file::<DeadLetter>("2025-11-24", &stem, &refs[..5]).unwrap();
    // the same offset range again (a sink restarted after a crash) leaves the first copy, writing 0 bytes
    let other: Vec<&DeadLetter> = extra[5..].iter().collect();
    let again = lake.write_file::<DeadLetter>("2025-11-24", &stem, &other).unwrap();
    assert_eq!((again.path.clone(), again.bytes), (first.path.clone(), 0));
    lake.write_file::<DeadLetter>("2025-11-24", &kafka_stem("c1", "ns.dead_letters", 3, 15, 19), &refs[5..]).unwrap();

    assert_eq!(lake.tables(), vec!["dead_letters".to_string()]);
    let files = lake.files(DeadLetter::NAME).unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    assert!(files.iter().all(|f| f.bytes > 0));
    // what the write reported (the sink's `sink_bytes_total`) is the object's size in the bucket
    assert_eq!(files.iter().find(|f| f.path == first.path).map(|f| f.bytes), Some(first.bytes));
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
}

fn ingest_run_and_sql_with_the_lake_on_object_storage(store: StoreLake) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store(&dir.path().join("state")) else { return };
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

const DAY: i64 = 1_764_000_000_000; // 2025-11-24

fn interaction(i: usize, day: i64) -> Interaction {
    let req = format!(r#"[{{"role":"user","content":"question {i}"}}]"#);
    Interaction::new(&format!("s{}", i % 13), i as i32, &req, &format!("answer {i}"), day + i as i64)
}

const QUERIES: &[&str] = &[
    "SELECT count(*) AS n, count(DISTINCT interaction_id) AS ids, sum(turn_index) AS turns FROM interactions",
    "SELECT session_id, count(*) AS turns, min(turn_index) AS lo, max(turn_index) AS hi FROM interactions GROUP BY session_id ORDER BY session_id",
    "SELECT date, count(*) AS n FROM interactions GROUP BY date ORDER BY date",
];

async fn results(lake: &Lake) -> Vec<String> {
    let mut out = vec![];
    for q in QUERIES {
        out.push(nextstate::sql::render(&nextstate::sql::query(lake, q).await.unwrap(), nextstate::sql::OutputFormat::Csv).unwrap());
    }
    out
}

/// The `.parquet` objects below table `table` of the lake.
fn parquet_objects(lake: &Lake, table: &str) -> usize {
    lake.remote().unwrap().list(table).unwrap().iter().filter(|m| m.location.as_ref().ends_with(".parquet")).count()
}

async fn compact_on_object_storage_merges_small_objects_and_changes_no_result(store: StoreLake) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store(&dir.path().join("state")) else { return };
    let lake = Lake::open(&url).unwrap();
    // Partition 0: 10 sink files of 20 rows, contiguous offsets, 5 on each of two dates; a direct
    // writer's 3 files.
    let (mut id, mut next) = (0usize, 0i64);
    for f in 0..10 {
        let day = if f < 5 { DAY } else { DAY + 86_400_000 };
        let rows: Vec<Interaction> = (id..id + 20).map(|i| interaction(i, day)).collect();
        let refs: Vec<&Interaction> = rows.iter().collect();
        lake.write_file::<Interaction>(&nextstate::lake::date_of(day), &kafka_stem("cluster-1", "ns.interactions", 0, next, next + 19), &refs).unwrap();
        (id, next) = (id + 20, next + 20);
    }
    for seq in 1..=3 {
        lake.write_rows(&(id..id + 7).map(|i| interaction(i, DAY)).collect::<Vec<_>>(), "ingest-a", seq).unwrap();
        id += 7;
    }
    let total = id;
    assert_eq!(lake.files(Interaction::NAME).unwrap().len(), 13);
    let before = results(&lake).await;
    assert!(before[0].contains(&format!("{total},{total}")), "{}", before[0]);
    let offsets = lake.next_offsets(Interaction::NAME).unwrap();
    let keys = lake.keys::<Interaction>().unwrap();

    // The CLI, keeping the merged-away objects for readers (the default retention).
    let (ok, out, err) = common::run_bin(&["compact", "--lake", &url, "--table", "interactions", "--target-mb", "1"]);
    assert!(ok, "compact failed: {err}");
    // partition 0: one object per date (2); the writer: 1
    assert!(out.contains("compact interactions: files 13 -> 3 (13 merged into 3"), "{out}");
    assert!(out.contains("covered files deleted=0 kept=13"), "{out}");
    assert_eq!(lake.files(Interaction::NAME).unwrap().len(), 3);
    assert_eq!(lake.covered_files(Interaction::NAME).unwrap().len(), 13);
    assert_eq!(parquet_objects(&lake, Interaction::NAME), 16, "the small objects stay until the retention time");
    assert_eq!(results(&lake).await, before, "identical query results while the covered objects are still there");
    assert_eq!(lake.next_offsets(Interaction::NAME).unwrap(), offsets, "the durable offsets are unchanged");
    assert_eq!(lake.keys::<Interaction>().unwrap(), keys);
    assert_eq!(lake.read_table::<Interaction>().unwrap().len(), total);
    let r = lake.remote().unwrap();
    let lock_path = r.path("_state/compact/interactions.lock");
    assert!(!r.exists(&lock_path).unwrap(), "the lock object is deleted at the end");
    assert_eq!(lake.tables(), vec!["interactions".to_string()], "the lock folder is not a table");

    // A held lock (another compactor) stops a compaction at once; a stale one (a compactor killed
    // mid-way) is taken over.
    let opts = CompactOptions { target_bytes: 1 << 20, retain: Duration::ZERO };
    let now = chrono::Utc::now().timestamp_millis();
    let held = CompactLock { holder: "elsewhere:1:x".into(), acquired_ms: now, expires_ms: now + 600_000 };
    assert!(r.put_new(&lock_path, serde_json::to_vec(&held).unwrap()).unwrap());
    let e = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &opts).unwrap_err().to_string();
    assert!(e.contains("another `nextstate compact` is compacting table interactions") && e.contains("elsewhere:1:x"), "{e}");
    assert_eq!(lake.covered_files(Interaction::NAME).unwrap().len(), 13, "nothing deleted under another's lock");
    r.delete(&lock_path).unwrap();
    let stale = CompactLock { holder: "killed:2:y".into(), acquired_ms: now - 3_600_000, expires_ms: now - 1_000 };
    assert!(r.put_new(&lock_path, serde_json::to_vec(&stale).unwrap()).unwrap());

    // Retention 0: the covered objects go; nothing left to merge.
    let s = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &opts).unwrap();
    assert_eq!((s.merged, s.covered_deleted, s.covered_kept, s.files_after), (0, 13, 0, 3), "{s:?}");
    assert!(!r.exists(&lock_path).unwrap(), "the taken-over lock is released");
    assert_eq!(parquet_objects(&lake, Interaction::NAME), 3, "only the merged objects are left in the bucket");
    assert_eq!(results(&lake).await, before);
    assert_eq!(lake.next_offsets(Interaction::NAME).unwrap(), offsets);
    assert_eq!(lake.read_table::<Interaction>().unwrap().len(), total);
    // A second compaction is a no-op.
    let s = compact_table(&lake, Interaction::NAME, schema_of::<Interaction>(), &opts).unwrap();
    assert_eq!((s.files_before, s.merged, s.covered_deleted, s.files_after), (3, 0, 0, 3), "{s:?}");
}

/// Trainer checkpoints on object storage, with a tiny policy (embedding + linear head over 16 tokens).
mod checkpoints {
    use nextstate::method::Method;
    use nextstate::schema::{Sample, SampleType};
    use nextstate::trainer::optim::trainable_named;
    use nextstate::trainer::{CheckpointWriter, Gradients, HiddenPass, PackedBatch, Policy, Trainer, TrainerConfig};
    use tch::nn::{self, Module, VarStore};
    use tch::{Device, Tensor};

    const V: i64 = 16;
    const H: i64 = 8;

    struct Tiny {
        vs: VarStore,
        emb: nn::Embedding,
        head: nn::Linear,
    }

    /// Weights set from `seed` by a fixed formula (no random generator shared with parallel tests).
    fn tiny(seed: u64) -> Tiny {
        let vs = VarStore::new(Device::Cpu);
        let emb = nn::embedding(vs.root() / "emb", V, H, Default::default());
        let head = nn::linear(vs.root() / "head", H, V, Default::default());
        tch::no_grad(|| {
            for (_, mut t) in trainable_named(&vs) {
                let vals: Vec<f32> = (0..t.numel() as u64).map(|i| ((i * 37 + seed * 11) % 100) as f32 / 100.0 - 0.5).collect();
                t.copy_(&Tensor::from_slice(&vals).view(t.size().as_slice()));
            }
        });
        Tiny { vs, emb, head }
    }

    impl Policy for Tiny {
        fn var_store(&self) -> &VarStore {
            &self.vs
        }
        fn vocab_size(&self) -> usize {
            V as usize
        }
        fn response_hidden(&self, b: &PackedBatch, grad: Gradients) -> nextstate::Result<HiddenPass<'_>> {
            let _guard = (grad == Gradients::None).then(tch::no_grad_guard);
            let (bs, t) = (b.batch_size() as i64, b.max_response_len() as i64);
            let hidden = self.emb.forward(&b.input_ids);
            let idx = b.predict_positions.f_unsqueeze(-1)?.f_expand([bs, t, H], false)?;
            HiddenPass::from_graph(hidden.f_gather(1, &idx, false)?)
        }
        fn logits(&self, hidden: &Tensor) -> nextstate::Result<Tensor> {
            Ok(self.head.forward(hidden))
        }
    }

    fn weights(p: &Tiny) -> Vec<(String, Tensor)> {
        trainable_named(&p.vs).into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
    }

    fn same_weights(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|((na, ta), (nb, tb))| na == nb && ta.equal(tb))
    }

    fn sample(id: &str, prompt: &[i32], response: &[i32], reward: f32) -> Sample {
        Sample {
            sample_id: id.into(),
            pipeline: "test".into(),
            interaction_id: format!("i-{id}"),
            session_id: "s".into(),
            source_topic: Some("interactions".into()),
            source_partition: Some(0),
            source_offset: Some(0),
            ..Sample::new(SampleType::Binary, prompt.to_vec(), response.to_vec(), vec![-2.0; response.len()], reward)
        }
    }

    fn batch(step: usize) -> Vec<Sample> {
        let s = |i: usize, r: f32| sample(&format!("s{step}-{i}"), &[1 + i as i32, 2], &[3 + i as i32, 4, 5], r);
        vec![s(0, 1.0), s(1, -1.0), s(2, 1.0), s(3, -1.0)]
    }

    pub fn checkpoints_go_to_the_bucket_and_resume_bit_exactly_without_the_local_folder(store: super::StoreLake) {
        let dir = tempfile::tempdir().unwrap();
        let Some(url) = store(&dir.path().join("state")) else { return };
        let lake = nextstate::lake::Lake::open(&url).unwrap();
        let local = dir.path().join("checkpoints");
        let writer = || CheckpointWriter::new(&local, "run").with_lake(&lake);
        let c = TrainerConfig { checkpoint_every: 2, lr: 0.01, weight_decay: 0.0, ..TrainerConfig::default() };
        let mut a = Trainer::new(tiny(4), Method::Binary, c.clone(), writer()).unwrap();
        for step in 0..4 {
            a.train_step(&batch(step)).unwrap();
        }
        assert_eq!(a.version(), 2);
        let r = lake.remote().unwrap();
        for f in ["1/manifest.json", "1/model.safetensors", "2/manifest.json", "2/model.safetensors", "2/optimizer/optimizer.safetensors"] {
            assert!(r.exists(&r.path(&format!("_checkpoints/run/{f}"))).unwrap(), "{f} uploaded");
        }
        assert_eq!(lake.tables(), Vec::<String>::new(), "the checkpoint folder is not a table");
        // Another machine (no local folder) cannot start the run afresh: the bucket has its checkpoints.
        let elsewhere = dir.path().join("elsewhere");
        let e = Trainer::new(tiny(5), Method::Binary, c.clone(), CheckpointWriter::new(&elsewhere, "run").with_lake(&lake)).unwrap_err().to_string();
        assert!(e.contains("on object storage") && e.contains("resume"), "{e}");

        // The machine is gone: resume on another from the bucket alone.
        let at_4 = weights(a.policy());
        std::fs::remove_dir_all(&local).unwrap();
        let machine_b = dir.path().join("machine-b");
        let (mut b, resumed) = Trainer::resume(tiny(99), Method::Binary, c.clone(), CheckpointWriter::new(&machine_b, "run").with_lake(&lake)).unwrap();
        assert_eq!(resumed.from.as_ref().map(|(_, m)| m.version), Some(2));
        assert_eq!((b.step(), b.version(), b.optimizer().steps()), (4, 2, 4));
        assert!(same_weights(&weights(b.policy()), &at_4), "bit-identical weights");
        let want: std::collections::HashSet<String> = (0..4).flat_map(|s| batch(s).into_iter().map(|x| x.sample_id)).collect();
        assert_eq!(resumed.consumed, want, "the lineage of version 1 (manifest only) and of version 2");
        assert!(machine_b.join("run/2/manifest.json").is_file() && machine_b.join("run/.lineage/1.json").is_file());
        assert!(!machine_b.join("run/1").exists(), "older versions' weights are not downloaded");
        // The next step from the resumed trainer equals the next step of the uninterrupted one, bit for bit.
        let ra = a.train_step(&batch(4)).unwrap().train_step.unwrap();
        let rb = b.train_step(&batch(4)).unwrap().train_step.unwrap();
        assert_eq!((ra.loss, ra.grad_norm, ra.step, ra.version), (rb.loss, rb.grad_norm, rb.step, rb.version));
        assert!(same_weights(&weights(a.policy()), &weights(b.policy())));
        // Two trainers of one run: the second to reach version 3 is told, not silently overwritten.
        assert!(a.train_step(&batch(5)).unwrap().checkpoint.is_some());
        let e = b.train_step(&batch(5)).unwrap_err().to_string();
        assert!(e.contains("already on object storage"), "{e}");
    }
}
