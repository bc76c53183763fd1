//! `nextstate export`: SQL-selected `samples` rows written as Parquet for another trainer — slime,
//! verl, TRL (KTO / SFT / GKD) or a Hugging Face dataset folder — so a team training a large policy on
//! its own distributed engine can use what the pipeline produced.
//!
//! Every format reads the rows of one query over the lake ([`crate::sql`]); all but `hf` need full
//! `samples` rows (`SELECT * FROM samples ...`). Text the samples table does not hold (the request
//! messages, the response text, the hint-enhanced teacher context) is looked up in the lake's
//! `interactions` and `hints` tables by the sample's `interaction_id` / `hint_id`; token ids are never
//! decoded (no tokenizer is needed). A row that lacks what a format needs is not written and is
//! counted with the reason ([`FileReport::skipped`]); nothing is dropped silently.

mod files;
mod hf;
mod slime;
mod texts;
mod trl;
mod verl;

use std::path::Path;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;

pub use files::FileReport;
use texts::Texts;

use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::schema::Sample;

/// The layout `nextstate export --to` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// `slime.parquet`: the fields of slime's `Sample` (`tokens`, `response_length`, `loss_mask`,
    /// `rollout_log_probs`, `reward`, `teacher_log_probs`, ...) plus our ids.
    Slime,
    /// `train.parquet`: verl's RL layout (`data_source`, `prompt` chat messages, `ability`,
    /// `reward_model {style, ground_truth}`, `extra_info`).
    Verl,
    /// `kto.parquet`, `sft.parquet`, `gkd.parquet` for TRL's KTO, SFT and GKD-style distillation.
    Trl,
    /// A Hugging Face dataset folder: `data/train-00000-of-00001.parquet` (the query's columns as
    /// they are) and a `README.md` dataset card that `datasets.load_dataset(DIR)` reads.
    Hf,
}

impl ExportFormat {
    /// Lower-case name as on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            ExportFormat::Slime => "slime",
            ExportFormat::Verl => "verl",
            ExportFormat::Trl => "trl",
            ExportFormat::Hf => "hf",
        }
    }
}

/// Options of [`export`] besides the query, format and folder.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// Fail ([`Error::InvalidInput`]) when the query selects no rows, before anything is written.
    /// Without it an empty selection writes files with the format's columns and no rows.
    pub require_rows: bool,
}

/// What [`export`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    /// The format written.
    pub format: ExportFormat,
    /// Rows the query selected.
    pub selected: usize,
    /// One entry per file written (data files; the `hf` card is not listed).
    pub files: Vec<FileReport>,
}

/// Runs `sql` over `lake` and writes its rows in `format` into the folder `out` (created; files of the
/// same names are replaced atomically). Returns per file the rows written and the rows skipped with
/// their reasons.
///
/// # Errors
/// [`Error::Sql`] when the query fails; [`Error::InvalidInput`] for anything but a read-only query
/// ([`crate::sql::read_only`]), when a format other than `hf` is given
/// a query that does not return full `samples` rows, or when `opts.require_rows` is set and the query
/// selects nothing; [`Error::Arrow`]/[`Error::Records`]/[`Error::Parquet`]/[`Error::Io`] on writing.
pub async fn export(lake: &Lake, sql: &str, format: ExportFormat, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    let ctx = crate::sql::session(lake).await?;
    let df = crate::sql::read_only_frame(&ctx, sql).await?;
    let schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
    let batches = df.collect().await?;
    let selected: usize = batches.iter().map(|b| b.num_rows()).sum();
    if opts.require_rows && selected == 0 {
        return Err(Error::InvalidInput(format!("--require-rows: the query selected no rows: {sql}")));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("create folder", out, e))?;
    let files = match format {
        ExportFormat::Hf => vec![hf::write(lake, sql, out, schema, &batches)?],
        ExportFormat::Slime => vec![slime::write(out, &samples_of(&batches)?)?],
        ExportFormat::Verl => {
            let samples = samples_of(&batches)?;
            let texts = Texts::lookup(lake, &samples, false).await?;
            vec![verl::write(out, &samples, &texts)?]
        }
        ExportFormat::Trl => {
            let samples = samples_of(&batches)?;
            let texts = Texts::lookup(lake, &samples, true).await?;
            trl::write(out, &samples, &texts)?
        }
    };
    Ok(ExportReport { format, selected, files })
}

/// The query's rows as samples.
fn samples_of(batches: &[RecordBatch]) -> Result<Vec<Sample>> {
    let mut out = vec![];
    for b in batches {
        let rows: Vec<Sample> = serde_arrow::from_record_batch(b)
            .map_err(|e| Error::InvalidInput(format!("this format needs full samples rows (SELECT * FROM samples ...): {e}")))?;
        out.extend(rows);
    }
    Ok(out)
}
