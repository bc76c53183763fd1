//! OpenAI chat-completions wire types (the subset the policy server and the proxy speak) and their
//! conversion to the crate's [`Message`] / [`ToolCall`]; the legacy completions request with vLLM's
//! `prompt_logprobs` ([`CompletionRequest`]).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::schema::{Message, ToolCall};
use crate::Result;

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum StopField {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// A `POST /v1/chat/completions` body. Unknown fields are ignored, as OpenAI-compatible servers do.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct ChatCompletionRequest {
    /// Model name (informational; the server serves one model).
    #[serde(default)]
    pub model: Option<String>,
    /// Conversation so far (OpenAI message objects).
    pub messages: Vec<Value>,
    /// Tool definitions, passed through to the chat template.
    #[serde(default)]
    pub tools: Option<Value>,
    /// Sampling temperature (OpenAI default 1; 0 = greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (vLLM extension; 0 or −1 = off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Token limit (legacy name).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Token limit (current name; wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopField>,
    /// Extra stop token ids (vLLM extension), in addition to the model's EOS ids.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Return per-token log-probs.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Number of alternatives per token (0..=20; needs `logprobs`).
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Extension: `"sampling"` (default) or `"raw"`: which distribution the returned log-probs of
    /// sampled tokens refer to (see `crate::model::generate`).
    #[serde(default)]
    pub logprobs_mode: Option<String>,
    /// Extension: extra chat-template variables (e.g. `{"enable_thinking": false}`).
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `prompt` of a `POST /v1/completions`: text, token ids, or a list of one of them (OpenAI's batch
/// form, of which one prompt is supported).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum PromptField {
    /// Token ids, used as they are (no special tokens added).
    Ids(Vec<u32>),
    /// Text, tokenised with the served model's tokenizer (no special tokens added).
    Text(String),
    /// Several token-id prompts.
    ManyIds(Vec<Vec<u32>>),
    /// Several text prompts.
    ManyTexts(Vec<String>),
}

/// Most prompt log-probs per position a `/v1/completions` request may ask for (vLLM's default
/// `max_logprobs` is 20; scoring teachers use a few more at most).
pub const MAX_PROMPT_LOGPROBS: usize = 100;

/// A `POST /v1/completions` body: the OpenAI legacy completions API with vLLM's `prompt_logprobs`
/// extension (the subset `nextstate serve` implements; unknown fields are ignored, missing ones are
/// `None`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct CompletionRequest {
    /// Model name (informational; the server serves one model).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: PromptField,
    /// Tokens to generate after the prompt (default 16, as OpenAI's; 0 = score only).
    pub max_tokens: Option<usize>,
    /// Sampling temperature (default 1; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k sampling (vLLM extension; 0 or −1 = off).
    pub top_k: Option<i64>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// vLLM extension: return, for every prompt position after the first, the log-prob of the prompt
    /// token and of the K most likely tokens (0..=[`MAX_PROMPT_LOGPROBS`]).
    pub prompt_logprobs: Option<i64>,
    /// Log-probs of generated tokens (legacy); not supported here (refused when > 0).
    pub logprobs: Option<i64>,
    /// Echo the prompt in the text; not supported (refused when true).
    pub echo: Option<bool>,
    /// Number of choices; only 1 is supported.
    pub n: Option<usize>,
    /// Streaming; not supported on this route (refused when true).
    pub stream: Option<bool>,
}

/// Text of an OpenAI `content` (string, null, or a list of parts whose `text` parts are joined).
fn content_text(v: Option<&Value>) -> std::result::Result<String, String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(|t| t.as_str()), p.get("text").and_then(|t| t.as_str())) {
                    (Some("text"), Some(t)) | (None, Some(t)) => out.push_str(t),
                    (t, _) => return Err(format!("content part {i} of type {t:?} is not supported (text only)")),
                }
            }
            Ok(out)
        }
        Some(other) => Err(format!("content must be a string or a list of parts, got {other}")),
    }
}

