//! Scale-out: two processes of one stage in one consumer group against the real broker. N
//! interactions over many sessions go into a 4-partition `interactions` topic; two `nextstate run
//! --only signals --until-idle` processes (static members `signals-0` and `signals-1` of the stage's
//! default group) start together, split the partitions two and two, and both exit by themselves once
//! their partitions are read. Afterwards the raw `signals` topic, read from the beginning by a fresh
//! consumer with no de-duplication, holds exactly one signal per interaction produced (by the signal's
//! key, `interaction_id`): none missing, none twice. Each process's report line (`stage signals:
//! interactions=K ...`) shows that both did work and that the two counts add up to N: every input
//! record was read once, by one of the two.
//!
//! Bounded, and what "together" needs: noida-db 0.2.3 forms a new group from the members whose
//! JoinGroup arrives within a short window (a start 0.3 s behind the other is still in it, 0.8 s is
//! not). A member that joins after the other has started work triggers an eager rebalance: the first
//! member's commit fails (`IllegalGeneration`) and the partition it keeps is read again from its
//! last commit, so the stage re-emits, unchanged, the signals of the rows read again — the stage is
//! at-least-once on its output topic by design (the keyed sinks keep one copy; `src/stages/signals/stage.rs`).
//! The strict topic-level check therefore applies to a group that formed in one generation (each
//! process assigned once, two partitions each). A run in which the group formed in two generations
//! (a process started late on a loaded machine) is checked for no loss and identical re-emits, then
//! repeated with fresh topics, at most [`ATTEMPTS`] runs in all. Static membership also keeps the
//! first process to finish from leaving the group (librdkafka sends no LeaveGroup for a static
//! member), which would rebalance the other mid-work. Every process is waited for with a deadline and
//! killed when the test ends.
use crate::common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::Proc;

use nextstate::bus::{Bus, BusConfig, Envelope};
use nextstate::runtime::InputLoop;
use nextstate::schema::{Interaction, Signal};

/// Sessions and turns per session: N = SESSIONS × TURNS interactions.
const SESSIONS: usize = 200;
const TURNS: usize = 10;
const N: usize = SESSIONS * TURNS;
/// Runs of the scenario at most (each with fresh topics) until the group forms in one generation.
const ATTEMPTS: usize = 3;
const IDS: [&str; 2] = ["signals-0", "signals-1"];

/// Turn `t` of session `s`: its request is the whole conversation so far, so turn `t + 1` continues
/// it (a `user` signal); the last turn is marked `session_done` (an excluded signal, and the session
/// closes). Every turn therefore gets exactly one signal, emitted as soon as its session allows.
fn interaction(s: usize, t: usize) -> Interaction {
    let mut msgs = Vec::with_capacity(2 * t + 1);
    for k in 0..t {
        msgs.push(serde_json::json!({"role": "user", "content": format!("question {k} of session {s}")}));
        msgs.push(serde_json::json!({"role": "assistant", "content": format!("answer {k} of session {s}")}));
    }
    msgs.push(serde_json::json!({"role": "user", "content": format!("question {t} of session {s}")}));
    let req = serde_json::to_string(&msgs).unwrap();
    let resp = format!("answer {t} of session {s}");
    Interaction {
        session_done: t + 1 == TURNS,
        source_format: "test".into(),
        ..Interaction::new(&format!("s{s}"), t as i32, &req, &resp, 1_764_000_000_000 + (s as i64) * 10 + (t as i64) * 1_000)
    }
}

/// `nextstate run --only signals --until-idle` as static member `id` of the stage's group; the bus's
/// rebalance callbacks are logged (`assigned` / `revoked`, debug) so the test sees how the group formed.
fn spawn_signals(id: &str, pipeline: &Path, brokers: &str, prefix: &str, lake: &Path, log: &Path) -> Proc {
    let mut a = common::args(&["run", "--only", "signals", "--until-idle", "--group-instance-id", id, "--pipeline", &pipeline.display().to_string()]);
    a.extend(common::args(&["--brokers", brokers, "--topic-prefix", prefix, "--lake", &lake.display().to_string()]));
    Proc::spawn_with_env(id, &a, &[("RUST_LOG", "info,rdkafka=warn,nextstate::bus=debug")], log)
}

