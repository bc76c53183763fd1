//! Persistence of the vote cache (judge and hint votes) in the lake: `DIR/_state/vote_cache/*.jsonl`,
//! one file per flush, written atomically. Loaded whole at stage start, so a replay over the same data
//! with the same judge configuration reuses every cached vote.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::judge::{CacheEntry, VoteCache};
use crate::lake::{write_atomic, Lake};

/// Where a cache is persisted, and how far it has been.
pub struct CacheStore {
    dir: PathBuf,
    writer: String,
    seq: u64,
    mark: usize,
}

impl CacheStore {
    /// Opens the store and loads every persisted entry into `cache`. Returns the store and the number
    /// of entries loaded.
    ///
    /// # Errors
    /// [`Error::Io`] when the folder cannot be read, [`Error::Json`] on a corrupt line (the file is named).
    pub fn open(lake: &Lake, cache: &VoteCache) -> Result<(CacheStore, usize)> {
        let dir = lake.state_dir("vote_cache")?;
        let mut entries = vec![];
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| Error::io("list", &dir, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).map_err(|e| Error::io("read", &f, e))?;
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let e: CacheEntry = serde_json::from_str(line)
                    .map_err(|e| Error::InvalidInput(format!("{} line {}: {e}", f.display(), i + 1)))?;
                entries.push(e);
            }
        }
        let n = cache.load(entries);
        let mark = cache.entries_since(0).1;
        Ok((CacheStore { dir, writer: uuid::Uuid::new_v4().simple().to_string(), seq: 0, mark }, n))
    }

    /// Writes the entries `cache` gained since the last flush. Returns how many.
    ///
    /// # Errors
    /// [`Error::Io`] on write failure.
    pub fn flush(&mut self, cache: &VoteCache) -> Result<usize> {
        let (entries, next) = cache.entries_since(self.mark);
        if entries.is_empty() {
            return Ok(0);
        }
        let mut buf = String::new();
        for e in &entries {
            buf.push_str(&serde_json::to_string(e)?);
            buf.push('\n');
        }
        self.seq += 1;
        let path = self.dir.join(format!("{}-{:06}.jsonl", self.writer, self.seq));
        write_atomic(&path, buf.as_bytes())?;
        self.mark = next;
        Ok(entries.len())
    }
}
