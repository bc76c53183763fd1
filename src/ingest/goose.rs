//! Goose session files (`~/.local/share/goose/sessions/<session id>.jsonl`): `--format goose`. Read
//! from block/goose `crates/goose/src/session/storage.rs` (`read_messages_with_truncation`,
//! `SessionMetadata`) and `crates/goose/src/message.rs` (`Message`, `MessageContent`, and
//! `tool_result_serde`'s `{status: "success", value} | {status: "error", error}`).
//!
//! The first line is the session metadata (`working_dir`, `description`, `message_count`, token
//! counts; counted) — a first line that is not metadata is a message, as Goose reads it. Every other
//! line is one `Message` `{id, role: user|assistant, created (s), content: [...], metadata}` whose
//! parts are read by the shared normaliser after conversion:
//! - `text` as text, `thinking` as reasoning, `redactedThinking` dropped (noted);
//! - `toolRequest`/`frontendToolRequest` `{id, toolCall: {status: "success", value: {name, arguments}}}`
//!   a tool call; one whose `toolCall` is `{status: "error"}` (the model's call did not parse) is
//!   counted and left out (its error response then counts as an orphan);
//! - `toolResponse` `{id, toolResult}` (in a `user` message) a `tool` message answering that id: the
//!   text of the MCP contents meant for the model (an `annotations.audience` without `assistant` is
//!   for the UI only), or `error: <error>`; one whose call is not in the file is counted and left out;
//! - `toolConfirmationRequest`, `contextLengthExceeded`, `summarizationRequested`, `image` and any other
//!   part are counted by type and not read.
//!
//! A message whose `metadata.agentVisible` is `false` was never sent to the model: counted, left out.
//! Each assistant message is one turn (`created` its event time); session id = `goose:<file stem>`.
//! The file has no end marker: the session is never `session_done`, the messages after the last turn
//! are its next state. A line that is not a JSON object is a dead letter and the rest is read.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Map, Value};

use super::normalize::normalize_with_role;
use super::sink::Sink;
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::Result;

/// Whether a first record is Goose's `SessionMetadata`.
pub(crate) fn is_metadata(r: &Map<String, Value>) -> bool {
    !r.contains_key("role") && r.contains_key("message_count") && r.contains_key("description")
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let session = format!("goose:{}", sink.stem);
    let mut t = Trajectory::default();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut count = |what: String| *counts.entry(what).or_insert(0) += 1;
    let mut calls: HashSet<String> = HashSet::new();
    for (k, (n, r)) in records.iter().enumerate() {
        if k == 0 && is_metadata(r) {
            count("session metadata records".into());
            continue;
        }
        if r.get("metadata").and_then(|m| m.get("agentVisible")) == Some(&Value::Bool(false)) {
            count("messages not visible to the agent (left out)".into());
            continue;
        }
        let role = r.get("role").and_then(Value::as_str).unwrap_or("");
        let mut parts = Vec::new();
        for p in r.get("content").and_then(Value::as_array).into_iter().flatten() {
            match goose_part(p, &calls) {
                Ok(Some(part)) => parts.push(part),
                Ok(None) => {}
                Err(what) => count(what),
            }
        }
        let mut msg = Map::new();
        msg.insert("content".into(), Value::Array(parts));
        let normalized = match role {
            "assistant" | "user" => normalize_with_role(&msg, role, None),
            other => {
                count(format!("messages with role {other:?} (not read)"));
                continue;
            }
        };
        let nm = match normalized {
            Ok(nm) => nm,
            Err(err) => {
                sink.dead_in_session(Some(*n), &session, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(r)?)?;
                continue;
            }
        };
        if role == "assistant" {
            calls.extend(nm.message.tool_calls.iter().filter_map(|c| c.id.clone()));
        } else if nm.before.is_empty() && nm.message.content.trim().is_empty() {
            continue;
        }
        let event_time = r.get("created").and_then(Value::as_i64).map(|s| s * 1000);
        t.push(nm, MessageMeta { line: Some(*n), event_time, ..MessageMeta::default() });
    }
    emit_event_session(sink, &session, t, false, counts, records.len(), "session file has no assistant message")
}

/// One Goose content part in the shape the normaliser reads (module doc); `Ok(None)` for a part that
/// is left out silently, `Err(counter)` for one counted and left out.
fn goose_part(p: &Value, calls: &HashSet<String>) -> std::result::Result<Option<Value>, String> {
    let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
    let id = p.get("id").cloned().unwrap_or(Value::Null);
    let ok = |k: &str| p.get(k).filter(|v| v.get("status").and_then(Value::as_str) == Some("success")).and_then(|v| v.get("value"));
    match ty {
        "text" | "thinking" | "redactedThinking" => Ok(Some(p.clone())),
        "toolRequest" | "frontendToolRequest" => match ok("toolCall") {
            Some(call) => Ok(Some(json!({"type": "tool_use", "id": id, "name": call.get("name").cloned().unwrap_or(Value::Null), "input": call.get("arguments").cloned().unwrap_or(json!({}))}))),
            None => Err("tool requests that did not parse (left out, with their responses)".into()),
        },
        "toolResponse" => {
            if !id.as_str().is_some_and(|id| calls.contains(id)) {
                return Err("orphan tool results (their call is not in the file)".into());
            }
            let content = match ok("toolResult") {
                // Contents for the UI only (`audience` without `assistant`) were not sent to the model.
                Some(Value::Array(items)) => Value::Array(
                    items
                        .iter()
                        .filter(|c| c.get("annotations").and_then(|a| a.get("audience")).and_then(Value::as_array).is_none_or(|a| a.iter().any(|r| r == "assistant")))
                        .cloned()
                        .collect(),
                ),
                Some(other) => other.clone(),
                None => Value::String(format!("error: {}", p.get("toolResult").and_then(|r| r.get("error")).and_then(Value::as_str).unwrap_or("tool failed"))),
            };
            Ok(Some(json!({"type": "tool_result", "tool_use_id": id, "content": content})))
        }
        other => Err(format!("{other} parts (not read)")),
    }
}
