//! Anthropic Messages API logs: JSONL of `{request, response}` (optionally `headers`, `timestamp`),
//! like `openai-chat`: `--format anthropic-messages`.
//!
//! - request: `system` (a string or text blocks) → the system message; `messages[]` (`role`,
//!   `content` string or blocks) through the content-parts normaliser, so `tool_use` blocks are tool
//!   calls, `tool_result` blocks in user messages are `tool` messages (the next states) and
//!   `thinking` blocks reasoning; `tools`, `model`;
//! - response: the assistant message (`content` blocks), `stop_reason` (`tool_use` → `tool_calls`,
//!   `end_turn`/`stop_sequence` → `stop`, `max_tokens` → `length`, truncated), `model`; an error
//!   (`{"type": "error"}`) is an `api_error` dead letter;
//! - sessions, turn types and done flags as `openai-chat` (headers / body markers, else inferred).
//!
//! Source: the Messages API reference and anthropic-sdk-python `types/` (read, not copied).

use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{json_type, normalize_request, normalize_with_role};
use super::openai_chat::Sessions;
use super::{parse_timestamp, Sink, Turn};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut sessions = Sessions::new(sink);
    super::openai_chat::exchange_lines(path, sink, progress, &mut |sink, n, text| record(sink, n, text, &mut sessions))
}

/// A log line's object, its `request` and its `response`.
pub(crate) type Exchange<'v> = (&'v Map<String, Value>, &'v Map<String, Value>, &'v Map<String, Value>);

/// Parses one log line: the line's JSON, or a dead letter's (code, reason) when it is not JSON.
pub(crate) fn parse_line(n: i64, text: &[u8]) -> std::result::Result<Value, (&'static str, String)> {
    serde_json::from_slice(text).map_err(|e| ("malformed_json", format!("line {n}: {e}")))
}

/// `{request, response}` of one log line, or a dead letter's (code, reason).
pub(crate) fn exchange(n: i64, v: &Value) -> std::result::Result<Exchange<'_>, (&'static str, String)> {
    let Some(line) = v.as_object() else {
        return Err(("wrong_type", format!("line {n} is a JSON {}, expected an object", json_type(v))));
    };
    let (Some(Value::Object(req)), Some(resp_v)) = (line.get("request"), line.get("response")) else {
        return Err(("missing_request_or_response", format!("line {n}: needs a `request` object and a `response`")));
    };
    let Some(resp) = resp_v.as_object() else {
        return Err(("wrong_type", format!("line {n}: `response` is a JSON {}", json_type(resp_v))));
    };
    Ok((line, req, resp))
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], sessions: &mut Sessions) -> Result<()> {
    let v = match parse_line(n, text) {
        Ok(v) => v,
        Err((code, reason)) => return sink.dead(Some(n), code, reason, text),
    };
    let (line, req, resp) = match exchange(n, &v) {
        Ok(x) => x,
        Err((code, reason)) => return sink.dead(Some(n), code, reason, text),
    };
    if resp.get("type").and_then(Value::as_str) == Some("error") || (resp.contains_key("error") && !resp.contains_key("content")) {
        return sink.dead(Some(n), "api_error", format!("line {n}: the server answered with an error: {}", resp.get("error").unwrap_or(&Value::Null)), text);
    }
    let Some(Value::Array(raw_messages)) = req.get("messages") else {
        return sink.dead(Some(n), "missing_messages", format!("line {n}: `request.messages` is not an array"), text);
    };
    let mut notes = vec![];
    let mut request: Vec<Message> = vec![];
    match req.get("system") {
        None | Some(Value::Null) => {}
        Some(sys) => {
            let mut o = Map::new();
            o.insert("content".into(), sys.clone());
            match normalize_with_role(&o, "system", None) {
                Ok(mut s) => {
                    notes.append(&mut s.notes);
                    request.push(s.message);
                }
                Err(e) => return sink.dead(Some(n), e.code(), format!("line {n}, request system: {e}"), text),
            }
        }
    }
    match normalize_request(raw_messages, &mut notes) {
        Ok(ms) => request.extend(ms),
        Err((i, e)) => return sink.dead(Some(n), e.code(), format!("line {n}, request message {i}: {e}"), text),
    }
    let resp_norm = match resp.get("role").and_then(Value::as_str) {
        None | Some("assistant") => normalize_with_role(resp, "assistant", None),
        Some(other) => return sink.dead(Some(n), "unknown_role", format!("line {n}: response has role {other:?}, expected assistant"), text),
    };
    let mut resp_norm = match resp_norm {
        Ok(r) => r,
        Err(e) => return sink.dead(Some(n), e.code(), format!("line {n}, response: {e}"), text),
    };
    notes.append(&mut resp_norm.notes);
    let response = resp_norm.message;
    let stop = resp.get("stop_reason").and_then(Value::as_str);
    let mut t = Turn::new(String::new(), 0, &request, &response);
    t.model = resp.get("model").or_else(|| req.get("model")).and_then(Value::as_str).map(str::to_string);
    t.tools = req.get("tools").filter(|v| !v.is_null()).map(Value::to_string);
    t.finish_reason = stop.map(|s| {
        match s {
            "tool_use" => "tool_calls",
            "end_turn" | "stop_sequence" => "stop",
            "max_tokens" => "length",
            other => other,
        }
        .to_string()
    });
    t.truncated = resp_norm.truncated || stop == Some("max_tokens");
    t.notes = notes;
    t.event_time = line.get("timestamp").or_else(|| line.get("time")).and_then(parse_timestamp);
    t.source_line = Some(n);
    sessions.place_and_emit(sink, n, text, line, req, t)
}
