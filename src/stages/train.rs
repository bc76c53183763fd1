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
//! The model lives on a dedicated thread (libtorch work never blocks the async runtime); the async side
//! sends it batches.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::mpsc;

use tokio::sync::oneshot;

use super::Output;
use crate::bus::{Bus, Envelope};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::lake::sink::start_sinks;
use crate::model::{LanguageModel, LoadOptions, LoraConfig, LoraTarget, Trainable};
use crate::runtime::{InputLoop, TaskCtl};
use crate::schema::{Checkpoint, DeadLetter, Lineage, Sample};
use crate::trainer::{CheckpointWriter, StepOutcome, Trainer, WrittenCheckpoint};

/// `max.poll.interval.ms` of the trainer's `samples` consumer, at least (1 h): the trainer does not poll
/// while an optimizer step runs (215 s measured for a full fine-tuning step on 11 long samples on 2 CPU
/// cores), and a static member that exceeds the interval is fenced, which is fatal to its consumer.
/// A crashed trainer is still detected by `session.timeout.ms` (heartbeats run on librdkafka's thread).
pub const TRAINER_MAX_POLL_INTERVAL_MS: u32 = 3_600_000;

/// Where the trainer reads samples.
#[derive(Debug, Clone)]
pub enum TrainSource {
    /// The `samples` topic, as a consumer group (online).
    Topic,
    /// A SQL query over the lake returning full `samples` rows (offline replay), e.g.
    /// `SELECT * FROM samples WHERE pipeline = 'combined' ORDER BY event_time`.
    Sql(String),
}

/// Options of `nextstate train`.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Sample source.
    pub source: TrainSource,
    /// Continue from the newest complete checkpoint of the run.
    pub resume: bool,
    /// Run id (checkpoint folder name); default: the pipeline name.
    pub run_id: Option<String>,
    /// Folder holding `<run id>/<version>/` checkpoints.
    pub checkpoints_dir: PathBuf,
    /// Stop after this many optimizer steps.
    pub max_steps: Option<i64>,
    /// `--metrics-jsonl FILE`: append one JSON object per optimizer step (the `train_steps` row, plus
    /// `metrics_jsonl_extra`), flushed per line.
    pub metrics_jsonl: Option<PathBuf>,
    /// Keys added to each JSON line (`ablate`: `arm`, `group` and `seed`).
    pub metrics_jsonl_extra: Vec<(String, serde_json::Value)>,
}

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
    /// Version resumed from (None: fresh start).
    pub resumed_from: Option<i64>,
    /// Final loss of the last step.
    pub last_loss: Option<f64>,
}

/// Called after each checkpoint is durable and published (e.g. to hot-swap a server's weights).
pub type OnCheckpoint = Box<dyn Fn(&Checkpoint) + Send + Sync>;

enum Cmd {
    Step(Vec<Sample>, Vec<(String, (String, i32, i64))>, oneshot::Sender<Result<StepOutcome>>),
    Flush(oneshot::Sender<Result<Option<WrittenCheckpoint>>>),
}

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

struct Worker {
    tx: mpsc::Sender<Cmd>,
    consumed: HashSet<String>,
    resumed_from: Option<i64>,
}

