//! Claude Code session transcripts (`~/.claude/projects/<project>/<session>.jsonl` and the
//! subagents' `<session>/subagents/agent-<id>.jsonl`): `--format claude-code`.
//!
//! There is no published schema; this follows the files themselves (the sample in
//! `../shared/data/agent-logs-2026/`) and public parsers of them (claude-code-viewer's schemas):
//! - one JSON object per line with `type`: `user`, `assistant`, `system`, `summary`, `progress`,
//!   `file-history-snapshot`, `queue-operation` and metadata types; unknown types are counted;
//! - the conversation is in **line order** (Claude Code appends as it goes; its `parentUuid` links
//!   branch at parallel tool results, so the parent chain alone would lose all but one result);
//! - **one API response is written as several `assistant` lines**, one content block each, sharing
//!   `message.id`: they are merged into one assistant message (one turn) at the position of the
//!   first; `stop_reason` `tool_use` → finish reason `tool_calls`, `end_turn` → `stop`, `max_tokens`
//!   → `length` (truncated); assistant messages of model `<synthetic>` (written by the CLI, e.g. after
//!   an API error) are context but not turns;
//! - tool results come back in `user` lines as `tool_result` blocks: each is a `tool` message (the
//!   next state of its `tool_use`); other user text is a user message (`isMeta` lines included: the
//!   CLI sends them to the model);
//! - `isSidechain` lines are their own session, `<sessionId>:sidechain`, and a subagent file
//!   (`subagents/agent-<id>.jsonl` or a line with `agentId`) is the session
//!   `<sessionId>:agent-<agentId>` (a note names the parent session);
//! - a `system` line of subtype `compact_boundary` ends a segment: the turns after it see the
//!   compact summary (the following `isCompactSummary` user line) and what follows; the last turn
//!   before it gets what followed it as its next state. Other `system` lines (local commands, hooks,
//!   API errors) are not model context and are counted by subtype; `summary` lines (titles) are
//!   counted.
//!
//! Each session of the file is held in memory while the file is read; `session_done` is never set.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::normalize_with_role;
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::Result;

/// One message of a session before normalisation (assistant fragments already merged).
struct Item {
    line: i64,
    time: Option<i64>,
    role: &'static str,
    message: Map<String, Value>,
    /// Starts a new segment (the compact summary after a `compact_boundary`).
    segment_start: bool,
}

#[derive(Default)]
struct Session {
    items: Vec<Item>,
    /// `message.id` → index of its merged assistant item.
    by_message_id: HashMap<String, usize>,
    parent: Option<String>,
    boundary_pending: bool,
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let file_agent = path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix("agent-"))
        .filter(|_| path.parent().and_then(|p| p.file_name()).is_some_and(|d| d == "subagents"))
        .map(str::to_string);
    let mut order: Vec<String> = vec![];
    let mut sessions: HashMap<String, Session> = HashMap::new();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut bump = |k: String| *counts.entry(k).or_insert(0) += 1;
    let fallback = records.iter().find_map(|(_, r)| r.get("sessionId").and_then(Value::as_str)).map(str::to_string).unwrap_or_else(|| sink.stem.clone());
    for (n, r) in &records {
        let ty = r.get("type").and_then(Value::as_str).unwrap_or("");
        let base = r.get("sessionId").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| fallback.clone());
        let agent = r.get("agentId").and_then(Value::as_str).map(str::to_string).or_else(|| file_agent.clone());
        let sidechain = r.get("isSidechain").and_then(Value::as_bool) == Some(true);
        let (key, parent) = match (&agent, sidechain) {
            (Some(a), _) if sidechain || file_agent.is_some() => (format!("{base}:agent-{a}"), Some(base.clone())),
            (_, true) => (format!("{base}:sidechain"), Some(base.clone())),
            _ => (base.clone(), None),
        };
        let time = r.get("timestamp").and_then(parse_timestamp);
        match ty {
            "user" | "assistant" => {
                let Some(m) = r.get("message").and_then(Value::as_object) else {
                    sink.dead_in_session(Some(*n), &key, "missing_message", format!("line {n}: {ty} line without a `message` object"), &serde_json::to_vec(r)?)?;
                    continue;
                };
                let s = session_mut(&mut sessions, &mut order, &key, &parent);
                let id = m.get("id").and_then(Value::as_str).filter(|_| ty == "assistant");
                if let Some(&i) = id.and_then(|id| s.by_message_id.get(id)) {
                    // A further content block of a response already seen.
                    let extra = m.get("content").and_then(Value::as_array).cloned().unwrap_or_default();
                    let it = &mut s.items[i];
                    match it.message.get_mut("content") {
                        Some(Value::Array(c)) => c.extend(extra),
                        _ => {
                            it.message.insert("content".into(), Value::Array(extra));
                        }
                    }
                    for k in ["stop_reason", "model"] {
                        if let Some(v) = m.get(k).filter(|v| !v.is_null()) {
                            it.message.insert(k.into(), v.clone());
                        }
                    }
                    bump("assistant lines merged into an earlier line of the same response".into());
                    continue;
                }
                let segment_start = s.boundary_pending && ty == "user";
                if segment_start {
                    s.boundary_pending = false;
                }
                if let Some(id) = id {
                    s.by_message_id.insert(id.to_string(), s.items.len());
                }
                s.items.push(Item { line: *n, time, role: if ty == "user" { "user" } else { "assistant" }, message: m.clone(), segment_start });
            }
            "system" => {
                let sub = r.get("subtype").and_then(Value::as_str).unwrap_or("none");
                if sub == "compact_boundary" {
                    session_mut(&mut sessions, &mut order, &key, &parent).boundary_pending = true;
                }
                bump(format!("system lines ({sub})"));
            }
            "" => bump("lines without a type".into()),
            other => bump(format!("{other} lines")),
        }
    }
    let mut c: Vec<(String, u64)> = counts.into_iter().collect();
    c.sort();
    for (k, v) in c {
        sink.count(&k, v);
    }
    for key in order {
        let s = sessions.remove(&key).expect("every ordered key has a session");
        session(sink, &key, s)?;
    }
    Ok(())
}

