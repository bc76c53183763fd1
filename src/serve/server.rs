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

use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::openai::{error_body, messages_from_openai, split_tool_calls, ChatCompletionRequest, CompletionRequest, PromptField, MAX_PROMPT_LOGPROBS};
use crate::model::generate::check_request;
use crate::model::{FinishReason, Generation, GenerationRequest, LanguageModel, LoadOptions, LogprobMode, SamplingParams};
use crate::schema::Message;
use crate::{Error, Result};

/// Response header carrying the policy version.
pub const VERSION_HEADER: &str = "x-policy-version";

/// Policy-server settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Model id reported by `/v1/models` and in responses.
    pub model_name: String,
    /// Bearer token required on every route but `/health` (none: open).
    pub api_key: Option<String>,
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

/// Renders and validates one job; `Err` is (HTTP status, message) for that job alone.
fn prepare(lm: &LanguageModel, job: &Job) -> std::result::Result<GenerationRequest, (StatusCode, String)> {
    let chat = lm.chat_template().ok_or((StatusCode::BAD_REQUEST, format!("model {} has no chat template", lm.dir().display())))?;
    let text = chat.render(&job.messages, job.tools.as_ref(), true, job.template_kwargs.as_ref()).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let prompt_ids = lm.encode(&text).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let mut params = job.params.clone();
    let mut stops = lm.eos_token_ids().to_vec();
    stops.extend(job.extra_stop_ids.iter().copied());
    params.stop_token_ids = Some(stops);
    let req = GenerationRequest { prompt_ids, params };
    check_request(&lm.transformer().config, &req).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    if let Some(&bad) = job.extra_stop_ids.iter().find(|&&t| t as usize >= lm.transformer().config.vocab_size) {
        return Err((StatusCode::BAD_REQUEST, format!("stop token id {bad} outside the vocabulary")));
    }
    Ok(req)
}

fn run_batch(lm: &LanguageModel, version: i64, jobs: Vec<Job>, shared: &Shared) {
    let mut ready: Vec<(Job, GenerationRequest)> = Vec::with_capacity(jobs.len());
    for job in jobs {
        match prepare(lm, &job) {
            Ok(req) => {
                let _ = job.events.send(JobEvent::Started { version, prompt_ids: req.prompt_ids.clone() });
                ready.push((job, req));
            }
            Err((status, message)) => {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(JobEvent::Failed { status, message });
            }
        }
    }
    if ready.is_empty() {
        return;
    }
    let reqs: Vec<GenerationRequest> = ready.iter().map(|(_, r)| r.clone()).collect();
    let tok = lm.tokenizer();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lm.generate_stream(&reqs, &mut |ev| {
            let Some((job, _)) = ready.get(ev.request) else { return false };
            let top = ev.top_logprobs.iter().map(|&(id, lp)| (id, tok.token_bytes(id), lp)).collect();
            let out = TokenOut { id: ev.token_id, logprob: ev.logprob, bytes: tok.token_bytes(ev.token_id), top, text: ev.text_delta.to_string() };
            // A closed channel means the client went away: cancel this sequence.
            job.events.send(JobEvent::Token(out)).is_ok()
        })
    }));
    match result {
        Ok(Ok(gens)) => {
            for ((job, _), g) in ready.into_iter().zip(gens) {
                shared.completed.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(JobEvent::Done(g));
            }
        }
        Ok(Err(e)) => {
            tracing::error!("generation failed for a batch of {} requests: {e}", ready.len());
            for (job, _) in ready {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                let status = if matches!(e, Error::InvalidInput(_)) { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
                let _ = job.events.send(JobEvent::Failed { status, message: e.to_string() });
            }
        }
        Err(_) => {
            tracing::error!("generation panicked for a batch of {} requests", ready.len());
            for (job, _) in ready {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(JobEvent::Failed { status: StatusCode::INTERNAL_SERVER_ERROR, message: "internal error during generation".into() });
            }
        }
    }
}

