//! The messages between the HTTP handlers and the inference worker: jobs ([`Job`], [`CompletionJob`])
//! and what comes back ([`JobEvent`], [`TokenOut`], [`CompletionOut`]), and everything else the worker
//! is sent ([`WorkerMsg`]).

use std::path::PathBuf;

use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::model::{Generation, LanguageModel, SamplingParams};
use crate::schema::Message;

/// One token as reported to a request.
#[derive(Debug, Clone)]
pub(super) struct TokenOut {
    pub(super) id: u32,
    pub(super) logprob: f32,
    pub(super) bytes: Vec<u8>,
    /// (id, bytes, log-prob) of the alternatives.
    pub(super) top: Vec<(u32, Vec<u8>, f32)>,
    pub(super) text: String,
}

pub(super) enum JobEvent {
    /// `adapter`: the tenant whose adapter serves the job (None: the shared policy); `version`: that
    /// policy's version.
    Started { version: i64, adapter: Option<String>, prompt_ids: Vec<u32> },
    Token(TokenOut),
    Done(Generation),
    Failed { status: StatusCode, message: String },
}

pub(super) struct Job {
    /// The tenant whose adapter serves the job (None: the shared policy).
    pub(super) adapter: Option<String>,
    pub(super) messages: Vec<Message>,
    pub(super) tools: Option<Value>,
    pub(super) template_kwargs: Option<serde_json::Map<String, Value>>,
    pub(super) params: SamplingParams,
    pub(super) extra_stop_ids: Vec<u32>,
    pub(super) events: UnboundedSender<JobEvent>,
}

/// A `/v1/completions` prompt as the worker receives it.
pub(super) enum PromptInput {
    Ids(Vec<u32>),
    Text(String),
}

/// One `/v1/completions` request: prompt log-probs (when asked) and then, when `params.max_new_tokens`
/// > 0, a generated continuation.
pub(super) struct CompletionJob {
    /// The tenant whose adapter serves the job (None: the shared policy).
    pub(super) adapter: Option<String>,
    pub(super) prompt: PromptInput,
    /// K of `prompt_logprobs`, when asked.
    pub(super) prompt_logprobs: Option<usize>,
    pub(super) params: SamplingParams,
    pub(super) reply: tokio::sync::oneshot::Sender<std::result::Result<CompletionOut, (StatusCode, String)>>,
}

/// What the worker answers a [`CompletionJob`].
pub(super) struct CompletionOut {
    pub(super) version: i64,
    pub(super) adapter: Option<String>,
    pub(super) prompt_ids: Vec<u32>,
    /// vLLM's `prompt_logprobs` list (first element null), when asked.
    pub(super) prompt_logprobs: Option<Vec<Value>>,
    pub(super) generation: Option<Generation>,
}

pub(super) enum WorkerMsg {
    Job(Box<Job>),
    Complete(Box<CompletionJob>),
    Swap { model: Box<LanguageModel>, version: i64, ack: tokio::sync::oneshot::Sender<i64> },
    /// A tenant's adapter, loaded from `path` as `version`, made resident (the least recently used
    /// others evicted past the bounds). The ack is the tenant's previous version, or `Err(newer)` when
    /// the tenant already has a newer one (the model is then dropped).
    Install { tenant: String, path: PathBuf, model: Box<LanguageModel>, version: i64, ack: tokio::sync::oneshot::Sender<std::result::Result<Option<i64>, i64>> },
    Shutdown,
}
