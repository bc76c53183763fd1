//! `nextstate schema`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::common::outln;

/// `nextstate schema`'s arguments.
#[derive(Args)]
pub struct SchemaArgs {
    /// Write one file per table into this folder instead of printing.
    #[arg(long)]
    write: Option<PathBuf>,
}

pub fn run(args: SchemaArgs) -> Result<()> {
    let SchemaArgs { write } = args;
    for (name, s) in nextstate::schema::all_schemas() {
        let json = serde_json::to_string_pretty(&nextstate::schema::schema_json(&s))?;
        match &write {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                std::fs::write(dir.join(format!("{name}.json")), json + "\n")?;
            }
            None => outln!("{json}"),
        }
    }
    Ok(())
}