fn worker_loop(mut lm: Box<LanguageModel>, mut version: i64, rx: std::sync::mpsc::Receiver<WorkerMsg>, shared: Arc<Shared>) {
    let max_batch = shared.opts.max_batch.max(1);
    let mut pending: VecDeque<WorkerMsg> = VecDeque::new();
    loop {
        let msg = match pending.pop_front() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => return,
            },
        };
        match msg {
            WorkerMsg::Shutdown => return,
            WorkerMsg::Swap { model, version: v, ack } => {
                let old = version;
                lm = model;
                version = v;
                shared.version.store(v, Ordering::SeqCst);
                tracing::info!("policy weights swapped: version {old} -> {v}");
                let _ = ack.send(old);
            }
            WorkerMsg::Job(job) => {
                let batch = take_batch(*job, &rx, &shared, max_batch, &mut pending, |m| match m {
                    WorkerMsg::Job(j) => Ok(*j),
                    other => Err(other),
                });
                run_batch(&lm, version, batch, &shared);
            }
            WorkerMsg::Complete(job) => {
                let batch = take_batch(*job, &rx, &shared, max_batch, &mut pending, |m| match m {
                    WorkerMsg::Complete(j) => Ok(*j),
                    other => Err(other),
                });
                run_completions(&lm, version, batch, &shared);
            }
        }
    }
}

/// `first` and the messages of its kind (`same` returns them, and gives any other back) queued now or
/// arriving within the batching window, at most `max_batch`. Another kind of message ends the batch and
/// waits in `pending`, so order is kept and a batch never crosses a swap.
fn take_batch<T>(
    first: T,
    rx: &std::sync::mpsc::Receiver<WorkerMsg>,
    shared: &Shared,
    max_batch: usize,
    pending: &mut VecDeque<WorkerMsg>,
    same: impl Fn(WorkerMsg) -> std::result::Result<T, WorkerMsg>,
) -> Vec<T> {
    let mut batch = vec![first];
    let deadline = std::time::Instant::now() + shared.opts.batch_window;
    while batch.len() < max_batch {
        let wait = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(wait) {
            Ok(m) => match same(m) {
                Ok(j) => batch.push(j),
                Err(other) => {
                    pending.push_back(other);
                    break;
                }
            },
            Err(_) => break,
        }
    }
    batch
}

