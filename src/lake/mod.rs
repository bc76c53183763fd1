//! The Parquet lake: one folder per table, Hive-style `date=YYYY-MM-DD/` partitions, ZSTD Parquet files
//! written atomically (temporary name, fsync, rename, fsync of the folder).
//!
//! Layout (`--lake DIR`, default `./lake`):
//! ```text
//! DIR/<table>/date=2026-11-29/k~<source>~<topic>~p0003~00000000000000000120-00000000000000000199.parquet
//! DIR/<table>/date=2026-11-29/w~<writer id>~000007.parquet
//! DIR/_state/...                      stage state (vote cache, progress), not tables
//! ```
//! Files written by the Kafka sink ([`sink`]) are named by their source cluster, topic, partition and the
//! first and last offset they hold, so the lake itself records how far each partition has been written:
//! re-writing the same range is idempotent and a restarted sink resumes after the last durable offset.
//! Files written directly (ingest without Kafka records, the trainer's step table) are named by a writer
//! id and sequence number.
//!
//! A column marked [`HISTORY_LAYOUT`] (the request history, which grows by a suffix each turn) is
//! written without a dictionary in large pages ([`writer_properties`]), and the rows of a file of such
//! a table are grouped by session (in offset order within a session): ZSTD then stores each turn's new
//! messages, not the whole history again, and `interactions` keeps one plain JSON-text column that SQL
//! reads as is. Files of the other tables hold their rows in offset order.

pub mod columns;
pub mod compact;
pub mod dedupe;
mod file_names;
pub mod live;
pub mod remote;
pub mod sink;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use arrow::array::{Array, RecordBatch, StringArray};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::file::reader::ChunkReader;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

pub use file_names::{kafka_stem, FileOrigin};
pub(crate) use file_names::{parse_stem, sanitize};
use file_names::SEP;

use crate::error::{Error, Result};
use crate::schema::{field_refs, schema_of, Table, HISTORY_LAYOUT, LAYOUT_KEY};

/// Largest data page (bytes, uncompressed) of a [`HISTORY_LAYOUT`] column: large enough that a long
/// session's turns share a page, so ZSTD stores each turn's new suffix rather than its whole history.
/// Measured on 24,540 tau-bench rows grouped by session (docs/BENCHMARKS.md §2): 1, 2, 4 and 8 MiB
/// pages give 1.86, 1.33, 1.07 and 0.94 MB of Parquet, and the write takes longer as pages grow
/// (0.19, 0.24, 0.29, 0.37 s; 0.34 s and 6.94 MB with the dictionary and 1 MiB pages in offset order).
/// 2 MiB keeps most of the saving and writes faster than before.
pub const HISTORY_PAGE_BYTES: usize = 2 << 20;

/// The lake's Parquet writer settings for `schema`: ZSTD level 3 on every column; a column marked
/// [`HISTORY_LAYOUT`] (field metadata [`LAYOUT_KEY`]) is written without a dictionary and in pages of
/// up to [`HISTORY_PAGE_BYTES`].
///
/// # Errors
/// None in practice ([`Error::Parquet`] if the ZSTD level were invalid).
pub fn writer_properties(schema: &arrow::datatypes::Schema) -> Result<WriterProperties> {
    let mut b = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?));
    for f in schema.fields().iter().filter(|f| is_history(f)) {
        let col = ColumnPath::from(f.name().as_str());
        b = b.set_column_dictionary_enabled(col.clone(), false).set_column_data_page_size_limit(col, HISTORY_PAGE_BYTES);
    }
    Ok(b.build())
}

/// A file [`Lake::write_file`] or [`Lake::write_batches`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Its path (on object storage: the object's path in its bucket).
    pub path: PathBuf,
    /// Bytes this call wrote: the file's size, or 0 when a file of that name was already there and was
    /// left as is (a re-written offset range).
    pub bytes: u64,
}

/// Whether `field` is marked with the [`HISTORY_LAYOUT`] (field metadata [`LAYOUT_KEY`]).
fn is_history(field: &arrow::datatypes::Field) -> bool {
    field.metadata().get(LAYOUT_KEY).is_some_and(|l| l == HISTORY_LAYOUT)
}

