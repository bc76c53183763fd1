//! `nextstate proxy`: a capture proxy in front of a policy server (ours, vLLM, SGLang, a hosted
//! API). It forwards `POST /v1/chat/completions`, `POST /v1/responses` (OpenAI Responses) and
//! `POST /v1/messages` (Anthropic Messages), streamed or not, and `GET /v1/models`, and emits one
//! `interactions` event per finished turn (METHOD.md §1) to Kafka without ever making the client
//! wait on Kafka. What is specific to the Responses and Messages APIs (conversations, responses,
//! stream events, `previous_response_id` chains, `x-api-key` / `anthropic-*` headers) is in
//! [`apis`]; everything below holds for all three, except the log-prob rewriting, which is chat
//! completions only.
//!
//! Per request:
//! - Turn metadata from headers `X-Session-Id`, `X-Turn-Type` (`main`|`side`), `X-Session-Done`
//!   (truthy: 1/true/yes/on), `X-Turn-Index`, or the body keys `session_id`, `turn_type`,
//!   `session_done`, `turn_index` (headers win). The body keys are removed and the headers are not
//!   forwarded: the upstream never sees them. A bad turn type or index → 400.
//! - No session id → inferred ([`crate::ingest::sessions`]; `session_inferred = true`). The default
//!   turn type is configurable and `main` by default (METHOD.md §1: the reference's `side` default
//!   trains nothing).
//! - `turn_index`: explicit (`X-Turn-Index`) when given; else, for an explicit session, the number of
//!   turns (main and side) of that session this proxy process has seen, in the order their responses
//!   finished (failed turns do not count) — **a proxy restart resets it**
//!   (clients that need stable indices across restarts send `X-Turn-Index`); for an inferred session,
//!   the number of assistant messages in the request (restart-proof).
//! - Log-probs: the proxy sets `logprobs: true` when the client did not, and then nulls
//!   `choices[].logprobs` in what the client gets (stream chunks included), so the client sees what
//!   it asked for. It adds `return_token_ids: true` (vLLM's switch for `prompt_token_ids` and
//!   `choices[].token_ids`; ours returns them anyway and ignores the key) unless disabled. It does
//!   **not** set `logprobs_mode`: the upstream's own default applies to proxied and direct calls
//!   alike (ours: `nextstate serve --logprobs-mode`, default `sampling` = the distribution actually
//!   sampled from; vLLM: raw). The trainer's ratio `exp(new − old)` (METHOD.md §6) compares these
//!   rollout log-probs with its own forward pass, so deployments that sample with temperature ≠ 1 or
//!   top-p/top-k and want the two to agree set `--logprobs-mode raw` on the server, or
//!   `--upstream-logprobs-mode raw` here (sent only when the client sent none).
//! - The response is returned unchanged otherwise (non-stream: the upstream's bytes, re-serialised
//!   only when log-probs had to be removed); streams are forwarded chunk by chunk as they arrive.
//! - Upstream error status → passed through (status and body), no event, counted; upstream
//!   unreachable → 502 with a JSON error; body over the limit → 413; missing/wrong key (bearer, or
//!   `x-api-key`) → 401
//!   (compared in constant time; `/health` is open).
//! - Requests that could not become a row are refused before the upstream runs, with 400 and
//!   `error.code` naming why ([`capture::Rejected`]): not JSON (`malformed_json`: bad syntax, invalid
//!   UTF-8, nesting deeper than 128), not an object (`wrong_type`), bad turn metadata
//!   (`invalid_turn_metadata`), `messages` missing or not an array (`missing_messages`), a message
//!   that does not normalise (`wrong_type`, `missing_role`, `unknown_role`, ...). An explicit session
//!   and `X-Turn-Index` this proxy already captured → 409 `duplicate_turn`.
//! - An upstream 2xx response that cannot be recorded is passed to the client unchanged and becomes a
//!   `dead_letters` row (stage `proxy`): not JSON (`malformed_json`, e.g. a `NaN` log-prob), no
//!   `choices[0].message` (`bad_response`), a stream chunk that is not JSON (`bad_response`), a stream
//!   without a finish reason (`incomplete_stream`); a second capture of one session and turn (two
//!   requests in flight at once, or an inferred session asked again) → `duplicate_turn`.
//!
//! Rows (`interactions`, `source_format = "proxy"`): request messages normalised
//! ([`crate::ingest::normalize`]), tools, response text / reasoning (`<think>` split or
//! `reasoning_content`) / tool calls, finish reason, `truncated` (finish reason `length` or an
//! unclosed reasoning block), `policy_version` (body field, else the `X-Policy-Version` header, else
//! the version an in-process reloader confirmed for the upstream: [`ProxyOptions::upstream_versions`]),
//! prompt and response token ids and rollout log-probs when the upstream returns them (validated:
//! ids are non-negative `i32`s, log-probs finite, one per response token; anything invalid is dropped
//! with a note and counted in `token_capture_total{kind="rejected"}`), `event_time` = when the
//! request arrived, `ingest_time` = when the row was built. The `source_*` lineage columns stay null:
//! the row is itself the Kafka record.
//!
//! Events: see [`emit`] (bounded channel → emitter task → Kafka, or a bounded local spool while Kafka
//! is down, replayed later; at-least-once). `/metrics` ([`metrics`]) and `/health` report the counts.

pub mod apis;
pub mod capture;
pub mod emit;
pub mod metrics;
pub mod sessions;

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;

