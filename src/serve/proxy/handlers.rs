//! The capture proxy's HTTP handlers: auth and request counting, the capture routes (one request
//! forwarded upstream and its turn captured), `/v1/models`, `/health`, `/metrics`, and the JSON 404 /
//! 405 of anything else. The proxy's own errors come in the client's API's error shape
//! ([`Api::error_body`]); upstream URLs in them are redacted ([`crate::net::redact_url`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;

use super::apis::{self, Api};
use super::background::{self, Pending};
use super::capture::{self, TurnRequest};
use super::metrics::ProxyStats;
use super::relay::{pump_stream, BackgroundStream, StreamedTurn};
use super::request::{prepare_request, strip_logprobs, Rejected};
use super::state::{capture, hold_background, reloaded_version, submit_dead, take_background, turn_request, Shared};
use super::streams::Accumulator;
use super::upstream::{respond, response_headers, with_auth, X_API_KEY};
use crate::net::redact_url;
use crate::schema::now_ms;
use crate::serve::VERSION_HEADER;

/// The header that carries a turn's tenant to the upstream (when not the default tenant).
const TENANT_UPSTREAM_HEADER: &str = "x-agent-id";

/// A JSON error answer of the proxy itself, in `api`'s error shape.
fn api_error(api: Api, status: StatusCode, message: &str, kind: &str, code: Option<&str>) -> Response {
    (status, Json(api.error_body(status.as_u16(), message, kind, code))).into_response()
}

/// The API whose error shape a request's client reads: Messages for `/v1/messages` and for requests
/// with Anthropic's headers (`anthropic-version`, `x-api-key`), Responses for `/v1/responses`, else
/// chat completions.
fn client_api(path: &str, headers: &HeaderMap) -> Api {
    match path {
        p if p == Api::Messages.path() => Api::Messages,
        p if p == Api::Responses.path() => Api::Responses,
        _ if headers.contains_key("anthropic-version") || headers.contains_key(X_API_KEY) => Api::Messages,
        _ => Api::ChatCompletions,
    }
}

/// A 4xx for a refused request: `error.code` is the reason code.
fn rejected(s: &Shared, api: Api, r: &Rejected) -> Response {
    s.metrics.turn("bad_request");
    tracing::info!(code = r.code, reason = %r.message, "proxy: request refused");
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    api_error(api, status, &r.message, "invalid_request_error", Some(r.code))
}

/// The metrics label of a request path.
fn route_of(path: &str) -> &'static str {
    if let Some(api) = [Api::ChatCompletions, Api::Responses, Api::Messages].into_iter().find(|a| a.path() == path) {
        return api.route();
    }
    match path {
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        "/v1/messages/count_tokens" => "count_tokens",
        p if p.starts_with("/v1/responses/") => "responses_stored",
        _ => "other",
    }
}

/// Auth (constant-time) on every route but `/health` (and on `/health` too with
/// [`super::ProxyOptions::health_requires_key`]): `Authorization: Bearer KEY` (the scheme in any
/// case), or `x-api-key: KEY` as Anthropic clients send it; a body that missed the listener's
/// deadline ([`crate::net::BodyTimedOut`]) answered 408 in the API's shape; counts every response by
/// route/status.
pub(super) async fn auth_and_count(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let route = route_of(req.uri().path());
    let api = client_api(req.uri().path(), req.headers());
    if let Some(key) = &s.opts.api_key {
        if route != "health" || s.opts.health_requires_key {
            let h = req.headers();
            let bearer = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(crate::net::bearer_token).unwrap_or("");
            let x_key = h.get(X_API_KEY).and_then(|v| v.to_str().ok()).unwrap_or("");
            // Either header may carry the key (both compared, in constant time).
            let ok = bearer.as_bytes().ct_eq(key.as_bytes()) | x_key.as_bytes().ct_eq(key.as_bytes());
            if !bool::from(ok) {
                s.metrics.request(route, 401);
                return api_error(api, StatusCode::UNAUTHORIZED, "invalid or missing API key", "authentication_error", None);
            }
        }
    }
    let timed_out = req.extensions().get::<crate::net::BodyTimedOut>().cloned();
    let mut r = next.run(req).await;
    if timed_out.is_some_and(|t| t.fired()) {
        let limit = s.opts.limits.body_read_timeout.as_secs_f64();
        tracing::info!(route, "proxy: request body not received within {limit:.1} s; connection closed");
        r = api_error(api, StatusCode::REQUEST_TIMEOUT, &format!("request body not received within {limit:.1} s"), "invalid_request_error", Some("body_timeout"));
    }
    s.metrics.request(route, r.status().as_u16());
    r
}

