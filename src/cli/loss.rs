//! `nextstate loss`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nextstate::lake::Lake;

use super::common::{DataArgs, load_pipeline, out, outln};

/// `nextstate loss`'s arguments.
#[derive(Args)]
pub struct LossArgs {
    /// Pipeline file ([trainer], [policy]).
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Query returning full samples rows.
    #[arg(long)]
    sql: String,
    /// Method whose advantage to use (default: the pipeline's).
    #[arg(long, value_enum)]
    method: Option<nextstate::method::Method>,
    /// Weights to evaluate: a checkpoint folder (default: the pipeline's policy model).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    data: DataArgs,
}

pub async fn run(args: LossArgs) -> Result<()> {
    let LossArgs { pipeline, sql, method, checkpoint, json, data } = args;
    let mut cfg = load_pipeline(&pipeline, &data)?;
    if let Some(m) = method {
        cfg.method = m;
    }
    let lake = Lake::open(&cfg.lake)?;
    let samples = nextstate::stages::train::query_samples(&lake, &sql).await?;
    let report = nextstate::stages::train::loss_command(&cfg, checkpoint.as_deref(), &samples)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", nextstate::stages::train::render_loss_report(&report));
    }
    Ok(())
}
