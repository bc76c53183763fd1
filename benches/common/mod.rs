//! Shared helpers of the `harness = false` benches: the tau-bench fixture, replication with fresh ids,
//! `key=value` arguments, timing summaries and the JSON result line that `scripts/bench_report.py`
//! turns into docs/BENCHMARKS.md.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::schema::{Interaction, Lineage, Signal};
use nextstate::signals::{SignalConfig, SignalPairer};

/// The tau-bench fixture (200 sessions, 2,454 assistant turns, 4.1 MB).
pub fn tau_bench() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json")
}

/// The fixture's interactions, or `None` when the file is absent.
pub fn fixture_rows() -> Option<Vec<Interaction>> {
    let path = tau_bench();
    if !path.is_file() {
        return None;
    }
    let opts = IngestOptions::new(1_772_323_200_000);
    let mut rows = Vec::with_capacity(2454);
    read_file(&path, Format::TauBench, &opts, &mut |_| {}, &mut |item| {
        if let IngestItem::Interaction(i) = item {
            rows.push(*i);
        }
        Ok(())
    })
    .expect("read tau-bench");
    Some(rows)
}

/// Pairs the fixture's turns with their next states (one signal per turn, input order).
pub fn signals_of(rows: &[Interaction]) -> Vec<Signal> {
    let mut p = SignalPairer::with_clock(SignalConfig::default(), Box::new(|| 0));
    let mut out = vec![];
    for (i, r) in rows.iter().enumerate() {
        out.extend(p.push(r.clone(), Lineage { source_partition: Some(0), source_offset: Some(i as i64), ..Lineage::default() }));
    }
    out.extend(p.finish());
    out
}

/// Copy `k` of `row` with fresh interaction and session ids (`<id>~r<k>`): a distinct turn of a
/// distinct session with the same content.
pub fn replica(row: &Interaction, k: usize) -> Interaction {
    let mut r = row.clone();
    r.interaction_id = format!("{}~r{k}", row.interaction_id);
    r.session_id = format!("{}~r{k}", row.session_id);
    r
}

/// `key=value` from the command line (cargo bench passes its own flags too; they are ignored), else
/// the environment variable `NEXTSTATE_BENCH_<KEY>`, else `default`.
pub fn arg(key: &str, default: &str) -> String {
    let prefix = format!("{key}=");
    std::env::args()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_string))
        .or_else(|| std::env::var(format!("NEXTSTATE_BENCH_{}", key.to_uppercase())).ok())
        .unwrap_or_else(|| default.to_string())
}

/// Percentile (nearest rank) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Milliseconds of a duration.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Prints one result line: `BENCH {"bench": ..., ...}` (what the report generator collects).
pub fn emit(value: serde_json::Value) {
    println!("BENCH {value}");
}

/// Total size in bytes of the files under `dir` (recursive).
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                total += dir_bytes(&p);
            } else if let Ok(m) = e.metadata() {
                total += m.len();
            }
        }
    }
    total
}
