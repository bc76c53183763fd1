//! The [`Trainer`]: the training loop's state (policy, AdamW, step and version counters, the lineage
//! and metrics since the last checkpoint), one optimizer step per batch ([`Trainer::train_step`]),
//! fresh start or resume from the newest checkpoint, and the checkpoint written every K steps. What
//! happens when a step fails on a bad batch is in `recovery.rs`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use super::accumulate::{accumulate_gradients, pack_options_for};
use super::alarms::Alarms;
use super::batch::{DropReason, Dropped, PackOptions};
use super::checkpoint::{self, ancestry, consumed_sample_ids, latest_complete, scan, CheckpointWriter, LineageEntry, Manifest, OptimizerRecord, StepRecord};
use super::config::TrainerConfig;
use super::loss_report::{loss_report, LossReport};
use super::optim::{AdamW, AdamWConfig};
use super::policy::{Policy, WeightsFormat};
use super::step_figures::step_figures;
use super::outcome::{SkipReason, StepFailure, StepOutcome, WrittenCheckpoint};
use crate::method::Method;
use crate::schema::{now_ms, Sample, Table, TrainStep};
use crate::{config_err, input_err, Error, Result};

/// Where [`Trainer::resume`] started from.
#[derive(Debug)]
pub struct Resumed {
    /// The checkpoint loaded (`None`: no complete checkpoint, fresh start at version 0).
    pub from: Option<(PathBuf, Manifest)>,
    /// Sample ids consumed on the path to it: skip these (exactly-once into the trainer).
    pub consumed: HashSet<String>,
}

/// The training loop's state: the policy, AdamW, the step and version counters, and the lineage and
/// metrics gathered since the last checkpoint.
pub struct Trainer<P: Policy> {
    pub(super) policy: P,
    pub(super) reference: Option<Box<dyn Policy>>,
    pub(super) method: Method,
    pub(super) cfg: TrainerConfig,
    pub(super) opt: AdamW,
    pub(super) writer: CheckpointWriter,
    pub(super) config_hash: String,
    pub(super) step: i64,
    pub(super) version: i64,
    pub(super) pending_lineage: Vec<LineageEntry>,
    pub(super) pending_steps: Vec<StepRecord>,
    /// Positions of samples read from the `samples` topic, by sample id (see [`Trainer::note_positions`]).
    pub(super) positions: std::collections::HashMap<String, (String, i32, i64)>,
    /// When the last checkpoint was written (or the trainer started): `checkpoint_every_secs`.
    pub(super) last_checkpoint_at: Instant,
    /// Samples trained since the last checkpoint: `checkpoint_every_samples`.
    pub(super) samples_since_checkpoint: u64,
    /// Running medians of the gradient norm and log-prob gap ([`Alarms`]).
    pub(super) alarms: Alarms,
}

impl<P: Policy> std::fmt::Debug for Trainer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("run_id", &self.writer.run_id())
            .field("method", &self.method)
            .field("step", &self.step)
            .field("version", &self.version)
            .field("optimizer", &self.opt)
            .finish()
    }
}

