//! What the capture proxy records: turn metadata from headers and body keys, the rewritten upstream
//! request, the response assembled from a JSON body or from SSE chunks, token/log-prob validation and
//! the [`Interaction`] row (METHOD.md §1). Pure code: no I/O, unit-tested below.

use axum::http::HeaderMap;
use serde_json::{json, Map, Value};

use super::apis::Api;
pub use super::sessions::{Chain, Sessions};
use crate::ingest::normalize::{normalize_request, normalize_with_role};
use crate::schema::{now_ms, DeadLetter, Interaction, Lineage, Message, Table, TurnType};
use crate::serve::openai::split_tool_calls;
use crate::Result;

/// Header naming the session of a request.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header with the turn type (`main` | `side`).
pub const TURN_TYPE_HEADER: &str = "x-turn-type";
/// Header marking the last turn of a session (truthy: `1`, `true`, `yes`, `on`).
pub const SESSION_DONE_HEADER: &str = "x-session-done";
/// Header with an explicit 0-based turn index (survives proxy restarts, unlike the proxy's counter).
pub const TURN_INDEX_HEADER: &str = "x-turn-index";
/// Body keys the proxy reads and removes before forwarding (same meaning as the headers).
pub const BODY_KEYS: [&str; 4] = ["session_id", "turn_type", "session_done", "turn_index"];

/// The turn metadata a client sent (headers win over body keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnMeta {
    /// Explicit session id, if any (else the proxy infers one).
    pub session_id: Option<String>,
    /// Turn type (the proxy's default when the client gave none).
    pub turn_type: TurnType,
    /// The client marked the session done with this turn.
    pub session_done: bool,
    /// Explicit turn index, if any.
    pub turn_index: Option<i32>,
}

/// `1`, `true`, `yes`, `on` (case-insensitive, trimmed).
pub fn truthy(s: &str) -> bool {
    matches!(s.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| crate::input_err!("header {name} is not visible ASCII")),
    }
}

fn body_string(v: &Value, key: &str) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.trim().to_string())),
        Value::Number(n) => Ok(Some(n.to_string())),
        Value::Bool(b) => Ok(Some(b.to_string())),
        other => Err(crate::input_err!("body key {key} must be a string, got {other}")),
    }
}

fn parse_turn_type(s: &str, from: &str) -> Result<TurnType> {
    TurnType::parse(s).ok_or_else(|| crate::input_err!("{from} must be main or side, got {s:?}"))
}

fn parse_turn_index(s: &str, from: &str) -> Result<i32> {
    s.parse::<i32>().ok().filter(|i| *i >= 0).ok_or_else(|| crate::input_err!("{from} must be a non-negative integer, got {s:?}"))
}

/// Reads the turn metadata from `headers` and `body`, removing [`BODY_KEYS`] from `body` (they must
/// never reach the upstream). Headers win over body keys; an empty session id counts as none.
///
/// # Errors
/// [`crate::Error::InvalidInput`] for a turn type other than `main`/`side`, a negative or non-integer
/// turn index, a non-ASCII header, or a body key holding an array or object.
pub fn take_turn_meta(headers: &HeaderMap, body: &mut Map<String, Value>, default_turn_type: TurnType) -> Result<TurnMeta> {
    let mut from_body: [Option<String>; 4] = Default::default();
    for (i, k) in BODY_KEYS.iter().enumerate() {
        if let Some(v) = body.remove(*k) {
            from_body[i] = body_string(&v, k)?;
        }
    }
    let [b_session, b_type, b_done, b_index] = from_body;
    let session_id = match header_str(headers, SESSION_HEADER)? {
        Some(s) => Some(s.to_string()),
        None => b_session,
    }
    .filter(|s| !s.is_empty());
    let turn_type = match (header_str(headers, TURN_TYPE_HEADER)?, b_type) {
        (Some(h), _) => parse_turn_type(h, "header X-Turn-Type")?,
        (None, Some(b)) => parse_turn_type(&b, "body key turn_type")?,
        (None, None) => default_turn_type,
    };
    let session_done = match (header_str(headers, SESSION_DONE_HEADER)?, b_done) {
        (Some(h), _) => truthy(h),
        (None, Some(b)) => truthy(&b),
        (None, None) => false,
    };
    let turn_index = match (header_str(headers, TURN_INDEX_HEADER)?, b_index) {
        (Some(h), _) => Some(parse_turn_index(h, "header X-Turn-Index")?),
        (None, Some(b)) => Some(parse_turn_index(&b, "body key turn_index")?),
        (None, None) => None,
    };
    Ok(TurnMeta { session_id, turn_type, session_done, turn_index })
}

