//! Which files of a table folder are live: the rule that lets `nextstate compact` replace small files
//! with a large one while writers and readers go on (see [`super::compact`]).
//!
//! A file's name says what it holds: a Kafka range (`k~<source>~<topic>~p<partition>~<first>-<last>`)
//! or a writer's sequence numbers (`w~<writer>~<seq>` or, once merged, `w~<writer>~<first>-<last>`).
//! In one `date=` folder, a file whose range lies inside another file's larger range of the same
//! source, topic and partition (or of the same writer) is **covered**: the larger file holds its rows,
//! so every reader skips it. Compaction writes the merged file (atomically, under its range's name)
//! and deletes the covered files only after a retention time. A reader that lists the folder at any
//! moment therefore sees either the small files (merged file not yet renamed into place) or the merged
//! file (and the small ones covered): never both, never neither. A reader that listed before a covered
//! file was deleted can still open it for the retention time.
//!
//! [`LiveFiles`] applies the rule to DataFusion's listings, so `nextstate sql` follows it too. On the
//! local file system it also serves small ranged reads inline ([`INLINE_READ_BYTES`]).

use std::collections::HashMap;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use datafusion::object_store::local::LocalFileSystem;
use datafusion::object_store::path::Path as ObjectPath;
use datafusion::object_store::{
    Attributes, CopyOptions, GetOptions, GetRange, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result as StoreResult,
};

use super::file_names::{parse_stem, FileOrigin};

/// The group a file's range is compared within (one `date=` folder is implied): one Kafka partition
/// of one topic on one cluster, or one direct writer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Lane<'a> {
    Kafka(&'a str, &'a str, i32),
    Direct(&'a str),
}

/// A file's lane and the first and last offset (or sequence number) it holds.
pub(crate) fn lane_and_range(o: &FileOrigin) -> (Lane<'_>, i64, i64) {
    match o {
        FileOrigin::Kafka { source, topic, partition, first, last } => (Lane::Kafka(source, topic, *partition), *first, *last),
        FileOrigin::Direct { writer, seq, last_seq } => (Lane::Direct(writer), *seq as i64, *last_seq as i64),
    }
}

/// For each of `origins` (the lake files of one `date=` folder), the index of a file whose range
/// strictly contains its range (the file is covered), or `None` (the file is live).
pub fn covering(origins: &[&FileOrigin]) -> Vec<Option<usize>> {
    let mut lanes: HashMap<Lane, Vec<usize>> = HashMap::new();
    for (i, o) in origins.iter().enumerate() {
        lanes.entry(lane_and_range(o).0).or_default().push(i);
    }
    let mut out = vec![None; origins.len()];
    for idx in lanes.values_mut() {
        // widest first among equal starts, so a covering file precedes the files it covers
        idx.sort_by_key(|&i| {
            let (_, a, b) = lane_and_range(origins[i]);
            (a, std::cmp::Reverse(b))
        });
        let mut widest: Option<(usize, i64)> = None;
        for &i in idx.iter() {
            let (_, _, last) = lane_and_range(origins[i]);
            match widest {
                Some((w, w_last)) if last <= w_last => out[i] = Some(w),
                _ => widest = Some((i, last)),
            }
        }
    }
    out
}

/// The live files among `names` (file names of one `date=` folder): the names the lake does not write
/// are kept (they are strays, see [`super::StrayReason`]), covered lake files are dropped.
fn live_names<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let parsed: Vec<(usize, FileOrigin)> =
        names.iter().enumerate().filter_map(|(i, n)| n.strip_suffix(".parquet").and_then(parse_stem).map(|o| (i, o))).collect();
    let refs: Vec<&FileOrigin> = parsed.iter().map(|(_, o)| o).collect();
    let mut keep = vec![true; names.len()];
    for ((i, _), cover) in parsed.iter().zip(covering(&refs)) {
        keep[*i] = cover.is_none();
    }
    names.iter().zip(keep).filter(|(_, k)| *k).map(|(n, _)| *n).collect()
}

/// Drops the covered lake files from a listing (grouped by folder).
fn filter_listing(metas: Vec<ObjectMeta>) -> Vec<ObjectMeta> {
    let mut by_dir: HashMap<String, Vec<usize>> = HashMap::new();
    for (i, m) in metas.iter().enumerate() {
        let s = m.location.as_ref();
        let dir = s.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
        by_dir.entry(dir.to_string()).or_default().push(i);
    }
    let mut keep = vec![false; metas.len()];
    for idx in by_dir.values() {
        let names: Vec<&str> = idx.iter().map(|&i| metas[i].location.filename().unwrap_or("")).collect();
        let live = live_names(&names);
        for (&i, n) in idx.iter().zip(&names) {
            keep[i] = live.contains(n);
        }
    }
    metas.into_iter().zip(keep).filter(|(_, k)| *k).map(|(m, _)| m).collect()
}

