//! SQL over the lake: every table is registered in DataFusion (Hive `date` partition column included)
//! with its declared schema, so a table with no files yet is queryable (and empty). Any other folder of
//! the lake root holding Parquet files directly (e.g. an ablation's `results/<table>/`) is registered
//! too, under the folder's name, with the schema of its files. Files are listed through
//! [`LiveFiles`]: a file that `nextstate compact` merged into a larger one is not read.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::array::{Array, ArrayRef, AsArray, StringBuilder};
use arrow::datatypes::{Float32Type, Float64Type};
use arrow::json::writer::{make_encoder, Encoder, EncoderFactory, EncoderOptions, LineDelimited, NullableEncoder, WriterBuilder};
use datafusion::config::ConfigOptions;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::MemTable;
use datafusion::execution::context::SQLOptions;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

use crate::error::{Error, Result};
use crate::lake::live::LiveFiles;
use crate::lake::Lake;
use crate::schema::all_schemas;

/// Output format of `nextstate sql`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum OutputFormat {
    /// An aligned text table.
    #[default]
    Table,
    /// CSV with a header row.
    Csv,
    /// One JSON object per row (JSON Lines).
    Json,
}

/// Bytes read from the end of a Parquet file to get its footer in one read
/// (`datafusion.execution.parquet.metadata_size_hint`): the lake's footers, with their page index, are
/// 8–14 KiB for the widest tables; DataFusion's default (512 KiB) read most of every small file a sink
/// writes just for its footer.
pub const METADATA_SIZE_HINT: usize = 32 << 10;

/// The session settings for the lake, before the environment's overrides (see [`session`]); measured on
/// the 1,000,000-turn lake of `benches/sql.rs` (docs/BENCHMARKS.md §3):
/// - `parquet.metadata_size_hint` = [`METADATA_SIZE_HINT`];
/// - `collect_statistics = false`: per-query file statistics read and summarise every file's footer at
///   planning time, which on a lake of many small files cost more than they saved (the join took 0.50 s
///   with them against 0.75 s without, the group-by 0.19 against 0.29); row-group statistics still prune
///   inside each file;
/// - `target_partitions` = twice the cores (at least 4): scans of many small files wait on reads, so
///   more partitions than cores overlap them.
pub fn lake_options() -> ConfigOptions {
    let mut o = ConfigOptions::new();
    o.execution.parquet.metadata_size_hint = Some(METADATA_SIZE_HINT);
    o.execution.collect_statistics = false;
    o.execution.target_partitions = (2 * std::thread::available_parallelism().map_or(1, |n| n.get())).max(4);
    o
}

/// [`lake_options`] with every setting that has a `DATAFUSION_*` environment variable taken from it
/// (DataFusion's own names: `datafusion.execution.target_partitions` is
/// `DATAFUSION_EXECUTION_TARGET_PARTITIONS`, as `SessionConfig::from_env` reads them).
///
/// # Errors
/// [`Error::Sql`] when a variable's value is not valid for its setting.
pub fn session_options() -> Result<ConfigOptions> {
    let mut o = lake_options();
    for entry in ConfigOptions::new().entries() {
        if let Some(v) = std::env::var_os(entry.key.to_uppercase().replace('.', "_")) {
            o.set(&entry.key, &v.to_string_lossy())?;
        }
    }
    Ok(o)
}

/// A DataFusion session with every lake table registered, with [`session_options`].
///
/// # Errors
/// [`Error::Sql`] when a table cannot be registered or a `DATAFUSION_*` variable is not a valid setting.
pub async fn session(lake: &Lake) -> Result<SessionContext> {
    let ctx = SessionContext::new_with_config(SessionConfig::from(session_options()?).with_information_schema(true));
    // Local files are listed through the lake's live-file rule: files a compaction merged are not read.
    let local = Arc::new(LiveFiles::local());
    ctx.runtime_env().register_object_store(ObjectStoreUrl::local_filesystem().as_ref(), local);
    if let Some(r) = lake.remote() {
        ctx.runtime_env().register_object_store(&r.base, Arc::new(LiveFiles::new(r.store.clone())));
    }
    let known = all_schemas();
    for (name, schema) in &known {
        register(&ctx, lake, name, Arc::new(schema.as_ref().clone())).await?;
    }
    for name in lake.tables() {
        if known.iter().any(|(k, _)| *k == name) || lake.remote().is_some() || !has_direct_parquet(&lake.table_dir(&name)) {
            continue;
        }
        let path = format!("{}/", lake.table_dir(&name).display());
        ctx.register_parquet(&name, &path, ParquetReadOptions::default()).await?;
    }
    Ok(ctx)
}

/// Whether `dir` holds a (non-hidden) `.parquet` file directly.
fn has_direct_parquet(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).map(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.ends_with(".parquet") && !n.starts_with('.') && e.path().is_file()
        })
    })
    .unwrap_or(false)
}

