//! OpenHands event streams (`tests/runtime/trajs/*.json`, saved sessions): a JSON array of events,
//! each an action (`action`, `args`) or an observation (`observation`, `content`, `cause` = id of the
//! action it answers), with `id`, `timestamp` and `source` (`user`, `agent`, `environment`).
//!
//! Rebuilding the conversation:
//! - user `message` actions → user messages; a `system` action → the system message;
//! - agent actions with `tool_call_metadata` → one assistant message per model response (actions
//!   sharing `model_response.id` are the parallel calls of one response), taken from the logged
//!   `model_response.choices[0].message` (content, tool calls, finish reason, model) when present,
//!   else built from the action (`args.thought` + a call of `function_name` with the other args);
//! - agent `message` actions without metadata → assistant text messages (`args.content`);
//! - observations whose `cause` is such an action → tool messages, joined to the call by the
//!   observation's `tool_call_id` (ids are looked up, never assumed contiguous — event ids skip);
//!   the text is `content`, or `message` when `content` is empty, plus the command's exit-code
//!   suffix when logged;
//! - skipped and counted: `environment` events (agent state changes), `null` observations ("No
//!   observation"), JSON-null events, other agent actions without a model response (e.g. `recall`),
//!   observations of such actions.
//!
//! Elements are streamed; the session's messages are kept until the end of the file (the last turn
//! needs them). Session id = `openhands:<file stem>`; complete when the agent ran `finish`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{json_type, normalize_with_role};
use super::sink::Sink;
use super::stream::{for_each_element, ArrayEnd};
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::schema::{Message, ToolCall};
use crate::Result;

#[derive(Default)]
struct Builder {
    t: Trajectory,
    /// model_response.id → index of its assistant message.
    by_response: HashMap<String, usize>,
    /// action event id → (tool_call_id, function name) of tool-call actions.
    call_of_action: HashMap<String, (Option<String>, String)>,
    finished: bool,
    skipped: HashMap<&'static str, u64>,
    bad: Option<(i64, String, String)>,
}

