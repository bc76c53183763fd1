//! The broker stopped and restarted mid-run, nothing lost or duplicated:
//!
//! - `broker_stopped_and_restarted_mid_run_loses_and_duplicates_nothing`: a private noida-db on a free
//!   loopback port (the shared test broker stays up for the other tests), stopped with SIGTERM.
//!   noida-db keeps its data only across a clean stop, so SIGKILL would lose acknowledged records. Even
//!   SIGTERM can lose some while clients write: noida-db 0.2.3 saves its snapshot and exits while its
//!   connection threads still serve, so a produce that arrives in between is acknowledged and lost (a
//!   CI run lost ingest's last 12 acknowledged interactions that way, seed 87152). So every role is
//!   frozen (SIGSTOP) for 200 ms around the stop, the broker answers what is already in its sockets,
//!   and nothing new arrives before the snapshot; the roles resume (SIGCONT) against the stopped broker,
//!   with requests in flight and queued, and retry and reconnect as before. A durable broker needs no
//!   such pause.
//! - `durable_broker_killed_and_restarted_mid_run_loses_and_duplicates_nothing`: a durable broker
//!   (a real cluster's broker, or nisshi with SQLite storage) killed with SIGKILL. It runs when
//!   `NEXTSTATE_CHAOS_DURABLE_BROKER` holds the command that starts one in the foreground, with `{port}`
//!   and `{dir}` (its data folder, kept across restarts; also the command's working folder) in it, e.g.
//!   `nisshi broker --listener-url tcp://127.0.0.1:{port} --advertised-listener-url tcp://127.0.0.1:{port} --storage-engine sqlite://nisshi.db`
//!   (nisshi 0.8.1 from crates.io; its SQLite path is relative to the working folder); otherwise it
//!   says `SKIPPED (optional)` (listed in `.ci/run`'s summary).

use std::path::{Path, PathBuf};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::{base_args, check, common, create_topics, data, pipeline_roles, serial, setting};

/// How the broker under test is run.
enum Kind {
    /// A private noida-db run by `scripts/broker.sh` in the data folder; stopped with SIGTERM.
    Noida,
    /// A durable broker started from a command template; stopped with SIGKILL.
    Durable { template: String, child: std::sync::Mutex<Option<Child>> },
}

/// The broker under test, on its own port and data folder (stopped when dropped).
struct Broker {
    port: u16,
    dir: PathBuf,
    kind: Kind,
}

