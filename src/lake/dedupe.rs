//! The lake sink's de-duplication state, bounded by a window of offsets instead of the whole table.
//!
//! Why keys are checked at all: an upstream stage is at-least-once. After its own crash it re-processes
//! the input it had not committed and re-emits those rows (same keys) at new offsets of its output
//! topic. The producer keys records by session ([`crate::bus::BusProducer::send`]), so a re-emitted row
//! lands in the same partition as its first copy, a bounded number of records later: at most what the
//! upstream produced since its last commit. The sink therefore only needs the keys of the newest
//! `window` records of each partition it owns ([`RecentKeys`]), not every key of the table.
//!
//! What is held, per partition of the sink's own topic on its own cluster: the keys of the lake files
//! whose last offset is within `window` of the partition's next offset, plus the rows buffered but not
//! yet written. Rows that came another way (files of other clusters, e.g. an earlier embedded run, and
//! directly written files) are covered by the keys of the newest `window` such rows (by file
//! modification time). Memory: about `(partitions owned + 1) × window` keys; a key older than that is
//! not checked (documented in the `[sink] dedupe_window` setting).

use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

use super::{FileOrigin, Lake};
use crate::error::Result;

/// Keys seen recently, per partition (see the module documentation).
#[derive(Debug, Default)]
pub struct RecentKeys {
    window: u64,
    /// Per partition: key → the offset it was read at (the last offset of its file when read back from
    /// the lake; the record's own offset when buffered by this sink).
    parts: HashMap<i32, HashMap<String, i64>>,
    /// Keys of the newest `window` rows that did not come from this sink's topic on this cluster.
    other: HashSet<String>,
}

impl RecentKeys {
    /// Loads the keys of table `table`'s key column `key_column` that can still be re-sent: for each
    /// partition of `topic` on cluster `source` (all of them when `partitions` is `None`), the files
    /// whose last offset is at least `next − window`; plus the newest `window` rows of the other files.
    ///
    /// # Errors
    /// [`crate::Error::Io`]/[`crate::Error::Parquet`] when a file cannot be listed or read.
    pub fn load(lake: &Lake, table: &str, key_column: &str, source: &str, topic: &str, window: u64, partitions: Option<&HashSet<i32>>) -> Result<RecentKeys> {
        let files = lake.files(table)?;
        let mut next: HashMap<i32, i64> = HashMap::new();
        let mut other = vec![];
        let mut own = vec![];
        for f in files {
            match &f.origin {
                FileOrigin::Kafka { source: s, topic: t, partition, last, .. } if s == source && t == topic => {
                    let n = next.entry(*partition).or_insert(0);
                    *n = (*n).max(last + 1);
                    own.push((*partition, *last, f.path));
                }
                _ => other.push((f.modified, f.path)),
            }
        }
        let mut out = RecentKeys { window, ..Default::default() };
        for (partition, last, path) in own {
            if partitions.is_some_and(|ps| !ps.contains(&partition)) || last < next[&partition] - window as i64 {
                continue;
            }
            let keys = out.parts.entry(partition).or_default();
            for k in lake.file_strings(&path, key_column)?.into_iter().flatten() {
                keys.insert(k, last);
            }
        }
        // Newest first by modification time, until `window` keys are held.
        other.sort_by(|a: &(SystemTime, std::path::PathBuf), b| b.cmp(a));
        for (_, path) in other {
            if out.other.len() as u64 >= window {
                break;
            }
            out.other.extend(lake.file_strings(&path, key_column)?.into_iter().flatten());
        }
        Ok(out)
    }

    /// Whether `key` was seen in `partition` (or outside the sink's topic).
    pub fn contains(&self, partition: i32, key: &str) -> bool {
        self.other.contains(key) || self.parts.get(&partition).is_some_and(|m| m.contains_key(key))
    }

    /// Records `key`, read at `offset` of `partition`; forgets the keys of `partition` older than
    /// `offset − window` once they are a quarter of the window over (amortised O(1) per key).
    pub fn insert(&mut self, partition: i32, key: &str, offset: i64) {
        let keys = self.parts.entry(partition).or_default();
        keys.insert(key.to_string(), offset);
        if keys.len() as u64 > self.window + self.window / 4 {
            let cutoff = offset - self.window as i64;
            keys.retain(|_, o| *o >= cutoff);
        }
    }

