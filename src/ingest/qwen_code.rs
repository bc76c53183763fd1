//! Qwen Code chat recordings (`~/.qwen/projects/<project>/chats/<sessionId>.jsonl`, earlier
//! `~/.qwen/tmp/<project hash>/chats/`): `--format qwen-code`. Read from QwenLM/qwen-code
//! `packages/core/src/services/chatRecordingService.ts` (the `ChatRecord` type and
//! `recordUserMessage`/`recordAssistantTurn`/`recordToolResult`/`recordChatCompression`),
//! `sessionService.ts` (`reconstructHistory`, `aggregateRecords`, `buildApiHistoryFromConversation`)
//! and `utils/conversation-chain.ts`.
//!
//! One `ChatRecord` a line: `{uuid, parentUuid, sessionId, timestamp, type, subtype?, cwd, version,
//! message?: {role, parts}, model?, usageMetadata?, toolCallResult?, systemPayload?}`; `message` is a
//! Gemini `Content` whose parts the shared normaliser reads (`text`, `thought` text, `functionCall`,
//! `functionResponse`). Read the way the CLI resumes a session:
//! - records sharing a `uuid` are one message (the CLI may write a message in pieces): their parts
//!   are joined in file order, the first `model` and `parentUuid` kept; one model response is one
//!   turn however many records it spans;
//! - the conversation is the chain of `parentUuid` links from the last record back to the root;
//!   records off that chain (a branch the user rewound away) are counted, not read;
//! - `user` → a user message; `assistant` → an assistant message, one turn, its `functionCall` parts
//!   its tool calls; `tool_result` → the `tool` messages of its `functionResponse` parts (`response:
//!   {output}` or `{error}`), each answering its call by id: the call's next state. A result whose
//!   call is not in the conversation, or that was already given, is counted and left out;
//! - `system` with subtype `chat_compression`: the model's history was replaced by
//!   `systemPayload.compressedHistory` (summary turns + kept tail). The turns before it are emitted
//!   then, with the messages after their last turn as its next state; the turns after it see the
//!   compressed history (its model messages are context, never turns) and number on. Every other
//!   `system` record (`slash_command`, `ui_telemetry`, `custom_title`, ...) is counted.
//!
//! Session id = `qwen-code:<sessionId>` (else the file stem). The file has no end marker: the
//! session is never `session_done`, and the messages after the last turn are its next state. A line
//! that is not a JSON object is a dead letter and the rest of the file is read; a message the
//! normaliser rejects is a dead letter and left out. The session is held in memory while it is read.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::normalize_with_role;
use super::openclaw_session::active_path;
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, emit_event_session, MessageMeta, Trajectory};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let session = records.iter().find_map(|(_, r)| r.get("sessionId").and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string));
    let session = format!("qwen-code:{}", session.unwrap_or_else(|| sink.stem.clone()));
    let messages = aggregate(&records);
    let view: Vec<(i64, &Map<String, Value>)> = messages.iter().map(|(n, m)| (*n, m)).collect();
    let chain = active_path(&view, "uuid", "parentUuid");
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut count = |what: &str, n: u64| {
        if n > 0 {
            *counts.entry(what.to_string()).or_insert(0) += n;
        }
    };
    count("records sharing a uuid with an earlier one (joined to it)", (records.len() - messages.len()) as u64);
    count("messages on abandoned branches (off the parentUuid chain of the last record)", (messages.len() - chain.len()) as u64);
    let mut t = Trajectory::default();
    let mut calls: HashSet<String> = HashSet::new();
    let mut answered: HashSet<String> = HashSet::new();
    let mut emitted = 0usize;
    for i in chain {
        let (n, rec) = (messages[i].0, &messages[i].1);
        let kind = rec.get("type").and_then(Value::as_str).unwrap_or("");
        let subtype = rec.get("subtype").and_then(Value::as_str).unwrap_or("");
        let meta = MessageMeta { event_time: rec.get("timestamp").and_then(parse_timestamp), line: Some(n), ..MessageMeta::default() };
        let mut raw = Map::new();
        raw.insert("content".into(), rec.get("message").and_then(|m| m.get("parts")).cloned().unwrap_or(Value::Null));
        match (kind, subtype) {
            ("user" | "assistant" | "tool_result", _) => {
                let role = if kind == "assistant" { "assistant" } else { "user" };
                let mut nm = match normalize_with_role(&raw, role, None) {
                    Ok(nm) => nm,
                    Err(err) => {
                        sink.dead_in_session(Some(n), &session, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(rec)?)?;
                        continue;
                    }
                };
                if kind == "assistant" {
                    calls.extend(nm.message.tool_calls.iter().filter_map(|c| c.id.clone()));
                    let model = rec.get("model").and_then(Value::as_str).map(str::to_string);
                    t.push(nm, MessageMeta { model, ..meta });
                    continue;
                }
                let results = nm.before.len();
                nm.before.retain(|m| m.tool_call_id.as_ref().is_none_or(|id| calls.contains(id)));
                count("orphan tool results (their call is not in the conversation)", (results - nm.before.len()) as u64);
                let fresh = nm.before.len();
                nm.before.retain(|m| m.tool_call_id.as_ref().is_none_or(|id| answered.insert(id.clone())));
                count("tool results given again (kept once)", (fresh - nm.before.len()) as u64);
                if nm.before.is_empty() && nm.message.content.trim().is_empty() && nm.message.reasoning.is_none() {
                    continue;
                }
                t.push(nm, meta);
            }
            ("system", "chat_compression") => {
                count("chat compression checkpoints", 1);
                let history = rec.get("systemPayload").and_then(|p| p.get("compressedHistory")).and_then(Value::as_array);
                let Some(history) = history else { continue };
                t.tail_is_next_state = true;
                emitted += emit(sink, &session, &t, Some(1))?;
                t = Trajectory { first_turn: emitted as i32, ..Trajectory::default() };
                for content in history {
                    let mut raw = Map::new();
                    raw.insert("content".into(), content.get("parts").cloned().unwrap_or(Value::Null));
                    let role = if content.get("role").and_then(Value::as_str) == Some("model") { "assistant" } else { "user" };
                    match normalize_with_role(&raw, role, None) {
                        // The compressed history restates earlier turns: context, never a turn again.
                        Ok(nm) => t.push(nm, MessageMeta { not_turn: true, ..meta.clone() }),
                        Err(err) => count(&format!("compressed history messages not read ({})", err.code()), 1),
                    }
                }
            }
            ("system", other) => count(&format!("system records ({})", if other.is_empty() { "no subtype" } else { other }), 1),
            (other, _) => count(&format!("records of type {other:?} (not read)"), 1),
        }
    }
    let records = if emitted > 0 { 0 } else { records.len() };
    emit_event_session(sink, &session, t, false, counts, records, "chat recording has no assistant message")
}

