//! The client's request as the capture proxy reads and rewrites it: turn metadata from headers and
//! body keys, the conversation checked before the upstream runs (refusals: [`Rejected`]), the
//! upstream body with the log-prob rewrite of chat requests, and [`strip_logprobs`], which undoes
//! that rewrite in what the client gets. Pure code, unit-tested below.

use axum::http::HeaderMap;
use serde_json::{Map, Value};

use super::apis::{self, Api};
use crate::schema::{Message, TurnType};
use crate::Result;

/// Header naming the session of a request.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header with the turn type (`main` | `side`).
pub const TURN_TYPE_HEADER: &str = "x-turn-type";
/// Header marking the last turn of a session (truthy: `1`, `true`, `yes`, `on`).
pub const SESSION_DONE_HEADER: &str = "x-session-done";
/// Header with an explicit 0-based turn index (survives proxy restarts, unlike the proxy's counter).
pub const TURN_INDEX_HEADER: &str = "x-turn-index";
/// Headers naming the tenant of a request, in order of preference: the first one present wins
/// (`[proxy] tenant_headers` replaces the list).
pub use crate::schema::TENANT_HEADERS;
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
    /// The tenant: the first of the tenant headers present, else [`crate::schema::DEFAULT_TENANT`].
    pub tenant: String,
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
    Ok(TurnMeta { session_id, turn_type, session_done, turn_index, tenant: crate::schema::DEFAULT_TENANT.to_string() })
}

/// [`TENANT_HEADERS`] as owned names.
pub fn default_tenant_headers() -> Vec<String> {
    TENANT_HEADERS.iter().map(|h| h.to_string()).collect()
}

/// Header names for [`take_tenant`]: `names` lower-cased, or [`TENANT_HEADERS`] for `None`.
///
/// # Errors
/// The reason, for an empty list or a name that is not a valid HTTP header name.
pub fn tenant_header_names(names: Option<&[String]>) -> std::result::Result<Vec<String>, String> {
    let Some(names) = names else {
        return Ok(default_tenant_headers());
    };
    if names.is_empty() {
        return Err("the list of tenant headers is empty (leave it out for X-Agent-Id, X-User-Id)".into());
    }
    names
        .iter()
        .map(|n| axum::http::HeaderName::from_bytes(n.trim().as_bytes()).map(|h| h.as_str().to_string()).map_err(|_| format!("{n:?} is not an HTTP header name")))
        .collect()
}

/// The tenant a request's headers name: the value of the first header of `names` (case-insensitive)
/// that is present and not blank (None: no such header; [`prepare_request`] then reads the body, as
/// ingest does: [`crate::ingest::normalize::body_tenant`], else [`crate::schema::DEFAULT_TENANT`]).
///
/// # Errors
/// The reason, naming the header, when its value is not visible ASCII or not a valid tenant id
/// ([`crate::schema::validate_tenant`]).
pub fn take_tenant(headers: &HeaderMap, names: &[String]) -> std::result::Result<Option<String>, String> {
    for name in names {
        let Some(v) = headers.get(name.as_str()) else { continue };
        let v = v.to_str().map_err(|_| format!("header {name} is not visible ASCII"))?.trim();
        if v.is_empty() {
            continue;
        }
        crate::schema::validate_tenant(v).map_err(|e| format!("header {name}: {e}"))?;
        return Ok(Some(v.to_string()));
    }
    Ok(None)
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
    /// Headers naming the tenant, lower-case, first present wins ([`TENANT_HEADERS`] by default).
    pub tenant_headers: Vec<String>,
}

impl RewriteOptions {
    /// Turn type `main`, token ids not requested, upstream log-prob mode left alone, the tenant from
    /// [`TENANT_HEADERS`].
    pub fn new(default_turn_type: TurnType) -> RewriteOptions {
        RewriteOptions { default_turn_type, request_token_ids: false, logprobs_mode: None, tenant_headers: default_tenant_headers() }
    }
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
    /// Responses API: the request said `background: true` (the upstream answers at once with a
    /// `queued` response fetched later: [`super::background`]).
    pub background: bool,
}

