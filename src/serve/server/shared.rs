//! What the handlers, the worker and the [`PolicyHandle`] share: the server's state ([`Shared`]), the
//! in-flight count ([`InFlight`]) and the handle's version queries and shared-policy reload.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::messages::WorkerMsg;
use super::options::ServerOptions;
use super::registry::{AdapterOptions, TenantRegistry};
use crate::model::{LanguageModel, LoadOptions};
use crate::{Error, Result};

pub(super) struct Shared {
    pub(super) opts: ServerOptions,
    pub(super) adapters: AdapterOptions,
    /// Every tenant with an adapter: its newest checkpoint, version and whether it is resident.
    pub(super) tenants: TenantRegistry,
    pub(super) version: AtomicI64,
    pub(super) in_flight: AtomicUsize,
    pub(super) completed: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) jobs: std::sync::mpsc::Sender<WorkerMsg>,
    pub(super) reload_lock: tokio::sync::Mutex<()>,
    /// Where the server's time went ([`PolicyHandle::time_spent`]).
    pub(super) clock: TimeClock,
}

/// Microseconds spent, by kind of work (see [`ServerTime`]).
#[derive(Default)]
pub(super) struct TimeClock {
    pub(super) chat_us: AtomicU64,
    pub(super) completions_us: AtomicU64,
    pub(super) reloads: AtomicU64,
    pub(super) reload_load_us: AtomicU64,
    pub(super) reload_wait_us: AtomicU64,
}

impl TimeClock {
    /// Adds the time since `t0` to `counter`.
    pub(super) fn add_since(counter: &AtomicU64, t0: std::time::Instant) {
        counter.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
    }
}

/// Where a policy server's time went since it started ([`PolicyHandle::time_spent`]). Seconds are wall
/// time; the inference worker is one thread, so `chat_seconds + completions_seconds` is at most the
/// server's age, while reload loads run beside it on a blocking thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ServerTime {
    /// The inference worker generating chat completions (`/v1/chat/completions`, `/v1/responses`,
    /// `/v1/messages`): rendering, prefill and decoding of its batches, and loading an evicted tenant
    /// adapter a batch needs.
    pub chat_seconds: f64,
    /// The inference worker on `/v1/completions` batches (prompt scoring, then generation).
    pub completions_seconds: f64,
    /// Shared-policy reloads completed (a tenant adapter's reload is not counted here).
    pub reloads: u64,
    /// Their checkpoint loads (files read, adapters attached or merged), beside serving.
    pub reload_load_seconds: f64,
    /// Their waits for the worker to swap the loaded weights in (it finishes its batch first).
    pub reload_swap_wait_seconds: f64,
}

/// Counts a request as in flight until dropped.
pub(super) struct InFlight(Arc<Shared>);

impl InFlight {
    pub(super) fn new(s: &Arc<Shared>) -> InFlight {
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
    pub(super) shared: Arc<Shared>,
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

    /// Where the server's time went since it started.
    pub fn time_spent(&self) -> ServerTime {
        let c = &self.shared.clock;
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
        ServerTime {
            chat_seconds: s(&c.chat_us),
            completions_seconds: s(&c.completions_us),
            reloads: c.reloads.load(Ordering::Relaxed),
            reload_load_seconds: s(&c.reload_load_us),
            reload_swap_wait_seconds: s(&c.reload_wait_us),
        }
    }

    /// Loads a checkpoint directory as the shared policy (full weights or adapters on the base, see
    /// [`LanguageModel::load_checkpoint`]; a LoRA checkpoint's adapters stay attached, or are merged when
    /// [`ServerOptions::merge_lora`] is set) on a blocking thread, then swaps it in at the worker's next
    /// batch boundary: the batch being decoded finishes on the old weights, requests still queued run on
    /// the new ones. Returns the previous version. Tenant adapters are not touched (they stay on the
    /// base model; [`PolicyHandle::reload_tenant`] moves one). The load and the wait for the worker's
    /// swap are timed apart (`server_reload_load_seconds`, `server_reload_swap_wait_seconds`).
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
        let (opts, base, merge) = (s.opts.load.clone(), s.opts.base_dir.clone(), s.opts.merge_lora);
        let t0 = std::time::Instant::now();
        let lm = tokio::task::spawn_blocking(move || load_policy(&path, &base, &opts, merge))
            .await
            .map_err(|e| Error::Internal(format!("reload task: {e}")))??;
        let load_s = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let (ack, done) = tokio::sync::oneshot::channel();
        s.jobs.send(WorkerMsg::Swap { model: Box::new(lm), version, ack }).map_err(|_| Error::Internal("inference worker stopped".into()))?;
        let old = done.await.map_err(|_| Error::Internal("inference worker stopped before the swap".into()))?;
        let wait_s = t1.elapsed().as_secs_f64();
        let c = &s.clock;
        c.reloads.fetch_add(1, Ordering::Relaxed);
        c.reload_load_us.fetch_add((load_s * 1e6) as u64, Ordering::Relaxed);
        c.reload_wait_us.fetch_add((wait_s * 1e6) as u64, Ordering::Relaxed);
        let m = crate::metrics::get();
        m.server_reload_load.observe(load_s);
        m.server_reload_swap_wait.observe(wait_s);
        tracing::info!(version, merged = merge, "reloaded version {version} in {:.2} s: load {load_s:.2} s, swap wait {wait_s:.2} s", load_s + wait_s);
        Ok(old)
    }
}

/// Loads the checkpoint `path` frozen as a shared policy (adapters on `base`, whose tensors alias the
/// process's one copy, [`crate::model::weights::read_checkpoint_shared`]), with `load`'s device and
/// dtype; with `merge`, a LoRA checkpoint's adapters are folded into the weights
/// ([`crate::model::Transformer::merge_lora`]). Blocking (reads files). Used at start and at each reload.
///
/// # Errors
/// As [`LanguageModel::load_checkpoint`]; [`Error::Torch`] when merging fails.
pub fn load_policy(path: &std::path::Path, base: &std::path::Path, load: &LoadOptions, merge: bool) -> Result<LanguageModel> {
    let opts = LoadOptions { trainable: crate::model::Trainable::Frozen, ..load.clone() };
    let mut lm = LanguageModel::load_checkpoint(path, Some(base), &opts)?;
    if merge {
        lm.transformer_mut().merge_lora()?;
    }
    Ok(lm)
}
