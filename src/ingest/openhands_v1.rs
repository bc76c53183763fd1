//! OpenHands V1 (software-agent-sdk) event streams, one event per line with the class name in
//! `kind`: `--format openhands-v1`.
//!
//! From the SDK's event classes (`openhands-sdk/openhands/sdk/event/`, read, not copied):
//! - `SystemPromptEvent` → the system message (`system_prompt.text`; `tools` → the turn's tools);
//! - `MessageEvent` → `llm_message` (`role`, content parts) — an agent message is a turn;
//! - `ActionEvent` → an assistant message: `thought[]` text, `reasoning_content`, and the call
//!   `tool_call {id, name, arguments}`; actions sharing `llm_response_id` are the parallel calls of one
//!   response, so one turn;
//! - `ObservationEvent` (`observation.content[]`), `UserRejectObservation` (`rejection_reason`) and
//!   `AgentErrorEvent` (`error`) → the `tool` message answering `tool_call_id`: the next state of the
//!   call. An observation whose call is not in the file (a slice of a longer run) is counted as an
//!   orphan and left out (no turn of this file made that call);
//! - `CondensationSummaryEvent` → a user message with the summary;
//! - `ConversationStateUpdateEvent` with `key = "execution_status"` and value `finished` marks the
//!   session done; every other kind (state updates, pauses, condensations, hooks) is counted.
//!
//! Input: JSONL of events, or the SDK's persisted events folder (`<conversation>/events/`, one
//! `event-<index>-<id>.json` file per event, read in index order; a file that is not one JSON object
//! is a dead letter). Session id = `openhands-v1:<file stem>`, or `openhands-v1:<conversation folder>`
//! for an events folder. The session is held in memory while it is read.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{normalize_with_role, Normalized};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::schema::{Message, ToolCall};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let (records, session_id) = if path.is_dir() {
        let conv = path.parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| sink.stem.clone());
        (event_files(path, sink, progress)?, format!("openhands-v1:{conv}"))
    } else {
        (super::sink::jsonl_objects(path, sink, progress)?, format!("openhands-v1:{}", sink.stem))
    };
    let mut t = Trajectory::default();
    let mut by_response: HashMap<String, usize> = HashMap::new();
    let mut calls: HashSet<String> = HashSet::new();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut finished = false;
    for (n, e) in &records {
        let kind = e.get("kind").and_then(Value::as_str).unwrap_or("");
        let meta = MessageMeta { event_time: e.get("timestamp").and_then(parse_timestamp), line: Some(*n), ..MessageMeta::default() };
        let text_of = |v: Option<&Value>| -> String {
            match v {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o.get("text").and_then(Value::as_str).unwrap_or("").to_string(),
                Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str())).collect::<Vec<_>>().join("\n"),
                _ => String::new(),
            }
        };
        match kind {
            "SystemPromptEvent" => {
                t.push(Normalized::new(Message::text("system", text_of(e.get("system_prompt")))), meta);
                if let Some(tools) = e.get("tools").filter(|v| !v.is_null()) {
                    t.tools = Some(tools.to_string());
                }
            }
            "MessageEvent" => {
                let Some(m) = e.get("llm_message").and_then(Value::as_object) else {
                    sink.dead_in_session(Some(*n), &session_id, "missing_message", format!("line {n}: MessageEvent without `llm_message`"), &serde_json::to_vec(e)?)?;
                    continue;
                };
                match super::normalize::normalize_message(&Value::Object(m.clone())) {
                    Ok(nm) => {
                        for tc in &nm.message.tool_calls {
                            calls.extend(tc.id.clone());
                        }
                        t.push(nm, meta)
                    }
                    Err(err) => sink.dead_in_session(Some(*n), &session_id, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(e)?)?,
                }
            }
            "ActionEvent" => {
                let call_obj = e.get("tool_call").and_then(Value::as_object);
                let call_id = e.get("tool_call_id").and_then(Value::as_str).or_else(|| call_obj.and_then(|c| c.get("id")).and_then(Value::as_str)).map(str::to_string);
                let name = call_obj.and_then(|c| c.get("name")).and_then(Value::as_str).or_else(|| e.get("tool_name").and_then(Value::as_str)).unwrap_or("").to_string();
                let raw = call_obj.and_then(|c| c.get("arguments")).cloned().unwrap_or(Value::Null);
                let mut call_map = Map::new();
                call_map.insert("name".into(), Value::String(name));
                call_map.insert("arguments".into(), raw);
                if let Some(id) = &call_id {
                    call_map.insert("id".into(), Value::String(id.clone()));
                    calls.insert(id.clone());
                }
                let mut msg = Map::new();
                msg.insert("content".into(), Value::String(text_of(e.get("thought"))));
                if let Some(r) = e.get("reasoning_content").filter(|v| !v.is_null()) {
                    msg.insert("reasoning_content".into(), r.clone());
                }
                msg.insert("tool_calls".into(), Value::Array(vec![Value::Object(call_map)]));
                let nm = match normalize_with_role(&msg, "assistant", None) {
                    Ok(nm) => nm,
                    Err(err) => {
                        sink.dead_in_session(Some(*n), &session_id, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(e)?)?;
                        continue;
                    }
                };
                let response = e.get("llm_response_id").and_then(Value::as_str).map(str::to_string);
                if let Some(&i) = response.as_ref().and_then(|r| by_response.get(r)) {
                    // A parallel call of a response already seen.
                    let extra: Vec<ToolCall> = nm.message.tool_calls;
                    t.messages[i].tool_calls.extend(extra);
                    t.meta[i].notes.extend(nm.notes);
                    *counts.entry("parallel actions merged into their response".into()).or_insert(0) += 1;
                    continue;
                }
                if let Some(r) = response {
                    by_response.insert(r, t.messages.len());
                }
                t.push(nm, meta);
            }
            "ObservationEvent" | "UserRejectObservation" | "AgentErrorEvent" => {
                let call_id = e.get("tool_call_id").and_then(Value::as_str).map(str::to_string);
                if !call_id.as_ref().is_some_and(|c| calls.contains(c)) {
                    *counts.entry("orphan observations (their action is not in the file)".into()).or_insert(0) += 1;
                    continue;
                }
                let text = match kind {
                    "ObservationEvent" => {
                        let obs = e.get("observation");
                        text_of(obs.and_then(|o| o.get("content")))
                    }
                    "UserRejectObservation" => format!("rejected: {}", e.get("rejection_reason").and_then(Value::as_str).unwrap_or("")),
                    _ => e.get("error").and_then(Value::as_str).unwrap_or("").to_string(),
                };
                if kind != "ObservationEvent" || e.get("observation").and_then(|o| o.get("is_error")).and_then(Value::as_bool) == Some(true) {
                    *counts.entry("tool results that are errors or rejections".into()).or_insert(0) += 1;
                }
                let name = e.get("tool_name").and_then(Value::as_str).map(str::to_string);
                t.push(Normalized::new(Message { tool_call_id: call_id, name, ..Message::text("tool", text) }), meta);
            }
            "CondensationSummaryEvent" => {
                t.push(Normalized::new(Message::text("user", e.get("summary").and_then(Value::as_str).unwrap_or(""))), meta);
            }
            "ConversationStateUpdateEvent" => {
                if e.get("key").and_then(Value::as_str) == Some("execution_status") && e.get("value").and_then(Value::as_str) == Some("finished") {
                    finished = true;
                }
                *counts.entry("ConversationStateUpdateEvent events".into()).or_insert(0) += 1;
            }
            "" => *counts.entry("events without a kind".into()).or_insert(0) += 1,
            other => *counts.entry(format!("{other} events")).or_insert(0) += 1,
        }
    }
    emit_event_session(sink, &session_id, t, finished, counts, records.len(), "event stream has no agent turn")
}

