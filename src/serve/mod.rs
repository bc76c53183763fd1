//! Serving: the policy server (OpenAI-compatible chat completions over the model runtime, with
//! weight hot-swap) — [`server`] —, the capture proxy in front of any OpenAI-compatible server —
//! [`proxy`] —, the OpenAI wire types they share — [`openai`] — and the reloading of external
//! servers (ours, vLLM, SGLang) with each checkpoint — [`reload`].

pub mod config;
pub mod openai;
pub mod proxy;
pub mod reload;
pub mod server;

use std::path::PathBuf;

use clap::Args;

pub use config::ServeConfig;
pub use server::{AdapterOptions, PolicyHandle, PolicyServer, ServerOptions, ServerTime, TenantAdapter, POLICY_TENANT_HEADER, VERSION_HEADER};

use crate::model::{LanguageModel, LoadOptions, LogprobMode, Trainable};
use crate::{Error, Result};

/// `nextstate serve`: run the policy server.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model directory (HF layout) or a trainer checkpoint (full weights, or adapters on --base).
    #[arg(long)]
    pub model: PathBuf,
    /// Base model for an adapter checkpoint given as --model, and for later reloads of adapters.
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// Keep a LoRA checkpoint's adapters attached beside the base, at start and at each reload, instead
    /// of folding them into the weights: a reload then reads only the adapter files (about 0.05 s, no
    /// new copy of the adapted projections) but decoding is slower (docs/serving.md, "Weight reloads").
    #[arg(long)]
    pub unmerged_lora: bool,
    /// Static batches instead of continuous batching: a request arriving while a batch decodes waits
    /// for the whole batch to finish (docs/serving.md, "Batching").
    #[arg(long)]
    pub static_batching: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "NEXTSTATE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Require the API key on /health too (default: /health is open, for load balancers).
    #[arg(long)]
    pub health_requires_key: bool,
    /// Header and body read timeouts and the connection cap.
    #[command(flatten)]
    pub limits: crate::net::ListenLimitArgs,
    /// Model id reported to clients (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Policy version of the initial weights.
    #[arg(long, default_value_t = 0)]
    pub policy_version: i64,
    /// Device: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Weight dtype: f32, f16, bf16 or auto (f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// libtorch intra-op threads (default: libtorch's own choice).
    #[arg(long, env = "NEXTSTATE_THREADS")]
    pub threads: Option<i32>,
    /// Most concurrent requests generated together in one batch.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Milliseconds the worker waits for more requests to join a batch.
    #[arg(long, default_value_t = 10)]
    pub batch_window_ms: u64,
    /// Token limit for requests that set none.
    #[arg(long, default_value_t = 1024)]
    pub default_max_tokens: usize,
    /// Default log-prob distribution of sampled tokens: sampling (tempered/truncated) or raw.
    #[arg(long, default_value = "sampling")]
    pub logprobs_mode: String,
    /// Largest accepted request body, bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Most tenant LoRA adapters resident at once beside the shared policy (the least recently used is
    /// evicted and loaded again on its tenant's next request).
    #[arg(long, default_value_t = server::DEFAULT_MAX_ADAPTERS)]
    pub max_adapters: usize,
    /// Most MiB of tenant adapter tensors resident at once.
    #[arg(long, default_value_t = server::DEFAULT_MAX_ADAPTER_BYTES >> 20)]
    pub max_adapter_mib: u64,
    /// Header naming a request's tenant, whose adapter then serves it (repeatable; the first present
    /// wins). Default: X-Agent-Id, then X-User-Id, as the capture proxy.
    #[arg(long = "tenant-header")]
    pub tenant_headers: Vec<String>,
    /// https instead of http.
    #[command(flatten)]
    pub tls: crate::net::ListenTlsArgs,
}

impl ServeArgs {
    /// Loads the model and serves until Ctrl-C / SIGTERM.
    ///
    /// # Errors
    /// [`Error::Config`] for bad flags; load errors; [`Error::Io`] when the port cannot be bound.
    pub fn run(self) -> Result<()> {
        if let Some(n) = self.threads {
            crate::model::set_threads(n)?;
        }
        let device = LoadOptions::parse_device(&self.device)?;
        let load = LoadOptions { device, dtype: LoadOptions::parse_dtype(&self.dtype, device)?, trainable: Trainable::Frozen };
        let logprobs_mode = match self.logprobs_mode.as_str() {
            "sampling" => LogprobMode::Sampling,
            "raw" => LogprobMode::Raw,
            other => return Err(crate::config_err!("--logprobs-mode {other:?} (sampling or raw)")),
        };
        let t0 = std::time::Instant::now();
        let mut lm = LanguageModel::load_checkpoint(&self.model, self.base.as_deref(), &load)?;
        if !self.unmerged_lora {
            lm.transformer_mut().merge_lora()?;
        }
        let base_dir = self.base.clone().unwrap_or_else(|| lm.dir().to_path_buf());
        let model_name = self
            .served_model_name
            .clone()
            .unwrap_or_else(|| self.model.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "policy".into()));
        tracing::info!(
            "loaded {} ({:.1} M parameters, {:?}, {:?}) in {:.1} s",
            self.model.display(),
            lm.transformer().num_parameters() as f64 / 1e6,
            load.dtype,
            device,
            t0.elapsed().as_secs_f64()
        );
        let opts = ServerOptions {
            model_name,
            api_key: self.api_key.clone(),
            health_requires_key: self.health_requires_key,
            limits: self.limits.limits()?,
            max_body_bytes: self.max_body_bytes,
            max_batch: self.max_batch,
            batch_window: std::time::Duration::from_millis(self.batch_window_ms),
            default_max_tokens: self.default_max_tokens,
            logprobs_mode,
            load,
            base_dir,
            threads: self.threads.map(|n| n.max(0) as usize).unwrap_or(0),
            merge_lora: !self.unmerged_lora,
            continuous_batching: !self.static_batching,
        };
        let mut adapters = AdapterOptions { max_adapters: self.max_adapters, max_adapter_bytes: self.max_adapter_mib << 20, ..AdapterOptions::default() };
        if !self.tenant_headers.is_empty() {
            adapters.tenant_headers = self.tenant_headers.clone();
        }
        let server = PolicyServer::start_with_adapters(lm, self.policy_version, opts, adapters)?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| Error::io("tokio runtime", "-", e))?;
        let tls = self.tls.server_tls()?;
        let limits = self.limits.limits()?;
        rt.block_on(async move {
            let listener = crate::net::Listener::bind(&self.host, self.port, tls.as_ref()).await?;
            tracing::info!(
                "policy server listening on {} (auth {}, header/body timeouts {} s/{} s, at most {} connections)",
                listener.url()?,
                match (&self.api_key, self.health_requires_key) {
                    (None, _) => "off",
                    (Some(_), false) => "on, /health open",
                    (Some(_), true) => "on, /health too",
                },
                limits.header_read_timeout.as_secs_f64(),
                limits.body_read_timeout.as_secs_f64(),
                limits.max_connections
            );
            server.serve(listener, shutdown_signal()).await
        })
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}