/// The log-prob as vLLM writes it: −∞ (and NaN) as −9999.0 (`clamp_prompt_logprobs`).
fn wire_logprob(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// vLLM's `prompt_logprobs` for `ids` from their scores (`scored` scores `ids[1..]` after `ids[..1]`):
/// `null` for position 0, then per position a map from token id (as a string) to `{logprob, rank,
/// decoded_token}` holding the prompt token (rank: 1-based, in the whole vocabulary) and the `k` most
/// likely tokens (ranks 1..=k; a prompt token among them carries its top-K rank, as in vLLM).
fn prompt_logprobs_json(lm: &LanguageModel, ids: &[u32], scored: Option<&crate::model::ScoredResponse>, k: usize) -> Vec<Value> {
    let decoded = |id: u32| lm.decode(&[id], false).unwrap_or_default();
    let mut out = vec![Value::Null];
    let Some(s) = scored else { return out };
    for (t, &id) in ids.iter().skip(1).enumerate() {
        let mut m = serde_json::Map::new();
        let rank = s.ranks.as_ref().and_then(|r| r.get(t)).copied().unwrap_or(1);
        m.insert(id.to_string(), json!({"logprob": wire_logprob(s.logprobs[t]), "rank": rank, "decoded_token": decoded(id)}));
        if let (Some(top_ids), Some(top_lps)) = (&s.topk_ids, &s.topk_logprobs) {
            for (j, (&tid, &lp)) in top_ids[t].iter().zip(&top_lps[t]).take(k).enumerate() {
                m.insert(tid.to_string(), json!({"logprob": wire_logprob(lp), "rank": j + 1, "decoded_token": decoded(tid)}));
            }
        }
        out.push(Value::Object(m));
    }
    out
}

/// The prompt ids of a completion job: the ids given (checked against the vocabulary), or the text
/// tokenised without special tokens.
fn completion_prompt(lm: &LanguageModel, job: &CompletionJob) -> std::result::Result<Vec<u32>, (StatusCode, String)> {
    let ids = match &job.prompt {
        PromptInput::Ids(ids) => ids.clone(),
        PromptInput::Text(text) => lm.encode(text).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    };
    let config = &lm.transformer().config;
    if ids.is_empty() {
        return Err((StatusCode::BAD_REQUEST, "empty prompt".into()));
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
        return Err((StatusCode::BAD_REQUEST, format!("token id {bad} outside the vocabulary of {}", config.vocab_size)));
    }
    if ids.len() > config.max_position_embeddings {
        return Err((StatusCode::BAD_REQUEST, format!("prompt of {} tokens exceeds the context of {}", ids.len(), config.max_position_embeddings)));
    }
    Ok(ids)
}

/// The value of a batched model call (`what`) over the jobs `jobs`, or `None` after recording its error
/// (400 for invalid input, else 500) or panic (500) in `failed` for each of them.
fn batch_outcome<T>(outcome: std::thread::Result<Result<T>>, what: &str, jobs: &[usize], failed: &mut [Option<(StatusCode, String)>]) -> Option<T> {
    let (status, message) = match outcome {
        Ok(Ok(v)) => return Some(v),
        Ok(Err(e)) => {
            tracing::error!("{what} failed for a batch of {} completion requests: {e}", jobs.len());
            let status = if matches!(e, Error::InvalidInput(_)) { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
            (status, e.to_string())
        }
        Err(_) => {
            tracing::error!("{what} panicked for a batch of {} completion requests", jobs.len());
            (StatusCode::INTERNAL_SERVER_ERROR, format!("internal error during {what}"))
        }
    };
    for &i in jobs {
        failed[i] = Some((status, message.clone()));
    }
    None
}

/// Runs a batch of completion jobs: one scoring call ([`LanguageModel::score_ranked`], the code the
/// local teacher scores with) for the prompts that ask for log-probs, then one generation call for
/// those with tokens to generate. A job that fails alone gets its own error; a failed call fails the
/// jobs in it.
fn run_completions(lm: &LanguageModel, version: i64, jobs: Vec<CompletionJob>, shared: &Shared) {
    let fail = |job: CompletionJob, status: StatusCode, message: String| {
        shared.failed.fetch_add(1, Ordering::Relaxed);
        let _ = job.reply.send(Err((status, message)));
    };
    let mut ready: Vec<(CompletionJob, CompletionOut)> = Vec::with_capacity(jobs.len());
    for job in jobs {
        match completion_prompt(lm, &job) {
            Ok(prompt_ids) => ready.push((job, CompletionOut { version, prompt_ids, prompt_logprobs: None, generation: None })),
            Err((status, message)) => fail(job, status, message),
        }
    }
    // Prompt log-probs: position t + 1 scored after ids[..t + 1], as a response after a one-token prompt.
    let scoring: Vec<usize> = (0..ready.len()).filter(|&i| ready[i].0.prompt_logprobs.is_some() && ready[i].1.prompt_ids.len() > 1).collect();
    let k_max = scoring.iter().filter_map(|&i| ready[i].0.prompt_logprobs).max().unwrap_or(0);
    let items: Vec<(Vec<u32>, Vec<u32>)> = scoring.iter().map(|&i| (ready[i].1.prompt_ids[..1].to_vec(), ready[i].1.prompt_ids[1..].to_vec())).collect();
    let scored = if items.is_empty() {
        Ok(Ok(vec![]))
    } else {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lm.score_ranked(&items, k_max)))
    };
    let mut failed: Vec<Option<(StatusCode, String)>> = vec![None; ready.len()];
    if let Some(scores) = batch_outcome(scored, "prompt scoring", &scoring, &mut failed) {
        let mut by_job: Vec<Option<crate::model::ScoredResponse>> = vec![None; ready.len()];
        for (&i, sc) in scoring.iter().zip(scores) {
            by_job[i] = Some(sc);
        }
        for ((job, out), sc) in ready.iter_mut().zip(by_job) {
            if let Some(k) = job.prompt_logprobs {
                out.prompt_logprobs = Some(prompt_logprobs_json(lm, &out.prompt_ids, sc.as_ref(), k));
            }
        }
    }
    // Generation for the jobs with tokens to generate.
    let mut generating = vec![];
    let mut reqs = vec![];
    for (i, (job, out)) in ready.iter().enumerate() {
        if failed[i].is_some() || job.params.max_new_tokens == 0 {
            continue;
        }
        let mut params = job.params.clone();
        params.stop_token_ids = Some(lm.eos_token_ids().to_vec());
        let req = GenerationRequest { prompt_ids: out.prompt_ids.clone(), params };
        match check_request(&lm.transformer().config, &req) {
            Ok(()) => {
                generating.push(i);
                reqs.push(req);
            }
            Err(e) => failed[i] = Some((StatusCode::BAD_REQUEST, e.to_string())),
        }
    }
    if !reqs.is_empty() {
        let generated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lm.generate_stream(&reqs, &mut |_| true)));
        if let Some(gens) = batch_outcome(generated, "generation", &generating, &mut failed) {
            for (&i, g) in generating.iter().zip(gens) {
                ready[i].1.generation = Some(g);
            }
        }
    }
    for ((job, out), f) in ready.into_iter().zip(failed) {
        match f {
            Some((status, message)) => fail(job, status, message),
            None => {
                shared.completed.fetch_add(1, Ordering::Relaxed);
                let _ = job.reply.send(Ok(out));
            }
        }
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
    /// `GET /v1/models`, `GET /health`, `POST /v1/reload`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/v1/reload", post(reload))
            .layer(axum::middleware::from_fn_with_state(self.shared.clone(), auth_and_version))
            .layer(DefaultBodyLimit::max(self.shared.opts.max_body_bytes))
            .with_state(self.shared.clone())
    }

    /// Serves on `listener` (a plain `TcpListener`, or a [`crate::net::Listener`] that speaks TLS) until
    /// `shutdown` resolves (in-flight requests are finished first).
    ///
    /// # Errors
    /// [`Error::Http`] when the server fails.
    pub async fn serve(self, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<()> {
        let app = self.router();
        crate::net::serve_app(listener.into(), app, shutdown).await.map_err(|e| Error::Http(format!("server: {e}")))
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

fn api_error(status: StatusCode, message: &str, kind: &str) -> Response {
    (status, Json(error_body(message, kind, None))).into_response()
}

fn error_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 404 | 409 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        _ => "server_error",
    }
}

