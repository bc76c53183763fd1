//! Chaos tests against a real Kafka-protocol broker on loopback, bounded in time:
//!
//! - `kill` — every long-running process of a binary-method pipeline (`ingest`, the `signals`,
//!   `judge` and `teacher` stages, the lake `sinks`, `train`) is killed with SIGKILL at random points
//!   over many rounds and restarted; at the end every table holds each record exactly once by key, the
//!   stage chain is complete, and the trainer's checkpoints consumed each sample exactly once.
//! - `broker` — the broker (a private noida-db) is stopped with SIGTERM and restarted mid-run; a durable
//!   broker given by `NEXTSTATE_CHAOS_DURABLE_BROKER` is killed with SIGKILL and restarted.
//! - `judge_endpoint` — the judge's OpenAI-compatible endpoint returns errors, hangs past the timeout
//!   and returns garbage.
//!
//! Settings (environment): `NEXTSTATE_CHAOS_ROUNDS` (kill rounds, default 12), `NEXTSTATE_CHAOS_SEED`
//! (default: random, printed), `NEXTSTATE_CHAOS_SESSIONS` (synthetic sessions of 3 turns, default 12).
//! The tests of this file run one at a time (the machine may have two cores).

use crate::common;

mod broker;
mod check;
mod data;
mod judge_endpoint;
mod kill;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Proc;

/// Serialises the tests of this binary.
pub static SERIAL: Mutex<()> = Mutex::new(());

/// Takes [`SERIAL`] even after another test panicked while holding it.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// An environment setting or its default.
pub fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One process of the pipeline under test.
pub struct Role {
    /// Name (also its static group-membership id).
    pub name: &'static str,
    /// Arguments of `nextstate`.
    pub args: Vec<String>,
    /// Runs to completion by itself (`ingest`); others run until killed.
    pub finite: bool,
    /// The running process.
    pub proc: Option<Proc>,
    /// SIGKILLs that hit a running process.
    pub kills: u32,
    /// Starts.
    pub starts: u32,
    /// Clean exits of a finite role.
    pub completed: u32,
}

/// Starts, kills and restarts the roles; finishes the pipeline with `--until-idle` runs.
pub struct Supervisor {
    /// The roles.
    pub roles: Vec<Role>,
    /// Folder of the per-role logs.
    pub logs: PathBuf,
}

impl Supervisor {
    /// A supervisor writing logs under `logs`.
    pub fn new(logs: &Path) -> Supervisor {
        std::fs::create_dir_all(logs).expect("log folder");
        Supervisor { roles: vec![], logs: logs.to_path_buf() }
    }

    /// Adds a role.
    pub fn add(&mut self, name: &'static str, args: Vec<String>, finite: bool) {
        self.roles.push(Role { name, args, finite, proc: None, kills: 0, starts: 0, completed: 0 });
    }

    fn log(&self, name: &str) -> PathBuf {
        self.logs.join(format!("{name}.log"))
    }

    /// Starts role `name` (when not running).
    pub fn start(&mut self, name: &str) {
        let log = self.log(name);
        let r = self.roles.iter_mut().find(|r| r.name == name).expect("role");
        if r.proc.is_none() {
            r.proc = Some(Proc::spawn(name, &r.args, &log));
            r.starts += 1;
        }
    }

    /// Reaps exited processes. A finite role that exited cleanly is complete; any other exit is a
    /// failure of the pipeline (panics with the log tail).
    pub fn reap(&mut self) {
        for r in &mut self.roles {
            let Some(p) = r.proc.as_mut() else { continue };
            if let Some(status) = p.exited() {
                assert!(r.finite && status.success(), "{} exited by itself with {status}:\n{}", r.name, p.log_tail(60));
                r.completed += 1;
                r.proc = None;
            }
        }
    }

    /// SIGKILLs role `name` if it is running; true when it was.
    pub fn kill(&mut self, name: &str) -> bool {
        self.reap();
        let r = self.roles.iter_mut().find(|r| r.name == name).expect("role");
        match r.proc.take() {
            Some(mut p) => {
                p.kill();
                r.kills += 1;
                true
            }
            None => false,
        }
    }

