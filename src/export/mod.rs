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

mod hf;
mod slime;
mod trl;
mod verl;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{FieldRef, SchemaRef};
use parquet::arrow::ArrowWriter;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_arrow::schema::{SchemaLike, TracingOptions};

use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::schema::{Message, Sample};

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

/// A chat message as trainers take it: `{role, content}` (tool calls and reasoning of the lake's
/// messages are not carried).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    fn from_json_messages(json: &str) -> Option<Vec<ChatMessage>> {
        let msgs: Vec<Message> = serde_json::from_str(json).ok()?;
        Some(msgs.into_iter().map(|m| ChatMessage { role: m.role, content: m.content }).collect())
    }
}

/// The turn's text from `interactions`.
#[derive(Debug, Clone, Deserialize)]
struct TurnText {
    interaction_id: String,
    request_messages: String,
    response_text: String,
}

/// The hint's text from `hints`.
#[derive(Debug, Clone, Deserialize)]
struct HintText {
    hint_id: String,
    chosen_hint: Option<String>,
    teacher_messages: Option<String>,
}

/// Text of the selected samples' turns and hints, by id.
#[derive(Debug, Default)]
pub(crate) struct Texts {
    turns: HashMap<String, TurnText>,
    hints: HashMap<String, HintText>,
}

/// Why a row needing text is not written.
pub(crate) enum Missing {
    /// No `interactions` row with the sample's interaction_id in the lake.
    NoInteraction,
    /// Its `request_messages` are not a JSON array of messages.
    BadRequestMessages,
}

impl Missing {
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Missing::NoInteraction => "no_interaction_row",
            Missing::BadRequestMessages => "bad_request_messages",
        }
    }
}

impl Texts {
    /// Looks up the interactions (and with `hints` the hint rows) of `samples` in the lake.
    async fn lookup(lake: &Lake, samples: &[Sample], hints: bool) -> Result<Texts> {
        let ids: Vec<&str> = samples.iter().map(|s| s.interaction_id.as_str()).collect();
        let mut texts = Texts::default();
        for t in select_by_key::<TurnText>(lake, "interactions", "interaction_id", "interaction_id, request_messages, response_text", &ids).await? {
            texts.turns.entry(t.interaction_id.clone()).or_insert(t);
        }
        if hints {
            let ids: Vec<&str> = samples.iter().filter_map(|s| s.hint_id.as_deref()).collect();
            for h in select_by_key::<HintText>(lake, "hints", "hint_id", "hint_id, chosen_hint, teacher_messages", &ids).await? {
                texts.hints.entry(h.hint_id.clone()).or_insert(h);
            }
        }
        Ok(texts)
    }

    /// The request messages and response text of a sample's turn.
    pub(crate) fn turn(&self, s: &Sample) -> std::result::Result<(Vec<ChatMessage>, &str), Missing> {
        let t = self.turns.get(&s.interaction_id).ok_or(Missing::NoInteraction)?;
        let msgs = ChatMessage::from_json_messages(&t.request_messages).ok_or(Missing::BadRequestMessages)?;
        Ok((msgs, t.response_text.as_str()))
    }

    /// The hint row of a sample: (chosen hint, teacher context messages JSON).
    pub(crate) fn hint(&self, s: &Sample) -> Option<(Option<&str>, Option<&str>)> {
        let h = self.hints.get(s.hint_id.as_deref()?)?;
        Some((h.chosen_hint.as_deref(), h.teacher_messages.as_deref()))
    }
}

/// Rows of `table` whose `key` is one of `ids` (1,000 per query).
async fn select_by_key<T: DeserializeOwned>(lake: &Lake, table: &str, key: &str, columns: &str, ids: &[&str]) -> Result<Vec<T>> {
    let mut uniq: Vec<&str> = ids.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let mut out = vec![];
    for chunk in uniq.chunks(1000) {
        let list: Vec<String> = chunk.iter().map(|id| format!("'{}'", id.replace('\'', "''"))).collect();
        let q = format!("SELECT {columns} FROM {table} WHERE {key} IN ({})", list.join(", "));
        for b in crate::sql::query(lake, &q).await? {
            out.extend(serde_arrow::from_record_batch::<Vec<T>>(&b)?);
        }
    }
    Ok(out)
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