use self::apis::{Accumulator, Api};
use self::capture::{build_interaction, prepare_request, strip_logprobs, Captured, Completed, NoTurn, RewriteOptions, Sessions, SseEvent, SseFramer, TurnRequest};
use self::emit::{Emitter, EmitterConfig, EmitterHandle, Outgoing, Spool, SpoolConfig};
use self::metrics::Metrics;
use super::openai::error_body;
use super::VERSION_HEADER;
use crate::bus::{Bus, BusConfig};
use crate::schema::{now_ms, DeadLetter, Interaction, Table, TurnType};
use crate::{Error, Result};

/// Proxy settings (library form of [`ProxyArgs`]).
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Base URL of the upstream server (`http://host:port`; a trailing `/` or `/v1` is removed).
    pub upstream: String,
    /// Require `Authorization: Bearer KEY` from clients on every route but `/health`.
    pub api_key: Option<String>,
    /// Bearer key for the upstream. When `None` and `api_key` is `None`, the client's own
    /// `Authorization` header is forwarded.
    pub upstream_api_key: Option<String>,
    /// Turn type of requests that do not say (METHOD.md §1).
    pub default_turn_type: TurnType,
    /// Spool folder and bound.
    pub spool: SpoolConfig,
    /// Emitter queue, timeouts and retries.
    pub emitter: EmitterConfig,
    /// Largest accepted request body, bytes (larger → 413).
    pub max_body_bytes: usize,
    /// Ask the upstream for token ids with `return_token_ids: true` (see module docs).
    pub request_token_ids: bool,
    /// `logprobs_mode` sent upstream when the client sent none (`None`: upstream default).
    pub logprobs_mode: Option<String>,
    /// Longest silence from the upstream (waiting for headers or between chunks) before the request
    /// fails.
    pub upstream_idle_timeout: Duration,
    /// TCP connect timeout to the upstream.
    pub connect_timeout: Duration,
    /// Turns remembered for session inference and sessions whose turn counters are kept (LRU).
    pub session_capacity: usize,
    /// The versions a reloader of this process confirmed per server
    /// ([`crate::serve::reload::LoadedVersions`]): a turn whose upstream reports no policy version
    /// (neither body `policy_version` nor `X-Policy-Version`, as vLLM and SGLang) gets the upstream's
    /// confirmed version when no reload overlapped the request and, for a LoRA kind, the request named
    /// the loaded adapter; else it stays unknown. `None`: no such fallback.
    pub upstream_versions: Option<crate::serve::reload::LoadedVersions>,
}

impl ProxyOptions {
    /// Defaults for `upstream`: no auth, turn type `main`, spool `.cache/proxy-spool` bounded to
    /// 256 MiB, 16 MiB bodies, token ids requested, 600 s upstream idle timeout, 5 s connect timeout,
    /// 100,000 sessions.
    pub fn new(upstream: impl Into<String>) -> ProxyOptions {
        ProxyOptions {
            upstream: upstream.into(),
            api_key: None,
            upstream_api_key: None,
            default_turn_type: TurnType::Main,
            spool: SpoolConfig::new(".cache/proxy-spool", 256 << 20),
            emitter: EmitterConfig::default(),
            max_body_bytes: 16 << 20,
            request_token_ids: true,
            logprobs_mode: None,
            upstream_idle_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(5),
            session_capacity: crate::ingest::sessions::DEFAULT_CAPACITY,
            upstream_versions: None,
        }
    }
}

/// Counters of a proxy (a snapshot of its metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProxyStats {
    /// Turns turned into `interactions` events.
    pub turns_captured: u64,
    /// Turns sent to `dead_letters` instead (an upstream answer that cannot be recorded, a duplicate turn).
    pub dead_letters: u64,
    /// Requests the upstream answered with an error status (passed through, no event).
    pub upstream_errors: u64,
    /// Requests the upstream could not be reached for (502).
    pub upstream_unreachable: u64,
    /// Captured turns whose token ids/log-probs were invalid and dropped (event kept, with a note).
    pub token_rejected: u64,
    /// Events acknowledged by Kafka (direct or replayed).
    pub events_emitted: u64,
    /// Events written to the spool.
    pub events_spooled: u64,
    /// Spooled events replayed to Kafka.
    pub events_replayed: u64,
    /// Events lost (queue full, spool full, spool errors), all reasons.
    pub events_dropped: u64,
    /// Bytes in the spool now.
    pub spool_bytes: u64,
    /// Events in the spool now.
    pub spool_events: u64,
}

impl ProxyStats {
    /// Reads the counters from a proxy's metrics ([`Proxy::metrics`]).
    pub fn of(m: &Metrics) -> ProxyStats {
        ProxyStats {
            turns_captured: m.turns_of("captured"),
            dead_letters: m.turns_of("dead_letter"),
            upstream_errors: m.turns_of("upstream_error"),
            upstream_unreachable: m.turns_of("upstream_unreachable"),
            token_rejected: m.token_capture.get(&vec![("kind", "rejected".to_string())]).map(|c| c.get()).unwrap_or(0),
            events_emitted: m.emitted.get(),
            events_spooled: m.spooled.get(),
            events_replayed: m.replayed.get(),
            events_dropped: m.dropped_total(),
            spool_bytes: m.spool_bytes.get().max(0) as u64,
            spool_events: m.spool_events.get().max(0) as u64,
        }
    }
}