/// A lake rooted at a folder, or at an object-storage URL (`s3://bucket/prefix`, see [`remote`]).
#[derive(Debug, Clone)]
pub struct Lake {
    root: PathBuf,
    remote: Option<Arc<remote::Remote>>,
}

/// One Parquet file of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LakeFile {
    /// Full path (on object storage: the object's path in its bucket).
    pub path: PathBuf,
    /// The `date=` partition value (`YYYY-MM-DD`).
    pub date: String,
    /// Where the rows came from, parsed from the file name.
    pub origin: FileOrigin,
    /// Size in bytes.
    pub bytes: u64,
    /// Last modification time (when it was written or merged).
    pub modified: SystemTime,
}

/// Why a Parquet file under a table folder is not one of the lake's files ([`Lake::stray_files`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StrayReason {
    /// Directly in the table folder, not in a `date=YYYY-MM-DD/` folder: nothing reads it.
    OutsideDateFolder,
    /// In a `date=` folder under a name the lake does not write: `sql` reads it, the pipeline does not.
    ForeignName,
}

impl StrayReason {
    /// What happens to such a file, for a user.
    pub fn explain(self) -> &'static str {
        match self {
            StrayReason::OutsideDateFolder => "not read (by sql or anything else): it is not in a date=YYYY-MM-DD folder of the table",
            StrayReason::ForeignName => {
                "read by sql, but not by the pipeline (sinks' de-duplication, replay, caches): its name is not one the lake writes"
            }
        }
    }
}

/// `YYYY-MM-DD` (UTC) of a time in ms since the epoch.
pub fn date_of(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .format("%Y-%m-%d")
        .to_string()
}

impl Lake {
    /// Opens (creating if needed) a lake at `root`: a folder, or an object-storage URL
    /// (`s3://bucket/prefix`, see [`remote`]).
    ///
    /// # Errors
    /// [`Error::Io`] when the folder (for object storage: the local state folder) cannot be created;
    /// [`Error::Config`] for an unsupported URL.
    pub fn open(root: impl Into<PathBuf>) -> Result<Lake> {
        let root = root.into();
        if let Some(url) = root.to_str().filter(|s| remote::is_url(s)) {
            let r = remote::Remote::connect(url)?;
            fs::create_dir_all(&r.state).map_err(|e| Error::io("create state folder", &r.state, e))?;
            return Ok(Lake { root, remote: Some(Arc::new(r)) });
        }
        fs::create_dir_all(&root).map_err(|e| Error::io("create lake folder", &root, e))?;
        Ok(Lake { root, remote: None })
    }

    /// Opens the lake at `root` for reading (`sql`, `export`, `compact`): as [`Lake::open`], but a local
    /// folder that does not exist is an error instead of a new empty lake, so a mistyped `--lake` does not
    /// print 0 rows. (An object-storage URL is opened as by [`Lake::open`].)
    ///
    /// # Errors
    /// [`Error::InvalidInput`] (a user error) when the local folder does not exist or is not a folder;
    /// otherwise as [`Lake::open`].
    pub fn open_existing(root: impl Into<PathBuf>) -> Result<Lake> {
        let root = root.into();
        let remote = root.to_str().is_some_and(remote::is_url);
        if !remote && !root.is_dir() {
            let what = if root.exists() { "is not a folder" } else { "does not exist" };
            return Err(Error::InvalidInput(format!(
                "no lake at {}: it {what}; run `nextstate ingest` first or pass --lake (or --pipeline) naming the lake",
                root.display()
            )));
        }
        Lake::open(root)
    }

    /// The lake's root folder (for object storage: its URL).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The object store behind the lake, if it is on object storage.
    pub fn remote(&self) -> Option<&remote::Remote> {
        self.remote.as_deref()
    }

    /// The URL of table `name`'s folder, ending in `/` (a local path or `s3://bucket/prefix/name/`), as
    /// DataFusion lists it.
    pub fn table_url(&self, name: &str) -> String {
        match &self.remote {
            Some(r) => format!("{}/{}/", r.base.as_str().trim_end_matches('/'), r.path(name)),
            None => format!("{}/", self.table_dir(name).display()),
        }
    }