/// Fallback of unknown paths: a JSON 404 in the client's API's shape, naming the routes there are.
pub(super) async fn not_found(req: Request) -> Response {
    let api = client_api(req.uri().path(), req.headers());
    let message = format!(
        "no route {} {}: the proxy serves POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, GET /v1/models, GET /health, GET /metrics",
        req.method(),
        req.uri().path()
    );
    api_error(api, StatusCode::NOT_FOUND, &message, "invalid_request_error", Some("unknown_route"))
}

/// Fallback of a known path asked with the wrong method: a JSON 405 in the client's API's shape.
pub(super) async fn method_not_allowed(req: Request) -> Response {
    let api = client_api(req.uri().path(), req.headers());
    let message = format!("method {} not allowed on {}", req.method(), req.uri().path());
    api_error(api, StatusCode::METHOD_NOT_ALLOWED, &message, "invalid_request_error", Some("method_not_allowed"))
}

/// What went wrong reaching the upstream, for logs and the 502: its `error.code`
/// (`upstream_tls_error`, `upstream_timeout`, `upstream_unreachable`, `upstream_failed`) and message. A
/// TLS failure names TLS and its reason (`invalid peer certificate: UnknownIssuer`, ...); every message
/// carries the whole error chain (the OS error: connection refused, DNS, ...) and the upstream URL
/// redacted.
fn upstream_failure(base: &str, e: &reqwest::Error) -> (&'static str, String) {
    let chain = crate::net::error_chain(e);
    let (code, message) = if crate::net::is_tls_error(e) {
        ("upstream_tls_error", format!("TLS connection to upstream {base} failed: {chain}"))
    } else if e.is_timeout() {
        ("upstream_timeout", format!("upstream {base} timed out: {chain}"))
    } else if e.is_connect() {
        ("upstream_unreachable", format!("could not connect to upstream {base}: {chain}"))
    } else {
        ("upstream_failed", format!("upstream {base} failed: {chain}"))
    };
    (code, redact_url(&message))
}

/// The 502 for a failed upstream call, logged with `context` before the message
/// ([`upstream_failure`]).
fn upstream_error(s: &Shared, api: Api, e: &reqwest::Error, context: &str) -> Response {
    let (code, message) = upstream_failure(&s.base, e);
    tracing::warn!(upstream = %redact_url(&s.base), code, "proxy: {context}{message}");
    api_error(api, StatusCode::BAD_GATEWAY, &message, "upstream_error", Some(code))
}

/// The 502 for an upstream that could not be reached (counted as outcome `upstream_unreachable`).
fn unreachable_error(s: &Shared, api: Api, e: &reqwest::Error) -> Response {
    s.metrics.turn("upstream_unreachable");
    upstream_error(s, api, e, "")
}

/// The upstream's `X-Policy-Version` header as a version number, if present and numeric.
fn policy_version_header(h: &reqwest::header::HeaderMap) -> Option<i64> {
    h.get(VERSION_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<i64>().ok())
}

/// Whether an upstream answer is a server-sent event stream (`Content-Type: text/event-stream`).
fn is_event_stream(h: &reqwest::header::HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream"))
}

/// `POST /v1/chat/completions`: forwarded and captured.
pub(super) async fn chat_completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::ChatCompletions, s, headers, body).await
}

/// `POST /v1/responses`: forwarded and captured.
pub(super) async fn responses(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::Responses, s, headers, body).await
}

