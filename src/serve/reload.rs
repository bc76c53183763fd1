//! Making policy servers load each checkpoint the trainer publishes (`[serve] reload`), and the record
//! of which version each server confirmed.
//!
//! A [`Reloader`] sends one checkpoint to every configured server ([`reload_targets`]: `[serve]
//! reload_urls`, else `[serve] url`), in the request of the server's engine ([`ReloadKind`]). Each
//! request is answered before the reloader moves on, so one server never sees version 3 before 2.
//! A server is only ever moved forward: a version not newer than the one it confirmed is skipped.
//! Every failure is a [`ReloadFailure`] with its reason code (`unreachable`, `tls`, `no_answer`,
//! `http_4xx`, `http_5xx`, `refused`, `bad_path`), counted by the caller. Only a failed connection
//! (`unreachable`: the server never saw the request) and 5xx answers are retried
//! ([`RELOAD_ATTEMPTS`]) before counting; a TLS failure would fail again, a 4xx means the request itself
//! is wrong, and after a timeout or a broken-off answer (`no_answer`) the server may have done the load,
//! so sending it again is not safe (a second `load_lora_adapter` of one name is a 4xx).
//!
//! The request of each kind follows the engine's own API:
//!
//! | kind | request | engine docs |
//! |---|---|---|
//! | `nextstate` | `POST /v1/reload {"path", "version"}` | ours (`src/serve/server.rs`) |
//! | `vllm-lora` | `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, then `POST /v1/unload_lora_adapter {"lora_name"}` of the previous adapter | vLLM "LoRA Adapters", *Dynamically serving LoRA Adapters* (server started with `--enable-lora`, `--max-loras` ≥ 2, env `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) |
//! | `sglang-lora` | `POST /load_lora_adapter {"lora_name", "lora_path"}`, then `POST /unload_lora_adapter {"lora_name"}` of the previous adapter | SGLang "LoRA Serving", *Dynamic LoRA loading* (`--enable-lora`, `--max-loras-per-batch`, `--max-lora-rank`/`--lora-target-modules` covering our adapters) |
//! | `sglang-disk` (alias `sglang`) | `POST /update_weights_from_disk {"model_path", "weight_version"}` | SGLang "SGLang for RL Systems" / native API `update_weights_from_disk`; `GET /get_weight_version` (newer releases: `GET /model_info`) then reports the version |
//! | `vllm-disk` | `POST /collective_rpc {"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": PATH}}}}`, then `POST /collective_rpc {"method": "reload_weights"}` | vLLM "Sleep Mode" → *Online Serving*: the documented in-place weight load is `collective_rpc` `reload_weights` (server started with env `VLLM_SERVER_DEV_MODE=1`); `reload_weights` reads the model path of the worker's `model_config`, which the worker method `update_config` points at the checkpoint first |
//! | `none` | nothing | |
//!
//! **Versions.** `nextstate` sends the version; `sglang-disk` sends it as `weight_version` (a string,
//! e.g. `"3"`), which SGLang stamps on its responses' `meta_info.weight_version` and reports from
//! `GET /get_weight_version`; the LoRA kinds name the adapter [`adapter_name`] `policy-v{version}`; vLLM's
//! disk reload has no version field, so there the version lives only in the reloader's record.
//!
//! **What clients request.** With the disk kinds (and `nextstate`) the served model name does not change.
//! With `vllm-lora`, clients must request `"model": "policy-v{N}"` (vLLM serves an adapter under its
//! `lora_name`); with `sglang-lora`, `"model": "<served model>:policy-v{N}"` (SGLang's `base:adapter`
//! syntax). A request for the base model name gets the base weights, not the trained ones. Neither the
//! capture proxy nor its clients rewrite the model name today, so deployments that use a LoRA kind point
//! their clients at the current adapter name (`GET /v1/models` of vLLM lists it); the previous adapter
//! is unloaded once the new one loaded, so a request for it then fails with the engine's 404.
//!
//! **Per-tenant adapters** ([`Reloader::reload_tenant`]): a tenant's adapter checkpoint is loaded under the
//! tenant id, which clients then request as `"model": "<tenant>"`: `nextstate` sends `POST /v1/reload
//! {"path", "version", "tenant"}`; `vllm-lora` sends `POST /v1/load_lora_adapter {"lora_name": tenant,
//! "lora_path", "load_inplace": true}` (vLLM replaces an adapter of that name in place; releases without
//! `load_inplace` answer a second load of one name with a 400). `sglang-lora` has no documented in-place
//! replacement (an unload then a load would fail the tenant's requests in between), so it loads version N
//! under `tenant-<tenant>-v<N>` ([`tenant::tenant_adapter_name`]) and then unloads the tenant's previous
//! version, as it does `policy-v<N>` for the shared policy; clients request
//! `"model": "<served>:tenant-<tenant>-v<N>"`.
//! The disk kinds load full weights: they refuse a tenant's reload (`failed_unsupported`, nothing sent).
//!
//! **Confirmed versions** ([`LoadedVersions`]): after each successful reload the reloader records, per
//! server URL, the version it loaded (and the adapter name for LoRA kinds); while a reload is in flight,
//! and after a failed one, the server's version is unknown. The capture proxy of the same process reads
//! this record when the upstream reports no version itself (`x-policy-version` header or
//! `policy_version` body field, which `nextstate serve` sends): see [`LoadedVersions::version_for`].
//!
//! **Not verified against the real engines here** (needs a GPU run with vLLM and SGLang installed):
//! that vLLM and SGLang accept our checkpoint folder as `lora_path` (PEFT `adapter_config.json` +
//! `adapter_model.safetensors`) and as `model_path` (HF layout), that vLLM's `update_config` override
//! of `model_config.model` makes `reload_weights` read the new folder, and the exact status codes
//! each engine returns on failure. The tests (`tests/model_train/reload.rs`) check our side of each contract
//! against fake servers that implement the documented requests and responses.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod tenant;