/// How the proxy rewrites requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewriteOptions {
    /// Turn type of requests that do not say.
    pub default_turn_type: TurnType,
    /// Add `"return_token_ids": true` (vLLM's switch for `prompt_token_ids`/`token_ids`) when the
    /// client did not set it. Our server returns ids without it and ignores it.
    pub request_token_ids: bool,
    /// `logprobs_mode` to send when the client sent none (`None`: leave the upstream's default).
    pub logprobs_mode: Option<String>,
}

/// A client request after [`prepare_request`].
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The JSON body to send upstream (turn keys removed; chat completions: `logprobs: true` added).
    pub upstream_body: Vec<u8>,
    /// The client asked for log-probs itself (if not, they are removed from its response). Always
    /// true for the APIs whose requests the proxy does not rewrite (Responses, Messages).
    pub client_wants_logprobs: bool,
    /// The client asked for a stream.
    pub stream: bool,
    /// Turn metadata.
    pub meta: TurnMeta,
    /// The request's conversation, normalised ([`crate::ingest::normalize`]): chat `messages`;
    /// Responses `instructions` then `input` items; Messages `system` then `messages`.
    pub messages: Vec<Message>,
    /// What normalisation noticed (notes of the row).
    pub notes: Vec<String>,
    /// The request's conversation as sent (`messages`, or `input`), for dead letters.
    pub raw_messages: Value,
    /// The request's `tools`, when present and not null.
    pub tools: Option<Value>,
    /// The request's `model`.
    pub model: Option<String>,
    /// Responses API: the `previous_response_id` this request continues.
    pub previous_response_id: Option<String>,
    /// How many leading [`Prepared::messages`] are instructions (Responses: 1 with `instructions`,
    /// else 0), which a chain does not carry over.
    pub instructions: usize,
    /// The request did not say `store: false` (Responses: a response not stored upstream cannot be
    /// chained on, so the proxy does not remember it).
    pub store: bool,
}

/// Why a client's request is refused before it reaches the upstream (the proxy answers 4xx with
/// `error.code` = [`Rejected::code`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// HTTP status (400, or 409 for a duplicate turn).
    pub status: u16,
    /// Reason code, as in dead letters: `malformed_json` (not JSON, invalid UTF-8, nested deeper than
    /// 128), `wrong_type` (body or a message field of the wrong JSON type), `invalid_turn_metadata`,
    /// `missing_messages`, `missing_role`, `unknown_role`, `tool_call_without_name`, `duplicate_turn`.
    pub code: &'static str,
    /// What is wrong, with positions.
    pub message: String,
}

impl Rejected {
    fn bad(code: &'static str, message: String) -> Rejected {
        Rejected { status: 400, code, message }
    }
}

/// A chat request's `messages` the way the proxy records them: a JSON array of messages that
/// normalise ([`normalize_request`]: a known role, content a string, a list of parts or null, ...;
/// notes appended to `notes`). A request that could not become an `interactions` row is refused
/// before the upstream runs.
///
/// # Errors
/// [`Rejected`] (400) with code `missing_messages` or the normalisation error's code.
pub fn chat_conversation(messages: Option<&Value>, notes: &mut Vec<String>) -> std::result::Result<Vec<Message>, Rejected> {
    let list = match messages {
        Some(Value::Array(l)) => l,
        None => return Err(Rejected::bad("missing_messages", "request has no `messages`".into())),
        Some(other) => return Err(Rejected::bad("missing_messages", format!("request `messages` is a JSON {}, expected an array", crate::ingest::normalize::json_type(other)))),
    };
    normalize_request(list, notes).map_err(|(i, e)| Rejected::bad(e.code(), format!("messages[{i}] of {}: {e}", list.len())))
}

