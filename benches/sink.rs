//! Kafka → Parquet ingest through the exactly-once lake sink (`lake::sink::run_sink`), against a real
//! Kafka-protocol broker, with a local ceiling and a scaling run.
//!
//! Records: the tau-bench fixture's 2,454 interactions replicated with fresh interaction/session ids
//! (`records=N`, default 24,540 = 10 copies), each cut to about `record_bytes` (default 4,096; 0 = whole,
//! about 15 kB) by dropping its oldest request messages and then its tool schemas, produced to a fresh
//! topic as the bus's JSON envelopes, keyed by session id. Not timed: producing (reported separately as the
//! producer's rate). Timed:
//! - `sink`: one in-process `run_sink::<Interaction>` (the default `[sink]` settings: 64 MiB / 5 s
//!   rolls, polls of 2,000) from its start until it has written every record and found the topic idle
//!   (`idle_ms = 300`, included in the time), for 1, 2 and 4 partitions;
//!   Also reported: `last_file_secs`, from the sink's start to the newest Parquet file's mtime (the time
//!   to the last durable row, without the idle wait after it);
//! - `raw_consume`: librdkafka with no processing (what `kcat -C` does): a consumer assigned every
//!   partition of the same topic from the beginning, polling until it has seen every record, counting
//!   bytes; run on the same records in the same run just before each `sink` run;
//! - `raw_consume_group`: the same, subscribed in a fresh consumer group as the sink is (so its time
//!   includes the group join: noida-db holds a new group's first JoinGroup about 0.3 s);
//! - `ceiling`: the same payloads parsed with serde_json and written with the lake's own writer
//!   (`Lake::write_file`: serde_arrow → Arrow → ZSTD Parquet, fsync, rename) in 64 MiB files, in one
//!   process, no Kafka;
//! - `procs`: `nextstate run --only sinks --until-idle` processes (`procs=1,2`, static membership
//!   `--group-instance-id sinks-<i>`) over a topic of each partition count (`scale_records=N`, default
//!   24,540), from spawn until the last Parquet file of the table appears (process start, group join
//!   and rebalances included; the idle wait and shutdown after it are not).
//!
//! - `resume`: peak RSS (`/usr/bin/time -v`) and wall time of `nextstate run --only sinks --until-idle`
//!   starting on a lake whose `interactions` table already holds `resume_rows` rows (default 1,000,000,
//!   each about 1 kB, in files of 2,000 rows named as the sink names them for 4 partitions of the bench's
//!   topic on this broker), beside the same command on an empty lake (the process floor): what a sink
//!   keeps in memory to resume (`[sink] dedupe_window`).
//!
//! `cases=ceiling,run_sink,procs,resume` picks cases (default: all). Every run checks exactly-once: the
//! lake holds each record's key once (`rows` in the output).
//!
//! Run: `cargo bench --bench sink -- brokers=127.0.0.1:19092` (default broker: `scripts/broker.sh`'s);
//! with `RUST_LOG` set (e.g. `nextstate=debug`) the library's log goes to stderr.
//! Prints `BENCH {json}` lines.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use serde_json::json;

use nextstate::bus::{Bus, BusConfig, Envelope};
use nextstate::lake::sink::{run_sink, SinkConfig};
use nextstate::lake::{date_of, Lake};
use nextstate::runtime::{Stop, TaskCtl};
use nextstate::schema::{Interaction, Table};

use common::{arg, dir_bytes, emit, fixture_rows, replica};

