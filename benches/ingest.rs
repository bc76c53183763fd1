//! Ingest and pairing throughput on the tau-bench file (200 sessions, 2,454 assistant turns, 4.1 MB):
//! `ingest` reports MB/s of log read, `pair` and `ingest+pair` report turns/s.
//!
//! Run: `cargo bench --bench ingest` (release). The file is read from `../shared/data/agent-logs/`;
//! the bench is skipped when it is absent.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::schema::{Interaction, Lineage};
use nextstate::signals::{SignalConfig, SignalPairer};

fn tau_bench() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json")
}

fn ingest(path: &std::path::Path) -> Vec<Interaction> {
    let opts = IngestOptions::new(1_772_323_200_000);
    let mut rows = Vec::with_capacity(2454);
    read_file(path, Format::TauBench, &opts, &mut |_| {}, &mut |item| {
        if let IngestItem::Interaction(i) = item {
            rows.push(*i);
        }
        Ok(())
    })
    .expect("read tau-bench");
    rows
}

fn pair(rows: Vec<Interaction>) -> usize {
    let mut p = SignalPairer::with_clock(SignalConfig::default(), Box::new(|| 0));
    let mut n = 0;
    for (i, r) in rows.into_iter().enumerate() {
        n += p.push(r, Lineage { source_partition: Some(0), source_offset: Some(i as i64), ..Lineage::default() }).len();
    }
    n + p.finish().len()
}

fn bench(c: &mut Criterion) {
    let path = tau_bench();
    let Ok(meta) = std::fs::metadata(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return;
    };
    let rows = ingest(&path);
    let turns = rows.len() as u64;
    assert_eq!(pair(rows.clone()), rows.len());

    let mut g = c.benchmark_group("tau-bench");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(meta.len()));
    g.bench_function("ingest", |b| b.iter(|| ingest(&path).len()));
    g.throughput(Throughput::Elements(turns));
    g.bench_function("pair", |b| b.iter_batched(|| rows.clone(), pair, BatchSize::LargeInput));
    g.bench_function("ingest+pair", |b| b.iter(|| pair(ingest(&path))));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