async fn register(ctx: &SessionContext, lake: &Lake, name: &str, schema: Arc<Schema>) -> Result<()> {
    let has_files = !lake.files(name)?.is_empty();
    if has_files {
        let path = lake.table_url(name);
        let opts = ParquetReadOptions::default()
            .table_partition_cols(vec![("date".to_string(), DataType::Utf8)])
            .schema(&schema);
        ctx.register_parquet(name, &path, opts).await?;
    } else {
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields.push(Field::new("date", DataType::Utf8, false));
        let schema = Arc::new(Schema::new(fields));
        ctx.register_table(name, Arc::new(MemTable::try_new(schema, vec![vec![]])?))?;
    }
    Ok(())
}

/// Every Parquet file under the folders of the lake's own tables (those of [`all_schemas`]) that is not
/// one of the lake's files, with what happens to it ([`Lake::stray_files`]), for `nextstate sql` to say
/// so. (A folder of any other name with Parquet files directly in it is read as a table of its own.)
///
/// # Errors
/// [`Error::Io`] when a folder cannot be listed.
pub fn stray_files(lake: &Lake) -> Result<Vec<(std::path::PathBuf, crate::lake::StrayReason)>> {
    let mut out = vec![];
    for (name, _) in all_schemas() {
        out.extend(lake.stray_files(name)?);
    }
    Ok(out)
}

/// What every SQL entry point (`nextstate sql`, and the `--sql` of `export`, `train`, `replay`, `loss` and
/// the ablation's selections) runs: queries only. DDL (`CREATE [EXTERNAL] TABLE`, `DROP`, views), DML
/// (`INSERT`, `COPY ... TO`) and statements (`SET`, transactions) are refused before anything runs, so a
/// query can neither write a file anywhere the process can nor add rows to the lake, and cannot register
/// an outside file as a table (DataFusion's [`SQLOptions`]).
pub fn read_only() -> SQLOptions {
    SQLOptions::new().with_allow_ddl(false).with_allow_dml(false).with_allow_statements(false)
}

/// Plans `query` on `ctx` as a read-only query ([`read_only`]); nothing runs until the frame is
/// collected.
///
/// # Errors
/// [`Error::InvalidInput`] (a user error) naming the refused kind of statement, for anything but a query;
/// [`Error::Sql`] when the query does not parse or names a table/column that is not there.
pub async fn read_only_frame(ctx: &SessionContext, query: &str) -> Result<DataFrame> {
    let plan = ctx.state().create_logical_plan(query).await?;
    read_only().verify_plan(&plan).map_err(|e| {
        let why = e.find_root().to_string();
        let why = why.strip_prefix("Error during planning: ").unwrap_or(&why).to_string();
        Error::InvalidInput(format!(
            "only read-only queries run here (SELECT, WITH, VALUES, EXPLAIN, SHOW, DESCRIBE); nothing was run or written: {why}"
        ))
    })?;
    Ok(ctx.execute_logical_plan(plan).await?)
}

/// Runs `query` (read-only, [`read_only_frame`]) over the lake and returns the result batches; a result
/// without rows is one empty batch with the result's schema, so that its columns can still be printed.
///
/// # Errors
/// [`Error::InvalidInput`] for anything but a query; [`Error::Sql`] naming the unknown table/column or
/// the failure.
pub async fn query(lake: &Lake, query: &str) -> Result<Vec<RecordBatch>> {
    let ctx = session(lake).await?;
    let df = read_only_frame(&ctx, query).await?;
    let schema = Arc::new(df.schema().as_arrow().clone());
    let mut batches = df.collect().await?;
    if batches.is_empty() {
        batches.push(RecordBatch::new_empty(schema));
    }
    Ok(batches)
}

/// Renders batches in `format`:
/// - `table`: an aligned text table; a result without rows prints its header and `0 rows`;
/// - `csv`: a header row (also for a result without rows), then one line per row; a nested value (list,
///   struct, map) is written as its JSON text in one field;
/// - `json`: one JSON object per row; a NaN or infinite float is written as the string `"NaN"`,
///   `"Infinity"` or `"-Infinity"` (JSON has no such numbers), so it stays distinct from null.
///
/// # Errors
/// [`Error::Arrow`] when a value cannot be rendered.
pub fn render(batches: &[RecordBatch], format: OutputFormat) -> Result<String> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    match format {
        OutputFormat::Table => {
            let table = arrow::util::pretty::pretty_format_batches(batches)?.to_string();
            Ok(if rows == 0 { format!("{table}\n0 rows") } else { table })
        }
        OutputFormat::Csv => {
            let mut buf = vec![];
            {
                let mut w = arrow::csv::WriterBuilder::new().with_header(true).build(&mut buf);
                for b in batches {
                    w.write(&nested_as_json_text(b)?)?;
                }
            }
            String::from_utf8(buf).map_err(|e| Error::Internal(e.to_string()))
        }
        OutputFormat::Json => {
            let mut buf = vec![];
            {
                let mut w = WriterBuilder::new().with_encoder_factory(Arc::new(NonFiniteAsText)).build::<_, LineDelimited>(&mut buf);
                for b in batches {
                    w.write(b)?;
                }
                w.finish()?;
            }
            String::from_utf8(buf).map_err(|e| Error::Internal(e.to_string()))
        }
    }
}