const SINK_TOPICS: &[&str] = &["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "dead_letters"];

struct Records {
    /// (key, envelope JSON) per record.
    payloads: Vec<(String, Vec<u8>)>,
    bytes: u64,
}

/// The envelope of `row`, cut to at most about `target` bytes (0: whole) the way a shorter conversation
/// would be: the oldest request messages go first, then the tool schemas; the response and the ids stay.
fn envelope_near(mut row: Interaction, target: usize) -> Vec<u8> {
    let encode = |r: &Interaction| serde_json::to_vec(&Envelope { row: r.clone(), carry: None }).expect("serialise");
    let mut out = encode(&row);
    if target == 0 {
        return out;
    }
    let mut messages: Vec<serde_json::Value> = serde_json::from_str(&row.request_messages).unwrap_or_default();
    while out.len() > target && messages.len() > 1 {
        messages.remove(0);
        row.request_messages = serde_json::to_string(&messages).expect("serialise");
        out = encode(&row);
    }
    if out.len() > target && row.tools.is_some() {
        row.tools = None;
        out = encode(&row);
    }
    out
}

fn records(rows: &[Interaction], n: usize, target: usize) -> Records {
    let payloads: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| {
            let r = replica(&rows[i % rows.len()], i / rows.len());
            (r.session_id.clone(), envelope_near(r, target))
        })
        .collect();
    let bytes = payloads.iter().map(|(_, p)| p.len() as u64).sum();
    Records { payloads, bytes }
}

/// serde_json → serde_arrow → Parquet with the lake's writer, 64 MiB of payload per file.
fn ceiling(recs: &Records, dir: &std::path::Path) -> Duration {
    let lake = Lake::open(dir).expect("lake");
    let roll = SinkConfig::default().roll_bytes;
    let t = Instant::now();
    let mut rows: Vec<Interaction> = vec![];
    let mut bytes = 0usize;
    let mut seq = 0u64;
    let flush = |rows: &mut Vec<Interaction>, seq: &mut u64| {
        if rows.is_empty() {
            return;
        }
        {
            let refs: Vec<&Interaction> = rows.iter().collect();
            let date = date_of(rows[0].event_time_ms());
            lake.write_file::<Interaction>(&date, &format!("w~ceiling~{seq:06}"), &refs).expect("write");
        }
        *seq += 1;
        rows.clear();
    };
    for (_, p) in &recs.payloads {
        let env: Envelope<Interaction> = serde_json::from_slice(p).expect("parse");
        bytes += p.len();
        rows.push(env.row);
        if bytes >= roll {
            flush(&mut rows, &mut seq);
            bytes = 0;
        }
    }
    flush(&mut rows, &mut seq);
    t.elapsed()
}

