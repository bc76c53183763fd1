//! Trainer wiring: `samples` (topic, consumer group) or a SQL query over the lake → [`Trainer`] →
//! `train_steps`, `checkpoints` (topic + table) and checkpoint folders.
//!
//! Exactly-once into the trainer: the `samples` offsets are committed only together with a checkpoint
//! (after its files are durable and its row is published), and a restarted trainer (`--resume`) starts
//! from the newest complete checkpoint and skips every sample id that checkpoint's ancestry consumed.
//! The topic itself is at-least-once (a stage killed between sending and committing sends again), so a
//! sample id already taken in this run is skipped too (counted as `skipped_duplicates`). A
//! sample trained after the last checkpoint is re-read after a crash and trained again from the
//! checkpointed weights — once, as far as any published checkpoint is concerned.
//!
//! A bad batch never stops training: samples the trainer could not train (non-finite loss or gradient,
//! a libtorch error; see [`Trainer::train_step`]) are dead-lettered with stage `train` and their offsets
//! committed right away (up to the first sample still buffered or trained since the last checkpoint),
//! so a restart does not read them again.
//!
//! The model lives on a dedicated thread (libtorch work never blocks the async runtime; `worker.rs`);
//! the async side sends it batches.
//!
//! **Per tenant** (`[trainer.tenants] mode = "per_tenant"`, [`crate::trainer::tenants`]): one LoRA
//! adapter per tenant on the shared frozen base, each with its own optimizer state, versions and
//! checkpoints (`checkpoints/<run>/<tenant>/<version>`). Offsets are committed per partition up to the
//! first sample still buffered, or trained since *its own adapter's* last checkpoint, of any tenant. A
//! tenant refused (beyond `max_tenants`, or its adapter cannot be opened) has its samples dead-lettered
//! with the reason and counted (`dead_letters_total{stage="train"}`); the other tenants keep training.
//! Several trainer processes in one consumer group split the tenants by partition (`samples` is keyed by
//! tenant). At a rebalance a process hands over every tenant that read from a partition it lost: the
//! tenant's buffered samples are dropped, its adapter is closed without a checkpoint (steps since its
//! last checkpoint are lost, never published) and nothing more of that partition is committed here; the
//! partition's new owner reads those samples again from the committed offset and opens the tenant's
//! adapter from its newest checkpoint ([`TrainReport::handed_over`]). Two processes therefore never
//! write checkpoints of one tenant from diverging weights.
//!
//! `nextstate loss` lives in `loss_command.rs`.

mod loss_command;
mod options;
mod worker;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::Output;
use crate::bus::{Bus, Envelope, Revoked};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::lake::sink::start_sinks;
use crate::runtime::{InputLoop, TaskCtl};
use crate::schema::{Checkpoint, DeadLetter, Lineage, Sample};
use crate::trainer::{adapter_name, AdapterKey, Batcher, StepOutcome, WrittenCheckpoint};

pub use loss_command::{loss_command, render_loss_report, LossCommandReport};
pub use options::{TrainOptions, TrainSource};
pub use worker::policy_load_options;

/// The trainer's name as a task: its metrics label, its dead letters' `stage` and its `--only` task name.
pub const NAME: &str = "train";

/// The trainer's consumer group on `samples` for pipeline `pipeline` (`nextstate.<pipeline>.trainer`,
/// with the bus's group prefix): the one place it is written.
pub fn consumer_group(bus: &Bus, pipeline: &str) -> String {
    bus.group(&format!("nextstate.{pipeline}.trainer"))
}

/// `max.poll.interval.ms` of the trainer's `samples` consumer, at least (1 h): the trainer does not poll
/// while an optimizer step runs (215 s measured for a full fine-tuning step on 11 long samples on 2 CPU
/// cores), and a static member that exceeds the interval is fenced, which is fatal to its consumer.
/// A crashed trainer is still detected by `session.timeout.ms` (heartbeats run on librdkafka's thread).
pub const TRAINER_MAX_POLL_INTERVAL_MS: u32 = 3_600_000;

/// Longest the trainer steps through ready batches before it polls `samples` again (continuous
/// training): 5 min, well inside [`TRAINER_MAX_POLL_INTERVAL_MS`] even with one more long step.
pub const TRAIN_READY_BUDGET: std::time::Duration = std::time::Duration::from_secs(300);

