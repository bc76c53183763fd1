//! Model runtime throughput on CPU (SmolLM2-135M-Instruct imported by scripts/setup.sh):
//! generation tokens/s (greedy batch 1, sampled batch 4) and scoring tokens/s (batch 4).
//! Compare with `python3 benches/peer_model.py` (HF transformers on the same directory, same work).
//!
//! Group `reload`: what a policy server's reload of a LoRA checkpoint costs, and what it costs decoding
//! after it, with the checkpoint's adapters folded into the weights (`serve.merge_lora`, the default)
//! or kept unmerged: `load_{unmerged,merged}` times [`nextstate::serve::server::load_policy`], the
//! load a reload runs on its blocking thread (the base tensors are the process's cached copy, as in the
//! server; the wait for the inference worker's swap is not in it), and `greedy_b{1,4}_{unmerged,merged}`
//! the decoding of the loaded model. The adapter is the trainer's default shape (rank 16, α 32, all
//! seven projections) with random B. A `BENCH` line gives the resident memory (VmRSS) each loaded model
//! adds.
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

/// Resident memory of this process (VmRSS), MB.
fn rss_mb() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}

fn bench_reload(c: &mut Criterion) {
    use nextstate::model::{LoraConfig, LoraTarget, Trainable};
    use nextstate::serve::server::load_policy;
    let Some(dir) = model_dir() else {
        eprintln!("SKIPPED: no model directory (run scripts/setup.sh)");
        return;
    };
    let threads = std::env::var("NEXTSTATE_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
    tch::set_num_threads(threads);
    // Freed tensors go back to the OS, so the resident set follows what is alive.
    nextstate::model::return_freed_memory();
    let tmp = tempfile::tempdir().expect("tempdir");
    let ckpt = tmp.path().join("run/1");
    {
        tch::manual_seed(1);
        let lora = LoraConfig { rank: 16, alpha: 32.0, targets: LoraTarget::ALL.to_vec() };
        let lm = LanguageModel::load(&dir, &LoadOptions { trainable: Trainable::Lora(lora), ..Default::default() }).expect("load model");
        let _g = tch::no_grad_guard();
        for (name, mut t) in lm.transformer().adapter_state() {
            if name.contains("lora_B") {
                t.copy_(&(tch::Tensor::randn_like(&t) * 0.01));
            }
        }
        lm.save_adapters(&ckpt).expect("save adapters");
    }
    let load = LoadOptions::default();
    // The server's shared policy: the base, whose tensors the reloaded checkpoints alias.
    let shared = load_policy(&dir, &dir, &load, false).expect("load base");
    let rss0 = rss_mb();
    let unmerged = load_policy(&ckpt, &dir, &load, false).expect("load unmerged");
    let rss1 = rss_mb();
    let merged = load_policy(&ckpt, &dir, &load, true).expect("load merged");
    let rss2 = rss_mb();
    println!(
        "BENCH {}",
        serde_json::json!({"case": "reload_rss", "threads": threads, "base_rss_mb": rss0, "unmerged_adds_mb": rss1 - rss0, "merged_adds_mb": rss2 - rss1})
    );
    let prompts: Vec<Vec<u32>> = ["What is the capital of Germany?", "Write a haiku about rain.", "Explain photosynthesis briefly.", "List three prime numbers."]
        .iter()
        .map(|q| shared.chat_prompt_ids(&[Message::text("user", *q)], None, true).expect("prompt"))
        .collect();
    let greedy = SamplingParams { max_new_tokens: NEW_TOKENS, stop_token_ids: Some(vec![]), ..Default::default() };

    let mut g = c.benchmark_group("reload");
    g.sample_size(10);
    g.bench_function("load_unmerged", |b| b.iter(|| load_policy(&ckpt, &dir, &load, false).expect("load")));
    g.bench_function("load_merged", |b| b.iter(|| load_policy(&ckpt, &dir, &load, true).expect("load")));
    for (name, lm) in [("unmerged", &unmerged), ("merged", &merged)] {
        g.throughput(Throughput::Elements(NEW_TOKENS as u64));
        g.bench_function(format!("greedy_b1_{name}"), |b| b.iter(|| lm.generate(&prompts[..1], &greedy).expect("generate")));
        g.throughput(Throughput::Elements((4 * NEW_TOKENS) as u64));
        g.bench_function(format!("greedy_b4_{name}"), |b| b.iter(|| lm.generate(&prompts, &greedy).expect("generate")));
    }
    g.finish();
}

criterion_group!(benches, bench, bench_reload);
criterion_main!(benches);
