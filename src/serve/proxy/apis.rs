//! The APIs the capture proxy speaks: OpenAI chat completions (`POST /v1/chat/completions`), the
//! OpenAI Responses API (`POST /v1/responses`) and the Anthropic Messages API (`POST /v1/messages`).
//!
//! Each is forwarded as is (only the turn-metadata body keys are removed; chat requests are also
//! rewritten for log-probs, see [`super::capture::prepare_request`]) and captured as one turn. The
//! request's conversation and the response's assistant message are read by the same functions as
//! the log readers `openai-chat`, `openai-responses` and `anthropic-messages`
//! ([`crate::ingest`]), so a proxied exchange and a logged one become the same row:
//! - Responses: `instructions` → the system message, `input` (a string or items: messages,
//!   `function_call`, `function_call_output`, `reasoning`, ...) → messages; the response's `output`
//!   items → one assistant message; `status = "incomplete"` with reason `max_output_tokens` →
//!   finish reason `length`, truncated; function calls → `tool_calls`, else `stop`. A request with
//!   `previous_response_id` continues a response this process captured
//!   ([`super::capture::Sessions::chain`]): its conversation is the chain's (instructions are not
//!   carried over a chain, the API's rule), and without an explicit session it is the next turn of
//!   that response's session. A chain this process did not see starts at the request's input, with a
//!   note. The signal stage pairs turns by content: a chained request whose instructions differ
//!   from the earlier one's does not start like the earlier turn's conversation, so that turn is
//!   not paired with it (clients that send the same instructions with every request pair).
//! - Messages: `system` → the system message, `messages` (content blocks: `tool_use` → tool calls,
//!   `tool_result` → `tool` messages, `thinking` → reasoning); `stop_reason` `tool_use` →
//!   `tool_calls`, `end_turn`/`stop_sequence` → `stop`, `max_tokens` → `length`, truncated.
//! - Streams (`stream: true`) are passed to the client byte for byte as they arrive and assembled on
//!   the way: Responses from the terminal `response.completed` / `response.incomplete` event's
//!   `response` (its `output`, or the `response.output_item.done` items when that is empty);
//!   Messages from `message_start`, `content_block_start` / `_delta` (`text_delta`,
//!   `thinking_delta`, `input_json_delta`) / `_stop` and `message_delta`'s `stop_reason`. An `error`
//!   event or `response.failed` is the upstream's error (counted, no row); a stream that ends without
//!   its terminal event is an `incomplete_stream` dead letter.
//! - Neither API returns token ids, so these rows carry text only (the trainer tokenises them).
//!
//! Sources: the Responses API and Messages API references (streaming events included),
//! openai-python `types/responses/` and anthropic-sdk-python `types/` (read, not copied).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::capture::{chat_conversation, Completed, NoTurn, StreamAccumulator, StreamState};
use crate::ingest::anthropic_messages::{self as messages_api, Unusable};
use crate::ingest::items::Skipped;
use crate::ingest::normalize::json_type;
use crate::ingest::openai_responses as responses_api;
use crate::schema::Message;

/// An API the proxy forwards and captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat completions.
    ChatCompletions,
    /// OpenAI Responses.
    Responses,
    /// Anthropic Messages.
    Messages,
}

impl Api {
    /// An SSE error event in this API's own shape, telling a streaming client that the upstream's
    /// stream broke off (chat: a `data:` chunk with `error`; Responses: an `error` event; Messages: an
    /// `error` event with `error.type = "api_error"`, which the Anthropic clients raise).
    pub fn stream_error_event(self, message: &str) -> Vec<u8> {
        let (event, data) = match self {
            Api::ChatCompletions => (None, crate::serve::openai::error_body(message, "upstream_error", None)),
            Api::Responses => (Some("error"), serde_json::json!({"type": "error", "code": "upstream_error", "message": message, "param": null})),
            Api::Messages => (Some("error"), serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}})),
        };
        let mut out = vec![];
        if let Some(e) = event {
            out.extend_from_slice(format!("event: {e}\n").as_bytes());
        }
        out.extend_from_slice(&super::capture::SseEvent::with_data(&data.to_string()));
        out
    }

    /// The request path, the same on the proxy and the upstream.
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// The route's metrics label.
    pub fn route(self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat_completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }
}

