//! Judge backends behind one async trait ([`VoteBackend`]); the [`super::Voter`] that asks a backend
//! for m votes with bounded concurrency, timeouts, retries and a vote cache lives in `voter.rs`.
//!
//! Backends: any OpenAI-compatible `/v1/chat/completions` endpoint ([`OpenAiBackend`]); SGLang's native
//! `/generate` ([`SglangBackend`]); and embedded rule-based baselines (the judge's
//! [`super::RulesJudge`], the hint stage's `RulesHint`), which are not LLMs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::prompt::{render_role_tagged, ChatMessage};
use super::turn::TurnContext;
use crate::{config_err, Error, Result};

/// Which backend answers the votes (`backend = "rules" | "openai" | "sglang"` in a pipeline's
/// `[judge]` / `[hint]` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The embedded rule-based baseline (no LLM, no network). The default.
    #[default]
    Rules,
    /// An OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang, llama.cpp, OpenAI, ...).
    Openai,
    /// SGLang's native `/generate` endpoint (takes a rendered prompt string).
    Sglang,
}

impl BackendKind {
    /// `rules`, `openai` or `sglang`, as stored in `judge_backend` / `hint_backend`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Rules => "rules",
            BackendKind::Openai => "openai",
            BackendKind::Sglang => "sglang",
        }
    }
}

/// Sampling parameters of a vote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Sampling temperature (docs/method.md §2 default 0.6).
    pub temperature: f32,
    /// Maximum number of generated tokens per vote.
    pub max_tokens: u32,
}

impl Sampling {
    /// Canonical text of the parameters, part of the vote-cache key: `temperature=0.6;max_tokens=4096`
    /// (Rust's shortest round-trip float formatting).
    pub fn canonical(&self) -> String {
        format!("temperature={};max_tokens={}", self.temperature, self.max_tokens)
    }
}

/// One vote request handed to a backend.
#[derive(Debug, Clone, Copy)]
pub struct VoteRequest<'a> {
    /// The rendered judge prompt (system + user).
    pub messages: &'a [ChatMessage],
    /// The turn itself (what rule-based backends read).
    pub turn: &'a TurnContext,
    /// 0-based vote index.
    pub index: u32,
    /// Sampling parameters.
    pub sampling: Sampling,
}

/// Why one call to a backend failed; decides whether it is retried.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// Connection refused/reset, DNS, body read error: retried.
    Transport(String),
    /// The TLS layer refused the connection (an untrusted or expired certificate, a name mismatch, a
    /// failed handshake): not retried, since the same certificate fails the same way.
    Tls(String),
    /// No answer within the per-attempt timeout (seconds): retried.
    Timeout(f64),
    /// A non-success HTTP status: retried for 5xx, 408 and 429, not for other 4xx.
    Status {
        /// HTTP status code.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// A 2xx answer we cannot read (not JSON, no text field): not retried.
    BadResponse(String),
}

impl CallError {
    /// Whether a retry may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            CallError::Transport(_) | CallError::Timeout(_) => true,
            CallError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            CallError::BadResponse(_) | CallError::Tls(_) => false,
        }
    }

    /// As the crate's error type ([`Error::Http`] or [`Error::Timeout`]).
    pub fn into_error(self) -> Error {
        match self {
            CallError::Timeout(s) => Error::Timeout(s),
            other => Error::Http(other.to_string()),
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Transport(m) => write!(f, "transport error: {m}"),
            CallError::Tls(m) => write!(f, "TLS error: {m}"),
            CallError::Timeout(s) => write!(f, "timeout after {s:.1} s"),
            CallError::Status { status, body } => write!(f, "HTTP status {status}: {body}"),
            CallError::BadResponse(m) => write!(f, "unreadable response: {m}"),
        }
    }
}

/// A judge backend: turns one vote request into the judge's raw answer text. One call is one attempt;
/// retries, timeouts, concurrency limits and caching are the [`super::Voter`]'s job.
pub trait VoteBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// Judge model id as stored in the rows (`rules-v1` for the judge baseline).
    fn model(&self) -> &str;
    /// Whether answers are worth caching (false for the free, deterministic rule-based backends).
    fn cacheable(&self) -> bool {
        true
    }
    /// One attempt at one vote.
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>>;
}

/// An API key read from the environment; its `Debug` output is redacted.
#[derive(Clone)]
pub struct ApiKey(String);

impl ApiKey {
    /// Reads the key from the environment variable named `var`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable (never its value) when it is unset or not UTF-8.
    pub fn from_env(var: &str) -> Result<ApiKey> {
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(ApiKey(v)),
            Ok(_) => Err(config_err!("environment variable {var} (api_key_env) is empty")),
            Err(_) => Err(config_err!("environment variable {var} (api_key_env) is not set or not UTF-8")),
        }
    }
    /// A key given directly (tests, embedding).
    pub fn new(key: impl Into<String>) -> ApiKey {
        ApiKey(key.into())
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(***)")
    }
}

