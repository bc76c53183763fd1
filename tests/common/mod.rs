//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
