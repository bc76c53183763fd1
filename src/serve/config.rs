//! The `[serve]` table of a pipeline: the policy server `nextstate run` starts, or the external
//! servers it reloads with each checkpoint ([`super::reload`]). Kept apart from the server code so the
//! pipeline configuration and the reloader can name it without depending on each other.

use serde::{Deserialize, Serialize};

/// The policy server run by `nextstate run` (`[serve]`), or the external one to reload.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address to listen on.
    pub host: String,
    /// Port (0 = any free port).
    pub port: u16,
    /// Most concurrent requests generated together.
    pub max_batch: usize,
    /// Milliseconds the worker waits for more requests to join a batch.
    pub batch_window_ms: u64,
    /// Token limit of requests that set none.
    pub default_max_tokens: usize,
    /// Returned log-probs: `raw` (the policy's own log-softmax, what the trainer's forward pass
    /// computes: PPO ratios start at 1) or `sampling` (the tempered/truncated distribution).
    pub logprobs_mode: String,
    /// How external servers are made to load each checkpoint: `nextstate` (`POST /v1/reload`), `none`,
    /// `vllm-lora`, `vllm-disk`, `sglang-lora`, `sglang-disk` (`sglang` is its old name). Requests and
    /// engine docs: [`crate::serve::reload`]. An in-process `serve` task is always reloaded in place.
    pub reload: String,
    /// URL of the external policy server (for the proxy's upstream, and for reloads when
    /// `reload_urls` is empty).
    pub url: Option<String>,
    /// The servers to reload with each checkpoint (any number; each gets every version in order).
    /// Empty: `url`. `url` itself is not reloaded when this is set (it may be a load balancer).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reload_urls: Vec<String>,
    /// Whole-request timeout of one reload call, seconds (default 600: a full model read from disk
    /// takes minutes on large models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reload_timeout_s: Option<u64>,
    /// Serve https with this certificate chain and key (`[serve.tls] cert_file`, `key_file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::net::ServerTls>,
    /// Seconds a client may take to send a request's headers; also the longest a connection may stay
    /// silent or idle; the connection is then closed (default 10).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout_s: Option<u64>,
    /// Seconds a client may take to send a request's body after its headers; then 408 and the
    /// connection is closed (default 30).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_timeout_s: Option<u64>,
    /// Most connections open at once; further ones wait in the listen backlog until one closes
    /// (default 512).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Most per-tenant LoRA adapters resident in the in-process server at once (default 8); past it
    /// the least recently used is dropped and loaded again when its tenant asks (docs/tenants.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_adapters: Option<usize>,
    /// Most MiB of per-tenant adapter tensors resident at once (default 512).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_adapter_mib: Option<u64>,
    /// Request headers naming the tenant whose adapter answers, first present wins (case-insensitive;
    /// default `["X-Agent-Id", "X-User-Id"]`; the capture proxy forwards a turn's tenant as
    /// `X-Agent-Id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant_headers: Option<Vec<String>>,
    /// Fold each LoRA checkpoint's adapters into the in-process server's shared-policy weights at start
    /// and at each reload (default true). False: the adapters stay attached beside the shared base, so
    /// a reload reads only the adapter files (about 0.05 s instead of about 0.85 s, and no new copy of the
    /// adapted projections, about 420 MB for SmolLM2-135M), but decoding is slower (the demo's
    /// worker generated 26 % fewer tokens per second; docs/serving.md, "Weight reloads").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merge_lora: Option<bool>,
    /// Let chat requests join the in-process server's running decode batch at token boundaries and leave
    /// it as they finish (default true). False: static batches, where a request arriving during a batch
    /// waits for the whole batch (docs/serving.md, "Batching").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuous_batching: Option<bool>,
}

impl ServeConfig {
    /// The in-process server's per-tenant adapter bounds and tenant headers ([`crate::serve::AdapterOptions`]).
    ///
    /// # Errors
    /// [`crate::Error::Config`] for `max_adapters = 0`, `max_adapter_mib = 0` or an invalid header name.
    pub fn adapter_options(&self) -> crate::Result<crate::serve::server::AdapterOptions> {
        let mut o = crate::serve::server::AdapterOptions::default();
        if let Some(n) = self.max_adapters {
            if n == 0 {
                return Err(crate::config_err!("serve.max_adapters must be at least 1"));
            }
            o.max_adapters = n;
        }
        if let Some(m) = self.max_adapter_mib {
            if m == 0 {
                return Err(crate::config_err!("serve.max_adapter_mib must be at least 1"));
            }
            o.max_adapter_bytes = m << 20;
        }
        if let Some(h) = &self.tenant_headers {
            o.tenant_headers = crate::serve::proxy::request::tenant_header_names(Some(h)).map_err(|e| crate::config_err!("serve.tenant_headers: {e}"))?;
        }
        Ok(o)
    }

    /// The listener limits of `header_timeout_s`, `body_timeout_s` and `max_connections`.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for a zero value.
    pub fn limits(&self) -> crate::Result<crate::net::ListenLimits> {
        crate::net::ListenLimits::from_settings("serve", self.header_timeout_s, self.body_timeout_s, self.max_connections)
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            host: "127.0.0.1".into(),
            port: 30001,
            max_batch: 8,
            batch_window_ms: 10,
            default_max_tokens: 512,
            logprobs_mode: "raw".into(),
            reload: "nextstate".into(),
            url: None,
            reload_urls: Vec::new(),
            reload_timeout_s: None,
            tls: None,
            header_timeout_s: None,
            body_timeout_s: None,
            max_connections: None,
            max_adapters: None,
            max_adapter_mib: None,
            tenant_headers: None,
            merge_lora: None,
            continuous_batching: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_options_default_and_are_checked() {
        let d = ServeConfig::default().adapter_options().unwrap();
        assert_eq!((d.max_adapters, d.max_adapter_bytes, d.tenant_headers), (8, 512 << 20, vec!["x-agent-id".to_string(), "x-user-id".to_string()]));
        let c: ServeConfig = toml::from_str("max_adapters = 2\nmax_adapter_mib = 64\ntenant_headers = [\"X-Team\"]\n").unwrap();
        let o = c.adapter_options().unwrap();
        assert_eq!((o.max_adapters, o.max_adapter_bytes, o.tenant_headers), (2, 64 << 20, vec!["x-team".to_string()]));
        assert!(ServeConfig { max_adapters: Some(0), ..ServeConfig::default() }.adapter_options().unwrap_err().to_string().contains("serve.max_adapters"));
        assert!(ServeConfig { tenant_headers: Some(vec!["bad header".into()]), ..ServeConfig::default() }.adapter_options().unwrap_err().to_string().contains("serve.tenant_headers"));
    }
}