/// The records joined by `uuid` (the CLI's `aggregateRecords`), in order of first appearance, each
/// with the line of its first record: `message.parts` concatenated, the first `model` and
/// `parentUuid` kept, the latest `timestamp`. A record without a `uuid` stands alone.
fn aggregate(records: &[(i64, Map<String, Value>)]) -> Vec<(i64, Map<String, Value>)> {
    let mut out: Vec<(i64, Map<String, Value>)> = vec![];
    let mut at: HashMap<String, usize> = HashMap::new();
    for (n, r) in records {
        let Some(uuid) = r.get("uuid").and_then(Value::as_str) else {
            out.push((*n, r.clone()));
            continue;
        };
        let Some(&i) = at.get(uuid) else {
            at.insert(uuid.to_string(), out.len());
            out.push((*n, r.clone()));
            continue;
        };
        let base = &mut out[i].1;
        let more: Vec<Value> = r.get("message").and_then(|m| m.get("parts")).and_then(Value::as_array).cloned().unwrap_or_default();
        match base.get_mut("message").and_then(|m| m.get_mut("parts")).and_then(Value::as_array_mut) {
            Some(parts) => parts.extend(more),
            None => {
                if let Some(m) = r.get("message") {
                    base.insert("message".into(), m.clone());
                }
            }
        }
        for key in ["model", "toolCallResult"] {
            if base.get(key).is_none_or(Value::is_null) {
                if let Some(v) = r.get(key) {
                    base.insert(key.into(), v.clone());
                }
            }
        }
        if let (Some(a), Some(b)) = (base.get("timestamp").and_then(Value::as_str), r.get("timestamp").and_then(Value::as_str)) {
            if b > a {
                base.insert("timestamp".into(), Value::String(b.to_string()));
            }
        }
    }
    out
}