struct Shared {
    opts: ProxyOptions,
    base: String,
    client: reqwest::Client,
    rewrite: RewriteOptions,
    sessions: Mutex<Sessions>,
    emitter: EmitterHandle,
    metrics: Arc<Metrics>,
    interactions_topic: String,
    dead_letters_topic: String,
}

/// A running proxy: its routes, its emitter and its metrics.
pub struct Proxy {
    shared: Arc<Shared>,
    emitter: Emitter,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").field("upstream", &self.shared.base).finish()
    }
}

/// `http://h:p/`, `http://h:p/v1` → `http://h:p`.
fn upstream_base(url: &str) -> String {
    let t = url.trim().trim_end_matches('/');
    t.strip_suffix("/v1").unwrap_or(t).to_string()
}

impl Proxy {
    /// Opens the spool and starts the emitter on `bus` (which may be unreachable: see
    /// [`Bus::connect_lazy`]). Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Config`] for an upstream URL that is not `http(s)://…`, [`Error::Io`] when the spool
    /// folder cannot be opened, [`Error::Kafka`] when the producer cannot be created,
    /// [`Error::Http`] when the HTTP client cannot be built.
    pub async fn start(opts: ProxyOptions, bus: &Bus) -> Result<Proxy> {
        let base = upstream_base(&opts.upstream);
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(crate::config_err!("--upstream must be an http:// URL, got {:?}", opts.upstream));
        }
        let client = crate::net::client_builder()?
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.upstream_idle_timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| Error::Http(format!("http client: {}", crate::net::error_chain(&e))))?;
        let metrics = Arc::new(Metrics::new());
        let spool = Spool::open(opts.spool.clone()).await?;
        if !spool.is_empty() {
            tracing::info!(events = spool.events(), bytes = spool.bytes(), dir = %spool.dir().display(), "proxy: spool from an earlier run will be replayed");
        }
        let producer = bus.producer_with_timeout(opts.emitter.send_timeout, Duration::ZERO)?;
        let emitter = Emitter::start(producer, bus.clone(), vec![Interaction::NAME, DeadLetter::NAME], spool, metrics.clone(), opts.emitter.clone());
        let rewrite = RewriteOptions { default_turn_type: opts.default_turn_type, request_token_ids: opts.request_token_ids, logprobs_mode: opts.logprobs_mode.clone() };
        let shared = Arc::new(Shared {
            sessions: Mutex::new(Sessions::new(opts.session_capacity)),
            base,
            client,
            rewrite,
            emitter: emitter.handle(),
            metrics,
            interactions_topic: bus.topic(Interaction::NAME),
            dead_letters_topic: bus.topic(DeadLetter::NAME),
            opts,
        });
        Ok(Proxy { shared, emitter })
    }

    /// The routes: `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages`,
    /// `GET /v1/models`, `GET /health`, `GET /metrics`.
    pub fn router(&self) -> Router {
        Router::new()
            .route(Api::ChatCompletions.path(), post(chat_completions))
            .route(Api::Responses.path(), post(responses))
            .route(Api::Messages.path(), post(messages))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .layer(axum::middleware::from_fn_with_state(self.shared.clone(), auth_and_count))
            .layer(DefaultBodyLimit::max(self.shared.opts.max_body_bytes))
            .with_state(self.shared.clone())
    }

    /// The metrics registry.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        ProxyStats::of(&self.shared.metrics)
    }

    /// Serves on `listener` until `shutdown` resolves, then finishes requests in flight, delivers or
    /// spools every queued event and returns the final counters.
    ///
    /// # Errors
    /// [`Error::Http`] when the server fails.
    pub async fn serve(self, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<ProxyStats> {
        let app = self.router();
        let r = crate::net::serve_app(listener.into(), app, shutdown).await.map_err(|e| Error::Http(format!("proxy server: {e}")));
        let stats = self.shutdown().await;
        r.map(|_| stats)
    }

    /// Stops the emitter after it delivered or spooled every queued event; returns the final counters.
    pub async fn shutdown(self) -> ProxyStats {
        let Proxy { shared, emitter } = self;
        emitter.shutdown().await;
        ProxyStats::of(&shared.metrics)
    }
}

/// Runs a proxy on `listener` with events going to `bus` until `shutdown` resolves (see
/// [`Proxy::serve`]); for running the proxy as a task inside another command.
///
/// # Errors
/// As [`Proxy::start`] and [`Proxy::serve`].
pub async fn serve_proxy(opts: ProxyOptions, bus: Bus, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<ProxyStats> {
    Proxy::start(opts, &bus).await?.serve(listener, shutdown).await
}

fn api_error(status: StatusCode, message: &str, kind: &str) -> Response {
    (status, Json(error_body(message, kind, None))).into_response()
}

/// A 4xx for a refused request: `error.code` is the reason code.
fn rejected(s: &Shared, r: &capture::Rejected) -> Response {
    s.metrics.turn("bad_request");
    tracing::info!(code = r.code, reason = %r.message, "proxy: request refused");
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(error_body(&r.message, "invalid_request_error", Some(r.code)))).into_response()
}

