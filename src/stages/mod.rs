//! Stage wiring: feeds each stage's pure transform from Kafka and writes its output to Kafka (the lake
//! sinks then write Parquet).
//!
//! The chain per method (each stage forwards the upstream context in the envelope's `carry`):
//! ```text
//! binary:   interactions → signals → judge → teacher(samples)
//! opd:      interactions → signals → hint  → teacher(samples)
//! combined: interactions → signals → judge → hint → teacher(samples)
//! ```
//! A stage is at-least-once (it commits its input offsets after its outputs are acknowledged); the lake
//! sinks make each table exactly-once by key.
//!
//! **Embedded default** (no `--brokers`): the mock cluster lives only as long as the command, so at start
//! each stage's *pending* input is re-published from the lake: the input rows that have no output yet
//! (tracked per stage by the output table's `pipeline` + `interaction_id`, and by dead letters of the
//! stage). See [`pending`].

pub mod cache_store;
pub mod follow;
pub mod hint;
pub mod judge;
pub mod pending;
pub mod reload;
pub mod signals;
pub mod source;
pub mod teacher;
pub mod train;

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::bus::{Bus, BusProducer, Carry, Envelope};
use crate::error::Result;
use crate::runtime::{InputLoop, TaskCtl};
use crate::schema::{DeadLetter, Lineage, Table};

/// One decoded input record.
#[derive(Debug, Clone)]
pub struct Input<T> {
    /// The upstream row.
    pub row: T,
    /// Upstream context.
    pub carry: Carry,
    /// Where it was read (topic, partition, offset).
    pub lineage: Lineage,
}

/// Counters of what a stage did, by outcome (every input is counted under one outcome).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StageCounts {
    /// Count per outcome name (`emitted`, `dead_letter`, `no_sample: score 0`, ...).
    pub outcomes: std::collections::BTreeMap<String, u64>,
}

impl StageCounts {
    /// Adds `n` to `outcome`.
    pub fn add(&mut self, outcome: &str, n: u64) {
        *self.outcomes.entry(outcome.to_string()).or_default() += n;
    }
    /// The count of `outcome`.
    pub fn get(&self, outcome: &str) -> u64 {
        self.outcomes.get(outcome).copied().unwrap_or(0)
    }
    /// One line: `a=1 b=2`.
    pub fn line(&self) -> String {
        self.outcomes.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    }
}

/// Where a stage sends its results.
#[derive(Clone)]
pub struct Output {
    producer: BusProducer,
    stage: &'static str,
}

impl Output {
    /// An output for `stage` through `producer`.
    pub fn new(producer: BusProducer, stage: &'static str) -> Output {
        Output { producer, stage }
    }
    /// Sends a row of table `T` with its carry; waits for the broker's acknowledgement. A record the bus
    /// refuses for its size (with its carry, a turn's record is about twice the turn) becomes a dead
    /// letter of this stage instead (reason `record_too_large`, keyed by the row's key, with the first
    /// [`source::TOO_LARGE_PAYLOAD_BYTES`] of the row), so one huge turn never stops a stage.
    ///
    /// # Errors
    /// [`crate::Error::Kafka`] when delivery fails.
    pub async fn emit<T: Table>(&self, row: &T, carry: Option<&Carry>) -> Result<()> {
        match self.producer.send(row, carry).await {
            Ok(_) => Ok(()),
            Err(e @ crate::Error::RecordTooLarge { .. }) if T::NAME != DeadLetter::NAME => {
                tracing::warn!(stage = self.stage, table = T::NAME, key = row.key(), error = %e, "record too large for the bus: dead-lettered");
                let json = serde_json::to_vec(row)?;
                let head = &json[..json.len().min(source::TOO_LARGE_PAYLOAD_BYTES)];
                let d = DeadLetter::new(self.stage, source::TOO_LARGE, format!("{e} (payload: first {} bytes of the {} row)", head.len(), T::NAME), head, Lineage::default())
                    .with_keys(row.session_id(), Some(row.key()));
                self.producer.send(&d, None).await.map(|_| ())
            }
            Err(e) => Err(e),
        }
    }
    /// Sends a dead letter (stage name filled in when empty).
    ///
    /// # Errors
    /// [`crate::Error::Kafka`] when delivery fails.
    pub async fn dead(&self, mut d: DeadLetter) -> Result<()> {
        if d.stage.is_empty() {
            d.stage = self.stage.to_string();
        }
        self.producer.send(&d, None).await.map(|_| ())
    }
    /// The stage name.
    pub fn stage(&self) -> &'static str {
        self.stage
    }
}