fn id_key(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

impl Builder {
    fn skip(&mut self, what: &'static str) {
        *self.skipped.entry(what).or_insert(0) += 1;
    }

    fn event(&mut self, index: i64, v: &Value) {
        let Some(e) = v.as_object() else {
            if v.is_null() {
                self.skip("null events");
            } else if self.bad.is_none() {
                self.bad = Some((index, "wrong_type".into(), format!("event {index} is a JSON {}", json_type(v))));
            }
            return;
        };
        let source = e.get("source").and_then(Value::as_str).unwrap_or("");
        let ts = e.get("timestamp").and_then(parse_timestamp);
        if source == "environment" {
            self.skip("environment events");
            return;
        }
        if let Some(obs) = e.get("observation").and_then(Value::as_str) {
            self.observation(e, obs, ts);
        } else if let Some(action) = e.get("action").and_then(Value::as_str) {
            self.action(index, e, source, action, ts);
        } else {
            self.skip("events without action or observation");
        }
    }

    fn action(&mut self, index: i64, e: &Map<String, Value>, source: &str, action: &str, ts: Option<i64>) {
        let args = e.get("args").and_then(Value::as_object);
        let text = || args.and_then(|a| a.get("content")).and_then(Value::as_str).or_else(|| e.get("message").and_then(Value::as_str)).unwrap_or("").to_string();
        match (source, action) {
            ("user", "message") => self.t.push(plain("user", text()), MessageMeta { event_time: ts, ..MessageMeta::default() }),
            (_, "system") => self.t.push(plain("system", text()), MessageMeta { event_time: ts, ..MessageMeta::default() }),
            ("agent", _) if e.get("tool_call_metadata").is_some_and(Value::is_object) => self.tool_action(index, e, action, ts),
            ("agent", "message") | ("agent", "finish") => {
                self.t.push(plain("assistant", text()), MessageMeta { event_time: ts, line: Some(index), ..MessageMeta::default() });
            }
            _ => self.skip("actions without a model response"),
        }
        if action == "finish" {
            self.finished = true;
        }
    }

    fn tool_action(&mut self, index: i64, e: &Map<String, Value>, action: &str, ts: Option<i64>) {
        let md = e.get("tool_call_metadata").and_then(Value::as_object);
        let call_id = md.and_then(|m| m.get("tool_call_id")).and_then(Value::as_str).map(str::to_string);
        let fname = md.and_then(|m| m.get("function_name")).and_then(Value::as_str).unwrap_or(action).to_string();
        if let Some(id) = id_key(e.get("id")) {
            self.call_of_action.insert(id, (call_id.clone(), fname.clone()));
        }
        let resp = md.and_then(|m| m.get("model_response")).and_then(Value::as_object);
        let resp_id = resp.and_then(|r| r.get("id")).and_then(Value::as_str).map(str::to_string);
        if let Some(rid) = &resp_id {
            if self.by_response.contains_key(rid) {
                // A further call of a response already rebuilt from model_response (it lists all calls).
                return;
            }
        }
        let choice = resp.and_then(|r| r.get("choices")).and_then(|c| c.get(0)).and_then(Value::as_object);
        let logged = choice.and_then(|c| c.get("message")).and_then(Value::as_object);
        let meta = MessageMeta {
            event_time: ts,
            line: Some(index),
            finish_reason: choice.and_then(|c| c.get("finish_reason")).and_then(Value::as_str).map(str::to_string),
            model: resp.and_then(|r| r.get("model")).and_then(Value::as_str).map(str::to_string),
            ..MessageMeta::default()
        };
        let n = match logged.map(|m| normalize_with_role(m, "assistant", None)) {
            Some(Ok(n)) => n,
            Some(Err(err)) => {
                if self.bad.is_none() {
                    self.bad = Some((index, err.code().into(), format!("event {index}: model_response message: {err}")));
                }
                return;
            }
            None => {
                // No logged response: rebuild from the action.
                let args = e.get("args").and_then(Value::as_object).cloned().unwrap_or_default();
                let thought = args.get("thought").and_then(Value::as_str).unwrap_or("").to_string();
                let mut call_args = args.clone();
                call_args.remove("thought");
                let msg = Message {
                    tool_calls: vec![ToolCall { id: call_id, name: fname, arguments: Value::Object(call_args), arguments_raw: None }],
                    ..Message::text("assistant", thought)
                };
                super::normalize::Normalized {
                    notes: vec!["assistant message rebuilt from the action (no model_response logged)".into()],
                    ..super::normalize::Normalized::new(msg)
                }
            }
        };
        if let Some(rid) = resp_id {
            self.by_response.insert(rid, self.t.messages.len());
        }
        self.t.push(n, meta);
    }

    fn observation(&mut self, e: &Map<String, Value>, obs: &str, ts: Option<i64>) {
        if obs == "null" {
            self.skip("null observations");
            return;
        }
        let cause = id_key(e.get("cause"));
        let Some((action_call_id, fname)) = cause.as_ref().and_then(|c| self.call_of_action.get(c)).cloned() else {
            self.skip("observations not answering a tool call");
            return;
        };
        let md = e.get("tool_call_metadata").and_then(Value::as_object);
        let call_id = md.and_then(|m| m.get("tool_call_id")).and_then(Value::as_str).map(str::to_string).or(action_call_id);
        let content = e.get("content").and_then(Value::as_str).unwrap_or("");
        let mut text = if content.is_empty() { e.get("message").and_then(Value::as_str).unwrap_or("").to_string() } else { content.to_string() };
        if let Some(suffix) = e.get("extras").and_then(|x| x.pointer("/metadata/suffix")).and_then(Value::as_str) {
            text.push_str(suffix);
        }
        let msg = Message { tool_call_id: call_id, name: Some(fname), ..Message::text("tool", text) };
        self.t.push(super::normalize::Normalized::new(msg), MessageMeta { event_time: ts, ..MessageMeta::default() });
    }
}

fn plain(role: &str, text: String) -> super::normalize::Normalized {
    super::normalize::Normalized::new(Message::text(role, text))
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut b = Builder::default();
    let (bytes, end) = for_each_element(path, progress, &mut |i, v| {
        sink.next_record()?;
        b.event(i, &v);
        Ok(())
    })?;
    sink.set_bytes(bytes);
    let session_id = format!("openhands:{}", sink.stem);
    let mut skipped: Vec<_> = b.skipped.iter().map(|(k, v)| (*k, *v)).collect();
    skipped.sort();
    for (k, v) in skipped {
        sink.count(k, v);
    }
    match end {
        ArrayEnd::Complete => {}
        ArrayEnd::NotAnArray(e) => return sink.dead(None, "wrong_type", format!("OpenHands file is not a JSON array of events: {e}"), b""),
        ArrayEnd::Broken { elements, error } => {
            // Keep nothing from a broken stream: its last turn and done flag would be wrong.
            return sink.dead_in_session(Some(elements + 1), &session_id, "malformed_json", format!("event stream broken after {elements} events: {error}"), b"");
        }
    }
    if let Some((i, code, reason)) = b.bad {
        return sink.dead_in_session(Some(i), &session_id, &code, reason, b"");
    }
    b.t.complete = b.finished;
    if !b.finished {
        b.t.notes.push("no finish action: trajectory treated as incomplete".into());
    }
    if b.t.turns() == 0 {
        return sink.dead_in_session(None, &session_id, "no_assistant_turn", "event stream has no agent turn", b"");
    }
    emit(sink, &session_id, &b.t, Some(1))?;
    Ok(())
}
