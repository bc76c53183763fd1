//! Malformed input never panics: it becomes dead letters with reasons.

use std::io::Write;

use proptest::prelude::*;

use super::common::*;
use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};

fn tmp(bytes: &[u8], suffix: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(suffix).tempfile().unwrap();
    f.write_all(bytes).unwrap();
    f
}

fn run(bytes: &[u8], format: Format, opts: &IngestOptions) -> (usize, Vec<(String, String)>) {
    let f = tmp(bytes, ".log");
    let mut rows = 0;
    let mut dead = vec![];
    read_file(f.path(), format, opts, &mut |_| {}, &mut |item| {
        match item {
            IngestItem::Interaction(_) => rows += 1,
            IngestItem::DeadLetter(d) => dead.push((d.reason_code, d.reason)),
        }
        Ok(())
    })
    .unwrap();
    (rows, dead)
}

#[test]
fn broken_documents_are_dead_lettered() {
    let o = IngestOptions::new(INGEST_MS);
    let (n, d) = run(b"{\"trajectory\": [", Format::SweAgent, &o);
    assert_eq!((n, d[0].0.as_str()), (0, "malformed_json"));
    let (_, d) = run(b"[1, 2]", Format::SweAgent, &o);
    assert_eq!(d[0], ("wrong_type".to_string(), "document is a JSON array, expected an object".to_string()));
    let (_, d) = run(b"{\"history\": null, \"info\": {}}", Format::SweAgent, &o);
    assert_eq!(d[0].0, "null_history");
    let (_, d) = run(b"{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}], \"info\": {}}", Format::MiniSweAgent, &o);
    assert_eq!(d[0], ("unknown_role".to_string(), "message 0: unknown message role \"wizard\"".to_string()));
    let (_, d) = run(b"{\"answer_generation\": {\"train_messages\": []}}", Format::ToolBench, &o);
    assert_eq!(d[0].0, "no_train_messages");
    let (_, d) = run(b"{\"task_id\": 1}", Format::TauBench, &o);
    assert_eq!(d[0].0, "wrong_type");
    let (_, d) = run(b"[{\"task_id\": 1, \"traj\": \"oops\"}, 5]", Format::TauBench, &o);
    assert_eq!(d.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(), vec!["wrong_type", "wrong_type"]);
    let (_, d) = run(b"", Format::TauBench, &o);
    assert_eq!(d[0].0, "malformed_json");
    let (_, d) = run(b"[{\"id\": 1, \"source\": \"user\", \"action\": \"message\"", Format::OpenHands, &o);
    assert_eq!(d[0].0, "malformed_json");
}

#[test]
fn jsonl_line_problems_are_per_line() {
    let o = IngestOptions { max_line_bytes: 120, ..IngestOptions::new(INGEST_MS) };
    let mut bytes = b"{\"request\": {\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}, \"response\": {}}\n".to_vec();
    bytes.extend_from_slice(format!("{{\"request\": {{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}}}\n", "x".repeat(200)).as_bytes());
    bytes.extend_from_slice(b"{\"request\": {\"messages\": []}, \"response\": {\"choices\": []}}\r\n");
    let (n, d) = run(&bytes, Format::OpenAiChat, &o);
    assert_eq!(n, 0);
    assert_eq!(d.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(), vec!["malformed_json", "line_too_long", "missing_choices"]);
    assert!(d[1].1.starts_with("line of 261 bytes is over the 120-byte limit"), "{}", d[1].1);
}

