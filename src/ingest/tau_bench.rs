//! tau-bench `historical_trajectories/*.json`: a JSON array of sessions
//! `{task_id, trial, reward, info, traj}`, where `traj` is OpenAI chat messages (system, user =
//! an LLM-simulated customer, assistant with `tool_calls`, tool results).
//!
//! Facts handled (found in `gpt-4o-airline.json`): tool-call `arguments` are JSON strings inside JSON;
//! `content` is null in over a thousand messages; in 49 of 200 sessions the model reused one tool-call
//! id for two different calls, so nothing here joins on ids. Each session is one element, streamed;
//! session id = `<file stem>:<task_id>:<trial>`; `reward` becomes `outcome_reward` of every turn; the
//! log has no timestamps (event time = ingest time). Every trajectory is complete: the messages after
//! the last assistant turn are its next state.

use std::path::Path;

use serde_json::Value;

use super::normalize::json_type;
use super::sink::Sink;
use super::stream::{for_each_element, ArrayEnd};
use super::trajectory::{emit, Trajectory};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let (bytes, end) = for_each_element(path, progress, &mut |i, v| {
        sink.next_record()?;
        session(sink, i, &v)
    })?;
    sink.set_bytes(bytes);
    match end {
        ArrayEnd::Complete => Ok(()),
        ArrayEnd::NotAnArray(e) => sink.dead(None, "wrong_type", format!("tau-bench file is not a JSON array of sessions: {e}"), b""),
        ArrayEnd::Broken { elements, error } => sink.dead(
            Some(elements + 1),
            "malformed_json",
            format!("JSON broken after {elements} complete sessions (element {} unreadable): {error}", elements + 1),
            b"",
        ),
    }
}

fn id_text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

fn session(sink: &mut Sink<'_>, index: i64, v: &Value) -> Result<()> {
    let payload = || v.to_string().into_bytes();
    let Some(obj) = v.as_object() else {
        return sink.dead(Some(index), "wrong_type", format!("session {index} is a JSON {}, expected an object", json_type(v)), &payload());
    };
    let traj = match obj.get("traj") {
        Some(Value::Array(a)) => a,
        Some(Value::Null) | None => {
            return sink.dead(Some(index), "missing_traj", format!("session {index} has no `traj` message list"), &payload());
        }
        Some(other) => {
            return sink.dead(Some(index), "wrong_type", format!("session {index}: `traj` is a JSON {}", json_type(other)), &payload());
        }
    };
    let task = id_text(obj.get("task_id")).unwrap_or_else(|| format!("element{index}"));
    let trial = id_text(obj.get("trial")).unwrap_or_else(|| "0".into());
    let session_id = format!("{}:{task}:{trial}", sink.stem);
    let mut t = Trajectory { complete: true, ..Trajectory::default() };
    t.outcome_reward = match obj.get("reward") {
        Some(Value::Number(n)) => n.as_f64(),
        _ => None,
    };
    if let Err((i, e)) = t.push_all(traj) {
        return sink.dead_in_session(Some(index), &session_id, e.code(), format!("session {session_id}, message {i}: {e}"), &payload());
    }
    if t.turns() == 0 {
        return sink.dead_in_session(Some(index), &session_id, "no_assistant_turn", format!("session {session_id} has no assistant message"), &payload());
    }
    sink.count("messages", t.messages.len() as u64);
    sink.count("tool_calls", t.messages.iter().map(|m| m.tool_calls.len() as u64).sum());
    emit(sink, &session_id, &t, Some(index))?;
    Ok(())
}
