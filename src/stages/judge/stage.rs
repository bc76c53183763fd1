//! Judge stage wiring: `signals` → PRM votes → `judgments` (docs/method.md §2). The votes of a batch run
//! concurrently (bounded by the judge's semaphore); the vote cache is persisted after each batch.

use std::sync::Arc;

use futures::future::join_all;

use crate::stages::cache_store::CacheStore;
use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::runtime::TaskCtl;
use crate::stages::{run_stage, Input, Output, StageCounts, StageLogic, StageRun, StageTask};
use crate::bus::Carry;
use crate::error::Result;
use crate::judge::{judge_turn, Judge, TurnContext};
use crate::lake::Lake;
use crate::schema::{DeadLetter, Signal};

/// The stage's name: its metrics label, its dead letters' `stage`, its consumer group's suffix and its
/// `--only` task name.
pub const NAME: &str = "judge";

/// The judge stage.
pub struct JudgeStage {
    judge: Arc<Judge>,
    pipeline: String,
    store: CacheStore,
}

impl JudgeStage {
    /// The judge this stage votes with (its start-up probe goes through it: the same client,
    /// semaphore and retry policy as the votes).
    pub fn judge(&self) -> &Judge {
        &self.judge
    }

    /// A judge stage for `pipeline`, loading the persisted vote cache from `lake`.
    ///
    /// # Errors
    /// Cache loading errors.
    pub fn new(judge: Judge, pipeline: &str, lake: &Lake) -> Result<JudgeStage> {
        let (store, n) = CacheStore::open(lake, judge.cache())?;
        tracing::info!(entries = n, "vote cache loaded");
        Ok(JudgeStage { judge: Arc::new(judge), pipeline: pipeline.to_string(), store })
    }
}

/// The judge stage's task for `cfg`: probes the judge endpoint once, then votes on the `signals` topic
/// read with `run`'s consumer group until `ctl` ends it (the registry, `crate::stages::run::Stage::build`,
/// calls this).
///
/// # Errors
/// [`crate::Error::Config`] for a bad `[judge]` table; vote-cache loading errors.
pub fn build(cfg: &PipelineConfig, bus: &Bus, lake: &Lake, run: StageRun, ctl: TaskCtl) -> Result<StageTask> {
    let stage = JudgeStage::new(Judge::new(cfg.judge.clone())?, &cfg.name, lake)?;
    let bus = bus.clone();
    Ok(Box::pin(async move {
        stage.judge().probe().await?;
        run_stage(&bus, &run, stage, &ctl).await
    }))
}

/// Builds the turn context from a carried interaction and a signal, or the dead letter explaining why
/// it cannot be built.
pub(crate) fn turn_of(stage: &str, input: &Input<impl serde::Serialize>, signal: Option<&Signal>) -> std::result::Result<TurnContext, DeadLetter> {
    let payload = || serde_json::to_vec(&input.row).unwrap_or_default();
    let (Some(i), Some(s)) = (input.carry.interaction.as_ref(), signal.or(input.carry.signal.as_ref())) else {
        return Err(DeadLetter::new(stage, "missing_context", "record carries no interaction/signal context", &payload(), input.lineage.clone()));
    };
    TurnContext::from_rows(i, s).map_err(|e| {
        DeadLetter::new(stage, "bad_turn", format!("cannot build the turn: {e}"), &payload(), input.lineage.clone())
            .with_keys(&i.session_id, Some(&i.interaction_id))
    })
}

impl StageLogic for JudgeStage {
    type In = Signal;
    fn name(&self) -> &'static str {
        NAME
    }
    async fn handle(&mut self, batch: Vec<Input<Signal>>, out: &Output, counts: &mut StageCounts) -> Result<()> {
        let mut jobs = vec![];
        for input in batch {
            if input.row.excluded_reason.is_some() {
                counts.add("skipped: excluded turn (no next state)", 1);
                continue;
            }
            match turn_of(NAME, &input, Some(&input.row)) {
                Ok(turn) => jobs.push((input, turn)),
                Err(d) => {
                    counts.add(&format!("dead_letter: {}", d.reason_code), 1);
                    out.dead(d).await?;
                }
            }
        }
        let judge = self.judge.clone();
        let pipeline = self.pipeline.clone();
        let results = join_all(jobs.iter().map(|(_, t)| judge_turn(&judge, &pipeline, t))).await;
        for ((input, _), j) in jobs.into_iter().zip(results) {
            counts.add(&format!("judged: score {}", j.score), 1);
            counts.add("votes", j.votes.len() as u64);
            counts.add("votes_invalid", (j.votes.len() as i32 - j.valid_votes) as u64);
            counts.add("votes_cached", j.cache_hits as u64);
            let carry = Carry { interaction: input.carry.interaction, signal: Some(input.row), judgment: Some(j.clone()), hint: None };
            out.emit(&j, Some(&carry)).await?;
        }
        self.store.flush(self.judge.cache())?;
        Ok(())
    }
}