/// `POST /v1/messages`: forwarded and captured.
pub(super) async fn messages(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    forward(Api::Messages, s, headers, body).await
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
            return api_error(api, e.status(), &e.body_text(), kind, None);
        }
    };
    let prepared = match prepare_request(api, &headers, &raw, &s.rewrite) {
        Ok(p) => p,
        Err(r) => return rejected(&s, api, &r),
    };
    // An explicit session and turn index that this proxy already captured: a duplicate turn.
    if let (Some(id), Some(turn)) = (&prepared.meta.session_id, prepared.meta.turn_index) {
        if s.sessions.lock().unwrap_or_else(|p| p.into_inner()).is_recorded(&prepared.meta.tenant, id, turn) {
            let message = format!("turn {turn} of session {id:?} was already captured by this proxy");
            return rejected(&s, api, &Rejected { status: 409, code: "duplicate_turn", message });
        }
    }
    let req = turn_request(&s, api, &prepared, received_ms);
    let reloads_before = s.opts.upstream_versions.as_ref().map(|l| l.get(&s.base));
    let mut rb = s.client.post(format!("{}{}", s.base, api.path())).header(header::CONTENT_TYPE, "application/json").body(prepared.upstream_body);
    if prepared.stream {
        rb = rb.header(header::ACCEPT, "text/event-stream");
    }
    rb = with_auth(&s.opts, api, &headers, rb);
    // The turn's tenant goes upstream as `X-Agent-Id`, so a policy server holding per-tenant adapters
    // (`nextstate serve`, docs/tenants.md) answers with the tenant's own; other servers ignore it
    // (`forward_tenant = false` keeps it from a third-party API).
    if s.opts.forward_tenant && prepared.meta.tenant != crate::schema::DEFAULT_TENANT {
        rb = rb.header(TENANT_UPSTREAM_HEADER, prepared.meta.tenant.as_str());
    }
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return unreachable_error(&s, api, &e),
    };
    let status = resp.status().as_u16();
    let header_version = policy_version_header(resp.headers());
    let out_headers = response_headers(resp.headers());
    let is_sse = is_event_stream(resp.headers());
    if (200..300).contains(&status) && is_sse {
        let (tx, rx) = mpsc::channel::<std::result::Result<Bytes, Infallible>>(64);
        let background = prepared.background.then(|| BackgroundStream { id: None, bytes: raw.len(), created_version: None });
        let turn = StreamedTurn { req, api, acc: Accumulator::new(api), strip: !prepared.client_wants_logprobs, header_version, reloads_before, t0, background };
        tokio::spawn(pump_stream(s.clone(), resp, tx, turn));
        return respond(status, out_headers, Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    }
    let body = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => return unreachable_error(&s, api, &e),
    };
    if !(200..300).contains(&status) {
        s.metrics.turn("upstream_error");
        s.metrics.latency.observe(t0.elapsed().as_secs_f64());
        return respond(status, out_headers, Body::from(body));
    }
    let parsed = serde_json::from_slice::<Value>(&body);
    // A background response answers at once, still running: its turn waits for a later fetch.
    let running = parsed.as_ref().ok().filter(|_| prepared.background).and_then(background::running_id).map(str::to_string);
    let out = match running {
        Some(id) => {
            hold_background(&s, &id, Pending { req, reloads_before, header_version, bytes: raw.len() });
            body
        }
        None => {
            let version = header_version.or_else(|| reloaded_version(&s, reloads_before.as_ref(), &req));
            record(&s, api, &req, body, parsed, version, !prepared.client_wants_logprobs)
        }
    };
    s.metrics.latency.observe(t0.elapsed().as_secs_f64());
    respond(status, out_headers, Body::from(out))
}

/// Records the turn of a 2xx JSON answer `body` (`parsed`: it read as JSON) to `req`: its row, or
/// its dead letter when it cannot be recorded (`malformed_json` for a body that is not JSON: passed
/// through unchanged, e.g. a `NaN` log-prob that clients whose parser accepts it still read). Returns
/// the bytes for the client: `body`, re-serialised without log-probs when `strip`.
fn record(s: &Shared, api: Api, req: &TurnRequest, body: Bytes, parsed: serde_json::Result<Value>, version: Option<i64>, strip: bool) -> Bytes {
    let mut v = match parsed {
        Ok(v) => v,
        Err(e) => {
            submit_dead(s, &capture::dead_response("malformed_json", format!("upstream response of {} bytes is not JSON: {e}", body.len()), req, &body));
            return body;
        }
    };
    match apis::completed(api, &v) {
        Ok(c) => capture(s, req, &c, version),
        Err(nt) => submit_dead(s, &capture::dead_response(nt.code(), nt.reason(), req, &body)),
    }
    if strip && strip_logprobs(&mut v) {
        match serde_json::to_vec(&v) {
            Ok(b) => return Bytes::from(b),
            Err(e) => tracing::error!(error = %e, "proxy: re-serialising the response failed; returned it with log-probs"),
        }
    }
    body
}

/// The paths passed through without capture ([`pass_through`]), as axum routes.
pub(super) const PASS_THROUGH: [&str; 4] = ["/v1/messages/count_tokens", "/v1/responses/{id}", "/v1/responses/{id}/cancel", "/v1/responses/{id}/input_items"];