/// Largest ranged read, in bytes (all ranges of one call together), that [`LiveFiles::local`] serves
/// inline on the calling task instead of on tokio's blocking pool.
///
/// A query over a lake of small files makes two small reads per file (the footer, then the projected
/// column chunks); on the blocking pool each costs a thread hand-off, an `open` and a `stat` twice
/// (`get_range` is `get_opts` and then a read of the returned file). Inline, a read of this size is a
/// copy from the page cache of at most about 0.1–0.2 ms, the order of the decoding work DataFusion runs
/// on the same threads. Measured on the 408-file lake of `docs/BENCHMARKS.md` §3 (alternating runs
/// with DuckDB): the group-by went from 1.18× DuckDB's time to 0.87×. Larger reads (column chunks of compacted files) and every read that carries a
/// condition, a version or `head` go to `LocalFileSystem` as before.
pub const INLINE_READ_BYTES: u64 = 1 << 20;

/// An object store that lists only live files ([`covering`]), delegating everything else to `inner`
/// (on the local file system, small reads are served inline: [`INLINE_READ_BYTES`]): registered for
/// `file://` (and the lake's remote store) in `nextstate sql`'s DataFusion session.
#[derive(Debug)]
pub struct LiveFiles {
    inner: Arc<dyn ObjectStore>,
    /// Set when `inner` is the local file system.
    local: Option<Arc<LocalFileSystem>>,
}

impl LiveFiles {
    /// Wraps `inner` (a remote store).
    pub fn new(inner: Arc<dyn ObjectStore>) -> LiveFiles {
        LiveFiles { inner, local: None }
    }

    /// The local file system, with small ranged reads served inline ([`INLINE_READ_BYTES`]).
    pub fn local() -> LiveFiles {
        let fs = Arc::new(LocalFileSystem::new());
        LiveFiles { inner: fs.clone(), local: Some(fs) }
    }

    /// Reads `ranges(size)` of a local file inline, with the file's metadata and each range, when the store is local
    /// and the ranges fit in [`INLINE_READ_BYTES`]. `None` (the caller delegates to `inner`, which
    /// also gives `LocalFileSystem`'s own errors) when the store is remote, the ranges are not valid
    /// for the file, they are too large, or any step fails.
    fn read_inline(&self, location: &ObjectPath, ranges: impl FnOnce(u64) -> Option<Vec<Range<u64>>>) -> Option<(std::fs::Metadata, Vec<(Range<u64>, Bytes)>)> {
        let path = self.local.as_ref()?.path_to_filesystem(location).ok()?;
        let file = std::fs::File::open(path).ok()?;
        let meta = file.metadata().ok().filter(|m| m.is_file())?;
        let ranges = ranges(meta.len())?;
        let total: u64 = ranges.iter().map(|r| r.end.saturating_sub(r.start)).sum();
        if total > INLINE_READ_BYTES || ranges.iter().any(|r| r.start > r.end || r.end > meta.len()) {
            return None;
        }
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let mut buf = vec![0; (r.end - r.start) as usize];
            file.read_exact_at(&mut buf, r.start).ok()?;
            out.push((r, Bytes::from(buf)));
        }
        Some((meta, out))
    }
}

/// The range of a plain ranged read (no condition, version or `head`): the only reads served inline.
fn plain_range(o: &GetOptions) -> Option<&GetRange> {
    let plain = o.if_match.is_none() && o.if_none_match.is_none() && o.if_modified_since.is_none() && o.if_unmodified_since.is_none()
        && o.version.is_none() && !o.head;
    o.range.as_ref().filter(|_| plain)
}

