//! The policy server: an OpenAI-compatible chat-completions endpoint over one [`LanguageModel`], with
//! weight hot-swap, and a vLLM-compatible `/v1/completions` that scores prompts (`prompt_logprobs`), so
//! a pipeline can use the server as its remote teacher (`[teacher] backend = "vllm"`).
//!
//! Inference runs on one dedicated worker thread that owns the model (tch tensors are not `Sync`);
//! HTTP handlers send it jobs over a channel and receive token events back, so the tokio runtime never
//! blocks on CPU work. The worker drains every job queued when it becomes free (up to `max_batch`)
//! into one batched generation.
//!
//! **Reload** (`POST /v1/reload` or [`PolicyHandle::reload`]): the new weights are loaded on a
//! blocking thread while the worker keeps serving; then a swap message is queued behind the jobs
//! already received. Jobs received before the swap finish on the old weights, later ones use the new
//! weights; nothing is rejected. Every response names the version that produced it (`policy_version`
//! in the body, `X-Policy-Version` header).
//!
//! This module holds the settings, the messages between handlers and worker, and start-up
//! ([`PolicyServer::start`], [`PolicyServer::router`]); `worker` is the batching inference worker and
//! `handlers` the HTTP request handlers.

mod handlers;
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
use handlers::{auth_and_version, chat_completions, completions, health, method_not_allowed, metrics, models, not_found, reload};
use worker::worker_loop;

/// Response header carrying the policy version.
pub const VERSION_HEADER: &str = "x-policy-version";

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
    Started { version: i64, prompt_ids: Vec<u32> },
    Token(TokenOut),
    Done(Generation),
    Failed { status: StatusCode, message: String },
}

struct Job {
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
    prompt: PromptInput,
    /// K of `prompt_logprobs`, when asked.
    prompt_logprobs: Option<usize>,
    params: SamplingParams,
    reply: tokio::sync::oneshot::Sender<std::result::Result<CompletionOut, (StatusCode, String)>>,
}

/// What the worker answers a [`CompletionJob`].
struct CompletionOut {
    version: i64,
    prompt_ids: Vec<u32>,
    /// vLLM's `prompt_logprobs` list (first element null), when asked.
    prompt_logprobs: Option<Vec<Value>>,
    generation: Option<Generation>,
}

enum WorkerMsg {
    Job(Box<Job>),
    Complete(Box<CompletionJob>),
    Swap { model: Box<LanguageModel>, version: i64, ack: tokio::sync::oneshot::Sender<i64> },
    Shutdown,
}

struct Shared {
    opts: ServerOptions,
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
    /// The version new requests are served with.
    pub fn version(&self) -> i64 {
        self.shared.version.load(Ordering::SeqCst)
    }

    /// Requests currently being served.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Loads a checkpoint directory (full weights or adapters on the base, see
    /// [`LanguageModel::load_checkpoint`]; adapters are merged) on a blocking thread, then swaps it in
    /// behind the requests already received. Returns the previous version.
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
    /// Starts the inference worker with `lm` as weights version `version`.
    ///
    /// # Errors
    /// [`Error::Internal`] when the worker thread cannot be spawned.
    pub fn start(lm: LanguageModel, version: i64, opts: ServerOptions) -> Result<PolicyServer> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            opts,
            version: AtomicI64::new(version),
            in_flight: AtomicUsize::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            jobs: tx,
            reload_lock: tokio::sync::Mutex::new(()),
        });
        crate::metrics::get().server_policy_version.set(version);
        let s2 = shared.clone();
        let lm = Box::new(lm);
        let worker = std::thread::Builder::new()
            .name("nextstate-inference".into())
            .spawn(move || {
                if s2.opts.threads > 0 {
                    let _ = crate::model::set_threads(s2.opts.threads as i32);
                }
                worker_loop(lm, version, rx, s2)
            })
            .map_err(|e| Error::Internal(format!("spawn inference worker: {e}")))?;
        Ok(PolicyServer { shared, worker: Some(worker) })
    }

    /// A handle for version queries and reloads (for the in-process checkpoint consumer).
    pub fn handle(&self) -> PolicyHandle {
        PolicyHandle { shared: self.shared.clone() }
    }

    /// The HTTP routes: `POST /v1/chat/completions`, `POST /v1/completions` (prompt log-probs, vLLM style),
    /// `GET /v1/models`, `GET /health`, `POST /v1/reload`, `GET /metrics` (the process-wide
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
