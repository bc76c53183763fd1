//! The corpus of malformed and hostile log inputs: each case is one file in one format, holding the
//! bad record(s) and, where the format has several records per file, good records around them that
//! must come through untouched.

use serde_json::json;

/// One corpus file.
pub struct Case {
    /// Name (also the file name, with `ext`).
    pub name: &'static str,
    /// Extension (formats are auto-detected from content; a few by extension).
    pub ext: &'static str,
    /// `--format` (`auto` for detection).
    pub format: &'static str,
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// Interactions the good records must give.
    pub interactions: usize,
    /// Dead-letter reason codes it must give (sorted).
    pub dead: Vec<&'static str>,
    /// A note the kept bad record must carry (its bad field removed), if it is kept.
    pub note: Option<&'static str>,
}

fn chat_line(session: &str, user: &str, answer: &str) -> String {
    json!({"headers": {"x-session-id": session},
        "request": {"model": "m", "messages": [{"role": "user", "content": user}]},
        "response": {"object": "chat.completion", "created": 1772400000, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}})
    .to_string()
}

/// A chat line whose response carries `token_ids` and the raw text `logprobs_json` as its
/// `choices[0].logprobs.content` (so non-JSON numbers such as `NaN` can be written).
fn chat_line_with_logprobs(session: &str, token_ids: &str, logprobs_json: &str) -> String {
    format!(
        r#"{{"headers": {{"x-session-id": "{session}"}}, "request": {{"messages": [{{"role": "user", "content": "count"}}]}}, "response": {{"created": 1772400000, "choices": [{{"index": 0, "message": {{"role": "assistant", "content": "one two"}}, "finish_reason": "stop", "token_ids": {token_ids}, "logprobs": {{"content": {logprobs_json}}}}}]}}}}"#
    )
}

fn lines(ls: &[String]) -> Vec<u8> {
    let mut s = ls.join("\n");
    s.push('\n');
    s.into_bytes()
}

fn nested(depth: usize) -> String {
    format!("{}{}", "[".repeat(depth), "]".repeat(depth))
}

