//! GitHub Copilot CLI session events (`~/.copilot/session-state/<session id>/events.jsonl`): `--format
//! copilot-cli`. One event per line, `{type, data, id, timestamp, parentId}`.
//!
//! Read from the real capture in `../shared/data/agent-logs-2026` (copilotVersion 1.0.34) and the
//! event names the CLI writes:
//! - `session.start` → the session id (`data.sessionId`; else the file's folder, else its stem);
//!   `session.model_change` → the model of later turns (`data.newModel`);
//! - `system.message` → the system message (the CLI writes it again before each user message: a
//!   repeat of the current system text is not added twice; a changed one is);
//! - `user.message` → a user message: `data.content`, or `data.transformedContent` (the text with
//!   the CLI's context wrapper) when `content` is empty;
//! - `assistant.message` → an assistant message, one turn: `content`, `reasoningText`, and
//!   `toolRequests[]` (`toolCallId`, `name`, `arguments` object) as its tool calls;
//! - `tool.execution_start` repeats a call of the message before it (counted, not a message);
//!   `tool.execution_complete` → the `tool` message answering `toolCallId` (`result.content`, or
//!   `error.message` when `success` is false): the call's next state. A start and a complete of one
//!   call are one call;
//! - `session.task_complete` and `session.shutdown` mark the session done; every other event
//!   (`assistant.turn_start`/`turn_end`, `session.info`, `session.mode_changed`, ...) is counted.
//!
//! Session id = `copilot-cli:<session id>`. A line that is not a JSON object is a dead letter; the
//! rest of the file is read. The session is held in memory while it is read.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{normalize_with_role, Normalized};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let folder = path.parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned());
    let mut session = records
        .iter()
        .find(|(_, e)| e.get("type").and_then(Value::as_str) == Some("session.start"))
        .and_then(|(_, e)| e.get("data")?.get("sessionId")?.as_str().map(str::to_string))
        .or(folder.filter(|f| f.len() >= 8))
        .unwrap_or_else(|| sink.stem.clone());
    session.insert_str(0, "copilot-cli:");
    let mut t = Trajectory::default();
    let mut model: Option<String> = None;
    let mut calls: HashSet<String> = HashSet::new();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut done = false;
    let empty = Map::new();
    for (n, e) in &records {
        let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
        let data = e.get("data").and_then(Value::as_object).unwrap_or(&empty);
        let at = |a: &str, b: &str| data.get(a).and_then(|v| v.get(b));
        let text = |k: &str| data.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let meta = MessageMeta { event_time: e.get("timestamp").and_then(parse_timestamp), line: Some(*n), ..MessageMeta::default() };
        match kind {
            "session.model_change" => model = data.get("newModel").and_then(Value::as_str).map(str::to_string).or(model),
            "system.message" => {
                let s = text("content");
                let current = t.messages.iter().rev().find(|m| m.role == "system").map(|m| m.content.as_str());
                if current == Some(s.as_str()) {
                    *counts.entry("repeated system messages".into()).or_insert(0) += 1;
                } else {
                    t.push(Normalized::new(Message::text("system", s)), meta);
                }
            }
            "user.message" => {
                let c = text("content");
                let c = if c.trim().is_empty() { text("transformedContent") } else { c };
                t.push(Normalized::new(Message::text("user", c)), meta);
            }
            "assistant.message" => {
                let mut msg = Map::new();
                msg.insert("content".into(), Value::String(text("content")));
                if let Some(r) = data.get("reasoningText").filter(|v| v.as_str().is_some_and(|s| !s.is_empty())) {
                    msg.insert("reasoning_content".into(), r.clone());
                }
                let requests = data.get("toolRequests").and_then(Value::as_array).cloned().unwrap_or_default();
                let tool_calls: Vec<Value> = requests
                    .iter()
                    .map(|r| serde_json::json!({"id": r.get("toolCallId"), "name": r.get("name"), "arguments": r.get("arguments").cloned().unwrap_or(Value::Null)}))
                    .collect();
                if !tool_calls.is_empty() {
                    msg.insert("tool_calls".into(), Value::Array(tool_calls));
                }
                match normalize_with_role(&msg, "assistant", None) {
                    Ok(nm) => {
                        calls.extend(nm.message.tool_calls.iter().filter_map(|c| c.id.clone()));
                        t.push(nm, MessageMeta { model: model.clone(), ..meta });
                    }
                    Err(err) => sink.dead_in_session(Some(*n), &session, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(e)?)?,
                }
            }
            "tool.execution_start" => *counts.entry("tool start events (their call is in the message before)".into()).or_insert(0) += 1,
            "tool.execution_complete" => {
                let id = data.get("toolCallId").and_then(Value::as_str).map(str::to_string);
                if !id.as_ref().is_some_and(|c| calls.contains(c)) {
                    *counts.entry("orphan tool results (their call is not in the file)".into()).or_insert(0) += 1;
                    continue;
                }
                let ok = data.get("success").and_then(Value::as_bool).unwrap_or(true);
                let out = if ok {
                    at("result", "content").map(|v| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())).unwrap_or_default()
                } else {
                    *counts.entry("tool results that are errors".into()).or_insert(0) += 1;
                    let why = at("error", "message").and_then(Value::as_str).or_else(|| at("result", "content").and_then(Value::as_str)).unwrap_or("");
                    format!("error: {why}")
                };
                t.push(Normalized::new(Message { tool_call_id: id, ..Message::text("tool", out) }), meta);
            }
            "session.task_complete" | "session.shutdown" => {
                done = true;
                *counts.entry(format!("{kind} events")).or_insert(0) += 1;
            }
            "" => *counts.entry("events without a type".into()).or_insert(0) += 1,
            other => *counts.entry(format!("{other} events")).or_insert(0) += 1,
        }
    }
    emit_event_session(sink, &session, t, done, counts, records.len(), "event stream has no assistant message")
}