/// Counts of items not recorded, as notes ("2 web_search_call items not recorded").
fn skipped_notes(skipped: Skipped, notes: &mut Vec<String>) {
    notes.extend(skipped.into_iter().map(|(what, n)| format!("{n} {what} not recorded")));
}

/// A request body's conversation for `api`, normalised; normalisation notes appended to `notes`.
///
/// # Errors
/// `missing_messages` when chat / Messages `messages` is not an array or a Responses request has no
/// `input`; the normaliser's code for a message or item that does not normalise.
pub fn conversation(api: Api, body: &Map<String, Value>, notes: &mut Vec<String>) -> Result<Vec<Message>, Unusable> {
    match api {
        Api::ChatCompletions => chat_conversation(body.get("messages"), notes).map_err(|r| (r.code, r.message)),
        Api::Messages => messages_api::request_conversation(body, notes).map_err(|(code, reason)| (code, format!("request {reason}"))),
        Api::Responses => {
            match body.get("input") {
                None | Some(Value::Null) => return Err(("missing_messages", "request has no `input`".into())),
                Some(Value::String(_)) | Some(Value::Array(_)) => {}
                Some(other) => return Err(("wrong_type", format!("request `input` is a JSON {}, expected a string or a list of items", json_type(other)))),
            }
            let mut out: Vec<Message> = responses_api::instructions(body).into_iter().collect();
            let (input, skipped) = responses_api::input_conversation(body, notes)?;
            skipped_notes(skipped, notes);
            out.extend(input);
            Ok(out)
        }
    }
}

/// A non-streamed 2xx response body of `api` as a finished turn.
///
/// # Errors
/// Chat: as [`Completed::from_response`]. Responses / Messages: [`NoTurn::BadResponse`] when the body
/// is not an object, [`NoTurn::Unusable`] with `api_error` for a failed response or an error body,
/// or the normaliser's code.
pub fn completed(api: Api, v: &Value) -> Result<Completed, NoTurn> {
    if api == Api::ChatCompletions {
        return Completed::from_response(v);
    }
    let Some(obj) = v.as_object() else {
        return Err(NoTurn::BadResponse(format!("response is a JSON {}, expected an object", json_type(v))));
    };
    match api {
        Api::Responses => responses_completed(obj),
        _ => messages_completed(obj),
    }
}

fn responses_completed(obj: &Map<String, Value>) -> Result<Completed, NoTurn> {
    if responses_api::is_failed(obj) {
        return Err(NoTurn::Unusable("api_error", format!("the response failed: {}", obj.get("error").unwrap_or(&Value::Null))));
    }
    // A background response (`queued`, `in_progress`) or a cancelled one has no finished output.
    match obj.get("status").and_then(Value::as_str) {
        None | Some("completed") | Some("incomplete") => {}
        Some(other) => return Err(NoTurn::Unusable("not_finished", format!("the response's status is {other:?}: no finished output to record"))),
    }
    let (reply, skipped) = responses_api::reply(obj).map_err(|(code, reason)| NoTurn::Unusable(code, reason))?;
    let mut c = Completed::of_reply(reply, obj.get("id").and_then(Value::as_str).map(str::to_string), obj.get("policy_version").and_then(Value::as_i64));
    skipped_notes(skipped, &mut c.notes);
    Ok(c)
}

fn messages_completed(obj: &Map<String, Value>) -> Result<Completed, NoTurn> {
    if messages_api::is_error(obj) {
        return Err(NoTurn::Unusable("api_error", format!("the upstream answered with an error: {}", obj.get("error").unwrap_or(&Value::Null))));
    }
    let reply = messages_api::reply(obj).map_err(|(code, reason)| NoTurn::Unusable(code, reason))?;
    Ok(Completed::of_reply(reply, None, obj.get("policy_version").and_then(Value::as_i64)))
}

/// The message of an `error` event or error object (`{message}` or `{error: {message}}`).
fn error_text(v: &Value) -> String {
    v.get("message").or_else(|| v.get("error").and_then(|e| e.get("message"))).and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| v.to_string())
}