fn snippet(s: &str) -> String {
    super::prompt::truncate_middle(s.trim(), 300)
}

/// Classifies a failed call: timeout, TLS (certificate, handshake: not retried) or other transport
/// error, with the error's whole chain of causes as the message.
pub fn transport(e: reqwest::Error, timeout_s: f64) -> CallError {
    if e.is_timeout() {
        CallError::Timeout(timeout_s)
    } else if crate::net::is_tls_error(&e) {
        CallError::Tls(crate::net::error_chain(&e))
    } else {
        CallError::Transport(crate::net::error_chain(&e))
    }
}

/// `url` with the endpoint `path` appended unless it already ends with it (trailing `/` ignored).
pub(crate) fn endpoint_url(url: &str, path: &str) -> String {
    let base = url.trim_end_matches('/');
    if base.ends_with(path) {
        base.to_string()
    } else if path.starts_with("/v1/") && base.ends_with("/v1") {
        format!("{}{}", base, &path[3..])
    } else {
        format!("{base}{path}")
    }
}

/// POSTs `body` as JSON (with `key` as a bearer token) and reads a JSON answer: transport failures
/// classified by [`transport`], a non-2xx status as [`CallError::Status`] with the start of the body, a
/// 2xx body that is not JSON as [`CallError::BadResponse`]. One attempt (no retry).
pub(crate) async fn post_json(
    client: &reqwest::Client,
    url: &str,
    key: Option<&ApiKey>,
    body: &serde_json::Value,
    timeout_s: f64,
) -> std::result::Result<serde_json::Value, CallError> {
    let mut rb = client.post(url).json(body);
    if let Some(k) = key {
        rb = rb.bearer_auth(&k.0);
    }
    let resp = rb.send().await.map_err(|e| transport(e, timeout_s))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| transport(e, timeout_s))?;
    if !status.is_success() {
        return Err(CallError::Status { status: status.as_u16(), body: snippet(&text) });
    }
    serde_json::from_str(&text).map_err(|e| CallError::BadResponse(format!("not JSON ({e}): {}", snippet(&text))))
}

/// An OpenAI-compatible chat endpoint: `POST {url}/v1/chat/completions` with
/// `{model, messages, temperature, max_tokens, n: 1, stream: false}`; the vote is
/// `choices[0].message.content`.
pub struct OpenAiBackend {
    client: reqwest::Client,
    url: String,
    model: String,
    key: Option<ApiKey>,
    timeout_s: f64,
}

impl std::fmt::Debug for OpenAiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiBackend").field("url", &crate::net::redact_url(&self.url)).field("model", &self.model).field("key", &self.key).finish()
    }
}

impl OpenAiBackend {
    /// A client for the endpoint at `url` (a base such as `http://127.0.0.1:30000`, or ending in `/v1`
    /// or the full `/v1/chat/completions` path). `timeout_s` bounds each request.
    ///
    /// # Errors
    /// [`Error::Http`] when the HTTP client cannot be built.
    pub fn new(url: &str, model: &str, key: Option<ApiKey>, timeout_s: f64) -> Result<OpenAiBackend> {
        Ok(OpenAiBackend {
            client: crate::net::http_client(Some(Duration::from_secs_f64(timeout_s)))?,
            url: endpoint_url(url, "/v1/chat/completions"),
            model: model.to_string(),
            key,
            timeout_s,
        })
    }
    /// The full endpoint URL requests go to.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl VoteBackend for OpenAiBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Openai
    }
    fn model(&self) -> &str {
        &self.model
    }
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>> {
        Box::pin(async move {
            let body = serde_json::json!({
                "model": self.model,
                "messages": req.messages,
                "temperature": req.sampling.temperature,
                "max_tokens": req.sampling.max_tokens,
                "n": 1,
                "stream": false,
            });
            let v = post_json(&self.client, &self.url, self.key.as_ref(), &body, self.timeout_s).await?;
            match v.pointer("/choices/0/message/content") {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                _ => Err(CallError::BadResponse(format!(
                    "no choices[0].message.content text: {}",
                    snippet(&v.to_string())
                ))),
            }
        })
    }
}

/// Renders chat messages into one prompt string (for [`SglangBackend`]).
pub type PromptRenderer = Arc<dyn Fn(&[ChatMessage]) -> String + Send + Sync>;

/// SGLang's native endpoint: `POST {url}/generate` with
/// `{"text": prompt, "sampling_params": {"temperature", "max_new_tokens"}}`; the vote is the answer's
/// `text` (an object, or the first element of an array). The prompt is rendered by a
/// [`PromptRenderer`], by default [`render_role_tagged`] (generic `<|role|>` tags, not the judge
/// model's chat template: pass the model's own renderer, or use the OpenAI-compatible endpoint, when
/// the judge is sensitive to its template).
pub struct SglangBackend {
    client: reqwest::Client,
    url: String,
    model: String,
    key: Option<ApiKey>,
    timeout_s: f64,
    renderer: PromptRenderer,
}

