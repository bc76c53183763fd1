//! mini-swe-agent trajectory (`*.traj.json`): `{info, messages[], trajectory_format}`.
//!
//! Facts handled: shell output comes back as role `user` inside `<returncode>`/`<output>` tags (the
//! signal stage classifies it as environment output by content); the final `user` message after the
//! last command is the submission (a diff), which is the last turn's next state. Format 1.1 (v2)
//! messages may carry `extra` (with a `timestamp`), `tool_calls`, `reasoning_content` and role `tool`;
//! its closing role-`exit` message is not part of the conversation (skipped, counted).
//!
//! Session id = `mini-swe-agent:<file stem>`. The trajectory is complete when `info.exit_status` is a
//! string; `exit_status` (`Submitted`, `LimitsExceeded`, ...) says the agent stopped, not whether the
//! task was solved, so it is recorded as a note and **not** mapped to `outcome_reward`; an explicit
//! boolean `info.resolved` (added by SWE-bench evaluation) is mapped to 1.0 / 0.0.
//! The whole document is read at once (bounded by `max_document_bytes`).

use std::path::Path;

use serde_json::Value;

use super::normalize::{json_type, normalize_message};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let Some(doc) = sink.load_document(path, progress)? else {
        return Ok(());
    };
    let payload = || doc.to_string().into_bytes();
    let session_id = format!("mini-swe-agent:{}", sink.stem);
    let Some(obj) = doc.as_object() else {
        return sink.dead(None, "wrong_type", format!("document is a JSON {}, expected an object", json_type(&doc)), &payload());
    };
    let messages = match obj.get("messages") {
        Some(Value::Array(a)) => a,
        other => {
            let found = other.map(json_type).unwrap_or("missing");
            return sink.dead(None, "missing_messages", format!("`messages` is {found}, expected an array"), &payload());
        }
    };
    let info = obj.get("info").and_then(Value::as_object);
    let exit_status = info.and_then(|i| i.get("exit_status")).and_then(Value::as_str);
    let mut t = Trajectory { complete: exit_status.is_some(), ..Trajectory::default() };
    match exit_status {
        Some(s) => t.notes.push(format!("mini-swe-agent exit_status: {s}")),
        None => t.notes.push("no info.exit_status: trajectory treated as incomplete".into()),
    }
    t.outcome_reward = info.and_then(|i| i.get("resolved")).and_then(Value::as_bool).map(|b| if b { 1.0 } else { 0.0 });
    t.model = info
        .and_then(|i| i.get("config"))
        .and_then(|c| c.pointer("/model/model_name"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut exits = 0u64;
    for (i, raw) in messages.iter().enumerate() {
        if raw.get("role").and_then(Value::as_str) == Some("exit") {
            exits += 1;
            continue;
        }
        let n = match normalize_message(raw) {
            Ok(n) => n,
            Err(e) => return sink.dead_in_session(None, &session_id, e.code(), format!("message {i}: {e}"), &payload()),
        };
        let ts = raw.get("timestamp").or_else(|| raw.pointer("/extra/timestamp")).and_then(parse_timestamp);
        t.push(n, MessageMeta { event_time: ts, ..MessageMeta::default() });
    }
    sink.count("exit messages skipped", exits);
    if t.turns() == 0 {
        return sink.dead_in_session(None, &session_id, "no_assistant_turn", "trajectory has no assistant message", &payload());
    }
    emit(sink, &session_id, &t, Some(1))?;
    Ok(())
}
