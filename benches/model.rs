//! Model runtime throughput on CPU (SmolLM2-135M-Instruct imported by scripts/setup.sh):
//! generation tokens/s (greedy batch 1, sampled batch 4) and scoring tokens/s (batch 4).
//! Compare with `python3 benches/peer_model.py` (HF transformers on the same directory, same work).
//!
//! Run: `cargo bench --bench model` (set `NEXTSTATE_BENCH_MODEL` for another model directory,
//! `NEXTSTATE_THREADS` for libtorch threads; default 1). Skipped when the model is missing.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nextstate::model::{LanguageModel, LoadOptions, SamplingParams};
use nextstate::schema::Message;

const NEW_TOKENS: usize = 32;
const SCORE_RESPONSE: usize = 64;

fn model_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var("NEXTSTATE_BENCH_MODEL").ok().map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct")),
    ];
    candidates.into_iter().flatten().find(|d| d.join("config.json").is_file())
}

fn bench(c: &mut Criterion) {
    let Some(dir) = model_dir() else {
        eprintln!("SKIPPED: no model directory (run scripts/setup.sh)");
        return;
    };
    let threads = std::env::var("NEXTSTATE_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
    tch::set_num_threads(threads);
    let lm = LanguageModel::load(&dir, &LoadOptions::default()).expect("load model");
    let questions = ["What is the capital of Germany?", "Write a haiku about rain.", "Explain photosynthesis briefly.", "List three prime numbers."];
    let prompts: Vec<Vec<u32>> = questions.iter().map(|q| lm.chat_prompt_ids(&[Message::text("user", *q)], None, true).expect("prompt")).collect();
    // No stop tokens: every sequence generates exactly NEW_TOKENS.
    let greedy = SamplingParams { max_new_tokens: NEW_TOKENS, stop_token_ids: Some(vec![]), ..Default::default() };
    let sampled = SamplingParams { temperature: 0.7, top_p: 0.95, seed: Some(1), ..greedy.clone() };

    let mut g = c.benchmark_group("model");
    g.sample_size(10);
    g.throughput(Throughput::Elements(NEW_TOKENS as u64));
    g.bench_function("generate_greedy_b1", |b| b.iter(|| lm.generate(&prompts[..1], &greedy).expect("generate")));
    g.throughput(Throughput::Elements((4 * NEW_TOKENS) as u64));
    g.bench_function("generate_sampled_b4", |b| b.iter(|| lm.generate(&prompts, &sampled).expect("generate")));
    let response: Vec<u32> = lm.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(8)).expect("encode")[..SCORE_RESPONSE].to_vec();
    let items: Vec<(Vec<u32>, Vec<u32>)> = prompts.iter().map(|p| (p.clone(), response.clone())).collect();
    let scored_tokens: usize = items.iter().map(|(p, r)| p.len() + r.len()).sum();
    g.throughput(Throughput::Elements(scored_tokens as u64));
    g.bench_function("score_b4", |b| b.iter(|| lm.score(&items, 0).expect("score")));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
