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
//! - one compaction per table at a time: a lock (see below) makes a second one fail at once.
//!
//! Rows keep their order (by offset, or by sequence number); files written before a table's schema
//! gained a nullable column get nulls in it (the table's declared schema is written).
//!
//! **The lock.** On a local lake: the file `_state/compact/<table>.lock` with an OS file lock, released
//! when the process dies. On object storage (`--lake s3://bucket/prefix`, [`super::remote`]): the object
//! `<prefix>/_state/compact/<table>.lock` in the bucket itself (so compactors on different machines
//! exclude each other; the lake's other stage state stays local), holding who took it and until when
//! ([`CompactLock`]: [`LOCK_TTL`] from now). It is created with a conditional PUT (`If-None-Match: *`),
//! renewed after every merged file with a PUT conditional on its version (`If-Match`), and deleted at the
//! end. A lock whose time ran out (a compactor killed mid-way) is taken over with the same `If-Match`
//! PUT, so of two compactors finding it stale one wins; a compactor that finds its lock taken over
//! (it stalled past [`LOCK_TTL`] between two files) stops with an error, leaving every file it wrote
//! valid. Expiry compares the compactors' clocks: they are assumed to agree to well within [`LOCK_TTL`].
//!
//! **On object storage** the rest works as on a disk: each merged file is one conditional PUT (it
//! appears complete, and under the live-file rule it supersedes the small files at once); the small
//! files are fetched whole (they are small by definition) and the merged file is built in memory (about
//! `target_bytes`) before its PUT; a covered file's age is its covering object's `last_modified` from
//! the listing (the server's clock), and it is deleted with a DELETE once that age reaches `retain`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arrow::array::{new_null_array, ArrayRef, RecordBatch};
use arrow::datatypes::SchemaRef;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use datafusion::object_store::path::Path as ObjectPath;
use datafusion::object_store::{PutMode, UpdateVersion};

use super::live::lane_and_range;
use super::remote::{raw_path, Remote};
use super::{kafka_stem, sanitize, FileOrigin, Lake, LakeFile};
use crate::error::{Error, Result};

/// How long a compaction lock on object storage holds without renewal (it is renewed after every merged
/// file); a lock older than this is stale and taken over.
pub const LOCK_TTL: Duration = Duration::from_secs(15 * 60);

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

/// The record batches of one lake file (a path from [`Lake::files`]): opened on disk, or fetched whole
/// from object storage.
fn read_batches(lake: &Lake, path: &Path) -> Result<Box<dyn Iterator<Item = Result<RecordBatch>>>> {
    let batches = |r: parquet::arrow::arrow_reader::ParquetRecordBatchReader| r.map(|b| b.map_err(Error::from));
    Ok(match lake.remote() {
        Some(r) => Box::new(batches(ParquetRecordBatchReaderBuilder::try_new(r.get(&object_path(path))?)?.build()?)),
        None => {
            let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
            Box::new(batches(ParquetRecordBatchReaderBuilder::try_new(file)?.build()?))
        }
    })
}

fn object_path(path: &Path) -> ObjectPath {
    raw_path(&path.to_string_lossy())
}

/// What the lock object of a compaction on object storage holds (JSON).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CompactLock {
    /// Who holds it: `<host>:<pid>:<random id>`.
    pub holder: String,
    /// When it was taken (ms since the Unix epoch).
    pub acquired_ms: i64,
    /// Until when it holds unless renewed (ms since the Unix epoch); after that it is stale.
    pub expires_ms: i64,
}

