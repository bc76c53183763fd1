//! `--to hf`: a Hugging Face dataset folder that `datasets.load_dataset(DIR)` reads:
//! `data/train-00000-of-00001.parquet` (the query's rows with its columns and Arrow types as they are)
//! and `README.md`, a dataset card whose YAML header names the data files (`configs:` /
//! `data_files:`), and whose body gives the lineage: source pipelines, the SQL, the lake, row counts,
//! time of export and nextstate version.

use std::collections::BTreeMap;
use std::path::Path;

use arrow::array::{Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, SchemaRef};

use super::files::{write_parquet, FileReport};
use crate::error::{Error, Result};
use crate::lake::Lake;

/// The data file, relative to the folder.
pub(super) const DATA_FILE: &str = "data/train-00000-of-00001.parquet";

/// Writes the data file and the card.
pub(super) fn write(lake: &Lake, sql: &str, out: &Path, schema: SchemaRef, batches: &[RecordBatch]) -> Result<FileReport> {
    let path = out.join(DATA_FILE);
    let dir = out.join("data");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create folder", &dir, e))?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    write_parquet(&path, schema.clone(), batches)?;
    let card = card(lake, sql, &schema, batches, rows)?;
    crate::lake::write_atomic(&out.join("README.md"), card.as_bytes())?;
    Ok(FileReport { path, rows, skipped: BTreeMap::new() })
}

/// Counts of the values of a column (as text), when the query returned it.
fn value_counts(batches: &[RecordBatch], column: &str) -> Result<Option<BTreeMap<String, usize>>> {
    let mut counts = BTreeMap::new();
    for b in batches {
        let Some(col) = b.column_by_name(column) else { return Ok(None) };
        let col = arrow::compute::cast(col, &DataType::Utf8)?;
        let Some(s) = col.as_any().downcast_ref::<StringArray>() else { return Ok(None) };
        for i in 0..s.len() {
            let v = if s.is_null(i) { "(null)".to_string() } else { s.value(i).to_string() };
            *counts.entry(v).or_default() += 1;
        }
    }
    Ok(Some(counts))
}

fn counts_line(c: &BTreeMap<String, usize>) -> String {
    c.iter().map(|(k, v)| format!("`{k}` ({v})")).collect::<Vec<_>>().join(", ")
}

/// The lake's name for a card that leaves this machine: the folder's own name (never its absolute path,
/// which names the machine's directories and user), or its object-storage URL (`s3://bucket/prefix`).
fn lake_name(lake: &Lake) -> String {
    if lake.remote().is_some() {
        return lake.root().to_string_lossy().into_owned();
    }
    let path = std::fs::canonicalize(lake.root()).unwrap_or_else(|_| lake.root().to_path_buf());
    path.file_name().map_or_else(|| "lake".to_string(), |n| n.to_string_lossy().into_owned())
}

fn card(lake: &Lake, sql: &str, schema: &SchemaRef, batches: &[RecordBatch], rows: usize) -> Result<String> {
    let lake_name = lake_name(lake);
    let pipelines = value_counts(batches, "pipeline")?;
    let types = value_counts(batches, "sample_type")?;
    let when = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let mut s = String::new();
    s.push_str("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n");
    s.push_str("tags:\n- nextstate\n- reinforcement-learning\n---\n\n");
    s.push_str("# nextstate export\n\n");
    s.push_str("Rows selected from a [nextstate](https://arxiv.org/abs/2603.10165) lake with `nextstate export --to hf`.\n\n");
    s.push_str("## Lineage\n\n");
    match &pipelines {
        Some(p) if !p.is_empty() => s.push_str(&format!("- source pipeline(s): {}\n", counts_line(p))),
        _ => s.push_str("- source pipeline(s): not in the selected columns\n"),
    }
    if let Some(t) = types.filter(|t| !t.is_empty()) {
        s.push_str(&format!("- rows by sample type: {}\n", counts_line(&t)));
    }
    s.push_str(&format!("- lake: `{lake_name}`\n"));
    s.push_str(&format!("- rows: {rows} (split `train`, file `{DATA_FILE}`)\n"));
    s.push_str(&format!("- exported: {when}\n"));
    s.push_str(&format!("- nextstate version: {}\n\n", env!("CARGO_PKG_VERSION")));
    s.push_str("Query:\n\n```sql\n");
    s.push_str(sql.trim());
    s.push_str("\n```\n\n## Columns\n\n| column | Arrow type |\n|---|---|\n");
    for f in schema.fields() {
        s.push_str(&format!("| `{}` | `{}` |\n", f.name(), f.data_type()));
    }
    s.push_str("\nThe columns of the `samples` table are documented field by field in nextstate's `schemas/samples.json`.\n");
    Ok(s)
}
