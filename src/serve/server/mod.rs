//! The policy server: an OpenAI-compatible chat-completions endpoint over one shared [`LanguageModel`]
//! and any number of per-tenant LoRA adapters on its base, with weight hot-swap, and a vLLM-compatible
//! `/v1/completions` that scores prompts (`prompt_logprobs`), so a pipeline can use the server as its
//! remote teacher (`[teacher] backend = "vllm"`).
//!
//! Inference runs on one dedicated worker thread that owns the model (tch tensors are not `Sync`);
//! HTTP handlers send it jobs over a channel and receive token events back, so the tokio runtime never
//! blocks on CPU work. The worker drains every job queued when it becomes free (up to `max_batch`)
//! into batched generations, one per policy: a batch never mixes adapters.
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
//! blocking thread while the worker keeps serving; then a swap message is queued behind the jobs
//! already received. Jobs received before the swap finish on the old weights, later ones use the new
//! weights; nothing is rejected. A tenant's reload swaps its adapter the same way. Every response
//! names the policy that produced it: `policy_version` in the body and the `X-Policy-Version` header
//! (the adapter's own version when one served), and `policy_tenant` / `X-Policy-Tenant` (the tenant
//! whose adapter served; null / absent for the shared policy).
//!
//! This module holds the settings, the messages between handlers and worker, and start-up
//! ([`PolicyServer::start`], [`PolicyServer::router`]); `worker` is the batching inference worker,
//! `adapters` its resident tenant adapters, `tenants` the registry of tenant adapters, which policy
//! serves a request and the per-tenant reload, `handlers` the inference request handlers and `admin`
//! the other routes.

mod adapters;
mod admin;
mod handlers;
mod tenants;
mod worker;

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::model::{Generation, LanguageModel, LoadOptions, LogprobMode, SamplingParams};
use crate::schema::Message;
use crate::{Error, Result};
use admin::{auth_and_version, health, method_not_allowed, metrics, models, not_found, reload};
use handlers::{chat_completions, completions};
pub use tenants::{AdapterOptions, TenantAdapter, DEFAULT_MAX_ADAPTERS, DEFAULT_MAX_ADAPTER_BYTES};
use tenants::TenantRegistry;
use worker::worker_loop;

/// Response header carrying the policy version (of the tenant's adapter when one served the request).
pub const VERSION_HEADER: &str = "x-policy-version";

/// Response header naming the tenant whose adapter served the request; absent when the shared policy
/// served it.
pub const POLICY_TENANT_HEADER: &str = "x-policy-tenant";

/// Policy-server settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Model id reported by `/v1/models` and in responses.
    pub model_name: String,
    /// Bearer token (`Authorization: Bearer KEY`, the scheme in any case) required on every route but
    /// `/health` (none: open).
    pub api_key: Option<String>,
    /// Put `/health` behind `api_key` as well (false: `/health` stays open, for load balancers). No
    /// effect without an `api_key`.
    pub health_requires_key: bool,
    /// Header and body read timeouts and the connection cap of the listener
    /// ([`crate::net::ListenLimits`]; default 10 s, 30 s, 512 connections).
    pub limits: crate::net::ListenLimits,
    /// Largest accepted request body (bytes).
    pub max_body_bytes: usize,
    /// Most requests generated together in one batch.
    pub max_batch: usize,
    /// How long the worker waits for more requests to join a batch once it has one (a few ms costs
    /// little next to a decoding step and lets near-simultaneous requests share the batch).
    pub batch_window: std::time::Duration,
    /// Token limit when a request sets none.
    pub default_max_tokens: usize,
    /// Default distribution of returned log-probs (requests may override with `logprobs_mode`).
    pub logprobs_mode: LogprobMode,
    /// How reloaded weights are loaded (device, dtype; always frozen).
    pub load: LoadOptions,
    /// Base model directory for adapter checkpoints and for config/tokenizer files a checkpoint lacks.
    pub base_dir: PathBuf,
    /// libtorch intra-op threads of the inference worker (`policy.threads`; 0 = libtorch's default). The
    /// setting is per thread (OpenMP), so it is applied on the worker itself.
    pub threads: usize,
}

/// One token as reported to a request.
#[derive(Debug, Clone)]
struct TokenOut {
    id: u32,
    logprob: f32,
    bytes: Vec<u8>,
    /// (id, bytes, log-prob) of the alternatives.
    top: Vec<(u32, Vec<u8>, f32)>,
    text: String,
}

enum JobEvent {
    /// `adapter`: the tenant whose adapter serves the job (None: the shared policy); `version`: that
    /// policy's version.
    Started { version: i64, adapter: Option<String>, prompt_ids: Vec<u32> },
    Token(TokenOut),
    Done(Generation),
    Failed { status: StatusCode, message: String },
}