/// Parses a client's request body for `api`, reads its conversation (chat: [`chat_conversation`];
/// Responses and Messages: [`super::apis::conversation`]), takes its turn metadata and builds the
/// upstream body. Only chat requests are rewritten beyond the removal of [`BODY_KEYS`]: `logprobs:
/// true`, `return_token_ids`, `logprobs_mode` (see [`RewriteOptions`]).
///
/// # Errors
/// [`Rejected`] (400): `malformed_json` when the body is not JSON (bad syntax, invalid UTF-8, nesting
/// over serde_json's limit of 128), `wrong_type` when it is not an object, `invalid_turn_metadata`
/// (see [`take_turn_meta`]), `missing_messages` (no `messages` / `input`), or the normaliser's code
/// for a message that does not normalise.
pub fn prepare_request(api: Api, headers: &HeaderMap, raw: &[u8], opts: &RewriteOptions) -> std::result::Result<Prepared, Rejected> {
    let v: Value = serde_json::from_slice(raw).map_err(|e| Rejected::bad("malformed_json", format!("request body of {} bytes is not JSON: {e}", raw.len())))?;
    let Value::Object(mut body) = v else {
        return Err(Rejected::bad("wrong_type", format!("request body is a JSON {}, expected an object", crate::ingest::normalize::json_type(&v))));
    };
    let meta = take_turn_meta(headers, &mut body, opts.default_turn_type).map_err(|e| Rejected::bad("invalid_turn_metadata", e.to_string()))?;
    let mut notes = vec![];
    let instructions = usize::from(api == Api::Responses && crate::ingest::openai_responses::instructions(&body).is_some());
    let messages = super::apis::conversation(api, &body, &mut notes).map_err(|(code, reason)| Rejected::bad(code, reason))?;
    // Dead letters of the Responses and Messages APIs keep the whole body (instructions, system,
    // previous_response_id): their conversation is more than one field.
    let raw_messages = match api {
        Api::ChatCompletions => body.get("messages").cloned().unwrap_or(Value::Null),
        _ => Value::Object(body.clone()),
    };
    let store = !matches!(body.get("store"), Some(Value::Bool(false)));
    let mut client_wants_logprobs = true;
    if api == Api::ChatCompletions {
        client_wants_logprobs = matches!(body.get("logprobs"), Some(Value::Bool(true)));
        if !client_wants_logprobs {
            body.insert("logprobs".into(), Value::Bool(true));
        }
        if opts.request_token_ids && !body.contains_key("return_token_ids") {
            body.insert("return_token_ids".into(), Value::Bool(true));
        }
        if let Some(mode) = &opts.logprobs_mode {
            if !body.contains_key("logprobs_mode") {
                body.insert("logprobs_mode".into(), Value::String(mode.clone()));
            }
        }
    }
    let stream = matches!(body.get("stream"), Some(Value::Bool(true)));
    let tools = body.get("tools").filter(|t| !t.is_null()).cloned();
    let model = body.get("model").and_then(Value::as_str).map(str::to_string);
    let previous_response_id = match api {
        Api::Responses => body.get("previous_response_id").and_then(Value::as_str).filter(|p| !p.is_empty()).map(str::to_string),
        _ => None,
    };
    let upstream_body = serde_json::to_vec(&body).map_err(|e| Rejected::bad("wrong_type", format!("request body cannot be re-serialised: {e}")))?;
    Ok(Prepared { upstream_body, client_wants_logprobs, stream, meta, messages, notes, raw_messages, tools, model, previous_response_id, instructions, store })
}

/// Sets `logprobs` of every choice to null (for a client that did not ask for them). Works on a full
/// response and on a stream chunk. Returns true when something changed.
pub fn strip_logprobs(v: &mut Value) -> bool {
    let mut changed = false;
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            if let Some(lp) = c.get_mut("logprobs") {
                if !lp.is_null() {
                    *lp = Value::Null;
                    changed = true;
                }
            }
        }
    }
    changed
}

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
fn assistant_message(obj: &Map<String, Value>) -> std::result::Result<crate::ingest::normalize::Normalized, NoTurn> {
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

/// Splits server-sent events out of a byte stream: each event ends with a blank line (`\n\n`,
/// `\r\n\r\n` or `\r\r`). Keeps the raw bytes of each event so it can be forwarded unchanged.
#[derive(Debug, Default)]
pub struct SseFramer {
    buf: Vec<u8>,
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event's bytes as received, terminator included.
    pub raw: Vec<u8>,
    /// Its `data:` lines joined with `\n` (None for events without data: comments, keep-alives).
    pub data: Option<String>,
}

impl SseEvent {
    fn parse(raw: Vec<u8>) -> SseEvent {
        let text = String::from_utf8_lossy(&raw);
        let mut data: Option<String> = None;
        for line in text.split(['\n', '\r']) {
            if let Some(rest) = line.strip_prefix("data:") {
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => data = Some(rest.to_string()),
                }
            }
        }
        SseEvent { raw, data }
    }

    /// The event with its data replaced by `data` (other lines dropped), as SSE bytes.
    pub fn with_data(data: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 8);
        for line in data.split('\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
        out
    }
}

fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        match (buf[i], buf[i + 1]) {
            (b'\n', b'\n') | (b'\r', b'\r') => return Some(i + 2),
            (b'\r', b'\n') if buf.get(i + 2..i + 4) == Some(b"\r\n") => return Some(i + 4),
            _ => i += 1,
        }
    }
    None
}

impl SseFramer {
    /// Adds bytes; returns the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = vec![];
        while let Some(end) = event_end(&self.buf) {
            let rest = self.buf.split_off(end);
            let raw = std::mem::replace(&mut self.buf, rest);
            out.push(SseEvent::parse(raw));
        }
        out
    }

    /// True when bytes of an unfinished event are held (the stream stopped inside an event).
    pub fn has_partial(&self) -> bool {
        !self.buf.iter().all(|b| b.is_ascii_whitespace())
    }

    /// The unterminated last event, if the stream ended without a blank line.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
            return None;
        }
        Some(SseEvent::parse(std::mem::take(&mut self.buf)))
    }
}

/// Token ids and log-probs after validation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenCapture {
    /// Prompt token ids.
    pub prompt_ids: Option<Vec<i32>>,
    /// Response token ids.
    pub response_ids: Option<Vec<i32>>,
    /// One log-prob (nats) per response token; only kept together with `response_ids`.
    pub logprobs: Option<Vec<f32>>,
    /// What was dropped and why.
    pub notes: Vec<String>,
    /// Something the upstream returned was invalid and dropped (counted as a mismatch).
    pub rejected: bool,
}

impl TokenCapture {
    /// Metric label: `ids_and_logprobs`, `ids_only`, `text_only` or `rejected`.
    pub fn kind(&self) -> &'static str {
        match (self.rejected, &self.response_ids, &self.logprobs) {
            (true, _, _) => "rejected",
            (false, Some(_), Some(_)) => "ids_and_logprobs",
            (false, Some(_), None) => "ids_only",
            _ => "text_only",
        }
    }
}

fn token_ids(v: &Value) -> std::result::Result<Vec<i32>, String> {
    let arr = v.as_array().ok_or_else(|| format!("not a list: {}", crate::ingest::normalize::json_type(v)))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| x.as_u64().and_then(|u| i32::try_from(u).ok()).ok_or_else(|| format!("entry {i} ({x}) is not a token id")))
        .collect()
}

/// Validates what the upstream returned: ids are non-negative `i32`s, log-probs finite numbers, one
/// per response token. Invalid parts are dropped with a note and `rejected` set; log-probs without
/// response ids are dropped with a note (they cannot be aligned without re-tokenising).
pub fn validate_tokens(prompt: Option<&Value>, ids: Option<&Value>, logprobs: Option<&[Value]>) -> TokenCapture {
    let mut t = TokenCapture::default();
    if let Some(p) = prompt {
        match token_ids(p) {
            Ok(v) => t.prompt_ids = Some(v),
            Err(e) => {
                t.notes.push(format!("prompt_token_ids dropped: {e}"));
                t.rejected = true;
            }
        }
    }
    if let Some(r) = ids {
        match token_ids(r) {
            Ok(v) => t.response_ids = Some(v),
            Err(e) => {
                t.notes.push(format!("response token_ids dropped: {e}"));
                t.rejected = true;
            }
        }
    }
    if let Some(entries) = logprobs {
        let mut lps = Vec::with_capacity(entries.len());
        let mut bad = None;
        for (i, e) in entries.iter().enumerate() {
            match e.get("logprob").and_then(Value::as_f64) {
                Some(x) if x.is_finite() && (x as f32).is_finite() => lps.push(x as f32),
                _ => {
                    bad = Some(format!("log-prob {i} is missing or not finite ({})", e.get("logprob").unwrap_or(&Value::Null)));
                    break;
                }
            }
        }
        match (bad, &t.response_ids) {
            (Some(why), _) => {
                t.notes.push(format!("rollout log-probs dropped: {why}; token ids dropped too"));
                t.response_ids = None;
                t.rejected = true;
            }
            (None, None) if !t.rejected => {
                t.notes.push(format!("{} rollout log-probs dropped: the upstream returned no response token ids", lps.len()));
            }
            (None, None) => {}
            (None, Some(ids)) if ids.len() != lps.len() => {
                t.notes.push(format!("response token ids ({}) and log-probs ({}) differ in length; dropped both", ids.len(), lps.len()));
                t.response_ids = None;
                t.rejected = true;
            }
            (None, Some(_)) => t.logprobs = Some(lps),
        }
    }
    t
}