/// Assembles a Responses API stream (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ResponsesStream {
    state: StreamState,
    /// The latest `response` snapshot (created, in progress, then the terminal one).
    response: Option<Map<String, Value>>,
    /// The terminal event seen (`response.completed` or `response.incomplete`).
    terminal: bool,
    /// `response.output_item.done` items by output index.
    items: BTreeMap<u64, Value>,
}

impl ResponsesStream {
    /// Feeds one event's data.
    pub fn push(&mut self, v: &Value) {
        self.state.chunks += 1;
        let ty = v.get("type").and_then(Value::as_str).unwrap_or("");
        match ty {
            "error" => self.state.error = Some(error_text(v)),
            "response.failed" => {
                let e = v.get("response").and_then(|r| r.get("error")).filter(|e| !e.is_null());
                self.state.error = Some(e.map(error_text).unwrap_or_else(|| "the response failed".into()));
            }
            "response.completed" | "response.incomplete" | "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(r) = v.get("response").and_then(Value::as_object) {
                    if !self.terminal {
                        self.response = Some(r.clone());
                    }
                }
                if ty == "response.completed" || ty == "response.incomplete" {
                    self.terminal = true;
                }
            }
            "response.output_item.done" => {
                if let Some(item) = v.get("item") {
                    let index = v.get("output_index").and_then(Value::as_u64).unwrap_or(self.items.len() as u64);
                    self.items.insert(index, item.clone());
                }
            }
            _ => {}
        }
    }

    /// The assembled turn.
    ///
    /// # Errors
    /// [`NoTurn::StreamError`] for an `error` event or `response.failed`, [`NoTurn::BadResponse`] for
    /// a chunk that was not JSON, [`NoTurn::Incomplete`] without a terminal event, or as
    /// [`completed`].
    pub fn finish(self) -> Result<Completed, NoTurn> {
        if let Some(f) = self.state.failure() {
            return Err(f);
        }
        let (true, Some(mut resp)) = (self.terminal, self.response) else {
            return Err(NoTurn::Incomplete);
        };
        let empty = resp.get("output").and_then(Value::as_array).is_none_or(Vec::is_empty);
        if empty && !self.items.is_empty() {
            resp.insert("output".into(), Value::Array(self.items.into_values().collect()));
        }
        responses_completed(&resp)
    }
}

/// Assembles an Anthropic Messages stream (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct MessagesStream {
    state: StreamState,
    /// The message of `message_start` (id, model, role).
    message: Option<Map<String, Value>>,
    /// Content blocks by index, as they are completed by deltas.
    blocks: BTreeMap<u64, Map<String, Value>>,
    /// `input_json_delta` fragments of tool-use blocks by index.
    partial_json: BTreeMap<u64, String>,
    stop_reason: Option<String>,
    notes: Vec<String>,
}

fn push_str(block: &mut Map<String, Value>, key: &str, s: &str) {
    match block.get_mut(key) {
        Some(Value::String(t)) => t.push_str(s),
        _ => {
            block.insert(key.into(), Value::String(s.to_string()));
        }
    }
}

