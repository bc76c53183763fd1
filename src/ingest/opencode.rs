//! OpenCode session storage (`~/.local/share/opencode/storage/`): `--format opencode`. Read from
//! sst/opencode `packages/opencode/src/session/message-v2.ts` (`Info` = `User` | `Assistant`, `Part`,
//! `ToolState`, `toModelMessage`) and `src/storage/storage.ts` (one JSON file per record).
//!
//! A session is a folder of files, so the input is a folder: `message/<session id>/` holds one
//! `<message id>.json` per message (`{id, sessionID, role, time: {created (ms)}, ...}`; assistant
//! messages add `modelID`, `providerID`, `finish`, `error`, `summary`) and the parts of each message are
//! `part/<message id>/<part id>.json` beside it (`../../part/`). Ids sort in creation order, so messages
//! and parts are read in file-name order. `nextstate ingest` reads such a message folder given on the
//! command line, and a walk over the storage folder (one holding `message/` and `part/`) reads each
//! `message/<session id>/` as one input and nothing else there (session, project, diff and todo files
//! are not logs). A single message file given on the command line reads its folder when it sits in one,
//! else that message alone. Session id = `opencode:<session id>`.
//!
//! Parts, as `toModelMessage` sends them to the model:
//! - user: `text` (not `ignored`; `synthetic` text, e.g. a file's contents, included), a `compaction`
//!   part as the text "What did we do so far?"; `file` and other parts counted;
//! - assistant: one message holds the model's steps, each opened by a `step-start` part: every step
//!   with content is one turn (one model response) — its `text`, its `reasoning` (as reasoning) and its
//!   `tool` parts `{callID, tool, state: {status, input, output | error}}` as tool calls, each answered
//!   by a `tool` message right after it: the `output` of a `completed` call ("[Old tool result content
//!   cleared]" once `time.compacted`), `error: <error>` for an `error` one; a `pending`/`running` call
//!   (interrupted) is counted and left out. An assistant message with an `error` is not sent again
//!   (counted), unless it was aborted after writing something.
//! - an assistant message with `summary: true` closes a segment (a compaction): the turns before it are
//!   emitted with the messages after the last one as its next state, and the later turns see only the
//!   compaction request, the summary and what follows, as OpenCode sends them.
//!
//! A file that is not a JSON object is a dead letter and the rest is read. The storage has no end
//! marker: the session is never `session_done`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::normalize::{normalize_with_role, Normalized};
use super::sink::Sink;
use super::trajectory::{emit, emit_event_session, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

/// Whether `dir` is an OpenCode `message/<session id>/` folder: inside a `message` folder whose
/// storage folder also holds `part/`, with at least one `msg_*.json` file.
pub fn is_message_dir(dir: &Path) -> bool {
    let in_storage = dir.parent().is_some_and(|m| m.file_name().is_some_and(|n| n == "message") && m.parent().is_some_and(|s| s.join("part").is_dir()));
    in_storage && json_files(dir).iter().any(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("msg_")))
}

/// The session folders of an OpenCode storage folder (one holding `message/` and `part/`), sorted;
/// `None` when `dir` is not one.
pub fn storage_sessions(dir: &Path) -> Option<Vec<PathBuf>> {
    if !(dir.join("message").is_dir() && dir.join("part").is_dir()) {
        return None;
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir.join("message")).ok()?.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| is_message_dir(p)).collect();
    out.sort();
    Some(out)
}

/// The `.json` files of `dir` in name order (none when it cannot be read).
fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "json") && p.is_file()).collect()).unwrap_or_default();
    out.sort();
    out
}

