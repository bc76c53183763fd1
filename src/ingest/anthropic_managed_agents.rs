//! Anthropic Managed Agents session event logs (`client.beta.sessions.events.*`):
//! `--format anthropic-managed-agents`.
//!
//! Sources (what was confirmed where):
//! - anthropics/anthropic-sdk-python `src/anthropic/types/beta/sessions/` (snapshot 009b0353, Aug
//!   2026): `beta_managed_agents_session_event.py` (the event union, discriminated by `type`) and one
//!   file per event: `user.message` and `agent.message` `{id, type, content[], processed_at}` (content
//!   blocks `text {text}`, `redacted`, image/document/search-result); `agent.tool_use` and
//!   `agent.custom_tool_use` `{id, name, input, session_thread_id?}`; `agent.mcp_tool_use` (also
//!   `mcp_server_name`); `agent.tool_result {tool_use_id, content?, is_error?}` ("the id of the
//!   `agent.tool_use` event"), `agent.mcp_tool_result {mcp_tool_use_id}`, `user.custom_tool_result
//!   {custom_tool_use_id}` ("the id of the `agent.custom_tool_use` event"), `user.tool_result
//!   {tool_use_id}` (self-hosted environments; `types/beta/beta_managed_agents_user_tool_result_event.py`);
//!   `agent.thinking {id, processed_at}` ("a progress signal, not a content carrier");
//!   `span.model_request_start` / `span.model_request_end {model_request_start_id, is_error?,
//!   model_usage}`; `session.status_idle {stop_reason}`, `session.status_terminated`,
//!   `session.deleted` ("no further events will be emitted for this session"); `system.message`
//!   (`types/beta/beta_managed_agents_system_message_event.py`: "appended to the session as a
//!   `role: "system"` turn"); `session_thread_id` on a tool use: "cross-posted from a subagent's
//!   thread ... Empty on the thread's own events".
//! - the same SDK, `types/beta/sessions/beta_managed_agents_send_session_events.py` (`events.send`
//!   returns `{data: [sent events]}`), `event_send_params.py` (`{events: [...]}`, params without `id`),
//!   `beta_managed_agents_stream_session_events.py` and `lib/sessions/_accumulate.py` (the stream
//!   carries user events too, and `event_start`/`event_delta` previews whose final event "is
//!   canonical"), `resources/beta/sessions/events.py` (`list`, `send`, `stream`);
//!   `lib/tools/_beta_session_runner.py` (tool-call events de-duplicated by event id; a result's
//!   `tool_use_id` / `custom_tool_use_id` is the call event's `id`).
//! - platform.claude.com/docs/en/managed-agents/events-and-streaming (event types, `{domain}.{action}`,
//!   `processed_at` null while queued) and docs/en/api/.../beta/sessions/events/stream ("a model
//!   request that ends early ... produces no final event — its terminal `span.model_request_end`").
//!
//! Not confirmed by any public source, and so read without depending on it: the `[method, payload]`
//! line framing of the issue (no SDK or doc writes such a file; the method string is not read, only
//! the payload, which may be one event, a `{data: [...]}` page/send response or `{events: [...]}`
//! send params); a bare event object a line (what `list`/`stream` yield) is read the same way. Events
//! carry no session id, model name or tool definitions, so the session is the file
//! (`anthropic-managed-agents:<file stem>`), and `model`/`tools` stay empty. Whether the agent events
//! of one model response always sit between its `span.model_request_start` and `_end` is implied by
//! the stream docs but not stated; the grouping below uses spans when present and otherwise consecutive
//! agent events.
//!
//! Reading: every event is read once, by `id` (a sent event echoed on the stream, or a `list` replay
//! of the history, is counted and left out); an event without `id` (send params) is counted and left
//! out, its echo carries the id. One turn per model response: the agent's `agent.message` text and its
//! `agent.tool_use` / `agent.custom_tool_use` / `agent.mcp_tool_use` calls (call id = the event id)
//! from one `span.model_request_start` to its `_end`, or, without spans, the agent events between two
//! other events (a user or system message, a tool result, an idle or terminal status). Results
//! (`agent.tool_result`, `agent.mcp_tool_result`, `user.custom_tool_result`, `user.tool_result`) are
//! `tool` messages answering their call's event id; one whose call is not in the file is an orphan,
//! counted. Events cross-posted from a subagent thread (`session_thread_id` set) are counted and left
//! out. `session.status_terminated` / `session.deleted` end the session (`session_done`). Previews,
//! thinking signals, statuses, confirmations, interrupts and other event types are counted by type.
//! A line that is not JSON is a `malformed_json` dead letter, one that is neither an object nor an
//! array a `wrong_type` one; the rest of the file is read.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Map, Value};

use super::normalize::{json_type, normalize_with_role};
use super::sink::Sink;
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::Result;

