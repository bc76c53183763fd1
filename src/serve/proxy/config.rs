//! The capture proxy's settings ([`ProxyOptions`]), the library form of `nextstate proxy`'s flags.

use std::time::Duration;

use super::emit::{EmitterConfig, SpoolConfig};
use crate::schema::TurnType;

/// Proxy settings (library form of [`crate::serve::proxy::ProxyArgs`]).
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Base URL of the upstream server (`http://host:port`; a trailing `/` or `/v1` is removed).
    pub upstream: String,
    /// Require `Authorization: Bearer KEY` (scheme in any case) or `x-api-key: KEY` from clients on
    /// every route but `/health` (and on `/health` too with `health_requires_key`).
    pub api_key: Option<String>,
    /// Put `/health` behind `api_key` as well (default false: `/health` is open, for load balancers).
    /// No effect without an `api_key`.
    pub health_requires_key: bool,
    /// Header and body read timeouts and the connection cap of the listener (default
    /// [`crate::net::ListenLimits::default`]: 10 s, 30 s, 512 connections).
    pub limits: crate::net::ListenLimits,
    /// Bearer key for the upstream. When `None` and `api_key` is `None`, the client's own
    /// `Authorization` header is forwarded.
    pub upstream_api_key: Option<String>,
    /// Turn type of requests that do not say (docs/method.md §1).
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
    /// Headers naming a request's tenant, lower-case, first present wins (default `x-agent-id`, then
    /// `x-user-id`); a request with none belongs to the `default` tenant, one with an invalid id is
    /// refused with 400 `invalid_tenant` ([`crate::schema::validate_tenant`]).
    pub tenant_headers: Vec<String>,
    /// Send a turn's tenant upstream as `X-Agent-Id` when it is not the default tenant (default true).
    pub forward_tenant: bool,
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
    /// Defaults for `upstream`: no auth (`/health` open), turn type `main`, the default listener limits, spool `.cache/proxy-spool` bounded to
    /// 256 MiB, 16 MiB bodies, token ids requested, 600 s upstream idle timeout, 5 s connect timeout,
    /// 100,000 sessions.
    pub fn new(upstream: impl Into<String>) -> ProxyOptions {
        ProxyOptions {
            upstream: upstream.into(),
            api_key: None,
            health_requires_key: false,
            limits: crate::net::ListenLimits::default(),
            upstream_api_key: None,
            default_turn_type: TurnType::Main,
            spool: SpoolConfig::new(".cache/proxy-spool", 256 << 20),
            emitter: EmitterConfig::default(),
            max_body_bytes: 16 << 20,
            request_token_ids: true,
            logprobs_mode: None,
            tenant_headers: super::request::default_tenant_headers(),
            forward_tenant: true,
            upstream_idle_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(5),
            session_capacity: crate::ingest::sessions::DEFAULT_CAPACITY,
            upstream_versions: None,
        }
    }
}

/// `http://h:p/`, `http://h:p/v1` → `http://h:p`.
pub(super) fn upstream_base(url: &str) -> String {
    let t = url.trim().trim_end_matches('/');
    t.strip_suffix("/v1").unwrap_or(t).to_string()
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
}