    /// Forgets every key of `partition` (it was revoked: its new owner holds them).
    pub fn forget(&mut self, partition: i32) {
        self.parts.remove(&partition);
    }

    /// Number of keys held (all partitions and the other files').
    pub fn len(&self) -> usize {
        self.other.len() + self.parts.values().map(HashMap::len).sum::<usize>()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lake::kafka_stem;
    use crate::schema::{DeadLetter, Lineage, Table};

    fn dl(i: i64) -> DeadLetter {
        DeadLetter::new("test", "x", format!("reason {i}"), format!("payload {i}").as_bytes(), Lineage { source_line: Some(i), ..Default::default() })
    }

    /// Writes rows `ids` as the sink's file of offsets `first..` of partition `p`; returns their keys.
    fn write(lake: &Lake, source: &str, p: i32, first: i64, ids: std::ops::Range<i64>) -> Vec<String> {
        let rows: Vec<DeadLetter> = ids.map(dl).collect();
        let refs: Vec<&DeadLetter> = rows.iter().collect();
        let last = first + rows.len() as i64 - 1;
        lake.write_file::<DeadLetter>("2026-12-03", &kafka_stem(source, "t", p, first, last), &refs).unwrap();
        rows.iter().map(|r| r.key().to_string()).collect()
    }

    #[test]
    fn holds_only_the_window_of_each_partition() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        // partition 0: offsets 0..=9, 10..=19, 20..=29; partition 1: 0..=9
        let a = write(&lake, "c1", 0, 0, 0..10);
        let b = write(&lake, "c1", 0, 10, 10..20);
        let c = write(&lake, "c1", 0, 20, 20..30);
        let d = write(&lake, "c1", 1, 0, 30..40);
        // another cluster's file and a direct file: "other" keys
        let e = write(&lake, "c2", 0, 0, 40..45);
        lake.write_rows(&(45..48).map(dl).collect::<Vec<_>>(), "w", 1).unwrap();
        // window 15: partition 0's next offset is 30, so files with last >= 15 (b and c) are held
        let keys = RecentKeys::load(&lake, DeadLetter::NAME, DeadLetter::KEY, "c1", "t", 15, None).unwrap();
        assert!(a.iter().all(|k| !keys.contains(0, k)), "file a (last offset 9 < 30 - 15) is outside the window");
        assert!(b.iter().chain(&c).all(|k| keys.contains(0, k)));
        assert!(d.iter().all(|k| keys.contains(1, k) && !keys.contains(0, k)), "keys are per partition");
        assert!(e.iter().all(|k| keys.contains(0, k) && keys.contains(7, k)), "other files' keys hold for every partition");
        assert_eq!(keys.len(), 10 + 10 + 10 + 5 + 3);
        // only partition 1 assigned
        let keys = RecentKeys::load(&lake, DeadLetter::NAME, DeadLetter::KEY, "c1", "t", 15, Some(&HashSet::from([1]))).unwrap();
        assert!(c.iter().all(|k| !keys.contains(0, k)) && d.iter().all(|k| keys.contains(1, k)));
        assert_eq!(keys.len(), 10 + 8);
    }

    #[test]
    fn other_files_are_held_newest_first_up_to_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let old = write(&lake, "old-run", 0, 0, 0..10);
        let t = SystemTime::now() - std::time::Duration::from_secs(3600);
        for f in lake.files(DeadLetter::NAME).unwrap() {
            std::fs::File::options().write(true).open(&f.path).unwrap().set_modified(t).unwrap();
        }
        let new = write(&lake, "newer-run", 0, 0, 10..20);
        let keys = RecentKeys::load(&lake, DeadLetter::NAME, DeadLetter::KEY, "c1", "t", 10, None).unwrap();
        assert!(new.iter().all(|k| keys.contains(0, k)) && old.iter().all(|k| !keys.contains(0, k)));
    }

    #[test]
    fn insert_forgets_keys_older_than_the_window() {
        let mut keys = RecentKeys { window: 8, ..Default::default() };
        for o in 0..=10 {
            keys.insert(2, &format!("k{o}"), o);
        }
        // at offset 10 the partition holds 11 > 8 + 8/4 keys: those read below 10 - 8 = 2 are forgotten
        assert!(!keys.contains(2, "k1") && keys.contains(2, "k2") && keys.contains(2, "k10"));
        assert_eq!(keys.len(), 9);
        keys.forget(2);
        assert!(keys.is_empty());
    }
}
