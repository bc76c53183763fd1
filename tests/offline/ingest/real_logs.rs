//! Adapters on the real public logs: counts and edge cases pinned to hand-checked values.

use serde_json::Value;

use super::common::*;
use nextstate::ingest::Format;
use nextstate::schema::TurnType;

#[test]
fn tau_bench_counts_match_the_file() {
    let Some(tau) = tau_bench() else { return };
    let r = ingest(&tau, Format::TauBench);
    assert!(r.dead.is_empty(), "{:?}", r.dead.first().map(|d| &d.reason));
    assert_eq!(r.summary.records, 200);
    assert_eq!(r.summary.sessions, 200);
    assert_eq!(r.summary.interactions, 2454);
    assert_eq!(r.rows.len(), 2454);
    assert_eq!(r.summary.counters.get("messages"), Some(&5308));
    assert_eq!(r.summary.counters.get("tool_calls"), Some(&1164));
    assert_eq!(r.summary.bytes, 4_114_038);
    let calls: usize = r.rows.iter().map(|i| i.parsed_tool_calls().unwrap().len()).sum();
    assert_eq!(calls, 1164);
    // One done turn per session, carrying the log's own next state; rewards 84 × 1.0, 116 × 0.0.
    let done: Vec<_> = r.rows.iter().filter(|i| i.session_done).collect();
    assert_eq!(done.len(), 200);
    assert!(done.iter().all(|i| i.next_state.is_some()));
    assert!(r.rows.iter().filter(|i| !i.session_done).all(|i| i.next_state.is_none()));
    assert_eq!(done.iter().filter(|i| i.outcome_reward == Some(1.0)).count(), 84);
    assert_eq!(done.iter().filter(|i| i.outcome_reward == Some(0.0)).count(), 116);
    assert!(r.rows.iter().all(|i| i.turn_type == TurnType::Main && !i.session_inferred && i.source_format == "tau-bench"));
    assert!(r.rows.iter().all(|i| i.event_time == INGEST_MS && i.ingest_time == INGEST_MS));
    // Interaction ids are unique.
    let ids: std::collections::HashSet<_> = r.rows.iter().map(|i| i.interaction_id.as_str()).collect();
    assert_eq!(ids.len(), 2454);
}

#[test]
fn tau_bench_first_session_hand_checked() {
    let Some(tau) = tau_bench() else { return };
    let r = ingest(&tau, Format::TauBench);
    let s: Vec<_> = r.rows.iter().filter(|i| i.session_id == "tau-bench__gpt-4o-airline:0:0").collect();
    assert_eq!(s.len(), 15, "assistant messages at positions 2, 4, ..., 30");
    assert_eq!((0..15).collect::<Vec<i32>>(), s.iter().map(|i| i.turn_index).collect::<Vec<_>>());
    assert!(s.iter().all(|i| i.source_line == Some(1) && i.outcome_reward == Some(0.0)));
    // The model reused call id call_oIHazX6yQrB8hUwl4cRilFKj for two different calls (turns 2 and 7).
    let t2 = s[2].parsed_tool_calls().unwrap();
    let t7 = s[7].parsed_tool_calls().unwrap();
    assert_eq!(t2[0].id.as_deref(), Some("call_oIHazX6yQrB8hUwl4cRilFKj"));
    assert_eq!(t7[0].id, t2[0].id);
    assert_eq!((t2[0].name.as_str(), t7[0].name.as_str()), ("get_user_details", "calculate"));
    assert_eq!(t2[0].arguments, serde_json::json!({"user_id": "mia_li_3668"}));
    assert_eq!(t2[0].arguments_raw.as_deref(), Some(r#"{"user_id":"mia_li_3668"}"#));
    assert_eq!(t7[0].arguments, serde_json::json!({"expression": "152 + 103"}));
    // Null content → "".
    assert_eq!(s[2].response_text, "");
    assert_eq!(s[0].response_text, "To assist you with booking a flight, I'll need your user ID. Could you please provide that?");
    // Requests grow by the messages between turns: 2 before turn 0, then +2 per turn.
    assert_eq!(messages(&s[0].request_messages).len(), 2);
    assert_eq!(messages(&s[14].request_messages).len(), 30);
    // The last turn's next state is the customer's closing message, as logged.
    assert!(s[14].session_done);
    let ns = messages(s[14].next_state.as_deref().unwrap());
    assert_eq!(ns.len(), 1);
    assert_eq!((ns[0].role.as_str(), ns[0].content.as_str()), ("user", "Thank you so much for your help! ###STOP###"));
}

#[test]
fn mini_swe_agent_ten_turns_and_the_diff_as_last_next_state() {
    let r = ingest(&fixture("mini-swe-agent__claude-sonnet-4__test_output.json"), Format::MiniSweAgent);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 10);
    let lens: Vec<usize> = r.rows.iter().map(|i| messages(&i.request_messages).len()).collect();
    assert_eq!(lens, vec![2, 4, 6, 8, 10, 12, 14, 16, 18, 20]);
    let last = &r.rows[9];
    assert!(last.session_done);
    assert!(r.rows[..9].iter().all(|i| !i.session_done && i.next_state.is_none()));
    let ns = messages(last.next_state.as_deref().unwrap());
    let raw: Value = serde_json::from_slice(&std::fs::read(fixture("mini-swe-agent__claude-sonnet-4__test_output.json")).unwrap()).unwrap();
    assert_eq!(ns.len(), 1);
    assert_eq!(ns[0].role, "user");
    assert_eq!(ns[0].content, raw["messages"][21]["content"].as_str().unwrap());
    assert!(ns[0].content.starts_with("diff --git a/tests/missing_colon.py b/tests/missing_colon.py\n"));
    // exit_status is a note, not a reward.
    assert_eq!(last.outcome_reward, None);
    assert_eq!(last.notes, vec!["mini-swe-agent exit_status: Submitted".to_string()]);
    assert_eq!(last.session_id, "mini-swe-agent:mini-swe-agent__claude-sonnet-4__test_output");
}

#[test]
fn swe_agent_string_state_demo_and_crlf() {
    let path = fixture("swe-agent__gpt4__pydicom__pydicom-1458.traj");
    let r = ingest(&path, Format::SweAgent);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 12);
    assert_eq!(r.summary.counters.get("state as string"), Some(&12));
    assert_eq!(r.summary.counters.get("state as object"), None);
    assert_eq!(r.summary.counters.get("demonstration messages"), Some(&1));
    // The demonstration is in the request context (system, demo, issue) ...
    let req0 = messages(&r.rows[0].request_messages);
    assert_eq!(req0.len(), 3);
    assert!(req0[1].content.starts_with("Here is a demonstration of how to correctly accomplish this task."));
    // ... and the issue text keeps its 26 CRLF line ends verbatim.
    assert_eq!(req0[2].content.matches("\r\n").count(), 26);
    // history ends with the `submit` action: the last step's observation (the diff) is its next state.
    let raw: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let last = &r.rows[11];
    assert!(last.session_done);
    assert_eq!(last.response_text, raw["history"][25]["content"].as_str().unwrap());
    let ns = messages(last.next_state.as_deref().unwrap());
    assert_eq!(ns.len(), 1);
    assert_eq!(ns[0].role, "user");
    assert_eq!(ns[0].content, raw["trajectory"][11]["observation"].as_str().unwrap());
    assert!(ns[0].content.starts_with("\ndiff --git a/pydicom/pixel_data_handlers/numpy_handler.py"));
    assert_eq!(last.notes, vec!["swe-agent exit_status: submitted".to_string()]);
}