/// The event `type`s of the session event union (SDK `BetaManagedAgentsSessionEvent`, stream previews).
const EVENT_TYPES: &[&str] = &[
    "user.message",
    "user.interrupt",
    "user.tool_confirmation",
    "user.custom_tool_result",
    "user.define_outcome",
    "user.tool_result",
    "agent.message",
    "agent.thinking",
    "agent.tool_use",
    "agent.tool_result",
    "agent.custom_tool_use",
    "agent.mcp_tool_use",
    "agent.mcp_tool_result",
    "agent.thread_message_received",
    "agent.thread_message_sent",
    "agent.thread_context_compacted",
    "session.error",
    "session.updated",
    "session.deleted",
    "session.usage",
    "session.status_running",
    "session.status_idle",
    "session.status_rescheduled",
    "session.status_terminated",
    "session.thread_created",
    "session.thread_status_running",
    "session.thread_status_idle",
    "session.thread_status_rescheduled",
    "session.thread_status_terminated",
    "span.model_request_start",
    "span.model_request_end",
    "span.outcome_evaluation_start",
    "span.outcome_evaluation_ongoing",
    "span.outcome_evaluation_end",
    "system.message",
];

fn is_event(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str).is_some_and(|t| EVENT_TYPES.contains(&t))
}

/// Why the first record of a file is a Managed Agents event log, if it is one: a `[method, payload]`
/// pair whose payload is an event, `{data: [events]}` or `{events: [events]}`; or a bare event object
/// with `id` and `processed_at` (Copilot CLI's `user.message` events have `data` and `timestamp`).
pub(crate) fn detect_record(v: &Value) -> Option<&'static str> {
    match v {
        Value::Array(a) if a.len() == 2 && a[0].is_string() => {
            let p = &a[1];
            let listed = |k: &str| p.get(k).and_then(Value::as_array).and_then(|l| l.first()).is_some_and(is_event);
            (is_event(p) || listed("data") || listed("events")).then_some("[method, payload] lines with Managed Agents session events")
        }
        Value::Object(o) if is_event(v) && o.get("id").is_some_and(Value::is_string) && o.contains_key("processed_at") && !o.contains_key("data") => {
            Some("Managed Agents session events (id, type, processed_at)")
        }
        _ => None,
    }
}

/// One model response being gathered: its content blocks, first line and time, and notes.
#[derive(Default)]
struct Response {
    parts: Vec<Value>,
    line: Option<i64>,
    event_time: Option<i64>,
    notes: Vec<String>,
}

struct Reader<'s, 'a> {
    sink: &'s mut Sink<'a>,
    session: String,
    t: Trajectory,
    counts: HashMap<String, u64>,
    calls: HashSet<String>,
    open: Option<Response>,
    /// Results read while their response's span is still open, pushed once it closes.
    held: Vec<(i64, Option<i64>, Map<String, Value>)>,
    in_span: bool,
}

impl Reader<'_, '_> {
    fn count(&mut self, what: impl Into<String>) {
        *self.counts.entry(what.into()).or_insert(0) += 1;
    }

    fn push(&mut self, line: i64, event_time: Option<i64>, role: &str, msg: &Map<String, Value>, notes: Vec<String>) -> Result<()> {
        match normalize_with_role(msg, role, None) {
            Ok(nm) => {
                self.t.push(nm, MessageMeta { line: Some(line), event_time, notes, ..MessageMeta::default() });
                Ok(())
            }
            Err(err) => self.sink.dead_in_session(Some(line), &self.session, err.code(), format!("line {line}: {err}"), &serde_json::to_vec(msg)?),
        }
    }

    /// Ends the response being gathered (if any): its assistant message, then the results held for it.
    fn close(&mut self) -> Result<()> {
        if let Some(r) = self.open.take() {
            let mut msg = Map::new();
            msg.insert("content".into(), Value::Array(r.parts));
            self.push(r.line.unwrap_or(1), r.event_time, "assistant", &msg, r.notes)?;
        }
        for (line, time, msg) in std::mem::take(&mut self.held) {
            self.push(line, time, "user", &msg, vec![])?;
        }
        Ok(())
    }

    fn response(&mut self, line: i64, event_time: Option<i64>) -> &mut Response {
        self.open.get_or_insert_with(|| Response { line: Some(line), event_time, ..Response::default() })
    }

