//! The chat-completions stream accumulator: choice 0 of a streamed chat completion assembled from
//! its chunks. Pure code, unit-tested below.

use serde_json::{json, Map, Value};

use crate::serve::openai::split_tool_calls;
use crate::serve::proxy::response::{assistant_message, Completed, NoTurn, StreamState};

/// One tool call being assembled from stream deltas.
#[derive(Debug, Clone, Default, PartialEq)]
struct PartialCall {
    id: Option<String>,
    name: String,
    arguments: String,
}

/// Assembles choice 0 of a chat-completions stream from its chunks (content, reasoning, tool-call
/// deltas merged by index, log-prob entries, token ids, finish reason).
#[derive(Debug, Clone, Default)]
pub struct StreamAccumulator {
    content: String,
    reasoning: String,
    calls: Vec<PartialCall>,
    logprobs: Vec<Value>,
    saw_logprobs: bool,
    token_ids: Vec<Value>,
    saw_token_ids: bool,
    prompt_token_ids: Option<Value>,
    policy_version: Option<i64>,
    model: Option<String>,
    finish_reason: Option<String>,
    max_index: usize,
    state: StreamState,
    done: bool,
}

impl StreamAccumulator {
    /// Feeds one SSE `data:` payload (`[DONE]` or a JSON chunk). A payload that is not JSON (e.g. a
    /// `NaN` log-prob) makes the turn unrecordable: [`StreamAccumulator::finish`] then returns
    /// [`NoTurn::BadResponse`] naming the chunk (its text may be missing from what was assembled).
    pub fn push_data(&mut self, data: &str) {
        let d = data.trim();
        if d == "[DONE]" {
            self.done = true;
            return;
        }
        match serde_json::from_str::<Value>(d) {
            Ok(v) => self.push(&v),
            Err(e) => self.unreadable_chunk(&e),
        }
    }

