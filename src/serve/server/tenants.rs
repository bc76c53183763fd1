//! Tenant adapters on the policy server's side of the channel: which policy serves a request
//! ([`pick_policy`]), loading an adapter beside the shared base ([`load_adapter`]) and the per-tenant
//! reload ([`PolicyHandle::reload_tenant`]). Their settings and registry are in `registry`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::HeaderMap;

use super::messages::WorkerMsg;
use super::registry::TenantAdapter;
use super::shared::{PolicyHandle, Shared};
use crate::model::lm::ADAPTER_CONFIG;
use crate::model::{LanguageModel, LoadOptions, Trainable};
use crate::serve::proxy::request::take_tenant;
use crate::{Error, Result};

/// Which policy serves one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pick {
    /// The tenant the request is for (its tenant header; without one, its `model` when that names an
    /// adapter; else [`crate::schema::DEFAULT_TENANT`]).
    pub tenant: String,
    /// The tenant whose adapter serves it; None: the shared policy.
    pub adapter: Option<String>,
}

/// The policy of a request: with a tenant header, the adapter of the tenant its first tenant header
/// names (the shared policy when that tenant has none; the body's `model` cannot name another tenant's
/// adapter, so a gateway's tenant header is what decides); without one, the adapter the body's `model`
/// names, else the shared policy.
///
/// # Errors
/// The reason (naming the header) when a tenant header is not a valid tenant id: a 400
/// `invalid_tenant`, as the capture proxy answers.
pub(super) fn pick_policy(s: &Shared, model: Option<&str>, headers: &HeaderMap) -> std::result::Result<Pick, String> {
    let header = take_tenant(headers, &s.adapters.tenant_headers)?;
    Ok(pick(model, header, |t| s.tenants.get(t).is_some()))
}

/// [`pick_policy`] once the header is read: `header` the tenant it names, `has_adapter` whether a
/// tenant has one.
fn pick(model: Option<&str>, header: Option<String>, has_adapter: impl Fn(&str) -> bool) -> Pick {
    let tenant = match (header, model.filter(|m| has_adapter(m))) {
        (Some(h), _) => h,
        (None, Some(m)) => m.to_string(),
        (None, None) => crate::schema::DEFAULT_TENANT.to_string(),
    };
    let adapter = has_adapter(&tenant).then(|| tenant.clone());
    Pick { tenant, adapter }
}

/// Bytes of a model's adapter tensors (element count × element size of each LoRA A and B).
pub(super) fn adapter_bytes(lm: &LanguageModel) -> u64 {
    lm.transformer().adapter_state().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
}

/// Loads the adapter checkpoint `path` frozen and unmerged on the shared base `base` (the base tensors
/// alias the process's one copy, [`crate::model::weights::read_checkpoint_shared`]), with `load`'s
/// device and dtype. Blocking (reads files).
///
/// # Errors
/// [`Error::Model`] when `path` holds no `adapter_config.json` (tenant checkpoints are adapters, not full
/// weights); else as [`LanguageModel::load_checkpoint`].
pub(super) fn load_adapter(path: &Path, base: &Path, load: &LoadOptions) -> Result<LanguageModel> {
    if !path.join(ADAPTER_CONFIG).is_file() {
        return Err(Error::Model(format!("{} holds no {ADAPTER_CONFIG}: a tenant's checkpoint must be a LoRA adapter", path.display())));
    }
    let opts = LoadOptions { trainable: Trainable::Frozen, ..load.clone() };
    LanguageModel::load_checkpoint(path, Some(base), &opts)
}

/// Loads `path` on a blocking thread and installs it as `tenant`'s adapter `version` behind the jobs
/// already queued; returns the tenant's previous version. The caller holds the tenant's lock.
async fn load_and_install(s: &Arc<Shared>, tenant: &str, path: PathBuf, version: i64, trigger: &'static str) -> Result<Option<i64>> {
    let (base, load, p) = (s.opts.base_dir.clone(), s.opts.load.clone(), path.clone());
    let t0 = std::time::Instant::now();
    let loaded = tokio::task::spawn_blocking(move || load_adapter(&p, &base, &load)).await.map_err(|e| Error::Internal(format!("adapter load task: {e}")))?;
    let lm = loaded.inspect_err(|e| {
        crate::metrics::server_adapter_load(tenant, trigger, "load_error");
        tracing::error!(tenant, path = %path.display(), error = %e, "tenant adapter not loaded");
    })?;
    let (ack, done) = tokio::sync::oneshot::channel();
    let msg = WorkerMsg::Install { tenant: tenant.to_string(), path, model: Box::new(lm), version, ack };
    s.jobs.send(msg).map_err(|_| Error::Internal("inference worker stopped".into()))?;
    match done.await.map_err(|_| Error::Internal("inference worker stopped before the install".into()))? {
        Ok(previous) => {
            crate::metrics::server_adapter_load(tenant, trigger, "loaded");
            tracing::info!(tenant, version, trigger, "tenant adapter loaded in {:.2} s", t0.elapsed().as_secs_f64());
            Ok(previous)
        }
        Err(newer) => {
            crate::metrics::server_adapter_load(tenant, trigger, "older_version");
            Err(crate::config_err!("tenant {tenant}: version {version} is older than the served version {newer}"))
        }
    }
}