fn start_worker(cfg: &PipelineConfig, opts: &TrainOptions) -> Result<Worker> {
    let load = policy_load_options(cfg)?;
    let model_dir = cfg.policy.model.clone();
    let method = cfg.method;
    let tcfg = cfg.trainer.clone();
    let run_id = opts.run_id.clone().unwrap_or_else(|| cfg.name.clone());
    let mut writer = CheckpointWriter::new(&opts.checkpoints_dir, &run_id);
    // a lake on object storage keeps a copy of every checkpoint (trainer::checkpoint module docs)
    if cfg.lake.to_str().is_some_and(crate::lake::remote::is_url) {
        writer = writer.with_lake(&crate::lake::Lake::open(&cfg.lake)?);
    }
    let resume = opts.resume;
    let threads = cfg.policy.threads;
    let (tx, rx) = mpsc::channel::<Cmd>();
    let (init_tx, init_rx) = mpsc::channel::<Result<(HashSet<String>, Option<i64>)>>();
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            if threads > 0 {
                let _ = crate::model::set_threads(threads as i32);
            }
            let built = (|| -> Result<(Trainer<LanguageModel>, HashSet<String>, Option<i64>)> {
                // Fresh LoRA adapters are drawn from libtorch's generator: seed it first, so the same
                // configuration always starts from the same adapters (runs are repeatable).
                tch::manual_seed(tcfg.seed as i64);
                let policy = LanguageModel::load(&model_dir, &load)?;
                if resume {
                    let (t, r) = Trainer::resume(policy, method, tcfg, writer)?;
                    let from = r.from.as_ref().map(|(_, m)| m.version);
                    Ok((t, r.consumed, from))
                } else {
                    Ok((Trainer::new(policy, method, tcfg, writer)?, HashSet::new(), None))
                }
            })();
            let mut trainer = match built {
                Ok((t, consumed, from)) => {
                    let _ = init_tx.send(Ok((consumed, from)));
                    t
                }
                Err(e) => {
                    let _ = init_tx.send(Err(e));
                    return;
                }
            };
            while let Ok(cmd) = rx.recv() {
                match cmd {
                    Cmd::Step(samples, positions, reply) => {
                        trainer.note_positions(positions);
                        let _ = reply.send(trainer.train_step(&samples));
                    }
                    Cmd::Flush(reply) => {
                        let _ = reply.send(trainer.checkpoint());
                    }
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start the trainer thread: {e}")))?;
    let (consumed, resumed_from) = init_rx.recv().map_err(|_| Error::Internal("trainer thread ended during start-up".into()))??;
    Ok(Worker { tx, consumed, resumed_from })
}

impl Worker {
    async fn step(&self, samples: Vec<Sample>, positions: Vec<(String, (String, i32, i64))>) -> Result<StepOutcome> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Step(samples, positions, tx)).map_err(|_| Error::Internal("trainer thread is gone".into()))?;
        rx.await.map_err(|_| Error::Internal("trainer thread is gone".into()))?
    }
    async fn flush(&self) -> Result<Option<WrittenCheckpoint>> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Flush(tx)).map_err(|_| Error::Internal("trainer thread is gone".into()))?;
        rx.await.map_err(|_| Error::Internal("trainer thread is gone".into()))?
    }
}

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
            let dl = DeadLetter::new("train", k.reason.as_str(), format!("sample {} not trained: {}", s.sample_id, k.detail), s.sample_id.as_bytes(), Lineage::default())
                .with_keys(&s.session_id, Some(&s.interaction_id));
            out.dead(dl).await?;
        }
    }
    for d in &outcome.dropped {
        *report.dropped.entry(d.reason.as_str().to_string()).or_default() += 1;
        let s = &batch[d.index];
        let dl = DeadLetter::new("train", d.reason.as_str(), format!("sample {} dropped: {}", d.sample_id, d.detail), s.sample_id.as_bytes(), Lineage::default())
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

/// Runs the trainer until the source is exhausted (SQL), or until stopped / idle (topic).
///
/// # Errors
/// Model loading, configuration (e.g. an existing run without `--resume`), Kafka and lake errors. A
/// batch whose loss or gradient is not finite, or on which libtorch fails, is not an error: its
/// offending samples are dead-lettered (`non_finite_loss`, `non_finite_grad`, `torch_error`), counted
/// in [`TrainReport::skipped_samples`] / [`TrainReport::skipped_steps`], and training goes on.
pub async fn run_train(cfg: &PipelineConfig, opts: &TrainOptions, bus: &Bus, ctl: &TaskCtl, on_checkpoint: Option<OnCheckpoint>) -> Result<TrainReport> {
    let worker = start_worker(cfg, opts)?;
    let out = Output::new(bus.producer()?, "train");
    let mut report = TrainReport { resumed_from: worker.resumed_from, ..Default::default() };
    let batch_size = cfg.trainer.batch_size.max(1);
    let notify = |row: &Checkpoint| {
        if let Some(f) = &on_checkpoint {
            f(row);
        }
    };
    let max_steps = opts.max_steps.unwrap_or(i64::MAX);
    let mut jsonl = opts.metrics_jsonl.as_deref().map(crate::metrics::JsonlWriter::open).transpose()?;
    match &opts.source {
        TrainSource::Sql(q) => {
            let lake = crate::lake::Lake::open(&cfg.lake)?;
            let samples = query_samples(&lake, q).await?;
            let mut todo: Vec<Sample> = Vec::new();
            let mut taken: HashSet<String> = HashSet::new();
            for s in samples {
                if worker.consumed.contains(&s.sample_id) {
                    report.skipped_already_trained += 1;
                } else if !taken.insert(s.sample_id.clone()) {
                    report.skipped_duplicates += 1;
                } else {
                    todo.push(s);
                }
            }
            for chunk in todo.chunks(batch_size) {
                if ctl.stop.requested() || report.steps >= max_steps {
                    break;
                }
                let outcome = worker.step(chunk.to_vec(), vec![]).await?;
                append_jsonl(&mut jsonl, &opts.metrics_jsonl_extra, &outcome)?;
                if let Some(row) = publish(&out, &outcome, &mut report, chunk).await? {
                    notify(&row);
                }
            }
            if let Some(row) = publish_checkpoint(&out, worker.flush().await?.as_ref(), &mut report).await? {
                notify(&row);
            }
        }
        TrainSource::Topic => {
            let topic = bus.topic("samples");
            let group = bus.group(&format!("nextstate.{}.trainer", cfg.name));
            // An optimizer step does not poll the consumer and can take minutes on a CPU.
            let mut input = InputLoop::with_max_poll_interval(bus, &group, &topic, TRAINER_MAX_POLL_INTERVAL_MS)?.for_stage("train");
            let mut pending: Vec<(Sample, i32, i64)> = vec![];
            // (partition, offset) of samples buffered or trained since the last checkpoint
            let mut open: BTreeSet<(i32, i64)> = BTreeSet::new();
            let mut consumed_next: HashMap<i32, i64> = HashMap::new();
            // Sample ids taken in this run: the topic is at-least-once (a stage that crashed between
            // sending and committing sends again), so a sample id may arrive more than once.
            let mut taken: HashSet<String> = HashSet::new();
            loop {
                if ctl.stop.requested() || report.steps >= max_steps {
                    break;
                }
                let msgs = input.next_batch(256, input.poll_wait(ctl, std::time::Duration::from_millis(300), 0)).await?;
                input.rebalanced();
                for m in &msgs {
                    consumed_next.insert(m.partition, m.offset + 1);
                    match serde_json::from_slice::<Envelope<Sample>>(&m.payload) {
                        Err(e) => {
                            let d = DeadLetter::new(
                                "train",
                                "malformed_record",
                                format!("not a valid samples record: {e}"),
                                &m.payload,
                                Lineage { source_topic: Some(topic.clone()), source_partition: Some(m.partition), source_offset: Some(m.offset), ..Default::default() },
                            );
                            out.dead(d).await?;
                        }
                        Ok(env) if env.row.pipeline != cfg.name => report.skipped_other_pipeline += 1,
                        Ok(env) if worker.consumed.contains(&env.row.sample_id) => report.skipped_already_trained += 1,
                        Ok(env) if !taken.insert(env.row.sample_id.clone()) => report.skipped_duplicates += 1,
                        Ok(env) => {
                            open.insert((m.partition, m.offset));
                            pending.push((env.row, m.partition, m.offset));
                        }
                    }
                }
                let finishing = msgs.is_empty() && ctl.until_idle && !pending.is_empty() && input.idle_finished(ctl, 0).await?;
                while pending.len() >= batch_size || (finishing && !pending.is_empty()) {
                    let n = pending.len().min(batch_size);
                    let chunk: Vec<(Sample, i32, i64)> = pending.drain(..n).collect();
                    let positions = chunk.iter().map(|(s, p, o)| (s.sample_id.clone(), (topic.clone(), *p, *o))).collect();
                    let chunk_pos: HashMap<String, (i32, i64)> = chunk.iter().map(|(s, p, o)| (s.sample_id.clone(), (*p, *o))).collect();
                    let samples: Vec<Sample> = chunk.into_iter().map(|(s, _, _)| s).collect();
                    let outcome = worker.step(samples.clone(), positions).await?;
                    append_jsonl(&mut jsonl, &opts.metrics_jsonl_extra, &outcome)?;
                    let checkpointed = publish(&out, &outcome, &mut report, &samples).await?;
                    if let Some(row) = checkpointed {
                        commit_checkpointed(&input, &mut open, &pending, &consumed_next);
                        notify(&row);
                    } else if let Some(k) = &outcome.skipped {
                        // The skipped samples are dead-lettered and will never be trained: their offsets
                        // need no checkpoint, so move the commit past them now (up to the first sample
                        // still buffered or trained since the last checkpoint), else a restart would
                        // read them again.
                        for &i in &k.samples {
                            let s = &samples[i];
                            if let Some(pos) = chunk_pos.get(&s.sample_id) {
                                open.remove(pos);
                            }
                        }
                        commit_open(&input, &open, &consumed_next);
                    }
                    if report.steps >= max_steps {
                        break;
                    }
                }
                if msgs.is_empty() && pending.is_empty() && input.idle_finished(ctl, 0).await? {
                    break;
                }
            }
            if let Some(row) = publish_checkpoint(&out, worker.flush().await?.as_ref(), &mut report).await? {
                commit_checkpointed(&input, &mut open, &pending, &consumed_next);
                notify(&row);
            }
        }
    }
    ctl.done.set();
    Ok(report)
}

/// After a checkpoint: everything trained so far is durable; commit per partition up to the first
/// sample still buffered (not trained), else up to what was read.
fn commit_checkpointed(input: &InputLoop, open: &mut BTreeSet<(i32, i64)>, pending: &[(Sample, i32, i64)], consumed_next: &HashMap<i32, i64>) {
    let still: BTreeSet<(i32, i64)> = pending.iter().map(|(_, p, o)| (*p, *o)).collect();
    open.retain(|x| still.contains(x));
    commit_open(input, open, consumed_next);
}

/// Commits per partition up to the first position in `open` (buffered, or trained since the last
/// checkpoint: both must be read again after a crash), else up to what was read.
fn commit_open(input: &InputLoop, open: &BTreeSet<(i32, i64)>, consumed_next: &HashMap<i32, i64>) {
    let mut commit: HashMap<i32, i64> = consumed_next.clone();
    for (p, o) in open.iter() {
        let e = commit.entry(*p).or_insert(*o);
        *e = (*e).min(*o);
    }
    if let Err(e) = input.commit(&commit) {
        tracing::warn!(error = %e, "samples offset commit failed; the checkpoint's lineage still prevents re-training");
    }
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
    let ctl = TaskCtl::new("train", until_idle || matches!(opts.source, TrainSource::Sql(_)), stop.clone()).after(&republished);
    let group = bus.group(&format!("nextstate.{}.trainer", cfg.name));
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

/// Publishes the pipeline's samples in the lake that no complete checkpoint under `run_dir` consumed.
///
/// # Errors
/// Lake and Kafka errors.
pub async fn republish_untrained(lake: &crate::lake::Lake, producer: &crate::bus::BusProducer, cfg: &PipelineConfig, run_dir: &std::path::Path) -> Result<u64> {
    let scan = crate::trainer::scan(run_dir)?;
    let manifests: Vec<crate::trainer::Manifest> = scan.complete.into_iter().map(|(_, m)| m).collect();
    let consumed = crate::trainer::consumed_sample_ids(&manifests);
    let mut rows: Vec<Sample> = lake.read_table::<Sample>()?.into_iter().filter(|s| s.pipeline == cfg.name && !consumed.contains(&s.sample_id)).collect();
    rows.sort_by(|a, b| (a.event_time, &a.sample_id).cmp(&(b.event_time, &b.sample_id)));
    for r in &rows {
        producer.send(r, None).await?;
    }
    Ok(rows.len() as u64)
}

/// What `nextstate loss` prints: the trainer's loss report plus each sample's per-token log-probs under
/// the evaluated weights (the same numbers the trainer's forward pass sees).
#[derive(Debug, serde::Serialize)]
pub struct LossCommandReport {
    /// Weights evaluated (model or checkpoint folder).
    pub weights: String,
    /// Per-sample advantages and loss components, per-chunk metrics, dropped samples.
    pub report: crate::trainer::LossReport,
    /// Per sample (input order): log π(response_t | prompt, response_<t) for every response token (nats),
    /// at `trainer.temperature`.
    pub token_logprobs: Vec<Vec<f32>>,
    /// Per sample: mean (teacher − student) log-prob over the response (null without teacher log-probs).
    pub teacher_gap: Vec<Option<f64>>,
}

/// Computes [`LossCommandReport`] for `samples` under the pipeline's policy or `checkpoint`.
///
/// # Errors
/// Model loading errors; the errors of [`crate::trainer::loss_report`].
pub fn loss_command(cfg: &PipelineConfig, checkpoint: Option<&std::path::Path>, samples: &[Sample]) -> Result<LossCommandReport> {
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let opts = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable: Trainable::Frozen };
    let (lm, version, weights) = match checkpoint {
        Some(dir) => {
            let lm = LanguageModel::load_checkpoint(dir, Some(&cfg.policy.model), &opts)?;
            let version = crate::trainer::Manifest::read(dir).map(|m| m.version).unwrap_or(0);
            (lm, version, dir.display().to_string())
        }
        None => (LanguageModel::load(&cfg.policy.model, &opts)?, 0, cfg.policy.model.display().to_string()),
    };
    let report = crate::trainer::loss_report(&lm, None, cfg.method, &cfg.trainer, version, samples)?;
    let items: Vec<(Vec<u32>, Vec<u32>)> = samples
        .iter()
        .map(|s| (s.prompt_token_ids.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect()))
        .collect();
    let mut token_logprobs = vec![];
    for chunk in items.chunks(cfg.trainer.batch_size.max(1)) {
        token_logprobs.extend(lm.score_at_temperature(chunk, 0, &[], cfg.trainer.temperature)?.into_iter().map(|s| s.logprobs));
    }
    let teacher_gap = samples
        .iter()
        .zip(&token_logprobs)
        .map(|(s, lp)| {
            s.teacher_logprobs.as_ref().filter(|t| t.len() == lp.len() && !lp.is_empty()).map(|t| {
                t.iter().zip(lp).map(|(a, b)| (*a - *b) as f64).sum::<f64>() / lp.len() as f64
            })
        })
        .collect();
    Ok(LossCommandReport { weights, report, token_logprobs, teacher_gap })
}

/// A text table of a loss report, one line per sample plus the batch totals.
pub fn render_loss_report(r: &LossCommandReport) -> String {
    let mut s = format!(
        "weights: {}  method: {}  version: {}\n{:<34} {:<20} {:>6} {:>6} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10}\n",
        r.weights, r.report.method, r.report.version, "sample_id", "type", "tokens", "reward", "advantage", "pg_loss", "clip", "ppo_kl", "entropy", "t-s gap"
    );
    for (i, x) in r.report.samples.iter().enumerate() {
        let gap = r.teacher_gap.get(i).copied().flatten().map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "{:<34} {:<20} {:>6} {:>6.1} {:>10.4} {:>10.4} {:>8.3} {:>10.2e} {:>10.4} {:>10}\n",
            x.sample_id, x.sample_type, x.tokens, x.reward, x.advantage, x.pg_loss, x.clip_fraction, x.ppo_kl, x.entropy, gap
        ));
    }
    for (i, b) in r.report.batches.iter().enumerate() {
        s.push_str(&format!(
            "batch {i}: loss={:.5} pg_loss={:.5} clip_fraction={:.3} ppo_kl={:.2e} kl={:.4} entropy={:.4} topk_kl={:.4} tokens={}\n",
            b.loss, b.pg_loss, b.clip_fraction, b.ppo_kl, b.kl, b.entropy, b.topk_kl, b.tokens
        ));
    }
    for d in &r.report.dropped {
        s.push_str(&format!("dropped {}: {} ({})\n", d.sample_id, d.reason.as_str(), d.detail));
    }
    s
}
