//! Helpers shared by the ingest/pairing integration tests.

use std::path::{Path, PathBuf};

use nextstate::ingest::{read_file, FileSummary, Format, IngestItem, IngestOptions};
use nextstate::schema::{DeadLetter, Interaction, Lineage, Message, Signal};
use nextstate::signals::{SignalConfig, SignalPairer};

/// Fixed ingest time used by every test (2026-03-01T00:00:00Z).
pub const INGEST_MS: i64 = 1_772_323_200_000;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-logs").join(name)
}

/// The big tau-bench file, read from the shared data folder next to the repository (`../shared`, as in
/// CI). `None`, with a SKIPPED line, in a clone that has no such folder beside it (a failure under CI).
pub fn tau_bench() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json");
    if p.is_file() {
        Some(p)
    } else {
        super::test_env::missing(&format!("{} not found (the real tau-bench log lives in ../shared/data beside the repository)", p.display()));
        None
    }
}

pub struct Ingested {
    pub rows: Vec<Interaction>,
    pub dead: Vec<DeadLetter>,
    pub summary: FileSummary,
}

pub fn ingest(path: &Path, format: Format) -> Ingested {
    let opts = IngestOptions::new(INGEST_MS);
    let mut rows = vec![];
    let mut dead = vec![];
    let mut last_progress = 0u64;
    let summary = read_file(path, format, &opts, &mut |b| last_progress = b, &mut |item| {
        match item {
            IngestItem::Interaction(i) => rows.push(*i),
            IngestItem::DeadLetter(d) => dead.push(*d),
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(last_progress <= summary.bytes);
    Ingested { rows, dead, summary }
}

pub fn messages(json: &str) -> Vec<Message> {
    serde_json::from_str(json).expect("messages JSON")
}

/// Pushes all rows (in the given order) into a fresh pairer with a fixed clock, then closes every
/// session; returns all signals.
pub fn pair_all(rows: impl IntoIterator<Item = Interaction>) -> (Vec<Signal>, nextstate::signals::SignalCounters) {
    let mut p = SignalPairer::with_clock(SignalConfig::default(), Box::new(|| INGEST_MS + 1));
    let mut out = vec![];
    for (i, r) in rows.into_iter().enumerate() {
        let lin = Lineage { source_topic: Some("interactions".into()), source_partition: Some(0), source_offset: Some(i as i64), ..Lineage::default() };
        out.extend(p.push(r, lin));
    }
    out.extend(p.finish());
    (out, p.counters().clone())
}
