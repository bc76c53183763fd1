//! `--format auto` on every real and synthetic file.

use super::common::*;
use nextstate::ingest::{detect, read_path, Format, FormatChoice, IngestOptions, DEFAULT_HEAD_BYTES};

#[test]
fn every_fixture_is_detected() {
    let cases = [
        ("agentbench__medagentbench-std__gemini-2.0__error.jsonl", Format::AgentBench),
        ("mini-swe-agent__claude-sonnet-4__test_output.json", Format::MiniSweAgent),
        ("openhands__basic.json", Format::OpenHands),
        ("openhands__basic_interactions.json", Format::OpenHands),
        ("swe-agent__gpt4__pydicom__pydicom-1458.traj", Format::SweAgent),
        ("toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json", Format::ToolBench),
        ("synthetic__openclaw-records.jsonl", Format::OpenClaw),
        ("synthetic__openai-chat.jsonl", Format::OpenAiChat),
        ("synthetic__swe-agent-v1__object-state.traj", Format::SweAgent),
        ("synthetic__openhands__null-observations.json", Format::OpenHands),
        ("broken__tau-bench-truncated.json", Format::TauBench),
    ];
    for (f, want) in cases {
        assert_eq!(detect(&fixture(f), DEFAULT_HEAD_BYTES).unwrap().format, want, "{f}");
        // Small heads still work: the keys seen before the cut decide.
        assert_eq!(detect(&fixture(f), 400).unwrap().format, want, "{f} with a 400-byte head");
    }
    let Some(tau) = tau_bench() else { return };
    let d = detect(&tau, 4096).unwrap();
    assert_eq!(d.format, Format::TauBench);
    assert_eq!(d.to_string(), "tau-bench (array of objects with keys traj, task_id/reward)");
}

#[test]
fn auto_reports_its_choice() {
    let s = read_path(&fixture("openhands__basic.json"), FormatChoice::Auto, &IngestOptions::new(INGEST_MS), &mut |_| {}, &mut |_| Ok(())).unwrap();
    assert_eq!(s.format, Format::OpenHands);
    assert_eq!(s.detection.as_deref(), Some("openhands (array of events with keys source, action/observation)"));
    assert_eq!(s.line(), "openhands: 4 records, 26389 bytes → 2 interactions in 1 sessions, 0 dead letters");
}

/// Reads `bytes` (written to a temporary `.jsonl`) with `--format auto`: the detection line, the
/// interactions and the dead letters (reason, line).
fn auto(bytes: &[u8]) -> (String, Vec<nextstate::schema::Interaction>, Vec<(String, Option<i64>)>) {
    use std::io::Write as _;
    let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    f.write_all(bytes).unwrap();
    let (mut rows, mut dead) = (vec![], vec![]);
    let s = read_path(f.path(), FormatChoice::Auto, &IngestOptions::new(INGEST_MS), &mut |_| {}, &mut |item| {
        match item {
            nextstate::ingest::IngestItem::Interaction(i) => rows.push(*i),
            nextstate::ingest::IngestItem::DeadLetter(d) => dead.push((d.reason_code, d.source_line)),
        }
        Ok(())
    })
    .unwrap();
    (s.detection.unwrap_or_default(), rows, dead)
}

#[test]
fn a_bad_start_a_cut_end_or_a_byte_order_mark_loses_only_the_bad_lines() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-logs-2026/openclaw__session-v3__f967d602.jsonl");
    let clean = std::fs::read(&path).unwrap();
    let (d, rows, dead) = auto(&clean);
    assert!(d.starts_with("openclaw-session (session header"), "{d}");
    assert_eq!((rows.len(), dead.len()), (8, 0), "the clean file: 8 turns");
    let text = |r: &[nextstate::schema::Interaction]| r.iter().map(|i| i.response_text.clone()).collect::<Vec<_>>();

    // Stray bytes before the first record (a terminal escape, a NUL, text): line 1 is a dead letter,
    // detection reads the next records, every turn is kept (the header gives only the working folder).
    let mut stray = b"\x00\x1b[0mgarbage ".to_vec();
    stray.extend_from_slice(&clean);
    let (d, rows_stray, dead) = auto(&stray);
    assert!(d.starts_with("openclaw-session (") && d.ends_with(", from line 2 (the lines before it are not records of a known format))"), "{d}");
    assert_eq!(dead, [("malformed_json".to_string(), Some(1))]);
    assert_eq!(text(&rows_stray), text(&rows));

    // A whole garbage line first, then a blank line.
    let mut junk = b"<html>not json</html>\n\n".to_vec();
    junk.extend_from_slice(&clean);
    let (d, rows_junk, dead) = auto(&junk);
    assert!(d.ends_with("from line 3 (the lines before it are not records of a known format))"), "{d}");
    assert_eq!(dead, [("malformed_json".to_string(), Some(1))]);
    assert_eq!(text(&rows_junk), text(&rows));

    // A byte-order mark: nothing lost, nothing dead.
    let mut bom = nextstate::ingest::UTF8_BOM.to_vec();
    bom.extend_from_slice(&clean);
    let (d, rows_bom, dead) = auto(&bom);
    assert!(d.starts_with("openclaw-session (session header"), "{d}");
    assert_eq!((text(&rows_bom), dead.len()), (text(&rows), 0));

    // The last line cut mid-record (a writer killed mid-write): that line is a dead letter.
    let lines = clean.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count();
    let cut = &clean[..clean.len() - 40];
    let (_, rows_cut, dead) = auto(cut);
    assert_eq!(dead, [("malformed_json".to_string(), Some(lines as i64))]);
    assert!(rows_cut.len() <= rows.len() && !rows_cut.is_empty());

    // Nothing recognisable at all: the error names the first value's keys and the lines tried.
    let e = nextstate::ingest::detect_bytes(b"garbage\n{\"a\": 1}\n{\"b\": 2}\n").unwrap_err().to_string();
    assert!(e.contains("cannot detect the log format") && e.contains("(also tried the next 2 lines that start a JSON value)"), "{e}");
}