#[test]
fn documents_over_the_limit_are_dead_lettered_without_reading_them() {
    let o = IngestOptions { max_document_bytes: 1000, ..IngestOptions::new(INGEST_MS) };
    let f = fixture("mini-swe-agent__claude-sonnet-4__test_output.json");
    let mut dead = vec![];
    let s = read_file(&f, Format::MiniSweAgent, &o, &mut |_| {}, &mut |i| {
        if let IngestItem::DeadLetter(d) = i {
            dead.push(*d);
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason_code, "document_too_large");
    assert_eq!(dead[0].reason, "12454 bytes is over the single-document limit of 1000 bytes (payload: first bytes)");
    assert_eq!(s.interactions, 0);
}

#[test]
fn callback_errors_stop_the_read() {
    let o = IngestOptions::new(INGEST_MS);
    let Some(tau) = tau_bench() else { return };
    let r = read_file(&tau, Format::TauBench, &o, &mut |_| {}, &mut |_| Err(nextstate::Error::Cancelled));
    assert!(matches!(r, Err(nextstate::Error::Cancelled)));
}

/// A raised stop flag ends a read between records with `Cancelled`: nothing after the record being
/// read when it was raised is handed on.
#[test]
fn a_raised_stop_flag_ends_the_read_between_records() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut bytes = vec![];
    for t in 0..100 {
        let line = serde_json::json!({
            "headers": {"X-Session-Id": "s"},
            "request": {"messages": [{"role": "user", "content": format!("q{t}")}]},
            "response": {"choices": [{"message": {"role": "assistant", "content": format!("a{t}")}}]},
        });
        bytes.extend_from_slice(format!("{line}\n").as_bytes());
    }
    let f = tmp(&bytes, ".jsonl");
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let o = IngestOptions { stop: Some(stop.clone()), ..IngestOptions::new(INGEST_MS) };
    let mut got = 0;
    let r = read_file(f.path(), Format::OpenAiChat, &o, &mut |_| {}, &mut |_| {
        got += 1;
        if got == 10 {
            stop.store(true, Ordering::Relaxed);
        }
        Ok(())
    });
    assert!(matches!(r, Err(nextstate::Error::Cancelled)), "{r:?}");
    assert_eq!(got, 10);
    // Not raised: all 100 turns.
    let (n, d) = run(&bytes, Format::OpenAiChat, &IngestOptions::new(INGEST_MS));
    assert_eq!((n, d.len()), (100, 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Any prefix of a real file, read in any format, gives Ok (items or dead letters), never a panic.
    #[test]
    fn truncated_real_files_never_panic(cut in 0.0f64..1.0, fmt in 0usize..8, file in 0usize..6) {
        let files = [
            "mini-swe-agent__claude-sonnet-4__test_output.json",
            "swe-agent__gpt4__pydicom__pydicom-1458.traj",
            "openhands__basic.json",
            "toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json",
            "synthetic__openai-chat.jsonl",
            "synthetic__openclaw-records.jsonl",
        ];
        let bytes = std::fs::read(fixture(files[file])).unwrap();
        let n = (bytes.len() as f64 * cut) as usize;
        let o = IngestOptions::new(INGEST_MS);
        run(&bytes[..n], Format::ALL[fmt], &o);
    }

    /// Arbitrary bytes in any format never panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), fmt in 0usize..8) {
        run(&bytes, Format::ALL[fmt], &IngestOptions::new(INGEST_MS));
    }
}

/// A 100 MB tau-bench-shaped array (the real file's 200 sessions repeated 25 times) is read element by
/// element: peak memory stays near one session plus the caller's own data. Slow in debug builds, so
/// ignored by default; run with `--ignored` under `/usr/bin/time -v` to see the peak resident size.
#[test]
#[ignore]
fn large_arrays_stream() {
    let Some(tau) = tau_bench() else { return };
    let raw = std::fs::read(tau).unwrap();
    let body = &raw[raw.iter().position(|&b| b == b'[').unwrap() + 1..raw.iter().rposition(|&b| b == b']').unwrap()];
    let mut f = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    f.write_all(b"[").unwrap();
    for i in 0..25 {
        if i > 0 {
            f.write_all(b",").unwrap();
        }
        f.write_all(body).unwrap();
    }
    f.write_all(b"]").unwrap();
    f.flush().unwrap();
    drop(raw);
    let mut n = 0u64;
    let s = read_file(f.path(), Format::TauBench, &IngestOptions::new(INGEST_MS), &mut |_| {}, &mut |_| {
        n += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!((n, s.interactions, s.records), (25 * 2454, 25 * 2454, 25 * 200));
    assert!(s.bytes > 100_000_000);
}