use backon::{ExponentialBuilder, Retryable};
use serde_json::{json, Value};

use super::config::ServeConfig;
use crate::net::redact_url;
use crate::{Error, Result};

/// Tries per request for an unreachable server or a 5xx answer (nothing else is retried).
pub const RELOAD_ATTEMPTS: u32 = 3;

/// Pause before the second try, doubled for each further try.
pub const RELOAD_RETRY_BASE: Duration = Duration::from_millis(500);

/// Whole-request timeout of a reload call when `[serve] reload_timeout_s` is not set, seconds (a full
/// model read from disk takes minutes on large models).
pub const DEFAULT_RELOAD_TIMEOUT_S: u64 = 600;

/// How an external server is made to load a checkpoint (`[serve] reload`; module docs list each
/// kind's request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReloadKind {
    /// Our own `nextstate serve`: `POST /v1/reload`.
    Nextstate,
    /// Do not reload anything.
    None,
    /// vLLM, runtime LoRA loading: `POST /v1/load_lora_adapter`.
    VllmLora,
    /// vLLM, full weights from disk: `POST /collective_rpc` `update_config` + `reload_weights`.
    VllmDisk,
    /// SGLang, dynamic LoRA loading: `POST /load_lora_adapter`.
    SglangLora,
    /// SGLang, full weights from disk: `POST /update_weights_from_disk` (config name `sglang-disk`, or
    /// `sglang` as in older pipeline files).
    SglangDisk,
}

impl ReloadKind {
    /// Every accepted `[serve] reload` value (`sglang` is the old name of `sglang-disk`).
    pub const NAMES: &'static [&'static str] = &["nextstate", "none", "vllm-lora", "vllm-disk", "sglang-lora", "sglang-disk", "sglang"];

    /// Parses a `[serve] reload` value.
    ///
    /// # Errors
    /// [`Error::Config`] naming the value and listing [`ReloadKind::NAMES`].
    pub fn parse(s: &str) -> Result<ReloadKind> {
        Ok(match s {
            "nextstate" => ReloadKind::Nextstate,
            "none" => ReloadKind::None,
            "vllm-lora" => ReloadKind::VllmLora,
            "vllm-disk" => ReloadKind::VllmDisk,
            "sglang-lora" => ReloadKind::SglangLora,
            "sglang-disk" | "sglang" => ReloadKind::SglangDisk,
            other => return Err(Error::Config(format!("serve.reload = {other:?} is not a reload kind (known: {})", Self::NAMES.join(", ")))),
        })
    }

    /// The canonical name (`sglang-disk` for the `sglang` alias).
    pub fn as_str(self) -> &'static str {
        match self {
            ReloadKind::Nextstate => "nextstate",
            ReloadKind::None => "none",
            ReloadKind::VllmLora => "vllm-lora",
            ReloadKind::VllmDisk => "vllm-disk",
            ReloadKind::SglangLora => "sglang-lora",
            ReloadKind::SglangDisk => "sglang-disk",
        }
    }

    /// Whether the kind loads the checkpoint as a named LoRA adapter ([`adapter_name`]).
    pub fn is_lora(self) -> bool {
        matches!(self, ReloadKind::VllmLora | ReloadKind::SglangLora)
    }
}

