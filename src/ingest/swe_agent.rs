//! SWE-agent `.traj`: `{environment, trajectory[], history[], info}`, every version.
//!
//! The conversation is `history` (what the model saw): system prompt, the in-context demonstration
//! (`is_demo: true` or `message_type: "demonstration"`: kept in the request context, never used as a
//! next state), the issue, then assistant actions and the terminal output sent back as role `user`
//! (older versions) or `tool` (function-calling versions, with `tool_calls` / `tool_call_ids`).
//! Only messages of the main agent (`agent` absent, `primary` or `main`) are used; others (reviewer
//! or sub-routine agents) are skipped and counted.
//!
//! `trajectory[i]` holds `action`, `observation`, `response`, `thought` and `state` — a JSON **string**
//! in older files, an **object** in newer ones (both accepted and counted; anything else is counted as
//! `state of another type`). `history` ends with the last action; the last step's `observation`
//! (e.g. the submitted diff) is the last turn's next state when nothing follows it in `history`.
//! Observations may contain CRLF line ends; they are kept verbatim.
//!
//! Session id = `swe-agent:<file stem>`. Complete when `info.exit_status` is a string (noted, not a
//! reward: `submitted` does not say the patch is right); boolean `info.resolved` → 1.0 / 0.0.

use std::path::Path;

use serde_json::Value;

use super::normalize::{json_type, normalize_message};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let Some(doc) = sink.load_document(path, progress)? else {
        return Ok(());
    };
    let payload = || doc.to_string().into_bytes();
    let session_id = format!("swe-agent:{}", sink.stem);
    let Some(obj) = doc.as_object() else {
        return sink.dead(None, "wrong_type", format!("document is a JSON {}, expected an object", json_type(&doc)), &payload());
    };
    let history = match obj.get("history") {
        Some(Value::Array(a)) => a,
        Some(Value::Null) | None => return sink.dead(None, "null_history", "`history` is missing or null", &payload()),
        Some(v) => return sink.dead(None, "wrong_type", format!("`history` is a JSON {}", json_type(v)), &payload()),
    };
    let steps: &[Value] = match obj.get("trajectory") {
        Some(Value::Array(a)) => a,
        _ => &[],
    };
    // `state`: string (old) or object (new); only checked and counted, the conversation does not need it.
    let (mut as_string, mut as_object, mut other) = (0u64, 0u64, 0u64);
    for s in steps {
        match s.get("state") {
            Some(Value::String(st)) => {
                as_string += 1;
                if serde_json::from_str::<Value>(st).is_err() {
                    sink.count("state string that is not JSON", 1);
                }
            }
            Some(Value::Object(_)) => as_object += 1,
            None | Some(Value::Null) => {}
            Some(_) => other += 1,
        }
    }
    sink.count("state as string", as_string);
    sink.count("state as object", as_object);
    sink.count("state of another type", other);

    let info = obj.get("info").and_then(Value::as_object);
    let exit_status = info.and_then(|i| i.get("exit_status")).and_then(Value::as_str);
    let mut t = Trajectory { complete: exit_status.is_some(), ..Trajectory::default() };
    match exit_status {
        Some(s) => t.notes.push(format!("swe-agent exit_status: {s}")),
        None => t.notes.push("no info.exit_status: trajectory treated as incomplete".into()),
    }
    t.outcome_reward = info.and_then(|i| i.get("resolved")).and_then(Value::as_bool).map(|b| if b { 1.0 } else { 0.0 });
    let mut other_agents = 0u64;
    let mut demos = 0u64;
    for (i, raw) in history.iter().enumerate() {
        let agent = raw.get("agent").and_then(Value::as_str);
        if !matches!(agent, None | Some("primary") | Some("main")) {
            other_agents += 1;
            continue;
        }
        let n = match normalize_message(raw) {
            Ok(n) => n,
            Err(e) => return sink.dead_in_session(None, &session_id, e.code(), format!("history[{i}]: {e}"), &payload()),
        };
        let demo = raw.get("is_demo").and_then(Value::as_bool).unwrap_or(false)
            || raw.get("message_type").and_then(Value::as_str) == Some("demonstration");
        demos += demo as u64;
        let ts = raw.get("timestamp").and_then(parse_timestamp);
        t.push(n, MessageMeta { not_next_state: demo, event_time: ts, ..MessageMeta::default() });
    }
    sink.count("messages of other agents skipped", other_agents);
    sink.count("demonstration messages", demos);
    if t.turns() == 0 {
        return sink.dead_in_session(None, &session_id, "no_assistant_turn", "history has no assistant message", &payload());
    }
    // The last step's observation is the environment's answer to the last action.
    let last_assistant = t.messages.iter().rposition(|m| m.role == "assistant");
    if let (Some(step), Some(la)) = (steps.last(), last_assistant) {
        if let Some(Value::String(obs)) = step.get("observation") {
            if !obs.is_empty() {
                let call_id = t.messages[la].tool_calls.first().and_then(|c| c.id.clone());
                let role = if call_id.is_some() { "tool" } else { "user" };
                t.final_observation = Some(Message { tool_call_id: call_id, ..Message::text(role, obs.clone()) });
            }
        }
    }
    emit(sink, &session_id, &t, Some(1))?;
    Ok(())
}