/// Queues a dead letter of a turn the proxy could not record (counted as outcome `dead_letter`).
fn submit_dead(s: &Shared, d: &DeadLetter) {
    s.metrics.turn("dead_letter");
    tracing::warn!(code = %d.reason_code, reason = %d.reason, "proxy: turn sent to dead_letters");
    match Outgoing::of(s.dead_letters_topic.clone(), d) {
        Ok(o) => {
            s.emitter.submit(o);
        }
        Err(e) => {
            s.metrics.drop_event("serialize");
            tracing::error!(error = %e, "proxy: dead letter could not be serialised");
        }
    }
}

fn route_of(path: &str) -> &'static str {
    if let Some(api) = [Api::ChatCompletions, Api::Responses, Api::Messages].into_iter().find(|a| a.path() == path) {
        return api.route();
    }
    match path {
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        _ => "other",
    }
}

/// Header of Anthropic clients' API key (they send no bearer token).
const X_API_KEY: &str = "x-api-key";

/// Auth (constant-time) on every route but `/health`: `Authorization: Bearer KEY`, or `x-api-key:
/// KEY` as Anthropic clients send it; counts every response by route/status.
async fn auth_and_count(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let route = route_of(req.uri().path());
    if let Some(key) = &s.opts.api_key {
        if route != "health" {
            let h = req.headers();
            let bearer = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
            let x_key = h.get(X_API_KEY).and_then(|v| v.to_str().ok()).unwrap_or("");
            // Either header may carry the key (both compared, in constant time).
            let ok = bearer.as_bytes().ct_eq(key.as_bytes()) | x_key.as_bytes().ct_eq(key.as_bytes());
            if !bool::from(ok) {
                s.metrics.request(route, 401);
                return api_error(StatusCode::UNAUTHORIZED, "invalid or missing API key", "authentication_error");
            }
        }
    }
    let r = next.run(req).await;
    s.metrics.request(route, r.status().as_u16());
    r
}

/// The `Authorization` value for the upstream (see [`ProxyOptions::upstream_api_key`]).
fn upstream_auth(s: &Shared, client: &HeaderMap) -> Option<HeaderValue> {
    match (&s.opts.upstream_api_key, &s.opts.api_key) {
        (Some(k), _) => HeaderValue::from_str(&format!("Bearer {k}")).ok(),
        (None, None) => client.get(header::AUTHORIZATION).cloned(),
        (None, Some(_)) => None,
    }
}

/// Anthropic headers passed to the upstream as the client sent them (`anthropic-version`,
/// `anthropic-beta`, ...).
fn anthropic_headers(client: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    client.iter().filter(|(k, _)| k.as_str().starts_with("anthropic-"))
}

/// The upstream request's auth for `api`: a bearer token (chat, Responses), or for Messages the
/// `x-api-key` header: the configured upstream key, else the client's own `x-api-key` /
/// `Authorization` when the proxy has no key of its own.
fn with_auth(s: &Shared, api: Api, client: &HeaderMap, mut rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    if api != Api::Messages {
        if let Some(a) = upstream_auth(s, client) {
            rb = rb.header(header::AUTHORIZATION, a);
        }
        return rb;
    }
    for (k, v) in anthropic_headers(client) {
        rb = rb.header(k, v);
    }
    match (&s.opts.upstream_api_key, &s.opts.api_key) {
        (Some(k), _) => rb.header(X_API_KEY, k.as_str()),
        (None, None) => {
            for name in [HeaderName::from_static(X_API_KEY), header::AUTHORIZATION] {
                if let Some(v) = client.get(&name) {
                    rb = rb.header(name, v);
                }
            }
            rb
        }
        (None, Some(_)) => rb,
    }
}

/// Upstream response headers worth returning (hop-by-hop headers and the length are recomputed).
fn response_headers(up: &reqwest::header::HeaderMap) -> HeaderMap {
    const SKIP: [&str; 9] = ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "date"];
    let mut out = HeaderMap::new();
    for (k, v) in up {
        if !SKIP.contains(&k.as_str()) {
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(k.as_str().as_bytes()), HeaderValue::from_bytes(v.as_bytes())) {
                out.append(name, value);
            }
        }
    }
    out
}

fn respond(status: u16, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    *r.headers_mut() = headers;
    r
}

fn unreachable_error(s: &Shared, e: &reqwest::Error) -> Response {
    s.metrics.turn("upstream_unreachable");
    let what = if e.is_timeout() { "timed out" } else if e.is_connect() { "refused the connection" } else { "failed" };
    tracing::warn!(upstream = %s.base, error = %e, "proxy: upstream {what}");
    api_error(StatusCode::BAD_GATEWAY, &format!("upstream {} {what}: {e}", s.base), "upstream_error")
}

/// Records a finished turn: builds its row and queues it for Kafka (never waits).
fn capture(s: &Shared, req: &TurnRequest, resp: &Completed, header_version: Option<i64>) {
    let out = match build_interaction(req, resp, header_version, &s.sessions) {
        Captured::Turn(row, tokens) => {
            s.metrics.turn("captured");
            s.metrics.token_capture.get_or_create(&vec![("kind", tokens.kind().to_string())]).inc();
            if tokens.rejected {
                tracing::warn!(session = %row.session_id, turn = row.turn_index, notes = ?tokens.notes, "proxy: invalid token ids/log-probs dropped from the event");
            }
            Outgoing::of(s.interactions_topic.clone(), row.as_ref())
        }
        Captured::Dead(d) => return submit_dead(s, &d),
    };
    match out {
        Ok(o) => {
            s.emitter.submit(o);
        }
        Err(e) => {
            s.metrics.drop_event("serialize");
            tracing::error!(error = %e, "proxy: event could not be serialised");
        }
    }
}