/// The request side of a turn, kept until its response is known.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    /// Turn metadata.
    pub meta: TurnMeta,
    /// The conversation, normalised (for a chained Responses request: the chain's history, then
    /// this request's instructions and input).
    pub messages: Vec<Message>,
    /// What normalisation noticed.
    pub notes: Vec<String>,
    /// The conversation as the client sent it (chat: `messages`; the other APIs: the whole body), for
    /// dead letters.
    pub raw_messages: Value,
    /// Remember the response for `previous_response_id` chains (Responses requests without `store:
    /// false`).
    pub remember: bool,
    /// Responses API: the response this request continues, and the chain rebuilt from it (None when
    /// this process did not capture it).
    pub previous: Option<(String, Option<Chain>)>,
    /// Index in [`TurnRequest::messages`] where this request's own input starts (after the chained
    /// history and the instructions).
    pub input_start: usize,
    /// Tool definitions.
    pub tools: Option<Value>,
    /// Requested model.
    pub model: Option<String>,
    /// When the request arrived (ms since epoch): the row's `event_time`.
    pub received_ms: i64,
}

/// What a finished turn becomes.
#[derive(Debug, Clone)]
pub enum Captured {
    /// The turn's row, and what its tokens looked like.
    Turn(Box<Interaction>, TokenCapture),
    /// The turn could not be recorded as an interaction (e.g. an unknown message role): its dead letter.
    Dead(Box<DeadLetter>),
}

fn dead(reason_code: &str, reason: String, req: &TurnRequest, resp: &Completed) -> Captured {
    let payload = json!({"messages": req.raw_messages, "response": resp.message, "session_id": req.meta.session_id}).to_string();
    let d = DeadLetter::new("proxy", reason_code, reason, payload.as_bytes(), Lineage::default())
        .with_keys(req.meta.session_id.as_deref().unwrap_or(""), None);
    Captured::Dead(Box::new(d))
}

/// The dead letter of a turn whose upstream response could not be recorded (stage `proxy`): the
/// request's messages and the first 64 KiB of the response (lossy UTF-8) as its payload.
pub fn dead_response(reason_code: &str, reason: String, req: &TurnRequest, response: &[u8]) -> DeadLetter {
    let head = String::from_utf8_lossy(&response[..response.len().min(64 << 10)]);
    let payload = json!({"messages": req.raw_messages, "response_head": head, "response_bytes": response.len(), "session_id": req.meta.session_id}).to_string();
    DeadLetter::new("proxy", reason_code, reason, payload.as_bytes(), Lineage::default()).with_keys(req.meta.session_id.as_deref().unwrap_or(""), None)
}

