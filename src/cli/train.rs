//! `nextstate train`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;

use super::common::{DataArgs, MetricsArgs, load_pipeline, outln};

/// `nextstate train`'s arguments.
#[derive(Args)]
pub struct TrainArgs {
    /// Pipeline file (method, [trainer], [policy]).
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Read samples with this query instead of the topic, e.g.
    /// "SELECT * FROM samples WHERE pipeline = 'combined' ORDER BY event_time".
    #[arg(long, conflicts_with = "from_topic")]
    sql: Option<String>,
    /// Read samples from the `samples` topic (the default).
    #[arg(long)]
    from_topic: bool,
    /// Continue from the newest complete checkpoint of the run.
    #[arg(long)]
    resume: bool,
    /// Run id (checkpoint folder name; default: the pipeline name).
    #[arg(long)]
    run_id: Option<String>,
    /// Checkpoints folder.
    #[arg(long, default_value = "checkpoints")]
    checkpoints: PathBuf,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    max_steps: Option<i64>,
    /// Exit once the topic is drained (topic source).
    #[arg(long)]
    until_idle: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    /// Append one JSON object per optimizer step (the `train_steps` row) to FILE, flushed per line
    /// (`tail -f FILE` follows the run).
    #[arg(long, value_name = "FILE")]
    metrics_jsonl: Option<PathBuf>,
    #[command(flatten)]
    data: DataArgs,
}

pub async fn run(args: TrainArgs) -> Result<()> {
    let TrainArgs { pipeline, sql, from_topic: _, resume, run_id, checkpoints, max_steps, until_idle, data, metrics, metrics_jsonl } = args;
    let cfg = load_pipeline(&pipeline, &data)?;
    let stop = Stop::default();
    stop.on_signals();
    metrics.serve(&stop).await?;
    let source = match sql {
        Some(q) => nextstate::stages::train::TrainSource::Sql(q),
        None => nextstate::stages::train::TrainSource::Topic,
    };
    let opts = nextstate::stages::train::TrainOptions { source, resume, run_id, checkpoints_dir: checkpoints, max_steps, metrics_jsonl, metrics_jsonl_extra: vec![] };
    let r = nextstate::stages::train::train_command(&cfg, &opts, until_idle, stop).await.context("training failed")?;
    outln!(
        "train: steps={} samples_trained={} skipped_already_trained={} skipped_duplicates={} skipped_other_pipeline={} dropped={:?} skipped_steps={} skipped_samples={:?} resumed_from={:?} last_loss={:?}",
        r.steps, r.samples_trained, r.skipped_already_trained, r.skipped_duplicates, r.skipped_other_pipeline, r.dropped, r.skipped_steps, r.skipped_samples, r.resumed_from, r.last_loss
    );
    if !r.refused.is_empty() {
        outln!("refused (dead-lettered): {:?}", r.refused);
    }
    if cfg.trainer.tenants.per_tenant() {
        for (t, a) in &r.tenants {
            outln!("tenant {t}: steps={} samples_trained={} version={:?} resumed_from={:?} waiting={}", a.steps, a.samples_trained, a.version, r.resumed.get(t), r.waiting.get(t).copied().unwrap_or(0));
        }
    }
    if !r.handed_over.is_empty() || r.skipped_not_assigned > 0 {
        outln!("handed over at rebalances (read again by the partitions' owners): {:?} skipped_not_assigned={}", r.handed_over, r.skipped_not_assigned);
    }
    for (t, n) in r.waiting.iter().filter(|(t, _)| !r.tenants.contains_key(*t)) {
        outln!("tenant {t}: waiting={n} (below [trainer.tenants] min_batch; not trained)");
    }
    for (v, p) in &r.checkpoints {
        outln!("checkpoint v{v}: {p}");
    }
    Ok(())
}