async fn chat_completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::ChatCompletions, s, headers, body).await
}

async fn responses(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::Responses, s, headers, body).await
}

async fn messages(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::Messages, s, headers, body).await
}

/// The request side of a turn from a prepared request: for a chained Responses request, the chain's
/// history is put between the instructions and the new input.
fn turn_request(s: &Shared, api: Api, prepared: &capture::Prepared, received_ms: i64) -> TurnRequest {
    let mut messages = prepared.messages.clone();
    let mut input_start = prepared.instructions;
    let previous = prepared.previous_response_id.as_ref().map(|p| {
        let chain = s.sessions.lock().unwrap_or_else(|e| e.into_inner()).chain(p);
        if let Some(c) = &chain {
            let at = prepared.instructions.min(messages.len());
            messages.splice(at..at, c.history.iter().cloned());
            input_start += c.history.len();
        }
        (p.clone(), chain)
    });
    TurnRequest {
        meta: prepared.meta.clone(),
        messages,
        notes: prepared.notes.clone(),
        raw_messages: prepared.raw_messages.clone(),
        remember: prepared.store && api == Api::Responses,
        previous,
        input_start,
        tools: prepared.tools.clone(),
        model: prepared.model.clone(),
        received_ms,
    }
}

/// The upstream's policy version from the reloader's record ([`ProxyOptions::upstream_versions`]),
/// given the record `before` the request was sent; read when the turn is captured, so a reload that
/// started or ended meanwhile leaves it unknown.
fn reloaded_version(s: &Shared, before: Option<&crate::serve::reload::ServerVersion>, req: &TurnRequest) -> Option<i64> {
    s.opts.upstream_versions.as_ref()?.version_for(&s.base, before?, req.model.as_deref())
}

/// Forwards one request of `api` to the upstream and captures its turn (see the module docs).
async fn forward(api: Api, s: Arc<Shared>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let received_ms = now_ms();
    let raw = match body {
        Ok(b) => b,
        Err(e) => {
            s.metrics.turn("bad_request");
            let kind = if e.status() == StatusCode::PAYLOAD_TOO_LARGE { "invalid_request_error" } else { "server_error" };
            return api_error(e.status(), &e.body_text(), kind);
        }
    };
    let prepared = match prepare_request(api, &headers, &raw, &s.rewrite) {
        Ok(p) => p,
        Err(r) => return rejected(&s, &r),
    };
    // An explicit session and turn index that this proxy already captured: a duplicate turn.
    if let (Some(id), Some(turn)) = (&prepared.meta.session_id, prepared.meta.turn_index) {
        if s.sessions.lock().unwrap_or_else(|p| p.into_inner()).is_recorded(id, turn) {
            let message = format!("turn {turn} of session {id:?} was already captured by this proxy");
            return rejected(&s, &capture::Rejected { status: 409, code: "duplicate_turn", message });
        }
    }
    let req = turn_request(&s, api, &prepared, received_ms);
    let reloads_before = s.opts.upstream_versions.as_ref().map(|l| l.get(&s.base));
    let mut rb = s.client.post(format!("{}{}", s.base, api.path())).header(header::CONTENT_TYPE, "application/json").body(prepared.upstream_body);
    if prepared.stream {
        rb = rb.header(header::ACCEPT, "text/event-stream");
    }
    rb = with_auth(&s, api, &headers, rb);
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return unreachable_error(&s, &e),
    };
    let status = resp.status().as_u16();
    let header_version = resp.headers().get(VERSION_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<i64>().ok());
    let out_headers = response_headers(resp.headers());
    let is_sse = resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream"));
    if (200..300).contains(&status) && is_sse {
        let (tx, rx) = mpsc::channel::<std::result::Result<Bytes, Infallible>>(64);
        let turn = StreamedTurn { req, api, acc: Accumulator::new(api), strip: !prepared.client_wants_logprobs, header_version, reloads_before, t0 };
        tokio::spawn(pump_stream(s.clone(), resp, tx, turn));
        return respond(status, out_headers, Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    }
    let body = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => return unreachable_error(&s, &e),
    };
    if !(200..300).contains(&status) {
        s.metrics.turn("upstream_error");
        s.metrics.latency.observe(t0.elapsed().as_secs_f64());
        return respond(status, out_headers, Body::from(body));
    }
    let mut out = body.clone();
    match serde_json::from_slice::<Value>(&body) {
        Ok(mut v) => {
            match apis::completed(api, &v) {
                Ok(c) => capture(&s, &req, &c, header_version.or_else(|| reloaded_version(&s, reloads_before.as_ref(), &req))),
                Err(nt) => submit_dead(&s, &capture::dead_response(nt.code(), nt.reason(), &req, &body)),
            }
            if !prepared.client_wants_logprobs && strip_logprobs(&mut v) {
                match serde_json::to_vec(&v) {
                    Ok(b) => out = Bytes::from(b),
                    Err(e) => tracing::error!(error = %e, "proxy: re-serialising the response failed; returned it with log-probs"),
                }
            }
        }
        // Passed through unchanged (e.g. a `NaN` log-prob: clients whose parser accepts it still get
        // their answer); the turn becomes a dead letter.
        Err(e) => submit_dead(&s, &capture::dead_response("malformed_json", format!("upstream response of {} bytes is not JSON: {e}", body.len()), &req, &body)),
    }
    s.metrics.latency.observe(t0.elapsed().as_secs_f64());
    respond(status, out_headers, Body::from(out))
}