/// Appends `outcome`'s `train_steps` row (if a step was taken) to `--metrics-jsonl`, with `extra` keys.
fn append_jsonl(w: &mut Option<crate::metrics::JsonlWriter>, extra: &[(String, serde_json::Value)], outcome: &StepOutcome) -> Result<()> {
    let (Some(w), Some(ts)) = (w.as_mut(), &outcome.train_step) else { return Ok(()) };
    let mut line = serde_json::to_value(ts)?;
    if let Some(obj) = line.as_object_mut() {
        for (k, v) in extra {
            obj.insert(k.clone(), v.clone());
        }
    }
    w.append(&line)
}

/// What a training run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TrainReport {
    /// Optimizer steps taken in this run.
    pub steps: i64,
    /// Samples that went into optimizer steps.
    pub samples_trained: u64,
    /// Samples skipped because a checkpoint of this run already consumed them (resume).
    pub skipped_already_trained: u64,
    /// Samples of other pipelines on the topic (not ours to train).
    pub skipped_other_pipeline: u64,
    /// Samples skipped because the same sample id was already taken in this run (an upstream stage
    /// that crashed between sending and committing sends it again: at-least-once delivery).
    pub skipped_duplicates: u64,
    /// Samples dropped by the batch packer, by reason.
    pub dropped: BTreeMap<String, u64>,
    /// Steps skipped whole because the loss or the gradient norm was not finite or libtorch failed
    /// (weights unchanged; their samples dead-lettered, see [`crate::trainer::SkippedStep`]).
    pub skipped_steps: u64,
    /// Samples left untrained by a skipped step or left out of a retried one, by reason
    /// (`non_finite_loss`, `non_finite_grad`, `torch_error`); each is dead-lettered with stage `train`.
    pub skipped_samples: BTreeMap<String, u64>,
    /// Checkpoints written: (version, folder).
    pub checkpoints: Vec<(i64, String)>,
    /// Version the shared policy resumed from (None: fresh start, or per-tenant training).
    pub resumed_from: Option<i64>,
    /// Final loss of the last step.
    pub last_loss: Option<f64>,
    /// Checkpoint version each adapter resumed from, by adapter (`shared` or the tenant).
    pub resumed: BTreeMap<String, i64>,
    /// Per adapter (`shared` or the tenant): steps, samples trained and the last version written.
    pub tenants: BTreeMap<String, AdapterReport>,
    /// Samples refused before training, by reason (`tenant_cap`: beyond `max_tenants`;
    /// `tenant_unavailable`: the tenant's adapter could not be opened); each is dead-lettered.
    pub refused: BTreeMap<String, u64>,
    /// Samples left buffered at the end, by adapter: fewer than `[trainer.tenants] min_batch` (not
    /// trained; read from the topic, their offsets are not committed).
    pub waiting: BTreeMap<String, u64>,
    /// Per-tenant training read from the topic: samples handed over at a rebalance, by tenant (buffered,
    /// or trained since the tenant's last checkpoint, when a partition holding some of the tenant's
    /// samples was revoked). Not lost: uncommitted, they are read again by the partition's new owner
    /// (or by this process when the partition comes back) and trained from the tenant's newest checkpoint.
    pub handed_over: BTreeMap<String, u64>,
    /// Records received from a partition that was no longer assigned to this process when they were
    /// handled (revoked while they arrived): not taken, read again by the partition's owner.
    pub skipped_not_assigned: u64,
}

/// One adapter's part of a [`TrainReport`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AdapterReport {
    /// Optimizer steps taken.
    pub steps: i64,
    /// Samples trained.
    pub samples_trained: u64,
    /// The last checkpoint version written in this run.
    pub version: Option<i64>,
}

/// Called after each checkpoint is durable and published (e.g. to hot-swap a server's weights).
pub type OnCheckpoint = Box<dyn Fn(&Checkpoint) + Send + Sync>;