    /// The folder of table `name`.
    pub fn table_dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// A folder for stage state (`DIR/_state/<name>`), created if needed.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be created.
    pub fn state_dir(&self, name: &str) -> Result<PathBuf> {
        let d = match &self.remote {
            Some(r) => r.state.join(name),
            None => self.root.join("_state").join(name),
        };
        fs::create_dir_all(&d).map_err(|e| Error::io("create state folder", &d, e))?;
        Ok(d)
    }

    /// Names of the tables that have a folder in the lake (sorted).
    pub fn tables(&self) -> Vec<String> {
        let mut out = vec![];
        if let Some(r) = &self.remote {
            out = r.folders().unwrap_or_default().into_iter().filter(|n| !n.starts_with('_') && !n.starts_with('.')).collect();
        } else if let Ok(rd) = fs::read_dir(&self.root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if e.path().is_dir() && !name.starts_with('_') && !name.starts_with('.') {
                    out.push(name);
                }
            }
        }
        out.sort();
        out
    }

    /// Every live Parquet file of table `name`, sorted by path: temporary files and files covered by a
    /// merged file ([`live`], [`compact`]) are not listed.
    ///
    /// # Errors
    /// [`Error::Io`] when a folder cannot be read.
    pub fn files(&self, name: &str) -> Result<Vec<LakeFile>> {
        Ok(self.scan(name)?.into_iter().filter(|(_, c)| c.is_none()).map(|(f, _)| f).collect())
    }

    /// The files of table `name` that a merged file covers, each with the path of that file (sorted by
    /// path): left by `nextstate compact` for readers that listed them before, deleted after its
    /// retention time.
    ///
    /// # Errors
    /// [`Error::Io`] when a folder cannot be read.
    pub fn covered_files(&self, name: &str) -> Result<Vec<(LakeFile, PathBuf)>> {
        Ok(self.scan(name)?.into_iter().filter_map(|(f, c)| c.map(|c| (f, c))).collect())
    }

    /// Every lake file of table `name` with the path of the file covering it, if any.
    fn scan(&self, name: &str) -> Result<Vec<(LakeFile, Option<PathBuf>)>> {
        let mut out = vec![];
        // (date, file name, path, bytes, modified) of every `.parquet` in a `date=` folder of the table
        let mut found: BTreeMap<String, Vec<(String, PathBuf, u64, SystemTime)>> = BTreeMap::new();
        if let Some(r) = &self.remote {
            for m in r.list(name)? {
                let rel = r.rel(m.location.as_ref());
                if let [_, part, fname] = rel.split('/').collect::<Vec<_>>().as_slice() {
                    if let Some(date) = part.strip_prefix("date=") {
                        let entry = (fname.to_string(), PathBuf::from(m.location.as_ref()), m.size, SystemTime::from(m.last_modified));
                        found.entry(date.to_string()).or_default().push(entry);
                    }
                }
            }
        } else {
            let dir = self.table_dir(name);
            if !dir.exists() {
                return Ok(out);
            }
            for part in fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?.flatten() {
                let pname = part.file_name().to_string_lossy().into_owned();
                let Some(date) = pname.strip_prefix("date=") else { continue };
                let files = found.entry(date.to_string()).or_default();
                for f in fs::read_dir(part.path()).map_err(|e| Error::io("list", part.path(), e))?.flatten() {
                    let fname = f.file_name().to_string_lossy().into_owned();
                    if !fname.ends_with(".parquet") {
                        continue;
                    }
                    // a file deleted since the listing (a compaction's retention ran out) is not listed
                    let Ok(meta) = f.metadata() else { continue };
                    files.push((fname, f.path(), meta.len(), meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)));
                }
            }
        }
        for (date, files) in found {
            let mut in_dir = vec![];
            for (fname, path, bytes, modified) in files {
                let Some(stem) = fname.strip_suffix(".parquet") else { continue };
                if stem.starts_with('.') {
                    continue;
                }
                if let Some(origin) = parse_stem(stem) {
                    in_dir.push(LakeFile { path, date: date.clone(), origin, bytes, modified });
                }
            }
            let cover = live::covering(&in_dir.iter().map(|f| &f.origin).collect::<Vec<_>>());
            let paths: Vec<PathBuf> = in_dir.iter().map(|f| f.path.clone()).collect();
            out.extend(in_dir.into_iter().zip(cover).map(|(f, c)| (f, c.map(|i| paths[i].clone()))));
        }
        out.sort_by(|a, b| a.0.path.cmp(&b.0.path));
        Ok(out)
    }

    /// Parquet files under table `name`'s folder that [`Lake::files`] does not list, each with why
    /// (sorted by path): a file outside the `date=YYYY-MM-DD/` folders, which nothing reads (`sql`
    /// included), or one in them whose name is not one the lake writes, which `sql` reads but the
    /// pipeline's own readers (sinks' de-duplication, replay, caches) do not (hidden `.parquet` files
    /// included: `sql` reads them too). The lake's temporary files (`.parquet.tmp`) are not listed.
    ///
    /// # Errors
    /// [`Error::Io`] when a folder cannot be read.
    pub fn stray_files(&self, name: &str) -> Result<Vec<(PathBuf, StrayReason)>> {
        let dir = self.table_dir(name);
        let mut out = vec![];
        if let Some(r) = &self.remote {
            for m in r.list(name)? {
                let rel = r.rel(m.location.as_ref());
                let Some(fname) = rel.rsplit('/').next().filter(|n| n.ends_with(".parquet")) else { continue };
                let stem = fname.trim_end_matches(".parquet");
                let reason = match rel.split('/').collect::<Vec<_>>().as_slice() {
                    [_, part, _] if part.starts_with("date=") => (stem.starts_with('.') || parse_stem(stem).is_none()).then_some(StrayReason::ForeignName),
                    _ => Some(StrayReason::OutsideDateFolder),
                };
                if let Some(reason) = reason {
                    out.push((PathBuf::from(m.location.as_ref()), reason));
                }
            }
            out.sort();
            return Ok(out);
        }
        if !dir.exists() {
            return Ok(out);
        }
        let is_parquet = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".parquet")) && p.is_file();
        for e in fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?.flatten() {
            let path = e.path();
            let pname = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() && pname.starts_with("date=") {
                for f in fs::read_dir(&path).map_err(|e| Error::io("list", &path, e))?.flatten() {
                    let fp = f.path();
                    let stem = f.file_name().to_string_lossy().trim_end_matches(".parquet").to_string();
                    if is_parquet(&fp) && (stem.starts_with('.') || parse_stem(&stem).is_none()) {
                        out.push((fp, StrayReason::ForeignName));
                    }
                }
            } else if is_parquet(&path) {
                out.push((path, StrayReason::OutsideDateFolder));
            }
        }
        out.sort();
        Ok(out)
    }

    /// For each (source, topic, partition) written by the Kafka sink into table `name`, the next offset to
    /// write (last durable offset + 1).
    ///
    /// # Errors
    /// [`Error::Io`] when the table folder cannot be listed.
    pub fn next_offsets(&self, name: &str) -> Result<HashMap<(String, String, i32), i64>> {
        let mut out: HashMap<(String, String, i32), i64> = HashMap::new();
        for f in self.files(name)? {
            if let FileOrigin::Kafka { source, topic, partition, last, .. } = f.origin {
                let e = out.entry((source, topic, partition)).or_insert(0);
                *e = (*e).max(last + 1);
            }
        }
        Ok(out)
    }

    /// Writes `rows` of table `T` as one file per `date=` partition (by event time), named
    /// `w~<writer>~<seq>`. Returns the paths written. An empty slice writes nothing.
    ///
    /// # Errors
    /// [`Error::Records`] when rows do not match the schema, [`Error::Parquet`]/[`Error::Io`] on write.
    pub fn write_rows<T: Table>(&self, rows: &[T], writer: &str, seq: u64) -> Result<Vec<PathBuf>> {
        let mut by_date: BTreeMap<String, Vec<&T>> = BTreeMap::new();
        for r in rows {
            by_date.entry(date_of(r.event_time_ms())).or_default().push(r);
        }
        let mut paths = vec![];
        for (date, group) in by_date {
            let stem = format!("w{SEP}{}{SEP}{seq:06}", sanitize(writer));
            paths.push(self.write_file::<T>(&date, &stem, &group)?.path);
        }
        Ok(paths)
    }

    /// Writes rows of one date as `<table>/date=<date>/<stem>.parquet`, atomically. If the file already
    /// exists (a re-write of the same offset range) it is left as is (`bytes` 0).
    ///
    /// # Errors
    /// As [`Lake::write_rows`].
    pub fn write_file<T: Table>(&self, date: &str, stem: &str, rows: &[&T]) -> Result<Written> {
        let path = self.table_dir(T::NAME).join(format!("date={date}")).join(format!("{stem}.parquet"));
        if self.remote.is_none() && path.exists() {
            return Ok(Written { path, bytes: 0 });
        }
        // A table with a history column gets its rows grouped by session (a stable sort: offset order
        // within a session), so a session's growing request history sits in one page run and ZSTD
        // stores each turn's new suffix only. Other tables keep offset order, the lake order that the
        // stages' re-publishing of pending rows follows.
        let schema = schema_of::<T>();
        let grouped: Vec<&T>;
        let rows = if schema.fields().iter().any(|f| is_history(f)) {
            let mut r = rows.to_vec();
            r.sort_by(|a, b| a.session_id().cmp(b.session_id()));
            grouped = r;
            &grouped[..]
        } else {
            rows
        };
        let batch = serde_arrow::to_record_batch(&field_refs::<T>(), &rows)?;
        let batch = batch.with_schema(schema)?;
        self.write_batches(T::NAME, date, stem, batch.schema(), std::iter::once(Ok(batch)))
    }

    /// Writes `batches` (each of `schema`) as `<table>/date=<date>/<stem>.parquet` with the lake's
    /// writer settings ([`writer_properties`]), atomically: a temporary name, fsync, rename, fsync of
    /// the folder. If the file already exists it is left as is (`bytes` 0).
    ///
    /// # Errors
    /// The first error of `batches`; [`Error::Parquet`]/[`Error::Io`] on write.
    pub fn write_batches(
        &self,
        table: &str,
        date: &str,
        stem: &str,
        schema: arrow::datatypes::SchemaRef,
        batches: impl IntoIterator<Item = Result<RecordBatch>>,
    ) -> Result<Written> {
        let props = writer_properties(&schema)?;
        if let Some(r) = &self.remote {
            // One conditional PUT: the object appears complete, and a second writer of the same name
            // (a re-written offset range) leaves the first copy.
            let mut w = ArrowWriter::try_new(Vec::new(), schema, Some(props))?;
            for batch in batches {
                w.write(&batch?)?;
            }
            let path = r.path(&format!("{table}/date={date}/{stem}.parquet"));
            let data = w.into_inner()?;
            let bytes = data.len() as u64;
            let wrote = r.put_new(&path, data)?;
            return Ok(Written { path: PathBuf::from(path.as_ref()), bytes: if wrote { bytes } else { 0 } });
        }
        let dir = self.table_dir(table).join(format!("date={date}"));
        let path = dir.join(format!("{stem}.parquet"));
        if path.exists() {
            return Ok(Written { path, bytes: 0 });
        }
        fs::create_dir_all(&dir).map_err(|e| Error::io("create partition folder", &dir, e))?;
        let tmp = dir.join(format!(".{stem}.parquet.tmp"));
        let written = (|| {
            let file = File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
            let mut w = ArrowWriter::try_new(file, schema, Some(props))?;
            for batch in batches {
                w.write(&batch?)?;
            }
            let file = w.into_inner()?;
            file.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
            Ok(file.metadata().map_err(|e| Error::io("stat", &tmp, e))?.len())
        })();
        let bytes = match written {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        fs::rename(&tmp, &path).map_err(|e| Error::io("rename", &path, e))?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(Written { path, bytes })
    }

    /// Reads every row of table `T` (all files, path order).
    ///
    /// # Errors
    /// [`Error::Parquet`]/[`Error::Records`] when a file is unreadable or does not match `T`.
    pub fn read_table<T: Table>(&self) -> Result<Vec<T>> {
        let mut out = vec![];
        for f in self.files(T::NAME)? {
            out.extend(self.read_rows::<T>(&f.path)?);
        }
        Ok(out)
    }

    /// The values of string column `column` of table `name` (all files), reading only that column.
    ///
    /// # Errors
    /// [`Error::Parquet`] on unreadable files; [`Error::InvalidInput`] when the column is missing or not
    /// a string column.
    pub fn string_column(&self, name: &str, column: &str) -> Result<Vec<Option<String>>> {
        let mut out = vec![];
        for f in self.files(name)? {
            out.extend(self.file_strings(&f.path, column).map_err(|e| match e {
                Error::InvalidInput(m) => Error::InvalidInput(format!("table {name}: {m}")),
                e => e,
            })?);
        }
        Ok(out)
    }

    /// The rows of one file of table `T` (a path from [`Lake::files`]).
    ///
    /// # Errors
    /// As [`read_file`]; [`Error::Unreachable`] when object storage fails.
    pub fn read_rows<T: Table>(&self, path: &Path) -> Result<Vec<T>> {
        match &self.remote {
            Some(r) => rows_from(r.get(&object_path(path))?),
            None => read_file(path),
        }
    }

    /// The values of string column `column` of one file (a path from [`Lake::files`]).
    ///
    /// # Errors
    /// As [`file_strings`]; [`Error::Unreachable`] when object storage fails.
    pub fn file_strings(&self, path: &Path, column: &str) -> Result<Vec<Option<String>>> {
        match &self.remote {
            Some(r) => strings_from(r.get(&object_path(path))?, path, column),
            None => file_strings(path, column),
        }
    }

    /// The set of primary keys already in table `T`.
    ///
    /// # Errors
    /// As [`Lake::string_column`].
    pub fn keys<T: Table>(&self) -> Result<HashSet<String>> {
        Ok(self.string_column(T::NAME, T::KEY)?.into_iter().flatten().collect())
    }
}

