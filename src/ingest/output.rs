//! What the ingest adapters hand out: [`IngestItem`]s, and the [`FileSummary`] of one file read.

use std::collections::BTreeMap;

use serde::Serialize;

use super::format::Format;
use crate::schema::{DeadLetter, Interaction};

/// One adapter output.
#[derive(Debug, Clone, PartialEq)]
pub enum IngestItem {
    /// An assistant turn.
    Interaction(Box<Interaction>),
    /// A record that could not be used (stage `ingest`).
    DeadLetter(Box<DeadLetter>),
}

/// What reading one file did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileSummary {
    /// The format read.
    pub format: Format,
    /// How the format was chosen (`--format auto`), if it was detected.
    pub detection: Option<String>,
    /// Bytes read.
    pub bytes: u64,
    /// Records read: lines (JSONL), array elements, or 1 for a single document.
    pub records: u64,
    /// Distinct sessions among the interactions (the ids are kept while the file is read).
    pub sessions: u64,
    /// Interactions emitted.
    pub interactions: u64,
    /// Dead letters emitted.
    pub dead_letters: u64,
    /// Dead letters by reason code.
    pub dead_letters_by_reason: BTreeMap<String, u64>,
    /// Named counts of what the adapter noticed or skipped without it being an error (blank lines,
    /// null observations, environment events, `state` as string/object, ...).
    pub counters: BTreeMap<String, u64>,
}

impl FileSummary {
    /// One-line summary with units.
    pub fn line(&self) -> String {
        format!(
            "{}: {} records, {} bytes → {} interactions in {} sessions, {} dead letters",
            self.format, self.records, self.bytes, self.interactions, self.sessions, self.dead_letters
        )
    }
}