/// Every case. Good lines are `good-*` sessions of one turn each.
pub fn cases() -> Vec<Case> {
    let good = |i: usize| chat_line(&format!("good-{i}"), &format!("question {i}"), &format!("answer {i}"));
    let mut v = vec![];
    // --- JSONL (openai-chat): one bad line between good lines each.
    let jsonl_note = |name: &'static str, bad: Vec<u8>, interactions: usize, dead: Vec<&'static str>, note: Option<&'static str>| {
        let mut b = lines(&[good(1)]);
        b.extend_from_slice(&bad);
        b.push(b'\n');
        b.extend(lines(&[good(2)]));
        Case { name, ext: "jsonl", format: "openai-chat", bytes: b, interactions: interactions + 2, dead, note }
    };
    let jsonl = |name: &'static str, bad: Vec<u8>, interactions: usize, dead: Vec<&'static str>| jsonl_note(name, bad, interactions, dead, None);
    let full = chat_line("s", "hello", "hi");
    v.push(jsonl("truncated-json-line", full.as_bytes()[..full.len() / 2].to_vec(), 0, vec!["malformed_json"]));
    v.push(jsonl("messages-not-a-list", br#"{"request": {"messages": "hello"}, "response": {"choices": [{"message": {"role": "assistant", "content": "x"}}]}}"#.to_vec(), 0, vec!["missing_messages"]));
    v.push(jsonl("content-is-a-number", br#"{"request": {"messages": [{"role": "user", "content": 5}]}, "response": {"choices": [{"message": {"role": "assistant", "content": "x"}}]}}"#.to_vec(), 0, vec!["wrong_type"]));
    v.push(jsonl("response-not-an-object", br#"{"request": {"messages": [{"role": "user", "content": "hi"}]}, "response": [1, 2]}"#.to_vec(), 0, vec!["wrong_type"]));
    v.push(jsonl("line-is-an-array", b"[1, 2, 3]".to_vec(), 0, vec!["wrong_type"]));
    v.push(jsonl("line-is-null", b"null".to_vec(), 0, vec!["wrong_type"]));
    v.push(jsonl("deep-nesting", format!(r#"{{"request": {{"messages": [{{"role": "user", "content": {}}}]}}}}"#, nested(100_000)).into_bytes(), 0, vec!["malformed_json"]));
    v.push(jsonl("invalid-utf8", b"{\"request\": {\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9 \xff\"}]}, \"response\": {}}".to_vec(), 0, vec!["malformed_json"]));
    v.push(jsonl("nul-bytes", b"{\"request\": \0\0\0}".to_vec(), 0, vec!["malformed_json"]));
    v.push(jsonl("nan-logprob", chat_line_with_logprobs("nan", "[11, 12]", r#"[{"token": "one", "logprob": NaN}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 0, vec!["malformed_json"]));
    v.push(jsonl("infinity-logprob", chat_line_with_logprobs("inf", "[11, 12]", r#"[{"token": "one", "logprob": -Infinity}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 0, vec!["malformed_json"]));
    v.push(jsonl("overflowing-logprob", chat_line_with_logprobs("big", "[11, 12]", r#"[{"token": "one", "logprob": -1e999}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 0, vec!["malformed_json"]));
    // Kept: the turn's text is fine; its bad token data is removed with a note (the teacher stage
    // recomputes rollout log-probs).
    let lp = "log-probs without a numeric logprob";
    v.push(jsonl_note("string-nan-logprob", chat_line_with_logprobs("snan", "[11, 12]", r#"[{"token": "one", "logprob": "NaN"}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 1, vec![], Some(lp)));
    v.push(jsonl_note("f32-infinite-logprob", chat_line_with_logprobs("f32inf", "[11, 12]", r#"[{"token": "one", "logprob": -1e300}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 1, vec![], Some("non-finite log-prob")));
    v.push(jsonl_note("mismatched-token-logprob-lengths", chat_line_with_logprobs("mm", "[11, 12, 13]", r#"[{"token": "one", "logprob": -1.0}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 1, vec![], Some("2 log-probs for 3 token ids")));
    v.push(jsonl_note("negative-token-id", chat_line_with_logprobs("neg", "[-5, 12]", r#"[{"token": "one", "logprob": -1.0}, {"token": " two", "logprob": -0.5}]"#).into_bytes(), 1, vec![], Some("negative token id")));
    v.push(jsonl("unknown-role", br#"{"request": {"messages": [{"role": "wizard", "content": "abracadabra"}]}, "response": {"choices": [{"message": {"role": "assistant", "content": "x"}}]}}"#.to_vec(), 0, vec!["unknown_role"]));
    v.push(jsonl("duplicate-turn", lines(&[chat_line("dup", "same question", "same answer"), chat_line("dup", "same question", "same answer")]), 1, vec!["duplicate_turn"]));
    v.push(jsonl("huge-message-6mb", chat_line("huge", &"x".repeat(6 << 20), "ok").into_bytes(), 1, vec![]));
    // --- OpenClaw records.
    let oc = |session: &str, turn: serde_json::Value, user: &str| {
        json!({"session_id": session, "turn": turn, "timestamp": "2026-03-01 10:00:00",
            "messages": [{"role": "user", "content": user}], "prompt_text": user, "response_text": "ok", "tool_calls": null, "next_state": null})
        .to_string()
    };
    let mut mismatched: serde_json::Value = serde_json::from_str(&oc("oc-6", json!(1), "tokens")).unwrap();
    mismatched["response_token_ids"] = json!([5, 6, 7]);
    mismatched["rollout_logprobs"] = json!([-0.5, -0.25]);
    v.push(Case {
        name: "openclaw-wrong-types-and-duplicate-turn",
        ext: "jsonl",
        format: "openclaw",
        bytes: lines(&[
            oc("oc-1", json!(1), "first"),
            oc("oc-1", json!(1), "first, but logged twice with other text"),
            oc("oc-2", json!("one"), "turn is a string"),
            json!({"session_id": "oc-3", "turn": 1, "messages": {"role": "user"}, "response_text": "ok"}).to_string(),
            json!({"session_id": "oc-4", "turn": 1, "messages": [{"role": "user", "content": "x"}], "response_text": 42}).to_string(),
            oc("oc-5", json!(2), "fine"),
            mismatched.to_string(),
        ]),
        interactions: 4,
        dead: vec!["duplicate_turn", "missing_messages", "wrong_type"],
        note: Some("2 log-probs for 3 token ids"),
    });
    // --- Whole-document formats.
    let doc = |name: &'static str, ext: &'static str, format: &'static str, bytes: Vec<u8>, dead: Vec<&'static str>| Case { name, ext, format, bytes, interactions: 0, dead, note: None };
    v.push(doc("swe-agent-truncated", "traj", "swe-agent", br#"{"environment": "swe", "trajectory": [{"action": "ls", "observation": "a"#.to_vec(), vec!["malformed_json"]));
    v.push(doc("swe-agent-history-wrong-type", "traj", "swe-agent", br#"{"environment": "swe", "history": {"role": "user"}, "info": {}}"#.to_vec(), vec!["wrong_type"]));
    v.push(doc("swe-agent-deep-nesting", "traj", "swe-agent", format!(r#"{{"history": {}}}"#, nested(50_000)).into_bytes(), vec!["malformed_json"]));
    v.push(doc("mini-swe-agent-invalid-utf8", "json", "mini-swe-agent", b"{\"info\": {}, \"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}".to_vec(), vec!["malformed_json"]));
    v.push(doc("mini-swe-agent-unknown-role", "json", "mini-swe-agent", br#"{"info": {}, "messages": [{"role": "system", "content": "s"}, {"role": "oracle", "content": "x"}, {"role": "assistant", "content": "y"}]}"#.to_vec(), vec!["unknown_role"]));
    v.push(doc("openhands-wrong-types", "json", "openhands", br#"[{"id": "one", "source": 5, "action": ["message"]}, 7, null]"#.to_vec(), vec!["wrong_type"]));
    v.push(doc("tau-bench-truncated", "json", "tau-bench", br#"[{"task_id": 1, "traj": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "#.to_vec(), vec!["malformed_json"]));
    v.push(doc("toolbench-wrong-types", "json", "toolbench", br#"{"answer_generation": {"train_messages": "none"}}"#.to_vec(), vec!["no_train_messages"]));
    v.push(doc("agentbench-null-history", "jsonl", "agentbench", b"{\"index\": 1, \"error\": \"x\", \"output\": {\"history\": null}}\n{\"index\": 2, \"output\": {\"history\": [{\"role\": \"nobody\", \"content\": 1}]}}\n".to_vec(), vec!["null_history", "unknown_role"]));
    v.push(doc("empty-file", "json", "tau-bench", vec![], vec!["malformed_json"]));
    v
}
