//! The servers `nextstate run` starts in-process: the policy server (serving the base model, or the
//! newest checkpoint of a resumed run) and the listeners it and the capture proxy bind.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::net::{Listener, ServerTls};
use crate::runtime::Stop;
use crate::schema::TurnType;
use crate::serve::proxy::emit::SpoolConfig;
use crate::serve::proxy::{Proxy, ProxyOptions, ProxyStats};
use crate::serve::reload::Reloader;
use crate::serve::PolicyHandle;

/// A server's task: serves until its stop future resolves.
pub(super) type ServerTask = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// Binds `host:port` (TLS when `tls`); returns the listener and its `http(s)://host:port` URL.
///
/// # Errors
/// The listener's bind and TLS errors.
pub(super) async fn bind(host: &str, port: u16, tls: Option<&ServerTls>) -> Result<(Listener, String)> {
    let l = Listener::bind(host, port, tls).await?;
    let url = l.url()?;
    Ok((l, url))
}

/// Loads the policy (or the newest checkpoint under `resume_run`) and starts the server; returns its
/// reload handle, URL and the future serving it until `stop`.
///
/// # Errors
/// [`Error::Config`] for a bad device, dtype or `serve.logprobs_mode`; model and checkpoint loading
/// errors; bind errors.
pub(super) async fn start_server(cfg: &PipelineConfig, resume_run: Option<PathBuf>, stop: Stop) -> Result<(PolicyHandle, String, ServerTask)> {
    use crate::model::{LanguageModel, LoadOptions, LogprobMode, Trainable};
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let load = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable: Trainable::Frozen };
    let latest = match &resume_run {
        Some(dir) => crate::trainer::latest_complete(dir)?,
        None => None,
    };
    let merge = cfg.serve.merge_lora.unwrap_or(true);
    let (lm, version) = {
        let (load, base) = (load.clone(), cfg.policy.model.clone());
        let latest = latest.clone();
        tokio::task::spawn_blocking(move || -> Result<(LanguageModel, i64)> {
            match latest {
                Some((path, m)) => Ok((crate::serve::server::load_policy(&path, &base, &load, merge)?, m.version)),
                None => Ok((LanguageModel::load(&base, &load)?, 0)),
            }
        })
        .await
        .map_err(|e| Error::Internal(format!("model load task: {e}")))??
    };
    let logprobs_mode = match cfg.serve.logprobs_mode.as_str() {
        "raw" => LogprobMode::Raw,
        "sampling" => LogprobMode::Sampling,
        other => return Err(Error::Config(format!("serve.logprobs_mode = {other:?} (raw or sampling)"))),
    };
    let opts = crate::serve::ServerOptions {
        model_name: cfg.policy.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "policy".into()),
        api_key: None,
        health_requires_key: false,
        limits: cfg.serve.limits()?,
        max_body_bytes: 16 << 20,
        max_batch: cfg.serve.max_batch,
        batch_window: std::time::Duration::from_millis(cfg.serve.batch_window_ms),
        default_max_tokens: cfg.serve.default_max_tokens,
        logprobs_mode,
        load,
        base_dir: cfg.policy.model.clone(),
        threads: cfg.policy.threads,
        merge_lora: merge,
        continuous_batching: cfg.serve.continuous_batching.unwrap_or(true),
    };
    let server = crate::serve::PolicyServer::start_with_adapters(lm, version, opts, cfg.serve.adapter_options()?)?;
    let handle = server.handle();
    if let Some(dir) = resume_run.as_deref().filter(|_| cfg.trainer.tenants.per_tenant()) {
        resume_tenants(&handle, dir).await?;
    }
    let (listener, url) = bind(&cfg.serve.host, cfg.serve.port, cfg.serve.tls.as_ref()).await?;
    tracing::info!(%url, version, "policy server listening");
    let mut s = stop;
    let fut = Box::pin(async move { server.serve(listener, async move { s.wait().await }).await });
    Ok((handle, url, fut))
}