/// Publishes what a step produced; returns the checkpoint row when one was written.
async fn publish(out: &Output, outcome: &StepOutcome, report: &mut TrainReport, batch: &[Sample]) -> Result<Option<Checkpoint>> {
    if let Some(ts) = &outcome.train_step {
        report.steps += 1;
        report.last_loss = Some(ts.loss);
        tracing::info!(
            step = ts.step,
            loss = format!("{:.5}", ts.loss),
            pg_loss = format!("{:.5}", ts.pg_loss),
            clip_fraction = format!("{:.3}", ts.clip_fraction),
            ppo_kl = format!("{:.2e}", ts.ppo_kl),
            tokens = ts.tokens,
            seconds = format!("{:.1}", ts.seconds),
            "train step"
        );
        out.emit(ts, None).await?;
    }
    let skipped = outcome.skipped.as_ref().map_or(&[][..], |k| k.samples.as_slice());
    report.samples_trained += (batch.len() - outcome.dropped.len() - skipped.len()) as u64;
    if let Some(k) = &outcome.skipped {
        if outcome.train_step.is_none() {
            report.skipped_steps += 1;
        }
        tracing::warn!(reason = k.reason.as_str(), samples = k.samples.len(), step_taken = outcome.train_step.is_some(), skipped_steps = report.skipped_steps, detail = %k.detail, "samples not trained: dead-lettered");
        for &i in &k.samples {
            *report.skipped_samples.entry(k.reason.as_str().to_string()).or_default() += 1;
            let s = &batch[i];
            let dl = DeadLetter::new(NAME, k.reason.as_str(), format!("sample {} not trained: {}", s.sample_id, k.detail), s.sample_id.as_bytes(), Lineage::default())
                .with_keys(&s.session_id, Some(&s.interaction_id));
            out.dead(dl).await?;
        }
    }
    for d in &outcome.dropped {
        *report.dropped.entry(d.reason.as_str().to_string()).or_default() += 1;
        let s = &batch[d.index];
        let dl = DeadLetter::new(NAME, d.reason.as_str(), format!("sample {} dropped: {}", d.sample_id, d.detail), s.sample_id.as_bytes(), Lineage::default())
            .with_keys(&s.session_id, Some(&s.interaction_id));
        out.dead(dl).await?;
    }
    publish_checkpoint(out, outcome.checkpoint.as_ref(), report).await
}

async fn publish_checkpoint(out: &Output, ck: Option<&WrittenCheckpoint>, report: &mut TrainReport) -> Result<Option<Checkpoint>> {
    let Some(ck) = ck else { return Ok(None) };
    out.emit(&ck.row, None).await?;
    report.checkpoints.push((ck.row.version, ck.path.display().to_string()));
    tracing::info!(version = ck.row.version, path = %ck.path.display(), samples = ck.row.samples, "checkpoint published");
    Ok(Some(ck.row.clone()))
}

/// Which sample a buffered item is and where it was read (`samples` topic partition and offset; None
/// for a SQL source).
type Item = (Sample, Option<(i32, i64)>);

/// Offsets of the `samples` topic the trainer may commit: per partition, everything read except the
/// samples buffered or trained since their adapter's last checkpoint (both must be read again after a
/// crash), which are held with their adapter.
#[derive(Default)]
struct Offsets {
    held: BTreeMap<(i32, i64), AdapterKey>,
    read_next: HashMap<i32, i64>,
}

impl Offsets {
    /// After adapter `key`'s checkpoint: its samples trained so far are durable; those still buffered
    /// (`buffered`) stay held.
    fn checkpointed(&mut self, key: &AdapterKey, buffered: &BTreeSet<(i32, i64)>) {
        self.held.retain(|pos, k| k != key || buffered.contains(pos));
    }

    /// Commits per partition up to the first held position, else up to what was read.
    fn commit(&self, input: &InputLoop) {
        let mut commit: HashMap<i32, i64> = self.read_next.clone();
        for (p, o) in self.held.keys() {
            let e = commit.entry(*p).or_insert(*o);
            *e = (*e).min(*o);
        }
        if let Err(e) = input.commit(&commit) {
            tracing::warn!(error = %e, "samples offset commit failed; the checkpoint's lineage still prevents re-training");
        }
    }
}

/// Why a sample is refused before it is buffered.
struct Refusal {
    reason: &'static str,
    detail: String,
}

/// The state of one training run: the model thread, the per-adapter buffers, the adapters opened or
/// refused, what is held uncommitted, and the report.
struct Run<'a> {
    cfg: &'a PipelineConfig,
    opts: &'a TrainOptions,
    worker: worker::Worker,
    out: Output,
    report: TrainReport,
    jsonl: Option<crate::metrics::JsonlWriter>,
    on_checkpoint: Option<OnCheckpoint>,
    batcher: Batcher<Item>,
    /// Adapters opened on the model thread.
    opened: HashSet<AdapterKey>,
    /// Tenants whose adapter could not be opened, with the error.
    failed: HashMap<String, String>,
    /// Sample ids consumed by the opened adapters' checkpoint ancestries.
    consumed: HashSet<String>,
    /// Sample ids taken in this run (the topic is at-least-once), with their adapter.
    taken: HashMap<String, AdapterKey>,
    /// The `samples` partitions each adapter read samples from (per-tenant hand-over at rebalances).
    partitions_of: HashMap<AdapterKey, BTreeSet<i32>>,
    /// Set when reading the `samples` topic.
    offsets: Option<Offsets>,
    /// The `samples` topic's name (lineage).
    topic: String,
    max_steps: i64,
}

