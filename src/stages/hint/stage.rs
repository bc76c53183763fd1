//! Hint stage wiring: `judgments` (combined) or `signals` (OPD) → hint votes → `hints` (docs/method.md §3),
//! with the teacher context rendered by the policy's chat template.

use std::sync::Arc;

use futures::future::join_all;

use crate::stages::cache_store::CacheStore;
use crate::stages::judge::turn_of;
use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::runtime::TaskCtl;
use crate::stages::{run_stage, Input, Output, StageCounts, StageLogic, StageRun, StageTask};
use crate::bus::Carry;
use crate::error::Result;
use crate::hint::{hint_turn, Hinter};
use crate::lake::Lake;
use crate::schema::{Judgment, Message, Signal, Table};

/// The stage's name: its metrics label, its dead letters' `stage`, its consumer group's suffix and its
/// `--only` task name.
pub const NAME: &str = "hint";

/// Renders teacher messages to prompt text with the policy's chat template (generation prompt on).
pub type TemplateRenderer = Arc<dyn Fn(&[Message]) -> Result<String> + Send + Sync>;

/// The hint stage over input rows of table `I`.
pub struct HintStage<I> {
    hinter: Arc<Hinter>,
    pipeline: String,
    store: CacheStore,
    render: Option<TemplateRenderer>,
    _in: std::marker::PhantomData<fn() -> I>,
}

impl<I> HintStage<I> {
    /// The hint judge this stage votes with (its start-up probe goes through it).
    pub fn hinter(&self) -> &Hinter {
        &self.hinter
    }

    /// A hint stage for `pipeline`; `render` renders the teacher context (None: left null).
    ///
    /// # Errors
    /// Cache loading errors.
    pub fn new(hinter: Hinter, pipeline: &str, lake: &Lake, render: Option<TemplateRenderer>) -> Result<HintStage<I>> {
        let (store, n) = CacheStore::open(lake, hinter.cache())?;
        tracing::info!(entries = n, "vote cache loaded (hint)");
        Ok(HintStage { hinter: Arc::new(hinter), pipeline: pipeline.to_string(), store, render, _in: std::marker::PhantomData })
    }
}

/// The hint stage's task for `cfg`, reading `input` (`judgments` after a judge, `signals` without one)
/// with `run`'s consumer group until `ctl` ends it; it probes the hint endpoint once first. The teacher
/// context is rendered with the policy's chat template when `[policy] model` has one (else it stays
/// null). The registry, `crate::stages::run::Stage::build`, calls this.
///
/// # Errors
/// [`crate::Error::Config`] for a bad `[hint]` table or an input table other than those two;
/// vote-cache loading errors.
pub fn build(cfg: &PipelineConfig, input: &str, bus: &Bus, lake: &Lake, run: StageRun, ctl: TaskCtl) -> Result<StageTask> {
    let hinter = Hinter::new(cfg.hint.clone())?;
    let render: Option<TemplateRenderer> = match crate::model::ChatTemplate::from_dir(&cfg.policy.model) {
        Ok(Some(t)) => Some(Arc::new(move |m: &[Message]| t.render(m, None, true, None))),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, model = %cfg.policy.model.display(), "no chat template: teacher_prompt_text stays null");
            None
        }
    };
    let bus = bus.clone();
    if input == Judgment::NAME {
        Ok(probed_task(HintStage::<Judgment>::new(hinter, &cfg.name, lake, render)?, bus, run, ctl))
    } else if input == Signal::NAME {
        Ok(probed_task(HintStage::<Signal>::new(hinter, &cfg.name, lake, render)?, bus, run, ctl))
    } else {
        Err(crate::Error::Config(format!("the hint stage reads `{}` or `{}`, not `{input}`", Judgment::NAME, Signal::NAME)))
    }
}

/// The task of `stage`: one probe of the hint endpoint, then the consumer-group loop.
fn probed_task<I: Table + serde::de::DeserializeOwned>(stage: HintStage<I>, bus: Bus, run: StageRun, ctl: TaskCtl) -> StageTask {
    Box::pin(async move {
        stage.hinter().probe().await?;
        run_stage(&bus, &run, stage, &ctl).await
    })
}

impl<I: Table> StageLogic for HintStage<I> {
    type In = I;
    fn name(&self) -> &'static str {
        NAME
    }
    async fn handle(&mut self, batch: Vec<Input<I>>, out: &Output, counts: &mut StageCounts) -> Result<()> {
        let mut jobs = vec![];
        for input in batch {
            let own = (&input.row as &dyn std::any::Any).downcast_ref::<crate::schema::Signal>();
            if own.or(input.carry.signal.as_ref()).is_some_and(|s| s.excluded_reason.is_some()) {
                counts.add("skipped: excluded turn (no next state)", 1);
                continue;
            }
            // Fed by the signals stage (OPD) the record *is* the signal; fed by the judge (combined) the
            // signal travels in the carry.
            let own_signal = (&input.row as &dyn std::any::Any).downcast_ref::<crate::schema::Signal>();
            match turn_of(NAME, &input, own_signal) {
                Ok(turn) => jobs.push((input, turn)),
                Err(d) => {
                    counts.add(&format!("dead_letter: {}", d.reason_code), 1);
                    out.dead(d).await?;
                }
            }
        }
        let hinter = self.hinter.clone();
        let pipeline = self.pipeline.clone();
        let results = join_all(jobs.iter().map(|(_, t)| hint_turn(&hinter, &pipeline, t))).await;
        for ((input, _), mut h) in jobs.into_iter().zip(results) {
            if let (Some(r), Some(tm)) = (&self.render, &h.teacher_messages) {
                let msgs: Vec<Message> = serde_json::from_str(tm)?;
                h.teacher_prompt_text = Some(r(&msgs)?);
            }
            counts.add(if h.chosen_hint.is_some() { "hint: accepted" } else { "hint: none" }, 1);
            counts.add("votes_cached", h.cache_hits as u64);
            let mut carry: Carry = input.carry;
            carry.hint = Some(h.clone());
            out.emit(&h, Some(&carry)).await?;
        }
        self.store.flush(self.hinter.cache())?;
        Ok(())
    }
}
