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
use super::sink::{Sink, Turn};
use super::timestamp::parse_timestamp;
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut sessions = Sessions::new(sink);
    super::sink::read_lines(path, sink, progress, &mut |sink, n, text| record(sink, n, text, &mut sessions))
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

/// A request or response that cannot become a turn: a dead letter's (reason code, reason).
pub(crate) type Unusable = (&'static str, String);

/// One `{request, response}` log line parsed into `slot` and checked: its (line, request, response).
///
/// # Errors
/// As [`parse_line`] and [`exchange`]; `api_error` when `is_error` says the response is the server's
/// error.
pub(crate) fn read_exchange<'v>(n: i64, text: &[u8], slot: &'v mut Value, is_error: fn(&Map<String, Value>) -> bool) -> std::result::Result<Exchange<'v>, Unusable> {
    *slot = parse_line(n, text)?;
    let v: &'v Value = slot;
    let x = exchange(n, v)?;
    if is_error(x.2) {
        return Err(("api_error", format!("line {n}: the server answered with an error: {}", x.2.get("error").unwrap_or(&Value::Null))));
    }
    Ok(x)
}

/// The assistant side of one exchange, read from an API response (shared by the log readers and the
/// capture proxy, so a logged exchange and a proxied one become the same row).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    /// The assistant message (text, reasoning, tool calls).
    pub message: Message,
    /// Finish reason in OpenAI chat terms (`stop`, `tool_calls`, `length`, or the API's own word).
    pub finish_reason: Option<String>,
    /// The response was cut (token limit, unclosed reasoning).
    pub truncated: bool,
    /// Model named by the response.
    pub model: Option<String>,
    /// What normalisation noticed.
    pub notes: Vec<String>,
}

/// True for an Anthropic error body (`{"type": "error", "error": {...}}`, or an `error` without content).
pub(crate) fn is_error(resp: &Map<String, Value>) -> bool {
    resp.get("type").and_then(Value::as_str) == Some("error") || (resp.contains_key("error") && !resp.contains_key("content"))
}

/// A Messages request's conversation: `system` (string or text blocks) as the system message, then
/// `messages` through the content-parts normaliser; notes appended to `notes`.
///
/// # Errors
/// `missing_messages` when `messages` is not an array; the normaliser's code for a bad system prompt
/// or message.
pub(crate) fn request_conversation(req: &Map<String, Value>, notes: &mut Vec<String>) -> std::result::Result<Vec<Message>, Unusable> {
    let Some(Value::Array(raw_messages)) = req.get("messages") else {
        return Err(("missing_messages", "`messages` is not an array".into()));
    };
    let mut request: Vec<Message> = vec![];
    match req.get("system") {
        None | Some(Value::Null) => {}
        Some(sys) => {
            let mut o = Map::new();
            o.insert("content".into(), sys.clone());
            let mut s = normalize_with_role(&o, "system", None).map_err(|e| (e.code(), format!("request system: {e}")))?;
            notes.append(&mut s.notes);
            request.push(s.message);
        }
    }
    let ms = normalize_request(raw_messages, notes).map_err(|(i, e)| (e.code(), format!("request message {i}: {e}")))?;
    request.extend(ms);
    Ok(request)
}

/// A Messages response (`role`, `content` blocks, `stop_reason`, `model`) as a [`Reply`]: `tool_use` →
/// `tool_calls`, `end_turn`/`stop_sequence` → `stop`, `max_tokens` → `length` and truncated.
///
/// # Errors
/// `unknown_role` for a role other than assistant; the normaliser's code for bad content.
pub(crate) fn reply(resp: &Map<String, Value>) -> std::result::Result<Reply, Unusable> {
    let norm = match resp.get("role").and_then(Value::as_str) {
        None | Some("assistant") => normalize_with_role(resp, "assistant", None),
        Some(other) => return Err(("unknown_role", format!("response has role {other:?}, expected assistant"))),
    };
    let norm = norm.map_err(|e| (e.code(), format!("response: {e}")))?;
    let stop = resp.get("stop_reason").and_then(Value::as_str);
    let finish_reason = stop.map(|s| {
        match s {
            "tool_use" => "tool_calls",
            "end_turn" | "stop_sequence" => "stop",
            "max_tokens" => "length",
            other => other,
        }
        .to_string()
    });
    Ok(Reply {
        truncated: norm.truncated || stop == Some("max_tokens"),
        message: norm.message,
        finish_reason,
        model: resp.get("model").and_then(Value::as_str).map(str::to_string),
        notes: norm.notes,
    })
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], sessions: &mut Sessions) -> Result<()> {
    let mut v = Value::Null;
    let (line, req, resp) = match read_exchange(n, text, &mut v, is_error) {
        Ok(x) => x,
        Err((code, reason)) => return sink.dead(Some(n), code, reason, text),
    };
    let mut notes = vec![];
    let request = match request_conversation(req, &mut notes) {
        Ok(r) => r,
        Err((code, reason)) => return sink.dead(Some(n), code, format!("line {n}: {reason}"), text),
    };
    let mut r = match reply(resp) {
        Ok(r) => r,
        Err((code, reason)) => return sink.dead(Some(n), code, format!("line {n}: {reason}"), text),
    };
    notes.append(&mut r.notes);
    let mut t = Turn::new(String::new(), 0, &request, &r.message);
    t.model = r.model.or_else(|| req.get("model").and_then(Value::as_str).map(str::to_string));
    t.tools = req.get("tools").filter(|v| !v.is_null()).map(Value::to_string);
    t.finish_reason = r.finish_reason;
    t.truncated = r.truncated;
    t.notes = notes;
    t.event_time = line.get("timestamp").or_else(|| line.get("time")).and_then(parse_timestamp);
    t.source_line = Some(n);
    t.tenant = super::sink::request_tenant(line, req, &mut t.notes);
    sessions.place_and_emit(sink, n, text, line, req, t)
}