impl Run<'_> {
    fn stopped(&self, ctl: &TaskCtl) -> bool {
        ctl.stop.requested() || self.report.steps >= self.max_steps
    }

    /// Opens adapter `key` unless it is open, refused earlier, or beyond the tenant cap. A tenant whose
    /// adapter cannot be opened is refused from then on (its samples dead-lettered); the shared policy
    /// failing to open is an error.
    async fn admit(&mut self, key: &AdapterKey) -> Result<std::result::Result<(), Refusal>> {
        if self.opened.contains(key) {
            return Ok(Ok(()));
        }
        if let Some(t) = key {
            if let Some(e) = self.failed.get(t) {
                return Ok(Err(Refusal { reason: "tenant_unavailable", detail: format!("the adapter of tenant {t} could not be opened: {e}") }));
            }
        }
        if let Err(over) = self.batcher.admit(key) {
            return Ok(Err(Refusal { reason: "tenant_cap", detail: over.to_string() }));
        }
        match self.worker.open(key.clone()).await {
            Ok(o) => {
                if let Some(v) = o.resumed_from {
                    self.report.resumed.insert(adapter_name(key).to_string(), v);
                    if key.is_none() {
                        self.report.resumed_from = Some(v);
                    }
                }
                self.consumed.extend(o.consumed);
                self.opened.insert(key.clone());
                Ok(Ok(()))
            }
            Err(e) => match key {
                None => Err(e),
                // the model thread is gone: nothing can train, not a tenant's fault
                Some(_) if matches!(e, Error::Internal(_)) => Err(e),
                Some(t) => {
                    tracing::error!(tenant = %t, error = %e, "a tenant's adapter cannot be opened: its samples are dead-lettered, the other tenants keep training");
                    self.failed.insert(t.clone(), e.to_string());
                    Ok(Err(Refusal { reason: "tenant_unavailable", detail: format!("the adapter of tenant {t} could not be opened: {e}") }))
                }
            },
        }
    }

    /// Takes one sample: skipped (another pipeline's, already trained, a duplicate), refused
    /// (dead-lettered) or buffered for its adapter.
    async fn accept(&mut self, s: Sample, pos: Option<(i32, i64)>) -> Result<()> {
        if s.pipeline != self.cfg.name {
            self.report.skipped_other_pipeline += 1;
            return Ok(());
        }
        let key = self.cfg.trainer.tenants.adapter_of(s.tenant.as_deref());
        if let Some((p, _)) = pos {
            self.partitions_of.entry(key.clone()).or_default().insert(p);
        }
        if let Err(r) = self.admit(&key).await? {
            *self.report.refused.entry(r.reason.to_string()).or_default() += 1;
            let lineage = match pos {
                Some((p, o)) => Lineage { source_topic: Some(self.topic.clone()), source_partition: Some(p), source_offset: Some(o), ..Default::default() },
                None => Lineage::default(),
            };
            let payload = serde_json::to_vec(&s)?;
            let dl = DeadLetter::new(NAME, r.reason, format!("sample {} not trained: {}", s.sample_id, r.detail), &payload, lineage)
                .with_keys(&s.session_id, Some(&s.interaction_id))
                .with_tenant(s.tenant.as_deref());
            return self.out.dead(dl).await;
        }
        if self.consumed.contains(&s.sample_id) {
            self.report.skipped_already_trained += 1;
        } else if self.taken.contains_key(&s.sample_id) {
            self.report.skipped_duplicates += 1;
        } else {
            if let (Some(off), Some(p)) = (self.offsets.as_mut(), pos) {
                off.held.insert(p, key.clone());
            }
            self.taken.insert(s.sample_id.clone(), key.clone());
            // admitted above, so this cannot be over the cap
            let _ = self.batcher.push(key, (s, pos));
        }
        Ok(())
    }

    /// Trains every full batch (reading the topic, also an adapter's partial batch of at least `min_batch`
    /// once its oldest sample waited `[trainer.tenants] max_wait_s`; `at_end`, every adapter's remainder of
    /// at least `min_batch`).
    ///
    /// Reading the topic (not at the end) it returns after [`TRAIN_READY_BUDGET`] of steps, so the loop
    /// polls the consumer (and sees a rebalance) between long runs of steps: many tenants due at once
    /// must not keep it from polling until `max.poll.interval.ms` fences it while it still trains them.
    async fn train_ready(&mut self, at_end: bool, ctl: &TaskCtl, input: Option<&InputLoop>) -> Result<()> {
        let started = std::time::Instant::now();
        while !self.stopped(ctl) {
            if !at_end && input.is_some() && started.elapsed() >= TRAIN_READY_BUDGET {
                break;
            }
            // The maximum wait applies to the topic only: a SQL replay's batches must not depend on wall time.
            let next = match (at_end, input) {
                (true, _) => self.batcher.next_at_end(),
                (false, Some(_)) => self.batcher.next_due(std::time::Instant::now()),
                (false, None) => self.batcher.next_full(),
            };
            let Some((key, chunk)) = next else { break };
            let positions: Vec<worker::Position> = chunk.iter().filter_map(|(s, p)| p.map(|(p, o)| (s.sample_id.clone(), (self.topic.clone(), p, o)))).collect();
            let pos_of: HashMap<String, (i32, i64)> = chunk.iter().filter_map(|(s, p)| p.map(|p| (s.sample_id.clone(), p))).collect();
            let samples: Vec<Sample> = chunk.into_iter().map(|(s, _)| s).collect();
            let outcome = self.worker.step(key.clone(), samples.clone(), positions).await?;
            append_jsonl(&mut self.jsonl, &self.opts.metrics_jsonl_extra, &outcome)?;
            let before = self.report.samples_trained;
            let checkpoint = publish(&self.out, &outcome, &mut self.report, &samples).await?;
            let trained = self.report.samples_trained - before;
            crate::metrics::trainer_tenant_step(adapter_name(&key), outcome.train_step.is_some(), trained);
            let adapter = self.report.tenants.entry(adapter_name(&key).to_string()).or_default();
            adapter.steps += i64::from(outcome.train_step.is_some());
            adapter.samples_trained += trained;
            if let Some(k) = &outcome.skipped {
                // The skipped samples are dead-lettered and will never be trained: their offsets need no
                // checkpoint, so the commit moves past them now.
                if let Some(off) = self.offsets.as_mut() {
                    for &i in &k.samples {
                        if let Some(pos) = pos_of.get(&samples[i].sample_id) {
                            off.held.remove(pos);
                        }
                    }
                }
            }
            match checkpoint {
                Some(row) => self.checkpointed(&key, &row, input),
                None if outcome.skipped.is_some() => self.commit(input),
                None => {}
            }
        }
        Ok(())
    }

    /// After a rebalance in per-tenant training (module docs): hands over every tenant that read samples
    /// from a partition this consumer lost (held ones or not: a tenant whose samples are all checkpointed
    /// goes too, so that when the partition comes back it is opened again from its newest checkpoint,
    /// which another process may have written since). Its buffered samples are dropped, its adapter
    /// closed without a checkpoint, its sample ids, refusal and place under `max_tenants` forgotten, and
    /// its held samples in partitions still assigned here are read again from the first of them (a seek).
    /// Nothing of a lost partition is committed from here any more. The shared policy (one trainer
    /// process) keeps its state: a partition assigned again is read again and what was taken is skipped
    /// as a duplicate. Returns the partitions sought back: the caller drops the records of the current
    /// batch from them (they are read again).
    ///
    /// # Errors
    /// [`Error::Internal`] when the model thread is gone; [`Error::Kafka`] when a partition still
    /// assigned cannot be read again from a tenant's first sample (the process stops; its restart reads
    /// from the committed offsets).
    async fn hand_over(&mut self, revoked: Revoked, input: &mut InputLoop) -> Result<BTreeSet<i32>> {
        let mut sought = BTreeSet::new();
        let Some(off) = self.offsets.as_mut() else {
            return Ok(sought);
        };
        let lost: BTreeSet<i32> = match revoked {
            Revoked::Partitions(p) => p,
            Revoked::All => off.read_next.keys().copied().chain(off.held.keys().map(|(p, _)| *p)).chain(self.partitions_of.values().flatten().copied()).collect(),
        };
        tracing::info!(partitions = ?lost, "samples partitions revoked");
        for p in &lost {
            off.read_next.remove(p);
        }
        if !self.cfg.trainer.tenants.per_tenant() {
            return Ok(sought);
        }
        let hit: BTreeSet<AdapterKey> = self.partitions_of.iter().filter(|(_, ps)| !ps.is_disjoint(&lost)).map(|(k, _)| k.clone()).collect();
        for key in hit {
            let mut rewind: BTreeMap<i32, i64> = BTreeMap::new();
            let mut n = 0u64;
            off.held.retain(|&(p, o), k| {
                if k != &key {
                    return true;
                }
                n += 1;
                if !lost.contains(&p) {
                    let e = rewind.entry(p).or_insert(o);
                    *e = (*e).min(o);
                }
                false
            });
            self.partitions_of.remove(&key);
            let buffered = self.batcher.release(&key).len();
            self.taken.retain(|_, k| k != &key);
            if let Some(t) = &key {
                self.failed.remove(t);
            }
            if self.opened.remove(&key) {
                self.worker.close(key.clone()).await?;
            }
            *self.report.handed_over.entry(adapter_name(&key).to_string()).or_default() += n;
            crate::metrics::trainer_tenant_handed_over(adapter_name(&key), n);
            tracing::info!(
                tenant = adapter_name(&key),
                samples = n,
                buffered,
                trained_since_checkpoint = n as usize - buffered.min(n as usize),
                "tenant handed over at a rebalance: adapter closed without a checkpoint; its samples are read again by the partition's owner"
            );
            for (p, o) in rewind {
                input.seek(p, o)?;
                let e = off.read_next.entry(p).or_insert(o);
                *e = (*e).min(o);
                sought.insert(p);
            }
        }
        Ok(sought)
    }

    fn commit(&self, input: Option<&InputLoop>) {
        if let (Some(off), Some(input)) = (self.offsets.as_ref(), input) {
            off.commit(input);
        }
    }

    /// After adapter `key`'s checkpoint `row` is published: commit what it made durable, tell the hook.
    fn checkpointed(&mut self, key: &AdapterKey, row: &Checkpoint, input: Option<&InputLoop>) {
        let buffered: BTreeSet<(i32, i64)> = self.batcher.buffered().filter_map(|(_, p)| *p).collect();
        if let Some(off) = self.offsets.as_mut() {
            off.checkpointed(key, &buffered);
        }
        self.commit(input);
        self.report.tenants.entry(adapter_name(key).to_string()).or_default().version = Some(row.version);
        crate::metrics::trainer_tenant_version(adapter_name(key), row.version);
        if let Some(f) = &self.on_checkpoint {
            f(row);
        }
    }

    /// At the end: checkpoint every adapter with steps since its last checkpoint; report what waits.
    async fn finish(&mut self, input: Option<&InputLoop>) -> Result<()> {
        // Every adapter's checkpoint is written by now: publish each written one even if another failed.
        let mut first_error = None;
        for (key, r) in self.worker.flush().await? {
            match r {
                Ok(Some(ck)) => {
                    if let Some(row) = publish_checkpoint(&self.out, Some(&ck), &mut self.report).await? {
                        self.checkpointed(&key, &row, input);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(adapter = adapter_name(&key), error = %e, "checkpoint failed");
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        for (key, n) in self.batcher.waiting() {
            tracing::info!(adapter = adapter_name(&key), samples = n, min_batch = self.cfg.trainer.tenants.min_batch_for(self.cfg.trainer.batch_size), "samples wait for a batch (below min_batch); not trained in this run");
            self.report.waiting.insert(adapter_name(&key).to_string(), n as u64);
        }
        Ok(())
    }
}

/// Refuses a run folder whose checkpoints belong to the other training mode, and (without `--resume`)
/// a per-tenant run folder that already has checkpoints.
fn check_run_folder(cfg: &PipelineConfig, opts: &TrainOptions) -> Result<()> {
    let run_id = opts.run_id.clone().unwrap_or_else(|| cfg.name.clone());
    let run_dir = opts.checkpoints_dir.join(&run_id);
    let tenants_with_checkpoints: Vec<String> = crate::trainer::tenants::tenant_folders(&run_dir)?
        .into_iter()
        .filter(|t| crate::trainer::latest_complete(&run_dir.join(t)).is_ok_and(|c| c.is_some()))
        .collect();
    if cfg.trainer.tenants.per_tenant() {
        if let Some((path, _)) = crate::trainer::latest_complete(&run_dir)? {
            return Err(crate::config_err!("run {run_id} holds checkpoints of a shared policy ({}); per-tenant training needs another run id", path.display()));
        }
        if !opts.resume && !tenants_with_checkpoints.is_empty() {
            return Err(crate::config_err!(
                "run {run_id} already has checkpoints of tenants {} ({}); resume it or choose another run id",
                tenants_with_checkpoints.join(", "),
                run_dir.display()
            ));
        }
    } else if !tenants_with_checkpoints.is_empty() {
        return Err(crate::config_err!(
            "run {run_id} holds per-tenant checkpoints (tenants {}; {}); set [trainer.tenants] mode = \"per_tenant\" or choose another run id",
            tenants_with_checkpoints.join(", "),
            run_dir.display()
        ));
    }
    Ok(())
}

/// Runs the trainer until the source is exhausted (SQL), or until stopped / idle (topic).
///
/// With `[trainer.tenants] mode = "per_tenant"` every tenant's samples train that tenant's own LoRA
/// adapter (batches never mix tenants; checkpoints `<run>/<tenant>/<version>` with the tenant in the
/// `checkpoints` row); a tenant's adapter is opened at its first sample, from its newest checkpoint when
/// it has one. A tenant beyond `max_tenants`, or whose adapter cannot be opened, has its samples
/// dead-lettered (`tenant_cap`, `tenant_unavailable`) while the other tenants keep training. At the end
/// of the input an adapter with fewer than `min_batch` samples waits: they are not trained, and read from
/// the topic their offsets stay uncommitted ([`TrainReport::waiting`]).
///
/// # Errors
/// Model loading, configuration (e.g. an existing run without `--resume`, a run folder of the other
/// training mode), Kafka and lake errors. A batch whose loss or gradient is not finite, or on which
/// libtorch fails, is not an error: its offending samples are dead-lettered (`non_finite_loss`,
/// `non_finite_grad`, `torch_error`), counted in [`TrainReport::skipped_samples`] /
/// [`TrainReport::skipped_steps`], and training goes on.
pub async fn run_train(cfg: &PipelineConfig, opts: &TrainOptions, bus: &Bus, ctl: &TaskCtl, on_checkpoint: Option<OnCheckpoint>) -> Result<TrainReport> {
    check_run_folder(cfg, opts)?;
    let mut run = Run {
        cfg,
        opts,
        worker: worker::start(cfg, opts)?,
        out: Output::new(bus.producer()?, NAME),
        report: TrainReport::default(),
        jsonl: opts.metrics_jsonl.as_deref().map(crate::metrics::JsonlWriter::open).transpose()?,
        on_checkpoint,
        batcher: Batcher::new(&cfg.trainer.tenants, cfg.trainer.batch_size),
        opened: HashSet::new(),
        failed: HashMap::new(),
        consumed: HashSet::new(),
        taken: HashMap::new(),
        partitions_of: HashMap::new(),
        offsets: None,
        topic: bus.topic("samples"),
        max_steps: opts.max_steps.unwrap_or(i64::MAX),
    };
    if !cfg.trainer.tenants.per_tenant() {
        // the shared policy loads (and resumes) before anything is read, as it always has
        let _ = run.admit(&None).await?;
    }
    match &opts.source {
        TrainSource::Sql(q) => {
            let lake = crate::lake::Lake::open(&cfg.lake)?;
            for s in query_samples(&lake, q).await? {
                if run.stopped(ctl) {
                    break;
                }
                run.accept(s, None).await?;
                run.train_ready(false, ctl, None).await?;
            }
            run.train_ready(true, ctl, None).await?;
            run.finish(None).await?;
        }
        TrainSource::Topic => {
            let group = consumer_group(bus, &cfg.name);
            // An optimizer step does not poll the consumer and can take minutes on a CPU.
            let mut input = InputLoop::with_max_poll_interval(bus, &group, &run.topic, TRAINER_MAX_POLL_INTERVAL_MS)?.for_stage(NAME);
            run.offsets = Some(Offsets::default());
            loop {
                if run.stopped(ctl) {
                    break;
                }
                let msgs = input.next_batch(256, input.poll_wait(ctl, std::time::Duration::from_millis(300), 0)).await?;
                input.rebalanced();
                let sought = match input.take_revoked() {
                    Some(r) => run.hand_over(r, &mut input).await?,
                    None => BTreeSet::new(),
                };
                let assigned: HashSet<i32> = if msgs.is_empty() { HashSet::new() } else { input.assigned().into_iter().collect() };
                for m in &msgs {
                    if sought.contains(&m.partition) {
                        // read again from a handed-over tenant's first sample (the seek)
                        continue;
                    }
                    if !assigned.contains(&m.partition) {
                        // revoked while it arrived: its owner reads it again from the committed offset
                        run.report.skipped_not_assigned += 1;
                        continue;
                    }
                    if let Some(off) = run.offsets.as_mut() {
                        off.read_next.insert(m.partition, m.offset + 1);
                    }
                    match serde_json::from_slice::<Envelope<Sample>>(&m.payload) {
                        Err(e) => {
                            let d = DeadLetter::new(
                                NAME,
                                "malformed_record",
                                format!("not a valid samples record: {e}"),
                                &m.payload,
                                Lineage { source_topic: Some(run.topic.clone()), source_partition: Some(m.partition), source_offset: Some(m.offset), ..Default::default() },
                            );
                            run.out.dead(d).await?;
                        }
                        Ok(env) => run.accept(env.row, Some((m.partition, m.offset))).await?,
                    }
                }
                run.train_ready(false, ctl, Some(&input)).await?;
                // Until idle: once the input is quiet and caught up, train the remainders and stop (an
                // adapter below min_batch waits, uncommitted, for the next run).
                if msgs.is_empty() && ctl.until_idle && input.idle_finished(ctl, 0).await? {
                    run.train_ready(true, ctl, Some(&input)).await?;
                    break;
                }
            }
            run.finish(Some(&input)).await?;
        }
    }
    ctl.done.set();
    Ok(run.report)
}


/// Runs `q` over the lake and returns its rows as samples (the query must return every column of
/// `samples`).
///
/// # Errors
/// [`Error::Sql`] for a bad query; [`Error::Records`] when the columns are not full `samples` rows.
pub async fn query_samples(lake: &crate::lake::Lake, q: &str) -> Result<Vec<Sample>> {
    let batches = crate::sql::query(lake, q).await?;
    let mut out = vec![];
    for b in batches {
        let rows: Vec<Sample> = serde_arrow::from_record_batch(&b)
            .map_err(|e| Error::InvalidInput(format!("the query must return full samples rows (SELECT * FROM samples ...): {e}")))?;
        out.extend(rows);
    }
    Ok(out)
}

/// `nextstate train` as a command: connects the bus, runs the lake sinks of the trainer's tables
/// (`train_steps`, `checkpoints`, `dead_letters`) in-process, and on the embedded bus re-publishes the
/// pipeline's samples that no checkpoint of this run consumed yet (topic source).
///
/// # Errors
/// As [`run_train`].
pub async fn train_command(cfg: &PipelineConfig, opts: &TrainOptions, until_idle: bool, stop: crate::runtime::Stop) -> Result<TrainReport> {
    let lake = crate::lake::Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&["samples", "train_steps", "checkpoints", "dead_letters"]).await?;
    let producer = bus.producer()?;
    let republished = crate::runtime::DoneFlag::default();
    let ctl = TaskCtl::new(NAME, until_idle || matches!(opts.source, TrainSource::Sql(_)), stop.clone()).after(&republished);
    let group = consumer_group(&bus, &cfg.name);
    if matches!(opts.source, TrainSource::Topic) {
        bus.expect_consumer(&group, "samples");
    }
    let sinks = start_sinks(&["train_steps", "checkpoints", "dead_letters"], &bus, &lake, &cfg.sink, &producer, |t| TaskCtl::new(&format!("sink:{t}"), true, stop.clone()).after(&ctl.done));
    let trainer = {
        let (cfg, opts, bus, ctl) = (cfg.clone(), opts.clone(), bus.clone(), ctl.clone());
        tokio::spawn(async move { run_train(&cfg, &opts, &bus, &ctl, None).await })
    };
    if bus.is_embedded() && matches!(opts.source, TrainSource::Topic) {
        let run_id = opts.run_id.clone().unwrap_or_else(|| cfg.name.clone());
        let n = republish_untrained(&lake, &producer, cfg, &opts.checkpoints_dir.join(&run_id)).await?;
        tracing::info!(samples = n, "re-published untrained samples from the lake");
    }
    republished.set();
    let result = trainer.await.map_err(|e| Error::Internal(format!("trainer task: {e}")))?;
    if result.is_err() {
        ctl.done.set();
        stop.request();
    }
    for (_, s) in sinks {
        s.await.map_err(|e| Error::Internal(format!("sink task: {e}")))??;
    }
    result
}

/// Publishes the pipeline's samples in the lake that no complete checkpoint under `run_dir` consumed (the
/// shared policy's, or any tenant's adapter's in `<run_dir>/<tenant>/`).
///
/// # Errors
/// Lake and Kafka errors.
pub async fn republish_untrained(lake: &crate::lake::Lake, producer: &crate::bus::BusProducer, cfg: &PipelineConfig, run_dir: &std::path::Path) -> Result<u64> {
    // the shared policy's checkpoints, and each tenant's (per-tenant training: `<run>/<tenant>/<version>`)
    let mut manifests: Vec<crate::trainer::Manifest> = crate::trainer::scan(run_dir)?.complete.into_iter().map(|(_, m)| m).collect();
    for t in crate::trainer::tenants::tenant_folders(run_dir)? {
        manifests.extend(crate::trainer::scan(&run_dir.join(t))?.complete.into_iter().map(|(_, m)| m));
    }
    let consumed = crate::trainer::consumed_sample_ids(&manifests);
    let mut rows: Vec<Sample> = lake.read_table::<Sample>()?.into_iter().filter(|s| s.pipeline == cfg.name && !consumed.contains(&s.sample_id)).collect();
    rows.sort_by(|a, b| (a.event_time, &a.sample_id).cmp(&(b.event_time, &b.sample_id)));
    for r in &rows {
        producer.send(r, None).await?;
    }
    Ok(rows.len() as u64)
}
