//! `nextstate compact`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nextstate::lake::Lake;

use super::common::outln;

/// `nextstate compact`'s arguments.
#[derive(Args)]
pub struct CompactArgs {
    /// Lake folder.
    #[arg(long, env = "NEXTSTATE_LAKE", default_value = "lake")]
    lake: PathBuf,
    /// Only this table (default: every table of the lake).
    #[arg(long)]
    table: Option<String>,
    /// Merge adjacent small files until a merged file holds about this many MiB.
    #[arg(long, default_value_t = 128)]
    target_mb: u64,
    /// Delete the merged-away files only once the merged file is this many seconds old (readers
    /// that listed them before may still be reading them).
    #[arg(long, default_value_t = 600)]
    retain_secs: u64,
}

pub fn run(args: CompactArgs) -> Result<()> {
    let CompactArgs { lake, table, target_mb, retain_secs } = args;
    let lake = Lake::open_existing(&lake)?;
    let mut tables = nextstate::schema::all_schemas();
    if let Some(t) = &table {
        tables.retain(|(name, _)| name == t);
        anyhow::ensure!(
            !tables.is_empty(),
            "--table {t}: not a lake table (tables: {})",
            nextstate::schema::all_schemas().iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        );
    }
    let opts = nextstate::lake::compact::CompactOptions { target_bytes: target_mb << 20, retain: std::time::Duration::from_secs(retain_secs) };
    for (t, s) in nextstate::lake::compact::compact(&lake, &tables, &opts)? {
        outln!(
            "compact {t}: files {} -> {} ({} merged into {}, {} rows), MB {:.1} -> {:.1}, covered files deleted={} kept={} (retain {retain_secs} s)",
            s.files_before,
            s.files_after,
            s.files_merged,
            s.merged,
            s.rows_merged,
            s.bytes_before as f64 / 1e6,
            s.bytes_after as f64 / 1e6,
            s.covered_deleted,
            s.covered_kept
        );
    }
    Ok(())
}
