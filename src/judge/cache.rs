//! The vote cache: a judge's raw answer per (turn content, template, judge, sampling, vote index), so
//! that re-running a stage over the same data asks the judge nothing and gives identical votes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::schema::content_hash;

/// One cached raw answer; the unit the wiring persists (e.g. as a lake table) and loads back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// Cache key ([`VoteCache::key`]).
    pub key: String,
    /// The judge's raw text.
    pub raw: String,
    /// When the answer was first stored (ms since the Unix epoch).
    pub created_ms: i64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, String>,
    /// Entries inserted by this process, in order (loaded entries are not logged: they are persisted).
    log: Vec<CacheEntry>,
}

/// In-memory vote cache, shared (`Arc`) by every judge and hint judge of a process; counts hits and
/// misses. Thread-safe. Only answers that arrived are cached: a failed request is retried on the
/// next run.
#[derive(Default)]
pub struct VoteCache {
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for VoteCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VoteCache")
            .field("entries", &self.len())
            .field("hits", &self.hits())
            .field("misses", &self.misses())
            .finish()
    }
}

impl VoteCache {
    /// An empty cache.
    pub fn new() -> VoteCache {
        VoteCache::default()
    }

    /// The cache key of one vote: hash of the turn's content hash ([`super::TurnContext::content_hash`]),
    /// the template hash, the backend and judge model, the sampling parameters (as a canonical string,
    /// e.g. `temperature=0.6;max_tokens=4096`) and the 0-based vote index. 32 hex characters.
    pub fn key(turn_hash: &str, template_hash: &str, backend: &str, model: &str, sampling: &str, index: u32) -> String {
        content_hash(&[
            turn_hash.as_bytes(),
            template_hash.as_bytes(),
            backend.as_bytes(),
            model.as_bytes(),
            sampling.as_bytes(),
            &index.to_le_bytes(),
        ])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves the map consistent (single inserts).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached raw answer for `key`; counts a hit or a miss.
    pub fn get(&self, key: &str) -> Option<String> {
        let got = self.lock().map.get(key).cloned();
        match got {
            Some(_) => self.hits.fetch_add(1, Ordering::Relaxed),
            None => self.misses.fetch_add(1, Ordering::Relaxed),
        };
        got
    }

    /// Stores a raw answer. The first answer for a key wins (a later insert for the same key is
    /// ignored and returns false), so concurrent runs cannot make a cached vote change.
    pub fn insert(&self, key: &str, raw: &str) -> bool {
        let mut inner = self.lock();
        if inner.map.contains_key(key) {
            return false;
        }
        inner.map.insert(key.to_string(), raw.to_string());
        inner.log.push(CacheEntry { key: key.to_string(), raw: raw.to_string(), created_ms: crate::schema::now_ms() });
        true
    }

    /// The entries inserted since `mark` (0 = since this cache was created; loaded entries excluded)
    /// and the mark to pass next time. Use it to append new entries to a persisted table.
    pub fn entries_since(&self, mark: usize) -> (Vec<CacheEntry>, usize) {
        let inner = self.lock();
        let from = mark.min(inner.log.len());
        (inner.log[from..].to_vec(), inner.log.len())
    }

    /// Loads persisted entries (first one per key wins, existing keys are kept). They are not
    /// reported by [`VoteCache::entries_since`]. Returns how many were new.
    pub fn load(&self, entries: impl IntoIterator<Item = CacheEntry>) -> usize {
        let mut inner = self.lock();
        let mut added = 0;
        for e in entries {
            if let std::collections::hash_map::Entry::Vacant(v) = inner.map.entry(e.key) {
                v.insert(e.raw);
                added += 1;
            }
        }
        added
    }

    /// Number of cached answers.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lookups that found an answer, since creation.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Lookups that found nothing, since creation.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_depends_on_every_part() {
        let k = VoteCache::key("t", "h", "openai", "m", "temperature=0.6", 0);
        assert_eq!(k.len(), 32);
        assert_eq!(k, VoteCache::key("t", "h", "openai", "m", "temperature=0.6", 0));
        for other in [
            VoteCache::key("t2", "h", "openai", "m", "temperature=0.6", 0),
            VoteCache::key("t", "h2", "openai", "m", "temperature=0.6", 0),
            VoteCache::key("t", "h", "sglang", "m", "temperature=0.6", 0),
            VoteCache::key("t", "h", "openai", "m2", "temperature=0.6", 0),
            VoteCache::key("t", "h", "openai", "m", "temperature=0.7", 0),
            VoteCache::key("t", "h", "openai", "m", "temperature=0.6", 1),
        ] {
            assert_ne!(k, other);
        }
    }

    #[test]
    fn get_insert_counts_and_first_wins() {
        let c = VoteCache::new();
        assert_eq!(c.get("a"), None);
        assert!(c.insert("a", "x \\boxed{1}"));
        assert!(!c.insert("a", "y"));
        assert_eq!(c.get("a").as_deref(), Some("x \\boxed{1}"));
        assert_eq!((c.hits(), c.misses(), c.len()), (1, 1, 1));
    }

    #[test]
    fn entries_since_and_load_round_trip() {
        let c = VoteCache::new();
        c.insert("a", "1");
        c.insert("b", "2");
        let (first, mark) = c.entries_since(0);
        assert_eq!(first.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(mark, 2);
        c.insert("c", "3");
        let (next, mark2) = c.entries_since(mark);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].key, "c");
        assert_eq!(mark2, 3);
        assert!(c.entries_since(99).0.is_empty());

        // A fresh process loads what was persisted: hits, and nothing new to persist.
        let d = VoteCache::new();
        let mut all = first.clone();
        all.extend(next);
        all.push(CacheEntry { key: "a".into(), raw: "other".into(), created_ms: 0 });
        assert_eq!(d.load(all), 3);
        assert_eq!(d.get("a").as_deref(), Some("1"));
        assert_eq!(d.entries_since(0).0.len(), 0);
    }
}
