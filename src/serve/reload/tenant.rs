//! Per-tenant adapter reloads of external servers ([`Reloader::reload_tenant`]; the requests are in the
//! module docs of [`super`]).

use std::path::Path;

use serde_json::json;

use super::{server_base, sglang_success, ReloadFailure, ReloadKind, ReloadOutcome, Reloader};
use crate::net::redact_url;
use crate::Error;

impl Reloader {
    /// Moves every server to version `version` of tenant `tenant`'s LoRA adapter in folder `path` (PEFT
    /// layout), one server after the other; one outcome per server, in [`Reloader::urls`] order,
    /// counted as [`Reloader::reload`]'s are. Versions are per tenant and server: a server that confirmed
    /// this tenant's `version` or a newer one is skipped. Neither other tenants nor the shared policy's
    /// record ([`Reloader::loaded`]) are touched. Nothing is sent for kind `none`.
    ///
    /// `sglang-lora` has no in-place replacement: version N of the tenant's adapter is loaded under
    /// [`tenant_adapter_name`] `tenant-<tenant>-v<N>` and the tenant's previous version on that server is
    /// then unloaded (as the shared policy's `policy-v<N>`); clients request
    /// `"model": "<served>:tenant-<tenant>-v<N>"`. A failed unload is reported in the outcome's
    /// `unload_error`, the new version serving. The previous version is what this reloader confirmed in
    /// this process: after a restart the old names stay loaded (unload them by hand, or restart SGLang).
    ///
    /// Failures (per server, nothing sent): `unsupported` for a kind that loads full weights
    /// (`sglang-disk`, `vllm-disk`), `bad_tenant` for an invalid tenant id
    /// ([`crate::schema::validate_tenant`]), `bad_path` for a path that is not UTF-8; then the reasons of
    /// [`ReloadFailure`].
    pub async fn reload_tenant(&self, tenant: &str, path: &Path, version: i64) -> Vec<ReloadOutcome> {
        if self.kind == ReloadKind::None {
            return vec![];
        }
        let mut out = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let o = self.reload_tenant_one(url, tenant, path, version).await;
            o.export(self.kind);
            out.push(o);
        }
        out
    }

    /// The newest version of `tenant`'s adapter the server at `url` confirmed.
    pub fn tenant_version(&self, url: &str, tenant: &str) -> Option<i64> {
        self.tenants.lock().unwrap_or_else(|p| p.into_inner()).get(&(server_base(url), tenant.to_string())).copied()
    }

    async fn reload_tenant_one(&self, url: &str, tenant: &str, path: &Path, version: i64) -> ReloadOutcome {
        let url = server_base(url);
        if let Some(v) = self.tenant_version(&url, tenant).filter(|v| *v >= version) {
            return ReloadOutcome::Skipped { url, loaded: v };
        }
        let failed = |url: String, reason: &'static str, error: Error| ReloadOutcome::Failed(ReloadFailure { url, reason, error });
        if let Err(e) = crate::schema::validate_tenant(tenant) {
            return failed(url, "bad_tenant", Error::Config(format!("reload: {e}")));
        }
        let Some(path_str) = path.to_str() else {
            return failed(url, "bad_path", Error::Config(format!("checkpoint path {} is not UTF-8", path.display())));
        };
        let previous = self.tenant_version(&url, tenant);
        let sent = match self.kind {
            ReloadKind::Nextstate => self.post(&url, "/v1/reload", json!({"path": path_str, "version": version, "tenant": tenant})).await,
            ReloadKind::VllmLora => self.post(&url, "/v1/load_lora_adapter", json!({"lora_name": tenant, "lora_path": path_str, "load_inplace": true})).await,
            ReloadKind::SglangLora => {
                let name = tenant_adapter_name(tenant, version);
                match self.post(&url, "/load_lora_adapter", json!({"lora_name": name, "lora_path": path_str})).await {
                    Ok(body) => sglang_success(&url, "/load_lora_adapter", &body).map(|()| body),
                    Err(e) => Err(e),
                }
            }
            other => {
                let error = Error::Config(format!("reload kind {} loads full weights, not a tenant's adapter (nextstate, vllm-lora and sglang-lora can)", other.as_str()));
                return failed(url, "unsupported", error);
            }
        };
        match sent {
            Ok(_) => {
                {
                    let mut m = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
                    let v = m.entry((url.clone(), tenant.to_string())).or_insert(version);
                    *v = (*v).max(version);
                }
                tracing::info!(url = %redact_url(&url), tenant, version, kind = self.kind.as_str(), "reload: server confirmed the tenant's adapter");
                // SGLang keeps every loaded name: unload the tenant's previous version so its slots
                // (`--max-loaded-loras`) do not fill up.
                let unload_error = match previous {
                    Some(prev) if self.kind == ReloadKind::SglangLora && prev != version => {
                        let old = tenant_adapter_name(tenant, prev);
                        self.unload(&url, &old).await.err().map(|e| {
                            tracing::warn!(url = %redact_url(&url), adapter = %old, error = %redact_url(&e.to_string()), "reload: the tenant's previous adapter could not be unloaded (the new one serves)");
                            e.to_string()
                        })
                    }
                    _ => None,
                };
                ReloadOutcome::Loaded { url, version, unload_error }
            }
            Err((reason, error)) => {
                tracing::error!(url = %redact_url(&url), tenant, version, kind = self.kind.as_str(), reason, error = %redact_url(&error.to_string()), "tenant reload failed");
                failed(url, reason, error)
            }
        }
    }
}

