//! Talking to the upstream: the auth it gets (a bearer token, or Anthropic's `x-api-key`: the
//! configured key, else the client's own), and its responses relayed back (hop-by-hop headers
//! dropped, status kept).

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;

use super::apis::Api;
use super::config::ProxyOptions;

/// Header of Anthropic clients' API key (they send no bearer token).
pub(super) const X_API_KEY: &str = "x-api-key";

/// The `Authorization` value for the upstream (see [`ProxyOptions::upstream_api_key`]).
fn upstream_auth(opts: &ProxyOptions, client: &HeaderMap) -> Option<HeaderValue> {
    match (&opts.upstream_api_key, &opts.api_key) {
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
/// `Authorization` when the proxy has no key of its own. For chat and Responses, the client's
/// `OpenAI-Organization`, `OpenAI-Project` and `OpenAI-Beta` headers too ([`OPENAI_HEADERS`]).
pub(super) fn with_auth(opts: &ProxyOptions, api: Api, client: &HeaderMap, mut rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    if api != Api::Messages {
        // OpenAI's organisation, project and beta-feature headers choose what the upstream bills and
        // enables: passed on as the client sent them.
        for name in OPENAI_HEADERS {
            for v in client.get_all(name) {
                rb = rb.header(name, v);
            }
        }
        if let Some(a) = upstream_auth(opts, client) {
            rb = rb.header(header::AUTHORIZATION, a);
        }
        return rb;
    }
    for (k, v) in anthropic_headers(client) {
        rb = rb.header(k, v);
    }
    match (&opts.upstream_api_key, &opts.api_key) {
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

/// The OpenAI request headers passed to the upstream as they came ([`with_auth`]).
pub(super) const OPENAI_HEADERS: [&str; 3] = ["openai-organization", "openai-project", "openai-beta"];

/// Upstream response headers worth returning (hop-by-hop headers and the length are recomputed).
pub(super) fn response_headers(up: &reqwest::header::HeaderMap) -> HeaderMap {
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

/// A response with the upstream's `status` (502 when it is not a valid status), `headers` and `body`.
pub(super) fn respond(status: u16, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    *r.headers_mut() = headers;
    r
}