/// The values of string column `column` of one Parquet file, reading only that column.
///
/// # Errors
/// [`Error::Parquet`] when unreadable; [`Error::InvalidInput`] when the column is missing or not a
/// string column.
pub fn file_strings(path: &Path, column: &str) -> Result<Vec<Option<String>>> {
    strings_from(File::open(path).map_err(|e| Error::io("open", path, e))?, path, column)
}

fn object_path(path: &Path) -> datafusion::object_store::path::Path {
    remote::raw_path(&path.to_string_lossy())
}

fn strings_from<R: ChunkReader + 'static>(reader: R, path: &Path, column: &str) -> Result<Vec<Option<String>>> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(reader)?;
    let idx = builder.schema().index_of(column).map_err(|_| Error::InvalidInput(format!("no column {column} in {}", path.display())))?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), [idx]);
    let mut out = vec![];
    for batch in builder.with_projection(mask).build()? {
        let batch = batch?;
        let col = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| Error::InvalidInput(format!("column {column} of {} is not a string column", path.display())))?;
        out.extend((0..col.len()).map(|i| col.is_valid(i).then(|| col.value(i).to_string())));
    }
    Ok(out)
}

/// Reads one Parquet file of table `T`.
///
/// # Errors
/// [`Error::Parquet`] when unreadable, [`Error::Records`] when the columns do not match `T`.
pub fn read_file<T: Table>(path: &Path) -> Result<Vec<T>> {
    rows_from(File::open(path).map_err(|e| Error::io("open", path, e))?)
}

fn rows_from<T: Table, R: ChunkReader + 'static>(reader: R) -> Result<Vec<T>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(reader)?.build()?;
    let mut out = vec![];
    for batch in reader {
        let batch: RecordBatch = batch?;
        let rows: Vec<T> = serde_arrow::from_record_batch(&batch)?;
        out.extend(rows);
    }
    Ok(out)
}

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename).
///
/// # Errors
/// [`Error::Io`] on any file-system failure.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| Error::io("create folder", dir, e))?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    let mut f = File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
    f.write_all(bytes).map_err(|e| Error::io("write", &tmp, e))?;
    f.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| Error::io("rename", path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests;