/// Why a client's request is refused before it reaches the upstream (the proxy answers 4xx with
/// `error.code` = [`Rejected::code`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// HTTP status (400, or 409 for a duplicate turn).
    pub status: u16,
    /// Reason code, as in dead letters: `malformed_json` (not JSON, invalid UTF-8, nested deeper than
    /// 128), `wrong_type` (body or a message field of the wrong JSON type), `invalid_turn_metadata`,
    /// `invalid_tenant`, `missing_messages`, `missing_role`, `unknown_role`, `tool_call_without_name`,
    /// `duplicate_turn`.
    pub code: &'static str,
    /// What is wrong, with positions.
    pub message: String,
}

impl Rejected {
    fn bad(code: &'static str, message: String) -> Rejected {
        Rejected { status: 400, code, message }
    }
}

/// Parses a client's request body for `api`, reads its conversation ([`apis::conversation`]), takes
/// its turn metadata and builds the
/// upstream body. Only chat requests are rewritten beyond the removal of [`BODY_KEYS`]: `logprobs:
/// true`, `return_token_ids`, `logprobs_mode` (see [`RewriteOptions`]).
///
/// # Errors
/// [`Rejected`] (400): `malformed_json` when the body is not JSON (bad syntax, invalid UTF-8, nesting
/// over serde_json's limit of 128), `wrong_type` when it is not an object, `invalid_turn_metadata`
/// (see [`take_turn_meta`]), `invalid_tenant` (see [`take_tenant`]), `missing_messages` (no `messages` / `input`), or the normaliser's code
/// for a message that does not normalise.
pub fn prepare_request(api: Api, headers: &HeaderMap, raw: &[u8], opts: &RewriteOptions) -> std::result::Result<Prepared, Rejected> {
    let v: Value = serde_json::from_slice(raw).map_err(|e| Rejected::bad("malformed_json", format!("request body of {} bytes is not JSON: {e}", raw.len())))?;
    let Value::Object(mut body) = v else {
        return Err(Rejected::bad("wrong_type", format!("request body is a JSON {}, expected an object", crate::ingest::normalize::json_type(&v))));
    };
    let mut meta = take_turn_meta(headers, &mut body, opts.default_turn_type).map_err(|e| Rejected::bad("invalid_turn_metadata", e.to_string()))?;
    let header_tenant = take_tenant(headers, &opts.tenant_headers).map_err(|e| Rejected::bad("invalid_tenant", e))?;
    let mut notes = vec![];
    meta.tenant = header_tenant.or_else(|| crate::ingest::normalize::body_tenant(&body, &mut notes)).unwrap_or_else(|| crate::schema::DEFAULT_TENANT.to_string());
    let instructions = usize::from(api == Api::Responses && crate::ingest::openai_responses::instructions(&body).is_some());
    let messages = apis::conversation(api, &body, &mut notes).map_err(|(code, reason)| Rejected::bad(code, reason))?;
    // Dead letters of the Responses and Messages APIs keep the whole body (instructions, system,
    // previous_response_id): their conversation is more than one field.
    let raw_messages = match api {
        Api::ChatCompletions => body.get("messages").cloned().unwrap_or(Value::Null),
        _ => Value::Object(body.clone()),
    };
    let store = !matches!(body.get("store"), Some(Value::Bool(false)));
    let background = api == Api::Responses && matches!(body.get("background"), Some(Value::Bool(true)));
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
    Ok(Prepared { upstream_body, client_wants_logprobs, stream, meta, messages, notes, raw_messages, tools, model, previous_response_id, instructions, store, background })
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    fn opts() -> RewriteOptions {
        RewriteOptions::new(TurnType::Main)
    }

    #[test]
    fn headers_win_and_body_keys_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_static("s-head"));
        h.insert("x-turn-type", HeaderValue::from_static("SIDE"));
        let raw = br#"{"messages":[{"role":"user","content":"hi"}],"session_id":"s-body","turn_type":"main","session_done":"yes","turn_index":3}"#;
        let p = prepare_request(Api::ChatCompletions, &h, raw, &opts()).unwrap();
        assert_eq!(p.meta, TurnMeta { session_id: Some("s-head".into()), turn_type: TurnType::Side, session_done: true, turn_index: Some(3), tenant: "default".into() });
        let up: Value = serde_json::from_slice(&p.upstream_body).unwrap();
        for k in BODY_KEYS {
            assert!(up.get(k).is_none(), "{k} forwarded");
        }
        assert_eq!(up["logprobs"], json!(true));
        assert!(!p.client_wants_logprobs);
        assert!(up.get("return_token_ids").is_none());
    }

    #[test]
    fn the_tenant_is_the_first_tenant_header_present_and_an_invalid_one_is_refused() {
        let raw = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let tenant = |pairs: &[(&'static str, &'static str)], o: &RewriteOptions| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            prepare_request(Api::ChatCompletions, &h, raw, o).map(|p| p.meta.tenant).map_err(|r| (r.status, r.code, r.message))
        };
        assert_eq!(tenant(&[], &opts()), Ok("default".into()));
        // Without a tenant header, the body's OpenAI `user` (a valid id only), as ingest reads it.
        let with_user = |user: &str| {
            let raw = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "user": user}).to_string();
            let p = prepare_request(Api::ChatCompletions, &HeaderMap::new(), raw.as_bytes(), &opts()).unwrap();
            (p.meta.tenant, p.notes)
        };
        assert_eq!(with_user("ann@example.com"), ("ann@example.com".into(), vec![]));
        assert_eq!(with_user("Ann Smith").0, "default", "not a tenant id: the default tenant, with a note");
        assert_eq!(with_user("Ann Smith").1.last().unwrap(), "the request's user is not a tenant: tenant id \"Ann Smith\" has the character ' ' at byte 3; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit");
        assert_eq!(tenant(&[("x-user-id", "bob")], &opts()), Ok("bob".into()));
        assert_eq!(tenant(&[("X-Agent-Id", "agent-7"), ("x-user-id", "bob")], &opts()), Ok("agent-7".into()), "X-Agent-Id first");
        assert_eq!(tenant(&[("x-agent-id", "  "), ("x-user-id", "bob")], &opts()), Ok("bob".into()), "a blank header counts as none");
        assert_eq!(
            tenant(&[("x-agent-id", "team/a")], &opts()),
            Err((400, "invalid_tenant", "header x-agent-id: tenant id \"team/a\" has the character '/' at byte 4; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit".into()))
        );
        let custom = RewriteOptions { tenant_headers: tenant_header_names(Some(&["X-Team".to_string()])).unwrap(), ..opts() };
        assert_eq!(tenant(&[("x-agent-id", "agent-7"), ("x-team", "blue")], &custom), Ok("blue".into()), "only the configured header is read");
        assert_eq!(tenant(&[("x-agent-id", "agent-7")], &custom), Ok("default".into()));
        assert_eq!(tenant_header_names(Some(&[])), Err("the list of tenant headers is empty (leave it out for X-Agent-Id, X-User-Id)".into()));
        assert_eq!(tenant_header_names(Some(&["bad header".to_string()])), Err("\"bad header\" is not an HTTP header name".into()));
        assert_eq!(tenant_header_names(None).unwrap(), vec!["x-agent-id".to_string(), "x-user-id".to_string()]);
    }

    #[test]
    fn defaults_and_errors() {
        let h = HeaderMap::new();
        let p = prepare_request(Api::ChatCompletions, &h, br#"{"messages":[],"logprobs":true,"stream":true}"#, &RewriteOptions { request_token_ids: true, ..opts() }).unwrap();
        assert_eq!(p.meta, TurnMeta { session_id: None, turn_type: TurnType::Main, session_done: false, turn_index: None, tenant: "default".into() });
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
}
