//! Bad input *files* given to `nextstate ingest` (issue 38, "nothing valid lost"): a file no format
//! matches, a path that does not exist, a FIFO, corrupt compressed data, a turn over the bus's record
//! limit, and a stop request while a long file is read. Each test runs the binary on the embedded bus
//! with its lake sinks and reads the lake back.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::lake::Lake;
use nextstate::schema::{DeadLetter, Interaction};

use super::common;

/// One openai-chat log line: session `session`, turn `turn`, a response of `response` (its text).
fn chat_line(session: &str, turn: usize, response: &str) -> String {
    serde_json::json!({
        "headers": {"X-Session-Id": session},
        "request": {"model": "m", "messages": [{"role": "user", "content": format!("question {turn} of {session}")}]},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": response}, "finish_reason": "stop"}]},
    })
    .to_string()
}

/// Writes an openai-chat log of `turns` turns of session `session` to `path`.
fn chat_log(path: &Path, session: &str, turns: usize) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for t in 0..turns {
        writeln!(f, "{}", chat_line(session, t, &format!("answer {t}"))).unwrap();
    }
    f.flush().unwrap();
}

/// The interaction ids the adapter gives for `path` (what must reach the lake).
fn ids_of(path: &Path) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    read_file(path, Format::OpenAiChat, &IngestOptions::new(1_772_400_000_000), &mut |_| {}, &mut |item| {
        if let IngestItem::Interaction(i) = item {
            ids.insert(i.interaction_id);
        }
        Ok(())
    })
    .unwrap();
    ids
}

fn mkfifo(path: &Path) {
    assert!(std::process::Command::new("mkfifo").arg(path).status().unwrap().success(), "mkfifo {}", path.display());
}

/// Runs `nextstate ingest --lake <dir>/lake ARGS...` to completion (at most `limit`); returns its exit
/// status, its output (stdout and stderr) and the time it took.
fn ingest(dir: &Path, name: &str, args: &[&str], limit: Duration) -> (std::process::ExitStatus, String, Duration) {
    let lake = dir.join("lake").display().to_string();
    let mut a = common::args(&["ingest", "--lake", &lake]);
    a.extend(args.iter().map(|s| s.to_string()));
    let log = dir.join(format!("{name}.log"));
    let t = Instant::now();
    let mut p = common::Proc::spawn(name, &a, &log);
    let status = p.wait_for(limit);
    let took = t.elapsed();
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("{name}: still running after {limit:?}\n{}", p.log_tail(40)));
    (status, out, took)
}

