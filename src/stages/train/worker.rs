//! The trainer's model thread: every [`Trainer`] of this process — the shared policy, or one per tenant
//! (`[trainer.tenants] mode = "per_tenant"`) — lives on one dedicated thread (libtorch work never
//! blocks the async runtime; steps of different tenants run one after another on the configured
//! threads). The async side opens an adapter before its first sample ([`Worker::open`]: a fresh
//! adapter, or the tenant's newest checkpoint when its folder has one), then sends it batches.
//!
//! Per-tenant adapters are LoRA adapters on one frozen base: [`LanguageModel::load`] with LoRA aliases
//! the process-wide shared base weights, so each tenant costs its adapter tensors, their AdamW moments
//! and the activations of its own steps only. Every adapter starts from the same initialisation
//! (`trainer.seed`), so tenants differ only by what they trained on.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;

use tokio::sync::oneshot;

use super::options::TrainOptions;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::model::{LanguageModel, LoadOptions, LoraConfig, LoraTarget, Trainable};
use crate::schema::Sample;
use crate::trainer::{adapter_name, AdapterKey, CheckpointWriter, StepOutcome, Trainer, WrittenCheckpoint};

/// Load options of the policy the trainer optimises (full weights or LoRA adapters per `[trainer]`).
///
/// # Errors
/// [`Error::Config`] for a bad device/dtype or LoRA target.
pub fn policy_load_options(cfg: &PipelineConfig) -> Result<LoadOptions> {
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let lora = &cfg.trainer.lora;
    let trainable = if lora.enabled {
        let targets = lora.targets.iter().map(|t| LoraTarget::parse(t)).collect::<Result<Vec<_>>>()?;
        Trainable::Lora(LoraConfig { rank: lora.rank, alpha: lora.alpha, targets })
    } else {
        Trainable::Full
    };
    Ok(LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable })
}

/// What opening an adapter found.
#[derive(Debug, Clone, Default)]
pub struct Opened {
    /// Sample ids the adapter's checkpoint ancestry consumed (skip them).
    pub consumed: HashSet<String>,
    /// The checkpoint version it resumed from (None: fresh weights).
    pub resumed_from: Option<i64>,
}

/// A sample position in the `samples` topic, by sample id (the lineage names it).
pub type Position = (String, (String, i32, i64));

enum Cmd {
    Open(AdapterKey, oneshot::Sender<Result<Opened>>),
    Step(AdapterKey, Vec<Sample>, Vec<Position>, oneshot::Sender<Result<StepOutcome>>),
    Flush(oneshot::Sender<Vec<(AdapterKey, Result<Option<WrittenCheckpoint>>)>>),
    Close(AdapterKey, oneshot::Sender<bool>),
}

/// The async side's handle to the model thread.
pub struct Worker {
    tx: mpsc::Sender<Cmd>,
}

/// How the thread builds one adapter's trainer.
struct Builder {
    load: LoadOptions,
    cfg: PipelineConfig,
    opts: TrainOptions,
    run_id: String,
    lake: Option<crate::lake::Lake>,
}

impl Builder {
    fn writer(&self, key: &AdapterKey) -> CheckpointWriter {
        let mut w = match key {
            None => CheckpointWriter::new(&self.opts.checkpoints_dir, &self.run_id),
            Some(t) => CheckpointWriter::for_tenant(&self.opts.checkpoints_dir, &self.run_id, t),
        };
        if let Some(l) = &self.lake {
            w = w.with_lake(l);
        }
        w
    }

    /// The shared policy: `--resume` resumes, else a fresh run (an existing run is an error). A tenant's
    /// adapter always picks up the tenant's newest checkpoint when there is one (with several trainer
    /// processes in one consumer group a tenant may move between them); `run_train` refuses a run
    /// folder with checkpoints at start-up unless `--resume`.
    fn build(&self, key: &AdapterKey) -> Result<(Trainer<LanguageModel>, Opened)> {
        // Fresh LoRA adapters are drawn from libtorch's generator: seed it first, so the same
        // configuration always starts from the same adapters (runs are repeatable).
        tch::manual_seed(self.cfg.trainer.seed as i64);
        let policy = LanguageModel::load(&self.cfg.policy.model, &self.load)?;
        let (method, tcfg, writer) = (self.cfg.method, self.cfg.trainer.clone(), self.writer(key));
        if self.opts.resume || key.is_some() {
            let (t, r) = Trainer::resume(policy, method, tcfg, writer)?;
            let resumed_from = r.from.as_ref().map(|(_, m)| m.version);
            Ok((t, Opened { consumed: r.consumed, resumed_from }))
        } else {
            Ok((Trainer::new(policy, method, tcfg, writer)?, Opened::default()))
        }
    }
}

