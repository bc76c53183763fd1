//! `--format auto` on every real and synthetic file.

use crate::common::*;
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
