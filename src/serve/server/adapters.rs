//! The inference worker's policies ([`Policies`]): the shared policy, never evicted, and the resident
//! tenant adapters, at most [`super::AdapterOptions::max_adapters`] of them and
//! [`super::AdapterOptions::max_adapter_bytes`] bytes of adapter tensors, the least recently used
//! evicted first. An evicted tenant stays in the registry with its newest checkpoint and is loaded again
//! when a request needs it.

use std::collections::HashMap;
use std::path::PathBuf;

use axum::http::StatusCode;

use super::registry::TenantAdapter;
use super::shared::Shared;
use super::tenants::{adapter_bytes, load_adapter};
use crate::model::LanguageModel;

/// A resident tenant adapter.
struct Resident {
    lm: Box<LanguageModel>,
    version: i64,
    bytes: u64,
    /// [`Policies::clock`] at its last use.
    last_used: u64,
}

/// What the worker serves with: the shared policy and the resident adapters.
pub(super) struct Policies {
    shared: Box<LanguageModel>,
    shared_version: i64,
    resident: HashMap<String, Resident>,
    /// Bumped on every use and install (the LRU order).
    clock: u64,
}

impl Policies {
    /// The shared policy `shared` as `version`, no adapter resident.
    pub(super) fn new(shared: Box<LanguageModel>, version: i64) -> Policies {
        Policies { shared, shared_version: version, resident: HashMap::new(), clock: 0 }
    }

    /// Replaces the shared policy; returns the previous version.
    pub(super) fn swap_shared(&mut self, model: Box<LanguageModel>, version: i64) -> i64 {
        self.shared = model;
        std::mem::replace(&mut self.shared_version, version)
    }

    /// Makes `model` (loaded from `path`) `tenant`'s resident adapter `version` and records it in the
    /// registry, evicting others past the bounds. `Ok(previous version)`, or `Err(newer)` (nothing
    /// changed) when the tenant already has a newer version.
    pub(super) fn install(&mut self, tenant: &str, path: PathBuf, model: Box<LanguageModel>, version: i64, s: &Shared) -> std::result::Result<Option<i64>, i64> {
        let previous = s.tenants.get(tenant).map(|e| e.version);
        if let Some(newer) = previous.filter(|&v| v > version) {
            return Err(newer);
        }
        let bytes = adapter_bytes(&model);
        self.clock += 1;
        self.resident.insert(tenant.to_string(), Resident { lm: model, version, bytes, last_used: self.clock });
        s.tenants.put(TenantAdapter { tenant: tenant.to_string(), version, path, resident: true, bytes });
        self.evict_past_bounds(tenant, s);
        tracing::info!(tenant, version, bytes, resident = self.resident.len(), "tenant adapter installed");
        Ok(previous)
    }

    /// Drops the least recently used adapters other than `keep` while more than `max_adapters` or
    /// `max_adapter_bytes` are resident.
    fn evict_past_bounds(&mut self, keep: &str, s: &Shared) {
        let entries: Vec<(&str, u64, u64)> = self.resident.iter().map(|(t, r)| (t.as_str(), r.bytes, r.last_used)).collect();
        let victims = lru_victims(&entries, keep, s.adapters.max_adapters, s.adapters.max_adapter_bytes);
        for t in victims {
            self.resident.remove(&t);
            s.tenants.evicted(&t);
            crate::metrics::server_adapter_evicted(&t);
            tracing::info!(tenant = %t, "tenant adapter evicted (least recently used)");
        }
        crate::metrics::server_adapters_resident(self.resident.len(), self.resident_bytes());
    }

    fn resident_bytes(&self) -> u64 {
        self.resident.values().map(|r| r.bytes).sum()
    }

    /// The model and version serving `adapter` (None: the shared policy). An adapter the registry knows
    /// but that is not resident (evicted since its request was queued) is loaded here, from its newest
    /// checkpoint.
    ///
    /// # Errors
    /// (503, reason) when that load fails.
    pub(super) fn resolve(&mut self, adapter: Option<&str>, s: &Shared) -> std::result::Result<(&LanguageModel, i64), (StatusCode, String)> {
        let Some(tenant) = adapter else { return Ok((&*self.shared, self.shared_version)) };
        if !self.resident.contains_key(tenant) {
            let Some(e) = s.tenants.get(tenant) else { return Ok((&*self.shared, self.shared_version)) };
            let lm = load_adapter(&e.path, &s.opts.base_dir, &s.opts.load).map_err(|err| {
                crate::metrics::server_adapter_load(tenant, "on_demand", "load_error");
                tracing::error!(tenant, path = %e.path.display(), error = %err, "tenant adapter not loaded");
                (StatusCode::SERVICE_UNAVAILABLE, format!("the adapter of tenant {tenant} could not be loaded: {err}"))
            })?;
            crate::metrics::server_adapter_load(tenant, "on_demand", "loaded");
            // The registry's own version: never older than what it holds.
            let _ = self.install(tenant, e.path, Box::new(lm), e.version, s);
        }
        self.clock += 1;
        let clock = self.clock;
        match self.resident.get_mut(tenant) {
            Some(r) => {
                r.last_used = clock;
                Ok((&*r.lm, r.version))
            }
            None => Err((StatusCode::SERVICE_UNAVAILABLE, format!("the adapter of tenant {tenant} is not loaded"))),
        }
    }
}

/// The adapters to evict from `entries` (tenant, bytes, last use), least recently used first, until at
/// most `max_n` and `max_bytes` remain; never `keep`, which may stay alone above `max_bytes`.
fn lru_victims(entries: &[(&str, u64, u64)], keep: &str, max_n: usize, max_bytes: u64) -> Vec<String> {
    let mut by_age: Vec<&(&str, u64, u64)> = entries.iter().filter(|(t, _, _)| *t != keep).collect();
    by_age.sort_by_key(|(_, _, used)| *used);
    let (mut n, mut bytes) = (entries.len(), entries.iter().map(|e| e.1).sum::<u64>());
    let mut out = Vec::new();
    for (t, b, _) in by_age {
        if n <= max_n && bytes <= max_bytes {
            break;
        }
        out.push(t.to_string());
        n -= 1;
        bytes -= b;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_adapters_go_first_past_either_bound_never_the_one_in_use() {
        let e = [("a", 10, 3), ("b", 10, 1), ("c", 10, 2), ("d", 10, 4)];
        assert_eq!(lru_victims(&e, "d", 4, 100), Vec::<String>::new());
        assert_eq!(lru_victims(&e, "d", 2, 100), vec!["b".to_string(), "c".to_string()]);
        assert_eq!(lru_victims(&e, "b", 3, 100), vec!["c".to_string()], "b is in use though oldest");
        assert_eq!(lru_victims(&e, "d", 8, 25), vec!["b".to_string(), "c".to_string()], "bytes bound");
        assert_eq!(lru_victims(&[("big", 50, 1), ("x", 5, 0)], "big", 8, 20), vec!["x".to_string()], "an adapter over the bound stays alone");
    }
}
