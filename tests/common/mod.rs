//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// Whether a missing prerequisite fails the test instead of skipping it: `CI` set to `true` or `1`, or
/// `NEXTSTATE_REQUIRE_ALL=1` (which `.ci/run` sets). In a developer's clone a test without its model or
/// data skips with a `SKIPPED:` line; in CI that would hide a broken set-up.
pub fn require_all() -> bool {
    let on = |k: &str| std::env::var(k).is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"));
    on("CI") || on("NEXTSTATE_REQUIRE_ALL")
}

/// A prerequisite of the calling test is missing (`what`: what, and how to get it). Under
/// [`require_all`] this panics with that message, failing the test; otherwise it prints
/// `SKIPPED: <what>` and the caller returns.
pub fn missing(what: &str) {
    if require_all() {
        panic!("missing prerequisite (CI / NEXTSTATE_REQUIRE_ALL): {what}");
    }
    eprintln!("SKIPPED: {what}");
    record_skip("required", what);
}

/// An optional input of the calling test is absent (a durable broker, a Qwen model): the test skips
/// with `SKIPPED (optional): <what>` everywhere, and the skip is recorded for `.ci/run`'s summary.
pub fn optional_missing(what: &str) {
    eprintln!("SKIPPED (optional): {what}");
    record_skip("optional", what);
}

/// Appends `<kind>\t<test binary>\t<what>` to the file named by `NEXTSTATE_SKIP_LOG`, when set.
fn record_skip(kind: &str, what: &str) {
    use std::io::Write;
    let Ok(path) = std::env::var("NEXTSTATE_SKIP_LOG") else { return };
    // The test binary's name without cargo's `-<hash>` suffix.
    let exe = std::env::current_exe().ok().and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned())).unwrap_or_default();
    let exe = match exe.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => name.to_string(),
        _ => exe,
    };
    let test = std::thread::current().name().unwrap_or("?").to_string();
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{kind}\t{exe} {test}\t{what}");
    }
}

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `models/smollm2-135m-instruct` (made by `scripts/setup.sh`) when its weights are there: the model
/// of the tests whose numbers are SmolLM2's.
pub fn smollm2() -> Option<PathBuf> {
    let d = root().join("models/smollm2-135m-instruct");
    d.join("model.safetensors").is_file().then_some(d)
}

/// The model of the model-agnostic tests: the directory `NEXTSTATE_TEST_MODEL` names when it holds
/// `model.safetensors`, else [`smollm2`].
pub fn test_model() -> Option<PathBuf> {
    let candidates = [std::env::var("NEXTSTATE_TEST_MODEL").ok().map(PathBuf::from), Some(root().join("models/smollm2-135m-instruct"))];
    candidates.into_iter().flatten().find(|d| d.join("model.safetensors").is_file())
}

/// [`test_model`]; when there is none, [`missing`] says how to get one (the caller then skips).
pub fn test_model_or_missing() -> Option<PathBuf> {
    let found = test_model();
    if found.is_none() {
        missing("model directory models/smollm2-135m-instruct not found (run scripts/setup.sh, or set NEXTSTATE_TEST_MODEL)");
    }
    found
}

