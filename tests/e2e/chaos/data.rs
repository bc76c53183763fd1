//! Test data of the chaos tests: short synthetic chat sessions (openai-chat JSONL, written here) next
//! to real agent logs from the fixtures, and what ingesting them must give.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::schema::TurnType;
use serde_json::json;

/// One synthetic session of three short turns: a question answered right (the user thanks and asks
/// the next one: PRM +1), a wrong answer (the user asks for a redo: −1), then a last answer after which
/// the session is done (no next state: excluded).
fn session_lines(s: usize, t0: i64) -> Vec<String> {
    let (a, b) = (s % 7 + 2, s % 5 + 3);
    let system = json!({"role": "system", "content": "You are a concise math tutor."});
    let q1 = json!({"role": "user", "content": format!("What is {a} + {b}?")});
    let r1 = json!({"role": "assistant", "content": format!("{a} + {b} = {}.", a + b)});
    let q2 = json!({"role": "user", "content": format!("Thanks, that is right! Now what is {a} times {b}?")});
    let r2 = json!({"role": "assistant", "content": format!("{a} times {b} is {}.", a * b + 1)});
    let q3 = json!({"role": "user", "content": "No, that's wrong. Please redo it."});
    let r3 = json!({"role": "assistant", "content": format!("Sorry: {a} times {b} is {}.", a * b)});
    let line = |i: i64, msgs: Vec<serde_json::Value>, resp: &serde_json::Value, done: bool| {
        let mut headers = json!({"x-session-id": format!("math-{s}")});
        if done {
            headers["x-session-done"] = json!("1");
        }
        json!({
            "headers": headers,
            "request": {"model": "policy", "messages": msgs},
            "response": {"object": "chat.completion", "created": t0 + 60 * i, "model": "policy",
                "choices": [{"index": 0, "message": resp, "finish_reason": "stop"}]},
        })
        .to_string()
    };
    vec![
        line(0, vec![system.clone(), q1.clone()], &r1, false),
        line(1, vec![system.clone(), q1.clone(), r1.clone(), q2.clone()], &r2, false),
        line(2, vec![system, q1, r1, q2, r2, q3], &r3, true),
    ]
}

/// Writes `sessions` synthetic sessions to `dir/synthetic-math.jsonl` (3 turns each) and returns the
/// files to ingest: that file plus real fixture logs (`real`: mini-swe-agent, OpenHands, ToolBench,
/// whose long prompts the teacher dead-letters as `too_long` under a small `[teacher] max_tokens`).
pub fn write_inputs(dir: &Path, sessions: usize, real: bool) -> Vec<PathBuf> {
    let t0 = 1_772_400_000; // 2026-03-01, seconds
    let mut text = String::new();
    for s in 0..sessions {
        for l in session_lines(s, t0 + 3600 * s as i64) {
            text.push_str(&l);
            text.push('\n');
        }
    }
    let synthetic = dir.join("synthetic-math.jsonl");
    std::fs::write(&synthetic, text).expect("write synthetic sessions");
    let mut files = vec![synthetic];
    if real {
        let fixtures = super::common::root().join("tests/fixtures/agent-logs");
        for f in ["mini-swe-agent__claude-sonnet-4__test_output.json", "openhands__basic_interactions.json", "toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json"] {
            files.push(fixtures.join(f));
        }
    }
    files
}

/// What ingesting the files must give, computed with the ingest adapters directly (no bus).
#[derive(Debug, Default)]
pub struct Expected {
    /// Every interaction id.
    pub interactions: BTreeSet<String>,
    /// Interaction ids of main turns (each gets exactly one signal).
    pub main: BTreeSet<String>,
    /// Dead-letter ids of the ingest stage.
    pub ingest_dead: BTreeSet<String>,
    /// Interactions per file (for the report).
    pub per_file: BTreeMap<String, usize>,
}

/// Reads `files` (format auto-detected) as `nextstate ingest` does.
pub fn expected(files: &[PathBuf]) -> Expected {
    let mut e = Expected::default();
    for f in files {
        let format: Format = nextstate::ingest::detect(f, nextstate::ingest::DEFAULT_HEAD_BYTES).expect("detect").format;
        let mut n = 0;
        read_file(f, format, &IngestOptions::new(0), &mut |_| {}, &mut |item| {
            match item {
                IngestItem::Interaction(i) => {
                    n += 1;
                    if i.turn_type == TurnType::Main {
                        e.main.insert(i.interaction_id.clone());
                    }
                    e.interactions.insert(i.interaction_id.clone());
                }
                IngestItem::DeadLetter(d) => {
                    e.ingest_dead.insert(d.dead_letter_id.clone());
                }
            }
            Ok(())
        })
        .expect("read input");
        e.per_file.insert(f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), n);
    }
    e
}