/// The stage-specific part of a streaming stage.
pub trait StageLogic: Send + 'static {
    /// The input row type (its table names the input topic unless [`StageLogic::input_table`] says otherwise).
    type In: Table + DeserializeOwned;
    /// Stage name (`signals`, `judge`, `hint`, `teacher`).
    fn name(&self) -> &'static str;
    /// Input table/topic name.
    fn input_table(&self) -> &'static str {
        Self::In::NAME
    }
    /// Handles a batch, sending outputs and dead letters with `out`, counting every input in `counts`.
    fn handle(&mut self, batch: Vec<Input<Self::In>>, out: &Output, counts: &mut StageCounts) -> impl Future<Output = Result<()>> + Send;
    /// Per partition, the offset commits may not pass: the stage's state needs the records from it on
    /// to be rebuilt after a restart. Called after every batch (a stage may prune its bookkeeping).
    fn hold(&mut self) -> HashMap<i32, i64> {
        HashMap::new()
    }
    /// Called after a rebalance with the partitions now assigned: state of the others must go (who
    /// reads them next rebuilds it from the committed offsets).
    fn on_rebalance(&mut self, _assigned: &[i32]) {}
}

/// Stage run settings.
#[derive(Debug, Clone)]
pub struct StageRun {
    /// Consumer group.
    pub group: String,
    /// Max records per batch.
    pub batch: usize,
    /// Consumer `max.poll.interval.ms` the stage needs (0: the bus's setting): the longest a batch may
    /// take before the next poll ([`SLOW_STAGE_MAX_POLL_INTERVAL_MS`] for stages that wait on models).
    pub max_poll_ms: u32,
}

/// `max.poll.interval.ms` of the stages that wait on models and endpoints (judge, hint, teacher): one
/// batch can take many minutes (a remote teacher's 120 s timeout × 4 attempts per turn, CPU scoring of
/// long turns), and a member that exceeds the interval leaves its group and its commit fails (a static
/// member is fenced). A crashed stage is still detected by `session.timeout.ms`.
pub const SLOW_STAGE_MAX_POLL_INTERVAL_MS: u32 = 3_600_000;

/// Runs `logic` as a consumer-group task until stopped (or idle, per `ctl`). Returns its counts.
///
/// # Errors
/// Kafka errors and whatever `logic.handle` returns (a stage stops on an error it could not
/// dead-letter).
pub async fn run_stage<L: StageLogic>(bus: &Bus, run: &StageRun, mut logic: L, ctl: &TaskCtl) -> Result<StageCounts> {
    let topic = bus.topic(logic.input_table());
    let mut input = InputLoop::with_max_poll_interval(bus, &run.group, &topic, run.max_poll_ms)?;
    let out = Output::new(bus.producer()?, logic.name());
    let mut counts = StageCounts::default();
    loop {
        if ctl.stop.requested() {
            break;
        }
        let msgs = input.next_batch(run.batch, Duration::from_millis(200)).await?;
        // Records of a partition taken away may still be in `msgs`: the stage drops its state after
        // the batch. A partition kept and read again from its committed offset is rebuilt by the stage
        // itself when its offsets go back.
        let rebalanced = input.rebalanced();
        if msgs.is_empty() {
            if rebalanced {
                logic.on_rebalance(&input.assigned());
            }
            if input.idle_finished(ctl, 0).await? {
                break;
            }
            continue;
        }
        let mut next: HashMap<i32, i64> = HashMap::new();
        let mut batch = Vec::with_capacity(msgs.len());
        for m in &msgs {
            next.insert(m.partition, m.offset + 1);
            let lineage = Lineage {
                source_topic: Some(topic.clone()),
                source_partition: Some(m.partition),
                source_offset: Some(m.offset),
                ..Default::default()
            };
            match serde_json::from_slice::<Envelope<L::In>>(&m.payload) {
                Ok(env) => batch.push(Input { row: env.row, carry: env.carry.unwrap_or_default(), lineage }),
                Err(e) => {
                    counts.add("dead_letter: malformed record", 1);
                    let d = DeadLetter::new(logic.name(), "malformed_record", format!("not a valid {} record: {e}", logic.input_table()), &m.payload, lineage)
                        .with_keys(&m.key, None);
                    out.dead(d).await?;
                }
            }
        }
        logic.handle(batch, &out, &mut counts).await?;
        let hold = logic.hold();
        for (p, o) in next.iter_mut() {
            if let Some(h) = hold.get(p) {
                *o = (*o).min(*h);
            }
        }
        if let Err(e) = input.commit(&next) {
            tracing::warn!(stage = logic.name(), error = %e, "commit failed; records will be re-read (outputs are keyed, sinks drop duplicates)");
            input.check_fatal()?;
        }
        if rebalanced {
            logic.on_rebalance(&input.assigned());
        }
    }
    tracing::info!(stage = logic.name(), counts = %counts.line(), "stage finished");
    ctl.done.set();
    Ok(counts)
}

