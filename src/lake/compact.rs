//! Table maintenance: `nextstate compact` merges a table's small files into large ones.
//!
//! The sink writes one file per partition per roll (`[sink] roll_ms`, 5 s by default), so a busy
//! table gathers many small files; each costs every reader an open, a footer read and a plan entry.
//! Compaction merges, in each `date=` folder, runs of adjacent files of one lane (one Kafka partition of
//! one topic on one cluster, with contiguous offsets; or one direct writer) into files of about
//! `target_bytes`, named by the whole range they hold. The naming rule of [`super::live`] then makes
//! the small files covered: invisible to every reader (the pipeline's and `nextstate sql`'s) from the
//! moment the merged file is renamed into place. They are deleted once the merged file is older than
//! `retain` (a reader that listed the folder before may still be reading them).
//!
//! What it keeps:
//! - exactly-once: a merged Kafka file's name is the union of its files' offset ranges, so the lake's
//!   record of the next offset per partition ([`Lake::next_offsets`]) is unchanged, and the sink's
//!   de-duplication reads the merged file's keys as it read the small ones';
//! - concurrent writers: only complete (renamed) files are merged; a sink writing the next range of a
//!   partition meanwhile writes a file that no merged range covers;
//! - concurrent readers: see [`super::live`] (never both the small files and the merged one, never
//!   neither);
//! - one compaction per table at a time: a lock file (`_state/compact/<table>.lock`, an OS file lock
//!   released when the process dies) makes a second one fail at once.
//!
//! Rows keep their order (by offset, or by sequence number); files written before a table's schema
//! gained a nullable column get nulls in it (the table's declared schema is written).

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arrow::array::{new_null_array, ArrayRef, RecordBatch};
use arrow::datatypes::SchemaRef;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::live::lane_and_range;
use super::{kafka_stem, sanitize, FileOrigin, Lake, LakeFile};
use crate::error::{Error, Result};

/// Settings of one compaction.
#[derive(Debug, Clone)]
pub struct CompactOptions {
    /// Merge adjacent files until a merged file holds about this many bytes (of the small files).
    /// Files at least this large are left as they are.
    pub target_bytes: u64,
    /// Delete covered files only once the file covering them is this old.
    pub retain: Duration,
}

impl Default for CompactOptions {
    fn default() -> Self {
        CompactOptions { target_bytes: 128 << 20, retain: Duration::from_secs(600) }
    }
}

/// What one compaction of a table did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CompactStats {
    /// Live files before.
    pub files_before: usize,
    /// Live files after.
    pub files_after: usize,
    /// Bytes of the live files before.
    pub bytes_before: u64,
    /// Bytes of the live files after.
    pub bytes_after: u64,
    /// Merged files written.
    pub merged: usize,
    /// Small files those merged files cover.
    pub files_merged: usize,
    /// Rows written into merged files.
    pub rows_merged: u64,
    /// Covered files deleted (their covering file older than `retain`).
    pub covered_deleted: usize,
    /// Covered files kept for readers (their covering file younger than `retain`).
    pub covered_kept: usize,
}

/// The merged file's stem for a run of files of one lane.
fn merged_stem(run: &[LakeFile]) -> String {
    let (first, last) = (&run[0].origin, &run[run.len() - 1].origin);
    match (first, last) {
        (FileOrigin::Kafka { source, topic, partition, first, .. }, FileOrigin::Kafka { last, .. }) => kafka_stem(source, topic, *partition, *first, *last),
        (FileOrigin::Direct { writer, seq, .. }, FileOrigin::Direct { last_seq, .. }) => format!("w~{}~{seq:06}-{last_seq:06}", sanitize(writer)),
        _ => unreachable!("a run holds files of one lane"),
    }
}

/// Runs of files to merge: per date and lane ([`lane_and_range`]), adjacent files (contiguous offsets for
/// Kafka lanes), each under `target` bytes, grouped until a run reaches `target`; only runs of two or
/// more files.
///
/// # Errors
/// [`Error::InvalidInput`] when two live files of a lane overlap without one covering the other (not
/// something the lake writes; compaction refuses to guess).
fn plan(mut files: Vec<LakeFile>, target: u64) -> Result<Vec<Vec<LakeFile>>> {
    files.sort_by(|a, b| (&a.date, lane_and_range(&a.origin)).cmp(&(&b.date, lane_and_range(&b.origin))));
    let mut runs = vec![];
    let mut run: Vec<LakeFile> = vec![];
    let mut run_bytes = 0u64;
    for (i, f) in files.iter().enumerate() {
        let (lane, first, _) = lane_and_range(&f.origin);
        // the previous file of the same date and lane, if any
        let prev = i.checked_sub(1).map(|j| &files[j]).filter(|p| p.date == f.date && lane_and_range(&p.origin).0 == lane);
        if let Some(p) = prev {
            if first <= lane_and_range(&p.origin).2 {
                return Err(Error::InvalidInput(format!("{} and {} overlap: not compacting this table", p.path.display(), f.path.display())));
            }
        }
        let adjacent = match (&f.origin, prev) {
            (FileOrigin::Kafka { .. }, Some(p)) => first == lane_and_range(&p.origin).2 + 1,
            (_, p) => p.is_some(),
        };
        if !adjacent || f.bytes >= target || run_bytes >= target {
            if run.len() > 1 {
                runs.push(std::mem::take(&mut run));
            }
            run.clear();
            run_bytes = 0;
        }
        if f.bytes < target {
            run_bytes += f.bytes;
            run.push(f.clone());
        }
    }
    if run.len() > 1 {
        runs.push(run);
    }
    Ok(runs)
}