/// The adapter name a LoRA kind loads version `version` under: `policy-v{version}`.
pub fn adapter_name(version: i64) -> String {
    format!("policy-v{version}")
}

/// `http://h:p/`, `http://h:p/v1` → `http://h:p` (the form versions are recorded under).
pub fn server_base(url: &str) -> String {
    let t = url.trim().trim_end_matches('/');
    t.strip_suffix("/v1").unwrap_or(t).to_string()
}

/// The servers a reloader moves: `[serve] reload_urls` when given, else `[serve] url` (none: nothing
/// to reload). `url` is also the proxy's upstream, which may be a load balancer in front of the
/// servers listed in `reload_urls`, so it is not reloaded when `reload_urls` is set.
pub fn reload_targets(cfg: &ServeConfig) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let list: Vec<&String> = if cfg.reload_urls.is_empty() { cfg.url.iter().collect() } else { cfg.reload_urls.iter().collect() };
    for u in list {
        let b = server_base(u);
        if !out.contains(&b) {
            out.push(b);
        }
    }
    out
}

/// Checks the reload settings of `[serve]`: a known kind, and http(s) URLs.
///
/// # Errors
/// [`Error::Config`] naming the bad value.
pub fn validate(cfg: &ServeConfig) -> Result<()> {
    ReloadKind::parse(&cfg.reload)?;
    for u in cfg.url.iter().chain(cfg.reload_urls.iter()) {
        let b = server_base(u);
        if !(b.starts_with("http://") || b.starts_with("https://")) {
            return Err(Error::Config(format!("serve: {u:?} is not an http(s):// URL")));
        }
    }
    if cfg.reload_timeout_s == Some(0) {
        return Err(Error::Config("serve.reload_timeout_s must be at least 1".into()));
    }
    Ok(())
}

/// What the reloader knows of one server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerVersion {
    /// The version the server confirmed last; `None` before the first reload, while one is in flight
    /// and after a failed one (the server's weights are then unknown).
    pub version: Option<i64>,
    /// For LoRA kinds: the adapter name that version is served under.
    pub adapter: Option<String>,
    /// The newest version the server ever confirmed (kept after a failed reload: versions only move
    /// forward).
    pub confirmed: Option<i64>,
    /// The adapter the server last confirmed loading (kept after a failed reload, so the next
    /// successful one unloads it).
    pub last_adapter: Option<String>,
    /// Bumped when a reload starts and when it ends: equal values before and after a request mean no
    /// reload overlapped it.
    pub epoch: u64,
    /// A reload of this server is in flight.
    pub reloading: bool,
}

/// The versions a reloader confirmed, per server URL ([`server_base`] form); shared in-process (cheap
/// clone) with the capture proxy.
#[derive(Debug, Clone, Default)]
pub struct LoadedVersions(Arc<Mutex<BTreeMap<String, ServerVersion>>>);