    /// SIGKILLs every running role.
    pub fn kill_all(&mut self) {
        let names: Vec<&'static str> = self.roles.iter().map(|r| r.name).collect();
        for n in names {
            self.kill(n);
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to every running role with `kill(1)`.
    pub fn signal_all(&self, signal: &str) {
        for p in self.roles.iter().filter_map(|r| r.proc.as_ref()) {
            let ok = std::process::Command::new("kill").arg(format!("-{signal}")).arg(p.pid().to_string()).status().map(|s| s.success()).unwrap_or(false);
            assert!(ok, "kill -{signal} {} failed", p.pid());
        }
    }

    /// Total SIGKILLs.
    pub fn kills(&self) -> u32 {
        self.roles.iter().map(|r| r.kills).sum()
    }

    /// One line per role: starts, kills.
    pub fn summary(&self) -> String {
        self.roles.iter().map(|r| format!("{}: {} starts, {} kills", r.name, r.starts, r.kills)).collect::<Vec<_>>().join("; ")
    }

    /// Lines of the roles' logs (appended over restarts) that contain `text`.
    pub fn log_lines_with(&self, text: &str) -> usize {
        self.roles.iter().map(|r| std::fs::read_to_string(self.log(r.name)).unwrap_or_default().lines().filter(|l| l.contains(text)).count()).sum()
    }

    /// Runs role `name` with `--until-idle` (extra args appended) to completion within `limit`.
    pub fn run_until_idle(&mut self, name: &str, limit: Duration) {
        let log = self.log(name);
        let r = self.roles.iter_mut().find(|r| r.name == name).expect("role");
        let mut args = r.args.clone();
        if !r.finite {
            args.push("--until-idle".into());
        }
        let t = Instant::now();
        let mut p = Proc::spawn(name, &args, &log);
        r.starts += 1;
        let status = p.wait_for(limit);
        assert!(status.is_some_and(|s| s.success()), "{name} --until-idle did not finish cleanly within {limit:?}: {status:?}\n{}", p.log_tail(60));
        eprintln!("[chaos] {name} --until-idle finished in {:.1} s", t.elapsed().as_secs_f64());
    }
}

/// The data arguments every role shares.
pub fn base_args(pipeline: &Path, brokers: &str, prefix: &str, lake: &Path) -> Vec<String> {
    common::args(&["--pipeline", &pipeline.display().to_string(), "--brokers", brokers, "--topic-prefix", prefix, "--lake", &lake.display().to_string()])
}

/// A supervisor (logs under `<dir>/logs`) holding the pipeline's roles, none started: `ingest
/// --no-sink` of `files` (finite) and one [`stage_args`] role for each of `stages`.
pub fn pipeline_roles(dir: &Path, base: &[String], files: &[PathBuf], stages: &[&'static str]) -> Supervisor {
    let mut sup = Supervisor::new(&dir.join("logs"));
    let mut ingest = common::args(&["ingest", "--no-sink"]);
    ingest.extend(base.iter().cloned());
    ingest.extend(files.iter().map(|f| f.display().to_string()));
    sup.add("ingest", ingest, true);
    for stage in stages {
        sup.add(stage, stage_args(stage, base), false);
    }
    sup
}

/// `run --only <stage>` with static membership `<stage>`.
pub fn stage_args(stage: &str, base: &[String]) -> Vec<String> {
    let mut a = common::args(&["run", "--only", stage, "--group-instance-id", stage]);
    a.extend(base.iter().cloned());
    a
}

/// Creates every topic of the pipeline up front (with the pipeline's partitions).
pub async fn create_topics(brokers: &str, prefix: &str, partitions: i32) {
    let bus = nextstate::bus::Bus::connect(nextstate::bus::BusConfig { brokers: Some(brokers.to_string()), topic_prefix: prefix.to_string(), partitions, ..Default::default() })
        .await
        .expect("connect to the broker");
    bus.ensure_topics(&["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "train_steps", "checkpoints", "dead_letters"]).await.expect("create topics");
}
