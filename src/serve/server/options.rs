//! [`ServerOptions`]: the policy server's settings.

use std::path::PathBuf;

use crate::model::{LoadOptions, LogprobMode};

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
    /// Continuous batching (what `serve` and `run` do unless told otherwise): chat requests of the
    /// batch's policy that arrive while it decodes join it at the next token boundary, up to
    /// `max_batch`, and each request's response is sent at the step it finishes
    /// ([`crate::model::Decoder`]). False: static batches, where a request arriving during a batch waits
    /// for the whole batch to finish (each response is still sent at the step its sequence ends).
    /// Measured: `benches/serve.rs` (docs/BENCHMARKS.md, section 6).
    pub continuous_batching: bool,
    /// Token limit when a request sets none.
    pub default_max_tokens: usize,
    /// Default distribution of returned log-probs (requests may override with `logprobs_mode`).
    pub logprobs_mode: LogprobMode,
    /// How reloaded weights are loaded (device, dtype; always frozen).
    pub load: LoadOptions,
    /// Base model directory for adapter checkpoints and for config/tokenizer files a checkpoint lacks.
    pub base_dir: PathBuf,
    /// Fold a LoRA checkpoint's adapters into the shared policy's weights at each reload
    /// ([`crate::model::Transformer::merge_lora`]; what `serve` and `run` do unless told otherwise):
    /// decoding then runs at the base model's speed, but every reload allocates and computes new copies
    /// of the adapted projections (for SmolLM2-135M f32, about 420 MB and a second of CPU beside the
    /// decoding). False: the adapters stay attached beside the shared base, as tenant adapters are; a
    /// reload reads only the adapter files (about 0.05 s instead of 0.85 s), and decoding is slower. The measured trade:
    /// `cargo bench --bench model -- reload`, and the demo's time table (docs/serving.md).
    pub merge_lora: bool,
    /// libtorch intra-op threads of the inference worker (`policy.threads`; 0 = libtorch's default). The
    /// setting is per thread (OpenMP), so it is applied on the worker itself.
    pub threads: usize,
}
