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
//!
//! This module is what every stage shares (decoded inputs, the output, the consumer-group loop). Each
//! stage has its folder (`signals/`, `judge/`, `hint/`, `teacher/`, `train/`: its name, its task's
//! `build` and its catch-up); the registry of the stage runner ([`run::Stage`]) is the one place that
//! knows the chain of each method, each stage's input, outputs and consumer group, and starts it.

pub mod cache_store;
pub mod follow;
pub mod hint;
pub mod judge;
pub mod metrics_http;
pub mod pending;
pub mod reload;
pub mod run;
pub mod signals;
pub mod source;
pub mod teacher;
pub mod train;

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::bus::{Bus, BusProducer, Carry, Envelope, TOO_LARGE, TOO_LARGE_PAYLOAD_BYTES};
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

/// Counters of what a stage did, by outcome (every input is counted under one outcome), and the time
/// it spent on its batches.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StageCounts {
    /// Count per outcome name (`emitted`, `dead_letter`, `no_sample: score 0`, ...).
    pub outcomes: std::collections::BTreeMap<String, u64>,
    /// Wall seconds the stage spent handling its batches ([`StageLogic::handle`]: its model or HTTP
    /// calls and its emits; not its waits for input). Summed over batches; 0 for a task that is not a
    /// streaming stage.
    pub busy_seconds: f64,
}

impl StageCounts {
    /// Adds `n` to `outcome`.
    pub fn add(&mut self, outcome: &str, n: u64) {
        *self.outcomes.entry(outcome.to_string()).or_default() += n;
    }
    /// Sets `outcome` to `n` (a level, such as rows held in state, rather than a running total).
    pub fn set(&mut self, outcome: &str, n: u64) {
        self.outcomes.insert(outcome.to_string(), n);
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
    /// [`crate::bus::TOO_LARGE_PAYLOAD_BYTES`] of the row), so one huge turn never stops a stage.
    ///
    /// # Errors
    /// [`crate::Error::Kafka`] when delivery fails.
    pub async fn emit<T: Table>(&self, row: &T, carry: Option<&Carry>) -> Result<()> {
        match self.producer.send(row, carry).await {
            Ok(_) => {
                crate::metrics::record_out(self.stage, T::NAME);
                Ok(())
            }
            Err(e @ crate::Error::RecordTooLarge { .. }) if T::NAME != DeadLetter::NAME => {
                tracing::warn!(stage = self.stage, table = T::NAME, key = row.key(), error = %e, "record too large for the bus: dead-lettered");
                let json = serde_json::to_vec(row)?;
                let head = &json[..json.len().min(TOO_LARGE_PAYLOAD_BYTES)];
                let d = DeadLetter::new(self.stage, TOO_LARGE, format!("{e} (payload: first {} bytes of the {} row)", head.len(), T::NAME), head, Lineage::default())
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

/// A boxed stage task, as a stage's `build` returns it (its counts when it ends).
pub type StageTask = std::pin::Pin<Box<dyn Future<Output = Result<StageCounts>> + Send>>;

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
    let mut input = InputLoop::with_max_poll_interval(bus, &run.group, &topic, run.max_poll_ms)?.for_stage(logic.name());
    let out = Output::new(bus.producer()?, logic.name());
    let mut counts = StageCounts::default();
    loop {
        if ctl.stop.requested() {
            break;
        }
        let msgs = input.next_batch(run.batch, input.poll_wait(ctl, Duration::from_millis(200), 0)).await?;
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
        let t0 = std::time::Instant::now();
        logic.handle(batch, &out, &mut counts).await?;
        counts.busy_seconds += t0.elapsed().as_secs_f64();
        let hold = logic.hold();
        for (p, o) in next.iter_mut() {
            if let Some(h) = hold.get(p) {
                *o = (*o).min(*h);
            }
        }
        if let Err(e) = input.commit(&next) {
            tracing::warn!(stage = logic.name(), error = %e, "commit failed; records will be re-read (outputs are keyed, sinks drop duplicates)");
        }
        if rebalanced {
            logic.on_rebalance(&input.assigned());
        }
    }
    tracing::info!(stage = logic.name(), counts = %counts.line(), "stage finished");
    ctl.done.set();
    Ok(counts)
}