/// Bootstrap address of the real Kafka-protocol broker for tests: `NEXTSTATE_TEST_BROKERS` when set
/// (CI, or a real cluster), else the local noida-db started (idempotently) by `scripts/broker.sh`.
pub fn brokers() -> String {
    if let Ok(b) = std::env::var("NEXTSTATE_TEST_BROKERS") {
        return b;
    }
    let out = Command::new("bash")
        .arg(root().join("scripts/broker.sh"))
        .arg("start")
        .output()
        .expect("run scripts/broker.sh");
    assert!(out.status.success(), "scripts/broker.sh start failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A unique topic prefix so tests never see each other's records.
pub fn prefix() -> String {
    format!("t{}.", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Path of the `nextstate` binary built for the tests.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_nextstate"))
}

/// `../shared/data/<rel>` if present, else `tests/fixtures/<rel>`.
pub fn data(rel: &str) -> PathBuf {
    let shared = root().join("../shared/data").join(rel);
    if shared.exists() {
        shared
    } else {
        root().join("tests/fixtures").join(rel)
    }
}

/// Runs the binary with args, returning (status success, stdout, stderr).
pub fn run_bin(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin()).args(args).env("OMP_NUM_THREADS", "1").output().expect("run nextstate");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A child process of a test: its stdout and stderr go to `log`; it is killed (SIGKILL) when dropped,
/// so a failing or timed-out test leaves no process behind.
pub struct Proc {
    /// The child.
    pub child: std::process::Child,
    /// Its log file (stdout and stderr).
    pub log: PathBuf,
    /// A name for messages.
    pub name: String,
}

impl Proc {
    /// Spawns the `nextstate` binary with `args` (OMP_NUM_THREADS=1), appending its output to `log`.
    pub fn spawn(name: &str, args: &[String], log: &std::path::Path) -> Proc {
        Proc::spawn_with_env(name, args, &[], log)
    }

    /// [`Proc::spawn`] with extra environment variables (e.g. `RUST_LOG`).
    pub fn spawn_with_env(name: &str, args: &[String], env: &[(&str, &str)], log: &std::path::Path) -> Proc {
        let f = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("open log");
        let child = Command::new(bin())
            .args(args)
            .env("OMP_NUM_THREADS", "1")
            .envs(env.iter().copied())
            .stdout(f.try_clone().expect("clone log"))
            .stderr(f)
            .spawn()
            .expect("spawn nextstate");
        Proc { child, log: log.to_path_buf(), name: name.to_string() }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (a clean stop request).
    pub fn term(&self) {
        let _ = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status();
    }

    /// Whether it has exited (reaps it), with its status.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for the process to exit; `None` when it is still running.
    pub fn wait_for(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// The last `n` lines of the log, leaving out the frames of backtraces (`RUST_BACKTRACE=1`
    /// prints dozens per error, which pushed the error's own text out of the tail).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines = without_backtrace_frames(&text);
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// The lines of `text` but the frames under a `stack backtrace:` heading (`  12: symbol` and
/// `      at path:line:col`); an error's numbered causes (`    0: message`) under `Caused by:` stay.
fn without_backtrace_frames(text: &str) -> Vec<&str> {
    let mut in_backtrace = false;
    let mut out = vec![];
    for line in text.lines() {
        let t = line.trim_start();
        let frame = t.starts_with("at ") || t.split_once(": ").is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if t.eq_ignore_ascii_case("stack backtrace:") {
            in_backtrace = true;
        } else if in_backtrace && frame {
            continue;
        } else {
            in_backtrace = false;
        }
        out.push(line);
    }
    out
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.kill();
        }
    }
}

/// `args` as owned strings.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A CA and one server certificate for `127.0.0.1` / `localhost`, written as PEM files into `dir`.
pub struct Pki {
    /// The CA certificate (trust this).
    pub ca: PathBuf,
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

/// Makes a CA (`<name> test CA`) and a server certificate it signs for `localhost` and `127.0.0.1`
/// (rcgen, ECDSA P-256), written as `<name>-ca.pem`, `<name>-cert.pem`, `<name>-key.pem` in `dir`.
pub fn make_pki(dir: &std::path::Path, name: &str) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} test CA"));
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign, rcgen::KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut leaf = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    leaf.distinguished_name.push(rcgen::DnType::CommonName, "127.0.0.1");
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
    let p = Pki { ca: dir.join(format!("{name}-ca.pem")), cert: dir.join(format!("{name}-cert.pem")), key: dir.join(format!("{name}-key.pem")) };
    std::fs::write(&p.ca, ca_cert.pem()).unwrap();
    std::fs::write(&p.cert, leaf_cert.pem()).unwrap();
    std::fs::write(&p.key, leaf_key.serialize_pem()).unwrap();
    p
}

/// Our policy server (`models/smollm2-135m-instruct`, f32 on the CPU, one libtorch thread, `Sampling`
/// log-probs) listening on 127.0.0.1:0 — on https when `tls` is given — until the returned sender is
/// dropped or sent to. Returns its base URL (`http://` or `https://`).
pub async fn start_policy_server(model: &std::path::Path, tls: Option<&nextstate::net::ServerTls>) -> (String, tokio::sync::oneshot::Sender<()>) {
    tch::set_num_threads(1);
    let lm = nextstate::model::LanguageModel::load(model, &nextstate::model::LoadOptions::default()).unwrap();
    let opts = nextstate::serve::ServerOptions {
        model_name: "smollm2-135m-instruct".into(),
        api_key: None,
        health_requires_key: false,
        limits: Default::default(),
        max_body_bytes: 8 << 20,
        max_batch: 4,
        batch_window: std::time::Duration::from_millis(5),
        default_max_tokens: 16,
        logprobs_mode: nextstate::model::LogprobMode::Sampling,
        load: nextstate::model::LoadOptions::default(),
        base_dir: model.to_path_buf(),
        threads: 1,
        merge_lora: false,
        continuous_batching: true,
    };
    let server = nextstate::serve::PolicyServer::start(lm, 0, opts).unwrap();
    let listener = nextstate::net::Listener::bind("127.0.0.1", 0, tls).await.unwrap();
    let url = listener.url().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));
    (url, stop)
}

/// The endpoint of a local object-storage server: `$env` when set (scripts/test.sh starts the servers),
/// else what `scripts/<script> start` prints after starting one. `None` (after [`missing`], naming
/// `what`) when the script fails.
fn local_server(env: &str, script: &str, what: &str) -> Option<String> {
    if let Ok(e) = std::env::var(env) {
        return Some(e);
    }
    let out = Command::new("bash").arg(root().join("scripts").join(script)).arg("start").output().unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    if !out.status.success() {
        missing(&format!("{what} (scripts/{script} start: {})", String::from_utf8_lossy(&out.stderr).trim()));
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A fresh bucket on the local S3-compatible server and the environment the lake's S3 client reads,
/// set in this process (and so inherited by the `nextstate` processes a test spawns): returns the lake
/// URL `s3://<bucket>/lake`. The server is `NEXTSTATE_TEST_S3` (scripts/test.sh starts moto with
/// scripts/s3.sh), else started here with scripts/s3.sh. Stage state of the lake goes to `state`
/// (`NEXTSTATE_STATE_DIR`). `None` (after [`missing`]) when no server can be started.
pub fn s3_lake(state: &std::path::Path) -> Option<String> {
    use std::io::{Read, Write};
    let endpoint = local_server("NEXTSTATE_TEST_S3", "s3.sh", "a local S3-compatible server")?;
    for (k, v) in [
        ("AWS_ENDPOINT", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
    ] {
        std::env::set_var(k, v);
    }
    std::env::set_var("NEXTSTATE_STATE_DIR", state);
    // CreateBucket: moto accepts an unsigned PUT /<bucket>.
    let bucket = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = std::net::TcpStream::connect(host).expect("connect to the S3 server");
    write!(conn, "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.0 200"), "create bucket {bucket}: {reply}");
    Some(format!("s3://{bucket}/lake"))
}

/// A fresh container on the local Azure Blob Storage emulator (Azurite) and the environment the lake's
/// Azure client reads, set in this process (and so inherited by the `nextstate` processes a test
/// spawns): returns the lake URL `az://<container>/lake`. The emulator is `NEXTSTATE_TEST_AZURE`
/// (scripts/test.sh starts it with scripts/azurite.sh), else started here with scripts/azurite.sh.
/// Stage state of the lake goes to `state` (`NEXTSTATE_STATE_DIR`). `None` (after [`missing`]) when no
/// emulator can be started.
pub fn azure_lake(state: &std::path::Path) -> Option<String> {
    let script = root().join("scripts/azurite.sh");
    let endpoint = local_server("NEXTSTATE_TEST_AZURE", "azurite.sh", "a local Azure Blob Storage emulator")?;
    // The emulator's well-known account (devstoreaccount1) and key: object_store's emulator mode.
    std::env::set_var("AZURE_STORAGE_USE_EMULATOR", "true");
    std::env::set_var("AZURITE_BLOB_STORAGE_URL", endpoint.trim_end_matches('/'));
    std::env::set_var("NEXTSTATE_STATE_DIR", state);
    // Create Container needs a SharedKey-signed request; the script signs it (node's crypto).
    let container = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let out = Command::new("bash").arg(&script).args(["container", &container, &endpoint]).output().expect("run scripts/azurite.sh container");
    assert!(out.status.success(), "create container {container}: {}", String::from_utf8_lossy(&out.stderr));
    Some(format!("az://{container}/lake"))
}