/// Builds the `interactions` row of a finished turn (METHOD.md §1): normalised request messages, the
/// response's text, reasoning and tool calls, validated token ids and log-probs, session and turn
/// index from `sessions`, `source_format = "proxy"`. `header_version` is the upstream's
/// `X-Policy-Version` header (used when the body has no `policy_version`).
pub fn build_interaction(req: &TurnRequest, resp: &Completed, header_version: Option<i64>, sessions: &std::sync::Mutex<Sessions>) -> Captured {
    let messages = &req.messages;
    let mut notes: Vec<String> = req.notes.clone();
    if let Some((p, chain)) = &req.previous {
        match chain {
            None => notes.push(format!("previous response {p:?} was not captured by this proxy process: the conversation starts at this request's input")),
            Some(Chain { missing: Some(m), .. }) => notes.push(format!("the chain of previous responses is known back to {m:?} only: the conversation starts there")),
            Some(Chain { cycle: Some(m), .. }) => notes.push(format!("the chain of previous responses loops at {m:?} (a reused response id): the conversation starts there")),
            Some(_) => {}
        }
    }
    notes.extend(resp.notes.iter().cloned());
    if resp.n_choices > 1 {
        notes.push(format!("{} choices returned; recorded choice 0", resp.n_choices));
    }
    let tokens = validate_tokens(resp.prompt_token_ids.as_ref(), resp.token_ids.as_ref(), resp.logprobs.as_deref());
    notes.extend(tokens.notes.iter().cloned());
    let msg = &resp.message;
    let (session_id, session_inferred, turn_index, fresh) = {
        let mut s = sessions.lock().unwrap_or_else(|p| p.into_inner());
        let chain = req.previous.as_ref().and_then(|(_, c)| c.as_ref());
        let (id, inferred, turn) = s.assign_chained(&req.meta, chain, messages, msg);
        let fresh = s.record(&id, turn);
        if let (true, true, Some(rid)) = (fresh, req.remember, &resp.response_id) {
            let mut added: Vec<Message> = messages[req.input_start.min(messages.len())..].to_vec();
            added.push(msg.clone());
            s.remember_response(rid, req.previous.as_ref().map(|(p, _)| p.clone()), added, &id, inferred, turn);
        }
        (id, inferred, turn, fresh)
    };
    if !fresh {
        let reason = format!("turn {turn_index} of session {session_id:?} was already captured by this proxy; the client got its answer, this copy is not recorded");
        return dead("duplicate_turn", reason, req, resp);
    }
    let request_messages = serde_json::to_string(messages).unwrap_or_else(|_| "[]".into());
    let tool_calls = if msg.tool_calls.is_empty() { None } else { serde_json::to_string(&msg.tool_calls).ok() };
    let interaction_id = Interaction::compute_id(&session_id, turn_index, &request_messages, &msg.content, tool_calls.as_deref());
    let now = now_ms();
    let row = Interaction {
        schema_version: Interaction::SCHEMA_VERSION,
        interaction_id,
        session_id,
        session_inferred,
        turn_index,
        turn_type: req.meta.turn_type,
        session_done: req.meta.session_done,
        policy_version: resp.policy_version.or(header_version),
        model: resp.model.clone().or_else(|| req.model.clone()),
        request_messages,
        tools: req.tools.as_ref().map(Value::to_string),
        response_text: msg.content.clone(),
        reasoning_text: msg.reasoning.clone(),
        tool_calls,
        truncated: resp.truncated || resp.finish_reason.as_deref() == Some("length"),
        finish_reason: resp.finish_reason.clone(),
        prompt_text: None,
        prompt_token_ids: tokens.prompt_ids.clone(),
        response_token_ids: tokens.response_ids.clone(),
        rollout_logprobs: tokens.logprobs.clone(),
        next_state: None,
        outcome_reward: None,
        notes,
        source_format: "proxy".into(),
        source_topic: None,
        source_partition: None,
        source_offset: None,
        source_file: None,
        source_line: None,
        event_time: req.received_ms,
        ingest_time: now,
    };
    Captured::Turn(Box::new(row), tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn opts() -> RewriteOptions {
        RewriteOptions { default_turn_type: TurnType::Main, request_token_ids: false, logprobs_mode: None }
    }

    #[test]
    fn headers_win_and_body_keys_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_static("s-head"));
        h.insert("x-turn-type", HeaderValue::from_static("SIDE"));
        let raw = br#"{"messages":[{"role":"user","content":"hi"}],"session_id":"s-body","turn_type":"main","session_done":"yes","turn_index":3}"#;
        let p = prepare_request(Api::ChatCompletions, &h, raw, &opts()).unwrap();
        assert_eq!(p.meta, TurnMeta { session_id: Some("s-head".into()), turn_type: TurnType::Side, session_done: true, turn_index: Some(3) });
        let up: Value = serde_json::from_slice(&p.upstream_body).unwrap();
        for k in BODY_KEYS {
            assert!(up.get(k).is_none(), "{k} forwarded");
        }
        assert_eq!(up["logprobs"], json!(true));
        assert!(!p.client_wants_logprobs);
        assert!(up.get("return_token_ids").is_none());
    }

    #[test]
    fn defaults_and_errors() {
        let h = HeaderMap::new();
        let p = prepare_request(Api::ChatCompletions, &h, br#"{"messages":[],"logprobs":true,"stream":true}"#, &RewriteOptions { request_token_ids: true, ..opts() }).unwrap();
        assert_eq!(p.meta, TurnMeta { session_id: None, turn_type: TurnType::Main, session_done: false, turn_index: None });
        assert!(p.client_wants_logprobs && p.stream);
        let up: Value = serde_json::from_slice(&p.upstream_body).unwrap();
        assert_eq!(up["return_token_ids"], json!(true));
        assert!(prepare_request(Api::ChatCompletions, &h, b"{not json", &opts()).is_err());
        assert!(prepare_request(Api::ChatCompletions, &h, b"[1]", &opts()).is_err());
        assert!(prepare_request(Api::ChatCompletions, &h, br#"{"turn_type":"bogus"}"#, &opts()).is_err());
        assert!(prepare_request(Api::ChatCompletions, &h, br#"{"turn_index":-1}"#, &opts()).is_err());
        let mut h2 = HeaderMap::new();
        h2.insert("x-session-done", HeaderValue::from_static("off"));
        h2.insert("x-session-id", HeaderValue::from_static(""));
        let p = prepare_request(Api::ChatCompletions, &h2, br#"{"session_done":true,"messages":[]}"#, &opts()).unwrap();
        assert!(!p.meta.session_done, "header wins");
        assert_eq!(p.meta.session_id, None, "empty id = none");
        for (s, want) in [("1", true), ("TRUE", true), (" yes ", true), ("on", true), ("0", false), ("no", false), ("", false)] {
            assert_eq!(truthy(s), want, "{s:?}");
        }
    }

    #[test]
    fn strip_logprobs_nulls_every_choice() {
        let mut v = json!({"choices": [{"index": 0, "logprobs": {"content": []}}, {"index": 1, "logprobs": null}]});
        assert!(strip_logprobs(&mut v));
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert!(!strip_logprobs(&mut v));
    }

    #[test]
    fn sse_framer_splits_across_chunks_and_line_endings() {
        let mut f = SseFramer::default();
        assert!(f.push(b"data: {\"a\"").is_empty());
        let ev = f.push(b":1}\n\ndata: x\r\n\r\n: keep-alive\n\ndata: a\ndata: b\n\n");
        assert_eq!(ev.len(), 4);
        assert_eq!(ev[0].data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(ev[0].raw, b"data: {\"a\":1}\n\n");
        assert_eq!(ev[1].data.as_deref(), Some("x"));
        assert_eq!(ev[2].data, None);
        assert_eq!(ev[3].data.as_deref(), Some("a\nb"));
        assert_eq!(SseEvent::with_data("a\nb"), b"data: a\ndata: b\n\n");
        assert!(f.finish().is_none());
        f.push(b"data: [DONE]");
        assert_eq!(f.finish().and_then(|e| e.data).as_deref(), Some("[DONE]"));
    }

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

    fn lp(x: f64) -> Value {
        json!({"token": "t", "logprob": x})
    }

    #[test]
    fn token_validation() {
        let ok = validate_tokens(Some(&json!([1, 2])), Some(&json!([5, 6])), Some(&[lp(-0.5), lp(-1.5)]));
        assert_eq!(ok.prompt_ids, Some(vec![1, 2]));
        assert_eq!(ok.response_ids, Some(vec![5, 6]));
        assert_eq!(ok.logprobs, Some(vec![-0.5, -1.5]));
        assert_eq!(ok.kind(), "ids_and_logprobs");
        assert!(ok.notes.is_empty());

        let short = validate_tokens(None, Some(&json!([5, 6])), Some(&[lp(-0.5)]));
        assert_eq!((short.response_ids.clone(), short.logprobs.clone(), short.kind()), (None, None, "rejected"));
        assert_eq!(short.notes, vec!["response token ids (2) and log-probs (1) differ in length; dropped both".to_string()]);

        let nan = validate_tokens(None, Some(&json!([5])), Some(&[json!({"logprob": null})]));
        assert_eq!((nan.response_ids.clone(), nan.logprobs.clone(), nan.kind()), (None, None, "rejected"));
        let huge = validate_tokens(None, Some(&json!([5])), Some(&[lp(-1e300)]));
        assert_eq!(huge.kind(), "rejected", "-1e300 is not a finite f32");

        let neg = validate_tokens(Some(&json!([-1])), Some(&json!([3])), None);
        assert_eq!((neg.prompt_ids.clone(), neg.response_ids.clone(), neg.kind()), (None, Some(vec![3]), "rejected"));

        let text = validate_tokens(None, None, Some(&[lp(-0.1)]));
        assert_eq!((text.logprobs.clone(), text.kind()), (None, "text_only"));
        assert_eq!(text.notes.len(), 1);
        assert_eq!(validate_tokens(None, Some(&json!([1])), None).kind(), "ids_only");
    }

    #[test]
    fn requests_that_cannot_be_recorded_are_refused_with_a_code() {
        let h = HeaderMap::new();
        let code = |raw: &[u8]| prepare_request(Api::ChatCompletions, &h, raw, &opts()).map(|_| ()).map_err(|r| (r.status, r.code));
        assert_eq!(code(b"{\"messages\": ["), Err((400, "malformed_json")));
        assert_eq!(code(b"\"hi\""), Err((400, "wrong_type")));
        assert_eq!(code(br#"{"model": "m"}"#), Err((400, "missing_messages")));
        assert_eq!(code(br#"{"messages": {"role": "user"}}"#), Err((400, "missing_messages")));
        assert_eq!(code(br#"{"messages": [{"role": "user", "content": 5}]}"#), Err((400, "wrong_type")));
        assert_eq!(code(br#"{"messages": [{"role": "user", "content": "a"}, {"role": "elf", "content": "b"}]}"#), Err((400, "unknown_role")));
        assert_eq!(code(br#"{"messages": [], "turn_index": "x"}"#), Err((400, "invalid_turn_metadata")));
        assert_eq!(code(br#"{"messages": [{"role": "developer", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}]}"#), Ok(()));
        let r = prepare_request(Api::ChatCompletions, &h, br#"{"messages": [{"role": "user", "content": "a"}, {"role": "elf", "content": "b"}]}"#, &opts()).unwrap_err();
        assert_eq!(r.message, "messages[1] of 2: unknown message role \"elf\"");
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

    #[test]
    fn builds_an_interaction_from_a_response() {
        let sessions = std::sync::Mutex::new(Sessions::new(100));
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_static("sess"));
        h.insert("x-turn-type", HeaderValue::from_static("side"));
        h.insert("x-session-done", HeaderValue::from_static("1"));
        let body = json!({"model": "req-model", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]});
        let p = prepare_request(Api::ChatCompletions, &h, body.to_string().as_bytes(), &opts()).unwrap();
        let req = TurnRequest {
            meta: p.meta,
            messages: p.messages,
            notes: p.notes,
            raw_messages: p.raw_messages,
            remember: false,
            previous: None,
            input_start: 0,
            tools: p.tools,
            model: p.model,
            received_ms: 0,
        };
        let resp = Completed::from_response(&json!({
            "model": "m", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "<think>r</think>hello"},
                "finish_reason": "length", "token_ids": [9, 8], "logprobs": {"content": [lp(-0.5), lp(-0.25)]}}]
        }))
        .unwrap();
        let Captured::Turn(row, tokens) = build_interaction(&req, &resp, Some(4), &sessions) else { panic!("dead letter") };
        assert_eq!(tokens.kind(), "ids_and_logprobs");
        assert_eq!((row.session_id.as_str(), row.session_inferred, row.turn_index), ("sess", false, 0));
        assert_eq!((row.turn_type, row.session_done, row.policy_version), (TurnType::Side, true, Some(4)));
        assert_eq!(row.model.as_deref(), Some("m"));
        assert_eq!(row.response_text, "hello");
        assert_eq!(row.reasoning_text.as_deref(), Some("r"));
        assert!(row.truncated);
        assert_eq!(row.prompt_token_ids, Some(vec![1, 2]));
        assert_eq!(row.response_token_ids, Some(vec![9, 8]));
        assert_eq!(row.rollout_logprobs, Some(vec![-0.5, -0.25]));
        assert_eq!(row.notes, vec!["developer role mapped to system".to_string()]);
        assert_eq!(row.source_format, "proxy");
        assert_eq!(serde_json::from_str::<Value>(row.tools.as_deref().unwrap()).unwrap(), json!([{"type": "function", "function": {"name": "f"}}]));
        let msgs = row.messages().unwrap();
        assert_eq!((msgs[0].role.as_str(), msgs[1].content.as_str()), ("system", "hi"));
        assert_eq!(row.interaction_id, Interaction::compute_id("sess", 0, &row.request_messages, "hello", None));

        // The same turn again (an explicit session and index already captured): a duplicate.
        let again = TurnRequest { meta: TurnMeta { turn_index: Some(0), ..req.meta.clone() }, ..req };
        let Captured::Dead(d) = build_interaction(&again, &resp, None, &sessions) else { panic!("expected a dead letter") };
        assert_eq!((d.stage.as_str(), d.reason_code.as_str(), d.session_id.as_str()), ("proxy", "duplicate_turn", "sess"));
    }
}