/// The name `sglang-lora` loads version `version` of tenant `tenant`'s adapter under:
/// `tenant-<tenant>-v<version>`. The prefix keeps it apart from the shared policy's `policy-v<N>` (a
/// tenant may be called `policy`); a tenant id has no `:`, so `<served>:tenant-<tenant>-v<N>` names it
/// unambiguously in SGLang's `base:adapter` syntax, and the trailing `-v<digits>` makes (tenant,
/// version) → name one-to-one.
pub fn tenant_adapter_name(tenant: &str, version: i64) -> String {
    format!("tenant-{tenant}-v{version}")
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::http::{StatusCode, Uri};
    use serde_json::Value;

    use super::*;

    /// A fake engine on 127.0.0.1:0 that records each (path, body) and answers 200 `{}`, or `status`
    /// while it is set.
    async fn fake(status: Arc<Mutex<Option<u16>>>) -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
        let calls: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let c = calls.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, body: axum::body::Bytes| {
            let (c, status) = (c.clone(), status.clone());
            async move {
                c.lock().unwrap().push((uri.path().to_string(), serde_json::from_slice(&body).unwrap_or(Value::Null)));
                let code = status.lock().unwrap().unwrap_or(200);
                (StatusCode::from_u16(code).unwrap(), "{}")
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, calls)
    }

    fn loaded(o: &[ReloadOutcome]) -> Vec<&'static str> {
        o.iter()
            .map(|o| match o {
                ReloadOutcome::Loaded { .. } => "loaded",
                ReloadOutcome::Skipped { .. } => "skipped",
                ReloadOutcome::Failed(f) => f.reason,
            })
            .collect()
    }

    #[tokio::test]
    async fn vllm_loads_each_tenant_in_place_under_its_id_with_versions_per_tenant() {
        let status = Arc::new(Mutex::new(None));
        let (url, calls) = fake(status.clone()).await;
        let r = Reloader::new(ReloadKind::VllmLora, std::slice::from_ref(&url), Duration::from_secs(5)).unwrap();
        let p = Path::new("/ckpt/run/alice/3");
        assert_eq!(loaded(&r.reload_tenant("alice", p, 3).await), vec!["loaded"]);
        assert_eq!(loaded(&r.reload_tenant("alice", p, 3).await), vec!["skipped"], "not newer for alice");
        assert_eq!(loaded(&r.reload_tenant("bob", Path::new("/ckpt/run/bob/1"), 1).await), vec!["loaded"], "bob's versions are his own");
        assert_eq!(loaded(&r.reload_tenant("alice", Path::new("/ckpt/run/alice/4"), 4).await), vec!["loaded"]);
        let got = calls.lock().unwrap().clone();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], ("/v1/load_lora_adapter".to_string(), json!({"lora_name": "alice", "lora_path": "/ckpt/run/alice/3", "load_inplace": true})));
        assert_eq!(got[2].1["lora_path"], "/ckpt/run/alice/4");
        assert_eq!((r.tenant_version(&url, "alice"), r.tenant_version(&url, "bob")), (Some(4), Some(1)));
        assert_eq!(r.loaded().get(&url).version, None, "the shared policy's record is untouched");
        // A refused load is a failure, not recorded: the same version is sent again next time.
        *status.lock().unwrap() = Some(400);
        assert_eq!(loaded(&r.reload_tenant("carol", Path::new("/c/1"), 1).await), vec!["http_4xx"]);
        *status.lock().unwrap() = None;
        assert_eq!(loaded(&r.reload_tenant("carol", Path::new("/c/1"), 1).await), vec!["loaded"]);
    }

    #[tokio::test]
    async fn nextstate_gets_the_tenant_in_its_reload_and_other_kinds_refuse_without_sending() {
        let (url, calls) = fake(Arc::default()).await;
        let ours = Reloader::new(ReloadKind::Nextstate, std::slice::from_ref(&url), Duration::from_secs(5)).unwrap();
        assert_eq!(loaded(&ours.reload_tenant("alice", Path::new("/a/2"), 2).await), vec!["loaded"]);
        assert_eq!(calls.lock().unwrap()[0], ("/v1/reload".to_string(), json!({"path": "/a/2", "version": 2, "tenant": "alice"})));
        assert_eq!(loaded(&ours.reload_tenant("no/such", Path::new("/a/2"), 3).await), vec!["bad_tenant"]);
        for kind in [ReloadKind::SglangDisk, ReloadKind::VllmDisk] {
            let r = Reloader::new(kind, std::slice::from_ref(&url), Duration::from_secs(5)).unwrap();
            assert_eq!(loaded(&r.reload_tenant("alice", Path::new("/a/2"), 2).await), vec!["unsupported"], "{kind:?}");
        }
        assert_eq!(calls.lock().unwrap().len(), 1, "nothing sent but the one good reload");
        let none = Reloader::new(ReloadKind::None, std::slice::from_ref(&url), Duration::from_secs(5)).unwrap();
        assert!(none.reload_tenant("alice", Path::new("/a/2"), 2).await.is_empty());
    }

    #[tokio::test]
    async fn sglang_loads_versioned_names_per_tenant_and_unloads_the_tenants_previous_one() {
        let (url, calls) = fake(Arc::default()).await;
        let r = Reloader::new(ReloadKind::SglangLora, std::slice::from_ref(&url), Duration::from_secs(5)).unwrap();
        assert_eq!(loaded(&r.reload_tenant("alice", Path::new("/ck/alice/1"), 1).await), vec!["loaded"]);
        assert_eq!(loaded(&r.reload_tenant("bob", Path::new("/ck/bob/1"), 1).await), vec!["loaded"]);
        assert_eq!(loaded(&r.reload_tenant("alice", Path::new("/ck/alice/2"), 2).await), vec!["loaded"]);
        assert_eq!(loaded(&r.reload_tenant("alice", Path::new("/ck/alice/2"), 2).await), vec!["skipped"]);
        let got = calls.lock().unwrap().clone();
        let want = vec![
            ("/load_lora_adapter".to_string(), json!({"lora_name": "tenant-alice-v1", "lora_path": "/ck/alice/1"})),
            ("/load_lora_adapter".to_string(), json!({"lora_name": "tenant-bob-v1", "lora_path": "/ck/bob/1"})),
            ("/load_lora_adapter".to_string(), json!({"lora_name": "tenant-alice-v2", "lora_path": "/ck/alice/2"})),
            ("/unload_lora_adapter".to_string(), json!({"lora_name": "tenant-alice-v1"})),
        ];
        assert_eq!(got, want, "bob's adapter stays; alice's v1 goes once v2 serves");
        let before = calls.lock().unwrap().len();
        let o = r.reload_tenant("bob", Path::new("/ck/bob/2"), 2).await;
        assert_eq!(loaded(&o), vec!["loaded"]);
        assert_eq!(calls.lock().unwrap()[before..].iter().map(|(p, b)| format!("{p} {}", b["lora_name"])).collect::<Vec<_>>(), vec!["/load_lora_adapter \"tenant-bob-v2\"", "/unload_lora_adapter \"tenant-bob-v1\""]);
        assert_eq!((r.tenant_version(&url, "alice"), r.tenant_version(&url, "bob")), (Some(2), Some(2)));
    }
}