/// A request the proxy forwards but does not capture, passed to the upstream as it came — method, path
/// and query, body, content type, and the API's authentication and headers ([`with_auth`]) — and its
/// answer returned as it is: `POST /v1/messages/count_tokens` (Claude Code counts tokens before a
/// turn), `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `GET
/// /v1/responses/{id}/input_items` (the Responses API's stored and background responses). Nothing is
/// recorded, except the turn of a background response this proxy holds ([`super::background`]): a
/// fetch or cancel that returns it finished records it ([`fetch_background`]).
pub(super) async fn pass_through(State(s): State<Arc<Shared>>, method: axum::http::Method, uri: axum::http::Uri, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Response {
    let api = if uri.path().starts_with(Api::Messages.path()) { Api::Messages } else { Api::Responses };
    let raw = match body {
        Ok(b) => b,
        Err(e) => {
            let kind = if e.status() == StatusCode::PAYLOAD_TOO_LARGE { "invalid_request_error" } else { "server_error" };
            return api_error(api, e.status(), &e.body_text(), kind, None);
        }
    };
    let target = format!("{}{}", s.base, uri.path_and_query().map(|p| p.as_str()).unwrap_or(uri.path()));
    let Ok(m) = reqwest::Method::from_bytes(method.as_str().as_bytes()) else {
        return api_error(api, StatusCode::METHOD_NOT_ALLOWED, "method not allowed", "invalid_request_error", None);
    };
    let mut rb = s.client.request(m, target);
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        rb = rb.header(header::CONTENT_TYPE, ct);
    }
    if !raw.is_empty() {
        rb = rb.body(raw);
    }
    let rb = with_auth(&s.opts, api, &headers, rb);
    if let Some((id, _)) = background::fetched_id(uri.path()) {
        if s.background.lock().unwrap_or_else(|e| e.into_inner()).is_pending(id) {
            return fetch_background(&s, id, rb).await;
        }
    }
    relay_whole(&s, api, rb, &format!("{}: ", uri.path())).await
}

/// A fetch (`GET /v1/responses/{id}`, plain or `?stream=true`) or cancel of background response `id`
/// whose turn this proxy holds: the answer is returned as it came, and the turn is recorded once the
/// response is finished — from the JSON response object, or from a stream's terminal event
/// ([`pump_stream`], which holds the turn again when the stream ends before that). A response still
/// `queued` / `in_progress`, another error status or a failed call keeps the turn held; a
/// `cancelled` response ends it (outcome `background_cancelled`), and so does a 404 or 410 (the
/// upstream no longer has it: `background_not_found`); a `failed` one becomes a dead letter
/// (`api_error`), as when answered at once. The turn's version is the create call's
/// `X-Policy-Version` when the fetch's agrees ([`background::version_of`]).
async fn fetch_background(s: &Arc<Shared>, id: &str, rb: reqwest::RequestBuilder) -> Response {
    let api = Api::Responses;
    let t0 = Instant::now();
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return upstream_error(s, api, &e, &format!("/v1/responses/{id}: ")),
    };
    let status = resp.status().as_u16();
    let header_version = policy_version_header(resp.headers());
    let out_headers = response_headers(resp.headers());
    let is_sse = is_event_stream(resp.headers());
    let ok = (200..300).contains(&status);
    if ok && is_sse {
        if let Some(p) = take_background(s, id) {
            let (tx, rx) = mpsc::channel::<std::result::Result<Bytes, Infallible>>(64);
            let background = Some(BackgroundStream { id: Some(id.to_string()), bytes: p.bytes, created_version: p.header_version });
            let turn = StreamedTurn { req: p.req, api, acc: Accumulator::new(api), strip: false, header_version, reloads_before: p.reloads_before, t0, background };
            tokio::spawn(pump_stream(s.clone(), resp, tx, turn));
            return respond(status, out_headers, Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
        }
        // Another fetch took the turn meanwhile: this stream is only relayed.
        return respond(status, out_headers, Body::from_stream(resp.bytes_stream()));
    }
    let body = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => return upstream_error(s, api, &e, &format!("/v1/responses/{id}: ")),
    };
    if status == 404 || status == 410 {
        if take_background(s, id).is_some() {
            s.metrics.turn("background_not_found");
            tracing::warn!(response = id, status, "proxy: the upstream no longer has a pending background response; its turn is not recorded");
        }
        return respond(status, out_headers, Body::from(body));
    }
    if !ok {
        return respond(status, out_headers, Body::from(body));
    }
    let parsed = serde_json::from_slice::<Value>(&body);
    if parsed.as_ref().is_ok_and(|v| background::running_id(v).is_some()) {
        return respond(status, out_headers, Body::from(body));
    }
    let Some(p) = take_background(s, id) else {
        // Another fetch recorded it meanwhile.
        return respond(status, out_headers, Body::from(body));
    };
    if parsed.as_ref().is_ok_and(|v| v.get("status").and_then(Value::as_str) == Some("cancelled")) {
        s.metrics.turn("background_cancelled");
        tracing::info!(response = id, "proxy: background response cancelled; no turn recorded");
        return respond(status, out_headers, Body::from(body));
    }
    let version = background::version_of(p.header_version, header_version).or_else(|| reloaded_version(s, p.reloads_before.as_ref(), &p.req));
    let out = record(s, api, &p.req, body, parsed, version, false);
    respond(status, out_headers, Body::from(out))
}