/// Reads each file as one JSON object (record number = its place in `files`, from 1); others are
/// dead letters.
fn objects(files: &[PathBuf], sink: &mut Sink<'_>, bytes: &mut u64, progress: &mut dyn FnMut(u64)) -> Result<Vec<(i64, Map<String, Value>)>> {
    let mut out = vec![];
    for (i, p) in files.iter().enumerate() {
        let n = i as i64 + 1;
        sink.record_read();
        let b = std::fs::read(p).map_err(|e| crate::Error::io("read", p, e))?;
        *bytes += b.len() as u64;
        progress(*bytes);
        match serde_json::from_slice::<Value>(b.strip_prefix(super::stream::UTF8_BOM).unwrap_or(&b)) {
            Ok(Value::Object(o)) => out.push((n, o)),
            Ok(_) | Err(_) => sink.dead(Some(n), "malformed_json", format!("{}: not one JSON object", p.display()), &b[..b.len().min(1 << 16)])?,
        }
    }
    Ok(out)
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let dir = if path.is_dir() { Some(path) } else { path.parent().filter(|d| is_message_dir(d)) };
    let files = dir.map(json_files).unwrap_or_else(|| vec![path.to_path_buf()]);
    let session = format!("opencode:{}", dir.and_then(Path::file_name).map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| sink.stem.clone()));
    let part_root = dir.and_then(Path::parent).and_then(Path::parent).map(|s| s.join("part"));
    let mut bytes = 0u64;
    let messages = objects(&files, sink, &mut bytes, progress)?;

    let mut t = Trajectory::default();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut count = |what: &str| *counts.entry(what.to_string()).or_insert(0) += 1;
    let mut emitted = 0usize;
    for (n, info) in &messages {
        let id = info.get("id").and_then(Value::as_str).unwrap_or("");
        let part_files = part_root.as_ref().filter(|_| !id.is_empty()).map(|r| json_files(&r.join(id))).unwrap_or_default();
        let parts: Vec<Map<String, Value>> = objects(&part_files, sink, &mut bytes, progress)?.into_iter().map(|(_, p)| p).collect();
        if parts.is_empty() {
            count("messages without parts");
            continue;
        }
        let meta = MessageMeta { line: Some(*n), event_time: info.get("time").and_then(|t| t.get("created")).and_then(Value::as_i64), ..MessageMeta::default() };
        match info.get("role").and_then(Value::as_str) {
            Some("user") => {
                let mut text: Vec<&str> = vec![];
                for p in &parts {
                    match p.get("type").and_then(Value::as_str) {
                        Some("text") if p.get("ignored") == Some(&Value::Bool(true)) => count("ignored text parts (not sent)"),
                        Some("text") => text.extend(p.get("text").and_then(Value::as_str)),
                        Some("compaction") => text.push("What did we do so far?"),
                        Some(other) => count(&format!("user {other} parts (not read)")),
                        None => count("parts without a type"),
                    }
                }
                t.push(Normalized::new(Message::text("user", text.join("\n"))), meta);
            }
            Some("assistant") => {
                if let Some(err) = info.get("error") {
                    let aborted = err.get("name").and_then(Value::as_str) == Some("MessageAbortedError");
                    let wrote = parts.iter().any(|p| !matches!(p.get("type").and_then(Value::as_str), Some("step-start" | "reasoning")));
                    if !(aborted && wrote) {
                        count("assistant messages with an error (not sent again)");
                        continue;
                    }
                }
                let summary = info.get("summary") == Some(&Value::Bool(true));
                if summary {
                    // A compaction: the turns so far end here; later requests hold only the compaction
                    // request (the last user message) and the summary onwards.
                    count("compaction summaries (context, not turns)");
                    t.tail_is_next_state = true;
                    emitted += emit(sink, &session, &t, Some(1))?;
                    let keep = t.messages.pop().zip(t.meta.pop()).filter(|(m, _)| m.role == "user");
                    t = Trajectory { first_turn: emitted as i32, ..Trajectory::default() };
                    if let Some((m, meta)) = keep {
                        t.push(Normalized::new(m), meta);
                    }
                }
                let model = match (info.get("providerID").and_then(Value::as_str), info.get("modelID").and_then(Value::as_str)) {
                    (Some(p), Some(m)) => Some(format!("{p}/{m}")),
                    (None, Some(m)) => Some(m.to_string()),
                    _ => None,
                };
                for step in steps(&parts) {
                    let (blocks, results) = step_blocks(&step, &mut count);
                    if blocks.is_empty() {
                        continue;
                    }
                    let mut msg = Map::new();
                    msg.insert("content".into(), Value::Array(blocks));
                    match normalize_with_role(&msg, "assistant", None) {
                        Ok(nm) => t.push(nm, MessageMeta { model: model.clone(), not_turn: summary, ..meta.clone() }),
                        Err(err) => {
                            sink.dead_in_session(Some(*n), &session, err.code(), format!("message {id}: {err}"), &serde_json::to_vec(info)?)?;
                            continue;
                        }
                    }
                    for r in results {
                        t.push(Normalized::new(r), meta.clone());
                    }
                }
            }
            _ => count("messages without a user/assistant role"),
        }
    }
    sink.set_bytes(bytes);
    let records = if emitted > 0 { 0 } else { messages.len() };
    emit_event_session(sink, &session, t, false, counts, records, "session has no assistant step")
}

/// The parts of an assistant message split at its `step-start` parts (parts before the first one are
/// a step of their own).
fn steps(parts: &[Map<String, Value>]) -> Vec<Vec<&Map<String, Value>>> {
    let mut out: Vec<Vec<&Map<String, Value>>> = vec![vec![]];
    for p in parts {
        if p.get("type").and_then(Value::as_str) == Some("step-start") {
            out.push(vec![]);
        } else if let Some(last) = out.last_mut() {
            last.push(p);
        }
    }
    out
}

/// One step's content blocks in the shape the normaliser reads (text, thinking, tool_use) and the
/// `tool` messages answering its calls.
fn step_blocks(step: &[&Map<String, Value>], count: &mut dyn FnMut(&str)) -> (Vec<Value>, Vec<Message>) {
    let (mut blocks, mut results) = (vec![], vec![]);
    for p in step {
        let s = |k: &str| p.get(k).and_then(Value::as_str);
        match s("type") {
            Some("text") if p.get("ignored") != Some(&Value::Bool(true)) => blocks.push(json!({"type": "text", "text": s("text").unwrap_or("")})),
            Some("reasoning") => blocks.push(json!({"type": "thinking", "thinking": s("text").unwrap_or("")})),
            Some("tool") => {
                let state = p.get("state");
                let st = |k: &str| state.and_then(|v| v.get(k));
                let output = match st("status").and_then(Value::as_str) {
                    Some("completed") if st("time").and_then(|t| t.get("compacted")).is_some_and(|c| !c.is_null()) => "[Old tool result content cleared]".to_string(),
                    Some("completed") => st("output").and_then(Value::as_str).unwrap_or("").to_string(),
                    Some("error") => format!("error: {}", st("error").and_then(Value::as_str).unwrap_or("")),
                    _ => {
                        count("tool calls pending or running (interrupted; left out)");
                        continue;
                    }
                };
                let id = s("callID").unwrap_or("");
                blocks.push(json!({"type": "tool_use", "id": id, "name": s("tool").unwrap_or(""), "input": st("input").cloned().unwrap_or(json!({}))}));
                results.push(Message { tool_call_id: Some(id.to_string()), name: s("tool").map(str::to_string), ..Message::text("tool", output) });
            }
            Some("step-finish" | "snapshot" | "patch") | Some("text") => {}
            Some(other) => count(&format!("assistant {other} parts (not read)")),
            None => count("parts without a type"),
        }
    }
    (blocks, results)
}
