//! What the upstream answered, whichever the API: a finished turn ([`Completed`]) or why there is
//! none ([`NoTurn`]), the reader of a non-streamed chat completion, and [`StreamState`], what every
//! stream accumulator ([`super::streams`]) keeps to tell the two apart. Pure code.

use serde_json::{Map, Value};

use crate::ingest::normalize::normalize_with_role;
use crate::schema::Message;

/// A finished response, from a JSON body or assembled from stream chunks (chat: choice 0 only).
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    /// The assistant message, normalised (text, reasoning, tool calls).
    pub message: Message,
    /// The response was cut: an unclosed reasoning block, or (Responses, Messages) the token limit.
    pub truncated: bool,
    /// Responses API: the response's id, what a later `previous_response_id` names (None for the
    /// other APIs, whose requests carry their whole conversation).
    pub response_id: Option<String>,
    /// Finish reason of choice 0.
    pub finish_reason: Option<String>,
    /// `choices[0].token_ids` (ours, vLLM with `return_token_ids`).
    pub token_ids: Option<Value>,
    /// `choices[0].logprobs.content` entries.
    pub logprobs: Option<Vec<Value>>,
    /// Top-level `prompt_token_ids`.
    pub prompt_token_ids: Option<Value>,
    /// Top-level `policy_version` (ours).
    pub policy_version: Option<i64>,
    /// Model name reported by the upstream.
    pub model: Option<String>,
    /// Number of choices (only choice 0 is recorded).
    pub n_choices: usize,
    /// Notes gathered while assembling.
    pub notes: Vec<String>,
}

/// Why a response yields no event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoTurn {
    /// The response has no choices or no message (reason for logs).
    BadResponse(String),
    /// The upstream reported an error inside the stream.
    StreamError(String),
    /// The stream ended before a finish reason.
    Incomplete,
    /// The response's message cannot be recorded (reason code of the normaliser, reason).
    Unusable(&'static str, String),
}

impl NoTurn {
    /// The reason, for logs and dead letters.
    pub fn reason(&self) -> String {
        match self {
            NoTurn::BadResponse(r) => format!("upstream response unusable: {r}"),
            NoTurn::StreamError(e) => format!("upstream reported an error in the stream: {e}"),
            NoTurn::Incomplete => "upstream stream ended without a finish reason".to_string(),
            NoTurn::Unusable(_, r) => format!("upstream response cannot be recorded: {r}"),
        }
    }

    /// Metric label (and dead-letter reason code).
    pub fn code(&self) -> &'static str {
        match self {
            NoTurn::BadResponse(_) => "bad_response",
            NoTurn::StreamError(_) => "upstream_error",
            NoTurn::Incomplete => "incomplete_stream",
            NoTurn::Unusable(code, _) => code,
        }
    }
}

/// A response's assistant message object (OpenAI chat shape), normalised.
///
/// # Errors
/// [`NoTurn::Unusable`] with the normaliser's code.
pub(crate) fn assistant_message(obj: &Map<String, Value>) -> std::result::Result<crate::ingest::normalize::Normalized, NoTurn> {
    normalize_with_role(obj, "assistant", None).map_err(|e| NoTurn::Unusable(e.code(), format!("response message: {e}")))
}

impl Completed {
    /// A response of the Responses or Messages API ([`super::apis`]): text only, one choice.
    pub(crate) fn of_reply(r: crate::ingest::anthropic_messages::Reply, response_id: Option<String>, policy_version: Option<i64>) -> Completed {
        Completed {
            message: r.message,
            truncated: r.truncated,
            response_id,
            finish_reason: r.finish_reason,
            token_ids: None,
            logprobs: None,
            prompt_token_ids: None,
            policy_version,
            model: r.model,
            n_choices: 1,
            notes: r.notes,
        }
    }

    /// Reads a non-streamed chat completion.
    ///
    /// # Errors
    /// [`NoTurn::BadResponse`] when `choices[0].message` is missing, [`NoTurn::Unusable`] when it does
    /// not normalise.
    pub fn from_response(v: &Value) -> std::result::Result<Completed, NoTurn> {
        let choices = v.get("choices").and_then(Value::as_array).ok_or_else(|| NoTurn::BadResponse("no choices".into()))?;
        let c0 = choices.first().ok_or_else(|| NoTurn::BadResponse("empty choices".into()))?;
        let message = c0.get("message").and_then(Value::as_object).ok_or_else(|| NoTurn::BadResponse("choice 0 has no message".into()))?;
        let n = assistant_message(message)?;
        let logprobs = c0.get("logprobs").and_then(|l| l.get("content")).and_then(Value::as_array).cloned();
        Ok(Completed {
            message: n.message,
            truncated: n.truncated,
            response_id: None,
            finish_reason: c0.get("finish_reason").and_then(Value::as_str).map(str::to_string),
            token_ids: c0.get("token_ids").filter(|t| !t.is_null()).cloned(),
            logprobs,
            prompt_token_ids: v.get("prompt_token_ids").filter(|t| !t.is_null()).cloned(),
            policy_version: v.get("policy_version").and_then(Value::as_i64),
            model: v.get("model").and_then(Value::as_str).map(str::to_string),
            n_choices: choices.len(),
            notes: n.notes,
        })
    }
}

/// What every stream accumulator keeps besides its content: the first error event, the first chunk
/// that was not JSON, and the number of chunks.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamState {
    /// The first error a chunk carried.
    pub(crate) error: Option<String>,
    /// The first chunk that was not JSON: (chunk number, parse error).
    unreadable: Option<(usize, String)>,
    /// `data:` payloads seen.
    pub(crate) chunks: usize,
}

impl StreamState {
    pub(crate) fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        self.chunks += 1;
        if self.unreadable.is_none() {
            self.unreadable = Some((self.chunks, e.to_string()));
        }
    }

    /// The error or unreadable chunk that keeps the turn from being recorded.
    pub(crate) fn failure(&self) -> Option<NoTurn> {
        if let Some(e) = &self.error {
            return Some(NoTurn::StreamError(e.clone()));
        }
        self.unreadable.as_ref().map(|(n, e)| NoTurn::BadResponse(format!("stream chunk {n} of {} is not JSON: {e}", self.chunks)))
    }
}

/// The message of an `error` event or error object (`{message}` or `{error: {message}}`).
pub(crate) fn error_text(v: &Value) -> String {
    v.get("message").or_else(|| v.get("error").and_then(|e| e.get("message"))).and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| v.to_string())
}