/// Sends `rb` upstream and returns its answer (status, headers, body: whole, or relayed as it arrives
/// for an event stream), or the 502 of a failed call in `api`'s error shape (`context` starts the log
/// line).
async fn relay_whole(s: &Shared, api: Api, rb: reqwest::RequestBuilder, context: &str) -> Response {
    let failed = |e: reqwest::Error| upstream_error(s, api, &e, context);
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let status = resp.status().as_u16();
    let h = response_headers(resp.headers());
    // A stream (e.g. a resumed `GET /v1/responses/{id}?stream=true`) is relayed as it arrives.
    if is_event_stream(resp.headers()) {
        return respond(status, h, Body::from_stream(resp.bytes_stream()));
    }
    match resp.bytes().await {
        Ok(b) => respond(status, h, Body::from(b)),
        Err(e) => failed(e),
    }
}

/// `GET /v1/models`: the upstream's list, passed through.
pub(super) async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let rb = s.client.get(format!("{}/v1/models", s.base));
    // Anthropic clients list models with their own headers.
    let api = client_api("/v1/models", &headers);
    let rb = with_auth(&s.opts, api, &headers, rb);
    relay_whole(&s, api, rb, "/v1/models: ").await
}

/// `GET /health`: upstream reachability, Kafka state and the counters (503 while the upstream is
/// unreachable).
pub(super) async fn health(State(s): State<Arc<Shared>>) -> Response {
    let mut rb = s.client.get(format!("{}/v1/models", s.base)).timeout(Duration::from_secs(2));
    if let Some(k) = &s.opts.upstream_api_key {
        rb = rb.bearer_auth(k);
    }
    let t = Instant::now();
    let (reachable, up_status, error) = match rb.send().await {
        Ok(r) => (true, Some(r.status().as_u16()), None),
        Err(e) => (false, None, Some(upstream_failure(&s.base, &e).1)),
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
        "upstream": {"url": redact_url(&s.base), "reachable": reachable, "status": up_status, "latency_ms": t.elapsed().as_secs_f64() * 1e3, "error": error},
        "kafka_up": kafka_up,
        "spool": {"dir": s.opts.spool.dir, "bytes": st.spool_bytes, "events": st.spool_events, "max_bytes": s.opts.spool.max_bytes},
        "events": {"emitted": st.events_emitted, "spooled": st.events_spooled, "replayed": st.events_replayed, "dropped": st.events_dropped},
        "turns": {"captured": st.turns_captured, "dead_letters": st.dead_letters, "upstream_errors": st.upstream_errors,
            "upstream_unreachable": st.upstream_unreachable, "token_rejected": st.token_rejected},
    });
    let code = if reachable { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

/// `GET /metrics`: the OpenMetrics text exposition.
pub(super) async fn metrics_text(State(s): State<Arc<Shared>>) -> Response {
    // The proxy's own families, then the process-wide ones ([`crate::metrics`]), one `# EOF` at the end.
    let body = crate::metrics::join(&[s.metrics.render(), crate::metrics::encode()]);
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shape_follows_the_client() {
        let mut h = HeaderMap::new();
        assert_eq!(client_api("/v1/messages", &h), Api::Messages);
        assert_eq!(client_api("/nope", &h), Api::ChatCompletions);
        h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        assert_eq!(client_api("/nope", &h), Api::Messages);
    }

    #[test]
    fn routes_for_metrics() {
        assert_eq!(route_of("/v1/chat/completions"), "chat_completions");
        assert_eq!((route_of("/v1/messages/count_tokens"), route_of("/v1/responses/resp_1/cancel")), ("count_tokens", "responses_stored"));
        assert_eq!(route_of("/nope"), "other");
    }
}