    /// Notes a `data:` payload that is not JSON (see [`StreamAccumulator::push_data`]).
    pub fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        self.state.unreadable_chunk(e);
    }

    /// Feeds one parsed chunk.
    pub fn push(&mut self, v: &Value) {
        self.state.chunks += 1;
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            self.state.error = Some(e.get("message").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| e.to_string()));
            return;
        }
        if self.prompt_token_ids.is_none() {
            self.prompt_token_ids = v.get("prompt_token_ids").filter(|t| !t.is_null()).cloned();
        }
        if let Some(pv) = v.get("policy_version").and_then(Value::as_i64) {
            self.policy_version = Some(pv);
        }
        if self.model.is_none() {
            self.model = v.get("model").and_then(Value::as_str).map(str::to_string);
        }
        let Some(choices) = v.get("choices").and_then(Value::as_array) else { return };
        for c in choices {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            self.max_index = self.max_index.max(index);
            if index != 0 {
                continue;
            }
            if let Some(delta) = c.get("delta") {
                if let Some(t) = delta.get("content").and_then(Value::as_str) {
                    self.content.push_str(t);
                }
                for key in ["reasoning_content", "reasoning"] {
                    if let Some(t) = delta.get(key).and_then(Value::as_str) {
                        self.reasoning.push_str(t);
                    }
                }
                if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                    for (pos, call) in calls.iter().enumerate() {
                        let i = call.get("index").and_then(Value::as_u64).map(|i| i as usize).unwrap_or(pos);
                        if i >= 1024 {
                            continue;
                        }
                        if self.calls.len() <= i {
                            self.calls.resize(i + 1, PartialCall::default());
                        }
                        let p = &mut self.calls[i];
                        if let Some(id) = call.get("id").and_then(Value::as_str) {
                            p.id = Some(id.to_string());
                        }
                        let f = call.get("function").unwrap_or(call);
                        if let Some(n) = f.get("name").and_then(Value::as_str) {
                            p.name.push_str(n);
                        }
                        match f.get("arguments") {
                            Some(Value::String(a)) => p.arguments.push_str(a),
                            Some(Value::Null) | None => {}
                            Some(other) => p.arguments.push_str(&other.to_string()),
                        }
                    }
                }
            }
            if let Some(entries) = c.get("logprobs").and_then(|l| l.get("content")).and_then(Value::as_array) {
                self.saw_logprobs = true;
                self.logprobs.extend(entries.iter().cloned());
            }
            if let Some(ids) = c.get("token_ids").and_then(Value::as_array) {
                self.saw_token_ids = true;
                self.token_ids.extend(ids.iter().cloned());
            }
            if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(f.to_string());
            }
        }
    }

    /// True once `[DONE]` was seen.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The assembled response.
    ///
    /// # Errors
    /// [`NoTurn::StreamError`] when a chunk carried an error, [`NoTurn::BadResponse`] when a chunk was
    /// not JSON, [`NoTurn::Incomplete`] when no finish reason arrived, [`NoTurn::Unusable`] when the
    /// assembled message does not normalise.
    pub fn finish(self) -> std::result::Result<Completed, NoTurn> {
        if let Some(f) = self.state.failure() {
            return Err(f);
        }
        if self.finish_reason.is_none() {
            return Err(NoTurn::Incomplete);
        }
        let mut notes = vec![];
        let calls: Vec<Value> = self
            .calls
            .iter()
            .filter(|c| !c.name.is_empty())
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
        let mut content = self.content;
        // Servers that stream the raw `<tool_call>` text and then the parsed calls (ours) return the
        // visible text without those blocks in a non-streamed response: record the same text.
        if !calls.is_empty() && content.contains("<tool_call>") {
            let (visible, parsed) = split_tool_calls(&content);
            if !parsed.is_empty() {
                content = visible;
                notes.push("tool-call text removed from the streamed content".to_string());
            }
        }
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert("content".into(), json!(content));
        if !self.reasoning.is_empty() {
            message.insert("reasoning_content".into(), json!(self.reasoning));
        }
        if !calls.is_empty() {
            message.insert("tool_calls".into(), Value::Array(calls));
        }
        let n = assistant_message(&message)?;
        notes.extend(n.notes);
        Ok(Completed {
            message: n.message,
            truncated: n.truncated,
            response_id: None,
            finish_reason: self.finish_reason,
            token_ids: self.saw_token_ids.then_some(Value::Array(self.token_ids)),
            logprobs: self.saw_logprobs.then_some(self.logprobs),
            prompt_token_ids: self.prompt_token_ids,
            policy_version: self.policy_version,
            model: self.model,
            n_choices: self.max_index + 1,
            notes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(delta: Value, extra: Value) -> Value {
        let mut c = json!({"index": 0, "delta": delta, "finish_reason": null});
        if let (Some(o), Some(e)) = (c.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        json!({"model": "m", "policy_version": 7, "choices": [c]})
    }

    #[test]
    fn accumulator_assembles_text_tool_calls_ids_and_logprobs() {
        let mut a = StreamAccumulator::default();
        let mut first = chunk(json!({"role": "assistant", "content": ""}), json!({}));
        first["prompt_token_ids"] = json!([1, 2, 3]);
        a.push(&first);
        a.push(&chunk(json!({"content": "Hel"}), json!({"token_ids": [10], "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]}})));
        a.push(&chunk(json!({"content": "lo", "reasoning_content": "hm"}), json!({"token_ids": [11], "logprobs": {"content": [{"token": "lo", "logprob": -0.25}]}})));
        a.push(&chunk(json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get", "arguments": "{\"x\""}}]}), json!({})));
        a.push(&chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}), json!({"finish_reason": "tool_calls"})));
        a.push_data("[DONE]");
        assert!(a.done());
        let c = a.finish().unwrap();
        assert_eq!(c.message.content, "Hello");
        assert_eq!(c.message.reasoning.as_deref(), Some("hm"));
        assert_eq!(c.message.tool_calls.len(), 1);
        let call = &c.message.tool_calls[0];
        assert_eq!((call.id.as_deref(), call.name.as_str(), &call.arguments, call.arguments_raw.as_deref()), (Some("c1"), "get", &json!({"x": 1}), Some("{\"x\": 1}")));
        assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(c.token_ids, Some(json!([10, 11])));
        assert_eq!(c.logprobs.as_ref().map(Vec::len), Some(2));
        assert_eq!(c.prompt_token_ids, Some(json!([1, 2, 3])));
        assert_eq!((c.policy_version, c.model.as_deref(), c.n_choices), (Some(7), Some("m"), 1));
    }

    #[test]
    fn accumulator_errors_and_incomplete_streams() {
        let mut a = StreamAccumulator::default();
        a.push(&chunk(json!({"content": "x"}), json!({})));
        assert_eq!(a.clone().finish().unwrap_err(), NoTurn::Incomplete);
        a.push_data(r#"{"error": {"message": "boom"}}"#);
        assert_eq!(a.finish().unwrap_err(), NoTurn::StreamError("boom".into()));
    }

    #[test]
    fn streamed_tool_call_text_is_removed_like_the_non_streamed_response() {
        let mut a = StreamAccumulator::default();
        a.push(&chunk(json!({"content": "ok <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"}), json!({})));
        a.push(&chunk(json!({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}), json!({"finish_reason": "tool_calls"})));
        let c = a.finish().unwrap();
        assert_eq!(c.message.content, "ok");
        assert_eq!(c.notes.len(), 1);
    }

    #[test]
    fn unreadable_stream_chunks_make_the_turn_a_bad_response() {
        let mut a = StreamAccumulator::default();
        a.push(&chunk(json!({"content": "a"}), json!({})));
        a.push_data(r#"{"choices": [{"index": 0, "delta": {"content": "b"}, "logprobs": {"content": [{"logprob": NaN}]}}]}"#);
        a.push(&chunk(json!({}), json!({"finish_reason": "stop"})));
        a.push_data("[DONE]");
        assert_eq!(a.finish().unwrap_err(), NoTurn::BadResponse("stream chunk 2 of 3 is not JSON: expected value at line 1 column 91".into()));
    }
}
