//! OpenClaw agent-runtime session transcripts (`~/.openclaw/agents/<agent>/sessions/<id>.jsonl`),
//! written by the pi coding agent's session manager: `--format openclaw-session`.
//!
//! Layout (pi-mono `packages/coding-agent/docs/session.md` and `src/core/session-manager.ts`, read,
//! not copied; the sample in `../shared/data/agent-logs-2026/`):
//! - line 1 is a header `{type: "session", version, id, timestamp, cwd}`; `id` is the session id
//!   (else the file stem);
//! - every later line is an entry `{type, id, parentId, timestamp}`. Versions 2 and 3 form a tree
//!   through `parentId`: the conversation is the path from the root to the **last entry of the file**
//!   (the active leaf), ordered by the chain, not by line order; entries on other branches are
//!   counted (`entries on abandoned branches`). Version 1 (no ids) is in line order;
//! - `message` entries hold `message.role` = `user` (string or text/image blocks), `assistant`
//!   (blocks `text`, `thinking`, `toolCall {id, name, arguments}`; `stopReason` `stop`/`length`/
//!   `toolUse`/`error`/`aborted`; `model`, `provider`, `timestamp` in ms) or `toolResult`
//!   (`toolCallId`, `toolName`, `content[]`, `isError`) — the tool's output, its own message and the
//!   next state of the call; `bashExecution` (a user's `!command`) is a user message with the command
//!   and its output unless `excludeFromContext`; `custom`/`hookMessage` messages are user messages;
//! - assistant messages that no model wrote (`provider: "openclaw"` with model `delivery-mirror` or
//!   `gateway-injected`) are neither turns nor context (counted: `gateway messages (not model
//!   output)`); aborted or failed assistant messages without text or tool calls are counted and left
//!   out;
//! - a `compaction` entry `{summary, firstKeptEntryId}` replaces the context: the turns after it see
//!   a user message with the summary, then the entries from `firstKeptEntryId` up to the compaction
//!   (context, not turns again), then what follows. The last turn before it gets the messages after
//!   it (up to the compaction) as its next state. `branch_summary` and `custom_message` entries are
//!   user messages; `thinking_level_change`, `model_change`, `custom`, `label`, `session_info` are
//!   settings (counted).
//!
//! A session file is one session and is held in memory while it is read. The last turn's next
//! state is what follows it in the file; `session_done` is never set (a session can always go on).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{normalize_with_role, Normalized};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

/// Models that mark assistant messages written by the OpenClaw gateway, not by a model.
const GATEWAY_MODELS: [&str; 2] = ["delivery-mirror", "gateway-injected"];

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let mut header: Option<&Map<String, Value>> = None;
    let mut entries: Vec<(i64, &Map<String, Value>)> = vec![];
    for (n, r) in &records {
        if r.get("type").and_then(Value::as_str) == Some("session") && header.is_none() && entries.is_empty() {
            header = Some(r);
        } else {
            entries.push((*n, r));
        }
    }
    let session_id = match header.and_then(|h| h.get("id")).and_then(Value::as_str) {
        Some(id) if !id.is_empty() => id.to_string(),
        _ => {
            sink.count("files without a session header", 1);
            sink.stem.clone()
        }
    };
    let order = active_path(&entries, "id", "parentId");
    sink.count("entries on abandoned branches", (entries.len() - order.len()) as u64);
    let path_entries: Vec<(i64, &Map<String, Value>)> = order.iter().map(|&i| entries[i]).collect();
    let mut b = Builder { t: Trajectory::default(), counts: HashMap::new() };
    let mut emitted_turns = 0i32;
    for (k, (n, e)) in path_entries.iter().enumerate() {
        let ty = e.get("type").and_then(Value::as_str).unwrap_or("");
        let ts = e.get("timestamp").and_then(parse_timestamp);
        match ty {
            "message" => {
                if let Err((code, reason)) = b.message(*n, e, ts) {
                    sink.dead_in_session(Some(*n), &session_id, code, reason, &serde_json::to_vec(e)?)?;
                }
            }
            "compaction" => {
                // The segment so far ends here: emit it, its last turn taking what followed it.
                let mut done = std::mem::take(&mut b.t);
                done.first_turn = emitted_turns;
                done.tail_is_next_state = true;
                emitted_turns += emit(sink, &session_id, &done, Some(*n))? as i32;
                b.count("compactions");
                let summary = e.get("summary").and_then(Value::as_str).unwrap_or("");
                b.t.push(Normalized::new(Message::text("user", summary)), MessageMeta { event_time: ts, line: Some(*n), ..MessageMeta::default() });
                let kept_from = e.get("firstKeptEntryId").and_then(Value::as_str);
                let start = kept_from.and_then(|id| path_entries[..k].iter().position(|(_, x)| x.get("id").and_then(Value::as_str) == Some(id)));
                if let Some(s) = start {
                    let before = b.t.messages.len();
                    for (m, x) in &path_entries[s..k] {
                        if x.get("type").and_then(Value::as_str) == Some("message") {
                            let xts = x.get("timestamp").and_then(parse_timestamp);
                            let _ = b.message(*m, x, xts);
                        }
                    }
                    for meta in &mut b.t.meta[before..] {
                        meta.not_turn = true;
                    }
                } else if kept_from.is_some() {
                    b.count("compactions whose first kept entry is not on the path");
                }
            }
            "branch_summary" | "custom_message" => {
                let n2 = normalize_with_role(e, "user", None).ok();
                let text = e.get("summary").and_then(Value::as_str).map(str::to_string).or_else(|| n2.as_ref().map(|x| x.message.content.clone())).unwrap_or_default();
                b.t.push(Normalized::new(Message::text("user", text)), MessageMeta { event_time: ts, line: Some(*n), ..MessageMeta::default() });
                b.count(if ty == "branch_summary" { "branch summaries" } else { "custom messages" });
            }
            "" => b.count("entries without a type"),
            other => b.count_owned(format!("{other} entries")),
        }
    }
    let mut counts: Vec<(String, u64)> = b.counts.into_iter().collect();
    counts.sort();
    for (k, v) in counts {
        sink.count(&k, v);
    }
    let mut t = b.t;
    t.first_turn = emitted_turns;
    t.tail_is_next_state = true;
    let turns = emit(sink, &session_id, &t, Some(1))? as i32;
    if turns + emitted_turns == 0 && !records.is_empty() {
        sink.dead_in_session(None, &session_id, "no_assistant_turn", "session transcript has no model-written assistant message", b"")?;
    }
    Ok(())
}