/// `batch` with every nested column (list, struct, map) replaced by a UTF-8 column of each value's JSON
/// text (null stays null), for CSV, which has no nested values.
fn nested_as_json_text(batch: &RecordBatch) -> Result<RecordBatch> {
    if !batch.schema().fields().iter().any(|f| f.data_type().is_nested()) {
        return Ok(batch.clone());
    }
    let options = EncoderOptions::default().with_encoder_factory(Arc::new(NonFiniteAsText));
    let mut fields = vec![];
    let mut columns: Vec<ArrayRef> = vec![];
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if !field.data_type().is_nested() {
            fields.push(field.clone());
            columns.push(column.clone());
            continue;
        }
        let mut encoder = make_encoder(field, column.as_ref(), &options)?;
        let mut text = StringBuilder::new();
        let mut buf = vec![];
        for row in 0..column.len() {
            if encoder.is_null(row) {
                text.append_null();
            } else {
                buf.clear();
                encoder.encode(row, &mut buf);
                text.append_value(String::from_utf8_lossy(&buf));
            }
        }
        fields.push(Arc::new(Field::new(field.name(), DataType::Utf8, true)));
        columns.push(Arc::new(text.finish()));
    }
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?)
}

/// The JSON encoders' options without [`NonFiniteAsText`]: the default encoders, which it delegates
/// finite values to.
static PLAIN_JSON: std::sync::LazyLock<EncoderOptions> = std::sync::LazyLock::new(EncoderOptions::default);

/// Encodes `Float32`/`Float64` values (at any depth) as arrow-json does, except NaN and ±infinity, which
/// arrow-json writes as `null`: they become the strings `"NaN"`, `"Infinity"`, `"-Infinity"`.
#[derive(Debug)]
struct NonFiniteAsText;

/// A float encoder: the non-finite values as text, the others by arrow-json's own encoder.
struct FloatEncoder<'a> {
    value: Box<dyn Fn(usize) -> f64 + 'a>,
    finite: NullableEncoder<'a>,
}

impl Encoder for FloatEncoder<'_> {
    fn encode(&mut self, idx: usize, out: &mut Vec<u8>) {
        let v = (self.value)(idx);
        if v.is_nan() {
            out.extend_from_slice(b"\"NaN\"");
        } else if v.is_infinite() {
            out.extend_from_slice(if v > 0.0 { b"\"Infinity\"" } else { b"\"-Infinity\"" });
        } else {
            self.finite.encode(idx, out);
        }
    }
}

impl EncoderFactory for NonFiniteAsText {
    fn make_default_encoder<'a>(
        &self,
        field: &'a arrow::datatypes::FieldRef,
        array: &'a dyn Array,
        _options: &'a EncoderOptions,
    ) -> std::result::Result<Option<NullableEncoder<'a>>, arrow::error::ArrowError> {
        let value: Box<dyn Fn(usize) -> f64 + 'a> = match array.data_type() {
            DataType::Float32 => {
                let a = array.as_primitive::<Float32Type>();
                Box::new(move |i| f64::from(a.value(i)))
            }
            DataType::Float64 => {
                let a = array.as_primitive::<Float64Type>();
                Box::new(move |i| a.value(i))
            }
            _ => return Ok(None),
        };
        let finite = make_encoder(field, array, &PLAIN_JSON)?;
        Ok(Some(NullableEncoder::new(Box::new(FloatEncoder { value, finite }), array.nulls().cloned())))
    }
}

/// Convenience: the single i64 value of a one-row, one-column result (e.g. `SELECT count(*) ...`).
///
/// # Errors
/// [`Error::InvalidInput`] when the result is not a single integer.
pub async fn scalar_i64(lake: &Lake, q: &str) -> Result<i64> {
    let batches = query(lake, q).await?;
    let b = batches.iter().find(|b| b.num_rows() > 0).ok_or_else(|| Error::InvalidInput(format!("no rows from: {q}")))?;
    let col = arrow::compute::cast(b.column(0), &DataType::Int64)?;
    let arr = col
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .ok_or_else(|| Error::InvalidInput(format!("not an integer result: {q}")))?;
    Ok(arr.value(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lake_settings_apply_and_the_environment_overrides_them() {
        let o = lake_options();
        assert_eq!(o.execution.parquet.metadata_size_hint, Some(32 * 1024));
        assert!(!o.execution.collect_statistics);
        assert!(o.execution.target_partitions >= 4);
        // A setting no other test reads, so that setting it here changes nothing elsewhere.
        std::env::set_var("DATAFUSION_EXECUTION_PARQUET_MAX_PREDICATE_CACHE_SIZE", "12345");
        let o = session_options().unwrap();
        assert_eq!(o.execution.parquet.max_predicate_cache_size, Some(12345));
        assert_eq!(o.execution.parquet.metadata_size_hint, Some(32 * 1024), "the others stay the lake's");
        std::env::set_var("DATAFUSION_EXECUTION_PARQUET_MAX_PREDICATE_CACHE_SIZE", "not a number");
        assert!(matches!(session_options(), Err(Error::Sql(_))));
        std::env::remove_var("DATAFUSION_EXECUTION_PARQUET_MAX_PREDICATE_CACHE_SIZE");
    }
}