fn lake_rows(dir: &Path) -> (Vec<Interaction>, Vec<DeadLetter>) {
    let lake = Lake::open(dir.join("lake")).unwrap();
    (lake.read_table().unwrap(), lake.read_table().unwrap())
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `ingest good.jsonl unknown.json missing.jsonl fifo.jsonl corrupt.jsonl.gz good2.jsonl`: every turn of
/// both good files reaches the lake, each bad path is one dead letter naming it with its reason, the FIFO
/// is refused without blocking, and the summary counts files read and skipped by reason. Before issue 38
/// the command stopped at `unknown.json` and nothing reached the lake.
#[test]
fn bad_files_between_good_ones_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (good, good2) = (d.join("good.jsonl"), d.join("good2.jsonl"));
    chat_log(&good, "s-good", 5);
    chat_log(&good2, "s-good2", 7);
    let unknown = d.join("unknown.json");
    std::fs::write(&unknown, br#"{"not": "an agent log", "n": 1}"#).unwrap();
    let missing = d.join("missing.jsonl");
    let fifo = d.join("fifo.jsonl");
    mkfifo(&fifo);
    let corrupt = d.join("corrupt.jsonl.gz");
    std::fs::write(&corrupt, b"\x1f\x8b\x08\x00 this is not deflate data at all").unwrap();
    let want: BTreeSet<String> = ids_of(&good).into_iter().chain(ids_of(&good2)).collect();
    assert_eq!(want.len(), 12);

    let (status, out, _) = ingest(d, "ingest-bad-files", &[&s(&good), &s(&unknown), &s(&missing), &s(&fifo), &s(&corrupt), &s(&good2)], Duration::from_secs(120));
    assert!(status.success(), "ingest failed: {status:?}\n{out}");
    assert!(
        out.contains("ingest: files=6 read=2 skipped=4 (file_not_found=1 not_a_regular_file=1 undetected_format=1 unreadable_file=1) interactions=12 dead_letters=4 (file_not_found=1 not_a_regular_file=1 undetected_format=1 unreadable_file=1)"),
        "summary line:\n{out}"
    );
    let (rows, dead) = lake_rows(d);
    let got: BTreeSet<String> = rows.iter().map(|r| r.interaction_id.clone()).collect();
    assert_eq!(rows.len(), 12, "each turn once");
    assert_eq!(got, want, "the good files' turns in the lake");
    let mut dead: Vec<(String, String)> = dead.iter().map(|x| (x.reason_code.clone(), x.source_file.clone().unwrap_or_default())).collect();
    dead.sort();
    assert_eq!(
        dead,
        vec![
            ("file_not_found".to_string(), s(&missing)),
            ("not_a_regular_file".to_string(), s(&fifo)),
            ("undetected_format".to_string(), s(&unknown)),
            ("unreadable_file".to_string(), s(&corrupt)),
        ]
    );
}

/// A FIFO named on the command line is refused from its metadata (never opened: `open()` of a FIFO
/// without a writer blocks) even with a fixed `--format`, and the command ends at once. Before, it hung
/// in `open()` until a writer came.
#[test]
fn a_fifo_argument_is_refused_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fifo = d.join("pipe.jsonl");
    mkfifo(&fifo);
    let good = d.join("good.jsonl");
    chat_log(&good, "s-fifo", 3);
    let (status, out, took) = ingest(d, "ingest-fifo", &["--format", "openai-chat", &s(&fifo), &s(&good)], Duration::from_secs(60));
    assert!(status.success(), "ingest failed: {status:?}\n{out}");
    assert!(out.contains("a FIFO (named pipe), not a regular file: refused without opening it"), "{out}");
    assert!(out.contains("ingest: files=2 read=1 skipped=1 (not_a_regular_file=1) interactions=3 dead_letters=1 (not_a_regular_file=1)"), "{out}");
    let (rows, dead) = lake_rows(d);
    assert_eq!(rows.len(), 3);
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].reason_code.as_str(), dead[0].source_file.as_deref()), ("not_a_regular_file", Some(s(&fifo).as_str())));
    eprintln!("ingest with a FIFO argument took {took:?}");
}

/// A turn whose bus record is over the embedded bus's 2 MiB limit is a `record_too_large` dead letter
/// that names its source file and line, and the file's own line agrees with the totals (before issue
/// 38 the dead letter had no source and the file's line still counted the turn as an interaction).
#[test]
fn an_oversize_turn_is_dead_lettered_with_its_source_and_the_counts_agree() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let log = d.join("big.jsonl");
    let huge = "x".repeat(3 << 20);
    let lines = [chat_line("s-big", 0, "small 0"), chat_line("s-big", 1, &huge), chat_line("s-big", 2, "small 2")];
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    let (status, out, _) = ingest(d, "ingest-oversize", &["--format", "openai-chat", &s(&log)], Duration::from_secs(120));
    assert!(status.success(), "ingest failed: {status:?}\n{out}");
    assert!(out.contains(&format!("{}: openai-chat: 3 records, {} bytes → 2 interactions in 1 sessions, 1 dead letters", s(&log), std::fs::metadata(&log).unwrap().len())), "file line:\n{out}");
    assert!(out.contains("ingest: files=1 read=1 skipped=0 interactions=2 dead_letters=1 (record_too_large=1)"), "summary line:\n{out}");
    let (rows, dead) = lake_rows(d);
    let mut turns: Vec<i32> = rows.iter().map(|r| r.turn_index).collect();
    turns.sort();
    assert_eq!(turns, vec![0, 2]);
    assert_eq!(dead.len(), 1);
    let dl = &dead[0];
    assert_eq!(dl.reason_code, "record_too_large");
    assert_eq!(dl.source_file.as_deref(), Some(s(&log).as_str()));
    assert_eq!(dl.source_line, Some(2));
    assert_eq!(dl.session_id, "s-big");
    assert!(dl.reason.contains("over the bus's record limit of 2097152 bytes"), "{}", dl.reason);
}

