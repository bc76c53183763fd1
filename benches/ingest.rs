//! Ingest and pairing throughput on the tau-bench file (200 sessions, 2,454 assistant turns, 4.1 MB):
//! `ingest` reports MB/s of log read, `pair` and `ingest+pair` report turns/s.
//!
//! The group `formats-2026` reads each file of `tests/fixtures/agent-logs-2026/` (one real sample or
//! one documented variant per format, 2–16 KB each) in its own format and reports MB/s; these are
//! per-file figures (open, read, detect nothing, emit) on small files, not steady-state throughput.
//! Beside each, `<format> / peer` reads the same file and parses it into `serde_json::Value`s (per
//! line for JSONL, whole for JSON) and does nothing else: the floor any JSON-based reader pays, so
//! the gap between the two is what the adapter itself costs.
//!
//! Run: `cargo bench --bench ingest` (release). The tau-bench file is read from
//! `../shared/data/agent-logs/`; that group is skipped when it is absent.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::schema::{Interaction, Lineage};
use nextstate::signals::{SignalConfig, SignalPairer};

fn tau_bench() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json")
}

fn ingest(path: &std::path::Path) -> Vec<Interaction> {
    ingest_as(path, Format::TauBench)
}

fn ingest_as(path: &std::path::Path, format: Format) -> Vec<Interaction> {
    let opts = IngestOptions::new(1_772_323_200_000);
    let mut rows = Vec::with_capacity(2454);
    read_file(path, format, &opts, &mut |_| {}, &mut |item| {
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

/// The peer of an adapter: read the file and parse its JSON (per line for `.jsonl`), keeping nothing.
fn parse_only(path: &std::path::Path) -> usize {
    let bytes = std::fs::read(path).expect("fixture");
    if path.extension().is_some_and(|e| e == "jsonl") {
        bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()).filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok()).count()
    } else {
        serde_json::from_slice::<serde_json::Value>(&bytes).map(|_| 1).unwrap_or(0)
    }
}

fn formats_2026(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-logs-2026");
    let files = [
        ("openclaw-session", "openclaw__session-v3__f967d602.jsonl", Format::OpenClawSession),
        ("claude-code", "claude-code__v2.1.38__short.jsonl", Format::ClaudeCode),
        ("codex", "synthetic__codex__rollout.jsonl", Format::Codex),
        ("openai-responses", "synthetic__openai-responses.jsonl", Format::OpenAiResponses),
        ("anthropic-messages", "synthetic__anthropic-messages.jsonl", Format::AnthropicMessages),
        ("otel (SDK spans)", "otel-genai-spans__any-agent__OPENAI_trace.json", Format::Otel),
        ("otel (OTLP/JSON)", "synthetic__otel__otlp.json", Format::Otel),
        ("langsmith", "langsmith__run-ingest-post-patch__wrap_openai_reasoning.json", Format::LangSmith),
        ("openhands-v1", "openhands-sdk-v1__events__goal-fixture.jsonl", Format::OpenHandsV1),
        ("otel (indexed attributes)", "synthetic__otel__indexed.json", Format::Otel),
    ];
    let mut g = c.benchmark_group("formats-2026");
    for (name, file, format) in files {
        let path = dir.join(file);
        let bytes = std::fs::metadata(&path).expect("fixture").len();
        assert!(!ingest_as(&path, format).is_empty(), "{file} gives no interaction");
        g.throughput(Throughput::Bytes(bytes));
        g.bench_function(name, |b| b.iter(|| ingest_as(&path, format).len()));
        g.bench_function(format!("{name} / peer"), |b| b.iter(|| parse_only(&path)));
    }
    g.finish();
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

criterion_group!(benches, bench, formats_2026);
criterion_main!(benches);
