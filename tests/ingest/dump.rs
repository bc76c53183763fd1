use crate::common::*;
use nextstate::ingest::Format;

#[test]
fn dump() {
    for (f, fmt) in [
        ("mini-swe-agent__claude-sonnet-4__test_output.json", Format::MiniSweAgent),
        ("swe-agent__gpt4__pydicom__pydicom-1458.traj", Format::SweAgent),
        ("openhands__basic.json", Format::OpenHands),
        ("openhands__basic_interactions.json", Format::OpenHands),
        ("toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json", Format::ToolBench),
        ("agentbench__medagentbench-std__gemini-2.0__error.jsonl", Format::AgentBench),
        ("synthetic__openclaw-records.jsonl", Format::OpenClaw),
        ("synthetic__openai-chat.jsonl", Format::OpenAiChat),
        ("synthetic__swe-agent-v1__object-state.traj", Format::SweAgent),
        ("synthetic__openhands__null-observations.json", Format::OpenHands),
        ("broken__tau-bench-truncated.json", Format::TauBench),
    ] {
        let r = ingest(&fixture(f), fmt);
        println!("##### {f}: {}", serde_json::to_string(&r.summary).unwrap());
        for d in &r.dead {
            println!("  DEAD line {:?} {} {}", d.source_line, d.reason_code, d.reason);
        }
        for i in &r.rows {
            println!("  TURN {} #{} {:?} done={} inferred={} trunc={} fin={:?} ev={} line={:?} model={:?} reqlen={} resp={:?} reas={:?} tc={:?} ns={:?} notes={:?} ids={:?} lps={:?} pids={:?}",
                i.session_id, i.turn_index, i.turn_type, i.session_done, i.session_inferred, i.truncated, i.finish_reason, i.event_time, i.source_line, i.model,
                messages(&i.request_messages).len(), &i.response_text.chars().take(60).collect::<String>(), i.reasoning_text.as_deref().map(|s| s.chars().take(40).collect::<String>()),
                i.tool_calls.as_deref().map(|s| s.chars().take(120).collect::<String>()), i.next_state.as_deref().map(|s| s.chars().take(150).collect::<String>()), i.notes, i.response_token_ids, i.rollout_logprobs, i.prompt_token_ids);
        }
        let (sigs, c) = pair_all(r.rows.clone());
        for s in &sigs {
            println!("  SIG {} #{} {:?} err={} exit={:?} corr={} thanks={} succ={} excl={:?} next={:?} text={:?}", s.session_id, s.turn_index, s.kind, s.has_error, s.exit_code, s.correction_cue, s.thanks_cue, s.success_cue, s.excluded_reason, s.next_interaction_id.is_some(), s.next_state_text.chars().take(100).collect::<String>());
        }
        println!("  COUNTERS {}", serde_json::to_string(&c).unwrap());
    }
}
