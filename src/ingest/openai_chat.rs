//! OpenAI chat-completions logs: JSONL of `{request, response}` (optionally `headers`, `timestamp`).
//!
//! - request: `messages` (normalised), `tools` (or legacy `functions`), `model`;
//! - response: `choices[0].message` (content, `reasoning_content`/`reasoning`, `tool_calls` or
//!   `function_call`), `choices[0].finish_reason` (`length` → truncated), `model`, `created`;
//! - log-probs: `choices[0].logprobs.content[]` with `token` and `logprob`; token ids from
//!   `choices[0].token_ids` (our server, vLLM with `return_token_ids`), each entry's `token_id`, or
//!   tokens written as `token_id:N` (vLLM `return_tokens_as_token_ids`); prompt ids from
//!   `prompt_token_ids` on the response or its first choice. When ids and log-probs disagree in
//!   length the log-probs are dropped with a note; `usage.completion_tokens` is checked against the
//!   ids (a mismatch is noted);
//! - session, turn type, done: headers `X-Session-Id`, `X-Turn-Type`, `X-Session-Done` (any case),
//!   else the same keys without `X-`/with `_` in the request body or at the top level of the line.
//!   A missing session id is inferred ([`super::sessions`]; `session_inferred = true`); a missing turn
//!   type is [`super::IngestOptions::default_turn_type`];
//! - turn index: the inferrer's (assistant messages in the request) for inferred sessions, else
//!   counted per session in file order (memory: one counter and one 32-byte content hash per turn of
//!   each explicit session); a line repeating the request and response of an earlier turn of its
//!   session is a `duplicate_turn` dead letter, as is any second row of one session and turn index;
//! - event time: top-level `timestamp`/`time`, else `response.created`, else the ingest time.
//!
//! An error response (`{"error": ...}` without `choices`) is dead-lettered as `api_error`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{json_type, normalize_request, normalize_with_role};
use super::sessions::SessionInferrer;
use super::sink::{Sink, Turn};
use super::timestamp::parse_timestamp;
use crate::schema::TurnType;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut sessions = Sessions::new(sink);
    super::sink::read_lines(path, sink, progress, &mut |sink, n, text| record(sink, n, text, &mut sessions))
}

/// Looks a marker up in headers (`X-Session-Id`, any case) then in the request body and the line.
fn marker<'v>(line: &'v Map<String, Value>, request: &'v Map<String, Value>, header: &str, key: &str) -> Option<&'v Value> {
    if let Some(Value::Object(h)) = line.get("headers") {
        if let Some((_, v)) = h.iter().find(|(k, _)| k.eq_ignore_ascii_case(header)) {
            return Some(v);
        }
    }
    request.get(key).or_else(|| line.get(key))
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => matches!(s.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"),
        Some(Value::Number(x)) => x.as_i64() == Some(1),
        _ => false,
    }
}

/// Turns seen so far of one explicit session.
#[derive(Default)]
struct SessionTurns {
    /// The next turn index.
    next: i32,
    /// Content key ([`content_key`]) → turn index.
    content: HashMap<[u8; 32], i32>,
}

/// SHA-256 of a turn's request and response messages (their JSON).
fn content_key(request: &[crate::schema::Message], response: &crate::schema::Message) -> Result<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(request)?);
    h.update([0u8]);
    h.update(serde_json::to_vec(response)?);
    Ok(h.finalize().into())
}