/// `K` of the process's report line `stage signals: interactions=K ...` (None when it has none).
fn interactions_read(log: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.starts_with("stage signals:"))?;
    line.split_whitespace().find_map(|w| w.strip_prefix("interactions=")).and_then(|k| k.parse().ok())
}

/// The partitions of each assignment the process logged, in order.
fn assignments(log: &str) -> Vec<usize> {
    log.lines().filter(|l| l.contains("assigned") && l.contains("partitions")).map(|l| l.matches("interactions\"").count()).collect()
}

/// What one run of the scenario left.
struct Run {
    /// Records per input partition.
    per_partition: BTreeMap<i32, usize>,
    /// Every interaction id produced.
    produced: HashSet<String>,
    /// Every signal record on the topic, by interaction id (`processed_time` zeroed).
    signals: HashMap<String, Vec<Signal>>,
    /// Each process's log.
    logs: Vec<String>,
    /// Each process's `interactions=K`.
    k: Vec<u64>,
    secs: f64,
}

impl Run {
    /// Both logs, for failure messages.
    fn both(&self) -> String {
        self.logs.iter().zip(IDS).map(|(t, n)| format!("--- {n}\n{t}")).collect::<Vec<_>>().join("\n")
    }
    /// Whether the group formed once: each process assigned once, two partitions each.
    fn one_generation(&self) -> bool {
        self.logs.iter().all(|l| assignments(l) == [2])
    }
}