impl<P: Policy> Trainer<P> {
    /// A fresh trainer at version 0 (the policy's current weights), step 0. Seeds libtorch with
    /// `cfg.seed` (seed before building the policy too if its initialisation is random, e.g. LoRA).
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration, a run folder that already has checkpoints (use
    /// [`Trainer::resume`]) or a policy without trainable tensors; [`Error::Io`] when the run folder
    /// cannot be listed.
    pub fn new(policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<Trainer<P>> {
        if let Some((path, m)) = latest_complete(writer.run_dir())? {
            return Err(config_err!("run {} already has checkpoints up to version {} ({}); resume it or choose another run id", writer.key(), m.version, path.display()));
        }
        if let Some(r) = writer.remote() {
            if let Some(m) = checkpoint::remote_manifests(r, &writer.key())?.pop() {
                return Err(config_err!(
                    "run {} already has checkpoints up to version {} on object storage ({}); resume it or choose another run id",
                    writer.key(),
                    m.version,
                    r.path(&format!("{}/{}", checkpoint::REMOTE_FOLDER, writer.key()))
                ));
            }
        }
        Self::fresh(policy, method, cfg, writer)
    }

    fn fresh(policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<Trainer<P>> {
        cfg.validate()?;
        let cfg_alarms = cfg.alarms.clone();
        tch::manual_seed(cfg.seed as i64);
        let opt = AdamW::new(
            policy.var_store(),
            AdamWConfig { lr: cfg.lr, beta1: cfg.betas.0, beta2: cfg.betas.1, eps: cfg.adam_eps, weight_decay: cfg.weight_decay },
        )?;
        Ok(Trainer {
            config_hash: cfg.hash(method)?,
            policy,
            reference: None,
            method,
            cfg,
            opt,
            writer,
            step: 0,
            version: 0,
            pending_lineage: Vec::new(),
            pending_steps: Vec::new(),
            positions: std::collections::HashMap::new(),
            last_checkpoint_at: Instant::now(),
            samples_since_checkpoint: 0,
            alarms: Alarms::new(cfg_alarms),
        })
    }

    /// Resumes the run from its newest complete checkpoint ([`latest_complete`]): loads the weights
    /// ([`Policy::load_weights`]) and the AdamW moments and step, sets the step and version counters,
    /// and returns the consumed sample ids of its [`ancestry`]. Without a checkpoint: a fresh start.
    /// A changed configuration hash is allowed (logged); a changed method or weights format is not.
    ///
    /// With a lake on object storage ([`CheckpointWriter::with_lake`]) the newest checkpoint is looked
    /// for there too: one newer than the run folder's is downloaded first, with the older manifests for
    /// the lineage ([`checkpoint::fetch_latest`]), and local checkpoints the store lacks are uploaded
    /// ([`checkpoint::upload_missing`]).
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`Error::Config`] when the checkpoint's method or weights format differs;
    /// the errors of [`Policy::load_weights`] and [`AdamW::load`]; [`Error::Unreachable`] when object
    /// storage fails.
    pub fn resume(mut policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<(Trainer<P>, Resumed)> {
        if let Some(r) = writer.remote() {
            checkpoint::fetch_latest(r, &writer.key(), writer.run_dir())?;
            for v in checkpoint::upload_missing(r, &writer.key(), writer.run_dir())? {
                tracing::info!(run = %writer.key(), version = v, "checkpoint uploaded to object storage (missing there)");
            }
        }
        let found = scan(writer.run_dir())?;
        let Some((path, manifest)) = found.complete.last().cloned() else {
            let t = Self::fresh(policy, method, cfg, writer)?;
            return Ok((t, Resumed { from: None, consumed: HashSet::new() }));
        };
        if manifest.method != method.as_str() {
            return Err(config_err!("checkpoint {} was trained with method {}, not {}", path.display(), manifest.method, method.as_str()));
        }
        let format = if cfg.lora.enabled { WeightsFormat::Lora } else { WeightsFormat::Full };
        if manifest.weights_format != format.as_str() {
            return Err(config_err!("checkpoint {} holds {} weights, the configuration asks for {}", path.display(), manifest.weights_format, format.as_str()));
        }
        policy.load_weights(&path, format)?;
        let mut t = Self::fresh(policy, method, cfg, writer)?;
        if manifest.config_hash != t.config_hash {
            tracing::warn!(checkpoint = %path.display(), old = %manifest.config_hash, new = %t.config_hash, "trainer configuration changed since the checkpoint");
        }
        t.opt.load(&path.join(&manifest.optimizer.file), manifest.optimizer.step)?;
        t.step = manifest.step;
        t.version = manifest.version;
        let manifests: Vec<Manifest> = found.manifests();
        let consumed = consumed_sample_ids(ancestry(&manifests, manifest.version));
        Ok((t, Resumed { from: Some((path, manifest)), consumed }))
    }

    /// Records where samples were read (`samples` topic, partition, offset) so the checkpoint lineage
    /// names those positions (exactly-once into the trainer is checked against them).
    pub fn note_positions(&mut self, positions: impl IntoIterator<Item = (String, (String, i32, i64))>) {
        self.positions.extend(positions);
    }

    /// Adds a frozen reference policy for the k3 KL term (needed when `kl_coef ≠ 0`).
    pub fn with_reference(mut self, reference: Box<dyn Policy>) -> Trainer<P> {
        self.reference = Some(reference);
        self
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }
    /// The policy, mutably (e.g. to hot-swap into a server).
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }
    /// Optimizer steps taken.
    pub fn step(&self) -> i64 {
        self.step
    }
    /// Version of the last checkpoint written or resumed (0 = initial weights).
    pub fn version(&self) -> i64 {
        self.version
    }
    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }
    /// The method.
    pub fn method(&self) -> Method {
        self.method
    }
    /// The run id.
    pub fn run_id(&self) -> &str {
        self.writer.run_id()
    }
    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    fn weights_format(&self) -> WeightsFormat {
        if self.cfg.lora.enabled {
            WeightsFormat::Lora
        } else {
            WeightsFormat::Full
        }
    }

    pub(super) fn pack_options(&self) -> PackOptions {
        pack_options_for(&self.policy, self.method, &self.cfg, self.version)
    }

    pub(super) fn record_lineage(&mut self, samples: &[Sample], dropped: &[Dropped], step: i64) {
        for (i, s) in samples.iter().enumerate() {
            let drop = dropped.iter().find(|d| d.index == i);
            self.pending_lineage.push(LineageEntry {
                sample_id: s.sample_id.clone(),
                interaction_id: s.interaction_id.clone(),
                source_topic: s.source_topic.clone(),
                source_partition: s.source_partition,
                source_offset: s.source_offset,
                policy_version: s.policy_version,
                sample_topic: self.positions.get(&s.sample_id).map(|p| p.0.clone()),
                sample_partition: self.positions.get(&s.sample_id).map(|p| p.1),
                sample_offset: self.positions.get(&s.sample_id).map(|p| p.2),
                step,
                trained: drop.is_none(),
                drop_reason: drop.map(|d| d.reason.as_str().to_string()),
            });
        }
    }

    /// One optimizer step on `samples` (normally `batch_size` of them): pack (dropping bad or stale rows
    /// with reasons, the quarantine rules included), forward, loss (docs/method.md §6), backward,
    /// gradient-norm clipping to `grad_clip`, AdamW. A sample whose mean |rollout − current| log-prob
    /// exceeds `quarantine.max_logprob_gap` is found in the forward pass; the gradients are then zeroed
    /// and the step is taken without it (drop reason `logprob_gap`). A checkpoint is written every
    /// `checkpoint_every` steps, and also once `checkpoint_every_secs` seconds or
    /// `checkpoint_every_samples` trained samples have passed since the last one
    /// ([`Trainer::checkpoint`]). The step's gradient norm and log-prob gap feed the spike alarms
    /// ([`super::alarms`]). When every sample is dropped no step is taken; the dropped samples still
    /// enter the lineage.
    ///
    /// **A bad batch never stops training**: when the loss or the gradient norm is not finite, or
    /// libtorch fails in the forward or backward pass, the weights and the AdamW state stay exactly as
    /// they were, each sample is evaluated alone (forward, loss, backward, gradient norm; no step) to
    /// find the offenders, and the step is retried once without them. The offenders — or, when none can
    /// be told apart or the retry fails too, every sample the packer kept — are returned in
    /// [`StepOutcome::skipped`] and enter the lineage as not trained, with the reason
    /// ([`SkipReason::as_str`]). A fully skipped step takes no optimizer step and counts no step.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an input the configuration needs and the batch lacks (e.g. a
    /// reference policy for `kl_coef ≠ 0`) or a policy returning wrongly shaped log-probs;
    /// [`Error::Internal`] when libtorch failed inside the AdamW update (the weights may be half
    /// updated); the checkpoint's errors.
    pub fn train_step(&mut self, samples: &[Sample]) -> Result<StepOutcome> {
        let adam_steps = self.opt.steps();
        let mut outcome = match self.try_step(samples) {
            Ok(o) => o,
            Err(StepFailure::Skip(reason, e)) if self.opt.steps() == adam_steps => self.recover(samples, reason, &e)?,
            Err(StepFailure::Skip(_, e)) => return Err(Error::Internal(format!("step {}: the AdamW update failed part-way: {e}", self.step + 1))),
            Err(StepFailure::Fatal(e)) => return Err(e),
        };
        self.export_metrics(samples, &outcome);
        if let Some(m) = &outcome.metrics {
            self.samples_since_checkpoint += m.samples.max(0) as u64;
        }
        if outcome.train_step.is_some() && self.checkpoint_due() {
            outcome.checkpoint = self.checkpoint()?;
        }
        Ok(outcome)
    }

    /// After a step: a checkpoint is due every `checkpoint_every` steps, or when `checkpoint_every_secs`
    /// have passed or `checkpoint_every_samples` samples were trained since the last one.
    fn checkpoint_due(&self) -> bool {
        (self.step as u64).is_multiple_of(self.cfg.checkpoint_every)
            || self.cfg.checkpoint_every_secs.is_some_and(|s| self.last_checkpoint_at.elapsed().as_secs_f64() >= s)
            || self.cfg.checkpoint_every_samples.is_some_and(|n| self.samples_since_checkpoint >= n)
    }

    /// Moves the process-wide trainer metrics ([`crate::metrics`]) by what one step did.
    fn export_metrics(&mut self, samples: &[Sample], outcome: &StepOutcome) {
        for d in &outcome.dropped {
            crate::metrics::trainer_skipped_sample(d.reason.as_str());
        }
        if let Some(s) = &outcome.skipped {
            crate::metrics::trainer_skipped_step(s.reason.as_str());
            for _ in &s.samples {
                crate::metrics::trainer_skipped_sample(s.reason.as_str());
            }
        }
        let Some(row) = &outcome.train_step else { return };
        for a in self.alarms.observe(row.grad_norm, row.rollout_logprob_abs_diff) {
            crate::metrics::trainer_alarm(a.kind.as_str());
            tracing::warn!(
                step = row.step,
                kind = a.kind.as_str(),
                value = a.value,
                running_median = a.median,
                threshold = a.threshold,
                "training alarm: {} spiked to {:.4} against a running median of {:.4} (trainer.alarms: factor {} over the last {} steps)",
                a.kind.as_str(),
                a.value,
                a.median,
                self.cfg.alarms.factor,
                self.cfg.alarms.window
            );
        }
        let terms = [("total", row.loss), ("pg", row.pg_loss), ("kl", row.kl), ("entropy", row.entropy), ("topk_kl", row.topk_kl), ("ppo_kl", row.ppo_kl)];
        crate::metrics::trainer_step(&terms, row.grad_norm, row.tokens, row.seconds);
        crate::metrics::trainer_step_figures(&crate::metrics::StepFigures {
            reward_mean: row.reward_mean,
            reward_std: row.reward_std,
            learning_rate: row.learning_rate,
            response_length_mean: row.response_length_mean,
            rollout_logprob_abs_diff: Some(row.rollout_logprob_abs_diff),
            staleness_mean: row.staleness_mean,
            positive_advantage_fraction: row.positive_advantage_fraction,
            negative_advantage_fraction: row.negative_advantage_fraction,
        });
        let left_out = |i: usize| outcome.dropped.iter().any(|d| d.index == i) || outcome.skipped.as_ref().is_some_and(|s| s.samples.contains(&i));
        for (i, s) in samples.iter().enumerate() {
            if let Some(v) = s.policy_version.filter(|_| !left_out(i)) {
                crate::metrics::get().trainer_sample_staleness.observe((self.version - v).max(0) as f64);
            }
        }
    }

    /// [`Trainer::train_step`] without the recovery and without the checkpoint: any failure is an error
    /// (the non-finite checks zero the gradients before returning).
    pub(super) fn try_step(&mut self, samples: &[Sample]) -> std::result::Result<StepOutcome, StepFailure> {
        let started = Instant::now();
        let step = self.step + 1;
        self.opt.zero_grad()?;
        let acc = accumulate_gradients(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, samples)?;
        let bound = self.cfg.quarantine.max_logprob_gap;
        let over: Vec<(usize, f64)> = acc.sample_gaps.iter().copied().filter(|(_, g)| *g > bound).collect();
        if !over.is_empty() {
            self.opt.zero_grad()?;
            return self.step_without_gaps(samples, &over);
        }
        let dropped = acc.dropped;
        let Some(m) = acc.metrics else {
            self.record_lineage(samples, &dropped, self.step);
            return Ok(StepOutcome { train_step: None, metrics: None, dropped, checkpoint: None, skipped: None });
        };
        let rollout_abs_diff = acc.rollout_abs_diff;
        let advantage_signs = acc.advantage_signs;
        let parts = acc.parts;
        if !m.loss.is_finite() {
            self.opt.zero_grad()?;
            return Err(StepFailure::Skip(
                SkipReason::NonFiniteLoss,
                input_err!("step {step}: loss is {} (pg {}, kl {}, entropy {}, top-K {}); weights not updated", m.loss, m.pg_loss, m.kl, m.entropy, m.topk_kl),
            ));
        }
        let grad_norm = self.opt.clip_grad_norm(self.cfg.grad_clip)?;
        if !grad_norm.is_finite() {
            self.opt.zero_grad()?;
            return Err(StepFailure::Skip(SkipReason::NonFiniteGrad, input_err!("step {step}: gradient norm is {grad_norm}; weights not updated")));
        }
        self.opt.step()?;
        self.opt.zero_grad()?;
        self.step = step;
        self.record_lineage(samples, &dropped, step);
        let seconds = started.elapsed().as_secs_f64();
        self.pending_steps.push(StepRecord {
            step,
            metrics: m.clone(),
            grad_norm,
            rollout_logprob_abs_diff: rollout_abs_diff,
            dropped: dropped.len() as i64,
            seconds,
            advantage_parts: Some(parts),
        });
        let (run_id, key) = (self.writer.run_id().to_string(), self.writer.key());
        let f = step_figures(samples, &dropped, self.version, self.opt.config().lr, m.tokens, seconds, &advantage_signs, &parts);
        let row = TrainStep {
            schema_version: TrainStep::SCHEMA_VERSION,
            step_id: format!("{key}/{step}"),
            run_id,
            tenant: self.writer.tenant().map(str::to_string),
            step,
            version: self.version + 1,
            method: self.method.as_str().to_string(),
            loss: m.loss,
            pg_loss: m.pg_loss,
            clip_fraction: m.clip_fraction,
            ppo_kl: m.ppo_kl,
            kl: m.kl,
            entropy: m.entropy,
            topk_kl: m.topk_kl,
            rollout_logprob_abs_diff: rollout_abs_diff,
            grad_norm,
            advantage_by_type: serde_json::to_string(&m.advantage_by_type).map_err(Error::from)?,
            samples: m.samples,
            tokens: m.tokens,
            seconds,
            created_time: now_ms(),
            reward_mean: Some(f.reward_mean),
            reward_std: Some(f.reward_std),
            learning_rate: Some(f.learning_rate),
            response_length_mean: Some(f.response_length_mean),
            response_length_max: Some(f.response_length_max),
            tokens_per_second: Some(f.tokens_per_second),
            staleness_mean: f.staleness_mean,
            staleness_max: f.staleness_max,
            positive_advantage_fraction: Some(f.positive_advantage_fraction),
            negative_advantage_fraction: Some(f.negative_advantage_fraction),
            advantage_sign_by_type: Some(f.advantage_sign_by_type),
            advantage_reward_abs_mean: Some(f.advantage_reward_abs_mean),
            advantage_teacher_abs_mean: Some(f.advantage_teacher_abs_mean),
            teacher_term_positive_fraction: Some(f.teacher_term_positive_fraction),
            teacher_term_negative_fraction: Some(f.teacher_term_negative_fraction),
        };
        Ok(StepOutcome { train_step: Some(row), metrics: Some(m), dropped, checkpoint: None, skipped: None })
    }

    /// The log-prob gap quarantine (`trainer.quarantine.max_logprob_gap`): `over` = (index into
    /// `samples`, mean |rollout − current| log-prob) of the samples above the bound, found in a step
    /// whose gradients were then zeroed. Takes the step on the others and returns it with `over` in
    /// its drops ([`DropReason::LogprobGap`]) and their lineage entries, not trained.
    fn step_without_gaps(&mut self, samples: &[Sample], over: &[(usize, f64)]) -> std::result::Result<StepOutcome, StepFailure> {
        let rest: Vec<usize> = (0..samples.len()).filter(|i| !over.iter().any(|(j, _)| j == i)).collect();
        let subset: Vec<Sample> = rest.iter().map(|&i| samples[i].clone()).collect();
        let adam_steps = self.opt.steps();
        let mut outcome = if subset.is_empty() {
            StepOutcome { train_step: None, metrics: None, dropped: vec![], checkpoint: None, skipped: None }
        } else {
            match self.try_step(&subset) {
                Ok(o) => o,
                // The step on the others failed (non-finite loss or gradient, a libtorch error): find
                // its offenders among them, so the quarantined samples keep their own reason.
                Err(StepFailure::Skip(reason, e)) if self.opt.steps() == adam_steps => {
                    let mut o = self.recover(&subset, reason, &e).map_err(StepFailure::Fatal)?;
                    if let Some(k) = &mut o.skipped {
                        for i in &mut k.samples {
                            *i = rest[*i];
                        }
                    }
                    o
                }
                Err(e) => return Err(e),
            }
        };
        for d in &mut outcome.dropped {
            d.index = rest[d.index];
        }
        if outcome.train_step.is_some() {
            if let Some(r) = self.pending_steps.last_mut() {
                r.dropped += over.len() as i64;
            }
        }
        let bound = self.cfg.quarantine.max_logprob_gap;
        let gapped: Vec<Dropped> = over
            .iter()
            .map(|&(i, g)| Dropped {
                index: i,
                sample_id: samples[i].sample_id.clone(),
                reason: DropReason::LogprobGap,
                detail: format!("mean |rollout − current| log-prob {g:.4} nats per trained token exceeds trainer.quarantine.max_logprob_gap = {bound}: the rollout log-probs were not made by these weights"),
            })
            .collect();
        let picked: Vec<Sample> = over.iter().map(|&(i, _)| samples[i].clone()).collect();
        let as_picked: Vec<Dropped> = gapped.iter().enumerate().map(|(k, d)| Dropped { index: k, ..d.clone() }).collect();
        let step = self.step;
        self.record_lineage(&picked, &as_picked, step);
        tracing::warn!(step, quarantined = over.len(), trained = rest.len(), "samples quarantined for their log-prob gap; step taken without them");
        outcome.dropped.extend(gapped);
        outcome.dropped.sort_by_key(|d| d.index);
        Ok(outcome)
    }

    /// Writes checkpoint `version + 1` now if any optimizer step was taken since the last one (call it at
    /// shutdown); `None` otherwise. The manifest holds the steps' metrics and the lineage of every sample
    /// consumed since the parent.
    ///
    /// With a lake on object storage the complete checkpoint is then uploaded ([`checkpoint::upload`]).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Torch`] when a file cannot be written; [`Error::Config`] when the version
    /// folder already exists, or object storage already holds this version (another trainer of the same
    /// run); [`Error::Unreachable`] when the upload fails. After an upload error the checkpoint is
    /// complete locally and the trainer's counters have moved past it; [`Trainer::resume`] uploads it.
    pub fn checkpoint(&mut self) -> Result<Option<WrittenCheckpoint>> {
        if self.pending_steps.is_empty() {
            return Ok(None);
        }
        let format = self.weights_format();
        let oc = self.opt.config();
        let mut manifest = Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            run_id: self.writer.run_id().to_string(),
            tenant: self.writer.tenant().map(str::to_string),
            version: self.version + 1,
            parent_version: self.version,
            step: self.step,
            method: self.method.as_str().to_string(),
            config_hash: self.config_hash.clone(),
            weights_format: format.as_str().to_string(),
            weight_files: Vec::new(),
            optimizer: OptimizerRecord {
                kind: "adamw".into(),
                step: self.opt.steps(),
                lr: oc.lr,
                betas: (oc.beta1, oc.beta2),
                eps: oc.eps,
                weight_decay: oc.weight_decay,
                file: checkpoint::OPTIMIZER_FILE.into(),
            },
            metrics: self.pending_steps.clone(),
            lineage: self.pending_lineage.clone(),
            created_time: now_ms(),
        };
        let (policy, opt) = (&mut self.policy, &self.opt);
        let path = self.writer.write(&mut manifest, |dir| {
            let files = policy.save_weights(dir, format)?;
            let opt_path = dir.join(checkpoint::OPTIMIZER_FILE);
            if let Some(parent) = opt_path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
            }
            opt.save(&opt_path)?;
            Ok(files)
        })?;
        self.version = manifest.version;
        self.pending_steps.clear();
        self.pending_lineage.clear();
        self.last_checkpoint_at = Instant::now();
        self.samples_since_checkpoint = 0;
        let row = manifest.to_row(&path)?;
        tracing::info!(run = %manifest.key(), version = manifest.version, step = manifest.step, samples = row.samples, path = %path.display(), "checkpoint written");
        if let Some(r) = self.writer.remote() {
            if !checkpoint::upload(r, &manifest.key(), manifest.version, &path)? {
                return Err(config_err!(
                    "checkpoint {} of run {} is already on object storage (another trainer of this run?); the local one is {}",
                    manifest.version,
                    manifest.key(),
                    path.display()
                ));
            }
            tracing::info!(run = %manifest.run_id, version = manifest.version, "checkpoint uploaded to object storage");
        }
        Ok(Some(WrittenCheckpoint { path, manifest, row }))
    }

    /// [`loss_report`] with this trainer's policy, reference, method, configuration and version.
    ///
    /// # Errors
    /// As [`loss_report`].
    pub fn loss_report(&self, samples: &[Sample]) -> Result<LossReport> {
        let mut r = loss_report(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, samples)?;
        r.step = self.step;
        Ok(r)
    }
}