async fn topic_with(brokers: &str, partitions: i32, recs: &Records) -> (Bus, String, f64) {
    let prefix = format!("bench{}.", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let bus = Bus::connect(BusConfig { brokers: Some(brokers.to_string()), topic_prefix: prefix.clone(), partitions, ..Default::default() })
        .await
        .expect("connect to the broker");
    bus.ensure_topics(SINK_TOPICS).await.expect("create topics");
    let producer = bus.producer().expect("producer");
    let topic = bus.topic(Interaction::NAME);
    let t = Instant::now();
    let results: Vec<_> = futures::stream::iter(recs.payloads.iter())
        .map(|(k, p)| producer.send_raw(&topic, k, p))
        .buffer_unordered(1000)
        .collect()
        .await;
    let secs = t.elapsed().as_secs_f64();
    for r in results {
        r.expect("produce");
    }
    (bus, prefix, secs)
}

fn newest_file_time(dir: &std::path::Path) -> Option<SystemTime> {
    let mut best: Option<SystemTime> = None;
    for part in std::fs::read_dir(dir).ok()?.flatten() {
        for f in std::fs::read_dir(part.path()).ok()?.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.ends_with(".parquet") && !name.starts_with('.') {
                let m = f.metadata().ok()?.modified().ok()?;
                best = Some(best.map_or(m, |b| b.max(m)));
            }
        }
    }
    best
}

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        // Diagnostics only (e.g. RUST_LOG=nextstate=debug shows each partition's first record and flush).
        let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).try_init();
    }
    let Some(rows) = fixture_rows() else {
        eprintln!("SKIPPED: tau-bench fixture not found");
        return;
    };
    let brokers = arg("brokers", "127.0.0.1:19092");
    let n: usize = arg("records", "24540").parse().expect("records=N");
    let scale_n: usize = arg("scale_records", "24540").parse().expect("scale_records=N");
    let target: usize = arg("record_bytes", "4096").parse().expect("record_bytes=N");
    let partitions: Vec<i32> = arg("partitions", "1,2,4").split(',').map(|p| p.parse().expect("partitions=1,2,4")).collect();
    let procs: Vec<usize> = arg("procs", "1,2").split(',').filter(|s| !s.is_empty()).map(|p| p.parse().expect("procs=1,2")).collect();
    let cases = arg("cases", "ceiling,run_sink,procs,resume");
    let has = |c: &str| cases.split(',').any(|x| x == c);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let tmp = tempfile::tempdir().expect("tempdir");
    if has("resume") {
        let resume_rows: usize = arg("resume_rows", "1000000").parse().expect("resume_rows=N");
        resume(&rt, &brokers, &rows, resume_rows, tmp.path());
    }
    if !(has("ceiling") || has("run_sink") || has("procs")) {
        return;
    }
    let recs = records(&rows, n, target);
    let mb = recs.bytes as f64 / 1e6;
    let mean_bytes = recs.bytes as f64 / n.max(1) as f64;
    eprintln!("{n} records, {mb:.1} MB of envelopes, {mean_bytes:.0} bytes each on average");

    if has("ceiling") {
        let d = ceiling(&recs, &tmp.path().join("ceiling"));
        let parquet = dir_bytes(&tmp.path().join("ceiling"));
        emit(json!({"bench": "sink", "case": "ceiling", "records": n, "mb": mb, "record_bytes_mean": mean_bytes, "record_bytes_target": target, "secs": d.as_secs_f64(),
            "mb_s": mb / d.as_secs_f64(), "records_s": n as f64 / d.as_secs_f64(), "parquet_mb": parquet as f64 / 1e6}));
    }

    for &p in partitions.iter().filter(|_| has("run_sink")) {
        let lake_dir = tmp.path().join(format!("sink-p{p}"));
        let (stats, secs, last_file_secs, produce_secs) = rt.block_on(async {
            let (bus, _prefix, produce_secs) = topic_with(&brokers, p, &recs).await;
            for (case, group) in [("raw_consume", false), ("raw_consume_group", true)] {
                let (raw_secs, raw_bytes) = raw_consume(&brokers, &bus.topic(Interaction::NAME), p, n, group);
                emit(json!({"bench": "sink", "case": case, "partitions": p, "records": n, "mb": raw_bytes as f64 / 1e6, "secs": raw_secs,
                    "mb_s": raw_bytes as f64 / 1e6 / raw_secs, "records_s": n as f64 / raw_secs}));
            }
            let lake = Lake::open(&lake_dir).expect("lake");
            let mut ctl = TaskCtl::new("sink:interactions", true, Stop::default());
            ctl.idle_ms = 300;
            let (t, started) = (Instant::now(), SystemTime::now());
            let stats = run_sink::<Interaction>(&bus, &lake, &SinkConfig::default(), &ctl, None).await.expect("sink");
            let secs = t.elapsed().as_secs_f64();
            let last_file = newest_file_time(&lake_dir.join(Interaction::NAME)).and_then(|m| m.duration_since(started).ok()).map_or(f64::NAN, |d| d.as_secs_f64());
            (stats, secs, last_file, produce_secs)
        });
        let lake = Lake::open(&lake_dir).expect("lake");
        let keys = lake.keys::<Interaction>().expect("keys").len();
        assert_eq!(keys, n, "exactly-once: every record once in the lake");
        emit(json!({"bench": "sink", "case": "run_sink", "partitions": p, "consumers": 1, "records": n, "mb": mb,
            "secs": secs, "mb_s": mb / secs, "records_s": n as f64 / secs, "rows": keys, "files": stats.files,
            "last_file_secs": last_file_secs, "last_file_mb_s": mb / last_file_secs,
            "produce_mb_s": mb / produce_secs, "idle_ms_included": 300}));
    }

    // Scaling: sink processes (static membership) over topics of 1, 2 and 4 partitions.
    let scale = records(&rows, if has("procs") { scale_n } else { 0 }, target);
    let smb = scale.bytes as f64 / 1e6;
    for (&p, &k) in partitions.iter().filter(|_| has("procs")).flat_map(|p| procs.iter().map(move |k| (p, k))) {
        let lake_dir = tmp.path().join(format!("procs-p{p}-{k}"));
        let (_bus, prefix, _) = rt.block_on(topic_with(&brokers, p, &scale));
        let t0 = SystemTime::now();
        let started = Instant::now();
        let mut children: Vec<std::process::Child> = (0..k)
            .map(|i| {
                let log = std::fs::File::create(tmp.path().join(format!("procs-p{p}-{k}-{i}.log"))).expect("log");
                Command::new(env!("CARGO_BIN_EXE_nextstate"))
                    .args(["run", "--only", "sinks", "--until-idle", "--brokers", &brokers, "--topic-prefix", &prefix])
                    .args(["--lake", &lake_dir.display().to_string(), "--group-instance-id", &format!("sinks-{i}")])
                    .env("OMP_NUM_THREADS", "1")
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("spawn nextstate")
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(600);
        for c in children.iter_mut() {
            loop {
                if let Some(s) = c.try_wait().expect("wait") {
                    assert!(s.success(), "sink process failed: see {}", tmp.path().display());
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    panic!("sink process did not finish in 600 s");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let exit_secs = started.elapsed().as_secs_f64();
        let lake = Lake::open(&lake_dir).expect("lake");
        let keys = lake.keys::<Interaction>().expect("keys").len();
        assert_eq!(keys, scale_n, "exactly-once across processes");
        let last = newest_file_time(&lake.table_dir(Interaction::NAME)).expect("files written");
        let secs = last.duration_since(t0).map(|d| d.as_secs_f64()).unwrap_or(exit_secs);
        emit(json!({"bench": "sink", "case": "processes", "partitions": p, "consumers": k, "records": scale_n, "mb": smb,
            "secs": secs, "mb_s": smb / secs, "records_s": scale_n as f64 / secs, "rows": keys, "exit_secs": exit_secs}));
    }
}

/// Peak RSS in kB and wall seconds of `nextstate run --only sinks --until-idle` on `lake_dir`, under
/// `/usr/bin/time -v`.
fn sink_process_rss(brokers: &str, prefix: &str, lake_dir: &std::path::Path, log: &std::path::Path) -> (u64, f64) {
    let t = Instant::now();
    let out = Command::new("/usr/bin/time")
        .arg("-v")
        .arg(env!("CARGO_BIN_EXE_nextstate"))
        .args(["run", "--only", "sinks", "--until-idle", "--brokers", brokers, "--topic-prefix", prefix])
        .args(["--lake", &lake_dir.display().to_string(), "--group-instance-id", "sinks-resume"])
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run /usr/bin/time -v nextstate");
    let secs = t.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr);
    std::fs::write(log, err.as_bytes()).expect("write log");
    assert!(out.status.success(), "sink process failed: see {}", log.display());
    let kb = err
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes): "))
        .and_then(|v| v.trim().parse().ok())
        .expect("peak RSS in /usr/bin/time -v output");
    (kb, secs)
}

/// The `resume` case: a sink process starting on a table of `n` rows against one starting on an empty lake.
fn resume(rt: &tokio::runtime::Runtime, brokers: &str, rows: &[Interaction], n: usize, tmp: &std::path::Path) {
    const PARTITIONS: i32 = 4;
    const FILE_ROWS: usize = 2000;
    let (bus, prefix, _) = rt.block_on(topic_with(brokers, PARTITIONS, &Records { payloads: vec![], bytes: 0 }));
    let topic = bus.topic(Interaction::NAME);
    // The fixture's rows cut to about 1 kB (oldest request messages first), then replicated with fresh ids.
    let base: Vec<Interaction> =
        rows.iter().map(|r| serde_json::from_slice::<Envelope<Interaction>>(&envelope_near(r.clone(), 1024)).expect("parse").row).collect();
    let lake_dir = tmp.join("resume");
    let lake = Lake::open(&lake_dir).expect("lake");
    let t = Instant::now();
    let mut next = [0i64; PARTITIONS as usize];
    let mut chunk: Vec<Interaction> = Vec::with_capacity(FILE_ROWS);
    for i in 0..n {
        chunk.push(replica(&base[i % base.len()], i / base.len()));
        if chunk.len() == FILE_ROWS || i + 1 == n {
            let p = (i / FILE_ROWS) % PARTITIONS as usize;
            let (first, last) = (next[p], next[p] + chunk.len() as i64 - 1);
            next[p] = last + 1;
            let refs: Vec<&Interaction> = chunk.iter().collect();
            let stem = nextstate::lake::kafka_stem(bus.source_id(), &topic, p as i32, first, last);
            lake.write_file::<Interaction>(&date_of(chunk[0].event_time_ms()), &stem, &refs).expect("write");
            chunk.clear();
        }
    }
    let gen_secs = t.elapsed().as_secs_f64();
    let files = lake.files(Interaction::NAME).expect("list").len();
    let lake_mb = dir_bytes(&lake_dir) as f64 / 1e6;
    eprintln!("resume: {n} rows in {files} files, {lake_mb:.0} MB, written in {gen_secs:.1} s");
    let empty = tmp.join("resume-empty");
    let (floor_kb, floor_secs) = sink_process_rss(brokers, &prefix, &empty, &tmp.join("resume-empty.log"));
    let (kb, secs) = sink_process_rss(brokers, &prefix, &lake_dir, &tmp.join("resume.log"));
    let after = lake.files(Interaction::NAME).expect("list").len();
    assert_eq!(after, files, "a resuming sink with nothing new writes nothing");
    emit(json!({"bench": "sink", "case": "resume", "rows": n, "files": files, "lake_mb": lake_mb, "partitions": PARTITIONS,
        "peak_rss_mb": kb as f64 / 1024.0, "secs": secs, "floor_peak_rss_mb": floor_kb as f64 / 1024.0, "floor_secs": floor_secs}));
}

/// Seconds and payload bytes for a plain librdkafka consumer to receive `n` records of `topic`'s
/// `partitions` partitions: with `group` false, partitions assigned from the beginning (no group join, as
/// `kcat -C` does); with `group` true, subscribed in a fresh consumer group (`auto.offset.reset =
/// earliest`), so the time includes the group join the sink also pays (noida-db holds a new group's
/// first JoinGroup about 0.3 s, as Kafka's `group.initial.rebalance.delay.ms` does).
fn raw_consume(brokers: &str, topic: &str, partitions: i32, n: usize, group: bool) -> (f64, u64) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("bench-raw-{}", uuid::Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("receive.message.max.bytes", (1u32 << 30).to_string())
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("raw consumer");
    let t = Instant::now();
    if group {
        consumer.subscribe(&[topic]).expect("subscribe");
    } else {
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning).expect("partition");
        }
        consumer.assign(&tpl).expect("assign");
    }
    let (mut seen, mut bytes) = (0usize, 0u64);
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen < n {
        assert!(Instant::now() < deadline, "raw consumer saw {seen} of {n} records in 300 s");
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m.expect("raw consume");
            bytes += m.payload().map_or(0, |p| p.len() as u64);
            seen += 1;
        }
    }
    (t.elapsed().as_secs_f64(), bytes)
}