/// `batch` with `schema`'s columns: matched by name, cast where the type differs, nulls where the file
/// predates a (nullable) column.
///
/// # Errors
/// [`Error::InvalidInput`] when a non-nullable column is missing; [`Error::Arrow`] when a cast fails.
fn conform(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let cols: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(c) if c.data_type() == field.data_type() => Ok(c.clone()),
            Some(c) => Ok(arrow::compute::cast(c, field.data_type())?),
            None if field.is_nullable() => Ok(new_null_array(field.data_type(), batch.num_rows())),
            None => Err(Error::InvalidInput(format!("a file lacks the non-nullable column {}", field.name()))),
        })
        .collect::<Result<_>>()?;
    Ok(RecordBatch::try_new(schema.clone(), cols)?)
}

fn read_batches(path: &PathBuf) -> Result<impl Iterator<Item = Result<RecordBatch>>> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    Ok(ParquetRecordBatchReaderBuilder::try_new(file)?.build()?.map(|b| b.map_err(Error::from)))
}

/// Compacts table `table` (declared `schema`) of `lake`: merges small files (see the module
/// documentation), then deletes the covered files older than `opts.retain`.
///
/// # Errors
/// [`Error::InvalidInput`] when another compaction holds the table's lock, files overlap, or the lake is
/// on object storage;
/// [`Error::Io`]/[`Error::Parquet`]/[`Error::Arrow`] on read or write failures (files written so far
/// stay valid: each merged file is complete or absent).
pub fn compact_table(lake: &Lake, table: &str, schema: SchemaRef, opts: &CompactOptions) -> Result<CompactStats> {
    refuse_remote(lake)?;
    let lock_path = lake.state_dir("compact")?.join(format!("{table}.lock"));
    let lock = File::create(&lock_path).map_err(|e| Error::io("create", &lock_path, e))?;
    lock.try_lock()
        .map_err(|_| Error::InvalidInput(format!("another `nextstate compact` is compacting table {table} (lock {})", lock_path.display())))?;
    let before = lake.files(table)?;
    let mut stats = CompactStats { files_before: before.len(), bytes_before: before.iter().map(|f| f.bytes).sum(), ..Default::default() };
    for run in plan(before, opts.target_bytes)? {
        let stem = merged_stem(&run);
        let mut rows = 0u64;
        let paths: Vec<PathBuf> = run.iter().map(|f| f.path.clone()).collect();
        let batches = paths.iter().map(read_batches).flat_map(|r| match r {
            Ok(it) => Box::new(it) as Box<dyn Iterator<Item = Result<RecordBatch>>>,
            Err(e) => Box::new(std::iter::once(Err(e))),
        });
        let conformed = batches.map(|b| {
            let b = conform(&b?, &schema)?;
            rows += b.num_rows() as u64;
            Ok(b)
        });
        lake.write_batches(table, &run[0].date, &stem, schema.clone(), conformed)?;
        tracing::info!(table, stem, files = run.len(), rows, "merged");
        stats.merged += 1;
        stats.files_merged += run.len();
        stats.rows_merged += rows;
    }
    let now = SystemTime::now();
    for (f, covering) in lake.covered_files(table)? {
        let age = std::fs::metadata(&covering).and_then(|m| m.modified()).ok().and_then(|t| now.duration_since(t).ok()).unwrap_or_default();
        if age >= opts.retain {
            std::fs::remove_file(&f.path).map_err(|e| Error::io("delete covered file", &f.path, e))?;
            stats.covered_deleted += 1;
        } else {
            stats.covered_kept += 1;
        }
    }
    let after = lake.files(table)?;
    stats.files_after = after.len();
    stats.bytes_after = after.iter().map(|f| f.bytes).sum();
    drop(lock);
    Ok(stats)
}

/// Compaction on object storage is not built yet: its covered-file deletion and its lock are local
/// file-system operations.
fn refuse_remote(lake: &Lake) -> Result<()> {
    match lake.remote() {
        Some(_) => Err(Error::InvalidInput(format!("nextstate compact: {} is on object storage; compaction is implemented for local lakes only", lake.root().display()))),
        None => Ok(()),
    }
}

/// Compacts every table of `tables` (name, declared schema) that has a folder in `lake`.
///
/// # Errors
/// As [`compact_table`], for the first table that fails.
pub fn compact(lake: &Lake, tables: &[(&'static str, SchemaRef)], opts: &CompactOptions) -> Result<Vec<(&'static str, CompactStats)>> {
    refuse_remote(lake)?;
    tables.iter().filter(|(name, _)| lake.table_dir(name).is_dir()).map(|(name, schema)| Ok((*name, compact_table(lake, name, Arc::clone(schema), opts)?))).collect()
}