/// Starts the model thread (nothing is loaded until [`Worker::open`]).
///
/// # Errors
/// [`Error::Config`] for bad load options; [`Error::Internal`] when the thread cannot start.
pub fn start(cfg: &PipelineConfig, opts: &TrainOptions) -> Result<Worker> {
    let lake = if cfg.lake.to_str().is_some_and(crate::lake::remote::is_url) { Some(crate::lake::Lake::open(&cfg.lake)?) } else { None };
    let builder = Builder { load: policy_load_options(cfg)?, cfg: cfg.clone(), opts: opts.clone(), run_id: opts.run_id.clone().unwrap_or_else(|| cfg.name.clone()), lake };
    let threads = cfg.policy.threads;
    let (tx, rx) = mpsc::channel::<Cmd>();
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            if threads > 0 {
                let _ = crate::model::set_threads(threads as i32);
            }
            let mut trainers: HashMap<AdapterKey, Trainer<LanguageModel>> = HashMap::new();
            loop {
                let cmd = match rx.try_recv() {
                    Ok(cmd) => cmd,
                    Err(mpsc::TryRecvError::Empty) => {
                        // Nothing waiting: the last step's freed activation blocks go back to the
                        // OS before the thread sleeps (every cached block of the process, a policy
                        // server's in the same process too: it maps them again on its next batch).
                        crate::model::cpu_allocator::trim(0);
                        match rx.recv() {
                            Ok(cmd) => cmd,
                            Err(_) => break,
                        }
                    }
                    Err(mpsc::TryRecvError::Disconnected) => break,
                };
                match cmd {
                    Cmd::Open(key, reply) => {
                        let r = builder.build(&key).map(|(t, opened)| {
                            tracing::info!(adapter = adapter_name(&key), resumed_from = ?opened.resumed_from, "trainer adapter opened");
                            trainers.insert(key, t);
                            opened
                        });
                        let _ = reply.send(r);
                    }
                    Cmd::Step(key, samples, positions, reply) => {
                        let r = match trainers.get_mut(&key) {
                            Some(t) => {
                                t.note_positions(positions);
                                t.train_step(&samples)
                            }
                            None => Err(Error::Internal(format!("adapter {} was not opened", adapter_name(&key)))),
                        };
                        let _ = reply.send(r);
                    }
                    Cmd::Flush(reply) => {
                        let mut keys: Vec<AdapterKey> = trainers.keys().cloned().collect();
                        keys.sort();
                        let out = keys.into_iter().map(|k| {
                            let r = trainers.get_mut(&k).map_or(Ok(None), Trainer::checkpoint);
                            (k, r)
                        });
                        let _ = reply.send(out.collect());
                    }
                    Cmd::Close(key, reply) => {
                        let was_open = trainers.remove(&key).is_some();
                        tracing::info!(adapter = adapter_name(&key), was_open, "trainer adapter closed (steps since its last checkpoint are dropped)");
                        let _ = reply.send(was_open);
                    }
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start the trainer thread: {e}")))?;
    Ok(Worker { tx })
}

fn gone() -> Error {
    Error::Internal("trainer thread is gone".into())
}

impl Worker {
    /// Loads adapter `key`'s trainer (see the module docs).
    ///
    /// # Errors
    /// Model loading, a checkpoint that cannot be resumed, an existing run without `--resume` (shared).
    pub async fn open(&self, key: AdapterKey) -> Result<Opened> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Open(key, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// One optimizer step of adapter `key` on `samples` ([`Trainer::train_step`]).
    ///
    /// # Errors
    /// As [`Trainer::train_step`]; [`Error::Internal`] when `key` was not opened.
    pub async fn step(&self, key: AdapterKey, samples: Vec<Sample>, positions: Vec<Position>) -> Result<StepOutcome> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Step(key, samples, positions, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Drops adapter `key`'s trainer without a checkpoint (its steps since the last checkpoint are
    /// lost; [`Worker::open`] loads it again from its newest checkpoint). True when it was open.
    ///
    /// # Errors
    /// [`Error::Internal`] when the thread is gone.
    pub async fn close(&self, key: AdapterKey) -> Result<bool> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Close(key, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Checkpoints every open adapter with steps since its last checkpoint, in key order.
    ///
    /// # Errors
    /// [`Error::Internal`] when the thread is gone; each adapter's own result is in the list.
    pub async fn flush(&self) -> Result<Vec<(AdapterKey, Result<Option<WrittenCheckpoint>>)>> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Flush(tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}
