//! The agent log formats of 2026 (tests/fixtures/agent-logs-2026: one real file per family, with
//! attribution in its README, and `synthetic__*` files built from each format's documentation), plus
//! variants written here: counts of turns, tool calls and next states by kind, hand-checked against
//! the files.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::common::*;
use nextstate::ingest::{detect, Format, DEFAULT_HEAD_BYTES};
use nextstate::schema::{Interaction, Message, NextStateKind, ToolCall};

fn log2026(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-logs-2026").join(name)
}

fn calls(i: &Interaction) -> Vec<ToolCall> {
    i.tool_calls.as_deref().map(|s| serde_json::from_str(s).unwrap()).unwrap_or_default()
}

fn request(i: &Interaction) -> Vec<Message> {
    messages(&i.request_messages)
}

/// Pairs the rows and counts the signals by next-state kind (`none` = excluded, with its reason).
fn kinds(rows: &[Interaction]) -> BTreeMap<String, usize> {
    let (sigs, _) = pair_all(rows.to_vec());
    let mut out = BTreeMap::new();
    for s in sigs {
        let k = match (s.kind, s.excluded_reason.as_deref()) {
            (NextStateKind::User, _) => "user".to_string(),
            (NextStateKind::Tool, _) => "tool".to_string(),
            (NextStateKind::Environment, _) => "environment".to_string(),
            (NextStateKind::None, r) => format!("none: {}", r.unwrap_or("")),
        };
        *out.entry(k).or_insert(0) += 1;
    }
    out
}