fn int_list(v: Option<&Value>) -> Option<Vec<i32>> {
    v?.as_array()?.iter().map(|x| x.as_i64().and_then(|i| i32::try_from(i).ok())).collect()
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], sessions: &mut Sessions) -> Result<()> {
    let v: Value = match serde_json::from_slice(text) {
        Ok(v) => v,
        Err(e) => return sink.dead(Some(n), "malformed_json", format!("line {n}: {e}"), text),
    };
    let Some(line) = v.as_object() else {
        return sink.dead(Some(n), "wrong_type", format!("line {n} is a JSON {}, expected an object", json_type(&v)), text);
    };
    let (Some(Value::Object(req)), Some(resp_v)) = (line.get("request"), line.get("response")) else {
        return sink.dead(Some(n), "missing_request_or_response", format!("line {n}: needs a `request` object and a `response`"), text);
    };
    let Some(resp) = resp_v.as_object() else {
        return sink.dead(Some(n), "wrong_type", format!("line {n}: `response` is a JSON {}", json_type(resp_v)), text);
    };
    let Some(Value::Array(raw_messages)) = req.get("messages") else {
        return sink.dead(Some(n), "missing_messages", format!("line {n}: `request.messages` is not an array"), text);
    };
    let choice = match resp.get("choices").and_then(|c| c.get(0)).and_then(Value::as_object) {
        Some(c) => c,
        None => {
            if let Some(err) = resp.get("error") {
                return sink.dead(Some(n), "api_error", format!("line {n}: the server answered with an error: {err}"), text);
            }
            return sink.dead(Some(n), "missing_choices", format!("line {n}: `response.choices[0]` is missing"), text);
        }
    };
    let mut notes = vec![];
    let request = match normalize_request(raw_messages, &mut notes) {
        Ok(ms) => ms,
        Err((i, e)) => return sink.dead(Some(n), e.code(), format!("line {n}, request message {i}: {e}"), text),
    };
    let Some(Value::Object(msg)) = choice.get("message") else {
        return sink.dead(Some(n), "missing_message", format!("line {n}: `choices[0].message` is not an object"), text);
    };
    let resp_norm = match msg.get("role").and_then(Value::as_str) {
        None | Some("assistant") => normalize_with_role(msg, "assistant", None),
        Some(other) => {
            return sink.dead(Some(n), "unknown_role", format!("line {n}: response message has role {other:?}, expected assistant"), text);
        }
    };
    let resp_norm = match resp_norm {
        Ok(r) => r,
        Err(e) => return sink.dead(Some(n), e.code(), format!("line {n}, response message: {e}"), text),
    };
    notes.extend(resp_norm.notes);
    let response = resp_norm.message;

    // Token ids and log-probs.
    let lp_content = choice.get("logprobs").and_then(|l| l.get("content")).and_then(Value::as_array);
    let mut logprobs: Option<Vec<f32>> = None;
    let mut entry_ids: Vec<i32> = vec![];
    if let Some(entries) = lp_content {
        let mut lps = Vec::with_capacity(entries.len());
        let mut bad = None;
        for (i, e) in entries.iter().enumerate() {
            match e.get("logprob").and_then(Value::as_f64) {
                Some(x) => lps.push(x as f32),
                None => bad = bad.or(Some(i)),
            }
            let id = e
                .get("token_id")
                .and_then(Value::as_i64)
                .or_else(|| e.get("token").and_then(Value::as_str).and_then(|t| t.strip_prefix("token_id:")).and_then(|x| x.parse().ok()));
            if let Some(id) = id.and_then(|i| i32::try_from(i).ok()) {
                entry_ids.push(id);
            }
        }
        match bad {
            None => logprobs = Some(lps),
            Some(i) => notes.push(format!("log-probs without a numeric logprob (entry {i} of {}): log-probs dropped", entries.len())),
        }
    }
    let mut token_ids = int_list(choice.get("token_ids"));
    if token_ids.is_none() && lp_content.is_some_and(|c| !c.is_empty() && entry_ids.len() == c.len()) {
        token_ids = Some(entry_ids);
    }
    if logprobs.is_some() && token_ids.is_none() {
        notes.push("log-probs without token ids".into());
    }
    if let (Some(ids), Some(ct)) = (&token_ids, resp.get("usage").and_then(|u| u.get("completion_tokens")).and_then(Value::as_u64)) {
        if ids.len() as u64 != ct {
            notes.push(format!("usage.completion_tokens = {ct} but {} response token ids", ids.len()));
        }
    }
    let prompt_ids = int_list(resp.get("prompt_token_ids")).or_else(|| int_list(choice.get("prompt_token_ids")));

    let event_time = line.get("timestamp").or_else(|| line.get("time")).and_then(parse_timestamp).or_else(|| resp.get("created").and_then(parse_timestamp));
    let tools = match req.get("tools").or_else(|| req.get("functions")) {
        None | Some(Value::Null) => None,
        Some(t) => Some(t.to_string()),
    };
    let mut t = Turn::new(String::new(), 0, &request, &response);
    t.model = resp.get("model").or_else(|| req.get("model")).and_then(Value::as_str).map(str::to_string);
    t.tools = tools;
    t.finish_reason = choice.get("finish_reason").and_then(Value::as_str).map(str::to_string);
    t.truncated = resp_norm.truncated;
    t.prompt_text = line.get("prompt_text").and_then(Value::as_str).map(str::to_string);
    t.prompt_token_ids = prompt_ids;
    t.response_token_ids = token_ids;
    t.rollout_logprobs = logprobs;
    t.notes = notes;
    t.event_time = event_time;
    t.source_line = Some(n);
    t.tenant = super::sink::request_tenant(line, req, &mut t.notes);
    sessions.place_and_emit(sink, n, text, line, req, t)
}