/// Feeds one SSE event to the accumulator; returns the bytes to forward to the client.
fn relay_event(acc: &mut Accumulator, ev: SseEvent, strip: bool) -> Vec<u8> {
    let Some(data) = &ev.data else { return ev.raw };
    if data.trim() == "[DONE]" {
        acc.done_marker();
        return ev.raw;
    }
    match serde_json::from_str::<Value>(data) {
        Ok(mut v) => {
            acc.push(&v);
            if strip && strip_logprobs(&mut v) {
                SseEvent::with_data(&v.to_string())
            } else {
                ev.raw
            }
        }
        Err(e) => {
            acc.unreadable_chunk(&e);
            ev.raw
        }
    }
}

/// A streamed turn being relayed: its request, the accumulator of its API, whether log-probs are
/// removed from what the client gets, the upstream's `X-Policy-Version` and when the request arrived.
struct StreamedTurn {
    req: TurnRequest,
    api: Api,
    acc: Accumulator,
    strip: bool,
    header_version: Option<i64>,
    /// The reloader's record of the upstream when the request was sent (see
    /// [`ProxyOptions::upstream_versions`]).
    reloads_before: Option<crate::serve::reload::ServerVersion>,
    t0: Instant,
}

/// Forwards an upstream SSE stream to the client as it arrives, assembling the turn on the way;
/// records the turn when the stream ends with a finish reason.
async fn pump_stream(s: Arc<Shared>, resp: reqwest::Response, tx: mpsc::Sender<std::result::Result<Bytes, Infallible>>, turn: StreamedTurn) {
    let StreamedTurn { req, api, mut acc, strip, header_version, reloads_before, t0 } = turn;
    let mut framer = SseFramer::default();
    let mut upstream = resp.bytes_stream();
    let mut failed: Option<&'static str> = None;
    // The stream's first bytes, for the dead letter of a stream that cannot be recorded.
    let mut head: Vec<u8> = vec![];
    'read: while let Some(chunk) = upstream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "proxy: upstream stream broke off");
                // In the API's own error shape, after a blank line that ends any event cut mid-way.
                let mut out = if framer.has_partial() { b"\n\n".to_vec() } else { vec![] };
                out.extend(api.stream_error_event(&format!("upstream stream failed: {e}")));
                let _ = tx.send(Ok(Bytes::from(out))).await;
                failed = Some("upstream_error");
                break;
            }
        };
        head.extend_from_slice(&chunk[..chunk.len().min((64usize << 10).saturating_sub(head.len()))]);
        let events = framer.push(&chunk);
        if strip {
            for ev in events {
                let out = relay_event(&mut acc, ev, true);
                if tx.send(Ok(Bytes::from(out))).await.is_err() {
                    failed = Some("client_disconnected");
                    break 'read;
                }
            }
        } else {
            // Forward the bytes as received (no waiting for event boundaries), then assemble.
            if tx.send(Ok(chunk)).await.is_err() {
                failed = Some("client_disconnected");
                break;
            }
            for ev in events {
                relay_event(&mut acc, ev, false);
            }
        }
    }
    if failed.is_none() {
        if let Some(ev) = framer.finish() {
            let out = relay_event(&mut acc, ev, strip);
            if strip && tx.send(Ok(Bytes::from(out))).await.is_err() {
                failed = Some("client_disconnected");
            }
        }
    }
    // Dropping the upstream stream closes its connection: the upstream stops generating.
    drop(upstream);
    s.metrics.latency.observe(t0.elapsed().as_secs_f64());
    match failed {
        Some(outcome) => s.metrics.turn(outcome),
        None => match acc.finish() {
            Ok(c) => capture(&s, &req, &c, header_version.or_else(|| reloaded_version(&s, reloads_before.as_ref(), &req))),
            // The upstream's own error: passed to the client, counted, no dead letter (as an error status).
            Err(nt @ NoTurn::StreamError(_)) => {
                tracing::warn!(reason = ?nt, "proxy: stream ended without a turn to record");
                s.metrics.turn(nt.code());
            }
            Err(nt) => submit_dead(&s, &capture::dead_response(nt.code(), nt.reason(), &req, &head)),
        },
    }
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let rb = s.client.get(format!("{}/v1/models", s.base));
    // Anthropic clients list models with their own headers.
    let anthropic = headers.contains_key(X_API_KEY) || headers.contains_key("anthropic-version");
    let rb = with_auth(&s, if anthropic { Api::Messages } else { Api::ChatCompletions }, &headers, rb);
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return api_error(StatusCode::BAD_GATEWAY, &format!("upstream {}: {e}", s.base), "upstream_error"),
    };
    let status = resp.status().as_u16();
    let h = response_headers(resp.headers());
    match resp.bytes().await {
        Ok(b) => respond(status, h, Body::from(b)),
        Err(e) => api_error(StatusCode::BAD_GATEWAY, &format!("upstream {}: {e}", s.base), "upstream_error"),
    }
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    let mut rb = s.client.get(format!("{}/v1/models", s.base)).timeout(Duration::from_secs(2));
    if let Some(k) = &s.opts.upstream_api_key {
        rb = rb.bearer_auth(k);
    }
    let t = Instant::now();
    let (reachable, up_status, error) = match rb.send().await {
        Ok(r) => (true, Some(r.status().as_u16()), None),
        Err(e) => (false, None, Some(e.to_string())),
    };
    let m = &s.metrics;
    let st = ProxyStats::of(m);
    let kafka_up = m.kafka_up.get() == 1;
    let status = if !reachable {
        "upstream_unreachable"
    } else if !kafka_up {
        "spooling"
    } else {
        "ok"
    };
    let body = json!({
        "status": status,
        "version": env!("CARGO_PKG_VERSION"),
        "upstream": {"url": s.base, "reachable": reachable, "status": up_status, "latency_ms": t.elapsed().as_secs_f64() * 1e3, "error": error},
        "kafka_up": kafka_up,
        "spool": {"dir": s.opts.spool.dir, "bytes": st.spool_bytes, "events": st.spool_events, "max_bytes": s.opts.spool.max_bytes},
        "events": {"emitted": st.events_emitted, "spooled": st.events_spooled, "replayed": st.events_replayed, "dropped": st.events_dropped},
        "turns": {"captured": st.turns_captured, "dead_letters": st.dead_letters, "upstream_errors": st.upstream_errors,
            "upstream_unreachable": st.upstream_unreachable, "token_rejected": st.token_rejected},
    });
    let code = if reachable { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

async fn metrics_text(State(s): State<Arc<Shared>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render()).into_response()
}