pub mod run;

/// A boxed stage task.
pub type StageTask = std::pin::Pin<Box<dyn Future<Output = Result<StageCounts>> + Send>>;

/// The consumer group of stage `name` of pipeline `cfg`.
pub fn stage_group(bus: &Bus, cfg: &crate::config::PipelineConfig, name: &str) -> String {
    bus.group(&format!("nextstate.{}.{}", cfg.name, name))
}

/// The input table of stage `name` for `cfg`'s method.
pub fn stage_input(cfg: &crate::config::PipelineConfig, name: &str) -> &'static str {
    use crate::config::Method;
    match (name, cfg.method) {
        ("signals", _) => "interactions",
        ("judge", _) => "signals",
        ("hint", Method::Combined) => "judgments",
        ("hint", _) => "signals",
        ("teacher", Method::Binary) => "judgments",
        ("teacher", _) => "hints",
        _ => "interactions",
    }
}

/// Builds the task of stage `name` for `cfg`.
///
/// # Errors
/// [`crate::Error::Config`] for an unknown stage or a bad stage configuration; model loading errors.
pub fn build(name: &str, cfg: &crate::config::PipelineConfig, bus: &Bus, lake: &crate::lake::Lake, ctl: TaskCtl) -> Result<StageTask> {
    use crate::config::Method;
    use crate::schema::{Judgment, Signal};
    let max_poll_ms = if name == "signals" { 0 } else { SLOW_STAGE_MAX_POLL_INTERVAL_MS };
    let run = StageRun { group: stage_group(bus, cfg, name), batch: cfg.stage_batch, max_poll_ms };
    let bus = bus.clone();
    match name {
        "signals" => {
            let stage = signals::SignalsStage::new(cfg.signals.clone());
            Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
        }
        "judge" => {
            let stage = judge::JudgeStage::new(crate::judge::Judge::new(cfg.judge.clone())?, &cfg.name, lake)?;
            Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
        }
        "hint" => {
            let hinter = crate::hint::Hinter::new(cfg.hint.clone())?;
            // The teacher context is rendered with the policy's own chat template (when the model is there).
            let render: Option<hint::TemplateRenderer> = match crate::model::ChatTemplate::from_dir(&cfg.policy.model) {
                Ok(Some(t)) => Some(std::sync::Arc::new(move |m: &[crate::schema::Message]| t.render(m, None, true, None))),
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(error = %e, model = %cfg.policy.model.display(), "no chat template: teacher_prompt_text stays null");
                    None
                }
            };
            if cfg.method == Method::Combined {
                let stage = hint::HintStage::<Judgment>::new(hinter, &cfg.name, lake, render)?;
                Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
            } else {
                let stage = hint::HintStage::<Signal>::new(hinter, &cfg.name, lake, render)?;
                Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
            }
        }
        "teacher" => {
            let models = teacher::TeacherModels::load(cfg)?;
            if cfg.method == Method::Binary {
                let stage = teacher::TeacherStage::<Judgment>::new(cfg, models);
                Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
            } else {
                let cache = teacher::TeacherCache::load(lake)?;
                tracing::info!(rows = cache.len(), "teacher cache loaded");
                let stage = teacher::TeacherStage::<crate::schema::HintRecord>::new(cfg, models).with_cache(cache);
                Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
            }
        }
        other => Err(crate::Error::Config(format!("unknown stage '{other}'"))),
    }
}
