//! Errors a person reads: a user error (unknown log format, bad config) prints its message and exits
//! non-zero without a stack trace, even with `RUST_BACKTRACE=1`, and says each thing once.

use std::process::Command;

/// Runs the binary with `RUST_BACKTRACE=1`; returns (success, stderr).
fn run(args: &[&str], dir: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nextstate"))
        .args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "1")
        .env_remove("NEXTSTATE_BROKERS")
        .env_remove("NEXTSTATE_LAKE")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn assert_user_error(args: &[&str], dir: &std::path::Path, message: &str) -> String {
    let (ok, stderr) = run(args, dir);
    assert!(!ok, "{args:?} succeeded: {stderr}");
    assert!(stderr.contains(message), "{args:?}: no {message:?} in {stderr}");
    assert!(!stderr.to_lowercase().contains("stack backtrace"), "{args:?} printed a backtrace: {stderr}");
    stderr
}

#[test]
fn unknown_format_prints_no_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("log.jsonl"), "{}\n").unwrap();
    assert_user_error(&["ingest", "--format", "nope", "log.jsonl"], dir.path(), "unknown log format \"nope\"");
}

#[test]
fn bad_config_prints_no_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.toml"), "name = \"x\"\nno_such_field = 1\n").unwrap();
    std::fs::write(dir.path().join("log.jsonl"), "{}\n").unwrap();
    assert_user_error(&["ingest", "--pipeline", "bad.toml", "log.jsonl"], dir.path(), "no_such_field");
}

#[test]
fn bad_sql_column_prints_no_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    std::fs::create_dir_all(&lake).unwrap();
    let stderr = assert_user_error(&["sql", "--lake", lake.to_str().unwrap(), "SELECT nope FROM interactions"], dir.path(), "nope");
    // DataFusion's schema error prints its cause in its own text and also returns it as its source (a
    // chain of four errors with one text): the message, with its list of valid fields, is printed once.
    assert_eq!(stderr.matches("Valid fields are").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("No field named nope").count(), 1, "{stderr}");
}