impl fmt::Debug for SglangBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SglangBackend").field("url", &crate::net::redact_url(&self.url)).field("model", &self.model).field("key", &self.key).finish()
    }
}

impl SglangBackend {
    /// A client for the SGLang server at `url` (base URL or the full `/generate` path); `model` is the
    /// judge model id recorded in rows and cache keys. `renderer` = `None` uses [`render_role_tagged`].
    ///
    /// # Errors
    /// [`Error::Http`] when the HTTP client cannot be built.
    pub fn new(url: &str, model: &str, key: Option<ApiKey>, timeout_s: f64, renderer: Option<PromptRenderer>) -> Result<SglangBackend> {
        Ok(SglangBackend {
            client: crate::net::http_client(Some(Duration::from_secs_f64(timeout_s)))?,
            url: endpoint_url(url, "/generate"),
            model: model.to_string(),
            key,
            timeout_s,
            renderer: renderer.unwrap_or_else(|| Arc::new(|m: &[ChatMessage]| render_role_tagged(m))),
        })
    }
    /// The full endpoint URL requests go to.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl VoteBackend for SglangBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sglang
    }
    fn model(&self) -> &str {
        &self.model
    }
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>> {
        Box::pin(async move {
            let body = serde_json::json!({
                "text": (self.renderer)(req.messages),
                "sampling_params": {
                    "temperature": req.sampling.temperature,
                    "max_new_tokens": req.sampling.max_tokens,
                },
            });
            let v = post_json(&self.client, &self.url, self.key.as_ref(), &body, self.timeout_s).await?;
            let obj = match &v {
                serde_json::Value::Array(a) => a.first().cloned().unwrap_or(serde_json::Value::Null),
                other => other.clone(),
            };
            match obj.get("text") {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                _ => Err(CallError::BadResponse(format!("no \"text\" field: {}", snippet(&v.to_string())))),
            }
        })
    }
}

/// Builds the network backend named by `kind`, or returns `rules` for [`BackendKind::Rules`].
///
/// # Errors
/// [`Error::Config`] when a network backend lacks `url` or `model`, or `api_key_env` names an unset
/// variable; [`Error::Http`] when the HTTP client cannot be built.
pub fn build_backend(
    kind: BackendKind,
    url: Option<&str>,
    model: Option<&str>,
    api_key_env: Option<&str>,
    timeout_s: f64,
    rules: Arc<dyn VoteBackend>,
) -> Result<Arc<dyn VoteBackend>> {
    if kind == BackendKind::Rules {
        return Ok(rules);
    }
    let url = url.filter(|u| !u.trim().is_empty()).ok_or_else(|| config_err!("backend {} needs `url`", kind.as_str()))?;
    let model = model.filter(|m| !m.trim().is_empty()).ok_or_else(|| config_err!("backend {} needs `model`", kind.as_str()))?;
    let key = api_key_env.map(ApiKey::from_env).transpose()?;
    Ok(match kind {
        BackendKind::Openai => Arc::new(OpenAiBackend::new(url, model, key, timeout_s)?),
        _ => Arc::new(SglangBackend::new(url, model, key, timeout_s, None)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_urls() {
        assert_eq!(endpoint_url("http://h:1", "/v1/chat/completions"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint_url("http://h:1/", "/v1/chat/completions"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint_url("http://h:1/v1", "/v1/chat/completions"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint_url("http://h:1/v1/chat/completions", "/v1/chat/completions"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint_url("http://h:1", "/generate"), "http://h:1/generate");
        assert_eq!(endpoint_url("http://h:1/generate/", "/generate"), "http://h:1/generate");
    }

    #[test]
    fn retryable_classes() {
        assert!(CallError::Transport("x".into()).retryable());
        assert!(CallError::Timeout(1.0).retryable());
        assert!(CallError::Status { status: 500, body: String::new() }.retryable());
        assert!(CallError::Status { status: 503, body: String::new() }.retryable());
        assert!(CallError::Status { status: 429, body: String::new() }.retryable());
        assert!(!CallError::Status { status: 400, body: String::new() }.retryable());
        assert!(!CallError::Status { status: 401, body: String::new() }.retryable());
        assert!(!CallError::BadResponse("x".into()).retryable());
        assert!(matches!(CallError::Timeout(2.0).into_error(), Error::Timeout(s) if s == 2.0));
    }

    #[test]
    fn api_key_is_redacted_and_missing_var_names_only_the_var() {
        assert_eq!(format!("{:?}", ApiKey::new("sk-secret")), "ApiKey(***)");
        let e = ApiKey::from_env("NEXTSTATE_TEST_SURELY_UNSET_VAR_42").unwrap_err();
        assert_eq!(
            e.to_string(),
            "config: environment variable NEXTSTATE_TEST_SURELY_UNSET_VAR_42 (api_key_env) is not set or not UTF-8"
        );
    }

    #[test]
    fn sampling_canonical_text() {
        assert_eq!(Sampling { temperature: 0.6, max_tokens: 4096 }.canonical(), "temperature=0.6;max_tokens=4096");
    }
}