impl LoadedVersions {
    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<String, ServerVersion>) -> R) -> R {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// The record of `url` (default when never reloaded).
    pub fn get(&self, url: &str) -> ServerVersion {
        self.with(|m| m.get(&server_base(url)).cloned().unwrap_or_default())
    }

    /// Every server's record.
    pub fn snapshot(&self) -> BTreeMap<String, ServerVersion> {
        self.with(|m| m.clone())
    }

    /// Marks a reload of `url` as started: its version is unknown until [`LoadedVersions::finish`].
    pub fn begin(&self, url: &str) {
        self.with(|m| {
            let e = m.entry(server_base(url)).or_default();
            e.reloading = true;
            e.epoch += 1;
        });
    }

    /// Ends a reload of `url`: `Some((version, adapter))` when the server confirmed it, `None` when it
    /// failed (version unknown).
    pub fn finish(&self, url: &str, loaded: Option<(i64, Option<String>)>) {
        self.with(|m| {
            let e = m.entry(server_base(url)).or_default();
            e.reloading = false;
            e.epoch += 1;
            match loaded {
                Some((v, a)) => {
                    e.version = Some(v);
                    e.confirmed = Some(e.confirmed.map_or(v, |c| c.max(v)));
                    e.last_adapter = a.clone();
                    e.adapter = a;
                }
                None => {
                    e.version = None;
                    e.adapter = None;
                }
            }
        });
    }

    /// The policy version that answered a request to `url` for model `model`, given the record
    /// `before` the request was sent: `Some` only when no reload started or ended while it ran (same
    /// epoch, none in flight) and, for a LoRA kind, when the request named the loaded adapter (`model`
    /// equal to it, or SGLang's `<base>:<adapter>`). A request for the base model of a LoRA server, or one
    /// that overlapped a reload, gets `None`: unknown rather than wrong.
    pub fn version_for(&self, url: &str, before: &ServerVersion, model: Option<&str>) -> Option<i64> {
        let now = self.get(url);
        if now.reloading || before.reloading || now.epoch != before.epoch {
            return None;
        }
        let v = now.version?;
        match &now.adapter {
            None => Some(v),
            Some(a) => {
                let m = model?;
                (m == a.as_str() || m.strip_suffix(a.as_str()).is_some_and(|p| p.ends_with(':'))).then_some(v)
            }
        }
    }
}

/// Why a reload of one server failed.
#[derive(Debug)]
pub struct ReloadFailure {
    /// The server ([`server_base`] form).
    pub url: String,
    /// Reason code for counting: `unreachable` (connection failed), `tls` (certificate or handshake),
    /// `no_answer` (timeout or broken-off answer), `http_4xx`, `http_5xx`, `refused` (2xx with
    /// `success: false`), `bad_path` (the checkpoint path is not UTF-8).
    pub reason: &'static str,
    /// The error, naming the server, the endpoint, the status and the engine's message.
    pub error: Error,
}

/// What one reload did to one server.
#[derive(Debug)]
pub enum ReloadOutcome {
    /// The server confirmed the version.
    Loaded {
        /// The server.
        url: String,
        /// The version it loaded.
        version: i64,
        /// The previous adapter could not be unloaded (LoRA kinds; the new one is loaded and serves):
        /// the error, also logged.
        unload_error: Option<String>,
    },
    /// The server had already confirmed this version or a newer one: nothing sent.
    Skipped {
        /// The server.
        url: String,
        /// The version it serves.
        loaded: i64,
    },
    /// The reload failed (see [`ReloadFailure`]).
    Failed(ReloadFailure),
}

impl ReloadOutcome {
    /// Counts this outcome in `reloads_total{kind, outcome}` ([`ReloadOutcome::metric_outcome`]) and
    /// moves `reload_version{kind}` to a confirmed version.
    fn export(&self, kind: ReloadKind) {
        let version = match self {
            ReloadOutcome::Loaded { version, .. } => Some(*version),
            _ => None,
        };
        crate::metrics::reload(kind.as_str(), &self.metric_outcome(), version);
    }

    /// The `outcome` label: `loaded`, `skipped_not_newer` or `failed_<reason>`.
    pub fn metric_outcome(&self) -> String {
        match self {
            ReloadOutcome::Failed(f) => format!("failed_{}", f.reason),
            other => other.count_key(),
        }
    }

    /// The count key: `loaded`, `skipped_not_newer`, or `failed: <reason>`.
    pub fn count_key(&self) -> String {
        match self {
            ReloadOutcome::Loaded { .. } => "loaded".into(),
            ReloadOutcome::Skipped { .. } => "skipped_not_newer".into(),
            ReloadOutcome::Failed(f) => format!("failed: {}", f.reason),
        }
    }
}

/// Sends checkpoints to external servers ([`ReloadKind`]) and records what they confirmed.
#[derive(Debug, Clone)]
pub struct Reloader {
    kind: ReloadKind,
    urls: Vec<String>,
    client: reqwest::Client,
    loaded: LoadedVersions,
    /// The newest version of each tenant's adapter each server confirmed ([`Reloader::reload_tenant`]).
    tenants: Arc<Mutex<BTreeMap<(String, String), i64>>>,
}