/// The session `key`, created (and its key appended to `order`) on first use.
fn session_mut<'a>(sessions: &'a mut HashMap<String, Session>, order: &mut Vec<String>, key: &str, parent: &Option<String>) -> &'a mut Session {
    if !sessions.contains_key(key) {
        order.push(key.to_string());
    }
    sessions.entry(key.to_string()).or_insert_with(|| Session { parent: parent.clone(), ..Session::default() })
}

fn session(sink: &mut Sink<'_>, key: &str, s: Session) -> Result<()> {
    let mut t = Trajectory::default();
    if let Some(p) = &s.parent {
        t.notes.push(format!("subagent session of Claude Code session {p}"));
    }
    let mut emitted = 0i32;
    let mut synthetic = 0u64;
    for it in s.items {
        if it.segment_start && !t.messages.is_empty() {
            let mut done = std::mem::take(&mut t);
            done.first_turn = emitted;
            done.tail_is_next_state = true;
            t.notes = done.notes.clone();
            emitted += emit(sink, key, &done, Some(it.line))? as i32;
        }
        let n = match normalize_with_role(&it.message, it.role, None) {
            Ok(n) => n,
            Err(e) => {
                sink.dead_in_session(Some(it.line), key, e.code(), format!("line {}: {e}", it.line), &serde_json::to_vec(&it.message)?)?;
                continue;
            }
        };
        let mut meta = MessageMeta { event_time: it.time, line: Some(it.line), ..MessageMeta::default() };
        if it.role == "assistant" {
            let model = it.message.get("model").and_then(Value::as_str);
            if model == Some("<synthetic>") {
                synthetic += 1;
                meta.not_turn = true;
            }
            meta.model = model.map(str::to_string);
            let stop = it.message.get("stop_reason").and_then(Value::as_str);
            meta.truncated = stop == Some("max_tokens");
            meta.finish_reason = stop.map(|x| match x {
                "tool_use" => "tool_calls".to_string(),
                "end_turn" | "stop_sequence" => "stop".to_string(),
                "max_tokens" => "length".to_string(),
                other => other.to_string(),
            });
        }
        t.push(n, meta);
    }
    sink.count("synthetic assistant messages (not model output)", synthetic);
    t.first_turn = emitted;
    t.tail_is_next_state = true;
    let turns = emit(sink, key, &t, Some(1))?;
    if turns == 0 && emitted == 0 {
        sink.dead_in_session(None, key, "no_assistant_turn", "session has no model-written assistant message", b"")?;
    }
    Ok(())
}