impl Broker {
    fn start(port: u16, dir: &Path, kind: Kind) -> Broker {
        std::fs::create_dir_all(dir).expect("broker folder");
        let b = Broker { port, dir: dir.to_path_buf(), kind };
        b.restart();
        b
    }
    /// Starts the broker again on the same port and data folder; returns once the port accepts.
    fn restart(&self) {
        match &self.kind {
            Kind::Noida => {
                let out = Command::new("bash").arg(common::root().join("scripts/broker.sh")).args(["start", &self.port.to_string()]).arg(&self.dir).output().expect("run broker.sh");
                assert!(out.status.success(), "broker.sh start failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            Kind::Durable { template, child } => {
                let cmd = template.replace("{port}", &self.port.to_string()).replace("{dir}", &self.dir.display().to_string());
                let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("broker.log")).expect("broker log");
                let c = Command::new("bash").args(["-c", &format!("exec {cmd}")]).current_dir(&self.dir).stdout(log.try_clone().expect("log")).stderr(log).stdin(Stdio::null()).spawn().expect("start the durable broker");
                *child.lock().unwrap() = Some(c);
                let deadline = Instant::now() + Duration::from_secs(30);
                while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
                    assert!(Instant::now() < deadline, "the durable broker did not open port {} in 30 s; see {}", self.port, self.dir.join("broker.log").display());
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
    /// Noida: SIGTERM (a clean stop: noida-db saves its data). Durable: SIGKILL. Waits for the exit.
    fn stop(&self) {
        match &self.kind {
            Kind::Noida => {
                let out = Command::new("bash").arg(common::root().join("scripts/broker.sh")).arg("stop").arg(&self.dir).output().expect("run broker.sh");
                assert!(out.status.success(), "broker.sh stop failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            Kind::Durable { child, .. } => {
                if let Some(mut c) = child.lock().unwrap().take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
        }
    }
    fn how(&self) -> &'static str {
        match self.kind {
            Kind::Noida => "stopped (SIGTERM)",
            Kind::Durable { .. } => "killed (SIGKILL)",
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stopped_and_restarted_mid_run_loses_and_duplicates_nothing() {
    let _serial = serial();
    if !common::root().join(".tools/noida-db").exists() {
        common::missing(".tools/noida-db not installed (scripts/setup.sh)");
        return;
    }
    restarts_lose_and_duplicate_nothing(Kind::Noida).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_broker_killed_and_restarted_mid_run_loses_and_duplicates_nothing() {
    let _serial = serial();
    let Ok(template) = std::env::var("NEXTSTATE_CHAOS_DURABLE_BROKER") else {
        common::optional_missing("NEXTSTATE_CHAOS_DURABLE_BROKER not set (the command of a durable broker; see tests/e2e/chaos/broker.rs)");
        return;
    };
    restarts_lose_and_duplicate_nothing(Kind::Durable { template, child: Default::default() }).await;
}

/// Runs ingest → signals → judge → sinks while the broker is stopped and restarted
/// (`NEXTSTATE_CHAOS_BROKER_RESTARTS`, default 2), then drains and checks every table by key.
async fn restarts_lose_and_duplicate_nothing(kind: Kind) {
    let seed: u64 = setting("NEXTSTATE_CHAOS_SEED", rand::random::<u64>() % 100_000);
    let restarts: usize = setting("NEXTSTATE_CHAOS_BROKER_RESTARTS", 2);
    eprintln!("[chaos] seed {seed}, {restarts} broker restarts");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(free_port(), &dir.path().join("broker"), kind);
    let brokers = broker.addr();
    let prefix = common::prefix();
    let lake = dir.path().join("lake");
    let pipeline = dir.path().join("p.toml");
    std::fs::write(&pipeline, "name = \"restart\"\nmethod = \"binary\"\nstage_batch = 8\n[bus]\npartitions = 2\nmax_poll_interval_ms = 10000\n[sink]\nroll_ms = 300\n[judge]\nm = 1\n").unwrap();
    let files = data::write_inputs(dir.path(), setting("NEXTSTATE_CHAOS_SESSIONS", 12), true);
    let expected = data::expected(&files);
    create_topics(&brokers, &prefix, 2).await;

    let base = base_args(&pipeline, &brokers, &prefix, &lake);
    let mut sup = pipeline_roles(dir.path(), &base, &files, &["signals", "judge", "sinks"]);
    for stage in ["signals", "judge", "sinks"] {
        sup.start(stage);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sup.start("ingest");
    for r in 0..restarts {
        // The first stop lands while ingest is sending; later ones while the stages work.
        let wait = if r == 0 { rng.gen_range(100..800) } else { rng.gen_range(1_000..3_000) };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        sup.reap();
        let freeze = matches!(broker.kind, Kind::Noida);
        if freeze {
            sup.signal_all("STOP");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        broker.stop();
        if freeze {
            sup.signal_all("CONT");
        }
        eprintln!("[chaos] broker {} at {:.1} s", broker.how(), t0.elapsed().as_secs_f64());
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1_000..3_000))).await;
        sup.reap();
        broker.restart();
        eprintln!("[chaos] broker restarted at {:.1} s", t0.elapsed().as_secs_f64());
    }
    // Ingest finishes by itself once the broker is back.
    let deadline = Instant::now() + Duration::from_secs(120);
    while sup.roles[0].completed == 0 {
        sup.reap();
        assert!(Instant::now() < deadline, "ingest did not finish within 120 s after the broker came back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sup.reap();
    sup.kill_all();
    for n in ["signals", "judge", "sinks"] {
        sup.run_until_idle(n, Duration::from_secs(180));
    }
    let c = check::check(&lake, "restart", &expected, false, None);
    // A static member fenced after a restart (its commit raced its own rejoin) replaces its consumer.
    let replaced = sup.log_lines_with("replacing the consumer");
    // Commits held back while no partition was assigned (they would race the rejoin).
    let held = sup.log_lines_with("Assignment lost");
    eprintln!("[chaos] PASS in {:.0} s: {restarts} broker restarts ({}); {} records checked ({:?}); consumers replaced after a fence: {replaced}; commits held back while unassigned: {held}", t0.elapsed().as_secs_f64(), broker.how(), c.total(), c.rows);
}
