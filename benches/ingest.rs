//! Ingest and pairing throughput on the tau-bench file (200 sessions, 2,454 assistant turns, 4.1 MB):
//! `ingest` reports MB/s of log read, `pair` and `ingest+pair` report turns/s.
//!
//! The group `formats-2026` reads a file of `tests/fixtures/agent-logs-2026/` per format (one real
//! sample or one documented variant, 1–161 KB each; an OpenCode session folder; the `messages` fallback
//! on a generated array) in its own format and reports MB/s; these are per-file figures (open, read,
//! detect nothing, emit) on small files, not steady-state throughput. Beside each, `<format> / peer`
//! reads the same input and parses it ([`parse_only`]: JSON per line for JSONL, whole for JSON, lines
//! for the text formats) and does nothing else: the floor any reader pays, so the gap between the two
//! is what the adapter itself costs.
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

/// The peer of an adapter: read the input and parse it, keeping nothing. JSON per line for `.jsonl`,
/// one JSON document for `.json`, every `.json` file under a folder (OpenCode's storage), and for the
/// text formats (Aider's markdown and LLM history) UTF-8 validation and a split into lines: the floor
/// of any reader of that input.
fn parse_only(path: &std::path::Path) -> usize {
    if path.is_dir() {
        return json_files(path).iter().map(|f| parse_only(f)).sum();
    }
    let bytes = std::fs::read(path).expect("fixture");
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") => bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()).filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok()).count(),
        Some("json") => serde_json::from_slice::<serde_json::Value>(&bytes).map(|_| 1).unwrap_or(0),
        _ => std::str::from_utf8(&bytes).map(|t| t.lines().count()).unwrap_or(0),
    }
}

/// Every `.json` file under `dir`, sorted.
fn json_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).expect("fixture folder").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(json_files(&p));
        } else if p.extension().is_some_and(|x| x == "json") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Bytes of a fixture file, or of every `.json` file under a fixture folder.
fn input_bytes(path: &std::path::Path) -> u64 {
    if path.is_dir() {
        return json_files(path).iter().map(|f| std::fs::metadata(f).expect("fixture").len()).sum();
    }
    std::fs::metadata(path).expect("fixture").len()
}

/// The `messages` fallback's input, written to a temporary file: a bare JSON array of 64 OpenAI-shape
/// chat messages (system, then user / assistant with a tool call / tool result / assistant answer,
/// repeated), about 13 KB like the other fixtures. No real file of this shape ships with the repo.
fn messages_file(dir: &std::path::Path) -> PathBuf {
    let mut msgs = vec![serde_json::json!({"role": "system", "content": "You are a coding agent. Use the tools to inspect the repository."})];
    for i in 0..21 {
        let call = format!("call_{i}");
        msgs.push(serde_json::json!({"role": "user", "content": format!("Step {i}: what does src/module_{i}.rs export? Answer in one line.")}));
        msgs.push(serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": call, "type": "function",
            "function": {"name": "read_file", "arguments": format!("{{\"path\": \"src/module_{i}.rs\"}}")}}]}));
        msgs.push(serde_json::json!({"role": "tool", "tool_call_id": call, "content": format!("pub fn run_{i}() {{}}\npub struct Config{i};")}));
    }
    msgs.truncate(64);
    let p = dir.join("messages.json");
    std::fs::write(&p, serde_json::to_vec_pretty(&msgs).expect("json")).expect("write messages.json");
    p
}

fn formats_2026(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-logs-2026");
    let tmp = tempfile::tempdir().expect("tempdir");
    let files = [
        ("openclaw-session", dir.join("openclaw__session-v3__f967d602.jsonl"), Format::OpenClawSession),
        ("claude-code", dir.join("claude-code__v2.1.38__short.jsonl"), Format::ClaudeCode),
        ("codex", dir.join("synthetic__codex__rollout.jsonl"), Format::Codex),
        ("openai-responses", dir.join("synthetic__openai-responses.jsonl"), Format::OpenAiResponses),
        ("anthropic-messages", dir.join("synthetic__anthropic-messages.jsonl"), Format::AnthropicMessages),
        ("otel (SDK spans)", dir.join("otel-genai-spans__any-agent__OPENAI_trace.json"), Format::Otel),
        ("otel (OTLP/JSON)", dir.join("synthetic__otel__otlp.json"), Format::Otel),
        ("langsmith", dir.join("langsmith__run-ingest-post-patch__wrap_openai_reasoning.json"), Format::LangSmith),
        ("openhands-v1", dir.join("openhands-sdk-v1__events__goal-fixture.jsonl"), Format::OpenHandsV1),
        ("otel (indexed attributes)", dir.join("synthetic__otel__indexed.json"), Format::Otel),
        ("gemini-cli (real, JSONL)", dir.join("gemini-cli__jsonl-2026-04__vibecodingtracker.jsonl"), Format::GeminiCli),
        ("copilot-cli (real)", dir.join("copilot-cli__v1.0.34-events__vibecodingtracker.jsonl"), Format::CopilotCli),
        ("qwen-code", dir.join("synthetic__qwen-code__session.jsonl"), Format::QwenCode),
        ("cline (XML tools)", dir.join("synthetic__cline__xml-tools.json"), Format::Cline),
        ("cline (Roo Code native tools)", dir.join("synthetic__roo-code__native-tools.json"), Format::Cline),
        ("kimi-cli", dir.join("synthetic__kimi-cli__context.jsonl"), Format::KimiCli),
        ("aider (chat history markdown)", dir.join("synthetic__aider__chat-history.md"), Format::Aider),
        ("aider (LLM history)", dir.join("synthetic__aider__llm-history.txt"), Format::Aider),
        ("goose", dir.join("synthetic__goose__session.jsonl"), Format::Goose),
        ("opencode (session folder)", dir.join("synthetic__opencode__storage/message/ses_7a3c9e1d2ffeQm4Lx8Rt2Vb6Nk"), Format::OpenCode),
        ("anthropic-managed-agents", dir.join("synthetic__anthropic-managed-agents__session.jsonl"), Format::AnthropicManagedAgents),
        ("messages (generated array)", messages_file(tmp.path()), Format::Messages),
    ];
    let mut g = c.benchmark_group("formats-2026");
    for (name, path, format) in files {
        // OpenCode reads a session's folder under `message/` and its parts under `part/`: the peer
        // parses every JSON file of the storage folder (this one session's).
        let peer_path = if format == Format::OpenCode { dir.join("synthetic__opencode__storage") } else { path.clone() };
        let bytes = input_bytes(&peer_path);
        assert!(!ingest_as(&path, format).is_empty(), "{} gives no interaction", path.display());
        assert!(parse_only(&peer_path) > 0, "{}: the peer parsed nothing", peer_path.display());
        g.throughput(Throughput::Bytes(bytes));
        g.bench_function(name, |b| b.iter(|| ingest_as(&path, format).len()));
        g.bench_function(format!("{name} / peer"), |b| b.iter(|| parse_only(&peer_path)));
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
