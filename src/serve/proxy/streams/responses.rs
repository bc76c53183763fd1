//! The OpenAI Responses stream accumulator: a streamed response read from its terminal event (see
//! [`crate::serve::proxy::apis`]). Pure code, unit-tested below.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::serve::proxy::apis::responses_completed;
use crate::serve::proxy::response::{error_text, Completed, NoTurn, StreamState};

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
    /// Notes an event whose data is not JSON: the turn cannot be recorded.
    pub fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        self.state.unreadable_chunk(e);
    }

    /// The response's id, from the latest `response` snapshot seen (None before the first).
    pub fn response_id(&self) -> Option<&str> {
        self.response.as_ref()?.get("id")?.as_str()
    }

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
    /// [`crate::serve::proxy::apis::completed`].
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::serve::proxy::apis::Api;
    use crate::serve::proxy::streams::Accumulator;

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
}
