//! The generic fallback (`--format messages`): a file that is one bare JSON array of chat messages, in
//! the OpenAI chat shape (`{role, content, tool_calls, tool_call_id}`) or the Anthropic Messages shape
//! (`{role, content: [blocks]}` with `tool_use` / `tool_result` blocks), or a mix; what tools without a
//! format of their own often store. Every message goes through the shared normaliser
//! ([`super::normalize`]), so tool results answer their calls by id and a `tool_result` block becomes
//! its own tool message.
//!
//! One file = one session, `messages:<file stem>`; every assistant message is a turn (request = the
//! messages before it), and the file is taken as the whole conversation as it was saved: the last turn
//! ends the session, with the messages after it as its next state. The whole document is read at once
//! (bounded by `max_document_bytes`).

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
    let session_id = format!("messages:{}", sink.stem);
    let Some(messages) = doc.as_array() else {
        return sink.dead(None, "wrong_type", format!("document is a JSON {}, expected an array of chat messages", json_type(&doc)), &payload());
    };
    let mut t = Trajectory { complete: true, ..Trajectory::default() };
    for (i, raw) in messages.iter().enumerate() {
        if !raw.is_object() {
            return sink.dead_in_session(None, &session_id, "wrong_type", format!("message {i} is a JSON {}, expected an object", json_type(raw)), &payload());
        }
        let n = match normalize_message(raw) {
            Ok(n) => n,
            Err(e) => return sink.dead_in_session(None, &session_id, e.code(), format!("message {i}: {e}"), &payload()),
        };
        let ts = raw.get("timestamp").or_else(|| raw.get("created_at")).and_then(parse_timestamp);
        let model = raw.get("model").and_then(Value::as_str).map(str::to_string);
        let finish_reason = raw.get("finish_reason").or_else(|| raw.get("stop_reason")).and_then(Value::as_str).map(str::to_string);
        t.push(n, MessageMeta { event_time: ts, model, finish_reason, ..MessageMeta::default() });
    }
    if t.turns() == 0 {
        return sink.dead_in_session(None, &session_id, "no_assistant_turn", "the messages hold no assistant message", &payload());
    }
    emit(sink, &session_id, &t, None)?;
    Ok(())
}
