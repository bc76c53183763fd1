//! The policy server: an OpenAI-compatible chat-completions endpoint over one shared [`LanguageModel`]
//! and any number of per-tenant LoRA adapters on its base, with weight hot-swap, and a vLLM-compatible
//! `/v1/completions` that scores prompts (`prompt_logprobs`), so a pipeline can use the server as its
//! remote teacher (`[teacher] backend = "vllm"`).
//!
//! Inference runs on one dedicated worker thread that owns the model (tch tensors are not `Sync`);
//! HTTP handlers send it jobs over a channel and receive token events back, so the tokio runtime never
//! blocks on CPU work. The worker drains every job queued when it becomes free (up to `max_batch`)
//! into batched generations, one per policy: a batch never mixes adapters. A chat batch is continuous
//! ([`ServerOptions::continuous_batching`]): requests of its policy arriving while it decodes join it at
//! the next token boundary, and each response is sent at the step its sequence ends.
//!
//! **Tenants** (`tenants`, `adapters`): [`PolicyHandle::reload_tenant`] (or `POST /v1/reload` with a
//! `"tenant"`) gives a tenant its own LoRA adapter, kept unmerged beside the shared base (the base
//! tensors and the tokenizer are the process's one copy, so a resident tenant costs its adapter
//! tensors). A request is
//! served by the adapter of the tenant its first tenant header names
//! ([`AdapterOptions::tenant_headers`]; the shared policy when that tenant has none), else, without a
//! tenant header, by the adapter its body's `model` names, else by the shared policy. At most
//! [`AdapterOptions::max_adapters`] adapters ([`AdapterOptions::max_adapter_bytes`] bytes) stay
//! resident; the least recently used one is dropped, and loaded again from its newest checkpoint on its
//! tenant's next request.
//!
//! **Reload** (`POST /v1/reload` or [`PolicyHandle::reload`]): the new weights are loaded on a
//! blocking thread while the worker keeps serving; then the worker swaps them in at its next batch
//! boundary, ahead of jobs still queued. The batch being decoded finishes on the old weights; every job
//! not yet started, received before the swap or after, uses the new weights; nothing is rejected. A
//! tenant's reload installs its adapter behind the jobs already queued. Every response names the policy
//! that produced it: `policy_version` in the body and the `X-Policy-Version` header (the adapter's own
//! version when one served), and `policy_tenant` / `X-Policy-Tenant` (the tenant
//! whose adapter served; null / absent for the shared policy).
//!
//! This module holds start-up ([`PolicyServer::start`], [`PolicyServer::router`]); `options` holds the
//! settings, `headers` the response headers naming the policy, `messages` the messages between handlers
//! and worker, `shared` the state they share and the [`PolicyHandle`]; `worker` is the batching
//! inference worker, `adapters` its resident tenant adapters, `registry` the settings and registry of
//! tenant adapters, `tenants` which policy serves a request and the per-tenant reload, `handlers` the
//! inference request handlers and `admin` the other routes.

mod adapters;
mod admin;
mod handlers;
mod headers;
mod messages;
mod options;
mod registry;
mod shared;
mod tenants;
mod worker;

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

use crate::model::LanguageModel;
use crate::{Error, Result};
use admin::{auth_and_version, health, method_not_allowed, metrics, models, not_found, reload};
use handlers::{chat_completions, completions};
pub use headers::{POLICY_TENANT_HEADER, VERSION_HEADER};
use messages::WorkerMsg;
pub use options::ServerOptions;
pub use registry::{AdapterOptions, TenantAdapter, DEFAULT_MAX_ADAPTERS, DEFAULT_MAX_ADAPTER_BYTES};
use registry::TenantRegistry;
pub use shared::{load_policy, PolicyHandle, ServerTime};
use shared::Shared;
use worker::worker_loop;

/// A running policy server (worker thread started; serve its [`PolicyServer::router`]).
pub struct PolicyServer {
    shared: Arc<Shared>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for PolicyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyServer").field("model", &self.shared.opts.model_name).finish()
    }
}

impl PolicyServer {
    /// Starts the inference worker with `lm` as the shared policy's weights version `version`, and the
    /// default [`AdapterOptions`] for tenant adapters.
    ///
    /// # Errors
    /// [`Error::Internal`] when the worker thread cannot be spawned.
    pub fn start(lm: LanguageModel, version: i64, opts: ServerOptions) -> Result<PolicyServer> {
        Self::start_with_adapters(lm, version, opts, AdapterOptions::default())
    }

    /// [`PolicyServer::start`] with the bounds and tenant headers of `adapters`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty `tenant_headers` list or a name that is not an HTTP header name;
    /// [`Error::Internal`] when the worker thread cannot be spawned.
    pub fn start_with_adapters(lm: LanguageModel, version: i64, opts: ServerOptions, adapters: AdapterOptions) -> Result<PolicyServer> {
        let adapters = adapters.checked()?;
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            opts,
            adapters,
            tenants: TenantRegistry::default(),
            version: AtomicI64::new(version),
            in_flight: AtomicUsize::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            jobs: tx,
            reload_lock: tokio::sync::Mutex::new(()),
            clock: shared::TimeClock::default(),
        });
        crate::metrics::get().server_policy_version.set(version);
        let s2 = shared.clone();
        let policies = adapters::Policies::new(Box::new(lm), version);
        let worker = std::thread::Builder::new()
            .name("nextstate-inference".into())
            .spawn(move || {
                if s2.opts.threads > 0 {
                    let _ = crate::model::set_threads(s2.opts.threads as i32);
                }
                worker_loop(policies, rx, s2)
            })
            .map_err(|e| Error::Internal(format!("spawn inference worker: {e}")))?;
        Ok(PolicyServer { shared, worker: Some(worker) })
    }

    /// A handle for version queries and reloads (for the in-process checkpoint consumer).
    pub fn handle(&self) -> PolicyHandle {
        PolicyHandle { shared: self.shared.clone() }
    }

    /// The HTTP routes: `POST /v1/chat/completions`, `POST /v1/completions` (prompt log-probs, vLLM style),
    /// `GET /v1/models` (the shared model and every tenant adapter), `GET /health`, `POST /v1/reload`
    /// (`{"path", "version"}`, and `"tenant"` for a tenant's adapter), `GET /metrics` (the process-wide
    /// [`crate::metrics`], OpenMetrics text); any other path is a JSON 404 and another method on a
    /// route a JSON 405 (OpenAI error shape).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/v1/reload", post(reload))
            .route("/metrics", get(metrics))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(self.shared.clone(), auth_and_version))
            .layer(DefaultBodyLimit::max(self.shared.opts.max_body_bytes))
            .with_state(self.shared.clone())
    }

    /// Serves on `listener` (a plain `TcpListener`, or a [`crate::net::Listener`] that speaks TLS) under
    /// [`ServerOptions::limits`] until `shutdown` resolves (in-flight requests are finished first).
    ///
    /// # Errors
    /// [`Error::Http`] when the server fails.
    pub async fn serve(self, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<()> {
        let app = self.router();
        crate::net::serve_app_with(listener.into(), app, self.shared.opts.limits, shutdown).await.map_err(|e| Error::Http(format!("server: {e}")))
    }
}

impl Drop for PolicyServer {
    fn drop(&mut self) {
        let _ = self.shared.jobs.send(WorkerMsg::Shutdown);
        if let Some(w) = self.worker.take() {
            // The worker finishes its current batch first; don't wait for it here (it may be long).
            drop(w);
        }
    }
}

// The model moves into the worker thread.
const _: fn() = || {
    fn is_send<T: Send>() {}
    is_send::<LanguageModel>();
};
