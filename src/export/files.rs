//! The files the formats write: rows as Parquet ([`write_rows`], [`write_parquet`]), the rows left
//! out and why ([`Skips`], [`token_columns_ok`]), and the [`FileReport`] of each file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use arrow::datatypes::{FieldRef, SchemaRef};
use parquet::arrow::ArrowWriter;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_arrow::schema::{SchemaLike, TracingOptions};

use crate::error::Result;
use crate::schema::Sample;

/// What one output file received.
#[derive(Debug, Clone, PartialEq)]
pub struct FileReport {
    /// The file written.
    pub path: PathBuf,
    /// Rows written.
    pub rows: usize,
    /// Selected rows not written to this file, by reason (e.g. `no_teacher_topk`).
    pub skipped: BTreeMap<String, usize>,
}

impl FileReport {
    /// One summary line: `<path>: rows=N skipped=M (reason=n ...)`.
    pub fn summary(&self) -> String {
        let n: usize = self.skipped.values().sum();
        let reasons: Vec<String> = self.skipped.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let why = if reasons.is_empty() { String::new() } else { format!(" ({})", reasons.join(" ")) };
        format!("{}: rows={} skipped={n}{why}", self.path.display(), self.rows)
    }
}

/// Counts of skipped rows by reason.
#[derive(Debug, Default)]
pub(crate) struct Skips(BTreeMap<String, usize>);

impl Skips {
    pub(crate) fn add(&mut self, reason: &str) {
        *self.0.entry(reason.to_string()).or_default() += 1;
    }
}

/// Whether a sample's per-token columns all have the response's length T (loss mask, rollout
/// log-probs, and teacher log-probs / top-K when present) and T > 0; else the skip reason.
pub(crate) fn token_columns_ok(s: &Sample) -> std::result::Result<(), &'static str> {
    let t = s.response_token_ids.len();
    if t == 0 {
        return Err("no_response_tokens");
    }
    let teacher_ok = s.teacher_logprobs.as_ref().is_none_or(|v| v.len() == t);
    let topk_ok = s.topk_ids.as_ref().is_none_or(|v| v.len() == t) && s.topk_logprobs.as_ref().is_none_or(|v| v.len() == t);
    if s.loss_mask.len() != t || s.rollout_logprobs.len() != t || !teacher_ok || !topk_ok {
        return Err("length_mismatch");
    }
    Ok(())
}

/// Writes `rows` (one Parquet row per element, columns traced from `T`'s serde fields) to
/// `out/<name>` and reports it.
pub(crate) fn write_rows<T: Serialize + DeserializeOwned>(out: &Path, name: &str, rows: &[T], skips: Skips) -> Result<FileReport> {
    let tracing = TracingOptions::default().strings_as_large_utf8(false).sequence_as_large_list(false);
    let fields = Vec::<FieldRef>::from_type::<T>(tracing)?;
    let batch = serde_arrow::to_record_batch(&fields, &rows)?;
    let path = out.join(name);
    write_parquet(&path, batch.schema(), std::slice::from_ref(&batch))?;
    Ok(FileReport { path, rows: rows.len(), skipped: skips.0 })
}

/// Writes batches as one Parquet file with the lake's writer settings ([`crate::lake::writer_properties`]), atomically.
pub(crate) fn write_parquet(path: &Path, schema: SchemaRef, batches: &[RecordBatch]) -> Result<()> {
    let props = crate::lake::writer_properties(&schema)?;
    let mut buf = vec![];
    {
        let mut w = ArrowWriter::try_new(&mut buf, schema, Some(props))?;
        for b in batches {
            w.write(b)?;
        }
        w.close()?;
    }
    crate::lake::write_atomic(path, &buf)
}
