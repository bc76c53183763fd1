//! The policy server's routes other than inference: auth and version middleware, `/v1/models` (the
//! shared model and every tenant adapter), `/health`, `/v1/reload` (the shared policy, or a tenant's
//! adapter), `/metrics` and the JSON 404 and 405 fallbacks; and the error answer the handlers share.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq;

use super::headers::{POLICY_TENANT_HEADER, VERSION_HEADER};
use super::shared::{PolicyHandle, Shared};
use crate::serve::openai::error_body;
use crate::Error;

pub(super) fn api_error(status: StatusCode, message: &str, kind: &str) -> Response {
    (status, Json(error_body(message, kind, None))).into_response()
}

pub(super) fn error_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 404 | 409 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        _ => "server_error",
    }
}

/// Bearer auth (constant-time; the scheme in any case) on every route but `/health` (and on `/health`
/// too with [`super::ServerOptions::health_requires_key`]), a 408 for a body that missed the
/// listener's deadline ([`crate::net::BodyTimedOut`]), and `X-Policy-Version` on every response that
/// does not set it itself.
pub(super) async fn auth_and_version(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let route = route_name(req.uri().path());
    let r = authorized(s, req, next).await;
    crate::metrics::server_request(route, r.status().as_u16());
    r
}

/// The fixed route label of a request path (`other` for a path the server has no route for).
fn route_name(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/v1/reload" => "reload",
        "/metrics" => "metrics",
        _ => "other",
    }
}

async fn authorized(s: Arc<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.opts.api_key {
        if req.uri().path() != "/health" || s.opts.health_requires_key {
            let given = req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(crate::net::bearer_token).unwrap_or("");
            if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
                let mut r = api_error(StatusCode::UNAUTHORIZED, "invalid or missing API key", "authentication_error");
                set_version(&mut r, s.version.load(Ordering::SeqCst));
                return r;
            }
        }
    }
    let timed_out = req.extensions().get::<crate::net::BodyTimedOut>().cloned();
    let mut r = next.run(req).await;
    if timed_out.is_some_and(|t| t.fired()) {
        let limit = s.opts.limits.body_read_timeout.as_secs_f64();
        r = (StatusCode::REQUEST_TIMEOUT, Json(error_body(&format!("request body not received within {limit:.1} s"), "invalid_request_error", Some("body_timeout")))).into_response();
    }
    if !r.headers().contains_key(VERSION_HEADER) {
        set_version(&mut r, s.version.load(Ordering::SeqCst));
    }
    r
}

pub(super) fn set_version(r: &mut Response, v: i64) {
    if let Ok(h) = HeaderValue::from_str(&v.to_string()) {
        r.headers_mut().insert(VERSION_HEADER, h);
    }
}

/// Names the policy that answered: `X-Policy-Version` = `version`, and `X-Policy-Tenant` = the tenant
/// whose adapter served (none for the shared policy).
pub(super) fn set_policy(r: &mut Response, version: i64, adapter: Option<&str>) {
    set_version(r, version);
    if let Some(h) = adapter.and_then(|t| HeaderValue::from_str(t).ok()) {
        r.headers_mut().insert(POLICY_TENANT_HEADER, h);
    }
}

/// Fallback of unknown paths: a JSON 404 naming the routes there are.
pub(super) async fn not_found(req: Request) -> Response {
    let message = format!(
        "no route {} {}: the server serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, POST /v1/reload, GET /metrics",
        req.method(),
        req.uri().path()
    );
    (StatusCode::NOT_FOUND, Json(error_body(&message, "invalid_request_error", Some("unknown_route")))).into_response()
}

/// Fallback of a known path asked with the wrong method: a JSON 405.
pub(super) async fn method_not_allowed(req: Request) -> Response {
    let message = format!("method {} not allowed on {}", req.method(), req.uri().path());
    (StatusCode::METHOD_NOT_ALLOWED, Json(error_body(&message, "invalid_request_error", Some("method_not_allowed")))).into_response()
}

/// `GET /v1/models`: the shared model (`policy_version`: the shared version) and every tenant adapter
/// (`id`: the tenant, which a request's `model` names to be served by it; `policy_version`: its version;
/// `resident`: loaded now, else loaded again on its next request).
pub(super) async fn models(State(s): State<Arc<Shared>>) -> Response {
    let mut data = vec![json!({"id": s.opts.model_name, "object": "model", "created": 0, "owned_by": "nextstate",
        "policy_version": s.version.load(Ordering::SeqCst)})];
    for a in s.tenants.snapshot() {
        data.push(json!({"id": a.tenant, "object": "model", "created": 0, "owned_by": "nextstate", "parent": s.opts.model_name,
            "policy_version": a.version, "tenant": a.tenant, "resident": a.resident, "adapter_bytes": a.bytes}));
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /metrics`: the process-wide metrics ([`crate::metrics`]) in the OpenMetrics text format.
pub(super) async fn metrics() -> Response {
    ([(axum::http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], crate::metrics::encode()).into_response()
}

pub(super) async fn health(State(s): State<Arc<Shared>>) -> Response {
    let adapters = s.tenants.snapshot();
    Json(json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "model": s.opts.model_name,
        "policy_version": s.version.load(Ordering::SeqCst),
        "requests_in_flight": s.in_flight.load(Ordering::SeqCst),
        "requests_completed": s.completed.load(Ordering::Relaxed),
        "requests_failed": s.failed.load(Ordering::Relaxed),
        "tenant_adapters": adapters.len(),
        "tenant_adapters_resident": adapters.iter().filter(|a| a.resident).count(),
    }))
    .into_response()
}

/// The body of `POST /v1/reload`: a checkpoint directory and the version to serve it as; with
/// `tenant`, that tenant's LoRA adapter (versions per tenant), else the shared policy.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReloadRequest {
    path: PathBuf,
    version: i64,
    #[serde(default)]
    tenant: Option<String>,
}

/// `POST /v1/reload`: 200 `{policy_version, previous_version, path[, tenant]}` (`previous_version` null
/// for a tenant's first adapter); 400 for an invalid tenant id, 409 for a version older than the one
/// served, 422 when the checkpoint cannot be loaded (nothing changes then).
pub(super) async fn reload(State(s): State<Arc<Shared>>, body: std::result::Result<Json<ReloadRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, &e.body_text(), "invalid_request_error"),
    };
    let handle = PolicyHandle { shared: s.clone() };
    let outcome = match &req.tenant {
        None => handle.reload(req.path.clone(), req.version).await.map(Some),
        Some(t) => handle.reload_tenant(t, req.path.clone(), req.version).await,
    };
    match outcome {
        Ok(previous) => {
            let mut body = json!({"policy_version": req.version, "previous_version": previous, "path": req.path});
            if let Some(t) = &req.tenant {
                body["tenant"] = json!(t);
            }
            let mut r = Json(body).into_response();
            if let Some(t) = &req.tenant {
                set_policy(&mut r, req.version, Some(t));
            }
            r
        }
        Err(e) => {
            let (status, code) = match &e {
                Error::InvalidInput(_) => (StatusCode::BAD_REQUEST, Some("invalid_tenant")),
                Error::Config(_) => (StatusCode::CONFLICT, None),
                Error::Io { .. } | Error::Model(_) | Error::Json(_) => (StatusCode::UNPROCESSABLE_ENTITY, None),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, None),
            };
            (status, Json(error_body(&e.to_string(), error_kind(status), code))).into_response()
        }
    }
}
