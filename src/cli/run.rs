//! `nextstate run`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;
use nextstate::stages::run::Stage;

use super::common::{DataArgs, MetricsArgs, load_pipeline, outln};

/// `nextstate run`'s arguments.
#[derive(Args)]
pub struct RunArgs {
    /// Pipeline file (pipelines/*.toml). Default: the built-in combined pipeline.
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Comma-separated subset of: serve, proxy, signals, judge, hint, teacher, train, sinks, reload
    /// (the reload follower: loads each checkpoint of the `checkpoints` topic into the servers of
    /// `[serve] reload_urls` / `url`). Default: all but reload; with --until-idle, all but serve,
    /// proxy (unbounded inputs) and reload.
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Exit once every input is processed (batch use and tests).
    #[arg(long)]
    until_idle: bool,
    /// Checkpoints folder of the trainer.
    #[arg(long, default_value = "checkpoints")]
    checkpoints: PathBuf,
    /// Trainer run id (default: the pipeline name).
    #[arg(long)]
    run_id: Option<String>,
    /// Resume the trainer from its newest checkpoint (and serve that checkpoint).
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    data: DataArgs,
}

pub async fn run(args: RunArgs) -> Result<()> {
    let RunArgs { pipeline, only, until_idle, checkpoints, run_id, resume, data, metrics } = args;
    let cfg = load_pipeline(&pipeline, &data)?;
    let stop = Stop::default();
    stop.on_signals();
    metrics.serve(&stop).await?;
    let only = only.or_else(|| {
        until_idle.then(|| Stage::ALL.iter().map(|s| s.name()).chain(["sinks"]).map(String::from).collect())
    });
    let opts = nextstate::stages::run::RunOptions { only, until_idle, checkpoints_dir: Some(checkpoints), run_id, resume };
    let report = nextstate::stages::run::run_pipeline(&cfg, &opts, stop).await.context("pipeline run failed")?;
    for (n, c) in &report.republished {
        eprintln!("republished from lake for {n}: {c}");
    }
    if report.sinks_added {
        eprintln!("note: the lake sinks ran too: without --brokers the topics live only in this process, so every row produced reaches the lake through them");
    }
    for (n, c) in &report.stages {
        outln!("stage {n}: {}", c.line());
    }
    for (t, s) in &report.sinks {
        outln!("sink {t}: {}", s.line());
    }
    if let Some(t) = &report.train {
        outln!(
            "train: steps={} samples_trained={} checkpoints={:?} dropped={:?} skipped_steps={} skipped_samples={:?}",
            t.steps,
            t.samples_trained,
            t.checkpoints.iter().map(|c| c.0).collect::<Vec<_>>(),
            t.dropped,
            t.skipped_steps,
            t.skipped_samples
        );
    }
    if let Some(p) = &report.proxy {
        outln!("proxy: {p:?}");
    }
    Ok(())
}