/// Makes `tenant`'s adapter resident before its request is queued, when it has one and it was evicted
/// (loaded from its newest checkpoint on a blocking thread, so the worker keeps serving meanwhile).
///
/// # Errors
/// As [`load_adapter`] when the checkpoint cannot be loaded any more.
pub(super) async fn ensure_resident(s: &Arc<Shared>, tenant: &str) -> Result<()> {
    if s.tenants.get(tenant).is_none_or(|e| e.resident) {
        return Ok(());
    }
    let lock = s.tenants.lock_for(tenant);
    let _one_load = lock.lock().await;
    // Another request may have loaded it while this one waited.
    let Some(e) = s.tenants.get(tenant).filter(|e| !e.resident) else { return Ok(()) };
    load_and_install(s, tenant, e.path, e.version, "on_demand").await.map(drop)
}

impl PolicyHandle {
    /// Loads `tenant`'s LoRA adapter checkpoint `path` (PEFT layout, on the server's base model) on a
    /// blocking thread, unmerged, and installs it as that tenant's version `version` behind the requests
    /// already received; later requests for the tenant use it. Versions are per tenant. Returns the
    /// tenant's previous version (None: its first adapter). A failure leaves the tenant's previous
    /// adapter, the other tenants and the shared policy as they were; each outcome is counted in
    /// `server_adapter_loads_total{trigger="reload"}`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an invalid tenant id ([`crate::schema::validate_tenant`]);
    /// [`Error::Config`] when `version` is older than the tenant's; [`Error::Model`] when `path` is not
    /// an adapter checkpoint; load errors as [`LanguageModel::load_checkpoint`]; [`Error::Internal`]
    /// when the worker is gone.
    pub async fn reload_tenant(&self, tenant: &str, path: PathBuf, version: i64) -> Result<Option<i64>> {
        crate::schema::validate_tenant(tenant).map_err(|e| crate::input_err!("reload: {e}"))?;
        let s = &self.shared;
        let lock = s.tenants.lock_for(tenant);
        let _one_load = lock.lock().await;
        if let Some(current) = s.tenants.get(tenant).map(|e| e.version).filter(|&v| version < v) {
            crate::metrics::server_adapter_load(tenant, "reload", "older_version");
            return Err(crate::config_err!("reload of tenant {tenant} to version {version} is older than its served version {current}"));
        }
        load_and_install(s, tenant, path, version, "reload").await
    }

    /// Every tenant with an adapter, by tenant id.
    pub fn tenant_adapters(&self) -> Vec<TenantAdapter> {
        self.shared.tenants.snapshot()
    }

    /// The adapter version served for each tenant with an adapter (tenant id → checkpoint version).
    pub fn tenant_versions(&self) -> std::collections::BTreeMap<String, i64> {
        self.tenant_adapters().into_iter().map(|a| (a.tenant, a.version)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::registry::AdapterOptions;
    use super::*;

    #[test]
    fn the_header_tenant_decides_else_the_model_field_names_an_adapter_else_the_shared_policy() {
        let known = |t: &str| matches!(t, "alice" | "bob");
        let p = |model: Option<&str>, header: Option<&str>| {
            let p = pick(model, header.map(str::to_string), known);
            (p.tenant, p.adapter)
        };
        let s = |x: &str| Some(x.to_string());
        assert_eq!(p(Some("alice"), None), ("alice".into(), s("alice")));
        assert_eq!(p(Some("alice"), Some("bob")), ("bob".into(), s("bob")), "the header decides: no other tenant's adapter by model");
        assert_eq!(p(Some("alice"), Some("carol")), ("carol".into(), None), "carol has no adapter: the shared policy, not alice's");
        assert_eq!(p(Some("smollm2"), Some("bob")), ("bob".into(), s("bob")), "a model that is no adapter: the header");
        assert_eq!(p(None, Some("carol")), ("carol".into(), None), "a tenant without an adapter: shared");
        assert_eq!(p(Some("smollm2"), None), ("default".into(), None));
    }

    #[test]
    fn adapter_options_check_the_headers_and_keep_one_adapter_at_least() {
        let o = AdapterOptions { max_adapters: 0, tenant_headers: vec!["X-Team".into()], ..AdapterOptions::default() }.checked().unwrap();
        assert_eq!((o.max_adapters, o.tenant_headers), (1, vec!["x-team".to_string()]));
        assert!(AdapterOptions { tenant_headers: vec![], ..AdapterOptions::default() }.checked().is_err());
        assert!(AdapterOptions { tenant_headers: vec!["bad header".into()], ..AdapterOptions::default() }.checked().is_err());
        assert_eq!(AdapterOptions::default().tenant_headers, vec!["x-agent-id".to_string(), "x-user-id".to_string()]);
    }
}