/// Bearer auth (constant-time) on every route but `/health`, and `X-Policy-Version` on every response
/// that does not set it itself.
async fn auth_and_version(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.opts.api_key {
        if req.uri().path() != "/health" {
            let given = req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
            if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
                let mut r = api_error(StatusCode::UNAUTHORIZED, "invalid or missing API key", "authentication_error");
                set_version(&mut r, s.version.load(Ordering::SeqCst));
                return r;
            }
        }
    }
    let mut r = next.run(req).await;
    if !r.headers().contains_key(VERSION_HEADER) {
        set_version(&mut r, s.version.load(Ordering::SeqCst));
    }
    r
}

fn set_version(r: &mut Response, v: i64) {
    if let Ok(h) = HeaderValue::from_str(&v.to_string()) {
        r.headers_mut().insert(VERSION_HEADER, h);
    }
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": s.opts.model_name, "object": "model", "created": 0, "owned_by": "nextstate",
        "policy_version": s.version.load(Ordering::SeqCst)}]}))
    .into_response()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    Json(json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "model": s.opts.model_name,
        "policy_version": s.version.load(Ordering::SeqCst),
        "requests_in_flight": s.in_flight.load(Ordering::SeqCst),
        "requests_completed": s.completed.load(Ordering::Relaxed),
        "requests_failed": s.failed.load(Ordering::Relaxed),
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadRequest {
    path: PathBuf,
    version: i64,
}

async fn reload(State(s): State<Arc<Shared>>, body: std::result::Result<Json<ReloadRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, &e.body_text(), "invalid_request_error"),
    };
    let handle = PolicyHandle { shared: s.clone() };
    match handle.reload(req.path.clone(), req.version).await {
        Ok(previous) => Json(json!({"policy_version": req.version, "previous_version": previous, "path": req.path})).into_response(),
        Err(e) => {
            let status = match &e {
                Error::Config(_) => StatusCode::CONFLICT,
                Error::Io { .. } | Error::Model(_) | Error::Json(_) => StatusCode::UNPROCESSABLE_ENTITY,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            api_error(status, &e.to_string(), error_kind(status))
        }
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn logprob_entry(t: &TokenOut) -> Value {
    json!({
        "token": lossy(&t.bytes),
        "logprob": t.logprob,
        "bytes": t.bytes,
        "top_logprobs": t.top.iter().map(|(_, b, lp)| json!({"token": lossy(b), "logprob": lp, "bytes": b})).collect::<Vec<_>>(),
    })
}

fn finish_str(g: &Generation, has_tool_calls: bool) -> &'static str {
    if has_tool_calls {
        "tool_calls"
    } else {
        match g.finish_reason {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn chat_completions(State(s): State<Arc<Shared>>, body: std::result::Result<Json<ChatCompletionRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(e.status(), &e.body_text(), error_kind(e.status())),
    };
    if req.n.unwrap_or(1) != 1 {
        return api_error(StatusCode::BAD_REQUEST, "only n = 1 is supported", "invalid_request_error");
    }
    let messages = match messages_from_openai(&req.messages) {
        Ok(m) if !m.is_empty() => m,
        Ok(_) => return api_error(StatusCode::BAD_REQUEST, "messages must not be empty", "invalid_request_error"),
        Err(e) => return api_error(StatusCode::BAD_REQUEST, &e.to_string(), "invalid_request_error"),
    };
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top_logprobs = if want_logprobs { req.top_logprobs.unwrap_or(0) } else { 0 };
    let logprob_mode = match req.logprobs_mode.as_deref() {
        None => s.opts.logprobs_mode,
        Some("sampling") => LogprobMode::Sampling,
        Some("raw") => LogprobMode::Raw,
        Some(other) => return api_error(StatusCode::BAD_REQUEST, &format!("logprobs_mode {other:?} (sampling or raw)"), "invalid_request_error"),
    };
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(0),
        max_new_tokens: req.max_completion_tokens.or(req.max_tokens).unwrap_or(s.opts.default_max_tokens),
        stop_token_ids: None,
        stop_strings: req.stop.clone().map(|x| x.into_vec()).unwrap_or_default(),
        seed: req.seed,
        top_logprobs,
        logprob_mode,
    };
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        messages,
        tools: req.tools.clone(),
        template_kwargs: req.chat_template_kwargs.clone(),
        params,
        extra_stop_ids: req.stop_token_ids.clone().unwrap_or_default(),
        events: tx,
    };
    let guard = InFlight::new(&s);
    if s.jobs.send(WorkerMsg::Job(Box::new(job))).is_err() {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker stopped", "server_error");
    }
    let (version, prompt_ids) = match rx.recv().await {
        Some(JobEvent::Started { version, prompt_ids }) => (version, prompt_ids),
        Some(JobEvent::Failed { status, message }) => return api_error(status, &message, error_kind(status)),
        _ => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let model = s.opts.model_name.clone();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().map(|o| o.include_usage).unwrap_or(false);
        let (etx, erx) = unbounded_channel::<std::result::Result<Event, Infallible>>();
        tokio::spawn(stream_events(rx, etx, StreamCtx { id, created, model, version, prompt_ids, want_logprobs, include_usage, _guard: guard }));
        let sse = Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(erx)).keep_alive(KeepAlive::default());
        let mut r = sse.into_response();
        set_version(&mut r, version);
        return r;
    }
    let mut tokens: Vec<TokenOut> = Vec::new();
    let generation = loop {
        match rx.recv().await {
            Some(JobEvent::Token(t)) => tokens.push(t),
            Some(JobEvent::Done(g)) => break g,
            Some(JobEvent::Failed { status, message }) => return api_error(status, &message, error_kind(status)),
            Some(JobEvent::Started { .. }) => {}
            None => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
        }
    };
    drop(guard);
    let (content, tool_calls) = split_tool_calls(&generation.text);
    let mut message = json!({"role": "assistant", "content": content});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls.clone());
    }
    let logprobs = if want_logprobs { json!({"content": tokens.iter().map(logprob_entry).collect::<Vec<_>>()}) } else { Value::Null };
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_str(&generation, !tool_calls.is_empty()),
            "token_ids": generation.token_ids,
        }],
        "usage": usage(prompt_ids.len(), generation.token_ids.len()),
        "policy_version": version,
        "prompt_token_ids": prompt_ids,
    });
    let mut r = Json(body).into_response();
    set_version(&mut r, version);
    r
}