/// The index of an OpenHands V1 persisted event file name, `event-<index, 5+ digits>-<event id>.json`.
pub(crate) fn event_file_index(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("event-")?.strip_suffix(".json")?;
    let (idx, id) = rest.split_once('-')?;
    (idx.len() >= 5 && !id.is_empty() && idx.bytes().all(|b| b.is_ascii_digit())).then(|| idx.parse().ok()).flatten()
}

/// Whether `dir` is an OpenHands V1 events folder (it holds `event-NNNNN-<id>.json` files): one
/// conversation, read as a whole by `--format openhands-v1`.
pub fn is_event_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()).any(|e| event_file_index(&e.file_name().to_string_lossy()).is_some())).unwrap_or(false)
}

/// The events of a persisted events folder in index order, each with its index as record number.
fn event_files(dir: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<Vec<super::sink::Record>> {
    let rd = std::fs::read_dir(dir).map_err(|e| crate::Error::io("read", dir, e))?;
    let mut files: Vec<(u64, std::path::PathBuf)> =
        rd.filter_map(|e| e.ok()).filter_map(|e| event_file_index(&e.file_name().to_string_lossy()).map(|i| (i, e.path()))).collect();
    files.sort();
    let mut out = vec![];
    let mut bytes = 0u64;
    for (i, p) in files {
        sink.record_read();
        let b = std::fs::read(&p).map_err(|e| crate::Error::io("read", &p, e))?;
        bytes += b.len() as u64;
        progress(bytes);
        match serde_json::from_slice::<Value>(b.strip_prefix(super::stream::UTF8_BOM).unwrap_or(&b)) {
            Ok(Value::Object(o)) => out.push((i as i64, o)),
            Ok(_) | Err(_) => sink.dead(Some(i as i64), "malformed_json", format!("{}: not one JSON event object", p.display()), &b[..b.len().min(1 << 16)])?,
        }
    }
    sink.set_bytes(bytes);
    Ok(out)
}