impl std::fmt::Display for LiveFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LiveFiles({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for LiveFiles {
    async fn put_opts(&self, location: &ObjectPath, payload: PutPayload, opts: PutOptions) -> StoreResult<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(&self, location: &ObjectPath, opts: PutMultipartOptions) -> StoreResult<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &ObjectPath, options: GetOptions) -> StoreResult<GetResult> {
        if let Some(range) = plain_range(&options) {
            if let Some((meta, mut read)) = self.read_inline(location, |size| Some(vec![range.as_range(size).ok()?])) {
                let (range, data) = read.pop().unwrap_or_default();
                let meta = ObjectMeta {
                    location: location.clone(),
                    last_modified: meta.modified().map(Into::into).unwrap_or_default(),
                    size: meta.len(),
                    // Not the local store's `inode-mtime-size` tag: nothing reads a ranged get's tag.
                    e_tag: None,
                    version: None,
                };
                return Ok(GetResult { payload: GetResultPayload::Stream(stream::once(async move { Ok(data) }).boxed()), meta, range, attributes: Attributes::default() });
            }
        }
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &ObjectPath, ranges: &[Range<u64>]) -> StoreResult<Vec<Bytes>> {
        match self.read_inline(location, |_| Some(ranges.to_vec())) {
            Some((_, read)) => Ok(read.into_iter().map(|(_, b)| b).collect()),
            None => self.inner.get_ranges(location, ranges).await,
        }
    }

    fn delete_stream(&self, locations: BoxStream<'static, StoreResult<ObjectPath>>) -> BoxStream<'static, StoreResult<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    /// Lists everything under `prefix` first (one folder's files must be seen together to apply the
    /// rule), then yields the live ones.
    fn list(&self, prefix: Option<&ObjectPath>) -> BoxStream<'static, StoreResult<ObjectMeta>> {
        let all = self.inner.list(prefix);
        stream::once(async move { all.try_collect::<Vec<ObjectMeta>>().await })
            .map_ok(|metas| stream::iter(filter_listing(metas).into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&ObjectPath>) -> StoreResult<ListResult> {
        let r = self.inner.list_with_delimiter(prefix).await?;
        Ok(ListResult { common_prefixes: r.common_prefixes, objects: filter_listing(r.objects) })
    }

    async fn copy_opts(&self, from: &ObjectPath, to: &ObjectPath, options: CopyOptions) -> StoreResult<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &ObjectPath, to: &ObjectPath, options: RenameOptions) -> StoreResult<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(first: i64, last: i64, p: i32) -> String {
        format!("{}.parquet", super::super::kafka_stem("c", "t", p, first, last))
    }

    #[test]
    fn a_merged_range_covers_the_files_inside_it_only() {
        let names = [k(0, 9, 0), k(10, 19, 0), k(20, 29, 0), k(0, 19, 0), k(0, 9, 1), "w~a~000001.parquet".into(), "w~a~000002.parquet".into()];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        // 0-19 covers 0-9 and 10-19 of partition 0; 20-29 and partition 1's 0-9 stay
        assert_eq!(live_names(&names), vec![names[2], names[3], names[4], names[5], names[6]]);
        let mut with_merged_writer = names.clone();
        with_merged_writer.push("w~a~000001-000002.parquet");
        assert_eq!(live_names(&with_merged_writer), vec![names[2], names[3], names[4], "w~a~000001-000002.parquet"]);
    }

    #[test]
    fn strays_and_partial_overlaps_stay_visible() {
        let names = [k(0, 9, 0), k(5, 14, 0), "mine.parquet".into()];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_eq!(live_names(&names), names, "a partial overlap is not a cover (compact refuses to make one)");
    }

    /// Inline reads return exactly what `LocalFileSystem` returns, and every read it does not serve
    /// (too large, out of range, conditional, `head`, missing file) gets `LocalFileSystem`'s answer.
    #[tokio::test]
    async fn inline_reads_match_the_local_store_and_the_rest_is_delegated() {
        use datafusion::object_store::ObjectStoreExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let size = INLINE_READ_BYTES as usize + 1000;
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.path().join("f.parquet"), &data).expect("write");
        let path = ObjectPath::from_filesystem_path(dir.path().join("f.parquet")).expect("path");
        let live = LiveFiles::local();
        let plain = LocalFileSystem::new();

        // small reads: served inline (the same bytes, the resolved range and the object's size)
        assert_eq!(live.get_range(&path, 3..40).await.expect("range"), &data[3..40]);
        let g = live.get_opts(&path, GetOptions { range: Some(GetRange::Suffix(16)), ..Default::default() }).await.expect("suffix");
        assert_eq!((g.range.clone(), g.meta.size), ((size - 16) as u64..size as u64, size as u64));
        assert_eq!(g.bytes().await.expect("bytes"), &data[size - 16..]);
        let ranges = [0..10, 100..4096, (size - 8) as u64..size as u64];
        let got = live.get_ranges(&path, &ranges).await.expect("ranges");
        assert_eq!(got, plain.get_ranges(&path, &ranges).await.expect("ranges"));
        assert!(live.read_inline(&path, |_| Some(ranges.to_vec())).is_some(), "small reads are inline");

        // too large together: delegated, same bytes
        let big = [0..INLINE_READ_BYTES, INLINE_READ_BYTES..size as u64];
        assert!(live.read_inline(&path, |_| Some(big.to_vec())).is_none());
        assert_eq!(live.get_ranges(&path, &big).await.expect("big"), vec![Bytes::from(data[..INLINE_READ_BYTES as usize].to_vec()), Bytes::from(data[INLINE_READ_BYTES as usize..].to_vec())]);
        assert_eq!(live.get(&path).await.expect("whole").bytes().await.expect("bytes"), &data[..]);

        // errors are the local store's: a range past the end, a missing file
        let past = (size + 10) as u64..(size + 20) as u64;
        assert_eq!(live.get_range(&path, past.clone()).await.map_err(|e| e.to_string()), plain.get_range(&path, past).await.map_err(|e| e.to_string()));
        let missing = ObjectPath::from_filesystem_path(dir.path()).expect("dir").join("missing.parquet");
        assert!(matches!(live.get_range(&missing, 0..4).await, Err(datafusion::object_store::Error::NotFound { .. })));

        // conditional and head reads carry the local store's tag
        let head = live.head(&path).await.expect("head");
        assert_eq!(head.e_tag, plain.head(&path).await.expect("head").e_tag);
        let cond = GetOptions { range: Some(GetRange::Bounded(0..4)), if_match: Some("not-the-tag".into()), ..Default::default() };
        assert!(matches!(live.get_opts(&path, cond).await, Err(datafusion::object_store::Error::Precondition { .. })));
    }
}