/// `POST /v1/completions`: OpenAI's legacy completions with vLLM's `prompt_logprobs` extension, scoring
/// first. The prompt is token ids (used as given) or a text (tokenised without special tokens).
/// With `prompt_logprobs: K`, `choices[0].prompt_logprobs` is vLLM's list: `null` for the first
/// position, then per position a map `{"<token id>": {"logprob", "rank", "decoded_token"}}` with the
/// prompt token (rank in the whole vocabulary, 1 = most likely) and the K most likely tokens (ranks
/// 1..=K); log-probs in nats from the same scoring code as the local teacher
/// ([`LanguageModel::score_ranked`]) under the weights being served. Then `max_tokens` tokens (default
/// 16; 0 = none) are generated with the request's sampling parameters (the chat route's generator), as
/// `text`. `choices[0].prompt_token_ids` and `token_ids` give the ids. Not supported (400): `n` > 1,
/// `stream`, `echo`, `logprobs` of generated tokens, several prompts.
async fn completions(State(s): State<Arc<Shared>>, body: std::result::Result<Json<CompletionRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(e.status(), &e.body_text(), error_kind(e.status())),
    };
    let refuse = |m: &str| api_error(StatusCode::BAD_REQUEST, m, "invalid_request_error");
    if req.n.unwrap_or(1) != 1 {
        return refuse("only n = 1 is supported");
    }
    if req.stream.unwrap_or(false) {
        return refuse("stream is not supported on /v1/completions (use /v1/chat/completions)");
    }
    if req.echo.unwrap_or(false) {
        return refuse("echo is not supported (prompt_token_ids and prompt_logprobs give the prompt)");
    }
    if req.logprobs.is_some_and(|n| n > 0) {
        return refuse("logprobs of generated tokens are not supported on /v1/completions (use /v1/chat/completions); prompt_logprobs is");
    }
    let prompt = match req.prompt {
        PromptField::Ids(ids) => PromptInput::Ids(ids),
        PromptField::Text(t) => PromptInput::Text(t),
        PromptField::ManyIds(mut v) if v.len() == 1 => PromptInput::Ids(v.remove(0)),
        PromptField::ManyTexts(mut v) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        _ => return refuse("one prompt per request"),
    };
    let prompt_logprobs = match req.prompt_logprobs {
        None => None,
        Some(k) if (0..=MAX_PROMPT_LOGPROBS as i64).contains(&k) => Some(k as usize),
        Some(k) => return refuse(&format!("prompt_logprobs = {k}: must be in 0..={MAX_PROMPT_LOGPROBS}")),
    };
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(0),
        max_new_tokens: req.max_tokens.unwrap_or(16),
        stop_token_ids: None,
        stop_strings: req.stop.map(|x| x.into_vec()).unwrap_or_default(),
        seed: req.seed,
        top_logprobs: 0,
        logprob_mode: s.opts.logprobs_mode,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let _guard = InFlight::new(&s);
    if s.jobs.send(WorkerMsg::Complete(Box::new(CompletionJob { prompt, prompt_logprobs, params, reply: tx }))).is_err() {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker stopped", "server_error");
    }
    let out = match rx.await {
        Ok(Ok(out)) => out,
        Ok(Err((status, message))) => return api_error(status, &message, error_kind(status)),
        Err(_) => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
    };
    let (text, token_ids, finish) = match &out.generation {
        Some(g) => (g.text.clone(), g.token_ids.clone(), finish_str(g, false)),
        None => (String::new(), vec![], "length"),
    };
    let body = json!({
        "id": format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "text_completion",
        "created": chrono::Utc::now().timestamp(),
        "model": s.opts.model_name,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish,
            "stop_reason": null,
            "prompt_logprobs": out.prompt_logprobs,
            "prompt_token_ids": out.prompt_ids,
            "token_ids": token_ids,
        }],
        "usage": usage(out.prompt_ids.len(), token_ids.len()),
        "policy_version": out.version,
    });
    let mut r = Json(body).into_response();
    set_version(&mut r, out.version);
    r
}