struct Job {
    /// The tenant whose adapter serves the job (None: the shared policy).
    adapter: Option<String>,
    messages: Vec<Message>,
    tools: Option<Value>,
    template_kwargs: Option<serde_json::Map<String, Value>>,
    params: SamplingParams,
    extra_stop_ids: Vec<u32>,
    events: UnboundedSender<JobEvent>,
}

/// A `/v1/completions` prompt as the worker receives it.
enum PromptInput {
    Ids(Vec<u32>),
    Text(String),
}

/// One `/v1/completions` request: prompt log-probs (when asked) and then, when `params.max_new_tokens`
/// > 0, a generated continuation.
struct CompletionJob {
    /// The tenant whose adapter serves the job (None: the shared policy).
    adapter: Option<String>,
    prompt: PromptInput,
    /// K of `prompt_logprobs`, when asked.
    prompt_logprobs: Option<usize>,
    params: SamplingParams,
    reply: tokio::sync::oneshot::Sender<std::result::Result<CompletionOut, (StatusCode, String)>>,
}

/// What the worker answers a [`CompletionJob`].
struct CompletionOut {
    version: i64,
    adapter: Option<String>,
    prompt_ids: Vec<u32>,
    /// vLLM's `prompt_logprobs` list (first element null), when asked.
    prompt_logprobs: Option<Vec<Value>>,
    generation: Option<Generation>,
}

enum WorkerMsg {
    Job(Box<Job>),
    Complete(Box<CompletionJob>),
    Swap { model: Box<LanguageModel>, version: i64, ack: tokio::sync::oneshot::Sender<i64> },
    /// A tenant's adapter, loaded from `path` as `version`, made resident (the least recently used
    /// others evicted past the bounds). The ack is the tenant's previous version, or `Err(newer)` when
    /// the tenant already has a newer one (the model is then dropped).
    Install { tenant: String, path: PathBuf, model: Box<LanguageModel>, version: i64, ack: tokio::sync::oneshot::Sender<std::result::Result<Option<i64>, i64>> },
    Shutdown,
}

struct Shared {
    opts: ServerOptions,
    adapters: AdapterOptions,
    /// Every tenant with an adapter: its newest checkpoint, version and whether it is resident.
    tenants: TenantRegistry,
    version: AtomicI64,
    in_flight: AtomicUsize,
    completed: AtomicU64,
    failed: AtomicU64,
    jobs: std::sync::mpsc::Sender<WorkerMsg>,
    reload_lock: tokio::sync::Mutex<()>,
}

/// Counts a request as in flight until dropped.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(s: &Arc<Shared>) -> InFlight {
        s.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(s.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A cheap, cloneable handle to a running policy server: version, load, reload.
#[derive(Clone)]
pub struct PolicyHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PolicyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyHandle").field("version", &self.version()).finish()
    }
}

impl PolicyHandle {
    /// The version of the shared policy new requests are served with (a tenant's adapter has its own:
    /// [`PolicyHandle::tenant_adapters`]).
    pub fn version(&self) -> i64 {
        self.shared.version.load(Ordering::SeqCst)
    }

    /// Requests currently being served.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Loads a checkpoint directory as the shared policy (full weights or adapters on the base, see
    /// [`LanguageModel::load_checkpoint`]; adapters are merged) on a blocking thread, then swaps it in
    /// behind the requests already received. Returns the previous version. Tenant adapters are not
    /// touched (they stay on the base model; [`PolicyHandle::reload_tenant`] moves one).
    ///
    /// # Errors
    /// [`Error::Config`] when `version` is lower than the current one; load errors as
    /// [`LanguageModel::load_checkpoint`]; [`Error::Internal`] when the worker is gone.
    pub async fn reload(&self, path: PathBuf, version: i64) -> Result<i64> {
        let s = &self.shared;
        let _one_at_a_time = s.reload_lock.lock().await;
        let current = s.version.load(Ordering::SeqCst);
        if version < current {
            return Err(crate::config_err!("reload to version {version} is older than the served version {current}"));
        }
        let opts = LoadOptions { trainable: crate::model::Trainable::Frozen, ..s.opts.load.clone() };
        let base = s.opts.base_dir.clone();
        let t0 = std::time::Instant::now();
        let lm = tokio::task::spawn_blocking(move || -> Result<LanguageModel> {
            let mut lm = LanguageModel::load_checkpoint(&path, Some(&base), &opts)?;
            lm.transformer_mut().merge_lora()?;
            Ok(lm)
        })
        .await
        .map_err(|e| Error::Internal(format!("reload task: {e}")))??;
        let (ack, done) = tokio::sync::oneshot::channel();
        s.jobs.send(WorkerMsg::Swap { model: Box::new(lm), version, ack }).map_err(|_| Error::Internal("inference worker stopped".into()))?;
        let old = done.await.map_err(|_| Error::Internal("inference worker stopped before the swap".into()))?;
        tracing::info!("reloaded version {version} in {:.1} s", t0.elapsed().as_secs_f64());
        Ok(old)
    }
}

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