impl Reloader {
    /// A reloader of `urls` (any form [`server_base`] accepts) with a whole-request `timeout`.
    ///
    /// # Errors
    /// [`Error::Config`] for a URL that is not http(s) or an unreadable CA file; [`Error::Http`] when the
    /// HTTP client cannot be built.
    pub fn new(kind: ReloadKind, urls: &[String], timeout: Duration) -> Result<Reloader> {
        let mut bases = Vec::new();
        for u in urls {
            let b = server_base(u);
            if !(b.starts_with("http://") || b.starts_with("https://")) {
                return Err(Error::Config(format!("reload URL {u:?} is not an http(s):// URL")));
            }
            if !bases.contains(&b) {
                bases.push(b);
            }
        }
        Ok(Reloader { kind, urls: bases, client: crate::net::http_client(Some(timeout))?, loaded: LoadedVersions::default(), tenants: Arc::default() })
    }

    /// The reloader `[serve]` describes: its kind, [`reload_targets`] and `reload_timeout_s` (default
    /// [`DEFAULT_RELOAD_TIMEOUT_S`]).
    ///
    /// # Errors
    /// As [`Reloader::new`], and [`Error::Config`] for an unknown kind.
    pub fn from_config(cfg: &ServeConfig) -> Result<Reloader> {
        validate(cfg)?;
        let timeout = Duration::from_secs(cfg.reload_timeout_s.unwrap_or(DEFAULT_RELOAD_TIMEOUT_S));
        Reloader::new(ReloadKind::parse(&cfg.reload)?, &reload_targets(cfg), timeout)
    }

    /// The kind.
    pub fn kind(&self) -> ReloadKind {
        self.kind
    }

    /// The servers, in the order they are reloaded.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Whether a reload sends anything (a kind other than `none`, and at least one server).
    pub fn is_active(&self) -> bool {
        self.kind != ReloadKind::None && !self.urls.is_empty()
    }

    /// The shared record of confirmed versions.
    pub fn loaded(&self) -> LoadedVersions {
        self.loaded.clone()
    }

