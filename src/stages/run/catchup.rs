//! The embedded default's catch-up: the mock cluster is new with every command, so before the tasks
//! read anything each selected stage's pending input (and the trainer's untrained samples) is
//! re-published from the lake ([`crate::stages::pending`]).

use std::path::Path;

use crate::bus::BusProducer;
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::lake::Lake;
use crate::stages::pending::{publish_for_hint, publish_for_judge, publish_for_signals, publish_for_teacher};
use crate::stages::train::republish_untrained;

/// Re-publishes the pending input of task `stage` (a stage of the chain, or `train` with its run folder
/// `run_dir`); returns the rows published (0 for a task without lake input).
///
/// # Errors
/// Lake and Kafka errors.
pub(super) async fn republish(lake: &Lake, producer: &BusProducer, cfg: &PipelineConfig, stage: &str, run_dir: &Path) -> Result<u64> {
    match stage {
        "signals" => publish_for_signals(lake, producer).await,
        "judge" => publish_for_judge(lake, producer, &cfg.name).await,
        "hint" => publish_for_hint(lake, producer, &cfg.name, cfg.method.uses_judge()).await,
        "teacher" => publish_for_teacher(lake, producer, &cfg.name, cfg.method.uses_hints()).await,
        "train" => republish_untrained(lake, producer, cfg, run_dir).await,
        _ => Ok(0),
    }
}