/// Session and turn assignment of `{request, response}` log lines, shared by every request/response
/// format (`openai-chat`, `openai-responses`, `anthropic-messages`).
pub(crate) struct Sessions {
    inferrer: SessionInferrer,
    counters: HashMap<String, SessionTurns>,
}

impl Sessions {
    /// Sessions of one file (the inferrer is salted with the file name).
    pub fn new(sink: &Sink<'_>) -> Sessions {
        Sessions { inferrer: SessionInferrer::with_salt(sink.opts.session_cache, &sink.file), counters: HashMap::new() }
    }

    /// Sets `t`'s session, turn index, turn type and done flag from the line's markers (headers, then
    /// the request body, then the line; see the module doc) or by inference, and emits it; a
    /// repeated request and response of an explicit session is a `duplicate_turn` dead letter.
    ///
    /// # Errors
    /// Errors from the sink's callback.
    pub fn place_and_emit(&mut self, sink: &mut Sink<'_>, n: i64, text: &[u8], line: &Map<String, Value>, req: &Map<String, Value>, t: Turn<'_>) -> Result<()> {
        match self.place(sink, n, text, line, req, t, None)? {
            Some(row) => sink.emit(row),
            None => Ok(()),
        }
    }

    /// Like [`Sessions::place_and_emit`] but returns the built row instead of emitting it, continuing
    /// `chained` = (session, inferred, turn index) when the line names no session of its own (a
    /// Responses request chained by `previous_response_id`). `None` when the line was a duplicate
    /// (already dead-lettered).
    ///
    /// # Errors
    /// Errors from the sink's callback.
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        &mut self,
        sink: &mut Sink<'_>,
        n: i64,
        text: &[u8],
        line: &Map<String, Value>,
        req: &Map<String, Value>,
        mut t: Turn<'_>,
        chained: Option<(String, bool, i32)>,
    ) -> Result<Option<crate::schema::Interaction>> {
        let (request, response) = (t.request, t.response);
        let notes = &mut t.notes;
        let counters = &mut self.counters;
        let inferrer = &mut self.inferrer;
        // Session, turn type, done flag.
        let explicit = match marker(line, req, "x-session-id", "session_id") {
            Some(Value::String(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
            Some(Value::Number(x)) => Some(x.to_string()),
            _ => None,
        };
        let turn_type = match marker(line, req, "x-turn-type", "turn_type") {
            Some(Value::String(s)) => match TurnType::parse(s) {
                Some(t) => t,
                None => {
                    notes.push(format!("unknown turn type {s:?}: default used"));
                    sink.opts.default_turn_type
                }
            },
            _ => sink.opts.default_turn_type,
        };
        let done = truthy(marker(line, req, "x-session-done", "session_done"));
        let (session_id, inferred, turn_index) = match (explicit, chained) {
            (None, Some(c)) => c,
            (Some(id), _) => {
                // The same request and response logged twice in a session is one turn logged twice.
                // Counted per tenant: two tenants' sessions of one id number their turns apart.
                let content = content_key(request, response)?;
                let tenant = sink.opts.tenant.as_deref().or(t.tenant.as_deref()).unwrap_or(crate::schema::DEFAULT_TENANT);
                let counter_key = crate::schema::tenant_session_key(Some(tenant), &id);
                let seen = counters.entry(counter_key).or_default();
                if let Some(&turn) = seen.content.get(&content) {
                    let reason = format!("line {n}: the request and response of turn {turn} of session {id:?} logged again");
                    return sink.dead_in_session(Some(n), &id, "duplicate_turn", reason, text).map(|_| None);
                }
                let turn = seen.next;
                seen.next += 1;
                seen.content.insert(content, turn);
                (id, false, turn)
            }
            (None, None) => {
                // Scoped by the turn's tenant: two users' alike conversations stay apart.
                let tenant = sink.opts.tenant.as_deref().or(t.tenant.as_deref()).filter(|t| *t != crate::schema::DEFAULT_TENANT).unwrap_or("");
                let inf = inferrer.assign_in(tenant, request, response);
                (inf.session_id, true, inf.turn_index)
            }
        };

        t.session_id = session_id;
        t.session_inferred = inferred;
        t.turn_index = turn_index;
        t.turn_type = turn_type;
        t.session_done = done;
        Ok(Some(sink.build(t)?))
    }
}
