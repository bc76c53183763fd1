//! The stage chain of a pipeline: which stages a method runs and in what order, the input topic and
//! consumer group of each, and the task that runs one stage ([`build`]) — the stage runner's view of
//! the stages, so the stages themselves never name the runner.

use std::future::Future;

use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::lake::Lake;
use crate::method::Method;
use crate::runtime::TaskCtl;
use crate::stages::{hint, judge, run_stage, signals, teacher, StageCounts, StageRun, SLOW_STAGE_MAX_POLL_INTERVAL_MS};

/// The stages of `method`, in chain order.
pub fn chain(method: Method) -> Vec<&'static str> {
    match method {
        Method::Binary => vec!["signals", "judge", "teacher"],
        Method::Opd => vec!["signals", "hint", "teacher"],
        Method::Combined => vec!["signals", "judge", "hint", "teacher"],
    }
}

/// A boxed stage task.
pub type StageTask = std::pin::Pin<Box<dyn Future<Output = Result<StageCounts>> + Send>>;

/// The consumer group of stage `name` of pipeline `cfg`.
pub fn stage_group(bus: &Bus, cfg: &PipelineConfig, name: &str) -> String {
    bus.group(&format!("nextstate.{}.{}", cfg.name, name))
}

/// The input table of stage `name` for `cfg`'s method.
pub fn stage_input(cfg: &PipelineConfig, name: &str) -> &'static str {
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
pub fn build(name: &str, cfg: &PipelineConfig, bus: &Bus, lake: &Lake, ctl: TaskCtl) -> Result<StageTask> {
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
            Ok(Box::pin(async move {
                stage.judge().probe().await?;
                run_stage(&bus, &run, stage, &ctl).await
            }))
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
                Ok(Box::pin(async move {
                    stage.hinter().probe().await?;
                    run_stage(&bus, &run, stage, &ctl).await
                }))
            } else {
                let stage = hint::HintStage::<Signal>::new(hinter, &cfg.name, lake, render)?;
                Ok(Box::pin(async move {
                    stage.hinter().probe().await?;
                    run_stage(&bus, &run, stage, &ctl).await
                }))
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
                let probe = models.clone();
                let stage = teacher::TeacherStage::<crate::schema::HintRecord>::new(cfg, models).with_cache(cache);
                Ok(Box::pin(async move {
                    probe.probe().await?;
                    run_stage(&bus, &run, stage, &ctl).await
                }))
            }
        }
        other => Err(crate::Error::Config(format!("unknown stage '{other}'"))),
    }
}
