//! The trainer's checkpoint hook when `nextstate run` has no reload follower: each checkpoint the
//! in-process trainer publishes is loaded by the in-process policy server and the external servers of
//! `[serve]`, in publication order. A tenant's checkpoint (per-tenant training, the row's `tenant` set)
//! is loaded as that tenant's adapter beside the shared policy (`PolicyHandle::reload_tenant`, and the
//! engines' per-tenant LoRA names, `Reloader::reload_tenant`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::schema;
use crate::serve::reload::{ReloadOutcome, Reloader};
use crate::serve::PolicyHandle;
use crate::stages::train::OnCheckpoint;

/// The trainer's checkpoint callback: the in-process server reloads in place, then the external servers
/// ([`crate::serve::reload::Reloader`]). One task handles the checkpoints in the order they are
/// published (a server never gets version 3 before 2); versions of the shared policy some server
/// confirmed go to `log`.
pub(super) fn reloader(policy: Option<PolicyHandle>, external: Option<Reloader>, log: Arc<Mutex<Vec<i64>>>) -> OnCheckpoint {
    let external = external.filter(|r| r.is_active());
    if policy.is_none() && external.is_none() {
        return Box::new(|_row: &schema::Checkpoint| {});
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Option<String>, PathBuf, i64)>();
    tokio::spawn(async move {
        while let Some((tenant, path, version)) = rx.recv().await {
            let mut loaded = false;
            if let Some(h) = &policy {
                let r = match &tenant {
                    Some(t) => h.reload_tenant(t, path.clone(), version).await.map(|_| ()),
                    None => h.reload(path.clone(), version).await.map(|_| ()),
                };
                match r {
                    Ok(()) => {
                        crate::metrics::reload("in_process", "loaded", Some(version).filter(|_| tenant.is_none()));
                        loaded = true;
                    }
                    Err(e) => {
                        crate::metrics::reload("in_process", "failed_in_process", None);
                        tracing::error!(version, tenant = tenant.as_deref().unwrap_or("-"), error = %e, "the policy server could not load the checkpoint");
                    }
                }
            }
            if let Some(r) = &external {
                // Failures are logged (with the engine's answer) by the reloader.
                let outcomes = match &tenant {
                    Some(t) => r.reload_tenant(t, &path, version).await,
                    None => r.reload(&path, version).await,
                };
                loaded |= outcomes.iter().any(|o| matches!(o, ReloadOutcome::Loaded { .. }));
            }
            if loaded && tenant.is_none() {
                if let Ok(mut l) = log.lock() {
                    l.push(version);
                }
            }
        }
    });
    Box::new(move |row: &schema::Checkpoint| {
        // Err only once the worker is gone (the runtime is shutting down).
        let _ = tx.send((row.tenant.clone(), PathBuf::from(&row.path), row.version));
    })
}
