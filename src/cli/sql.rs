//! `nextstate sql`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::config::PipelineConfig;
use nextstate::lake::Lake;
use nextstate::sql::OutputFormat;

use super::common::{out, outln};

/// `nextstate sql`'s arguments.
#[derive(Args)]
pub struct SqlArgs {
    /// Lake folder or object-storage URL (default: the pipeline's lake, else ./lake). It must exist.
    #[arg(long, env = "NEXTSTATE_LAKE")]
    lake: Option<PathBuf>,
    /// Pipeline file whose lake to query (when --lake is not given).
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Output format: table, csv (nested values as JSON text) or json (JSON Lines; NaN and
    /// infinities as the strings "NaN", "Infinity", "-Infinity").
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    format: OutputFormat,
    /// The query, e.g. "SELECT kind, count(*) FROM signals GROUP BY kind", or `-` to read it from
    /// standard input. Queries only: COPY, INSERT, CREATE, DROP and SET are refused.
    query: String,
}

pub async fn run(args: SqlArgs) -> Result<()> {
    let SqlArgs { lake, pipeline, format, query } = args;
    let lake = match (lake, &pipeline) {
        (Some(l), _) => l,
        (None, Some(p)) => PipelineConfig::load(p)?.lake,
        (None, None) => PathBuf::from("lake"),
    };
    let lake = Lake::open_existing(&lake)?;
    let query = if query == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the query from standard input")?
    } else {
        query
    };
    for (path, why) in nextstate::sql::stray_files(&lake)? {
        eprintln!("note: {}: {}", path.display(), why.explain());
    }
    let batches = nextstate::sql::query(&lake, &query).await?;
    out!("{}", nextstate::sql::render(&batches, format)?);
    if format == OutputFormat::Table {
        outln!();
    }
    Ok(())
}
