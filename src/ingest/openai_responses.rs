//! OpenAI Responses API logs: JSONL of `{request, response}` (optionally `headers`, `timestamp`),
//! like `openai-chat`: `--format openai-responses`.
//!
//! - request: `instructions` → the system message; `input` (a string = one user message, or items:
//!   messages, `function_call`, `function_call_output`, `reasoning`; see [`super::items`]); `tools`,
//!   `model`;
//! - `previous_response_id`: the request holds only the new items; the conversation is the earlier
//!   request's, then its response's output, then this input (kept per response id for the file's
//!   [`super::IngestOptions::session_cache`] most recent responses; a chain whose start is not in the
//!   file is read from what the request holds, with a note);
//! - response: its `output` items are one assistant message (text, reasoning summaries, function
//!   calls by `call_id`); `status = "incomplete"` with `incomplete_details.reason =
//!   "max_output_tokens"` → finish reason `length`, truncated; a response with function calls has
//!   finish reason `tool_calls`, else `stop`; `status = "failed"` or an `error` is an `api_error` dead
//!   letter;
//! - sessions, turn types and done flags as `openai-chat`; a chained request without an explicit
//!   session continues the session of its previous response (next turn index), even where its
//!   conversation no longer starts like the earlier one's (instructions are not carried over a chain).
//!
//! Source: the Responses API reference and openai-python `types/responses/` (read, not copied).

use std::collections::{HashMap, VecDeque};
use std::path::Path;

use serde_json::Value;

use serde_json::Map;

use super::anthropic_messages::{read_exchange, Reply, Unusable};
use super::items::{read_items, Skipped};
use super::openai_chat::Sessions;
use super::sink::{Sink, Turn};
use super::timestamp::parse_timestamp;
use crate::schema::{Interaction, Message};
use crate::Result;

/// A response remembered for requests that chain on it: its conversation (request + response), where
/// it was placed (session, inferred, turn index) and its row, held back until a chained request gives
/// its next state (the new input items) or the response leaves the cache or the file ends.
struct Chained {
    conversation: Vec<Message>,
    placed: Option<(String, bool, i32)>,
    held: Option<Interaction>,
}

/// Conversations of the most recent responses, by response id.
struct Chains {
    by_id: HashMap<String, Chained>,
    /// Next turn index of each session chained into (a retry that chains on one response twice is a
    /// further turn, not a duplicate).
    next_turn: HashMap<String, i32>,
    order: VecDeque<String>,
    cap: usize,
}

/// True for a response that failed (`status = "failed"`, or an `error` without `output`).
pub(crate) fn is_failed(resp: &Map<String, Value>) -> bool {
    resp.get("status").and_then(Value::as_str) == Some("failed") || (resp.get("error").is_some_and(|e| !e.is_null()) && !resp.contains_key("output"))
}

/// The request's `instructions` as a system message.
pub(crate) fn instructions(req: &Map<String, Value>) -> Option<Message> {
    match req.get("instructions") {
        Some(Value::String(s)) => Some(Message::text("system", s.clone())),
        _ => None,
    }
}

/// The request's `input` (a string = one user message, or items; [`super::items`]) as messages, with
/// the items of other types counted by type; normalisation notes appended to `notes`.
///
/// # Errors
/// The normaliser's code and `request input item N: ...` for the first bad item.
pub(crate) fn input_conversation(req: &Map<String, Value>, notes: &mut Vec<String>) -> std::result::Result<(Vec<Message>, Skipped), Unusable> {
    let (input, skipped) = read_items(req.get("input")).map_err(|(i, e)| (e.code(), format!("request input item {i}: {e}")))?;
    let mut out = vec![];
    for mut nm in input {
        notes.append(&mut nm.notes);
        out.extend(nm.into_messages());
    }
    Ok((out, skipped))
}