/// A resumed per-tenant run (`nextstate run --resume`): loads each tenant's newest complete checkpoint
/// under `run_dir` (`<run_dir>/<tenant>/<version>`) as that tenant's adapter into the server of
/// `handle`, so every tenant is served by its trained weights from the start, not only from its next
/// checkpoint. Returns the versions loaded, by tenant. A tenant whose adapter fails to load is logged and
/// left out (served by the shared policy until its next checkpoint loads); the others are not held back.
///
/// # Errors
/// [`Error::Io`] when the run folder cannot be listed.
pub async fn resume_tenants(handle: &PolicyHandle, run_dir: &std::path::Path) -> Result<std::collections::BTreeMap<String, i64>> {
    let mut loaded = std::collections::BTreeMap::new();
    for tenant in crate::trainer::tenants::tenant_folders(run_dir)? {
        let latest = match crate::trainer::latest_complete(&run_dir.join(&tenant)) {
            Ok(Some(l)) => l,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(%tenant, error = %e, "resume: the tenant's checkpoints cannot be read; it is served by the shared policy until its next checkpoint");
                continue;
            }
        };
        let (path, m) = latest;
        match handle.reload_tenant(&tenant, path.clone(), m.version).await {
            Ok(_) => {
                tracing::info!(%tenant, version = m.version, path = %path.display(), "resume: the tenant's adapter serves");
                loaded.insert(tenant, m.version);
            }
            Err(e) => tracing::warn!(%tenant, version = m.version, error = %e, "resume: the tenant's adapter cannot be loaded; it is served by the shared policy until its next checkpoint"),
        }
    }
    Ok(loaded)
}

/// The capture proxy's task: serves until the sources are closed, then returns its counters.
pub(super) type ProxyTask = Pin<Box<dyn Future<Output = Result<ProxyStats>> + Send>>;

/// Starts the capture proxy of `[proxy]` in front of `upstream` (the in-process policy server, or
/// `[serve] url`), producing to `bus`; returns its URL and the future serving it until `source_stop`.
/// The versions `external` confirms stand in for an upstream's `x-policy-version`.
///
/// # Errors
/// [`Error::Config`] without an upstream, for a bad `proxy.default_turn_type` or an unset
/// `proxy.api_key_env` variable; bind errors; the proxy's start errors.
pub(super) async fn start_proxy(cfg: &PipelineConfig, upstream: Option<String>, external: &Reloader, bus: &Bus, source_stop: Stop) -> Result<(String, ProxyTask)> {
    let upstream = upstream.ok_or_else(|| Error::Config("the proxy needs an upstream: run `serve` too, or set [serve] url".into()))?;
    let mut popts = ProxyOptions::new(upstream);
    // External upstream: the versions the reloader confirms stand in for an `x-policy-version`.
    popts.upstream_versions = Some(external.loaded());
    popts.default_turn_type = TurnType::parse(&cfg.proxy.default_turn_type)
        .ok_or_else(|| Error::Config(format!("proxy.default_turn_type must be main or side, got {}", cfg.proxy.default_turn_type)))?;
    popts.spool = SpoolConfig::new(&cfg.proxy.spool_dir, cfg.proxy.spool_max_bytes);
    if let Some(env) = &cfg.proxy.api_key_env {
        popts.api_key = Some(std::env::var(env).map_err(|_| Error::Config(format!("proxy.api_key_env: ${env} is not set")))?);
    }
    popts.health_requires_key = cfg.proxy.health_requires_key;
    popts.tenant_headers = cfg.proxy.tenant_header_names()?;
    popts.forward_tenant = cfg.proxy.forward_tenant.unwrap_or(true);
    popts.limits = cfg.proxy.limits()?;
    let (listener, url) = bind(&cfg.proxy.host, cfg.proxy.port, cfg.proxy.tls.as_ref()).await?;
    tracing::info!(%url, "capture proxy listening");
    let proxy = Proxy::start(popts, bus).await?;
    let mut s = source_stop;
    let fut = Box::pin(async move { proxy.serve(listener, async move { s.wait().await }).await });
    Ok((url, fut))
}
