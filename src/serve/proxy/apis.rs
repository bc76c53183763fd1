//! The APIs the capture proxy speaks: OpenAI chat completions (`POST /v1/chat/completions`), the
//! OpenAI Responses API (`POST /v1/responses`) and the Anthropic Messages API (`POST /v1/messages`).
//!
//! Each is forwarded as is (only the turn-metadata body keys are removed; chat requests are also
//! rewritten for log-probs, see [`super::request::prepare_request`]) and captured as one turn. The
//! request's conversation and the response's assistant message are read by the same functions as
//! the log readers `openai-chat`, `openai-responses` and `anthropic-messages`
//! ([`crate::ingest`]), so a proxied exchange and a logged one become the same row:
//! - Responses: `instructions` → the system message, `input` (a string or items: messages,
//!   `function_call`, `function_call_output`, `reasoning`, ...) → messages; the response's `output`
//!   items → one assistant message; `status = "incomplete"` with reason `max_output_tokens` →
//!   finish reason `length`, truncated; function calls → `tool_calls`, else `stop`. A request with
//!   `previous_response_id` continues a response this process captured
//!   ([`super::sessions::Sessions::chain`]): its conversation is the chain's (instructions are not
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

use serde_json::{Map, Value};

use super::response::{Completed, NoTurn};
use crate::ingest::anthropic_messages::{self as messages_api, Unusable};
use crate::ingest::items::Skipped;
use crate::ingest::normalize::{json_type, normalize_request};
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
        out.extend_from_slice(&super::sse::SseEvent::with_data(&data.to_string()));
        out
    }

    /// An error body of the proxy itself in this API's own shape. Chat completions and Responses:
    /// OpenAI's `{"error": {"message", "type": kind, "param": null, "code"}}`. Messages: Anthropic's
    /// `{"type": "error", "error": {"type", "message"}}`, `error.type` chosen by `status`
    /// ([`anthropic_error_type`]; `kind` is OpenAI's and unused), plus `error.code` when `code` is
    /// given (the proxy's reason code, as in the OpenAI shape; Anthropic clients ignore it).
    pub fn error_body(self, status: u16, message: &str, kind: &str, code: Option<&str>) -> Value {
        match self {
            Api::ChatCompletions | Api::Responses => crate::serve::openai::error_body(message, kind, code),
            Api::Messages => {
                let mut e = serde_json::json!({"type": anthropic_error_type(status), "message": message});
                if let Some(c) = code {
                    e["code"] = Value::String(c.to_string());
                }
                serde_json::json!({"type": "error", "error": e})
            }
        }
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

/// Anthropic's `error.type` for an HTTP status (the Messages API's error list): 401
/// `authentication_error`, 403 `permission_error`, 404 `not_found_error`, 413 `request_too_large`,
/// 429 `rate_limit_error`, 504 `timeout_error`, 529 `overloaded_error`, any other 4xx
/// `invalid_request_error`, any other status `api_error`.
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Counts of items not recorded, as notes ("2 web_search_call items not recorded").
fn skipped_notes(skipped: Skipped, notes: &mut Vec<String>) {
    notes.extend(skipped.into_iter().map(|(what, n)| format!("{n} {what} not recorded")));
}

/// A chat request's `messages` the way the proxy records them: a JSON array of messages that
/// normalise ([`normalize_request`]: a known role, content a string, a list of parts or null, ...;
/// notes appended to `notes`). A request that could not become an `interactions` row is refused
/// before the upstream runs.
///
/// # Errors
/// `missing_messages` or the normalisation error's code, with what is wrong.
pub fn chat_conversation(messages: Option<&Value>, notes: &mut Vec<String>) -> Result<Vec<Message>, Unusable> {
    let list = match messages {
        Some(Value::Array(l)) => l,
        None => return Err(("missing_messages", "request has no `messages`".into())),
        Some(other) => return Err(("missing_messages", format!("request `messages` is a JSON {}, expected an array", json_type(other)))),
    };
    normalize_request(list, notes).map_err(|(i, e)| (e.code(), format!("messages[{i}] of {}: {e}", list.len())))
}

/// A request body's conversation for `api`, normalised; normalisation notes appended to `notes`.
///
/// # Errors
/// `missing_messages` when chat / Messages `messages` is not an array or a Responses request has no
/// `input`; the normaliser's code for a message or item that does not normalise.
pub fn conversation(api: Api, body: &Map<String, Value>, notes: &mut Vec<String>) -> Result<Vec<Message>, Unusable> {
    match api {
        Api::ChatCompletions => chat_conversation(body.get("messages"), notes),
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

/// A Responses API response object as a finished turn (also the end of a Responses stream).
///
/// # Errors
/// As [`completed`].
pub(crate) fn responses_completed(obj: &Map<String, Value>) -> Result<Completed, NoTurn> {
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

/// A Messages API message object as a finished turn (also the end of a Messages stream).
///
/// # Errors
/// As [`completed`].
pub(crate) fn messages_completed(obj: &Map<String, Value>) -> Result<Completed, NoTurn> {
    if messages_api::is_error(obj) {
        return Err(NoTurn::Unusable("api_error", format!("the upstream answered with an error: {}", obj.get("error").unwrap_or(&Value::Null))));
    }
    let reply = messages_api::reply(obj).map_err(|(code, reason)| NoTurn::Unusable(code, reason))?;
    Ok(Completed::of_reply(reply, None, obj.get("policy_version").and_then(Value::as_i64)))
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
    fn proxy_errors_in_each_api_shape() {
        assert_eq!(Api::Messages.error_body(502, "down", "upstream_error", None), json!({"type": "error", "error": {"type": "api_error", "message": "down"}}));
        assert_eq!(Api::Messages.error_body(400, "bad", "invalid_request_error", Some("malformed_json"))["error"], json!({"type": "invalid_request_error", "message": "bad", "code": "malformed_json"}));
        assert_eq!(Api::Responses.error_body(404, "no", "invalid_request_error", Some("unknown_route")), json!({"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": "unknown_route"}}));
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
}
