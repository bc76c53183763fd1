//! `nextstate export`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nextstate::lake::Lake;

use super::common::outln;

/// `nextstate export`'s arguments.
#[derive(Args)]
pub struct ExportArgs {
    /// Lake folder.
    #[arg(long, env = "NEXTSTATE_LAKE", default_value = "lake")]
    lake: PathBuf,
    /// The rows, e.g. "SELECT * FROM samples WHERE pipeline = 'combined'" (`hf`: any query).
    #[arg(long)]
    sql: String,
    /// Layout to write.
    #[arg(long = "to", value_enum)]
    to: nextstate::export::ExportFormat,
    /// Output folder (created; files of the same names are replaced).
    #[arg(long)]
    out: PathBuf,
    /// Fail when the query selects no rows (default: write empty files).
    #[arg(long)]
    require_rows: bool,
}

pub async fn run(args: ExportArgs) -> Result<()> {
    let ExportArgs { lake, sql, to, out, require_rows } = args;
    let opts = nextstate::export::ExportOptions { require_rows };
    let r = nextstate::export::export(&Lake::open_existing(&lake)?, &sql, to, &out, &opts).await?;
    outln!("export {}: selected={}", to.as_str(), r.selected);
    for f in &r.files {
        outln!("export {}: {}", to.as_str(), f.summary());
    }
    Ok(())
}
