//! Trainer throughput on CPU: `Trainer::train_step` (pack, forward, docs/method.md §6 loss, backward,
//! gradient clipping, AdamW) on SmolLM2-135M-Instruct with LoRA adapters (rank 16, α 32 on
//! q,k,v,o,gate,up,down; the `pipelines/demo.toml` trainer), binary method, one batch of 8 samples.
//! Compare with `benches/peer_train.py` (PyTorch + HF transformers: the same weights, adapters, batch,
//! PPO-clip loss and AdamW step).
//!
//! The batch: the 4 chat prompts of `benches/model.rs` twice, each with the same 64-token response,
//! rewards +1/−1 alternating; rollout log-probs are the model's own (scored once, untimed), so the ratio
//! starts at 1. Checkpoints are not written inside the timed steps (`checkpoint_every` is large).
//! Reports tokens/s over prompt + response tokens (the forward/backward work) and response tokens/s.
//!
//! Cases (`case=`):
//! - `lora_binary_b8` (default): the 4 chat prompts twice, 64-token responses (798 tokens in all);
//! - `lora_binary_b8_2k`: the same 8 samples, each prompt prefixed with a passage so prompt + response
//!   is 2,000 tokens (16,000 in all): the "8 samples × ~2,000 tokens" memory target.
//!
//! `recompute=0|1` sets `trainer.recompute_layers` (default 1), `chunk=N` `trainer.logits_chunk_tokens`,
//! `micro=N` `trainer.micro_batch_tokens` (default 4096), `samples=N` the first N of the 8 samples (a
//! shorter step for profiling; the peer's `--samples`); `mmap=0` leaves glibc's allocator at its
//! defaults instead of [`nextstate::model::return_freed_memory`] (what `nextstate` calls at start);
//! `NEXTSTATE_CPU_CACHE_MB` sets the caching CPU allocator's limit and `NEXTSTATE_CPU_CACHE_MIN_KB` its
//! smallest cached buffer as for `nextstate` (`NEXTSTATE_CPU_CACHE_MB=0`: libtorch's default allocator;
//! see `nextstate::model::cpu_allocator`). Steps run back to back, as in `train --sql`: the cached
//! blocks stay between them.
//! Peak RSS is read from the process (`VmHWM` of /proc/self/status) after the timed steps, so it covers
//! model loading, the warm-up and the timed steps; run one case per process.
//!
//! Run: `cargo bench --bench train [-- case=lora_binary_b8_2k recompute=1]` (`steps=3`,
//! `NEXTSTATE_THREADS` libtorch threads, default 1). Prints `BENCH {json}` lines.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use serde_json::json;

use nextstate::method::Method;
use nextstate::model::{LanguageModel, LoadOptions, LoraConfig, LoraTarget, Trainable};
use nextstate::schema::{Message, Sample, SampleType};
use nextstate::trainer::checkpoint::CheckpointWriter;
use nextstate::trainer::{LoraSettings, Trainer, TrainerConfig};

use common::{arg, emit};

const QUESTIONS: [&str; 4] = ["What is the capital of Germany?", "Write a haiku about rain.", "Explain photosynthesis briefly.", "List three prime numbers."];
const RESPONSE: usize = 64;

fn model_dir() -> Option<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct");
    d.join("config.json").is_file().then_some(d)
}