impl MessagesStream {
    /// Feeds one event's data.
    pub fn push(&mut self, v: &Value) {
        self.state.chunks += 1;
        let index = v.get("index").and_then(Value::as_u64).unwrap_or(0);
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "error" => self.state.error = Some(error_text(v)),
            "message_start" => self.message = v.get("message").and_then(Value::as_object).cloned(),
            "content_block_start" => {
                if let Some(b) = v.get("content_block").and_then(Value::as_object) {
                    self.blocks.insert(index, b.clone());
                }
            }
            "content_block_delta" => {
                let Some(delta) = v.get("delta") else { return };
                let block = self.blocks.entry(index).or_default();
                let text = |k: &str| delta.get(k).and_then(Value::as_str).unwrap_or("");
                match delta.get("type").and_then(Value::as_str).unwrap_or("") {
                    "text_delta" => push_str(block, "text", text("text")),
                    "thinking_delta" => push_str(block, "thinking", text("thinking")),
                    "signature_delta" => push_str(block, "signature", text("signature")),
                    "input_json_delta" => self.partial_json.entry(index).or_default().push_str(text("partial_json")),
                    _ => {}
                }
            }
            "content_block_stop" => self.close_block(index),
            "message_delta" => {
                if let Some(r) = v.get("delta").and_then(|d| d.get("stop_reason")).and_then(Value::as_str) {
                    self.stop_reason = Some(r.to_string());
                }
            }
            _ => {}
        }
    }

    /// A tool-use block's input from its JSON fragments (none: the start's input, `{}`).
    fn close_block(&mut self, index: u64) {
        let Some(json) = self.partial_json.remove(&index) else { return };
        let Some(block) = self.blocks.get_mut(&index) else { return };
        let input = if json.trim().is_empty() {
            Value::Object(Map::new())
        } else {
            match serde_json::from_str::<Value>(&json) {
                Ok(v) => v,
                Err(e) => {
                    self.notes.push(format!("tool-use block {index}: streamed input is not JSON ({e}); kept raw"));
                    Value::String(json)
                }
            }
        };
        block.insert("input".into(), input);
    }

    /// The assembled turn.
    ///
    /// # Errors
    /// [`NoTurn::StreamError`] for an `error` event, [`NoTurn::BadResponse`] for a chunk that was not
    /// JSON, [`NoTurn::Incomplete`] without a stop reason, or as [`completed`].
    pub fn finish(mut self) -> Result<Completed, NoTurn> {
        if let Some(f) = self.state.failure() {
            return Err(f);
        }
        let Some(stop) = self.stop_reason.take() else {
            return Err(NoTurn::Incomplete);
        };
        let open: Vec<u64> = self.partial_json.keys().copied().collect();
        for i in open {
            self.close_block(i);
        }
        let mut m = self.message.take().unwrap_or_default();
        m.insert("content".into(), Value::Array(std::mem::take(&mut self.blocks).into_values().map(Value::Object).collect()));
        m.insert("stop_reason".into(), Value::String(stop));
        let mut c = messages_completed(&m)?;
        c.notes.append(&mut self.notes);
        Ok(c)
    }
}

/// A stream being assembled, whichever the API.
#[derive(Debug, Clone)]
pub enum Accumulator {
    /// Chat-completions chunks.
    Chat(StreamAccumulator),
    /// Responses events.
    Responses(ResponsesStream),
    /// Messages events.
    Messages(MessagesStream),
}

impl Accumulator {
    /// An empty accumulator for `api`.
    pub fn new(api: Api) -> Accumulator {
        match api {
            Api::ChatCompletions => Accumulator::Chat(StreamAccumulator::default()),
            Api::Responses => Accumulator::Responses(ResponsesStream::default()),
            Api::Messages => Accumulator::Messages(MessagesStream::default()),
        }
    }

    /// Feeds one event's parsed data.
    pub fn push(&mut self, v: &Value) {
        match self {
            Accumulator::Chat(a) => a.push(v),
            Accumulator::Responses(a) => a.push(v),
            Accumulator::Messages(a) => a.push(v),
        }
    }

    /// Feeds a `[DONE]` marker (chat completions; the other APIs send none).
    pub fn done_marker(&mut self) {
        if let Accumulator::Chat(a) = self {
            a.push_data("[DONE]");
        }
    }