/// A held compaction lock: the local file lock, or the lock object and its current version.
enum HeldLock<'a> {
    Local(#[allow(dead_code)] File),
    Remote { remote: &'a Remote, path: ObjectPath, lock: CompactLock, version: UpdateVersion },
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or_default()
}

fn busy(table: &str, where_: &str, holder: &str) -> Error {
    Error::InvalidInput(format!("another `nextstate compact` is compacting table {table} (lock {where_}{holder})"))
}

impl<'a> HeldLock<'a> {
    /// Takes table `table`'s lock (see the module documentation), failing at once when another
    /// compaction holds it.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the lock is held; [`Error::Io`]/[`Error::Unreachable`] when it cannot
    /// be created.
    fn acquire(lake: &'a Lake, table: &str) -> Result<HeldLock<'a>> {
        let Some(remote) = lake.remote() else {
            let lock_path = lake.state_dir("compact")?.join(format!("{table}.lock"));
            let lock = File::create(&lock_path).map_err(|e| Error::io("create", &lock_path, e))?;
            lock.try_lock().map_err(|_| busy(table, &lock_path.display().to_string(), ""))?;
            return Ok(HeldLock::Local(lock));
        };
        let path = remote.path(&format!("_state/compact/{table}.lock"));
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
        let holder = format!("{host}:{}:{}", std::process::id(), uuid::Uuid::new_v4().simple());
        let lock = CompactLock { holder, acquired_ms: now_ms(), expires_ms: now_ms() + LOCK_TTL.as_millis() as i64 };
        let body = serde_json::to_vec(&lock)?;
        // two rounds: the lock may be released between our failed create and our read
        for _ in 0..2 {
            if let Some(version) = remote.put_if(&path, body.clone(), PutMode::Create)? {
                return Ok(HeldLock::Remote { remote, path, lock, version });
            }
            let Some((bytes, version)) = remote.get_versioned(&path)? else { continue };
            match serde_json::from_slice::<CompactLock>(&bytes) {
                Ok(other) if other.expires_ms > now_ms() => {
                    let until = chrono::DateTime::from_timestamp_millis(other.expires_ms).map(|t| t.to_rfc3339()).unwrap_or_default();
                    return Err(busy(table, &format!("{path}, held by "), &format!("{} until {until}", other.holder)));
                }
                stale => {
                    let was = stale.map(|o| o.holder).unwrap_or_else(|_| "unreadable lock".into());
                    tracing::warn!(table, lock = %path, stale_holder = %was, "taking over a stale compaction lock");
                    return match remote.put_if(&path, body, PutMode::Update(version))? {
                        Some(version) => Ok(HeldLock::Remote { remote, path, lock, version }),
                        None => Err(busy(table, path.as_ref(), " (taken over by another compactor just now)")),
                    };
                }
            }
        }
        Err(busy(table, path.as_ref(), ""))
    }

    /// Extends a lock on object storage by [`LOCK_TTL`] from now (a local lock needs nothing).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the lock was taken over (this compaction stalled past its expiry);
    /// [`Error::Unreachable`] when the PUT fails.
    fn renew(&mut self, table: &str) -> Result<()> {
        let HeldLock::Remote { remote, path, lock, version } = self else { return Ok(()) };
        lock.expires_ms = now_ms() + LOCK_TTL.as_millis() as i64;
        match remote.put_if(path, serde_json::to_vec(&*lock)?, PutMode::Update(version.clone()))? {
            Some(v) => {
                *version = v;
                Ok(())
            }
            None => Err(Error::InvalidInput(format!(
                "the compaction lock {path} of table {table} was taken over by another compactor (this one stalled past {} s); stopping",
                LOCK_TTL.as_secs()
            ))),
        }
    }

    /// Releases the lock: deletes the lock object if it is still this compaction's.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the lock object cannot be read or deleted.
    fn release(self) -> Result<()> {
        if let HeldLock::Remote { remote, path, lock, .. } = self {
            let ours = remote.get_versioned(&path)?.and_then(|(b, _)| serde_json::from_slice::<CompactLock>(&b).ok()).is_some_and(|l| l.holder == lock.holder);
            if ours {
                remote.delete(&path)?;
            }
        }
        Ok(())
    }
}

/// Compacts table `table` (declared `schema`) of `lake` (a local folder or object storage): merges
/// small files (see the module documentation), then deletes the covered files older than
/// `opts.retain`.
///
/// # Errors
/// [`Error::InvalidInput`] when another compaction holds the table's lock (or took it over from this
/// one) or files overlap; [`Error::Io`]/[`Error::Parquet`]/[`Error::Arrow`] on read or write failures;
/// [`Error::Unreachable`] when object storage fails (files written so far stay valid: each merged file
/// is complete or absent).
pub fn compact_table(lake: &Lake, table: &str, schema: SchemaRef, opts: &CompactOptions) -> Result<CompactStats> {
    let mut lock = HeldLock::acquire(lake, table)?;
    let result = compact_locked(lake, table, schema, opts, &mut lock);
    let released = lock.release();
    let stats = result?;
    released?;
    Ok(stats)
}

fn compact_locked(lake: &Lake, table: &str, schema: SchemaRef, opts: &CompactOptions, lock: &mut HeldLock) -> Result<CompactStats> {
    let before = lake.files(table)?;
    let mut stats = CompactStats { files_before: before.len(), bytes_before: before.iter().map(|f| f.bytes).sum(), ..Default::default() };
    for run in plan(before, opts.target_bytes)? {
        let stem = merged_stem(&run);
        let mut rows = 0u64;
        let batches = run.iter().flat_map(|f| match read_batches(lake, &f.path) {
            Ok(it) => it,
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
        lock.renew(table)?;
    }
    // a covered file's age is its covering file's: local mtime, or the object's last_modified
    let written: HashMap<PathBuf, SystemTime> = lake.files(table)?.into_iter().map(|f| (f.path, f.modified)).collect();
    let now = SystemTime::now();
    for (f, covering) in lake.covered_files(table)? {
        let age = written.get(&covering).and_then(|t| now.duration_since(*t).ok()).unwrap_or_default();
        if age >= opts.retain {
            match lake.remote() {
                Some(r) => r.delete(&object_path(&f.path))?,
                None => std::fs::remove_file(&f.path).map_err(|e| Error::io("delete covered file", &f.path, e))?,
            }
            stats.covered_deleted += 1;
        } else {
            stats.covered_kept += 1;
        }
    }
    let after = lake.files(table)?;
    stats.files_after = after.len();
    stats.bytes_after = after.iter().map(|f| f.bytes).sum();
    Ok(stats)
}

/// Compacts every table of `tables` (name, declared schema) that has a folder in `lake`.
///
/// # Errors
/// As [`compact_table`], for the first table that fails.
pub fn compact(lake: &Lake, tables: &[(&'static str, SchemaRef)], opts: &CompactOptions) -> Result<Vec<(&'static str, CompactStats)>> {
    let present = lake.tables();
    tables
        .iter()
        .filter(|(name, _)| present.iter().any(|p| p == name))
        .map(|(name, schema)| Ok((*name, compact_table(lake, name, Arc::clone(schema), opts)?)))
        .collect()
}