#[test]
fn swe_agent_object_state_tool_calls_and_reviewer() {
    let r = ingest(&fixture("synthetic__swe-agent-v1__object-state.traj"), Format::SweAgent);
    assert!(r.dead.is_empty());
    assert_eq!(r.summary.counters.get("state as object"), Some(&3));
    assert_eq!(r.summary.counters.get("messages of other agents skipped"), Some(&1));
    assert_eq!(r.rows.len(), 3, "the reviewer's message is not a turn");
    let req1 = messages(&r.rows[1].request_messages);
    // system, demo, issue (list content joined), action 1, its tool result with CRLF kept.
    assert_eq!(req1.len(), 5);
    assert_eq!(req1[2].content, "<uploaded_files>/repo</uploaded_files>\nFix the failing test.");
    assert_eq!(req1[4].role, "tool");
    assert_eq!(req1[4].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(req1[4].content, "F.\r\nFAILED test_x.py::test_add - AssertionError: assert 3 == 4\r\n1 failed, 1 passed\r\n");
    let last = &r.rows[2];
    assert_eq!(last.outcome_reward, Some(1.0), "info.resolved = true");
    let ns = messages(last.next_state.as_deref().unwrap());
    assert_eq!(ns[0].role, "tool");
    assert_eq!(ns[0].tool_call_id.as_deref(), Some("toolu_3"));
    assert!(ns[0].content.starts_with("diff --git a/x.py b/x.py\n"));
}

#[test]
fn openhands_event_streams() {
    let r = ingest(&fixture("openhands__basic.json"), Format::OpenHands);
    assert!(r.dead.is_empty());
    assert_eq!(r.summary.records, 4);
    assert_eq!(r.rows.len(), 2);
    let t0 = &r.rows[0];
    assert_eq!(t0.model.as_deref(), Some("claude-3-5-sonnet-20241022"));
    assert_eq!(t0.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(t0.event_time, 1_738_017_913_764, "2025-01-27T22:44:56 + 16.86 s, read as UTC");
    assert_eq!(t0.source_line, Some(2), "the action event's index in the array");
    let calls = t0.parsed_tool_calls().unwrap();
    assert_eq!(calls[0].id.as_deref(), Some("toolu_017nBp7UfiGqyrA7j77HgtFP"));
    assert_eq!(calls[0].arguments["command"], "create");
    assert!(r.rows[1].session_done);
    let req1 = messages(&r.rows[1].request_messages);
    assert_eq!(req1.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), vec!["user", "assistant", "tool"]);
    assert_eq!(req1[2].tool_call_id.as_deref(), Some("toolu_017nBp7UfiGqyrA7j77HgtFP"));
    assert!(req1[2].content.starts_with("--- /workspace/game_2048.py\n+++ /workspace/game_2048.py\n"));

    let r = ingest(&fixture("openhands__basic_interactions.json"), Format::OpenHands);
    assert_eq!(r.rows.len(), 3);
    assert_eq!(r.rows[0].response_text, "1 + 1 equals 2.");
    assert!(r.rows[1].response_text.starts_with("Goldbach's conjecture is an unsolved problem in number theory"));
    assert_eq!(messages(&r.rows[1].request_messages)[2].content, "No, I mean by Goldbach's conjecture!");
    // The finish turn: the model wrote no text (content null), only the finish call.
    assert_eq!(r.rows[2].response_text, "");
    assert_eq!(r.rows[2].parsed_tool_calls().unwrap()[0].name, "finish");
}

#[test]
fn openhands_null_observations_environment_events_and_parallel_calls() {
    let r = ingest(&fixture("synthetic__openhands__null-observations.json"), Format::OpenHands);
    assert!(r.dead.is_empty());
    assert_eq!(r.summary.counters.get("environment events"), Some(&4));
    assert_eq!(r.summary.counters.get("null observations"), Some(&1));
    assert_eq!(r.summary.counters.get("null events"), Some(&1));
    assert_eq!(r.rows.len(), 2, "two actions of one model response are one turn");
    assert_eq!(r.rows[0].parsed_tool_calls().unwrap().len(), 2);
    let req1 = messages(&r.rows[1].request_messages);
    // user, assistant (2 calls), the two results as logged (B's first), joined by the observation ids.
    assert_eq!(req1.len(), 4);
    assert_eq!(req1[2].tool_call_id.as_deref(), Some("toolu_B"));
    assert_eq!(req1[2].content, "# Demo\r\nA demo repo.\r\n\n[The command completed with exit code 0.]");
    assert_eq!(req1[3].tool_call_id.as_deref(), Some("toolu_A"));
}

#[test]
fn toolbench_function_call_arguments_and_empty_error_field() {
    let r = ingest(&fixture("toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json"), Format::ToolBench);
    assert!(r.dead.is_empty());
    assert_eq!(r.rows.len(), 3);
    let c1 = r.rows[1].parsed_tool_calls().unwrap();
    assert_eq!(c1.len(), 1);
    assert_eq!(c1[0].id, None, "the old function_call format has no ids");
    assert_eq!(c1[0].name, "transitaire_for_transitaires");
    assert_eq!(c1[0].arguments, serde_json::json!({"is_id": "ACT_AGENCE_CALEDONIENNE_DE_TRANSIT"}));
    assert_eq!(c1[0].arguments_raw.as_deref(), Some("{\n  \"is_id\": \"ACT_AGENCE_CALEDONIENNE_DE_TRANSIT\"\n}"));
    let req = messages(&r.rows[1].request_messages);
    assert_eq!(req[3].role, "tool", "function role mapped to tool");
    assert_eq!(req[3].name.as_deref(), Some("transitaires_for_transitaires"));
    assert!(req[3].content.starts_with("{\"error\": \"\", \"response\": "));
    assert!(r.rows[1].notes.contains(&"function role mapped to tool".to_string()));
    let tools: Value = serde_json::from_str(r.rows[0].tools.as_deref().unwrap()).unwrap();
    assert_eq!(tools.as_array().unwrap().len(), 3);
    assert_eq!(r.rows[2].parsed_tool_calls().unwrap()[0].name, "Finish");
    assert!(r.rows[2].session_done && r.rows[2].next_state.is_none(), "Finish has no result");
}

#[test]
fn agentbench_null_history_is_one_dead_letter_per_line() {
    let r = ingest(&fixture("agentbench__medagentbench-std__gemini-2.0__error.jsonl"), Format::AgentBench);
    assert!(r.rows.is_empty());
    assert_eq!(r.dead.len(), 22);
    assert_eq!(r.summary.dead_letters_by_reason.get("null_history"), Some(&22));
    for (k, d) in r.dead.iter().enumerate() {
        assert_eq!(d.source_line, Some(k as i64 + 1));
        assert_eq!(d.stage, "ingest");
        assert_eq!(d.session_id, format!("agentbench:agentbench__medagentbench-std__gemini-2.0__error:{}", 53 - k));
        assert!(d.payload.starts_with("{\"index\": "));
    }
    assert_eq!(r.dead[0].reason, "AgentBench run 53 has no history (error AGENT_FAILED, info \"Failed.\"): nothing to ingest");
}
