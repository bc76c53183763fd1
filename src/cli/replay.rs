//! `nextstate replay`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;

use super::common::{DataArgs, load_pipeline, outln};

/// `nextstate replay`'s arguments.
#[derive(Args)]
pub struct ReplayArgs {
    /// Query over the source lake (--lake) returning full rows, e.g.
    /// "SELECT * FROM interactions WHERE session_id LIKE 'student-%'".
    #[arg(long)]
    sql: String,
    /// Table of the rows, and the topic they are published to.
    #[arg(long, default_value = "interactions")]
    to_topic: String,
    /// Pipeline file (bus settings; the stages run with --lake-out). Default: built-in.
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Write the rows into this fresh lake and run the pipeline's stages there until idle.
    #[arg(long)]
    lake_out: Option<PathBuf>,
    /// With --lake-out: the stages to run (default: the method's chain for interactions, none for
    /// other tables).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    #[command(flatten)]
    data: DataArgs,
}

pub async fn run(args: ReplayArgs) -> Result<()> {
    let ReplayArgs { sql, to_topic, pipeline, lake_out, only, data } = args;
    let cfg = load_pipeline(&pipeline, &data)?;
    let stop = Stop::default();
    stop.on_signals();
    let target = match lake_out {
        Some(dir) => nextstate::ablate::ReplayTarget::Lake { dir, pipeline: cfg.clone(), stages: only },
        None => nextstate::ablate::ReplayTarget::Bus { pipeline: cfg.clone() },
    };
    let opts = nextstate::ablate::ReplayOptions { source_lake: cfg.lake.clone(), sql, table: to_topic, target };
    let r = nextstate::ablate::replay(&opts, stop).await.context("replay failed")?;
    outln!(
        "replay: table={} rows={} published={} written={} vote_cache_files={} teacher_cache_rows={} votes_cached={} teacher_cache_hits={}",
        r.table, r.rows, r.published, r.written, r.vote_cache_files, r.teacher_cache_rows, r.votes_cached(), r.teacher_cache_hits()
    );
    if let Some(run) = &r.run {
        for (n, c) in &run.stages {
            outln!("stage {n}: {}", c.line());
        }
    }
    Ok(())
}