struct StreamCtx {
    id: String,
    created: i64,
    model: String,
    version: i64,
    prompt_ids: Vec<u32>,
    want_logprobs: bool,
    include_usage: bool,
    _guard: InFlight,
}

impl StreamCtx {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "policy_version": self.version, "choices": choices})
    }
}

fn data(v: &Value) -> std::result::Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Turns job events into SSE chunks: a role chunk (with `prompt_token_ids`), one chunk per token, a
/// final chunk with `finish_reason` (and parsed `tool_calls`), an optional usage chunk, `[DONE]`.
async fn stream_events(mut rx: UnboundedReceiver<JobEvent>, tx: UnboundedSender<std::result::Result<Event, Infallible>>, ctx: StreamCtx) {
    let mut first = ctx.chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]));
    first["prompt_token_ids"] = json!(ctx.prompt_ids);
    if tx.send(data(&first)).is_err() {
        return;
    }
    let mut completion = 0usize;
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Token(t) => {
                completion += 1;
                let logprobs = if ctx.want_logprobs { json!({"content": [logprob_entry(&t)]}) } else { Value::Null };
                let c = ctx.chunk(json!([{"index": 0, "delta": {"content": t.text}, "logprobs": logprobs, "finish_reason": null, "token_ids": [t.id]}]));
                // The client went away: dropping `rx` makes the worker cancel the sequence.
                if tx.send(data(&c)).is_err() {
                    return;
                }
            }
            JobEvent::Done(g) => {
                let (_, calls) = split_tool_calls(&g.text);
                let mut delta = json!({});
                if !calls.is_empty() {
                    delta["tool_calls"] = Value::Array(calls.iter().enumerate().map(|(i, c)| {
                        let mut c = c.clone();
                        c["index"] = json!(i);
                        c
                    }).collect());
                }
                let last = ctx.chunk(json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_str(&g, !calls.is_empty())}]));
                let _ = tx.send(data(&last));
                if ctx.include_usage {
                    let mut u = ctx.chunk(json!([]));
                    u["usage"] = usage(ctx.prompt_ids.len(), completion);
                    let _ = tx.send(data(&u));
                }
                let _ = tx.send(Ok(Event::default().data("[DONE]")));
                return;
            }
            JobEvent::Failed { message, .. } => {
                let _ = tx.send(data(&error_body(&message, "server_error", None)));
                let _ = tx.send(Ok(Event::default().data("[DONE]")));
                return;
            }
            JobEvent::Started { .. } => {}
        }
    }
}

// The model moves into the worker thread.
const _: fn() = || {
    fn is_send<T: Send>() {}
    is_send::<LanguageModel>();
};