/// A response's `output` items as one assistant [`Reply`] (text, reasoning summaries, function calls
/// by `call_id`), with the items of other types counted by type. Finish reason: `status =
/// "incomplete"` with `incomplete_details.reason = "max_output_tokens"` → `length` (truncated), another
/// incomplete reason → that reason, function calls → `tool_calls`, else `stop`.
///
/// # Errors
/// The normaliser's code and `response output item N: ...` for the first bad item.
pub(crate) fn reply(resp: &Map<String, Value>) -> std::result::Result<(Reply, Skipped), Unusable> {
    let (output, skipped) = read_items(resp.get("output")).map_err(|(i, e)| (e.code(), format!("response output item {i}: {e}")))?;
    let mut notes = vec![];
    let mut response = Message::text("assistant", "");
    let mut truncated = false;
    for mut nm in output {
        notes.append(&mut nm.notes);
        truncated |= nm.truncated;
        for m in nm.into_messages() {
            if m.role != "assistant" {
                notes.push(format!("response output item of role {} ignored", m.role));
                continue;
            }
            if !m.content.is_empty() {
                if !response.content.is_empty() {
                    response.content.push('\n');
                }
                response.content.push_str(&m.content);
            }
            if let Some(r) = m.reasoning {
                response.reasoning = Some(match response.reasoning.take() {
                    Some(x) => format!("{x}\n{r}"),
                    None => r,
                });
            }
            response.tool_calls.extend(m.tool_calls);
        }
    }
    let incomplete = resp.get("status").and_then(Value::as_str) == Some("incomplete");
    let reason = resp.get("incomplete_details").and_then(|d| d.get("reason")).and_then(Value::as_str);
    let finish = if incomplete && reason == Some("max_output_tokens") {
        "length".to_string()
    } else if incomplete {
        reason.unwrap_or("incomplete").to_string()
    } else if !response.tool_calls.is_empty() {
        "tool_calls".to_string()
    } else {
        "stop".to_string()
    };
    let model = resp.get("model").and_then(Value::as_str).map(str::to_string);
    Ok((Reply { message: response, truncated: truncated || finish == "length", finish_reason: Some(finish), model, notes }, skipped))
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut sessions = Sessions::new(sink);
    let mut chains = Chains { by_id: HashMap::new(), next_turn: HashMap::new(), order: VecDeque::new(), cap: sink.opts.session_cache.max(1) };
    super::sink::read_lines(path, sink, progress, &mut |sink, n, text| record(sink, n, text, &mut sessions, &mut chains))?;
    let mut rest: Vec<Interaction> = chains.by_id.into_values().filter_map(|c| c.held).collect();
    rest.sort_by_key(|r| r.source_line);
    for r in rest {
        sink.emit(r)?;
    }
    Ok(())
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], sessions: &mut Sessions, chains: &mut Chains) -> Result<()> {
    let mut v = Value::Null;
    let (line, req, resp) = match read_exchange(n, text, &mut v, is_failed) {
        Ok(x) => x,
        Err((code, reason)) => return sink.dead(Some(n), code, reason, text),
    };
    let mut notes: Vec<String> = vec![];
    let (input, skipped_in) = match input_conversation(req, &mut notes) {
        Ok(x) => x,
        Err((code, reason)) => return sink.dead(Some(n), code, format!("line {n}, {reason}"), text),
    };
    let (r, skipped_out) = match reply(resp) {
        Ok(x) => x,
        Err((code, reason)) => return sink.dead(Some(n), code, format!("line {n}, {reason}"), text),
    };
    for (k, c) in skipped_in.iter().chain(&skipped_out) {
        sink.count(k, *c);
    }
    let mut request: Vec<Message> = vec![];
    let previous = req.get("previous_response_id").and_then(Value::as_str);
    let mut chained = None;
    let mut earlier: Option<Interaction> = None;
    if let Some(p) = previous {
        match chains.by_id.get_mut(p) {
            Some(before) => {
                // Instructions are not carried over a chain (the API's rule): only this request's count.
                request.extend(before.conversation.iter().filter(|m| m.role != "system").cloned());
                chained = before.placed.clone().map(|(s, inf, turn)| {
                    let next = chains.next_turn.get(&s).copied().unwrap_or(0).max(turn + 1);
                    (s, inf, next)
                });
                earlier = before.held.take();
            }
            None => notes.push(format!("previous response {p:?} is not in this file: the conversation starts at this request's input")),
        }
    }
    if let Some(sys) = instructions(req) {
        request.insert(0, sys);
    }
    let carried = request.len();
    request.extend(input);
    // The earlier response's next state is what this request adds after it.
    if let Some(mut e) = earlier {
        let added = &request[carried..];
        if e.next_state.is_none() && !added.is_empty() && added.iter().all(|m| m.role != "assistant") {
            e.next_state = Some(serde_json::to_string(added)?);
        }
        sink.emit(e)?;
    }
    let Reply { message: response, finish_reason, truncated, model, notes: mut reply_notes } = r;
    notes.append(&mut reply_notes);
    let mut full = request.clone();
    full.push(response.clone());
    let mut t = Turn::new(String::new(), 0, &request, &response);
    t.model = model.or_else(|| req.get("model").and_then(Value::as_str).map(str::to_string));
    t.tools = req.get("tools").filter(|v| !v.is_null()).map(Value::to_string);
    t.truncated = truncated;
    t.finish_reason = finish_reason;
    t.notes = notes;
    t.event_time = line.get("timestamp").or_else(|| line.get("time")).and_then(parse_timestamp).or_else(|| resp.get("created_at").and_then(parse_timestamp));
    t.source_line = Some(n);
    t.tenant = super::sink::request_tenant(line, req, &mut t.notes);
    let Some(row) = sessions.place(sink, n, text, line, req, t, chained)? else {
        return Ok(());
    };
    // Remember this response's conversation for requests that chain on it.
    let Some(id) = resp.get("id").and_then(Value::as_str) else {
        return sink.emit(row);
    };
    let placed = Some((row.session_id.clone(), row.session_inferred, row.turn_index));
    let next = chains.next_turn.entry(row.session_id.clone()).or_insert(0);
    *next = (*next).max(row.turn_index + 1);
    if let Some(old) = chains.by_id.insert(id.to_string(), Chained { conversation: full, placed, held: Some(row) }) {
        if let Some(r) = old.held {
            sink.emit(r)?;
        }
    } else {
        chains.order.push_back(id.to_string());
    }
    while chains.order.len() > chains.cap {
        if let Some(old) = chains.order.pop_front() {
            if let Some(r) = chains.by_id.remove(&old).and_then(|c| c.held) {
                sink.emit(r)?;
            }
            sink.count("responses forgotten for chaining (over the session cache)", 1);
        }
    }
    Ok(())
}