/// Converts OpenAI message objects to [`Message`]s (`developer` → `system`, `function` → `tool`,
/// list content joined, tool-call arguments parsed from their JSON string).
///
/// # Errors
/// [`crate::Error::InvalidInput`] naming the message index for a missing role or unsupported content.
pub fn messages_from_openai(values: &[Value]) -> Result<Vec<Message>> {
    let mut out = Vec::with_capacity(values.len());
    for (i, v) in values.iter().enumerate() {
        let role = v.get("role").and_then(|r| r.as_str()).ok_or_else(|| crate::input_err!("message {i}: missing role"))?;
        let role = match role {
            "developer" => "system",
            "function" => "tool",
            r => r,
        };
        let content = content_text(v.get("content")).map_err(|e| crate::input_err!("message {i}: {e}"))?;
        let mut tool_calls = Vec::new();
        if let Some(calls) = v.get("tool_calls").and_then(|c| c.as_array()) {
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").unwrap_or(c);
                let name = f.get("name").and_then(|n| n.as_str()).ok_or_else(|| crate::input_err!("message {i} tool call {j}: missing function name"))?;
                let (arguments, raw) = match f.get("arguments") {
                    Some(Value::String(s)) => (serde_json::from_str(s).unwrap_or(Value::Null), Some(s.clone())),
                    Some(other) => (other.clone(), None),
                    None => (json!({}), None),
                };
                tool_calls.push(ToolCall { id: c.get("id").and_then(|x| x.as_str()).map(str::to_string), name: name.to_string(), arguments, arguments_raw: raw });
            }
        }
        out.push(Message {
            role: role.to_string(),
            content,
            reasoning: v.get("reasoning_content").or_else(|| v.get("reasoning")).and_then(|r| r.as_str()).map(str::to_string),
            tool_calls,
            tool_call_id: v.get("tool_call_id").and_then(|x| x.as_str()).map(str::to_string),
            name: v.get("name").and_then(|x| x.as_str()).map(str::to_string),
        });
    }
    Ok(out)
}

/// Splits Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
/// Qwen2.5 and many other templates ask models to write) out of generated text. Returns the visible
/// text (outside the blocks, trimmed) and the calls as OpenAI `tool_calls` objects (arguments as a
/// JSON string). A block that is not valid JSON with a `name` stays in the text.
pub fn split_tool_calls(text: &str) -> (String, Vec<Value>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut visible = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else { break };
        let body = after[..end].trim();
        let parsed: Option<Value> = serde_json::from_str(body).ok();
        match parsed.as_ref().and_then(|p| p.get("name").and_then(|n| n.as_str()).map(|n| (n, p))) {
            Some((name, p)) => {
                visible.push_str(&rest[..start]);
                let args = p.get("arguments").or_else(|| p.get("parameters")).cloned().unwrap_or(json!({}));
                let args = if let Value::String(s) = args { s } else { args.to_string() };
                calls.push(json!({"id": format!("call_{}", uuid::Uuid::new_v4().simple()), "type": "function",
                    "function": {"name": name, "arguments": args}}));
            }
            None => visible.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &after[end + CLOSE.len()..];
    }
    visible.push_str(rest);
    if calls.is_empty() {
        (text.to_string(), calls)
    } else {
        (visible.trim().to_string(), calls)
    }
}

/// An OpenAI error body: `{"error": {"message", "type", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_openai_messages() {
        let v = vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get", "arguments": "{\"x\": 1}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "42"}),
        ];
        let m = messages_from_openai(&v).unwrap();
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].content, "ab");
        assert_eq!(m[2].content, "");
        assert_eq!(m[2].tool_calls[0].arguments, json!({"x": 1}));
        assert_eq!(m[2].tool_calls[0].arguments_raw.as_deref(), Some("{\"x\": 1}"));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("c1"));
        assert!(messages_from_openai(&[json!({"content": "x"})]).is_err());
        assert!(messages_from_openai(&[json!({"role": "user", "content": [{"type": "image_url"}]})]).is_err());
    }

    #[test]
    fn splits_hermes_tool_calls() {
        let (text, calls) = split_tool_calls("Let me check.\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"path\": \"/\"}}\n</tool_call>");
        assert_eq!(text, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "ls");
        assert_eq!(calls[0]["function"]["arguments"], "{\"path\":\"/\"}");
        let (text, calls) = split_tool_calls("no <tool_call>not json</tool_call> here");
        assert_eq!((text.as_str(), calls.len()), ("no <tool_call>not json</tool_call> here", 0));
    }

    #[test]
    fn parses_completion_prompts() {
        let r: CompletionRequest = serde_json::from_value(json!({"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 4})).unwrap();
        assert_eq!((r.prompt, r.max_tokens, r.prompt_logprobs), (PromptField::Ids(vec![1, 2, 3]), Some(1), Some(4)));
        let r: CompletionRequest = serde_json::from_value(json!({"prompt": "hi"})).unwrap();
        assert_eq!(r.prompt, PromptField::Text("hi".into()));
        let r: CompletionRequest = serde_json::from_value(json!({"prompt": [[1, 2]]})).unwrap();
        assert_eq!(r.prompt, PromptField::ManyIds(vec![vec![1, 2]]));
        assert!(serde_json::from_value::<CompletionRequest>(json!({"prompt": [-1]})).is_err());
    }

    #[test]
    fn parses_request_fields() {
        let r: ChatCompletionRequest = serde_json::from_value(json!({"model": "m", "messages": [], "stop": "x",
            "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 2, "unknown_field": 1})).unwrap();
        assert_eq!(r.stop.map(StopField::into_vec), Some(vec!["x".to_string()]));
        assert_eq!((r.max_completion_tokens, r.top_logprobs), (Some(5), Some(2)));
    }
}