/// On a real cluster the record limit is `[bus] max_message_bytes`: set to 100,000 bytes, a 200 KB turn
/// is a `record_too_large` dead letter with its source that keeps a quarter of the limit as payload (the
/// fixed 256 KiB head would itself be refused, which stopped the whole ingest).
#[test]
fn the_record_limit_of_a_real_cluster_is_bus_max_message_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pipeline = d.join("small-records.toml");
    std::fs::write(&pipeline, "name = \"small-records\"\nmethod = \"binary\"\n[bus]\nmax_message_bytes = 100000\n").unwrap();
    let log = d.join("wide.jsonl");
    let wide = "w".repeat(200_000);
    let lines = [chat_line("s-wide", 0, "small 0"), chat_line("s-wide", 1, &wide), chat_line("s-wide", 2, "small 2")];
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    let (brokers, prefix) = (common::brokers(), common::prefix());
    let args = ["--pipeline", &s(&pipeline), "--brokers", &brokers, "--topic-prefix", &prefix, "--format", "openai-chat", &s(&log)];
    let (status, out, _) = ingest(d, "ingest-broker-limit", &args, Duration::from_secs(120));
    assert!(status.success(), "ingest failed: {status:?}\n{out}");
    assert!(out.contains("interactions=2 dead_letters=1 (record_too_large=1)"), "{out}");
    let (rows, dead) = lake_rows(d);
    assert_eq!(rows.len(), 2);
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].source_file.as_deref(), dead[0].source_line), (Some(s(&log).as_str()), Some(2)));
    assert!(dead[0].reason.contains("over the bus's record limit of 100000 bytes (payload: first 25000 bytes)"), "{}", dead[0].reason);
    assert_eq!(dead[0].payload.len(), 25_000);
}

/// SIGTERM while a long file is read ends `ingest` within a second or two: the reader checks the stop
/// flag between records, what was produced is flushed, the summary says it was stopped and the exit
/// status is not success. Before, the reader read on to the end of the file (tens of seconds here).
#[test]
fn sigterm_ends_ingest_of_a_long_file_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let big = long_log(d);
    let log = d.join("ingest-term.log");
    let lake = s(&d.join("lake"));
    let mut p = common::Proc::spawn("ingest-term", &common::args(&["ingest", "--lake", &lake, "--format", "openai-chat", &s(&big)]), &log);
    wait_reading(&mut p, &big);
    let t = Instant::now();
    p.term();
    let status = p.wait_for(Duration::from_secs(10));
    let took = t.elapsed();
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("still running 10 s after SIGTERM\n{}", p.log_tail(30)));
    assert!(took < Duration::from_secs(2), "ingest took {took:?} to stop after SIGTERM\n{}", p.log_tail(30));
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("stopped=signal"), "{out}");
    assert!(out.contains("stopped by a signal before every input was read"), "{out}");
    let done: u64 = out.lines().find_map(|l| l.strip_prefix("ingest: ")).and_then(|l| l.split(' ').find_map(|w| w.strip_prefix("interactions="))).and_then(|n| n.parse().ok()).unwrap();
    assert!(done < LONG_TURNS as u64, "it read the whole file ({done} turns) before stopping");
}

/// A second SIGTERM while the first one is being honoured exits at once with status 130.
#[test]
fn a_second_signal_forces_exit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let big = long_log(d);
    let log = d.join("ingest-term2.log");
    let lake = s(&d.join("lake"));
    let mut p = common::Proc::spawn("ingest-term2", &common::args(&["ingest", "--lake", &lake, "--format", "openai-chat", &s(&big)]), &log);
    wait_reading(&mut p, &big);
    p.term();
    std::thread::sleep(Duration::from_millis(20));
    p.term();
    let status = p.wait_for(Duration::from_secs(10)).unwrap_or_else(|| panic!("still running 10 s after two SIGTERMs\n{}", p.log_tail(30)));
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    // The first stop may already have finished when the second signal comes (then exit status 1).
    if status.code() == Some(130) {
        assert!(out.contains("second stop signal: exiting now"), "{out}");
    } else {
        assert_eq!(status.code(), Some(1), "{out}");
        assert!(out.contains("stopped=signal"), "{out}");
    }
}

const LONG_TURNS: usize = 300_000;

/// A ~100 MB openai-chat log of [`LONG_TURNS`] turns (far longer than a second to ingest).
fn long_log(d: &Path) -> PathBuf {
    let path = d.join("long.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let pad = "y".repeat(200);
    for t in 0..LONG_TURNS {
        writeln!(f, "{}", chat_line(&format!("s-{}", t / 50), t % 50, &format!("answer {t} {pad}"))).unwrap();
    }
    f.flush().unwrap();
    path
}

/// Waits (up to 60 s) until `p` has started reading `file` and produced its first records.
fn wait_reading(p: &mut common::Proc, file: &Path) {
    let want = format!("{}: format openai-chat", file.display());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&p.log).unwrap_or_default().contains(&want) {
        assert!(p.exited().is_none(), "ingest exited early\n{}", p.log_tail(30));
        assert!(Instant::now() < deadline, "ingest did not start reading within 60 s\n{}", p.log_tail(30));
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
}