struct Builder {
    t: Trajectory,
    counts: HashMap<String, u64>,
}

impl Builder {
    fn count(&mut self, what: &str) {
        *self.counts.entry(what.to_string()).or_insert(0) += 1;
    }

    fn count_owned(&mut self, what: String) {
        *self.counts.entry(what).or_insert(0) += 1;
    }

    /// Appends a `message` entry; `Err((code, reason))` for a message that cannot be read.
    fn message(&mut self, n: i64, e: &Map<String, Value>, ts: Option<i64>) -> std::result::Result<(), (&'static str, String)> {
        let Some(m) = e.get("message").and_then(Value::as_object) else {
            return Err(("missing_message", format!("line {n}: message entry without a `message` object")));
        };
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let event_time = m.get("timestamp").and_then(parse_timestamp).or(ts);
        let meta = MessageMeta { event_time, line: Some(n), ..MessageMeta::default() };
        let norm = |role: &str| normalize_with_role(m, role, None).map_err(|err| (err.code(), format!("line {n}: {err}")));
        match role {
            "user" => self.t.push(norm("user")?, meta),
            "toolResult" => {
                if m.get("isError").and_then(Value::as_bool) == Some(true) {
                    self.count("tool results marked isError");
                }
                self.t.push(norm("tool")?, meta)
            }
            "assistant" => {
                let provider = m.get("provider").and_then(Value::as_str);
                let model = m.get("model").and_then(Value::as_str);
                if provider == Some("openclaw") && model.is_some_and(|x| GATEWAY_MODELS.contains(&x)) {
                    self.count("gateway messages (not model output)");
                    return Ok(());
                }
                let nm = norm("assistant")?;
                let stop = m.get("stopReason").and_then(Value::as_str);
                if matches!(stop, Some("aborted" | "error")) && nm.message.content.trim().is_empty() && nm.message.tool_calls.is_empty() {
                    self.count("aborted or failed assistant messages without output");
                    return Ok(());
                }
                let finish_reason = stop.map(|s| match s {
                    "toolUse" => "tool_calls".to_string(),
                    other => other.to_string(),
                });
                let meta = MessageMeta {
                    model: model.map(|x| match provider {
                        Some(p) if !x.starts_with(&format!("{p}/")) => format!("{p}/{x}"),
                        _ => x.to_string(),
                    }),
                    truncated: stop == Some("length"),
                    finish_reason,
                    ..meta
                };
                self.t.push(nm, meta)
            }
            "bashExecution" => {
                if m.get("excludeFromContext").and_then(Value::as_bool) == Some(true) {
                    self.count("bash executions excluded from context");
                    return Ok(());
                }
                let cmd = m.get("command").and_then(Value::as_str).unwrap_or("");
                let out = m.get("output").and_then(Value::as_str).unwrap_or("");
                let text = format!("Ran `{cmd}`\n```\n{out}\n```");
                self.t.push(Normalized::new(Message::text("user", text)), meta);
                self.count("bash executions");
            }
            "custom" | "hookMessage" => {
                self.t.push(norm("user")?, meta);
                self.count("custom messages");
            }
            "branchSummary" | "compactionSummary" => {
                let text = m.get("summary").and_then(Value::as_str).unwrap_or("");
                self.t.push(Normalized::new(Message::text("user", text)), meta);
            }
            other => return Err(("unknown_role", format!("line {n}: unknown message role {other:?}"))),
        }
        Ok(())
    }
}

/// The entries on the active conversation path, as indices into `entries` in conversation order:
/// the chain of `parent_key` links from the last entry that has an `id_key` back to the root. Entries
/// without ids (version 1 files) are in line order. A chain that loops or points at a missing parent
/// stops there.
pub(crate) fn active_path(entries: &[(i64, &Map<String, Value>)], id_key: &str, parent_key: &str) -> Vec<usize> {
    let id_of = |e: &Map<String, Value>| e.get(id_key).and_then(Value::as_str).map(str::to_string);
    if !entries.iter().any(|(_, e)| id_of(e).is_some()) {
        return (0..entries.len()).collect();
    }
    let by_id: HashMap<String, usize> = entries.iter().enumerate().filter_map(|(i, (_, e))| id_of(e).map(|id| (id, i))).collect();
    let Some(leaf) = entries.iter().rposition(|(_, e)| id_of(e).is_some()) else {
        return vec![];
    };
    let mut out = vec![leaf];
    let mut seen = std::collections::HashSet::from([leaf]);
    let mut cur = leaf;
    while let Some(p) = entries[cur].1.get(parent_key).and_then(Value::as_str).and_then(|p| by_id.get(p).copied()) {
        if !seen.insert(p) {
            break;
        }
        out.push(p);
        cur = p;
    }
    out.reverse();
    out
}