/// `nextstate proxy`: the capture proxy.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Upstream OpenAI-compatible server (ours, vLLM, SGLang), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub upstream: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` from clients on every route but /health.
    #[arg(long, env = "NEXTSTATE_PROXY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Name of the environment variable holding the upstream's API key.
    #[arg(long)]
    pub upstream_api_key_env: Option<String>,
    /// Turn type of requests that do not mark it (main = trainable; METHOD.md §1).
    #[arg(long, default_value = "main")]
    pub default_turn_type: String,
    /// Folder of the spool that holds events while Kafka is unavailable.
    #[arg(long, default_value = ".cache/proxy-spool")]
    pub spool_dir: PathBuf,
    /// Most bytes the spool may hold; events beyond are dropped and counted.
    #[arg(long, default_value_t = 256 << 20)]
    pub spool_max_bytes: u64,
    /// Largest accepted request body, bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Milliseconds Kafka may take to acknowledge an event before it is spooled.
    #[arg(long, default_value_t = 5000)]
    pub send_timeout_ms: u64,
    /// Seconds the upstream may stay silent (before headers or between chunks).
    #[arg(long, default_value_t = 600)]
    pub upstream_timeout_s: u64,
    /// Do not add `return_token_ids: true` to upstream requests.
    #[arg(long)]
    pub no_return_token_ids: bool,
    /// `logprobs_mode` to send upstream when the client sends none (raw or sampling; ours only).
    #[arg(long)]
    pub upstream_logprobs_mode: Option<String>,
    /// Kafka bootstrap servers (HOST:PORT,...). Without it: an embedded in-process mock cluster
    /// (then the lake sink runs in this process).
    #[arg(long, env = "NEXTSTATE_BROKERS")]
    pub brokers: Option<String>,
    /// Prefix of every topic name.
    #[arg(long, env = "NEXTSTATE_TOPIC_PREFIX", default_value = "")]
    pub topic_prefix: String,
    /// Also write `interactions` and `dead_letters` to this lake from this process (always on with
    /// the embedded bus, default ./lake).
    #[arg(long, env = "NEXTSTATE_LAKE")]
    pub lake: Option<PathBuf>,
    /// A librdkafka setting for the cluster at --brokers, `KEY=VALUE` (repeatable), e.g.
    /// `security.protocol=SASL_SSL` ([bus.properties] of a pipeline).
    #[arg(long = "kafka-property", value_parser = crate::net::parse_key_value)]
    pub kafka_properties: Vec<(String, String)>,
    /// A librdkafka setting whose value is read from an environment variable, `KEY=VARIABLE`
    /// (repeatable), e.g. `sasl.password=KAFKA_PASSWORD` ([bus.secret_env]).
    #[arg(long = "kafka-secret-env", value_parser = crate::net::parse_key_value)]
    pub kafka_secret_env: Vec<(String, String)>,
    /// Extra CA certificates (PEM) trusted for an https upstream, besides the platform's roots and
    /// `SSL_CERT_FILE`.
    #[arg(long, env = "NEXTSTATE_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// https instead of http for clients of the proxy.
    #[command(flatten)]
    pub tls: crate::net::ListenTlsArgs,
}

impl ProxyArgs {
    /// The library options these flags describe.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad turn type, logprobs mode, or a missing upstream key variable.
    pub fn options(&self) -> Result<ProxyOptions> {
        let mut o = ProxyOptions::new(self.upstream.clone());
        o.api_key = self.api_key.clone().filter(|k| !k.is_empty());
        if let Some(name) = &self.upstream_api_key_env {
            o.upstream_api_key = Some(std::env::var(name).map_err(|_| crate::config_err!("--upstream-api-key-env {name}: variable not set"))?);
        }
        o.default_turn_type = TurnType::parse(&self.default_turn_type).ok_or_else(|| crate::config_err!("--default-turn-type must be main or side, got {:?}", self.default_turn_type))?;
        o.spool = SpoolConfig::new(self.spool_dir.clone(), self.spool_max_bytes);
        o.emitter.send_timeout = Duration::from_millis(self.send_timeout_ms.max(1));
        o.max_body_bytes = self.max_body_bytes;
        o.upstream_idle_timeout = Duration::from_secs(self.upstream_timeout_s.max(1));
        o.request_token_ids = !self.no_return_token_ids;
        if let Some(m) = &self.upstream_logprobs_mode {
            if m != "raw" && m != "sampling" {
                return Err(crate::config_err!("--upstream-logprobs-mode {m:?} (raw or sampling)"));
            }
            o.logprobs_mode = Some(m.clone());
        }
        Ok(o)
    }