    fn event(&mut self, line: i64, ev: &Map<String, Value>) -> Result<()> {
        let ty = ev.get("type").and_then(Value::as_str).unwrap_or("");
        let time = ev.get("processed_at").and_then(super::timestamp::parse_timestamp);
        let content = || ev.get("content").cloned().unwrap_or_else(|| json!([]));
        let str_of = |k: &str| ev.get(k).and_then(Value::as_str).map(str::to_string);
        match ty {
            "user.message" | "system.message" => {
                self.close()?;
                let mut msg = Map::new();
                msg.insert("content".into(), content());
                self.push(line, time, if ty == "user.message" { "user" } else { "system" }, &msg, vec![])?;
            }
            "agent.message" => {
                let parts = match content() {
                    Value::Array(a) => a,
                    other => {
                        let reason = format!("line {line}: agent.message content is a JSON {}, expected an array of blocks", json_type(&other));
                        return self.sink.dead_in_session(Some(line), &self.session, "wrong_type", reason, &serde_json::to_vec(ev)?);
                    }
                };
                self.response(line, time).parts.extend(parts);
            }
            "agent.tool_use" | "agent.custom_tool_use" | "agent.mcp_tool_use" => {
                let id = str_of("id").unwrap_or_default();
                self.calls.insert(id.clone());
                let call = json!({"type": "tool_use", "id": id, "name": ev.get("name").cloned().unwrap_or(Value::Null), "input": ev.get("input").cloned().unwrap_or_else(|| json!({}))});
                self.response(line, time).parts.push(call);
            }
            "agent.tool_result" | "agent.mcp_tool_result" | "user.custom_tool_result" | "user.tool_result" => {
                let key = match ty {
                    "agent.mcp_tool_result" => "mcp_tool_use_id",
                    "user.custom_tool_result" => "custom_tool_use_id",
                    _ => "tool_use_id",
                };
                let Some(call) = str_of(key).filter(|c| self.calls.contains(c)) else {
                    self.count("orphan tool results (their call is not in the file)");
                    return Ok(());
                };
                let mut msg = Map::new();
                msg.insert("content".into(), json!([{"type": "tool_result", "tool_use_id": call, "content": content()}]));
                if self.in_span && self.open.is_some() {
                    self.held.push((line, time, msg));
                } else {
                    self.close()?;
                    self.push(line, time, "user", &msg, vec![])?;
                }
            }
            "span.model_request_start" => {
                self.close()?;
                self.in_span = true;
            }
            "span.model_request_end" => {
                if ev.get("is_error") == Some(&Value::Bool(true)) {
                    self.count("model requests that ended in an error");
                    if let Some(r) = self.open.as_mut() {
                        r.notes.push("the model request ended in an error (span.model_request_end is_error)".into());
                    }
                }
                self.close()?;
                self.in_span = false;
            }
            "agent.thinking" => self.count("agent.thinking events (progress signals without content)"),
            _ => {
                if matches!(ty, "session.status_idle" | "session.status_terminated" | "session.deleted" | "user.interrupt" | "user.tool_confirmation") {
                    self.close()?;
                    self.in_span = false;
                }
                if matches!(ty, "session.status_terminated" | "session.deleted") {
                    self.t.complete = true;
                }
                let known = if EVENT_TYPES.contains(&ty) { "" } else { " (unknown type)" };
                self.count(format!("{ty} events{known}"));
            }
        }
        Ok(())
    }
}

/// The events of one line's payload (module doc), or `None` when it holds none.
fn payload_events(p: &Value) -> Option<Vec<&Value>> {
    if p.get("type").is_some_and(Value::is_string) {
        return Some(vec![p]);
    }
    ["data", "events"].iter().find_map(|k| p.get(*k).and_then(Value::as_array)).map(|l| l.iter().collect())
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut lines: Vec<(i64, Value)> = vec![];
    super::sink::read_lines(path, sink, progress, &mut |sink, n, text| match serde_json::from_slice::<Value>(text) {
        Ok(v @ (Value::Object(_) | Value::Array(_))) => {
            lines.push((n, v));
            Ok(())
        }
        Ok(v) => sink.dead(Some(n), "wrong_type", format!("line {n} is a JSON {}, expected an event object or a [method, payload] array", json_type(&v)), text),
        Err(e) => sink.dead(Some(n), "malformed_json", format!("line {n}: {e}"), text),
    })?;
    let records = lines.len();
    let session = format!("anthropic-managed-agents:{}", sink.stem);
    let mut r = Reader { sink, session: session.clone(), t: Trajectory::default(), counts: HashMap::new(), calls: HashSet::new(), open: None, held: vec![], in_span: false };
    let mut seen: HashSet<String> = HashSet::new();
    for (n, v) in &lines {
        let payload = match v {
            Value::Array(a) if a.len() == 2 && a[0].is_string() => {
                r.count("[method, payload] lines");
                &a[1]
            }
            Value::Array(_) => {
                r.count("arrays that are not [method, payload] pairs (not read)");
                continue;
            }
            obj => obj,
        };
        let Some(events) = payload_events(payload) else {
            r.count("payloads without session events (not read)");
            continue;
        };
        for ev in events {
            let Some(ev) = ev.as_object() else {
                r.count("events that are not JSON objects (not read)");
                continue;
            };
            if matches!(ev.get("type").and_then(Value::as_str), Some("event_start" | "event_delta")) {
                // Previews carry no `id` of their own; the buffered final event is canonical.
                r.count("stream previews (event_start/event_delta; the final event is read)");
                continue;
            }
            let Some(id) = ev.get("id").and_then(Value::as_str) else {
                r.count("events without an id (send params: their echo carries the id)");
                continue;
            };
            if !seen.insert(id.to_string()) {
                r.count("echoed or replayed events (id read before)");
                continue;
            }
            if ev.get("session_thread_id").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
                r.count("events cross-posted from a subagent thread (left out)");
                continue;
            }
            r.event(*n, ev)?;
        }
    }
    r.close()?;
    let Reader { t, counts, .. } = r;
    let complete = t.complete;
    emit_event_session(sink, &session, t, complete, counts, records, "event log has no agent response")
}
