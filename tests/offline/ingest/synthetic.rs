//! Adapters on the synthetic fixtures (cases the real files do not contain).

use super::common::*;
use nextstate::ingest::Format;
use nextstate::schema::TurnType;

#[test]
fn openclaw_records() {
    let r = ingest(&fixture("synthetic__openclaw-records.jsonl"), Format::OpenClaw);
    assert_eq!(r.summary.records, 6);
    assert_eq!(r.summary.dead_letters_by_reason.get("malformed_json"), Some(&1));
    assert_eq!(r.summary.dead_letters_by_reason.get("missing_messages"), Some(&1));
    assert_eq!(r.dead.iter().map(|d| d.source_line).collect::<Vec<_>>(), vec![Some(4), Some(6)]);
    assert_eq!(r.rows.len(), 4);
    let oc: Vec<_> = r.rows.iter().filter(|i| i.session_id == "oc-1").collect();
    assert_eq!(oc.iter().map(|i| i.turn_index).collect::<Vec<_>>(), vec![0, 1, 2], "turn numbers are 1-based in the records");
    // Turn 0: reasoning split off, end marker dropped, two parallel calls; the record's next_state
    // holds only the last tool result, the next record's request holds both.
    let t0 = oc[0];
    assert_eq!(t0.response_text, "");
    assert_eq!(t0.reasoning_text.as_deref(), Some("Two cities, two calls."));
    assert_eq!(t0.parsed_tool_calls().unwrap().len(), 2);
    let ns = messages(t0.next_state.as_deref().unwrap());
    assert_eq!(ns.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["Paris: 18 C, cloudy", "Rome: 25 C, sunny"]);
    assert!(t0.notes.contains(&"next state taken from the next record's request (2 messages) instead of the record's next_state".to_string()));
    assert_eq!(t0.event_time, 1_772_359_200_000, "2026-03-01 10:00:00 read as UTC");
    assert!(t0.prompt_text.as_deref().unwrap().starts_with("<|im_start|>system\n"));
    // Turn 1: the derived next state equals the record's, no note.
    assert_eq!(oc[1].response_text, "Paris is 18 C and cloudy; Rome is 25 C and sunny.");
    assert_eq!(messages(oc[1].next_state.as_deref().unwrap())[0].content, "thanks! and tomorrow?");
    assert!(!oc[1].notes.iter().any(|n| n.starts_with("next state taken")));
    // Turn 2: the record's next_state is null and no record follows.
    assert_eq!(oc[2].next_state, None);
    // Session `unknown` → inferred.
    let inf = r.rows.iter().find(|i| i.session_inferred).unwrap();
    assert!(inf.session_id.starts_with("inferred-"));
    assert!(inf.notes.contains(&"no session_id: session inferred from the messages".to_string()));
}

