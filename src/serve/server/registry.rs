//! The tenant adapters the policy server knows: their settings ([`AdapterOptions`]) and the registry of
//! every tenant with an adapter ([`TenantRegistry`]: newest checkpoint, version, whether resident).
//!
//! The worker owns the resident models (`adapters`); this registry is what handlers read, and the
//! worker keeps it up to date as it installs and evicts adapters.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use crate::serve::proxy::request::tenant_header_names;
use crate::Result;

/// Default of [`AdapterOptions::max_adapters`]: 8 resident adapters.
pub const DEFAULT_MAX_ADAPTERS: usize = 8;

/// Default of [`AdapterOptions::max_adapter_bytes`]: 512 MiB of resident adapter tensors.
pub const DEFAULT_MAX_ADAPTER_BYTES: u64 = 512 << 20;

/// How the policy server keeps per-tenant LoRA adapters beside its shared policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterOptions {
    /// Most tenant adapters resident at once (at least 1; default [`DEFAULT_MAX_ADAPTERS`]). The shared
    /// policy is not counted and never evicted.
    pub max_adapters: usize,
    /// Most bytes of adapter tensors resident at once (default [`DEFAULT_MAX_ADAPTER_BYTES`]); an
    /// adapter larger than this alone is still served, alone.
    pub max_adapter_bytes: u64,
    /// Request headers naming the tenant, first present and not blank wins (case-insensitive; default
    /// `X-Agent-Id`, `X-User-Id`, as the capture proxy).
    pub tenant_headers: Vec<String>,
}

impl Default for AdapterOptions {
    fn default() -> Self {
        AdapterOptions { max_adapters: DEFAULT_MAX_ADAPTERS, max_adapter_bytes: DEFAULT_MAX_ADAPTER_BYTES, tenant_headers: crate::serve::proxy::request::default_tenant_headers() }
    }
}

impl AdapterOptions {
    /// The options with header names lower-cased and checked, and `max_adapters` at least 1.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty header list or a name that is not an HTTP header name.
    pub(super) fn checked(mut self) -> Result<AdapterOptions> {
        self.tenant_headers = tenant_header_names(Some(&self.tenant_headers)).map_err(|e| crate::config_err!("tenant headers: {e}"))?;
        self.max_adapters = self.max_adapters.max(1);
        Ok(self)
    }
}

/// A tenant's adapter as the server knows it (listed by `/v1/models` and [`PolicyHandle::tenant_adapters`](super::PolicyHandle::tenant_adapters)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantAdapter {
    /// The tenant id (also the model id a request names to be served by it).
    pub tenant: String,
    /// The adapter's version (per tenant).
    pub version: i64,
    /// Its newest checkpoint folder (PEFT layout); an evicted adapter is loaded again from here.
    pub path: PathBuf,
    /// Whether it is loaded now.
    pub resident: bool,
    /// Bytes of its adapter tensors (LoRA A and B, the model's dtype).
    pub bytes: u64,
}

/// Every tenant with an adapter, and one lock per tenant that serialises its loads.
#[derive(Default)]
pub(super) struct TenantRegistry {
    entries: std::sync::Mutex<BTreeMap<String, TenantAdapter>>,
    locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl TenantRegistry {
    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<String, TenantAdapter>) -> R) -> R {
        f(&mut self.entries.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The entry of `tenant`, if it has an adapter.
    pub(super) fn get(&self, tenant: &str) -> Option<TenantAdapter> {
        self.with(|m| m.get(tenant).cloned())
    }

    /// Every entry, by tenant id.
    pub(super) fn snapshot(&self) -> Vec<TenantAdapter> {
        self.with(|m| m.values().cloned().collect())
    }

    /// Records `entry` (the worker, on install).
    pub(super) fn put(&self, entry: TenantAdapter) {
        self.with(|m| m.insert(entry.tenant.clone(), entry));
    }

    /// Marks `tenant` evicted (its path and version stay known).
    pub(super) fn evicted(&self, tenant: &str) {
        self.with(|m| {
            if let Some(e) = m.get_mut(tenant) {
                e.resident = false;
            }
        });
    }

    pub(super) fn lock_for(&self, tenant: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().unwrap_or_else(|p| p.into_inner()).entry(tenant.to_string()).or_default().clone()
    }
}
