//! OpenAI Codex CLI rollouts (`~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl[.zst]`): `--format codex`.
//!
//! From codex-rs `protocol/src/protocol.rs` (`RolloutLine`, `RolloutItem`) and `models.rs`
//! (`ResponseItem`), read, not copied:
//! - each line is `{timestamp, type, payload}` with `type` = `session_meta` (`payload.id` = the
//!   session id, `instructions`/`base_instructions.text` = the system message), `response_item` (the
//!   model-visible history: messages, reasoning, function calls and their outputs, read by
//!   [`super::items`]: consecutive assistant-side items are one turn, outputs are `tool` messages
//!   answering `call_id`), `turn_context` (the model of the following turns), `compacted` (`message`
//!   and optional `replacement_history`: the turns after it see that history, or the summary as a
//!   user message; the last turn before it gets what followed it as its next state) or `event_msg`;
//! - `event_msg` lines repeat response items for the UI (`user_message`, `agent_message`,
//!   `agent_reasoning`, ...): they are counted by type and never read as messages, so nothing is
//!   counted twice;
//! - the older layout without the envelope (a first line `{id, timestamp, instructions}` without
//!   `type`, then bare response items, and `{"record_type": "state"}` lines) is read too;
//! - unknown line and item types are counted.
//!
//! The session is held in memory while the file is read; `session_done` is never set.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::items::Items;
use super::normalize::Normalized;
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let mut session_id: Option<String> = None;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut t = Trajectory::default();
    let mut items = Items::default();
    let mut model: Option<String> = None;
    let mut emitted = 0i32;
    for (n, r) in &records {
        let time = r.get("timestamp").and_then(parse_timestamp);
        let (ty, payload) = match (r.get("type").and_then(Value::as_str), r.get("payload")) {
            (Some(ty), Some(p)) => (ty, p),
            _ if r.contains_key("record_type") => {
                *counts.entry("state lines (older layout)".into()).or_insert(0) += 1;
                continue;
            }
            // Older layout: the first line is the session meta, the others bare response items.
            _ if session_id.is_none() && r.contains_key("id") && !r.contains_key("type") => ("session_meta", &Value::Object(r.clone())),
            _ => ("response_item", &Value::Object(r.clone())),
        };
        match ty {
            "session_meta" => {
                session_id = session_id.or_else(|| payload.get("id").and_then(Value::as_str).map(str::to_string));
                let instructions = payload.get("instructions").and_then(Value::as_str).or_else(|| payload.pointer("/base_instructions/text").and_then(Value::as_str));
                if let Some(s) = instructions.filter(|s| !s.is_empty()) {
                    flush(&mut t, &mut items, &mut counts);
                    t.push(Normalized::new(Message::text("system", s)), MessageMeta { event_time: time, line: Some(*n), ..MessageMeta::default() });
                }
            }
            "response_item" => {
                if let Err(e) = items.push_at(payload, (*n, time, model.clone())) {
                    let sid = session_id.clone().unwrap_or_else(|| sink.stem.clone());
                    sink.dead_in_session(Some(*n), &sid, e.code(), format!("line {n}: {e}"), &serde_json::to_vec(r)?)?;
                    continue;
                }
            }
            "turn_context" => {
                if let Some(m) = payload.get("model").and_then(Value::as_str) {
                    model = Some(m.to_string());
                }
                *counts.entry("turn_context lines".into()).or_insert(0) += 1;
            }
            "compacted" => {
                flush(&mut t, &mut items, &mut counts);
                let sid = session_id.clone().unwrap_or_else(|| sink.stem.clone());
                let mut done = std::mem::take(&mut t);
                done.first_turn = emitted;
                done.tail_is_next_state = true;
                emitted += emit(sink, &sid, &done, Some(*n))? as i32;
                *counts.entry("compactions".into()).or_insert(0) += 1;
                let meta = MessageMeta { event_time: time, line: Some(*n), not_turn: true, ..MessageMeta::default() };
                match payload.get("replacement_history").and_then(Value::as_array) {
                    Some(h) if !h.is_empty() => {
                        let mut b = Items::default();
                        for it in h {
                            if b.push(it).is_err() {
                                *counts.entry("unreadable replacement history items".into()).or_insert(0) += 1;
                            }
                        }
                        let (ms, _) = b.finish();
                        for (m, _) in ms {
                            t.push(m, meta.clone());
                        }
                    }
                    _ => {
                        let summary = payload.get("message").and_then(Value::as_str).unwrap_or("");
                        t.push(Normalized::new(Message::text("user", summary)), meta);
                    }
                }
            }
            "event_msg" => {
                let et = payload.get("type").and_then(Value::as_str).unwrap_or("untyped");
                *counts.entry(format!("event_msg lines ({et})")).or_insert(0) += 1;
            }
            other => *counts.entry(format!("{other} lines")).or_insert(0) += 1,
        }
    }
    flush(&mut t, &mut items, &mut counts);
    for (k, v) in &counts {
        sink.count(k, *v);
    }
    let sid = session_id.unwrap_or_else(|| sink.stem.clone());
    t.first_turn = emitted;
    t.tail_is_next_state = true;
    if emit(sink, &sid, &t, Some(1))? == 0 && emitted == 0 && !records.is_empty() {
        sink.dead_in_session(None, &sid, "no_assistant_turn", "rollout has no assistant message", b"")?;
    }
    Ok(())
}

/// Moves the messages built from the items read so far into the trajectory; each message gets the
/// line and time of its first item (assistant messages: the model of the turn context then).
fn flush(t: &mut Trajectory, items: &mut Items, counts: &mut BTreeMap<String, u64>) {
    let (ms, skipped) = std::mem::take(items).finish();
    for (k, v) in skipped {
        *counts.entry(k).or_insert(0) += v;
    }
    for (m, (line, time, model)) in ms {
        let is_assistant = m.message.role == "assistant";
        let meta = MessageMeta {
            event_time: time,
            line: Some(line),
            model: if is_assistant { model } else { None },
            finish_reason: if is_assistant { Some(if m.message.tool_calls.is_empty() { "stop" } else { "tool_calls" }.to_string()) } else { None },
            ..MessageMeta::default()
        };
        t.push(m, meta);
    }
}