#[test]
fn openai_chat_logs() {
    let r = ingest(&fixture("synthetic__openai-chat.jsonl"), Format::OpenAiChat);
    assert_eq!(r.summary.records, 8);
    assert_eq!(r.summary.counters.get("blank lines"), Some(&1));
    let reasons: Vec<_> = r.dead.iter().map(|d| (d.source_line.unwrap(), d.reason_code.as_str())).collect();
    assert_eq!(reasons, vec![(7, "api_error"), (8, "unknown_role"), (9, "wrong_type")]);
    assert_eq!(r.rows.len(), 5);
    let t0 = &r.rows[0];
    assert_eq!((t0.session_id.as_str(), t0.turn_index, t0.turn_type), ("chat-1", 0, TurnType::Main));
    assert_eq!(t0.response_text, "About 330 m.");
    assert_eq!(t0.reasoning_text.as_deref(), Some("It is the Eiffel tower."));
    assert_eq!(t0.response_token_ids, Some(vec![11, 12, 13]));
    assert_eq!(t0.rollout_logprobs, Some(vec![-0.5, -1.25, -0.125]));
    assert_eq!(t0.prompt_token_ids, Some(vec![1, 2, 3, 4]));
    assert_eq!(t0.model.as_deref(), Some("policy-v1"));
    assert_eq!(t0.event_time, 1_772_359_200_000, "response.created in seconds");
    assert_eq!(t0.notes, vec!["developer role mapped to system".to_string(), "dropped 1 non-text content part".to_string()]);
    let req0 = messages(&t0.request_messages);
    assert_eq!(req0[0].role, "system");
    assert_eq!(req0[1].content, "How tall is this tower?");
    // Lower-case header; length cut inside an unclosed reasoning block.
    let t1 = &r.rows[1];
    assert_eq!((t1.session_id.as_str(), t1.turn_index), ("chat-1", 1));
    assert!(t1.truncated);
    assert_eq!(t1.finish_reason.as_deref(), Some("length"));
    assert_eq!(t1.response_text, "");
    assert_eq!(t1.reasoning_text.as_deref(), Some("330 m is about 1083"));
    // Side turn.
    assert_eq!((r.rows[2].turn_type, r.rows[2].turn_index), (TurnType::Side, 2));
    // Inferred session over a trivially different echo; done flag in the body; vLLM token ids.
    let (a, b) = (&r.rows[3], &r.rows[4]);
    assert!(a.session_inferred && b.session_inferred);
    assert_eq!(a.session_id, b.session_id);
    assert_eq!((a.turn_index, b.turn_index), (0, 1));
    assert_eq!(a.response_token_ids, Some(vec![9906, 0]));
    assert_eq!(a.rollout_logprobs, Some(vec![-0.1, -0.2]));
    assert!(b.session_done && !a.session_done);
    let calls = b.parsed_tool_calls().unwrap();
    assert_eq!(calls[0].arguments, serde_json::Value::Null);
    assert_eq!(calls[0].arguments_raw.as_deref(), Some("{\"path\": "));
    assert!(b.notes[0].starts_with("tool call 0 (ls) arguments are not valid JSON"));
}

#[test]
fn truncated_tau_bench_array_keeps_complete_sessions() {
    let r = ingest(&fixture("broken__tau-bench-truncated.json"), Format::TauBench);
    assert_eq!(r.rows.len(), 1);
    assert_eq!(r.rows[0].session_id, "broken__tau-bench-truncated:7:0");
    assert_eq!(r.rows[0].outcome_reward, Some(1.0));
    assert_eq!(r.dead.len(), 1);
    assert_eq!(r.dead[0].reason_code, "malformed_json");
    assert_eq!(r.dead[0].source_line, Some(2));
    assert!(r.dead[0].reason.starts_with("JSON broken after 1 complete sessions (element 2 unreadable): EOF while parsing"), "{}", r.dead[0].reason);
}

#[test]
fn agentbench_runs_with_history() {
    use std::io::Write;
    let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    let ok = r#"{"index": 7, "error": null, "info": null, "output": {"index": 7, "status": "completed", "result": {}, "history": [{"role": "user", "content": "Find patient S123's age."}, {"role": "agent", "content": "GET /Patient?identifier=S123"}, {"role": "user", "content": "Here is the response from GET request: {\"birthDate\": \"1960-01-01\"}"}, {"role": "agent", "content": "FINISH([65])"}, {"role": "user", "content": "Task finished."}]}, "time": {"timestamp": 1737159055712, "str": "2025-01-17 16:10:55"}}"#;
    writeln!(f, "{ok}").unwrap();
    writeln!(f, r#"{{"index": 8, "output": {{"status": "running", "history": [{{"role": "robot", "content": "x"}}]}}}}"#).unwrap();
    let r = ingest(f.path(), Format::AgentBench);
    assert_eq!(r.rows.len(), 2);
    assert_eq!(r.rows[0].event_time, 1_737_159_055_712);
    assert_eq!(r.rows[0].response_text, "GET /Patient?identifier=S123");
    assert!(r.rows[0].notes.contains(&"agent role mapped to assistant".to_string()));
    assert!(r.rows[1].session_done);
    assert_eq!(messages(r.rows[1].next_state.as_deref().unwrap())[0].content, "Task finished.");
    assert_eq!(r.dead.len(), 1);
    assert_eq!((r.dead[0].reason_code.as_str(), r.dead[0].reason.as_str()), ("unknown_role", "history[0]: unknown message role \"robot\""));
}