fn main() {
    let Some(dir) = model_dir() else {
        eprintln!("SKIPPED: no model directory (run scripts/setup.sh)");
        return;
    };
    // As `nextstate` does at start (`mmap=0` measures glibc's default instead).
    let mmap = arg("mmap", "1") == "1";
    if mmap {
        nextstate::model::return_freed_memory();
    }
    // As `nextstate` does at start (NEXTSTATE_CPU_CACHE_MB=0 measures libtorch's default allocator).
    let cache = nextstate::model::cpu_allocator::config_from_env().expect("NEXTSTATE_CPU_CACHE_MB or NEXTSTATE_CPU_CACHE_MIN_KB");
    if let Some(cfg) = cache {
        nextstate::model::cpu_allocator::install(cfg).expect("caching allocator");
    }
    let steps: usize = arg("steps", "3").parse().expect("steps=N");
    let threads = std::env::var("NEXTSTATE_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
    tch::set_num_threads(threads);
    let lora = LoraSettings { enabled: true, ..LoraSettings::default() };
    let targets = lora.targets.iter().map(|t| LoraTarget::parse(t)).collect::<Result<Vec<_>, _>>().expect("targets");
    let trainable = Trainable::Lora(LoraConfig { rank: lora.rank, alpha: lora.alpha, targets });
    let case = arg("case", "lora_binary_b8");
    let recompute = arg("recompute", "1") == "1";
    let chunk: usize = arg("chunk", &nextstate::model::score::LOGIT_CHUNK_TOKENS.to_string()).parse().expect("chunk=N");
    let micro: usize = arg("micro", "4096").parse().expect("micro=N");
    let cfg = TrainerConfig { batch_size: 8, lr: 1e-4, lora, checkpoint_every: 1_000_000, recompute_layers: recompute, logits_chunk_tokens: chunk, micro_batch_tokens: micro, ..TrainerConfig::default() };
    tch::manual_seed(cfg.seed as i64);
    let lm = LanguageModel::load(&dir, &LoadOptions { trainable, ..LoadOptions::default() }).expect("load model");
    let response: Vec<u32> = lm.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(8)).expect("encode")[..RESPONSE].to_vec();
    let prompts: Vec<Vec<u32>> = QUESTIONS.iter().map(|q| lm.chat_prompt_ids(&[Message::text("user", *q)], None, true).expect("prompt")).collect();
    let prompts: Vec<Vec<u32>> = match case.as_str() {
        "lora_binary_b8" => prompts,
        "lora_binary_b8_2k" => {
            let passage = lm.encode(&"Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in the chloroplasts of plant cells. ".repeat(120)).expect("encode");
            prompts.into_iter().map(|p| passage[..2000 - RESPONSE - p.len()].iter().chain(&p).copied().collect()).collect()
        }
        other => panic!("unknown case {other}"),
    };
    let n_samples: usize = arg("samples", "8").parse().expect("samples=N");
    assert!((1..=8).contains(&n_samples), "samples=N takes 1 to 8");
    let items: Vec<(Vec<u32>, Vec<u32>)> = (0..n_samples).map(|i| (prompts[i % 4].clone(), response.clone())).collect();
    let rollout = tch::no_grad(|| lm.score(&items, 0)).expect("score");
    let samples: Vec<Sample> = items
        .iter()
        .zip(rollout)
        .enumerate()
        .map(|(i, ((p, r), lp))| {
            let p: Vec<i32> = p.iter().map(|&x| x as i32).collect();
            let r: Vec<i32> = r.iter().map(|&x| x as i32).collect();
            Sample {
                sample_id: format!("bench-{i}"),
                pipeline: "bench".into(),
                interaction_id: format!("turn-{i}"),
                session_id: format!("session-{i}"),
                rollout_logprobs_recomputed: true,
                ..Sample::new(SampleType::Binary, p, r, lp.logprobs, if i % 2 == 0 { 1.0 } else { -1.0 })
            }
        })
        .collect();
    let tokens: usize = samples.iter().map(|s| s.prompt_token_ids.len() + s.response_token_ids.len()).sum();
    let response_tokens = samples.len() * RESPONSE;
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut trainer = Trainer::new(lm, Method::Binary, cfg, CheckpointWriter::new(tmp.path(), "bench")).expect("trainer");
    let warm = Instant::now();
    trainer.train_step(&samples).expect("warm-up step");
    let warmup_s = warm.elapsed().as_secs_f64();
    let mut times = vec![];
    let mut loss = f64::NAN;
    for _ in 0..steps {
        let t = Instant::now();
        let out = trainer.train_step(&samples).expect("step");
        times.push(t.elapsed().as_secs_f64());
        loss = out.metrics.map(|m| m.loss).unwrap_or(f64::NAN);
    }
    times.sort_by(f64::total_cmp);
    // steps=0: the warm-up step alone (a memory measurement of a step too slow to repeat).
    let med = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    emit(json!({"bench": "train", "case": case, "engine": "nextstate (tch)", "threads": threads, "samples": samples.len(),
        "tokens": tokens, "response_tokens": response_tokens, "steps": steps, "best_s": times.first().copied().unwrap_or(f64::NAN), "median_s": med,
        "tokens_s": tokens as f64 / med, "response_tokens_s": response_tokens as f64 / med, "last_loss": loss, "warmup_s": warmup_s,
        "recompute_layers": recompute, "logits_chunk_tokens": chunk, "micro_batch_tokens": micro, "return_freed_memory": mmap,
        "cpu_cache_limit_mb": cache.map(|c| c.cache_limit_bytes >> 20), "cpu_cache_min_kb": cache.map(|c| c.min_block_bytes >> 10), "cpu_cache": nextstate::model::cpu_allocator::stats().map(|s| format!("{s:?}")),
        "peak_rss_mb": peak_rss_mb()}));
}

/// Peak resident set size of this process so far (MiB), from `VmHWM` in /proc/self/status.
fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
