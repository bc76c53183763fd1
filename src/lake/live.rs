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
//! [`LiveFiles`] applies the rule to DataFusion's listings, so `nextstate sql` follows it too.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use datafusion::object_store::path::Path as ObjectPath;
use datafusion::object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
    Result as StoreResult,
};

use super::{parse_stem, FileOrigin};

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

/// An object store that lists only live files ([`covering`]), delegating everything else to `inner`:
/// registered for `file://` in `nextstate sql`'s DataFusion session.
#[derive(Debug)]
pub struct LiveFiles {
    inner: Arc<dyn ObjectStore>,
}

impl LiveFiles {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> LiveFiles {
        LiveFiles { inner }
    }
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
        self.inner.get_opts(location, options).await
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
}