    /// Notes an event whose data is not JSON: the turn cannot be recorded.
    pub fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        match self {
            Accumulator::Chat(a) => a.unreadable_chunk(e),
            Accumulator::Responses(a) => a.state.unreadable_chunk(e),
            Accumulator::Messages(a) => a.state.unreadable_chunk(e),
        }
    }

    /// The assembled turn.
    ///
    /// # Errors
    /// As [`StreamAccumulator::finish`], [`ResponsesStream::finish`], [`MessagesStream::finish`].
    pub fn finish(self) -> Result<Completed, NoTurn> {
        match self {
            Accumulator::Chat(a) => a.finish(),
            Accumulator::Responses(a) => a.finish(),
            Accumulator::Messages(a) => a.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn responses_requests_read_instructions_and_items() {
        let body = obj(json!({"model": "m", "instructions": "Be brief", "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "web_search_call", "id": "ws1", "status": "completed"}
        ]}));
        let mut notes = vec![];
        let ms = conversation(Api::Responses, &body, &mut notes).unwrap();
        let roles: Vec<&str> = ms.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!((ms[0].content.as_str(), ms[1].content.as_str()), ("Be brief", "weather?"));
        assert_eq!(ms[2].tool_calls[0].name, "get_weather");
        assert_eq!(ms[2].tool_calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!((ms[3].content.as_str(), ms[3].tool_call_id.as_deref()), ("18C", Some("c1")));
        assert_eq!(notes, ["1 web_search_call items not recorded"]);
        let plain = conversation(Api::Responses, &obj(json!({"input": "hi"})), &mut vec![]).unwrap();
        assert_eq!((plain.len(), plain[0].role.as_str(), plain[0].content.as_str()), (1, "user", "hi"));
        assert_eq!(conversation(Api::Responses, &obj(json!({"model": "m"})), &mut vec![]).unwrap_err().0, "missing_messages");
        assert_eq!(conversation(Api::Responses, &obj(json!({"input": 3})), &mut vec![]).unwrap_err().0, "wrong_type");
        assert_eq!(conversation(Api::Responses, &obj(json!({"input": [{"role": "elf", "content": "x"}]})), &mut vec![]).unwrap_err().0, "unknown_role");
    }

    #[test]
    fn messages_requests_read_system_and_blocks() {
        let body = obj(json!({"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "S"}], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}, {"type": "text", "text": "thanks"}]}
        ]}));
        let ms = conversation(Api::Messages, &body, &mut vec![]).unwrap();
        let got: Vec<(&str, &str)> = ms.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(got, [("system", "S"), ("user", "hi"), ("assistant", ""), ("tool", "42"), ("user", "thanks")]);
        assert_eq!((ms[2].tool_calls[0].id.as_deref(), &ms[2].tool_calls[0].arguments), (Some("t1"), &json!({"a": 1})));
        assert_eq!(ms[3].tool_call_id.as_deref(), Some("t1"));
        assert_eq!(conversation(Api::Messages, &obj(json!({"model": "m"})), &mut vec![]).unwrap_err().0, "missing_messages");
    }

    #[test]
    fn stream_error_events_in_each_api_shape() {
        let text = |api: Api| String::from_utf8(api.stream_error_event("cut")).unwrap();
        assert_eq!(text(Api::ChatCompletions), "data: {\"error\":{\"code\":null,\"message\":\"cut\",\"param\":null,\"type\":\"upstream_error\"}}\n\n");
        assert_eq!(text(Api::Responses), "event: error\ndata: {\"code\":\"upstream_error\",\"message\":\"cut\",\"param\":null,\"type\":\"error\"}\n\n");
        assert_eq!(text(Api::Messages), "event: error\ndata: {\"error\":{\"message\":\"cut\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n");
    }

    #[test]
    fn non_streamed_responses_and_messages() {
        let r = completed(
            Api::Responses,
            &json!({"id": "resp_1", "object": "response", "status": "incomplete", "model": "gpt-x",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hel"}]}]}),
        )
        .unwrap();
        assert_eq!((r.message.content.as_str(), r.finish_reason.as_deref(), r.truncated), ("Hel", Some("length"), true));
        assert_eq!((r.response_id.as_deref(), r.model.as_deref()), (Some("resp_1"), Some("gpt-x")));
        let failed = completed(Api::Responses, &json!({"id": "r", "status": "failed", "error": {"message": "x"}, "output": []})).unwrap_err();
        assert_eq!(failed.code(), "api_error");
        let queued = completed(Api::Responses, &json!({"id": "r", "status": "queued", "background": true, "output": []})).unwrap_err();
        assert_eq!(queued.code(), "not_finished");
        let m = completed(
            Api::Messages,
            &json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": "Done."}], "stop_reason": "end_turn"}),
        )
        .unwrap();
        assert_eq!((m.message.content.as_str(), m.finish_reason.as_deref(), m.truncated, m.response_id), ("Done.", Some("stop"), false, None));
        assert_eq!(completed(Api::Messages, &json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})).unwrap_err().code(), "api_error");
        assert_eq!(completed(Api::Messages, &json!([1])).unwrap_err().code(), "bad_response");
    }

    fn responses_events() -> Vec<Value> {
        let reasoning = json!({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]});
        let call = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"});
        vec![
            json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress", "model": "gpt-x", "output": []}}),
            json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": []}}),
            json!({"type": "response.reasoning_summary_text.delta", "output_index": 0, "delta": "think"}),
            json!({"type": "response.output_item.done", "output_index": 0, "item": reasoning}),
            json!({"type": "response.output_item.added", "output_index": 1, "item": {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ""}}),
            json!({"type": "response.function_call_arguments.delta", "output_index": 1, "delta": "{\"city\":"}),
            json!({"type": "response.output_item.done", "output_index": 1, "item": call}),
            json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "model": "gpt-x", "output": [reasoning, call]}}),
        ]
    }

    #[test]
    fn responses_streams_are_read_from_the_terminal_event() {
        let mut a = Accumulator::new(Api::Responses);
        for e in responses_events() {
            a.push(&e);
        }
        let c = a.finish().unwrap();
        assert_eq!((c.message.content.as_str(), c.message.reasoning.as_deref()), ("", Some("think")));
        let call = &c.message.tool_calls[0];
        assert_eq!((call.id.as_deref(), call.name.as_str(), &call.arguments), (Some("call_1"), "get_weather", &json!({"city": "Paris"})));
        assert_eq!((c.finish_reason.as_deref(), c.response_id.as_deref(), c.model.as_deref()), (Some("tool_calls"), Some("resp_1"), Some("gpt-x")));

        // A terminal event with an empty output: the done items stand in.
        let mut ev = responses_events();
        ev[7]["response"]["output"] = json!([]);
        let mut a = ResponsesStream::default();
        ev.iter().for_each(|e| a.push(e));
        assert_eq!(a.finish().unwrap().message.tool_calls.len(), 1);

        // No terminal event; an error event; a failed response.
        let mut a = ResponsesStream::default();
        ev[..7].iter().for_each(|e| a.push(e));
        assert_eq!(a.clone().finish().unwrap_err(), NoTurn::Incomplete);
        a.push(&json!({"type": "error", "code": "server_error", "message": "boom"}));
        assert_eq!(a.finish().unwrap_err(), NoTurn::StreamError("boom".into()));
        let mut a = ResponsesStream::default();
        a.push(&json!({"type": "response.failed", "response": {"id": "r", "status": "failed", "error": {"code": "x", "message": "model crashed"}}}));
        assert_eq!(a.finish().unwrap_err(), NoTurn::StreamError("model crashed".into()));
    }

    fn messages_events() -> Vec<Value> {
        vec![
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-x", "stop_reason": null}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me "}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "check."}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Checking "}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "now."}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": \"Par"}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "is\"}"}}),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 30}}),
            json!({"type": "message_stop"}),
        ]
    }

    #[test]
    fn messages_streams_are_assembled_from_their_deltas() {
        let mut a = Accumulator::new(Api::Messages);
        for e in messages_events() {
            a.push(&e);
        }
        let c = a.finish().unwrap();
        assert_eq!((c.message.content.as_str(), c.message.reasoning.as_deref()), ("Checking now.", Some("Let me check.")));
        let call = &c.message.tool_calls[0];
        assert_eq!((call.id.as_deref(), call.name.as_str(), &call.arguments), (Some("toolu_1"), "get_weather", &json!({"city": "Paris"})));
        assert_eq!((c.finish_reason.as_deref(), c.model.as_deref(), c.truncated), (Some("tool_calls"), Some("claude-x"), false));
        assert!(c.notes.is_empty(), "{:?}", c.notes);

        // Cut before message_delta: incomplete. A tool input that never became JSON is kept raw.
        let ev = messages_events();
        let mut a = MessagesStream::default();
        ev[..15].iter().for_each(|e| a.push(e));
        assert_eq!(a.clone().finish().unwrap_err(), NoTurn::Incomplete);
        a.push(&json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}));
        let c = a.finish().unwrap();
        assert_eq!((c.finish_reason.as_deref(), c.truncated), (Some("length"), true));
        assert_eq!(c.message.tool_calls[0].arguments, json!({"city": "Paris"}));
        let mut a = MessagesStream::default();
        ev[..14].iter().for_each(|e| a.push(e));
        a.push(&json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}));
        let c = a.finish().unwrap();
        assert!(c.notes.iter().any(|n| n.starts_with("tool-use block 2: streamed input is not JSON")), "{:?}", c.notes);

        let mut a = Accumulator::new(Api::Messages);
        a.push(&ev[0]);
        a.push(&json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}));
        assert_eq!(a.finish().unwrap_err(), NoTurn::StreamError("Overloaded".into()));
    }
}