    /// Moves every server to checkpoint `version` in folder `path` (for LoRA kinds the adapter folder),
    /// one server after the other; one outcome per server, in [`Reloader::urls`] order. A server that
    /// confirmed `version` or a newer one is skipped. Nothing is sent for kind `none`.
    pub async fn reload(&self, path: &Path, version: i64) -> Vec<ReloadOutcome> {
        if self.kind == ReloadKind::None {
            return vec![];
        }
        let mut out = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let o = self.reload_one(url, path, version).await;
            o.export(self.kind);
            out.push(o);
        }
        out
    }

    /// Moves the server at `url` (one of [`Reloader::urls`]) to `version`.
    pub async fn reload_one(&self, url: &str, path: &Path, version: i64) -> ReloadOutcome {
        let url = server_base(url);
        let before = self.loaded.get(&url);
        if let Some(v) = before.confirmed.filter(|v| *v >= version) {
            return ReloadOutcome::Skipped { url, loaded: v };
        }
        let Some(path_str) = path.to_str() else {
            let error = Error::Config(format!("checkpoint path {} is not UTF-8", path.display()));
            return ReloadOutcome::Failed(ReloadFailure { url, reason: "bad_path", error });
        };
        self.loaded.begin(&url);
        let adapter = self.kind.is_lora().then(|| adapter_name(version));
        let r = self.send(&url, path_str, version).await;
        match r {
            Ok(()) => {
                // The new adapter serves; the previous one is unloaded so the engine's adapter slots
                // (vLLM `--max-loras`, SGLang `--max-loaded-loras`) do not fill up.
                let unload_error = match (&before.last_adapter, &adapter) {
                    (Some(prev), Some(new)) if prev != new => self.unload(&url, prev).await.err().map(|e| {
                        tracing::warn!(url = %redact_url(&url), adapter = %prev, error = %redact_url(&e.to_string()), "reload: the previous adapter could not be unloaded (the new one serves)");
                        e.to_string()
                    }),
                    _ => None,
                };
                self.loaded.finish(&url, Some((version, adapter)));
                tracing::info!(url = %redact_url(&url), version, kind = self.kind.as_str(), "reload: server confirmed the checkpoint");
                ReloadOutcome::Loaded { url, version, unload_error }
            }
            Err((reason, error)) => {
                self.loaded.finish(&url, None);
                tracing::error!(url = %redact_url(&url), version, kind = self.kind.as_str(), reason, error = %redact_url(&error.to_string()), "reload failed");
                ReloadOutcome::Failed(ReloadFailure { url, reason, error })
            }
        }
    }

    /// The requests of [`ReloadKind`] (module docs), in order; the first failure ends them.
    async fn send(&self, url: &str, path: &str, version: i64) -> std::result::Result<(), (&'static str, Error)> {
        match self.kind {
            ReloadKind::None => Ok(()),
            ReloadKind::Nextstate => self.post(url, "/v1/reload", json!({"path": path, "version": version})).await.map(drop),
            ReloadKind::VllmLora => self.post(url, "/v1/load_lora_adapter", json!({"lora_name": adapter_name(version), "lora_path": path})).await.map(drop),
            ReloadKind::SglangLora => {
                let body = self.post(url, "/load_lora_adapter", json!({"lora_name": adapter_name(version), "lora_path": path})).await?;
                sglang_success(url, "/load_lora_adapter", &body)
            }
            ReloadKind::SglangDisk => {
                let body = self.post(url, "/update_weights_from_disk", json!({"model_path": path, "weight_version": version.to_string()})).await?;
                sglang_success(url, "/update_weights_from_disk", &body)
            }
            ReloadKind::VllmDisk => {
                let point = json!({"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": path}}}});
                self.post(url, "/collective_rpc", point).await?;
                self.post(url, "/collective_rpc", json!({"method": "reload_weights"})).await.map(drop)
            }
        }
    }

    /// Unloads adapter `name` from `url` (LoRA kinds).
    async fn unload(&self, url: &str, name: &str) -> Result<()> {
        let endpoint = if self.kind == ReloadKind::VllmLora { "/v1/unload_lora_adapter" } else { "/unload_lora_adapter" };
        let body = self.post(url, endpoint, json!({"lora_name": name})).await.map_err(|(_, e)| e)?;
        if self.kind == ReloadKind::SglangLora {
            sglang_success(url, endpoint, &body).map_err(|(_, e)| e)?;
        }
        Ok(())
    }

    /// POSTs `body` to `url` + `endpoint`, retrying unreachable servers and 5xx answers
    /// ([`RELOAD_ATTEMPTS`] attempts, [`RELOAD_RETRY_BASE`] doubling between them, by `backon`); returns
    /// the 2xx answer's body (JSON, or the text as a JSON string).
    async fn post(&self, url: &str, endpoint: &str, body: Value) -> std::result::Result<Value, (&'static str, Error)> {
        let backoff = ExponentialBuilder::default().with_min_delay(RELOAD_RETRY_BASE).with_factor(2.0).with_max_times(RELOAD_ATTEMPTS as usize - 1);
        (|| self.post_once(url, endpoint, &body))
            .retry(backoff)
            .sleep(tokio::time::sleep)
            // Only a refused/failed connection and a 5xx are retried: the server never saw the request,
            // or failed it. A TLS failure fails the same way again, after a timeout or a broken-off answer
            // the server may have done the load (a second load_lora_adapter of the same name is a 4xx).
            .when(|failure| matches!(failure.0, "unreachable" | "http_5xx"))
            .notify(|failure, delay| tracing::warn!(url = %redact_url(url), endpoint, ?delay, error = %redact_url(&failure.1.to_string()), "reload: retrying"))
            .await
    }

    /// One POST of `body` to `url` + `endpoint`: the 2xx answer's body, or the failure's reason label
    /// (`tls`, `unreachable`, `no_answer`, `http_5xx`, `http_4xx`) and error.
    async fn post_once(&self, url: &str, endpoint: &str, body: &Value) -> std::result::Result<Value, (&'static str, Error)> {
        match self.client.post(format!("{url}{endpoint}")).json(body).send().await {
            Err(e) => {
                let reason = if crate::net::is_tls_error(&e) {
                    "tls"
                } else if e.is_connect() && !e.is_timeout() {
                    "unreachable"
                } else {
                    "no_answer"
                };
                Err((reason, Error::Http(crate::net::redact_url(&format!("{} reload of {url}: POST {endpoint} failed: {}", self.kind.as_str(), crate::net::error_chain(&e))))))
            }
            Ok(resp) => {
                let status = resp.status();
                let text = resp.text().await.unwrap_or_default();
                if status.is_success() {
                    return Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)));
                }
                let reason = if status.is_server_error() { "http_5xx" } else { "http_4xx" };
                let text: String = text.chars().take(2000).collect();
                Err((reason, Error::Http(crate::net::redact_url(&format!("{} reload of {url}: POST {endpoint} answered {status}: {text}", self.kind.as_str())))))
            }
        }
    }
}