/// Produces N interactions to fresh topics, runs the two processes together until both exit, and
/// reads the whole `signals` topic back.
async fn run_once(brokers: &str) -> Run {
    let started = Instant::now();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let pipeline = dir.path().join("p.toml");
    std::fs::write(&pipeline, "name = \"so\"\nmethod = \"combined\"\n[bus]\npartitions = 4\nmax_poll_interval_ms = 10000\n").unwrap();

    let bus = Bus::connect(BusConfig { brokers: Some(brokers.to_string()), topic_prefix: prefix.clone(), partitions: 4, ..Default::default() }).await.unwrap();
    bus.ensure_topics(&["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "dead_letters"]).await.unwrap();
    let producer = bus.producer().unwrap();
    let rows: Vec<Interaction> = (0..SESSIONS).flat_map(|s| (0..TURNS).map(move |t| interaction(s, t))).collect();
    let produced: HashSet<String> = rows.iter().map(|r| r.interaction_id.clone()).collect();
    assert_eq!(produced.len(), N, "distinct interaction ids");
    // Keyed by session id: a session stays in one partition, the sessions spread over all four.
    let mut per_partition: BTreeMap<i32, usize> = BTreeMap::new();
    for r in futures::future::join_all(rows.iter().map(|r| producer.send(r, None))).await {
        *per_partition.entry(r.unwrap().0).or_default() += 1;
    }
    assert_eq!(per_partition.len(), 4, "sessions spread over the 4 partitions: {per_partition:?}");

    // Both members of the group at once.
    let logs: Vec<_> = IDS.iter().map(|id| dir.path().join(format!("{id}.log"))).collect();
    let procs: Vec<Proc> = IDS.iter().zip(&logs).map(|(id, log)| spawn_signals(id, &pipeline, brokers, &prefix, &lake, log)).collect();
    let waits: Vec<_> = procs.into_iter().map(|mut p| tokio::task::spawn_blocking(move || (p.wait_for(Duration::from_secs(45)), p))).collect();
    let mut done = vec![];
    for w in waits {
        done.push(w.await.unwrap());
    }
    for (status, p) in &done {
        assert!(status.is_some_and(|s| s.success()), "{} did not exit by itself within 45 s: {status:?}\n{}", p.name, p.log_tail(80));
    }
    let logs: Vec<String> = logs.iter().map(|l| std::fs::read_to_string(l).unwrap_or_default()).collect();
    let k: Vec<u64> = logs
        .iter()
        .zip(IDS)
        .map(|(t, n)| interactions_read(t).unwrap_or_else(|| panic!("{n}: no `stage signals: interactions=K` line\n{t}")))
        .collect();

    // Every record of the signals topic, from the beginning, by a consumer of its own group.
    let topic = bus.topic("signals");
    let high: HashMap<i32, i64> = bus.watermarks(&topic).await.unwrap().into_iter().map(|(p, (_, h))| (p, h)).collect();
    let mut input = InputLoop::new(&bus, &format!("{prefix}verify"), &topic).unwrap();
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut signals: HashMap<String, Vec<Signal>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while high.iter().any(|(p, h)| next.get(p).copied().unwrap_or(0) < *h) {
        assert!(Instant::now() < deadline, "read the signals topic to its end within 20 s: at {next:?} of {high:?}");
        for m in input.next_batch(1000, Duration::from_millis(300)).await.unwrap() {
            next.insert(m.partition, m.offset + 1);
            let mut s: Envelope<Signal> = serde_json::from_slice(&m.payload).unwrap();
            assert_eq!(m.key, s.row.session_id, "signals are keyed by session");
            s.row.processed_time = 0;
            signals.entry(s.row.interaction_id.clone()).or_default().push(s.row);
        }
    }
    Run { per_partition, produced, signals, logs, k, secs: started.elapsed().as_secs_f64() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_one_stage_process_every_record_exactly_once() {
    let brokers = common::brokers();
    for attempt in 1..=ATTEMPTS {
        let run = run_once(&brokers).await;
        // In every run: nothing lost, nothing unknown, and a signal emitted twice is the same signal.
        let missing = run.produced.iter().filter(|id| !run.signals.contains_key(*id)).count();
        assert_eq!(missing, 0, "every interaction has a signal\n{}", run.both());
        let unknown = run.signals.keys().filter(|id| !run.produced.contains(*id)).count();
        assert_eq!(unknown, 0, "no signal of an interaction never produced");
        for (id, copies) in &run.signals {
            assert!(copies.iter().all(|c| c.kind == copies[0].kind && c.next_state == copies[0].next_state), "signal {id} re-emitted differently: {copies:?}");
        }
        let twice = run.signals.values().filter(|c| c.len() > 1).count();
        if !run.one_generation() {
            let how: Vec<Vec<usize>> = run.logs.iter().map(|l| assignments(l)).collect();
            eprintln!(
                "attempt {attempt}: the group formed in more than one generation (partitions per assignment: {how:?}); \
                 interactions per process {:?}, {twice} signals re-emitted by the rebalance; running again with fresh topics",
                run.k
            );
            continue;
        }
        // The group formed once: exactly once on the raw topic, and each record read by one process.
        let records: usize = run.signals.values().map(Vec::len).sum();
        assert_eq!(twice, 0, "no signal twice ({records} signal records)\n{}", run.both());
        assert_eq!(records, N, "one signal record per interaction");
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for c in run.signals.values() {
            *kinds.entry(c[0].kind.as_str()).or_default() += 1;
        }
        assert_eq!(kinds, BTreeMap::from([("none", SESSIONS), ("user", SESSIONS * (TURNS - 1))]), "each turn paired with the next request, the last one excluded");
        assert!(run.k.iter().all(|&k| k > 0), "both processes did work: interactions={:?}\n{}", run.k, run.both());
        assert_eq!(run.k.iter().sum::<u64>(), N as u64, "each record read once across the two processes: interactions={:?}\n{}", run.k, run.both());
        eprintln!("scale-out (attempt {attempt}): interactions per process {:?}, per partition {:?}, {:.1} s", run.k, run.per_partition, run.secs);
        return;
    }
    panic!("the two processes never formed their group in one generation in {ATTEMPTS} runs (each started within noida-db's join window?)");
}
