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

/// Runs the binary in `dir` with `stdin` on its standard input; returns (exit code, stdout, stderr).
fn run_with_stdin(args: &[&str], dir: &std::path::Path, stdin: &str) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_nextstate"))
        .args(args)
        .current_dir(dir)
        .env_remove("NEXTSTATE_LAKE")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_missing_lake_is_an_error_not_an_empty_lake() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out").to_string_lossy().into_owned();
    for args in [
        vec!["sql", "SELECT count(*) FROM interactions"],
        vec!["sql", "--lake", "nolake", "SELECT count(*) FROM interactions"],
        vec!["compact"],
        vec!["export", "--sql", "SELECT * FROM samples", "--to", "hf", "--out", &out],
    ] {
        let stderr = assert_user_error(&args, dir.path(), "no lake at");
        assert!(stderr.contains("run `nextstate ingest` first or pass --lake"), "{args:?}: {stderr}");
    }
    assert!(!dir.path().join("lake").exists() && !dir.path().join("nolake").exists(), "a lake folder was created");
    // --pipeline names the lake
    std::fs::create_dir_all(dir.path().join("mine")).unwrap();
    std::fs::write(dir.path().join("p.toml"), "name = \"p\"\nmethod = \"binary\"\nlake = \"mine\"\n").unwrap();
    let (code, stdout, stderr) = run_with_stdin(&["sql", "--pipeline", "p.toml", "--format", "csv", "SELECT count(*) AS n FROM interactions"], dir.path(), "");
    assert_eq!((code, stdout.as_str()), (Some(0), "n\n0\n"), "{stderr}");
}

#[test]
fn sql_refuses_statements_that_write_and_reads_a_query_from_stdin() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("lake")).unwrap();
    let target = dir.path().join("x.csv");
    let copy = format!("COPY (SELECT 1) TO '{}'", target.display());
    let stderr = assert_user_error(&["sql", &copy], dir.path(), "only read-only queries run here");
    assert!(stderr.contains("COPY"), "{stderr}");
    assert!(!target.exists(), "COPY wrote {}", target.display());
    assert_user_error(&["export", "--sql", &copy, "--to", "hf", "--out", "o"], dir.path(), "only read-only queries run here");
    assert!(!target.exists());
    let (code, stdout, stderr) = run_with_stdin(&["sql", "--format", "csv", "-"], dir.path(), "SELECT 41 + 1 AS answer\n");
    assert_eq!((code, stdout.as_str()), (Some(0), "answer\n42\n"), "{stderr}");
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("lake")).unwrap();
    // far more than a pipe holds (64 KiB), so the writes meet the closed pipe
    let script = format!("set -o pipefail; '{}' sql --format csv 'SELECT * FROM generate_series(1, 200000)' | head -n 2", env!("CARGO_BIN_EXE_nextstate"));
    let out = Command::new("bash").arg("-c").arg(&script).current_dir(dir.path()).env_remove("NEXTSTATE_LAKE").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "value\n1\n");
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn an_os_error_is_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("lake")).unwrap();
    // a folder that cannot be created: its parent is a file
    std::fs::write(dir.path().join("file"), "").unwrap();
    let (ok, stderr) = run(&["export", "--sql", "SELECT 1 AS x", "--to", "hf", "--out", "file/out"], dir.path());
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("file/out"), "{stderr}");
    assert_eq!(stderr.matches("(os error").count(), 1, "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "colour codes in a pipe: {stderr}");
}