fn map(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn tmp(name: &str, content: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(name);
    std::fs::write(&p, content).unwrap();
    (dir, p)
}

#[test]
fn every_2026_file_is_detected() {
    let cases = [
        ("openclaw__session-v3__f967d602.jsonl", Format::OpenClawSession),
        ("claude-code__v2.1.38__short.jsonl", Format::ClaudeCode),
        ("openhands-sdk-v1__events__goal-fixture.jsonl", Format::OpenHandsV1),
        ("langsmith__run-ingest-post-patch__wrap_openai_reasoning.json", Format::LangSmith),
        ("otel-genai-spans__any-agent__OPENAI_trace.json", Format::Otel),
        ("synthetic__otel__otlp.json", Format::Otel),
        ("synthetic__otel__indexed.json", Format::Otel),
        ("synthetic__codex__rollout.jsonl", Format::Codex),
        ("synthetic__openai-responses.jsonl", Format::OpenAiResponses),
        ("synthetic__anthropic-messages.jsonl", Format::AnthropicMessages),
        ("copilot-cli__v1.0.34-events__vibecodingtracker.jsonl", Format::CopilotCli),
        ("gemini-cli__jsonl-2026-04__vibecodingtracker.jsonl", Format::GeminiCli),
        ("synthetic__qwen-code__session.jsonl", Format::QwenCode),
        ("synthetic__cline__xml-tools.json", Format::Cline),
        ("synthetic__roo-code__native-tools.json", Format::Cline),
        ("synthetic__kimi-cli__context.jsonl", Format::KimiCli),
        ("synthetic__aider__chat-history.md", Format::Aider),
        ("synthetic__aider__llm-history.txt", Format::Aider),
        ("synthetic__goose__session.jsonl", Format::Goose),
        ("synthetic__anthropic-managed-agents__session.jsonl", Format::AnthropicManagedAgents),
        ("synthetic__anthropic-managed-agents__events-list.jsonl", Format::AnthropicManagedAgents),
        ("synthetic__opencode__storage/message/ses_7a3c9e1d2ffeQm4Lx8Rt2Vb6Nk", Format::OpenCode),
        ("synthetic__opencode__storage/message/ses_7a3c9e1d2ffeQm4Lx8Rt2Vb6Nk/msg_7a3c9e1d3002Hq2Wd5Zp9Ys.json", Format::OpenCode),
    ];
    for (f, want) in cases {
        assert_eq!(detect(&log2026(f), DEFAULT_HEAD_BYTES).unwrap().format, want, "{f}");
    }
}

#[test]
fn openclaw_session_v3_follows_the_parent_chain_and_skips_the_gateway_message() {
    let r = ingest(&log2026("openclaw__session-v3__f967d602.jsonl"), Format::OpenClawSession);
    assert!(r.dead.is_empty());
    // 9 assistant messages, one of them the gateway's "New session started" mirror.
    assert_eq!(r.rows.len(), 8);
    assert_eq!(r.summary.counters.get("gateway messages (not model output)"), Some(&1));
    assert!(r.rows.iter().all(|i| i.session_id == "f967d602-325a-4a45-8d54-ee17484cfd96"));
    assert_eq!(r.rows.iter().map(|i| calls(i).len()).collect::<Vec<_>>(), vec![1, 1, 1, 1, 0, 0, 0, 0]);
    assert_eq!(r.rows.iter().map(|i| i.finish_reason.as_deref().unwrap()).collect::<Vec<_>>(), [["tool_calls"; 4], ["stop"; 4]].concat());
    assert_eq!(r.rows[0].model.as_deref(), Some("litellm/anthropic/claude-sonnet-4-5"));
    // The first request is the startup prompt alone (the mirror is neither turn nor context).
    let req0 = request(&r.rows[0]);
    assert_eq!(req0.len(), 1);
    assert!(req0[0].content.starts_with("A new session was started via /new"));
    assert!(r.rows[0].reasoning_text.is_some(), "thinking block kept as reasoning");
    // Tool results are their own messages, by toolCallId.
    let req1 = request(&r.rows[1]);
    let result = req1.last().unwrap();
    assert_eq!((result.role.as_str(), result.tool_call_id.as_deref()), ("tool", calls(&r.rows[0])[0].id.as_deref()));
    assert_eq!(kinds(&r.rows), map(&[("tool", 4), ("user", 3), ("none: session idle for 1800 s without next state", 1)]));
}

#[test]
fn openclaw_session_v1_compaction_aborted_and_branches() {
    // v1 (no ids, line order), then a v3 file with a compaction and an abandoned branch.
    let v1 = r#"{"type":"session","id":"s-v1","timestamp":"2026-01-01T00:00:00Z","cwd":"/w"}
{"type":"message","timestamp":"2026-01-01T00:00:01Z","message":{"role":"user","content":"hi","timestamp":1767225601000}}
{"type":"message","timestamp":"2026-01-01T00:00:02Z","message":{"role":"assistant","content":[{"type":"text","text":"hello"}],"provider":"p","model":"m","stopReason":"stop","timestamp":1767225602000}}
{"type":"message","timestamp":"2026-01-01T00:00:03Z","message":{"role":"user","content":"run ls","timestamp":1767225603000}}
{"type":"message","timestamp":"2026-01-01T00:00:04Z","message":{"role":"assistant","content":[],"provider":"p","model":"m","stopReason":"aborted","timestamp":1767225604000}}
{"type":"message","timestamp":"2026-01-01T00:00:05Z","message":{"role":"user","content":"again","timestamp":1767225605000}}
{"type":"message","timestamp":"2026-01-01T00:00:06Z","message":{"role":"assistant","content":[{"type":"toolCall","id":"c1","name":"bash","arguments":{"cmd":"ls"}}],"provider":"p","model":"m","stopReason":"toolUse","timestamp":1767225606000}}
{"type":"message","timestamp":"2026-01-01T00:00:07Z","message":{"role":"toolResult","toolCallId":"c1","toolName":"bash","content":[{"type":"text","text":"a.txt"}],"isError":false,"timestamp":1767225607000}}
"#;
    let (_d, p) = tmp("v1.jsonl", v1);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::OpenClawSession);
    let r = ingest(&p, Format::OpenClawSession);
    assert_eq!(r.rows.len(), 2, "the aborted empty message is not a turn");
    assert_eq!(r.summary.counters.get("aborted or failed assistant messages without output"), Some(&1));
    // The last turn's next state is the tool result that follows it in the file.
    assert_eq!(messages(r.rows[1].next_state.as_deref().unwrap())[0].content, "a.txt");
    assert_eq!(kinds(&r.rows), map(&[("user", 1), ("tool", 1)]));

    // v3: root → u1 → a1 → u2 → a2(branch A, abandoned) ; u2 → a2' → u3 → compaction(kept from u2) → u4 → a4.
    let line = |id: &str, parent: Option<&str>, body: &str| {
        format!(
            r#"{{"type":"message","id":"{id}","parentId":{},"timestamp":"2026-01-01T00:00:{:02}Z","message":{body}}}"#,
            parent.map(|p| format!("\"{p}\"")).unwrap_or("null".into()),
            id.len()
        )
    };
    let u = |t: &str| format!(r#"{{"role":"user","content":"{t}"}}"#);
    let a = |t: &str| format!(r#"{{"role":"assistant","content":[{{"type":"text","text":"{t}"}}],"provider":"p","model":"m","stopReason":"stop"}}"#);
    let v3 = [
        r#"{"type":"session","version":3,"id":"s-v3","timestamp":"2026-01-01T00:00:00Z","cwd":"/w"}"#.to_string(),
        line("u1", None, &u("one")),
        line("a1", Some("u1"), &a("ONE")),
        line("u2", Some("a1"), &u("two")),
        line("a2", Some("u2"), &a("abandoned")),
        line("a2b", Some("u2"), &a("TWO")),
        line("u3", Some("a2b"), &u("three")),
        r#"{"type":"compaction","id":"cp","parentId":"u3","timestamp":"2026-01-01T00:01:00Z","summary":"We counted to two.","firstKeptEntryId":"u2","tokensBefore":900}"#
            .to_string(),
        line("a3", Some("cp"), &a("THREE")),
        line("u4", Some("a3"), &u("four")),
        line("a4", Some("u4"), &a("FOUR")),
    ]
    .join("\n");
    let (_d, p) = tmp("v3.jsonl", &v3);
    let r = ingest(&p, Format::OpenClawSession);
    assert_eq!(r.rows.iter().map(|i| i.response_text.as_str()).collect::<Vec<_>>(), vec!["ONE", "TWO", "THREE", "FOUR"]);
    assert_eq!(r.rows.iter().map(|i| i.turn_index).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(r.summary.counters.get("entries on abandoned branches"), Some(&1));
    assert_eq!(r.summary.counters.get("compactions"), Some(&1));
    // After the compaction the request is the summary, then the kept entries (u2, a2b, u3).
    let req = request(&r.rows[2]);
    assert_eq!(req.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["We counted to two.", "two", "TWO", "three"]);
    // The last turn before the compaction took "three" as its next state.
    assert_eq!(messages(r.rows[1].next_state.as_deref().unwrap())[0].content, "three");
    assert_eq!(kinds(&r.rows), map(&[("user", 3), ("none: session idle for 1800 s without next state", 1)]));
}

#[test]
fn claude_code_merges_a_response_split_over_lines() {
    let r = ingest(&log2026("claude-code__v2.1.38__short.jsonl"), Format::ClaudeCode);
    assert!(r.dead.is_empty());
    // Five assistant lines share one message.id: one turn with its two tool_use blocks.
    assert_eq!(r.rows.len(), 1);
    let t = &r.rows[0];
    assert_eq!(t.session_id, "55604662-cf2a-4331-851a-ec234028f8ca");
    assert_eq!(calls(t).len(), 2);
    assert_eq!(t.model.as_deref(), Some("claude-opus-4-6"));
    assert!(t.reasoning_text.is_some());
    assert_eq!(r.summary.counters.get("assistant lines merged into an earlier line of the same response"), Some(&4));
    assert_eq!(r.summary.counters.get("progress lines"), Some(&3));
    assert_eq!(r.summary.counters.get("system lines (local_command)"), Some(&2));
    // Its next state: both (rejected) tool results, then the interruption note.
    let ns = messages(t.next_state.as_deref().unwrap());
    assert_eq!(ns.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["tool", "tool", "user"]);
    assert_eq!(ns[0].tool_call_id, calls(t)[0].id);
    assert_eq!(ns[1].tool_call_id, calls(t)[1].id);
    assert_eq!(ns[2].content, "[Request interrupted by user for tool use]");
    assert_eq!(kinds(&r.rows), map(&[("tool", 1)]));
}

#[test]
fn claude_code_sidechains_compaction_and_synthetic_messages() {
    let l = |ty: &str, uuid: &str, extra: &str, msg: &str| {
        format!(r#"{{"type":"{ty}","uuid":"{uuid}","parentUuid":null,"sessionId":"S","timestamp":"2026-01-01T00:00:00Z"{extra},"message":{msg}}}"#)
    };
    let text = r#"{"role":"user","content":"fix it"}"#;
    let reply = |id: &str, t: &str, stop: &str| {
        format!(r#"{{"id":"{id}","role":"assistant","model":"claude-x","content":[{{"type":"text","text":"{t}"}}],"stop_reason":"{stop}"}}"#)
    };
    let file = [
        l("user", "u1", "", text),
        l("assistant", "a1", "", &reply("m1", "on it", "end_turn")),
        l("user", "s1", r#","isSidechain":true,"agentId":"ag1""#, r#"{"role":"user","content":"subtask"}"#),
        l("assistant", "s2", r#","isSidechain":true,"agentId":"ag1""#, &reply("m2", "sub done", "end_turn")),
        l("user", "u2", "", r#"{"role":"user","content":"more"}"#),
        l("assistant", "a2", "", r#"{"id":"m3","role":"assistant","model":"<synthetic>","content":[{"type":"text","text":"No response requested."}],"stop_reason":"stop_sequence"}"#),
        r#"{"type":"system","subtype":"compact_boundary","uuid":"cb","parentUuid":null,"sessionId":"S","timestamp":"2026-01-01T00:00:00Z","content":"Conversation compacted"}"#.to_string(),
        l("user", "u3", r#","isCompactSummary":true"#, r#"{"role":"user","content":"Summary: fixing it."}"#),
        l("user", "u4", "", r#"{"role":"user","content":"go on"}"#),
        l("assistant", "a4", "", &reply("m4", "cut", "max_tokens")),
        r#"{"type":"summary","summary":"Fixing","leafUuid":"a4"}"#.to_string(),
    ]
    .join("\n");
    let (_d, p) = tmp("S.jsonl", &file);
    let r = ingest(&p, Format::ClaudeCode);
    let by_session = |s: &str| r.rows.iter().filter(|i| i.session_id == s).map(|i| i.response_text.as_str()).collect::<Vec<_>>();
    assert_eq!(by_session("S"), vec!["on it", "cut"], "the <synthetic> message is context, not a turn");
    assert_eq!(by_session("S:agent-ag1"), vec!["sub done"]);
    let sub = r.rows.iter().find(|i| i.session_id == "S:agent-ag1").unwrap();
    assert!(sub.notes.iter().any(|n| n == "subagent session of Claude Code session S"), "{:?}", sub.notes);
    let cut = r.rows.iter().find(|i| i.response_text == "cut").unwrap();
    assert_eq!((cut.turn_index, cut.truncated, cut.finish_reason.as_deref()), (1, true, Some("length")));
    assert_eq!(request(cut).iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["Summary: fixing it.", "go on"]);
    let first = r.rows.iter().find(|i| i.response_text == "on it").unwrap();
    assert_eq!(messages(first.next_state.as_deref().unwrap())[0].content, "more", "next state across the compaction");
    assert_eq!(r.summary.counters.get("synthetic assistant messages (not model output)"), Some(&1));
    assert_eq!(r.summary.counters.get("summary lines"), Some(&1));
}

#[test]
fn openhands_v1_events_orphans_and_parallel_actions() {
    let r = ingest(&log2026("openhands-sdk-v1__events__goal-fixture.jsonl"), Format::OpenHandsV1);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 2);
    assert_eq!(r.rows.iter().map(|i| calls(i).len()).collect::<Vec<_>>(), vec![1, 1]);
    assert_eq!(r.summary.counters.get("orphan observations (their action is not in the file)"), Some(&1));
    assert_eq!(r.summary.counters.get("ConversationStateUpdateEvent events"), Some(&5));
    assert_eq!(kinds(&r.rows), map(&[("tool", 2)]));

    // Two actions of one response, a message event and a finished status.
    let ev = |kind: &str, body: &str| format!(r#"{{"kind":"{kind}","id":"{}","source":"agent","timestamp":"2026-06-01T10:00:00"{body}}}"#, uuid_like(kind, body));
    let act = |call: &str, resp: &str| {
        ev(
            "ActionEvent",
            &format!(
                r#","thought":[{{"type":"text","text":"t"}}],"tool_name":"terminal","tool_call_id":"{call}","tool_call":{{"id":"{call}","name":"terminal","arguments":"{{\"command\":\"ls\"}}"}},"llm_response_id":"{resp}""#
            ),
        )
    };
    let obs = |call: &str, out: &str| {
        ev(
            "ObservationEvent",
            &format!(
                r#","tool_name":"terminal","tool_call_id":"{call}","action_id":"x","observation":{{"kind":"TerminalObservation","content":[{{"type":"text","text":"{out}"}}],"is_error":false}}"#
            ),
        )
    };
    let file = [
        ev("SystemPromptEvent", r#","system_prompt":{"type":"text","text":"You are OpenHands."},"tools":[]"#),
        ev("MessageEvent", r#","llm_message":{"role":"user","content":[{"type":"text","text":"list files"}]}"#),
        act("c1", "r1"),
        act("c2", "r1"),
        obs("c1", "a.txt"),
        obs("c2", "b.txt"),
        ev("MessageEvent", r#","llm_message":{"role":"assistant","content":[{"type":"text","text":"done"}]}"#),
        ev("ConversationStateUpdateEvent", r#","key":"execution_status","value":"finished""#),
    ]
    .join("\n");
    let (_d, p) = tmp("events.jsonl", &file);
    let r = ingest(&p, Format::OpenHandsV1);
    assert_eq!(r.rows.len(), 2);
    assert_eq!(calls(&r.rows[0]).len(), 2, "actions sharing llm_response_id are one turn");
    assert_eq!(r.rows[1].response_text, "done");
    assert!(r.rows[1].session_done);
    let req = request(&r.rows[1]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["system", "user", "assistant", "tool", "tool"]);
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session done without next state", 1)]));
}

/// A distinct id per event of the synthetic streams.
fn uuid_like(a: &str, b: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (a, b).hash(&mut h);
    format!("{:016x}", h.finish())
}

#[test]
fn langsmith_post_and_patch_merge_into_one_turn() {
    let r = ingest(&log2026("langsmith__run-ingest-post-patch__wrap_openai_reasoning.json"), Format::LangSmith);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 1);
    let t = &r.rows[0];
    assert_eq!(t.session_id, "langsmith:a8b34ded-ccd2-4fb7-bccb-9cd625066a14");
    assert_eq!((t.model.as_deref(), t.finish_reason.as_deref()), (Some("o1-mini"), Some("stop")));
    assert!(t.response_text.starts_with("Certainly! Below is a **Bash script**"));
    assert_eq!(request(t).iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["user"]);
    assert_eq!(r.summary.counters.get("run updates merged by id"), Some(&1));
    assert_eq!(kinds(&r.rows), map(&[("none: session idle for 1800 s without next state", 1)]));

    // A JSONL export: LangChain-serialised messages, a chain run, an unfinished llm run.
    let human = r#"{"lc":1,"type":"constructor","id":["langchain","schema","messages","HumanMessage"],"kwargs":{"content":"2+2?"}}"#;
    let ai_call = r#"{"lc":1,"type":"constructor","id":["langchain","schema","messages","AIMessage"],"kwargs":{"content":"","tool_calls":[{"name":"calc","args":{"x":"2+2"},"id":"t1"}]}}"#;
    let tool = r#"{"lc":1,"type":"constructor","id":["langchain","schema","messages","ToolMessage"],"kwargs":{"content":"4","tool_call_id":"t1"}}"#;
    let run = |id: &str, order: &str, inputs: &str, outputs: &str| {
        format!(
            r#"{{"id":"{id}","trace_id":"T","dotted_order":"{order}","run_type":"llm","start_time":"2026-01-01T00:00:0{}Z","inputs":{inputs},"outputs":{outputs}}}"#,
            order.len() % 10
        )
    };
    let gen = |m: &str| format!(r#"{{"generations":[[{{"message":{m},"generation_info":{{"finish_reason":"stop"}}}}]]}}"#);
    let file = [
        r#"{"id":"C","trace_id":"T","dotted_order":"1","run_type":"chain","inputs":{},"outputs":{}}"#.to_string(),
        run(
            "L2",
            "1.2",
            &format!(r#"{{"messages":[[{human},{ai_call},{tool}]]}}"#),
            &gen(r#"{"lc":1,"type":"constructor","id":["langchain","schema","messages","AIMessage"],"kwargs":{"content":"4."}}"#),
        ),
        run("L1", "1.1", &format!(r#"{{"messages":[[{human}]]}}"#), &gen(ai_call)),
        r#"{"id":"L3","trace_id":"T","dotted_order":"1.3","run_type":"llm","inputs":{"messages":[]},"outputs":null}"#.to_string(),
    ]
    .join("\n");
    let (_d, p) = tmp("export.jsonl", &file);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::LangSmith);
    let r = ingest(&p, Format::LangSmith);
    assert_eq!(r.rows.iter().map(|i| (i.turn_index, calls(i).len(), i.response_text.as_str())).collect::<Vec<_>>(), vec![(0, 1, ""), (1, 0, "4.")]);
    assert_eq!(r.summary.counters.get("chain runs (not model calls)"), Some(&1));
    assert_eq!(r.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>(), vec!["no_outputs"]);
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session idle for 1800 s without next state", 1)]));
    assert!(r.rows.iter().all(|i| i.tenant.as_deref() == Some("default")), "no metadata: the default tenant");

    // The tenant from the run's metadata: agent_id over user_id.
    let tagged = |trace: &str, meta: &str| {
        format!(
            r#"{{"id":"{trace}1","trace_id":"{trace}","dotted_order":"1","run_type":"llm","extra":{{"metadata":{meta}}},"inputs":{{"messages":[{{"role":"user","content":"hi"}}]}},"outputs":{{"choices":[{{"message":{{"role":"assistant","content":"hello"}},"finish_reason":"stop"}}]}}}}"#
        )
    };
    let file = [tagged("A", r#"{"user_id":"u-7","agent_id":"agent-a"}"#), tagged("B", r#"{"user_id":"u-7"}"#), tagged("C", r#"{"ls_model_name":"m"}"#)].join("\n");
    let (_d, p) = tmp("tagged.jsonl", &file);
    let r = ingest(&p, Format::LangSmith);
    let mut got: Vec<(String, Option<String>)> = r.rows.iter().map(|i| (i.session_id.clone(), i.tenant.clone())).collect();
    got.sort();
    let s = |x: &str| Some(x.to_string());
    assert_eq!(got, vec![("langsmith:A".into(), s("agent-a")), ("langsmith:B".into(), s("u-7")), ("langsmith:C".into(), s("default"))]);
}

#[test]
fn otel_any_agent_spans_rebuild_the_conversation_from_tool_spans() {
    let r = ingest(&log2026("otel-genai-spans__any-agent__OPENAI_trace.json"), Format::Otel);
    assert!(r.dead.is_empty());
    // The 128-bit decimal trace id, exactly, in hex.
    assert!(r.rows.iter().all(|i| i.session_id == "otel:4bedea77bb33b9c5f280371eae21ea97"));
    assert_eq!(r.rows.len(), 3);
    assert_eq!(
        r.rows.iter().map(|i| calls(i).iter().map(|c| c.name.clone()).collect::<Vec<_>>()).collect::<Vec<_>>(),
        vec![vec!["get_current_time".to_string()], vec!["write_file".into()], vec![]]
    );
    // The second call carries no input messages: its request is the first's plus the tool result.
    let req1 = request(&r.rows[1]);
    assert_eq!(req1.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["system", "user", "assistant", "tool"]);
    assert!(req1[3].content.contains("America/New_York"));
    assert!(r.rows[2].session_done, "the agent span ended the trace");
    assert_eq!(kinds(&r.rows), map(&[("tool", 2), ("none: session done without next state", 1)]));
}

#[test]
fn otel_otlp_export_and_indexed_attributes() {
    let r = ingest(&log2026("synthetic__otel__otlp.json"), Format::Otel);
    assert_eq!(r.rows.len(), 2);
    assert!(r.rows.iter().all(|i| i.session_id == "conv_5j66UpCpwteGg4YSxUnt7lPY"), "gen_ai.conversation.id");
    assert_eq!(calls(&r.rows[0]).len(), 1);
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session done without next state", 1)]));

    let r = ingest(&log2026("synthetic__otel__indexed.json"), Format::Otel);
    assert_eq!(r.rows.len(), 2);
    assert!(r.rows.iter().all(|i| i.session_id == "sess-42"));
    // traceloop's gen_ai.completion.0.tool_calls.{0,1}.*, then OpenInference's llm.output_messages.
    assert_eq!(calls(&r.rows[0]).iter().map(|c| c.id.clone().unwrap()).collect::<Vec<_>>(), vec!["call_p1", "call_l2"]);
    assert_eq!(r.rows[1].response_text, "Paris: rainy, 57°F. London: cloudy, 12°C.");
    assert_eq!(r.rows[1].reasoning_text.as_deref(), Some("Both results are in."));
    let (sigs, _) = pair_all(r.rows.clone());
    let s0 = sigs.iter().find(|s| s.turn_index == 0).unwrap();
    assert_eq!(messages(&s0.next_state).iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["rainy, 57°F", "cloudy, 12°C"]);
}

#[test]
fn otel_ids_and_spans_without_content() {
    // One trace written with a hex id and once more with the same id as a decimal integer; a model
    // span without content capture.
    let span = |trace: &str, start: u64, attrs: &str| {
        format!(r#"{{"name":"chat m","context":{{"trace_id":{trace},"span_id":{start}}},"parent":null,"start_time":{start},"attributes":{{{attrs}}},"events":[]}}"#)
    };
    let input = r#""gen_ai.operation.name":"chat","gen_ai.input.messages":"[{\"role\":\"user\",\"parts\":[{\"type\":\"text\",\"content\":\"hi\"}]}]","gen_ai.output.messages":"[{\"role\":\"assistant\",\"parts\":[{\"type\":\"text\",\"content\":\"hello\"}],\"finish_reason\":\"stop\"}]""#;
    let file = format!(
        "[{},{},{}]",
        span("\"0x-not-used\"", 1, r#""gen_ai.operation.name":"chat""#),
        span("\"4BEDEA77BB33B9C5F280371EAE21EA97\"", 2, input),
        span("100927429609276267646756448943279827607", 3, &input.replace("hello", "hello again").replace("\"hi\"", "\"hi again\"")),
    );
    let (_d, p) = tmp("spans.json", &file);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Otel);
    let r = ingest(&p, Format::Otel);
    assert_eq!(
        r.rows.iter().map(|i| (i.session_id.as_str(), i.turn_index)).collect::<Vec<_>>(),
        vec![("otel:4bedea77bb33b9c5f280371eae21ea97", 0), ("otel:4bedea77bb33b9c5f280371eae21ea97", 1)]
    );
    assert_eq!(r.dead.len(), 1);
    assert_eq!(r.dead[0].reason_code, "no_message_content");
    assert!(r.dead[0].reason.contains("capture is opt-in"), "{}", r.dead[0].reason);
    assert!(r.rows.iter().all(|i| i.tenant.as_deref() == Some("default")), "no agent or user id: the default tenant");

    // The tenant: `gen_ai.agent.id` over `user.id`, from whichever span of the trace carries it.
    let tenanted = format!(
        "[{},{}]",
        span("\"aa\"", 1, &format!(r#"{input},"user.id":"bob""#)),
        span("\"aa\"", 2, &format!(r#"{},"gen_ai.agent.id":"support-bot""#, input.replace("hello", "hello again").replace("\"hi\"", "\"hi again\""))),
    );
    let (_d, p) = tmp("tenanted.json", &tenanted);
    let r = ingest(&p, Format::Otel);
    assert_eq!(r.rows.iter().map(|i| i.tenant.as_deref()).collect::<Vec<_>>(), vec![Some("support-bot"); 2]);
    let (_d, p) = tmp("user.json", &format!("[{}]", span("\"bb\"", 1, &format!(r#"{input},"user.id":"bob""#))));
    assert_eq!(ingest(&p, Format::Otel).rows[0].tenant.as_deref(), Some("bob"));
    let (_d, p) = tmp("bad.json", &format!("[{}]", span("\"cc\"", 1, &format!(r#"{input},"user.id":"team/a""#))));
    let r = ingest(&p, Format::Otel);
    assert_eq!((r.rows.len(), r.dead.len(), r.dead[0].reason_code.as_str()), (0, 1, "invalid_tenant"));
}

#[test]
fn codex_rollout_reads_response_items_once() {
    let r = ingest(&log2026("synthetic__codex__rollout.jsonl"), Format::Codex);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 3);
    assert!(r.rows.iter().all(|i| i.session_id == "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"));
    assert_eq!(r.rows.iter().map(|i| calls(i).len()).collect::<Vec<_>>(), vec![1, 1, 0]);
    assert_eq!(r.rows[0].response_text, "I'll start by listing the files.");
    assert!(r.rows[0].reasoning_text.is_some());
    // The user_message / agent_message events repeat response items: counted, not read.
    assert_eq!(r.summary.counters.get("event_msg lines (user_message)"), Some(&1));
    assert_eq!(r.summary.counters.get("event_msg lines (agent_message)"), Some(&2));
    let users = request(&r.rows[0]).iter().filter(|m| m.role == "user").count();
    assert_eq!(users, 2, "the environment context and the prompt");
    assert_eq!(kinds(&r.rows), map(&[("tool", 2), ("none: session idle for 1800 s without next state", 1)]));

    // The older layout: a bare meta line, bare items, state lines; then a compaction.
    let file = r#"{"id":"old-1","timestamp":"2025-05-07T17:24:21.123Z","instructions":"be brief"}
{"record_type":"state"}
{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}
{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hello"}]}
{"type":"message","role":"user","content":[{"type":"input_text","text":"ls"}]}
{"type":"local_shell_call","call_id":"c1","status":"completed","action":{"type":"exec","command":["ls"]}}
{"type":"function_call_output","call_id":"c1","output":"a.txt"}
{"timestamp":"2025-05-07T17:25:00Z","type":"compacted","payload":{"message":"The user said hi and listed files."}}
{"type":"message","role":"user","content":[{"type":"input_text","text":"thanks"}]}
{"type":"message","role":"assistant","content":[{"type":"output_text","text":"welcome"}]}
"#;
    let (_d, p) = tmp("rollout-old.jsonl", file);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Codex);
    let r = ingest(&p, Format::Codex);
    assert_eq!(r.rows.iter().map(|i| (i.turn_index, i.response_text.as_str(), calls(i).len())).collect::<Vec<_>>(), vec![(0, "hello", 0), (1, "", 1), (2, "welcome", 0)]);
    assert!(r.rows.iter().all(|i| i.session_id == "old-1"));
    assert_eq!(request(&r.rows[0])[0].content, "be brief");
    assert_eq!(request(&r.rows[2]).iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["The user said hi and listed files.", "thanks"]);
    assert_eq!(messages(r.rows[1].next_state.as_deref().unwrap())[0].content, "a.txt");
    assert_eq!(r.summary.counters.get("state lines (older layout)"), Some(&1));
}

#[test]
fn openai_responses_items_chains_and_truncation() {
    let r = ingest(&log2026("synthetic__openai-responses.jsonl"), Format::OpenAiResponses);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 2);
    assert_eq!(r.rows[0].session_id, r.rows[1].session_id);
    assert_eq!(calls(&r.rows[0])[0].id.as_deref(), Some("call_Xy12Ab34Cd56Ef78"));
    assert_eq!(r.rows[0].reasoning_text.as_deref(), Some("**Checking weather tool**"));
    assert_eq!(r.rows.iter().map(|i| i.finish_reason.as_deref().unwrap()).collect::<Vec<_>>(), vec!["tool_calls", "stop"]);
    assert_eq!(request(&r.rows[0])[0].role, "system", "instructions");
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session idle for 1800 s without next state", 1)]));

    // previous_response_id: the second request holds only the tool output; cut by max_output_tokens.
    let file = r#"{"request":{"model":"m","instructions":"sys","input":"weather?"},"response":{"id":"resp_1","status":"completed","output":[{"type":"function_call","call_id":"k1","name":"w","arguments":"{}"}]}}
{"request":{"model":"m","previous_response_id":"resp_1","input":[{"type":"function_call_output","call_id":"k1","output":"sunny"}]},"response":{"id":"resp_2","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"It is sun"}]}]}}
{"request":{"model":"m","previous_response_id":"resp_gone","input":"hello"},"response":{"id":"resp_3","status":"failed","error":{"code":"server_error"}}}
"#;
    let (_d, p) = tmp("responses.jsonl", file);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::OpenAiResponses);
    let r = ingest(&p, Format::OpenAiResponses);
    assert_eq!(r.rows.len(), 2);
    assert_eq!(request(&r.rows[1]).iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["user", "assistant", "tool"]);
    assert_eq!((r.rows[1].truncated, r.rows[1].finish_reason.as_deref()), (true, Some("length")));
    assert_eq!(r.rows[0].session_id, r.rows[1].session_id, "the chain is one session");
    assert_eq!(r.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>(), vec!["api_error"]);
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session idle for 1800 s without next state", 1)]));
}

#[test]
fn anthropic_messages_blocks_tool_results_and_errors() {
    let r = ingest(&log2026("synthetic__anthropic-messages.jsonl"), Format::AnthropicMessages);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 2);
    let req1 = request(&r.rows[1]);
    // system, user, assistant (tool_use), and the tool_result block as its own tool message.
    assert_eq!(req1.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["system", "user", "assistant", "tool"]);
    assert_eq!(req1[3].tool_call_id.as_deref(), Some("toolu_01A2b3C4d5E6f7G8h9J0k1L2"));
    assert_eq!(r.rows.iter().map(|i| i.finish_reason.as_deref().unwrap()).collect::<Vec<_>>(), vec!["tool_calls", "stop"]);
    assert_eq!(kinds(&r.rows), map(&[("tool", 1), ("none: session idle for 1800 s without next state", 1)]));

    let file = r#"{"headers":{"X-Session-Id":"a1"},"request":{"model":"c","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"count"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA=="}}]}]},"response":{"type":"message","role":"assistant","content":[{"type":"thinking","thinking":"1, 2","signature":"s"},{"type":"text","text":"1 2 3"}],"stop_reason":"max_tokens"}}
{"request":{"model":"c","max_tokens":5,"messages":[{"role":"user","content":"x"}]},"response":{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}}
"#;
    let (_d, p) = tmp("anthropic.jsonl", file);
    let r = ingest(&p, Format::AnthropicMessages);
    assert_eq!(r.rows.len(), 1);
    let t = &r.rows[0];
    assert_eq!((t.session_id.as_str(), t.truncated, t.reasoning_text.as_deref(), t.response_text.as_str()), ("a1", true, Some("1, 2"), "1 2 3"));
    assert!(t.notes.iter().any(|n| n == "dropped 1 non-text content part"), "{:?}", t.notes);
    assert_eq!(r.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>(), vec!["api_error"]);
}

#[test]
fn compressed_files_read_like_plain_ones_and_a_corrupt_line_is_one_dead_letter() {
    let src = log2026("openclaw__session-v3__f967d602.jsonl");
    let plain = ingest(&src, Format::OpenClawSession);
    let bytes = std::fs::read(&src).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gz = dir.path().join("f967d602.jsonl.gz");
    let mut e = flate2::write::GzEncoder::new(std::fs::File::create(&gz).unwrap(), flate2::Compression::default());
    e.write_all(&bytes).unwrap();
    e.finish().unwrap();
    let zst = dir.path().join("f967d602.jsonl.zst");
    std::fs::write(&zst, zstd::encode_all(&bytes[..], 3).unwrap()).unwrap();
    for p in [&gz, &zst] {
        assert_eq!(detect(p, DEFAULT_HEAD_BYTES).unwrap().format, Format::OpenClawSession, "{}", p.display());
        let r = ingest(p, Format::OpenClawSession);
        let ids = |rows: &[Interaction]| rows.iter().map(|i| i.interaction_id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&r.rows), ids(&plain.rows), "{}", p.display());
        assert_eq!(r.summary.bytes, bytes.len() as u64, "bytes of decompressed content");
    }
    // Stray bytes before a line's JSON: that line is a dead letter, the rest still reads.
    let mut broken = bytes.clone();
    let at = broken.iter().position(|&b| b == b'\n').unwrap() + 1;
    broken.splice(at..at, b"\x00\x1b[0m".iter().copied());
    let bp = dir.path().join("broken.jsonl");
    std::fs::write(&bp, &broken).unwrap();
    let r = ingest(&bp, Format::OpenClawSession);
    assert_eq!(r.dead.iter().map(|d| (d.reason_code.as_str(), d.source_line)).collect::<Vec<_>>(), vec![("malformed_json", Some(2))]);
    // Line 2 was the gateway message (the parent of everything): the chain from the leaf stops at
    // its missing parent, and every model turn is still read.
    assert_eq!(r.rows.len(), 8);
}

#[test]
fn directories_are_walked_for_log_files() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("proj/S/subagents");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::create_dir_all(dir.path().join(".hidden")).unwrap();
    for (p, text) in [("proj/S.jsonl", "{}"), ("proj/S/subagents/agent-1.jsonl", "{}"), ("proj/notes.txt", "x"), (".hidden/x.jsonl", "{}"), ("b.json.gz", "")] {
        std::fs::write(dir.path().join(p), text).unwrap();
    }
    let got = nextstate::ingest::expand_paths(&[dir.path().to_path_buf()]).unwrap();
    let rel: Vec<(String, bool)> = got.iter().map(|(p, w)| (p.strip_prefix(dir.path()).unwrap().display().to_string(), *w)).collect();
    assert_eq!(rel, vec![("b.json.gz".to_string(), true), ("proj/S/subagents/agent-1.jsonl".into(), true), ("proj/S.jsonl".into(), true)]);
    // A subagent file is its own session, named after the agent.
    let line = r#"{"type":"user","uuid":"u","parentUuid":null,"sessionId":"S","isSidechain":true,"agentId":"1","timestamp":"2026-01-01T00:00:00Z","message":{"role":"user","content":"sub"}}
{"type":"assistant","uuid":"a","parentUuid":"u","sessionId":"S","isSidechain":true,"agentId":"1","timestamp":"2026-01-01T00:00:01Z","message":{"id":"m","role":"assistant","model":"c","content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn"}}"#;
    std::fs::write(sub.join("agent-1.jsonl"), line).unwrap();
    let r = ingest(&sub.join("agent-1.jsonl"), Format::ClaudeCode);
    assert_eq!(r.rows.iter().map(|i| i.session_id.as_str()).collect::<Vec<_>>(), vec!["S:agent-1"]);
}

#[test]
fn oasst_trees_and_messages() {
    // prompter → {assistant A (rank 0) → {prompter "thanks" → assistant C}, assistant B (rank 1), deleted D}
    let tree = r#"{"message_tree_id":"T1","tree_state":"ready_for_export","prompt":{"message_id":"p","parent_id":null,"role":"prompter","text":"What is 2+2?","created_date":"2023-02-01T10:00:00Z","replies":[
      {"message_id":"b","parent_id":"p","role":"assistant","text":"five","rank":1,"created_date":"2023-02-01T10:02:00Z","replies":[]},
      {"message_id":"a","parent_id":"p","role":"assistant","text":"4","rank":0,"created_date":"2023-02-01T10:01:00Z","replies":[
        {"message_id":"t","parent_id":"a","role":"prompter","text":"thanks","created_date":"2023-02-01T10:03:00Z","replies":[
          {"message_id":"c","parent_id":"t","role":"assistant","text":"you're welcome","created_date":"2023-02-01T10:04:00Z","replies":[]}]}]},
      {"message_id":"d","parent_id":"p","role":"assistant","text":"x","deleted":true,"replies":[]}]}}"#
        .replace('\n', "");
    let (_d, p) = tmp("oasst.trees.jsonl", &tree);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Oasst);
    let r = ingest(&p, Format::Oasst);
    assert_eq!(r.rows.iter().map(|i| (i.turn_index, i.response_text.as_str())).collect::<Vec<_>>(), vec![(0, "4"), (1, "you're welcome"), (2, "five")]);
    assert!(r.rows.iter().all(|i| i.session_id == "oasst:T1"));
    assert_eq!(messages(r.rows[0].next_state.as_deref().unwrap())[0].content, "thanks");
    assert_eq!(request(&r.rows[1]).iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["What is 2+2?", "4", "thanks"]);
    assert_eq!(r.summary.counters.get("deleted messages left out (with their replies)"), Some(&1));
    assert_eq!(kinds(&r.rows), map(&[("user", 1), ("none: session idle for 1800 s without next state", 2)]));

    // The same tree as flat messages.
    let v: serde_json::Value = serde_json::from_str(&tree).unwrap();
    let mut lines = vec![];
    fn flatten(m: &serde_json::Value, out: &mut Vec<String>) {
        let mut o = m.as_object().unwrap().clone();
        let replies = o.remove("replies").unwrap_or_default();
        o.insert("message_tree_id".into(), "T1".into());
        out.push(serde_json::to_string(&o).unwrap());
        for r in replies.as_array().unwrap() {
            flatten(r, out);
        }
    }
    flatten(&v["prompt"], &mut lines);
    let (_d, p) = tmp("oasst.messages.jsonl", &lines.join("\n"));
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Oasst);
    let flat = ingest(&p, Format::Oasst);
    assert_eq!(flat.rows.iter().map(|i| i.interaction_id.clone()).collect::<Vec<_>>(), r.rows.iter().map(|i| i.interaction_id.clone()).collect::<Vec<_>>());
}

#[test]
fn openhands_v1_persisted_events_folder_is_one_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("conversations/abc123/events");
    std::fs::create_dir_all(&events).unwrap();
    let lines: Vec<String> = std::fs::read_to_string(log2026("openhands-sdk-v1__events__goal-fixture.jsonl")).unwrap().lines().map(str::to_string).collect();
    for (i, l) in lines.iter().enumerate() {
        let id = serde_json::from_str::<serde_json::Value>(l).unwrap()["id"].as_str().unwrap().to_string();
        // Indexes past 99999 grow wider: order is numeric.
        let idx = if i == lines.len() - 1 { format!("{:06}", 100_000) } else { format!("{i:05}") };
        std::fs::write(events.join(format!("event-{idx}-{id}.json")), l).unwrap();
    }
    std::fs::write(dir.path().join("conversations/abc123/base_state.json"), "{}").unwrap();
    let inputs = nextstate::ingest::expand_paths(&[dir.path().to_path_buf()]).unwrap();
    assert!(inputs.iter().any(|(p, _)| p == &events), "{inputs:?}");
    assert_eq!(detect(&events, DEFAULT_HEAD_BYTES).unwrap().format, Format::OpenHandsV1);
    let r = ingest(&events, Format::OpenHandsV1);
    let jsonl = ingest(&log2026("openhands-sdk-v1__events__goal-fixture.jsonl"), Format::OpenHandsV1);
    assert!(r.rows.iter().all(|i| i.session_id == "openhands-v1:abc123"));
    assert_eq!(
        r.rows.iter().map(|i| (i.response_text.clone(), i.tool_calls.clone())).collect::<Vec<_>>(),
        jsonl.rows.iter().map(|i| (i.response_text.clone(), i.tool_calls.clone())).collect::<Vec<_>>()
    );
}

#[test]
fn review_faults_multi_trace_conversations_parent_loops_and_retries() {
    // OTel: one conversation over two traces (one per user turn) numbers its turns on.
    let span = |trace: u32, start: u64, text: &str| {
        format!(
            r#"{{"name":"chat m","context":{{"trace_id":"{trace:032x}","span_id":"{start:016x}"}},"start_time":{start},"attributes":{{"gen_ai.operation.name":"chat","gen_ai.conversation.id":"conv-1","gen_ai.input.messages":"[{{\"role\":\"user\",\"content\":\"{text}\"}}]","gen_ai.output.messages":"[{{\"role\":\"assistant\",\"content\":\"re {text}\",\"finish_reason\":\"stop\"}}]"}},"events":[]}}"#
        )
    };
    let (_d, p) = tmp("two-traces.json", &format!("[{},{}]", span(2, 20, "second"), span(1, 10, "first")));
    let r = ingest(&p, Format::Otel);
    assert!(r.dead.is_empty(), "{:?}", r.dead.iter().map(|d| &d.reason).collect::<Vec<_>>());
    assert_eq!(r.rows.iter().map(|i| (i.session_id.as_str(), i.turn_index, i.response_text.as_str())).collect::<Vec<_>>(), vec![("conv-1", 0, "re first"), ("conv-1", 1, "re second")]);

    // oasst: a message that is its own parent (and a repeated id) does not recurse forever.
    let file = r#"{"message_id":"a","message_tree_id":"t","role":"prompter","text":"q"}
{"message_id":"b","parent_id":"a","message_tree_id":"t","role":"assistant","text":"x"}
{"message_id":"b","parent_id":"b","message_tree_id":"t","role":"assistant","text":"loop"}"#;
    let (_d, p) = tmp("loop.messages.jsonl", file);
    let r = ingest(&p, Format::Oasst);
    assert_eq!(r.rows.iter().map(|i| i.response_text.as_str()).collect::<Vec<_>>(), vec!["x", "loop"]);

    // Responses: two requests chained on one response (a retry) are two turns, not a duplicate.
    let file = r#"{"request":{"model":"m","input":"hi"},"response":{"id":"r1","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hello"}]}]}}
{"request":{"model":"m","previous_response_id":"r1","input":"again"},"response":{"id":"r2","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"one"}]}]}}
{"request":{"model":"m","previous_response_id":"r1","input":"again"},"response":{"id":"r3","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"two"}]}]}}"#;
    let (_d, p) = tmp("retry.jsonl", file);
    let r = ingest(&p, Format::OpenAiResponses);
    assert!(r.dead.is_empty(), "{:?}", r.dead.iter().map(|d| &d.reason).collect::<Vec<_>>());
    let mut turns: Vec<(i32, String)> = r.rows.iter().map(|i| (i.turn_index, i.response_text.clone())).collect();
    turns.sort();
    assert_eq!(turns, vec![(0, "hello".to_string()), (1, "one".into()), (2, "two".into())]);
}

/// The generic fallback (`--format messages`): a bare JSON array of chat messages, OpenAI shape and
/// Anthropic shape, detected and read with tool calls paired to their results by id.
#[test]
fn a_bare_message_list_is_read_in_either_shape() {
    // OpenAI shape: system, user, an assistant tool call, the tool's result, the answer, the user's reply.
    let openai = r#"[
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
      {"role": "assistant", "content": "It is 18C."},
      {"role": "user", "content": "thanks, and in Rome?"}
    ]"#;
    let (_d, p) = tmp("chat.json", openai);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Messages);
    let got = ingest(&p, Format::Messages);
    assert_eq!((got.rows.len(), got.dead.len()), (2, 0));
    let (a, b) = (&got.rows[0], &got.rows[1]);
    assert_eq!((a.session_id.as_str(), a.turn_index, b.turn_index), ("messages:chat", 0, 1));
    assert_eq!(calls(a).iter().map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone())).collect::<Vec<_>>(), [(Some("call_1".into()), "get_weather".into(), serde_json::json!({"city": "Paris"}))]);
    assert_eq!(request(a).len(), 2);
    assert_eq!((b.response_text.as_str(), request(b).len(), b.session_done), ("It is 18C.", 4, true));
    assert_eq!(messages(b.next_state.as_deref().unwrap()).iter().map(|m| m.content.clone()).collect::<Vec<_>>(), ["thanks, and in Rome?"]);
    assert_eq!(kinds(&got.rows), map(&[("tool", 1), ("user", 1)]));

    // Anthropic shape: the tool use and its result are content blocks; the result block becomes a tool
    // message answering toolu_1.
    let anthropic = r#"[
      {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "It is 18C."}]}
    ]"#;
    let (_d2, p2) = tmp("claude.json", anthropic);
    assert_eq!(detect(&p2, DEFAULT_HEAD_BYTES).unwrap().format, Format::Messages);
    let got = ingest(&p2, Format::Messages);
    assert_eq!((got.rows.len(), got.dead.len()), (2, 0));
    assert_eq!((got.rows[0].response_text.as_str(), calls(&got.rows[0])[0].id.as_deref()), ("Checking.", Some("toolu_1")));
    let req = request(&got.rows[1]);
    assert_eq!((req.last().unwrap().role.as_str(), req.last().unwrap().tool_call_id.as_deref(), req.last().unwrap().content.as_str()), ("tool", Some("toolu_1"), "18C"));
    // The last turn ends the saved conversation with nothing after it: no next state.
    assert!(got.rows[1].session_done && got.rows[1].next_state.is_none());
    assert_eq!(kinds(&got.rows), map(&[("tool", 1), ("none: session done without next state", 1)]));

    // Not a list of messages: one dead letter each, with its reason.
    let (_d3, p3) = tmp("bad.json", r#"[{"role": "wizard", "content": "x"}]"#);
    assert_eq!(ingest(&p3, Format::Messages).dead[0].reason_code, "unknown_role");
    let (_d4, p4) = tmp("obj.json", r#"{"role": "user", "content": "x"}"#);
    assert_eq!(ingest(&p4, Format::Messages).dead[0].reason_code, "wrong_type");
    let (_d5, p5) = tmp("users.json", r#"[{"role": "user", "content": "x"}]"#);
    assert_eq!(ingest(&p5, Format::Messages).dead[0].reason_code, "no_assistant_turn");
}

/// GitHub Copilot CLI session events: the real capture (copilotVersion 1.0.34) and variants built
/// from it (a failed call, an orphan result, a bad line).
#[test]
fn copilot_cli_events_one_turn_per_assistant_message() {
    let path = log2026("copilot-cli__v1.0.34-events__vibecodingtracker.jsonl");
    assert_eq!(detect(&path, DEFAULT_HEAD_BYTES).unwrap().format, Format::CopilotCli);
    let got = ingest(&path, Format::CopilotCli);
    // Hand count: assistant.message on lines 9, 20, 29, 36, 41, 46; toolRequests 4, 3, 2, 1, 0, 1, each
    // with a start (not a call) and a complete (the result); the system message written again on line 43
    // is the same text (not added twice).
    assert_eq!((got.rows.len(), got.dead.len()), (6, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "copilot-cli:96ef38f0-9d09-45c3-8124-6448c36090ed"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [4, 3, 2, 1, 0, 1]);
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [9, 20, 29, 36, 41, 46]);
    assert_eq!(got.rows[0].model.as_deref(), Some("claude-sonnet-4.6"));
    let req5 = request(&got.rows[5]);
    assert_eq!(req5.iter().filter(|m| m.role == "system").count(), 1);
    assert_eq!(req5.iter().filter(|m| m.role == "tool").count(), 10, "every earlier call answered once");
    assert_eq!(calls(&got.rows[5])[0].name, "task_complete");
    assert!(got.rows[5].session_done, "session.task_complete and session.shutdown end it");
    // Next states: turns 0-3 and 5 see their tools' output; turn 4's answer draws the next user message.
    assert_eq!(kinds(&got.rows), map(&[("tool", 5), ("user", 1)]));

    // Variants: a call that failed (success false) answers with its error; a result whose call is not
    // in the file is left out; a bad line is a dead letter and the rest is read.
    let lines: Vec<&str> = std::fs::read_to_string(&path).unwrap().leak().lines().collect();
    let failed = lines[13].replace(r#""success":true"#, r#""success":false,"error":{"message":"permission denied"}"#);
    assert_ne!(failed, lines[13], "line 14 is a successful completion");
    let orphan = r#"{"type":"tool.execution_complete","data":{"toolCallId":"toolu_nowhere","success":true,"result":{"content":"x"}},"id":"o1","timestamp":"2026-04-23T17:11:00.000Z","parentId":"p"}"#;
    let mut variant: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    variant[13] = failed;
    variant.insert(8, orphan.to_string());
    variant.insert(2, "{not json".to_string());
    let (_d, p) = tmp("events.jsonl", &(variant.join("\n") + "\n"));
    let got = ingest(&p, Format::CopilotCli);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (6, vec!["malformed_json"]));
    let tools: Vec<Message> = request(&got.rows[1]).into_iter().filter(|m| m.role == "tool").collect();
    assert_eq!((tools.len(), tools[0].content.as_str()), (4, "error: permission denied"));
}

/// Gemini CLI chat recording, the 2026 JSONL form: the real capture (a header, `$set` lines, gemini
/// records written again under the same id once their tool calls are added).
#[test]
fn gemini_cli_recording_keeps_the_last_version_of_each_message() {
    let path = log2026("gemini-cli__jsonl-2026-04__vibecodingtracker.jsonl");
    assert_eq!(detect(&path, DEFAULT_HEAD_BYTES).unwrap().format, Format::GeminiCli);
    let got = ingest(&path, Format::GeminiCli);
    // Hand count: 6 gemini ids (first seen on lines 6, 9, 12, 15, 20, 24); five are written again with
    // their toolCalls (lines 8, 11, 14, 17, 26: 5, 3, 1, 1 and 2 calls, every one with a result).
    assert_eq!((got.rows.len(), got.dead.len()), (6, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "gemini-cli:0ab84937-9fe7-4284-986a-33c832af0b6a"));
    assert_eq!(got.rows.iter().map(|r| r.turn_index).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [5, 3, 1, 1, 0, 2]);
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [8, 11, 14, 17, 20, 26]);
    assert_eq!(got.rows[0].model.as_deref(), Some("gemini-3-flash-preview"));
    assert_eq!(calls(&got.rows[0]).iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["update_topic", "read_file", "read_file", "read_file", "read_file"]);
    assert_eq!(calls(&got.rows[0])[1].arguments, serde_json::json!({"file_path": "README.md"}));
    let c = &got.summary.counters;
    assert_eq!(c.get("message records rewritten (the last version kept)"), Some(&5));
    assert_eq!(c.get("metadata updates ($set)"), Some(&11));
    assert_eq!(c.get("info messages (CLI notices, not model context)"), Some(&2));
    // The last turn's request: 3 user messages, 5 earlier gemini messages, 10 tool results each
    // answering its call (the info notices are not context).
    let req = request(&got.rows[5]);
    let roles = |r: &str| req.iter().filter(|m| m.role == r).count();
    assert_eq!((roles("user"), roles("assistant"), roles("tool"), req.len()), (3, 5, 10, 18));
    assert_eq!(req[2].tool_call_id.as_deref(), Some("b5qo7ls5"));
    assert!(req[3].content.starts_with("<div align=\"center\""), "read_file README.md output: {}", &req[3].content[..40]);
    assert!(got.rows[1].reasoning_text.as_deref().unwrap().starts_with("Analyzing Project Context\n"));
    assert!(!got.rows[5].session_done, "a recording has no end marker");
    assert_eq!(got.rows[5].next_state.as_deref().map(|s| messages(s).len()), Some(2), "the last turn's two tool results");
    // Next states: turns 0-3 and 5 see their tools' output; turn 4's answer draws the next user message.
    assert_eq!(kinds(&got.rows), map(&[("tool", 5), ("user", 1)]));

    // A record written again at the end replaces its earlier version in place (no new turn).
    let lines: Vec<&str> = std::fs::read_to_string(&path).unwrap().leak().lines().collect();
    let mut rewrite: serde_json::Value = serde_json::from_str(lines[19]).unwrap();
    rewrite["content"] = "rewritten answer".into();
    let mut variant: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    variant.push(rewrite.to_string());
    variant.insert(2, "{not json".to_string());
    let (_d, p) = tmp("session-2026-04-23T12-52-0ab84937.jsonl", &(variant.join("\n") + "\n"));
    let got = ingest(&p, Format::GeminiCli);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (6, vec!["malformed_json"]));
    assert_eq!((got.rows[4].response_text.as_str(), got.rows[4].source_line), ("rewritten answer", Some(30)));
}

/// Gemini CLI, built from `chatRecordingService.ts`: the legacy `session-*.json` document (a failed
/// call answers with its error), and a JSONL recording with a `$rewindTo` and a `$set.messages`
/// checkpoint.
#[test]
fn gemini_cli_legacy_document_rewind_and_checkpoint() {
    let legacy = r#"{
  "sessionId": "5f1c2d3e-0000-4000-8000-00000000abcd",
  "projectHash": "9da8b3df",
  "startTime": "2025-09-01T10:00:00.000Z",
  "lastUpdated": "2025-09-01T10:01:00.000Z",
  "messages": [
    {"id": "m1", "timestamp": "2025-09-01T10:00:00.000Z", "type": "user", "content": "list the files"},
    {"id": "m2", "timestamp": "2025-09-01T10:00:05.000Z", "type": "gemini", "content": "",
     "thoughts": [{"subject": "Listing", "description": "I will run ls.", "timestamp": "2025-09-01T10:00:04.000Z"}],
     "tokens": {"input": 900, "output": 20, "cached": 0, "thoughts": 10, "tool": 0, "total": 930}, "model": "gemini-2.5-pro",
     "toolCalls": [
       {"id": "ls-1", "name": "list_directory", "args": {"path": "."}, "status": "success", "timestamp": "2025-09-01T10:00:06.000Z",
        "result": [{"functionResponse": {"id": "ls-1", "name": "list_directory", "response": {"output": "a.txt\nb.txt"}}}],
        "displayName": "ReadFolder", "description": "", "resultDisplay": "Listed 2 item(s).", "renderOutputAsMarkdown": true},
       {"id": "sh-2", "name": "run_shell_command", "args": {"command": "rm -rf build"}, "status": "error", "timestamp": "2025-09-01T10:00:07.000Z",
        "result": [{"functionResponse": {"id": "sh-2", "name": "run_shell_command", "response": {"error": "Tool execution denied."}}}]}
     ]},
    {"id": "m3", "timestamp": "2025-09-01T10:00:09.000Z", "type": "gemini", "content": "There are two files.", "model": "gemini-2.5-pro"},
    {"id": "m4", "timestamp": "2025-09-01T10:00:10.000Z", "type": "info", "content": "Request cancelled."},
    {"id": "m5", "timestamp": "2025-09-01T10:01:00.000Z", "type": "user", "content": [{"text": "thanks"}]}
  ]
}
"#;
    let (_d, p) = tmp("session-2025-09-01T10-00-5f1c2d3e.json", legacy);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::GeminiCli);
    let got = ingest(&p, Format::GeminiCli);
    assert_eq!((got.rows.len(), got.dead.len()), (2, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "gemini-cli:5f1c2d3e-0000-4000-8000-00000000abcd"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [2, 0]);
    assert_eq!(got.rows[0].reasoning_text.as_deref(), Some("Listing\nI will run ls."));
    let tools: Vec<(Option<String>, String)> = request(&got.rows[1]).into_iter().filter(|m| m.role == "tool").map(|m| (m.tool_call_id, m.content)).collect();
    assert_eq!(tools, [(Some("ls-1".to_string()), "a.txt\nb.txt".to_string()), (Some("sh-2".to_string()), "error: Tool execution denied.".to_string())]);
    assert_eq!(kinds(&got.rows), map(&[("tool", 1), ("user", 1)]));

    // JSONL: g1 is written twice (its call added), g2 is rewound away and g3 answers instead; a
    // checkpoint then restates the conversation with g1's result as a user functionResponse (already
    // given: not added again) before g4.
    let t = |s: u32| format!("2026-04-01T10:00:{s:02}.000Z");
    let r1 = r#"[{"functionResponse":{"id":"r1","name":"read_file","response":{"output":"print(1)"}}}]"#;
    let g1 = format!(r#"{{"id":"g1","timestamp":"{}","type":"gemini","content":"","model":"gemini-3-pro-preview"}}"#, t(2));
    let g1_calls = format!(
        r#"{{"id":"g1","timestamp":"{}","type":"gemini","content":"","model":"gemini-3-pro-preview","toolCalls":[{{"id":"r1","name":"read_file","args":{{"file_path":"a.py"}},"status":"success","timestamp":"{}","result":{r1}}}]}}"#,
        t(2),
        t(3)
    );
    let u1 = format!(r#"{{"id":"u1","timestamp":"{}","type":"user","content":[{{"text":"fix the bug"}}]}}"#, t(1));
    let g3 = format!(r#"{{"id":"g3","timestamp":"{}","type":"gemini","content":"The bug is on line 1.","model":"gemini-3-pro-preview"}}"#, t(6));
    let u2 = format!(r#"{{"id":"u2","timestamp":"{}","type":"user","content":"and now?"}}"#, t(7));
    let restated = format!(r#"{{"id":"h1","timestamp":"{}","type":"user","content":{r1}}}"#, t(8));
    let lines = [
        format!(r#"{{"sessionId":"s-rewind","projectHash":"h","startTime":"{}","lastUpdated":"{}","kind":"main"}}"#, t(0), t(0)),
        u1.clone(),
        g1,
        g1_calls.clone(),
        format!(r#"{{"id":"g2","timestamp":"{}","type":"gemini","content":"Done: the bug is fixed.","model":"gemini-3-pro-preview"}}"#, t(4)),
        r#"{"$rewindTo":"g2"}"#.to_string(),
        g3.clone(),
        u2.clone(),
        format!(r#"{{"$set":{{"messages":[{u1},{g1_calls},{restated},{g3},{u2}],"lastUpdated":"{}"}}}}"#, t(8)),
        format!(r#"{{"id":"g4","timestamp":"{}","type":"gemini","content":"Fixed it.","model":"gemini-3-pro-preview"}}"#, t(9)),
    ];
    let (_d2, p2) = tmp("session-rewind.jsonl", &(lines.join("\n") + "\n"));
    assert_eq!(detect(&p2, DEFAULT_HEAD_BYTES).unwrap().format, Format::GeminiCli);
    let got = ingest(&p2, Format::GeminiCli);
    assert_eq!(got.dead.len(), 0);
    // g1 and g2 before the rewind, g3 before the checkpoint, g4 after it: each once.
    let answers: Vec<(i32, &str)> = got.rows.iter().map(|r| (r.turn_index, r.response_text.as_str())).collect();
    assert_eq!(answers, [(0, ""), (1, "Done: the bug is fixed."), (2, "The bug is on line 1."), (3, "Fixed it.")]);
    assert!(got.rows.iter().all(|r| r.session_id == "gemini-cli:s-rewind"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 0, 0, 0]);
    let roles = |r: &Interaction| request(r).into_iter().map(|m| m.role).collect::<Vec<_>>().join(",");
    assert_eq!(roles(&got.rows[2]), "user,assistant,tool", "g2 left the conversation with the rewind");
    assert_eq!(roles(&got.rows[3]), "user,assistant,tool,assistant,user", "the restated result is not added twice");
    let c = &got.summary.counters;
    assert_eq!((c.get("messages removed by $rewindTo"), c.get("checkpoints ($set.messages, the conversation restated)")), (Some(&1), Some(&1)));
    assert_eq!(c.get("user records only restating tool results already given"), Some(&1));
    // g1 sees its tool result, g3 the next user message; the rewound g2 and the last g4 have nothing after them.
    assert_eq!(kinds(&got.rows), map(&[("tool", 1), ("user", 1), ("none: session idle for 1800 s without next state", 2)]));
}

/// Qwen Code chat records, built from QwenLM/qwen-code `chatRecordingService.ts` and
/// `sessionService.ts` (`synthetic__qwen-code__session.jsonl`): an assistant message written in two
/// records under one uuid, a failed call, a branch the user rewound away, an orphan result, a chat
/// compression checkpoint.
#[test]
fn qwen_code_records_follow_the_parent_chain_and_join_by_uuid() {
    let path = log2026("synthetic__qwen-code__session.jsonl");
    assert_eq!(detect(&path, DEFAULT_HEAD_BYTES).unwrap().format, Format::QwenCode);
    let got = ingest(&path, Format::QwenCode);
    // Hand count: assistant uuids a1 (line 2), a2 (lines 4 + 5: its text, then its two calls), a3 (9),
    // a4 (12), a5 (17); x1 (line 11) hangs off u2 beside a4, on the branch the chain from the last
    // record does not take.
    assert_eq!((got.rows.len(), got.dead.len()), (5, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "qwen-code:6c1e9a4b-2f3d-4e5a-9b8c-7d6e5f4a3b2c"));
    assert_eq!(got.rows.iter().map(|r| r.turn_index).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 2, 0, 1, 0]);
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [2, 4, 9, 12, 17]);
    assert_eq!((got.rows[0].response_text.as_str(), got.rows[0].reasoning_text.as_deref()), ("Running the tests.", Some("Run npm test first.")));
    assert_eq!((got.rows[1].response_text.as_str(), got.rows[1].model.as_deref()), ("Reading the test and the source.", Some("qwen3-coder-plus")));
    assert!(got.rows.iter().all(|r| !r.response_text.contains("rewrite the whole project")));
    let req = request(&got.rows[3]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,assistant,tool,tool,assistant,user");
    assert_eq!((req[5].tool_call_id.as_deref(), req[5].content.as_str()), (Some("call_3"), "error: File not found: /home/dev/calc/add.js"));
    // After the compression the model sees the snapshot, the acknowledgement and the new prompt.
    assert_eq!(request(&got.rows[4]).iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,user");
    assert_eq!(got.rows[3].next_state.as_deref().map(|s| messages(s).len()), Some(1), "a4's edit result; the orphan is left out");
    let c = &got.summary.counters;
    assert_eq!(c.get("records sharing a uuid with an earlier one (joined to it)"), Some(&1));
    assert_eq!(c.get("messages on abandoned branches (off the parentUuid chain of the last record)"), Some(&1));
    assert_eq!(c.get("orphan tool results (their call is not in the conversation)"), Some(&1));
    assert_eq!((c.get("chat compression checkpoints"), c.get("system records (ui_telemetry)")), (Some(&1), Some(&1)));
    // a1, a2 and a4 see their tools' output, a3 the user's answer; a5 is the last, with nothing after it.
    assert_eq!(kinds(&got.rows), map(&[("tool", 3), ("user", 1), ("none: session idle for 1800 s without next state", 1)]));

    // A bad line is a dead letter and the rest is read.
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.insert(3, "{\"uuid\": \"cut");
    let (_d, p) = tmp("6c1e9a4b-2f3d-4e5a-9b8c-7d6e5f4a3b2c.jsonl", &(lines.join("\n") + "\n"));
    let got = ingest(&p, Format::QwenCode);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (5, vec!["malformed_json"]));
}

/// Cline's XML tool protocol, built from cline/cline `src/core/Cline.ts` (`toolDescription`,
/// `pushToolResult`, `pushAdditionalToolFeedback`): `synthetic__cline__xml-tools.json`, read from a
/// task folder (the session id), plus a result header with no call before it.
#[test]
fn cline_xml_tool_calls_pair_with_their_result_headers() {
    let fixture = log2026("synthetic__cline__xml-tools.json");
    assert_eq!(detect(&fixture, DEFAULT_HEAD_BYTES).unwrap().format, Format::Cline);
    let dir = tempfile::tempdir().unwrap();
    let task = dir.path().join("tasks/1735689600000");
    std::fs::create_dir_all(&task).unwrap();
    let path = task.join("api_conversation_history.json");
    std::fs::copy(&fixture, &path).unwrap();
    let got = ingest(&path, Format::Cline);
    // Hand count: assistant messages 1 (read_file), 3 (replace_in_file, denied with feedback),
    // 5 (replace_in_file), 7 (attempt_completion); one XML tool each.
    assert_eq!((got.rows.len(), got.dead.len()), (4, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "cline:1735689600000"));
    let names: Vec<Vec<String>> = got.rows.iter().map(|r| calls(r).into_iter().map(|c| c.name).collect()).collect();
    assert_eq!(names, [vec!["read_file"], vec!["replace_in_file"], vec!["replace_in_file"], vec!["attempt_completion"]]);
    let first = &calls(&got.rows[0])[0];
    assert_eq!((first.id.as_deref(), &first.arguments), (Some("xml-1-0"), &serde_json::json!({"path": "cli.py"})));
    assert!(got.rows[0].response_text.contains("<read_file>"), "the text stays as the model wrote it");
    assert_eq!(got.rows[0].event_time, 1_735_689_604_000);
    let req = request(&got.rows[3]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,user,assistant,tool,user,assistant,tool,user");
    assert_eq!((req[2].tool_call_id.as_deref(), req[2].content.as_str()), (Some("xml-1-0"), "import argparse\nparser = argparse.ArgumentParser()\nargs = parser.parse_args()"));
    assert_eq!(req[5].content, "The user denied this operation. The file was not updated, and maintains its original contents.");
    assert!(req[6].content.starts_with("The user provided the following feedback:\n<feedback>\nalso accept -v"), "feedback stays user text: {}", req[6].content);
    assert!(got.rows[3].session_done, "attempt_completion ends the task");
    // Turns 0-2 see their tool's output (the denial included); attempt_completion has nothing after it.
    assert_eq!(kinds(&got.rows), map(&[("tool", 3), ("none: session done without next state", 1)]));

    // A result header whose tool the assistant message before did not call stays user text.
    let orphan = r#"[{"role": "user", "content": [{"type": "text", "text": "<task>\nlist files\n</task>"}], "ts": 1},
        {"role": "assistant", "content": [{"type": "text", "text": "Which folder?"}], "ts": 2},
        {"role": "user", "content": [{"type": "text", "text": "[execute_command for 'ls'] Result:"}, {"type": "text", "text": "a.py"}], "ts": 3},
        {"role": "assistant", "content": [{"type": "text", "text": "<list_files>\n<path>.</path>\n</list_files>"}], "reasoning_content": "List the top folder.", "ts": 4}]"#;
    let (_d, p) = tmp("orphan.json", orphan);
    let got = ingest(&p, Format::Cline);
    assert_eq!(got.rows.len(), 2);
    assert_eq!(got.summary.counters.get("tool result headers without a call before them (kept as user text)"), Some(&1));
    let req = request(&got.rows[1]);
    assert_eq!((req[2].role.as_str(), req[2].content.as_str()), ("user", "[execute_command for 'ls'] Result:\na.py"));
    assert_eq!(got.rows[1].reasoning_text.as_deref(), Some("List the top folder."), "Roo Code's reasoning_content field");
}

/// Roo Code with native tools (`tool_use` / `tool_result` blocks, a condense summary), built from
/// RooCodeInc/Roo-Code `src/core/task-persistence/{apiMessages,rooMessage}.ts`, and the v2 envelope
/// `{version: 2, messages}` with AI SDK parts; a file that is not JSON.
#[test]
fn roo_code_native_tools_summary_and_v2_envelope() {
    let path = log2026("synthetic__roo-code__native-tools.json");
    assert_eq!(detect(&path, DEFAULT_HEAD_BYTES).unwrap().format, Format::Cline);
    let got = ingest(&path, Format::Cline);
    // Hand count: assistant messages 1, 4, 6, 8 (message 3 is the condense summary, not a turn).
    assert_eq!((got.rows.len(), got.dead.len()), (4, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "cline:synthetic__roo-code__native-tools"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 2, 1, 1]);
    assert_eq!(got.rows[1].reasoning_text.as_deref(), Some("add() probably has an off-by-one."));
    let req = request(&got.rows[3]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,user,assistant,assistant,tool,tool,assistant,tool,user");
    let c = &got.summary.counters;
    assert_eq!((c.get("orphan tool results (their call is not in the file)"), c.get("condense summaries (context, not turns)")), (Some(&1), Some(&1)));
    assert!(got.rows[3].session_done);
    // The first turn's next state is given at the summary (its tool result); the last has none.
    assert_eq!(got.rows[0].next_state.as_deref().map(|s| messages(s).len()), Some(2), "tool result + environment details");
    assert_eq!(got.rows.iter().map(|r| r.turn_index).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(kinds(&got.rows), map(&[("tool", 3), ("none: session done without next state", 1)]));

    let v2 = r#"{"version": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "list the files"}], "ts": 1751000000000},
        {"type": "reasoning", "encrypted_content": "gAAAA", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "text", "text": "Listing."}, {"type": "tool-call", "toolCallId": "call_a", "toolName": "list_files", "input": {"path": "."}}], "ts": 1751000002000},
        {"role": "tool", "content": [{"type": "tool-result", "toolCallId": "call_a", "toolName": "list_files", "output": {"type": "text", "value": "a.py\nb.py"}}], "ts": 1751000003000},
        {"role": "assistant", "content": [{"type": "text", "text": "Two files: a.py and b.py."}], "ts": 1751000004000}]}"#;
    let (_d, p) = tmp("api_conversation_history.json", v2);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Cline);
    let got = ingest(&p, Format::Cline);
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 0]);
    let tool = request(&got.rows[1]).into_iter().find(|m| m.role == "tool").unwrap();
    assert_eq!((tool.tool_call_id.as_deref(), tool.content.as_str()), (Some("call_a"), "a.py\nb.py"));
    assert_eq!(got.summary.counters.get("stand-alone reasoning items (encrypted, not read)"), Some(&1));
    assert!(!got.rows[1].session_done);

    let (_d2, bad) = tmp("api_conversation_history.json", "[{\"role\": \"user\", \"content\": ");
    let got = ingest(&bad, Format::Cline);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (0, vec!["malformed_json"]));
}

/// Kimi CLI `context.jsonl`, built from MoonshotAI/kimi-cli `soul/context.py` and kosong's
/// `message.py` (`synthetic__kimi-cli__context.jsonl`): a system-prompt record, checkpoint and usage
/// records, a D-Mail checkpoint user message, think parts, parallel calls, a failed and an orphan result.
#[test]
fn kimi_cli_context_one_message_a_line() {
    let fixture = log2026("synthetic__kimi-cli__context.jsonl");
    assert_eq!(detect(&fixture, DEFAULT_HEAD_BYTES).unwrap().format, Format::KimiCli);
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("4f0c2a9e-5b1d-4c8e-9a3f-2d7b6e1c0a55");
    std::fs::create_dir_all(&session).unwrap();
    let path = session.join("context.jsonl");
    std::fs::copy(&fixture, &path).unwrap();
    let got = ingest(&path, Format::KimiCli);
    // Hand count: assistant messages on lines 6, 10, 13, 17 with 1, 0, 2, 0 tool calls.
    assert_eq!((got.rows.len(), got.dead.len()), (4, 0));
    assert!(got.rows.iter().all(|r| r.session_id == "kimi-cli:4f0c2a9e-5b1d-4c8e-9a3f-2d7b6e1c0a55"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 0, 2, 0]);
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [6, 10, 13, 17]);
    assert_eq!((got.rows[0].response_text.as_str(), got.rows[0].reasoning_text.as_deref()), ("Let me count them.", Some("I should count them with find.")));
    assert_eq!(calls(&got.rows[0])[0].arguments, serde_json::json!({"command": "find src -name '*.py' | wc -l"}));
    let req = request(&got.rows[3]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "system,user,user,assistant,tool,assistant,user,assistant,tool,tool");
    assert_eq!((req[2].content.as_str(), req[9].content.as_str()), ("<system>CHECKPOINT 1</system>", "<system>ERROR: File not found.</system>"));
    let c = &got.summary.counters;
    assert_eq!((c.get("_checkpoint records"), c.get("_usage records")), (Some(&3), Some(&2)));
    assert_eq!(c.get("orphan tool results (their call is not in the file)"), Some(&1));
    // Turns 0 and 2 see their tools' output, turn 1 the next user message; the last has nothing after it.
    assert_eq!(kinds(&got.rows), map(&[("tool", 2), ("user", 1), ("none: session idle for 1800 s without next state", 1)]));

    // A file moved aside by a rewind or compaction is its own session; a bad line is a dead letter.
    let text = std::fs::read_to_string(&fixture).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.insert(2, "{\"role\": \"user\", \"content\": ");
    let rotated = session.join("context_1.jsonl");
    std::fs::write(&rotated, lines.join("\n") + "\n").unwrap();
    let got = ingest(&rotated, Format::KimiCli);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (4, vec!["malformed_json"]));
    assert_eq!(got.rows[0].session_id, "kimi-cli:4f0c2a9e-5b1d-4c8e-9a3f-2d7b6e1c0a55:context_1");
}

/// Aider's `.aider.chat.history.md`, built from Aider-AI/aider `io.py` (`user_input`, `ai_output`,
/// `tool_output`, `append_chat_history`) (`synthetic__aider__chat-history.md`): three launches, the
/// last without a reply; multi-line input, `/run` output, confirmations.
#[test]
fn aider_chat_history_one_session_per_launch() {
    let fixture = log2026("synthetic__aider__chat-history.md");
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("my-cli");
    std::fs::create_dir_all(&repo).unwrap();
    let path = repo.join(".aider.chat.history.md");
    std::fs::copy(&fixture, &path).unwrap();
    // Walking a folder finds the hidden transcript (other hidden entries stay skipped).
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    std::fs::write(repo.join(".git/x.json"), "{}").unwrap();
    assert_eq!(nextstate::ingest::inputs(&[dir.path().to_path_buf()]), vec![nextstate::ingest::Input::Read { path: path.clone(), walked: true }]);
    assert_eq!(detect(&path, DEFAULT_HEAD_BYTES).unwrap().format, Format::Aider);
    let got = ingest(&path, Format::Aider);
    // Hand count: replies on lines 14, 39, 57 (launch 1) and 83 (launch 2); launch 3 has none.
    assert_eq!((got.rows.len(), got.dead.len()), (4, 0));
    assert_eq!(got.rows.iter().map(|r| r.session_id.as_str()).collect::<Vec<_>>(), ["aider:my-cli:2026-03-02T09:14:07"; 3].into_iter().chain(["aider:my-cli:2026-03-02T14:40:51"]).collect::<Vec<_>>());
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [14, 39, 57, 83]);
    assert_eq!(got.rows.iter().map(|r| (r.turn_index, r.session_done)).collect::<Vec<_>>(), [(0, false), (1, false), (2, true), (0, true)]);
    assert!(got.rows.iter().all(|r| calls(r).is_empty()));
    assert!(got.rows[0].response_text.starts_with("I'll add a `--verbose` flag that turns on debug logging.\n\ncli.py\n```python\n<<<<<<< SEARCH"));
    let req = request(&got.rows[2]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "system,user,system,assistant,system,user,system,assistant,system,user");
    assert_eq!((req[5].content.as_str(), req[9].content.as_str()), ("/run python cli.py data --verbose", "now add a test for the flag\nand keep it short"));
    assert!(req[6].content.starts_with("Traceback (most recent call last):\nFile \"cli.py\""));
    let c = &got.summary.counters;
    assert_eq!(c.get("launches without an assistant reply"), Some(&1));
    assert_eq!(c.get("aider output blocks ('> ' lines, kept as system messages)"), Some(&10));
    // The next user message follows turns 0, 1 and 3 (after Aider's output); launch 1 ends on output.
    assert_eq!(kinds(&got.rows), map(&[("user", 3), ("environment", 1)]));

    // A line that is not UTF-8 is a dead letter; the rest is read.
    let mut bytes = std::fs::read(&fixture).unwrap();
    let at = bytes.windows(5).position(|w| w == b"#### ").unwrap();
    bytes.splice(at..at, b"\xff\xfe broken\n".iter().copied());
    let (_d, bad) = tmp("broken.aider.chat.history.md", "");
    std::fs::write(&bad, bytes).unwrap();
    let got = ingest(&bad, Format::Aider);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (4, vec!["invalid_utf8"]));
}

/// Aider's `--llm-history-file` log, built from Aider-AI/aider `io.py` `log_llm_history`, `utils.py`
/// `format_messages`/`format_content` and `base_coder.py` `send` (`synthetic__aider__llm-history.txt`):
/// each request replays the conversation; an interrupted (empty) response, a new conversation, a
/// request without a response.
#[test]
fn aider_llm_history_responses_are_turns() {
    let path = log2026("synthetic__aider__llm-history.txt");
    let got = ingest(&path, Format::Aider);
    // Hand count: responses on lines 22, 76, 100 (empty), 114; the request on line 125 has none.
    assert_eq!((got.rows.len(), got.dead.len()), (3, 0));
    let a = "aider:synthetic__aider__llm-history:llm:2026-03-02T09:15:02";
    let b = "aider:synthetic__aider__llm-history:llm:2026-03-02T14:41:40";
    assert_eq!(got.rows.iter().map(|r| (r.session_id.as_str(), r.turn_index, r.source_line.unwrap())).collect::<Vec<_>>(), [(a, 0, 22), (a, 1, 76), (b, 0, 114)]);
    // Each request is the one logged before the response, replayed history included.
    assert_eq!(request(&got.rows[0]).iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "system,user,assistant,user,system");
    let req = request(&got.rows[1]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "system,user,assistant,user,assistant,user,system");
    assert_eq!(req[4].content, got.rows[0].response_text);
    assert_eq!(req[1].content.lines().nth(2), Some(""));
    assert!(got.rows[1].response_text.starts_with("The module uses `logging` without importing it."));
    // Turn 0's next state is the command output the user sent back, without the system reminder.
    let next: Vec<Message> = messages(got.rows[0].next_state.as_deref().unwrap());
    assert_eq!((next.len(), next[0].role.as_str()), (1, "user"));
    assert!(next[0].content.starts_with("I ran this command:\n\npython cli.py data --verbose"));
    assert!(got.rows[1].next_state.is_none() && got.rows[2].next_state.is_none());
    let c = &got.summary.counters;
    assert_eq!(c.get("empty responses (interrupted, or a function call the log does not keep)"), Some(&1));
    assert_eq!(c.get("requests without a logged response"), Some(&1));
    // That reply holds a traceback: program output sent as a user message, an environment next state.
    assert_eq!(kinds(&got.rows), map(&[("environment", 1), ("none: session idle for 1800 s without next state", 2)]));

    // Lines before the first block are dead letters.
    let text = std::fs::read_to_string(&path).unwrap();
    let (_d, bad) = tmp("llm.history", &format!("stray line\n{text}"));
    let got = ingest(&bad, Format::Aider);
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (3, vec!["unrecognised_line"]));
}

/// Goose session file, built from block/goose `session/storage.rs` and `message.rs`
/// (`synthetic__goose__session.jsonl`): a metadata line, toolRequest/toolResponse parts (one request
/// that did not parse, its error response an orphan), UI-only tool output, thinking, a message hidden
/// from the agent, a bad line.
#[test]
fn goose_session_messages_with_tool_parts() {
    let path = log2026("synthetic__goose__session.jsonl");
    let got = ingest(&path, Format::Goose);
    // Hand count: assistant messages on lines 3, 5, 8, 10, 13 (line 7 is cut off) with 1, 1, 1, 0, 1 calls.
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (5, vec!["malformed_json"]));
    assert!(got.rows.iter().all(|r| r.session_id == "goose:synthetic__goose__session"));
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [3, 5, 8, 10, 13]);
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 1, 1, 0, 1]);
    assert_eq!(got.rows[0].event_time, 1_740_823_204_000);
    assert_eq!((got.rows[1].response_text.as_str(), got.rows[1].reasoning_text.as_deref()), ("The bug is in add().", Some("add() subtracts; fix the operator.")));
    let c1 = &calls(&got.rows[1])[0];
    assert_eq!((c1.id.as_deref(), c1.name.as_str(), &c1.arguments["new_str"]), (Some("toolu_02"), "developer__text_editor", &serde_json::json!("a + b")));
    let req = request(&got.rows[4]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,assistant,tool,assistant,tool,assistant,user");
    // The tool output meant for the UI only (audience: user) is not in the context.
    assert_eq!((req[2].content.as_str(), req[2].tool_call_id.as_deref()), ("F.\n1 failed, 1 passed", Some("toolu_01")));
    assert_eq!(req[8].content, "thanks! commit it");
    let c = &got.summary.counters;
    assert_eq!(c.get("session metadata records"), Some(&1));
    assert_eq!(c.get("tool requests that did not parse (left out, with their responses)"), Some(&1));
    assert_eq!(c.get("orphan tool results (their call is not in the file)"), Some(&1));
    assert_eq!(c.get("messages not visible to the agent (left out)"), Some(&1));
    // Turns 0, 1, 2 and 4 see their tools' output (the last one the file's tail), turn 3 the user.
    assert_eq!(kinds(&got.rows), map(&[("tool", 4), ("user", 1)]));

    // Without its metadata line the file is still detected and read.
    let text = std::fs::read_to_string(&path).unwrap();
    let (_d, p) = tmp("20250301_101500.jsonl", &text.lines().skip(1).collect::<Vec<_>>().join("\n"));
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::Goose);
    let got = ingest(&p, Format::Goose);
    assert_eq!((got.rows.len(), got.rows[0].session_id.as_str()), (5, "goose:20250301_101500"));
}

/// OpenCode storage, built from sst/opencode `session/message-v2.ts` and `storage/storage.ts`
/// (`synthetic__opencode__storage/`: `message/<session>/`, `part/<message>/`, a `session/` info file):
/// assistant messages of several steps, completed, compacted, failed and interrupted tool parts, an
/// errored assistant message, a compaction with its summary, a cut-off part file.
#[test]
fn opencode_storage_one_turn_per_step() {
    let root = log2026("synthetic__opencode__storage");
    let session = root.join("message/ses_7a3c9e1d2ffeQm4Lx8Rt2Vb6Nk");
    // Walking the storage folder reads each message/<session> folder as one input, and nothing else.
    assert_eq!(nextstate::ingest::inputs(std::slice::from_ref(&root)), vec![nextstate::ingest::Input::Read { path: session.clone(), walked: true }]);
    let got = ingest(&session, Format::OpenCode);
    // Hand count: message 2 has four steps (the third only an interrupted call: no turn), message 5 two
    // steps, message 9 one; message 4 failed; message 7 is the compaction summary.
    assert_eq!((got.rows.len(), got.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>()), (6, vec!["malformed_json"]));
    assert!(got.rows.iter().all(|r| r.session_id == "opencode:ses_7a3c9e1d2ffeQm4Lx8Rt2Vb6Nk"));
    assert_eq!(got.rows.iter().map(|r| (r.turn_index, r.source_line.unwrap(), calls(r).len())).collect::<Vec<_>>(), [(0, 2, 1), (1, 2, 2), (2, 2, 0), (3, 5, 1), (4, 5, 0), (5, 9, 1)]);
    assert_eq!((got.rows[0].response_text.as_str(), got.rows[0].reasoning_text.as_deref()), ("I'll run the tests.", Some("Run the tests first to see the failure.")));
    assert_eq!(got.rows[0].model.as_deref(), Some("anthropic/claude-sonnet-4-20250514"));
    assert_eq!(got.rows[0].event_time, 1_741_000_005_000);
    // The user's text and the synthetic Read output are sent; the file part is not.
    assert_eq!(request(&got.rows[0])[0].content, "Why does `bun test` fail in packages/core?\nCalled the Read tool with the following input: {\"filePath\":\"packages/core/src/sum.ts\"}");
    let req = request(&got.rows[2]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,assistant,tool,tool");
    assert_eq!((req[4].content.as_str(), req[5].content.as_str()), ("[Old tool result content cleared]", "error: ripgrep not found"));
    assert_eq!(req[5].tool_call_id.as_deref(), Some("toolu_03C"));
    // After the compaction the request holds the compaction request, the summary and what follows.
    let req = request(&got.rows[5]);
    assert_eq!(req.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect::<Vec<_>>()[..1], [("user", "What did we do so far?")]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,user");
    let c = &got.summary.counters;
    assert_eq!(c.get("user file parts (not read)"), Some(&1));
    assert_eq!(c.get("ignored text parts (not sent)"), Some(&1));
    assert_eq!(c.get("tool calls pending or running (interrupted; left out)"), Some(&1));
    assert_eq!(c.get("assistant messages with an error (not sent again)"), Some(&1));
    assert_eq!(c.get("compaction summaries (context, not turns)"), Some(&1));
    // Turns 0, 1, 3 and 5 see tool output; turn 2 the next user message, turn 4 the compaction request.
    assert_eq!(kinds(&got.rows), map(&[("tool", 4), ("user", 2)]));
}

/// Anthropic Managed Agents session events, built from anthropic-sdk-python
/// `types/beta/sessions/` (module doc of the adapter): `[method, payload]` lines with `events.send`
/// responses echoed on the stream, model-request spans, a built-in and a custom tool round trip,
/// stream previews, and a terminated session.
#[test]
fn anthropic_managed_agents_one_turn_per_model_request_and_echoes_read_once() {
    let path = log2026("synthetic__anthropic-managed-agents__session.jsonl");
    let got = ingest(&path, Format::AnthropicManagedAgents);
    // Hand count: four model-request spans (lines 4-8, 10-12, 16-20, 23-25), each one turn; the
    // first opens at its agent.message on line 6.
    assert!(got.dead.is_empty(), "{:?}", got.dead);
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [6, 11, 19, 24]);
    assert!(got.rows.iter().all(|r| r.session_id == "anthropic-managed-agents:synthetic__anthropic-managed-agents__session"));
    assert_eq!(got.rows.iter().map(|r| calls(r).len()).collect::<Vec<_>>(), [1, 1, 0, 0]);
    assert_eq!(got.rows.iter().map(|r| r.response_text.as_str()).collect::<Vec<_>>(), ["I'll count the lines first.", "", "Done: 42 lines, ticket T-7.", "You're welcome."]);
    // Tool use ids are the event ids.
    let c0 = &calls(&got.rows[0])[0];
    assert_eq!((c0.id.as_deref(), c0.name.as_str(), &c0.arguments["command"]), (Some("sevt_011t1"), "bash", &serde_json::json!("wc -l notes.txt")));
    let c1 = &calls(&got.rows[1])[0];
    assert_eq!((c1.id.as_deref(), c1.name.as_str()), (Some("sevt_011c1"), "file_ticket"));
    assert_eq!(got.rows[0].event_time, 1_775_811_601_000);
    // The echoed user message and custom tool result appear once.
    let req = request(&got.rows[3]);
    assert_eq!(req.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join(","), "user,assistant,tool,assistant,tool,assistant,user");
    assert_eq!((req[2].content.as_str(), req[2].tool_call_id.as_deref()), ("42 notes.txt", Some("sevt_011t1")));
    assert_eq!((req[4].content.as_str(), req[4].tool_call_id.as_deref()), ("ticket T-7 filed", Some("sevt_011c1")));
    assert_eq!(req[6].content, "Thanks, that's all.");
    assert_eq!(got.rows.iter().map(|r| r.session_done).collect::<Vec<_>>(), [false, false, false, true]);
    let c = &got.summary.counters;
    assert_eq!(c.get("echoed or replayed events (id read before)"), Some(&2));
    assert_eq!(c.get("[method, payload] lines"), Some(&26));
    assert_eq!(c.get("stream previews (event_start/event_delta; the final event is read)"), Some(&2));
    assert_eq!(c.get("agent.thinking events (progress signals without content)"), Some(&1));
    // Turns 0 and 1 see their tools' output, turn 2 the user; the last ends the session.
    let k = kinds(&got.rows);
    assert_eq!((k.get("tool"), k.get("user")), (Some(&2), Some(&1)), "{k:?}");
    assert_eq!(k.values().sum::<usize>(), 4, "{k:?}");

    // A later `events.list` page replaying the whole history adds nothing.
    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[1].clone()).filter(|p| p.get("id").is_some()).collect();
    let replay = format!("{text}{}\n", serde_json::json!(["events.list", {"data": events}]));
    let (_d, p) = tmp("sesn_011replay.jsonl", &replay);
    assert_eq!(detect(&p, DEFAULT_HEAD_BYTES).unwrap().format, Format::AnthropicManagedAgents);
    let again = ingest(&p, Format::AnthropicManagedAgents);
    assert_eq!(again.rows.iter().map(|r| (r.response_text.clone(), r.request_messages.clone())).collect::<Vec<_>>(), got.rows.iter().map(|r| (r.response_text.clone(), r.request_messages.clone())).collect::<Vec<_>>());
    // 22 stream events with an id (26 lines less 2 send responses and 2 previews), on top of the 2 echoes.
    assert_eq!(again.summary.counters.get("echoed or replayed events (id read before)"), Some(&(2 + 22)));
}

/// Bare Managed Agents events, one a line (what `events.list` yields), without spans: a bad first
/// line, consecutive agent events of one response (a built-in and an MCP call), an orphan result, an
/// event cross-posted from a subagent thread, and replayed events.
#[test]
fn anthropic_managed_agents_bare_events_a_bad_line_and_replays() {
    let path = log2026("synthetic__anthropic-managed-agents__events-list.jsonl");
    let got = ingest(&path, Format::AnthropicManagedAgents);
    assert_eq!(got.dead.iter().map(|d| (d.reason_code.as_str(), d.source_line)).collect::<Vec<_>>(), [("malformed_json", Some(1))]);
    assert!(got.dead[0].source_file.as_deref().is_some_and(|f| f.ends_with("synthetic__anthropic-managed-agents__events-list.jsonl")));
    // Hand count: agent events on lines 5-7 are one response (2 calls), line 12 another.
    assert_eq!(got.rows.iter().map(|r| r.source_line.unwrap()).collect::<Vec<_>>(), [5, 12]);
    assert_eq!(got.rows.iter().map(|r| calls(r).iter().map(|c| (c.id.clone().unwrap(), c.name.clone())).collect::<Vec<_>>()).collect::<Vec<_>>(), [
        vec![("sevt_021t1".to_string(), "read".to_string()), ("sevt_021p1".to_string(), "list_issues".to_string())],
        vec![]
    ]);
    assert_eq!(got.rows[0].event_time, 1_775_901_602_000);
    let req = request(&got.rows[1]);
    assert_eq!(req.iter().map(|m| (m.role.as_str(), m.tool_call_id.as_deref())).collect::<Vec<_>>(), [
        ("user", None),
        ("assistant", None),
        ("tool", Some("sevt_021t1")),
        ("tool", Some("sevt_021p1"))
    ]);
    assert_eq!(req[3].content, "3 open issues");
    assert!(got.rows.iter().all(|r| !r.session_done));
    let c = &got.summary.counters;
    assert_eq!(c.get("echoed or replayed events (id read before)"), Some(&2));
    assert_eq!(c.get("orphan tool results (their call is not in the file)"), Some(&1));
    assert_eq!(c.get("events cross-posted from a subagent thread (left out)"), Some(&1));
    assert_eq!(kinds(&got.rows).get("tool"), Some(&1));

    // Garbage in any shape never panics: each line a dead letter or counted.
    let (_d, p) = tmp("odd.jsonl", "[1, 2]\n[\"m\", 3]\n42\n{\"type\": \"agent.tool_result\"}\n[\"m\", {\"data\": [7, {\"id\": 1}]}]\n{\"id\": \"x\", \"type\": \"agent.message\", \"content\": \"text\"}\n{\"id\": \"y\", \"type\": \"agent.tool_use\"}\n");
    let odd = ingest(&p, Format::AnthropicManagedAgents);
    assert_eq!(odd.dead.iter().map(|d| d.reason_code.as_str()).collect::<Vec<_>>(), ["wrong_type", "wrong_type", "tool_call_without_name", "no_assistant_turn"]);
    assert!(odd.rows.is_empty());
}