/// SGLang answers its control endpoints with `{"success": bool, "message" | "error_message": ...}`; a
/// 2xx answer with `success: false` is a refusal.
fn sglang_success(url: &str, endpoint: &str, body: &Value) -> std::result::Result<(), (&'static str, Error)> {
    if body.get("success").and_then(Value::as_bool) == Some(false) {
        let msg = body.get("message").or_else(|| body.get("error_message")).and_then(Value::as_str).unwrap_or("");
        return Err(("refused", Error::Http(crate::net::redact_url(&format!("reload of {url}: POST {endpoint} answered success=false: {msg}")))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reload_errors_do_not_carry_url_credentials() {
        let body = serde_json::json!({"success": false, "message": "busy"});
        let (reason, e) = sglang_success("http://admin:s3cret@h:30000", "/update_weights_from_disk", &body).unwrap_err();
        assert_eq!(reason, "refused");
        assert_eq!(e.to_string().contains("s3cret"), false, "{e}");
        assert!(e.to_string().contains("admin:***@h:30000"), "{e}");
    }

    #[test]
    fn kinds_parse_with_the_sglang_alias_and_reject_unknown_ones_listing_the_known() {
        assert_eq!(ReloadKind::parse("sglang").unwrap(), ReloadKind::SglangDisk);
        assert_eq!(ReloadKind::parse("sglang-disk").unwrap().as_str(), "sglang-disk");
        for n in ReloadKind::NAMES {
            ReloadKind::parse(n).unwrap();
        }
        let e = ReloadKind::parse("vllm").unwrap_err().to_string();
        assert!(e.contains("\"vllm\"") && e.contains("vllm-lora, vllm-disk, sglang-lora, sglang-disk, sglang"), "{e}");
    }

    #[test]
    fn targets_are_reload_urls_else_url_normalised_and_deduplicated() {
        let mut c = ServeConfig { url: Some("http://lb:8000/v1".into()), ..ServeConfig::default() };
        assert_eq!(reload_targets(&c), vec!["http://lb:8000".to_string()]);
        c.reload_urls = vec!["http://a:1/".into(), "http://b:2".into(), "http://a:1/v1".into()];
        assert_eq!(reload_targets(&c), vec!["http://a:1".to_string(), "http://b:2".to_string()]);
        c.reload_urls.push("ftp://x".into());
        assert!(validate(&c).unwrap_err().to_string().contains("ftp://x"));
    }

    #[test]
    fn version_is_known_only_without_an_overlapping_reload_and_for_the_loaded_adapter() {
        let lv = LoadedVersions::default();
        let u = "http://s:1";
        assert_eq!(lv.version_for(u, &lv.get(u), None), None);
        lv.begin(u);
        lv.finish(u, Some((3, None)));
        let before = lv.get(u);
        assert_eq!(lv.version_for("http://s:1/v1", &before, Some("any")), Some(3));
        lv.begin(u);
        assert_eq!(lv.version_for(u, &before, None), None, "a reload started during the request");
        lv.finish(u, Some((4, Some(adapter_name(4)))));
        let before = lv.get(u);
        assert_eq!(lv.version_for(u, &before, Some("policy-v4")), Some(4));
        assert_eq!(lv.version_for(u, &before, Some("Qwen/Qwen3-8B:policy-v4")), Some(4));
        assert_eq!(lv.version_for(u, &before, Some("Qwen/Qwen3-8B")), None, "base model of a LoRA server");
        assert_eq!(lv.version_for(u, &before, Some("xpolicy-v4")), None);
        lv.begin(u);
        lv.finish(u, None);
        let after = lv.get(u);
        assert_eq!((after.version, after.confirmed, after.last_adapter.as_deref()), (None, Some(4), Some("policy-v4")), "a failed reload leaves the version unknown");
    }
}
