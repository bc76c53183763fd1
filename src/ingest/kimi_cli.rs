//! Kimi CLI context files (`~/.kimi/sessions/<work dir hash>/<session id>/context.jsonl`; before
//! that `<session id>.jsonl` beside the others): `--format kimi-cli`. Read from MoonshotAI/kimi-cli
//! `src/kimi_cli/soul/context.py` (`Context.restore`, `checkpoint`, `revert_to`, `clear`),
//! `src/kimi_cli/session.py` and `packages/kosong/src/kosong/message.py` (the message model).
//!
//! One record a line, as `Context.restore` reads it:
//! - `{"role": "_system_prompt", "content"}`: the system prompt (the file's first line), a system
//!   message;
//! - `{"role": "_checkpoint", "id"}` and `{"role": "_usage", "token_count"}`: bookkeeping, counted;
//! - any other line is a kosong `Message` (`role` system/user/assistant/tool, `content` a string or
//!   parts — `text`, `think` (reasoning), `image_url`, ... —, `tool_calls` in the OpenAI shape with
//!   JSON-string arguments, `tool_call_id`), read by the shared normaliser. Each assistant message is
//!   one turn; a `tool` message answers its call by id (its next state); one whose call is not in the
//!   file is counted and left out. The `<system>CHECKPOINT n</system>` user messages the CLI writes
//!   for its D-Mail checkpoints are context the model saw, kept as user messages.
//!
//! A rewind (`revert_to`) or a compaction (`clear` + the compacted messages) moves the old file aside
//! as `context_<n>.jsonl` and starts a new one, so each file is one linear history; a moved-aside file
//! is its own session. Session id = `kimi-cli:<session id>` (the folder of `context.jsonl`;
//! `kimi-cli:<session id>:context_<n>` for a moved-aside file; else the file stem). The file has no end
//! marker: the session is never `session_done`, and the messages after the last turn are its next
//! state. A line that is not a JSON object is a dead letter and the rest of the file is read; a message
//! the normaliser rejects is a dead letter and left out.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

use super::normalize::{normalize_message, Normalized};
use super::sink::Sink;
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let folder = path.parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned());
    let stem = sink.stem.clone();
    let session = match folder {
        Some(f) if stem == "context" => format!("kimi-cli:{f}"),
        Some(f) if stem.starts_with("context_") => format!("kimi-cli:{f}:{stem}"),
        _ => format!("kimi-cli:{stem}"),
    };
    let mut t = Trajectory::default();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut calls: HashSet<String> = HashSet::new();
    for (n, r) in &records {
        let meta = MessageMeta { line: Some(*n), ..MessageMeta::default() };
        match r.get("role").and_then(Value::as_str) {
            Some("_system_prompt") => {
                let prompt = r.get("content").and_then(Value::as_str).unwrap_or("");
                t.push(Normalized::new(Message::text("system", prompt)), meta);
                continue;
            }
            Some(book @ ("_checkpoint" | "_usage")) => {
                *counts.entry(format!("{book} records")).or_insert(0) += 1;
                continue;
            }
            _ => {}
        }
        let nm = match normalize_message(&Value::Object(r.clone())) {
            Ok(nm) => nm,
            Err(err) => {
                sink.dead_in_session(Some(*n), &session, err.code(), format!("line {n}: {err}"), &serde_json::to_vec(r)?)?;
                continue;
            }
        };
        match nm.message.role.as_str() {
            "assistant" => calls.extend(nm.message.tool_calls.iter().filter_map(|c| c.id.clone())),
            "tool" if !nm.message.tool_call_id.as_ref().is_some_and(|id| calls.contains(id)) => {
                *counts.entry("orphan tool results (their call is not in the file)".into()).or_insert(0) += 1;
                continue;
            }
            _ => {}
        }
        t.push(nm, meta);
    }
    emit_event_session(sink, &session, t, false, counts, records.len(), "context file has no assistant message")
}
