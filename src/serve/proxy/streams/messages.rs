//! The Anthropic Messages stream accumulator: a streamed message assembled from its content-block
//! deltas (see [`crate::serve::proxy::apis`]). Pure code, unit-tested below.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::serve::proxy::apis::messages_completed;
use crate::serve::proxy::response::{error_text, Completed, NoTurn, StreamState};

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
    /// Notes an event whose data is not JSON: the turn cannot be recorded.
    pub fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        self.state.unreadable_chunk(e);
    }

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
    /// JSON, [`NoTurn::Incomplete`] without a stop reason, or as [`crate::serve::proxy::apis::completed`].
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::serve::proxy::apis::Api;
    use crate::serve::proxy::streams::Accumulator;

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