    /// Runs the proxy until Ctrl-C / SIGTERM (own tokio runtime).
    ///
    /// # Errors
    /// [`Error::Config`] for bad flags, [`Error::Io`] when the port cannot be bound, start errors of
    /// [`Proxy::start`].
    pub fn run(self) -> Result<()> {
        crate::net::TlsConfig { ca_file: self.ca_file.clone() }.apply()?;
        let opts = self.options()?;
        let tls = self.tls.server_tls()?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| Error::io("tokio runtime", "-", e))?;
        rt.block_on(async move {
            let cfg = BusConfig {
                brokers: self.brokers.clone(),
                topic_prefix: self.topic_prefix.clone(),
                properties: self.kafka_properties.iter().cloned().collect(),
                secret_env: self.kafka_secret_env.iter().cloned().collect(),
                ..BusConfig::default()
            };
            cfg.validate()?;
            let bus = match &cfg.brokers {
                None => Bus::connect(cfg.clone()).await?,
                Some(b) => match Bus::connect(cfg.clone()).await {
                    Ok(bus) => bus,
                    Err(e) => {
                        tracing::warn!(brokers = %b, error = %e, "Kafka unreachable at start; serving anyway and spooling events until it is back");
                        Bus::connect_lazy(cfg.clone())?
                    }
                },
            };
            let stop = crate::runtime::Stop::default();
            stop.on_signals();
            // The lake sinks stop once the proxy has drained its events and they have caught up.
            let (sink_stop, proxy_done) = (crate::runtime::Stop::default(), crate::runtime::DoneFlag::default());
            let lake = match (&self.lake, bus.is_embedded()) {
                (Some(l), _) => Some(l.clone()),
                (None, true) => Some(PathBuf::from("lake")),
                (None, false) => None,
            };
            let mut sinks = vec![];
            if let Some(dir) = &lake {
                let lake = crate::lake::Lake::open(dir)?;
                let sc = crate::lake::sink::SinkConfig::default();
                for table in [Interaction::NAME, DeadLetter::NAME] {
                    bus.expect_consumer(&crate::stages::run::sink_group(&bus, &sc, table), table);
                }
                bus.ensure_topics(&[Interaction::NAME, DeadLetter::NAME]).await?;
                let dl = bus.producer()?;
                for table in [Interaction::NAME, DeadLetter::NAME] {
                    let ctl = crate::runtime::TaskCtl::new(&format!("sink:{table}"), true, sink_stop.clone()).after(&proxy_done);
                    let (bus, lake, sc, dl) = (bus.clone(), lake.clone(), sc.clone(), dl.clone());
                    sinks.push((table, tokio::spawn(async move { crate::stages::run::spawn_sink(table, &bus, &lake, &sc, &ctl, (table != DeadLetter::NAME).then_some(&dl)).await })));
                }
                tracing::info!(lake = %dir.display(), "proxy: writing interactions and dead_letters to the lake");
            }
            let listener = crate::net::Listener::bind(&self.host, self.port, tls.as_ref()).await?;
            let addr = listener.url()?;
            tracing::info!(
                "capture proxy on {addr} → {} (auth {}, default turn type {}, events to {})",
                upstream_base(&opts.upstream),
                if opts.api_key.is_some() { "on" } else { "off" },
                opts.default_turn_type.as_str(),
                if bus.is_embedded() { "the embedded bus".to_string() } else { bus.bootstrap().to_string() }
            );
            let mut wait = stop.clone();
            let served = serve_proxy(opts, bus, listener, async move { wait.wait().await }).await;
            proxy_done.set();
            if served.is_err() {
                sink_stop.request();
            }
            let stats = served?;
            for (table, h) in sinks {
                match h.await {
                    Ok(Ok(st)) => tracing::info!(table, rows = st.rows_written, files = st.files, "lake sink finished"),
                    Ok(Err(e)) => tracing::error!(table, error = %e, "lake sink failed"),
                    Err(e) => tracing::error!(table, error = %e, "lake sink task failed"),
                }
            }
            println!(
                "proxy: turns_captured={} dead_letters={} upstream_errors={} events_emitted={} events_spooled={} events_dropped={} spool_events={}",
                stats.turns_captured, stats.dead_letters, stats.upstream_errors, stats.events_emitted, stats.events_spooled, stats.events_dropped, stats.spool_events
            );
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_are_normalised() {
        assert_eq!(upstream_base("http://h:1/"), "http://h:1");
        assert_eq!(upstream_base("http://h:1/v1/"), "http://h:1");
        assert_eq!(upstream_base(" http://h:1/v1"), "http://h:1");
        assert_eq!(upstream_base("http://h:1/api"), "http://h:1/api");
    }

    #[test]
    fn routes_for_metrics() {
        assert_eq!(route_of("/v1/chat/completions"), "chat_completions");
        assert_eq!(route_of("/nope"), "other");
    }
}
