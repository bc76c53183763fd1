//! Integration tests of the model runtime against the imported SmolLM2-135M-Instruct
//! (`models/smollm2-135m-instruct`, made by `scripts/setup.sh`; set `NEXTSTATE_TEST_MODEL` to use
//! another directory). Each test is skipped with a message when the model directory is missing (a failure under `CI=true`
//! or `NEXTSTATE_REQUIRE_ALL=1`, see `tests/common`).

use crate::common;

use std::path::PathBuf;
use std::sync::OnceLock;

use nextstate::model::{FinishReason, GenerationRequest, LanguageModel, LoadOptions, LogprobMode, LoraConfig, LoraTarget, SamplingParams, Trainable};
use tch::{Kind, Tensor};
use nextstate::schema::Message;

fn threads() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| tch::set_num_threads(1));
}

fn load(trainable: Trainable) -> Option<LanguageModel> {
    threads();
    let dir = common::test_model_or_missing()?;
    Some(LanguageModel::load(&dir, &LoadOptions { trainable, ..Default::default() }).expect("load model"))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn greedy_plain_text_continuation_says_paris() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = lm.encode("The capital of France is").unwrap();
    let out = lm.generate(&[prompt], &SamplingParams::greedy(8)).unwrap();
    assert!(out[0].text.starts_with(" Paris"), "got {:?}", out[0].text);
}

#[test]
fn chatml_answer_about_germany() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = lm.chat_prompt_ids(&[Message::text("user", "What is the capital of Germany?")], None, true).unwrap();
    let out = lm.generate(&[prompt], &SamplingParams::greedy(32)).unwrap();
    let g = &out[0];
    assert_eq!(g.text, "The capital of Germany is Berlin.");
    assert_eq!(g.finish_reason, FinishReason::Stop);
    assert_eq!(g.matched_stop.as_deref(), Some("<|im_end|>"));
    assert_eq!(g.token_ids.last().copied(), Some(2));
}

/// Log-softmax of one plain forward pass over prompt ++ response (no cache, no packing), read at the
/// positions that predict each response token.
fn independent_logprobs(lm: &LanguageModel, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let _g = tch::no_grad_guard();
    let ids: Vec<i64> = prompt.iter().chain(response).map(|&t| t as i64).collect();
    let x = Tensor::from_slice(&ids).view([1, -1]);
    let logp = lm.transformer().forward_logits(&x).unwrap().log_softmax(-1, Kind::Float);
    response
        .iter()
        .enumerate()
        .map(|(t, &id)| logp.double_value(&[0, (prompt.len() - 1 + t) as i64, id as i64]) as f32)
        .collect()
}

fn chat(lm: &LanguageModel, q: &str) -> Vec<u32> {
    lm.chat_prompt_ids(&[Message::text("user", q)], None, true).unwrap()
}

#[test]
fn score_matches_independent_forward_and_generate_logprobs() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = chat(&lm, "Name three colours.");
    let g = &lm.generate(std::slice::from_ref(&prompt), &SamplingParams::greedy(24)).unwrap()[0];
    assert!(!g.token_ids.is_empty());
    assert_eq!(g.logprobs.len(), g.token_ids.len());
    let scored = lm.score(&[(prompt.clone(), g.token_ids.clone())], 0).unwrap();
    let ind = independent_logprobs(&lm, &prompt, &g.token_ids);
    let d_gen = max_abs_diff(&scored[0].logprobs, &g.logprobs);
    let d_ind = max_abs_diff(&scored[0].logprobs, &ind);
    assert!(d_gen < 1e-4, "score vs generate: {d_gen}");
    assert!(d_ind < 1e-4, "score vs independent forward: {d_ind}");
    // Greedy picks the argmax, so every log-prob is the largest at its position and <= 0.
    assert!(g.logprobs.iter().all(|&x| x <= 0.0));

    // Sampled tokens: Raw mode reports the plain log-softmax, which score reproduces; Sampling mode
    // at temperature 1 without truncation is the same distribution.
    for mode in [LogprobMode::Raw, LogprobMode::Sampling] {
        let temperature = if mode == LogprobMode::Raw { 0.7 } else { 1.0 };
        let params = SamplingParams { temperature, max_new_tokens: 16, seed: Some(7), logprob_mode: mode, ..Default::default() };
        let s = &lm.generate(std::slice::from_ref(&prompt), &params).unwrap()[0];
        let sc = lm.score(&[(prompt.clone(), s.token_ids.clone())], 0).unwrap();
        let d = max_abs_diff(&sc[0].logprobs, &s.logprobs);
        assert!(d < 1e-4, "{mode:?}: score vs sampled log-probs {d}");
    }
}

#[test]
fn batched_generation_and_scoring_match_single() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let p1 = chat(&lm, "What is the capital of Germany?");
    let p2 = lm.encode("The capital of France is").unwrap();
    assert_ne!(p1.len(), p2.len());
    // A tiny cache step makes the batched run grow its cache (and padding mask) several times; results
    // must not depend on it.
    nextstate::model::generate::set_kv_cache_step(3);
    let params = SamplingParams::greedy(12);
    let both = lm.generate(&[p1.clone(), p2.clone()], &params).unwrap();
    let one = lm.generate(std::slice::from_ref(&p1), &params).unwrap();
    let two = lm.generate(std::slice::from_ref(&p2), &params).unwrap();
    assert_eq!(both[0].token_ids, one[0].token_ids);
    assert_eq!(both[1].token_ids, two[0].token_ids);
    assert!(max_abs_diff(&both[0].logprobs, &one[0].logprobs) < 1e-4);
    assert!(max_abs_diff(&both[1].logprobs, &two[0].logprobs) < 1e-4);
    // Scoring both in one padded batch equals scoring each alone.
    let items = vec![(p1.clone(), one[0].token_ids.clone()), (p2.clone(), two[0].token_ids.clone())];
    let batch = lm.score(&items, 0).unwrap();
    let single = lm.score(&items[1..], 0).unwrap();
    assert!(max_abs_diff(&batch[1].logprobs, &single[0].logprobs) < 1e-4);
    assert!(max_abs_diff(&batch[0].logprobs, &one[0].logprobs) < 1e-4);
}

/// Continuous batching ([`nextstate::model::Decoder`]): requests admitted while others decode (a longer
/// prompt, which shifts the running rows right; a shorter one, right-aligned into the running cache; one
/// after another has left) get the tokens and log-probs they get decoded alone, greedy and seeded sampling.
#[test]
fn requests_joining_a_running_batch_decode_as_they_do_alone() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    nextstate::model::generate::set_kv_cache_step(3);
    let long = chat(&lm, "What is the capital of Germany?");
    let short = lm.encode("The capital of France is").unwrap();
    let mid = chat(&lm, "Name three colours.");
    assert!(long.len() > short.len());
    let greedy = SamplingParams::greedy(10);
    let sampled = SamplingParams { temperature: 0.7, max_new_tokens: 14, seed: Some(11), ..Default::default() };
    let req = |p: &Vec<u32>, params: &SamplingParams| GenerationRequest { prompt_ids: p.clone(), params: params.clone() };
    let moon = chat(&lm, "Tell me a fact about the moon.");
    let jobs = [(short.clone(), greedy.clone()), (long.clone(), sampled.clone()), (mid.clone(), greedy.clone()), (short.clone(), sampled.clone()), (moon, greedy.clone())];
    let alone: Vec<_> = jobs.iter().map(|(p, params)| lm.generate_stream(&[req(p, params)], &mut |_| true).unwrap().remove(0)).collect();
    // Admit job 0; after 3 steps job 1 (longer prompt); after 2 more jobs 2 and 4 together (prompts of
    // two lengths, left-padded to each other, then right-aligned into the batch); job 3 once job 0 has left.
    let mut dec = lm.decoder();
    let mut got: Vec<Option<nextstate::model::Generation>> = vec![None; jobs.len()];
    let mut admitted = 1;
    assert!(dec.admit(&[(0, req(&jobs[0].0, &jobs[0].1))]).unwrap().is_empty());
    let mut steps = 0;
    let mut events = vec![0usize; jobs.len()];
    while !dec.is_empty() {
        for (k, g) in dec.step(&mut |ev| {
            events[ev.request] += 1;
            true
        })
        .unwrap()
        {
            got[k] = Some(g);
        }
        steps += 1;
        let due = match admitted {
            1 => steps == 3,
            2 => steps == 5,
            3 => got[0].is_some(),
            _ => false,
        };
        if due {
            let mut group = vec![(admitted, req(&jobs[admitted].0, &jobs[admitted].1))];
            if admitted == 2 {
                group.push((4, req(&jobs[4].0, &jobs[4].1)));
            }
            assert!(dec.admit(&group).unwrap().is_empty());
            admitted += 1;
        }
    }
    assert_eq!(admitted, 4, "every job was admitted");
    assert_ne!(jobs[2].0.len(), jobs[4].0.len());
    for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
        let g = g.as_ref().unwrap_or_else(|| panic!("job {i} has no result"));
        assert_eq!(g.token_ids, a.token_ids, "job {i}");
        assert_eq!(g.text, a.text, "job {i}");
        assert_eq!(events[i], a.token_ids.len(), "job {i}: one event per token");
        assert!(max_abs_diff(&g.logprobs, &a.logprobs) < 1e-4, "job {i}");
    }
    // Admission checks every request before taking any; a zero-token request finishes at once.
    let bad = GenerationRequest { prompt_ids: vec![], params: greedy.clone() };
    let err = dec.admit(&[(7, req(&short, &greedy)), (8, bad)]).unwrap_err().to_string();
    assert!(err.contains("request 8") && err.contains("empty prompt"), "{err}");
    assert!(dec.is_empty());
    let done = dec.admit(&[(9, req(&short, &SamplingParams::greedy(0)))]).unwrap();
    assert_eq!((done.len(), done[0].0, done[0].1.token_ids.len()), (1, 9, 0));
}

#[test]
fn one_token_response_aligns_with_last_prompt_position() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = lm.encode("The capital of France is").unwrap();
    let paris = lm.encode(" Paris").unwrap();
    let london = lm.encode(" London").unwrap();
    assert_eq!((paris.len(), london.len()), (1, 1));
    let s = lm.score(&[(prompt.clone(), paris.clone()), (prompt.clone(), london.clone())], 5).unwrap();
    assert_eq!(s[0].logprobs.len(), 1);
    // Independent: log-softmax of the forward pass over the prompt alone, at its last position.
    let _g = tch::no_grad_guard();
    let x = Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]);
    let logp = lm.transformer().forward_logits(&x).unwrap().log_softmax(-1, Kind::Float);
    let last = prompt.len() as i64 - 1;
    let want_paris = logp.double_value(&[0, last, paris[0] as i64]) as f32;
    let want_london = logp.double_value(&[0, last, london[0] as i64]) as f32;
    assert!((s[0].logprobs[0] - want_paris).abs() < 1e-4, "{} vs {want_paris}", s[0].logprobs[0]);
    assert!((s[1].logprobs[0] - want_london).abs() < 1e-4);
    // Cross-implementation check: HF transformers 5.24 (PyTorch 2.11, f32, SDPA) loading the same
    // imported directory gives log p(" Paris" | "The capital of France is") = −0.258072
    // (benches/peer_model.py prints it).
    assert!((s[0].logprobs[0] - (-0.258072)).abs() < 1e-4, "log p(Paris) = {}", s[0].logprobs[0]);
    // A response whose first token differs gets a different (here much lower) score.
    assert!(s[0].logprobs[0] > s[1].logprobs[0] + 1.0);
    // Top-K at that position: " Paris" is the most likely token, sorted descending.
    let ids = s[0].topk_ids.as_ref().unwrap();
    let lps = s[0].topk_logprobs.as_ref().unwrap();
    assert_eq!((ids.len(), ids[0].len()), (1, 5));
    assert_eq!(ids[0][0], paris[0]);
    assert!((lps[0][0] - s[0].logprobs[0]).abs() < 1e-6);
    assert!(lps[0].windows(2).all(|w| w[0] >= w[1]));
}

fn lora_cfg() -> LoraConfig {
    LoraConfig { rank: 4, alpha: 8.0, targets: LoraTarget::ALL.to_vec() }
}

#[test]
fn lora_zero_init_is_identity_and_adapters_round_trip() {
    let Some(base) = load(Trainable::Frozen) else { return };
    let Some(mut lm) = load(Trainable::Lora(lora_cfg())) else { return };
    let prompt = chat(&base, "Say hello.");
    let resp = base.encode("Hello! How can I help you today?").unwrap();
    let items = vec![(prompt.clone(), resp.clone())];
    let base_lp = base.score(&items, 0).unwrap()[0].logprobs.clone();
    let lora_lp = lm.score(&items, 0).unwrap()[0].logprobs.clone();
    assert_eq!(max_abs_diff(&base_lp, &lora_lp), 0.0, "zero-initialised B must leave log-probs unchanged");

    // Only the adapters train: 30 layers × 7 projections × (A, B).
    let trainable = lm.transformer().trainable_variables();
    assert_eq!(trainable.len(), 30 * 7 * 2);
    let batch = lm.pack(&[(prompt.as_slice(), resp.as_slice())]).unwrap();
    let rl = lm.response_logprobs(&batch).unwrap();
    assert_eq!(rl.logprobs.size(), vec![1, resp.len() as i64]);
    assert_eq!(rl.log_probs_full.size(), vec![1, resp.len() as i64, 49152]);
    let loss = rl.logprobs.sum(Kind::Float).neg();
    loss.backward();
    let with_grad = trainable.iter().filter(|t| t.grad().defined() && t.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0).count();
    assert!(with_grad >= 30 * 7, "B matrices get gradients ({with_grad})");
    let vars = lm.transformer().var_store().variables();
    let q = &vars["model.layers.0.self_attn.q_proj.weight"];
    assert!(!q.requires_grad() && !q.grad().defined(), "base weights stay frozen");
    // Entropy is positive where defined.
    assert!(rl.entropy().unwrap().sum(Kind::Float).double_value(&[]) > 0.0);

    // Move the adapters away from zero, as training would.
    {
        let _g = tch::no_grad_guard();
        tch::manual_seed(1);
        for (name, mut t) in lm.transformer().adapter_state() {
            if name.contains("lora_B") {
                t.copy_(&(Tensor::randn_like(&t) * 0.01));
            }
        }
    }
    let trained = lm.score(&items, 0).unwrap()[0].logprobs.clone();
    assert!(max_abs_diff(&trained, &base_lp) > 1e-3, "adapters now change the model");

    let dir = tempfile::tempdir().unwrap();
    let adapters = dir.path().join("adapters");
    lm.save_adapters(&adapters).unwrap();
    assert!(adapters.join("adapter_model.safetensors").is_file() && adapters.join("adapter_config.json").is_file());
    let reloaded = LanguageModel::load_checkpoint(&adapters, None, &LoadOptions::default()).unwrap();
    let again = reloaded.score(&items, 0).unwrap()[0].logprobs.clone();
    assert_eq!(max_abs_diff(&again, &trained), 0.0, "adapter round trip");

    // Full weights with the adapters merged in: a plain HF directory with the same log-probs.
    let full = dir.path().join("full");
    lm.save_full(&full).unwrap();
    let merged = LanguageModel::load_checkpoint(&full, None, &LoadOptions::default()).unwrap();
    assert!(merged.transformer().lora().is_none());
    let m = merged.score(&items, 0).unwrap()[0].logprobs.clone();
    assert!(max_abs_diff(&m, &trained) < 1e-4, "merged full weights: {}", max_abs_diff(&m, &trained));
}

/// Frozen and LoRA loads of the same files alias one copy of the base weights (issue 13: the demo's
/// server, teacher and trainer held three); full fine-tuning owns its copy; neither merging adapters
/// nor copying weights ever writes into the shared base.
#[test]
fn frozen_and_lora_loads_share_one_base_that_nothing_writes() {
    let Some(base) = load(Trainable::Frozen) else { return };
    let Some(mut lora) = load(Trainable::Lora(lora_cfg())) else { return };
    let Some(full) = load(Trainable::Full) else { return };
    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    let ptr = |lm: &LanguageModel, name: &str| lm.transformer().var_store().variables()[name].data_ptr();
    assert!(base.transformer().shares_base() && lora.transformer().shares_base());
    assert!(!full.transformer().shares_base());
    for name in [Q, "model.embed_tokens.weight", "model.norm.weight"] {
        assert_eq!(ptr(&base, name), ptr(&lora, name), "{name} is one tensor");
        assert_ne!(ptr(&base, name), ptr(&full, name), "{name}: full fine-tuning owns a copy");
    }
    let q_before = base.transformer().var_store().variables()[Q].copy();

    // A base weight of a shared model cannot be overwritten...
    let err = base.transformer().copy_weights(vec![(Q.to_string(), Tensor::zeros_like(&q_before))], false).unwrap_err();
    assert!(err.to_string().contains("shared with other models"), "{err}");
    // ...and merging trained adapters makes new tensors instead of writing into it.
    {
        let _g = tch::no_grad_guard();
        for (name, mut t) in lora.transformer().adapter_state() {
            if name.contains("lora_B") {
                t.copy_(&Tensor::ones_like(&t));
            }
        }
    }
    lora.transformer_mut().merge_lora().unwrap();
    assert_ne!(ptr(&lora, Q), ptr(&base, Q), "the merged projection is the LoRA model's own");
    assert_eq!(ptr(&lora, "model.embed_tokens.weight"), ptr(&base, "model.embed_tokens.weight"), "unmerged tensors stay shared");
    let q_after = base.transformer().var_store().variables()[Q].copy();
    assert_eq!(f64::try_from((&q_after - &q_before).abs().max()).unwrap(), 0.0, "the shared base is unchanged");
    let merged_q = lora.transformer().var_store().variables()[Q].copy();
    assert!(f64::try_from((&merged_q - &q_before).abs().max()).unwrap() > 0.1, "the merge took effect");
}

#[test]
fn full_weights_round_trip() {
    let Some(mut lm) = load(Trainable::Full) else { return };
    assert!(lm.transformer().trainable_variables().len() > 200);
    {
        let _g = tch::no_grad_guard();
        let vars = lm.transformer().var_store().variables();
        let mut w = vars["model.layers.3.mlp.down_proj.weight"].shallow_clone();
        let _ = w.g_add_scalar_(0.001);
    }
    let prompt = lm.encode("The capital of France is").unwrap();
    let resp = lm.encode(" Paris, the city of light.").unwrap();
    let items = vec![(prompt, resp)];
    let before = lm.score(&items, 0).unwrap()[0].logprobs.clone();
    let dir = tempfile::tempdir().unwrap();
    lm.save_full(dir.path()).unwrap();
    for f in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.path().join(f).is_file(), "{f} written");
    }
    let back = LanguageModel::load(dir.path(), &LoadOptions::default()).unwrap();
    let after = back.score(&items, 0).unwrap()[0].logprobs.clone();
    assert_eq!(max_abs_diff(&before, &after), 0.0);
}

#[test]
fn streaming_events_rebuild_the_text_and_stop_strings_cut_it() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = chat(&lm, "What is the capital of Germany?");
    let req = GenerationRequest { prompt_ids: prompt.clone(), params: SamplingParams { stop_strings: vec![" Berlin".into()], ..SamplingParams::greedy(32) } };
    let mut streamed = String::new();
    let mut events = 0;
    let out = lm
        .generate_stream(&[req], &mut |ev| {
            streamed.push_str(ev.text_delta);
            events += 1;
            true
        })
        .unwrap();
    assert_eq!(out[0].text, "The capital of Germany is");
    assert_eq!(streamed, out[0].text);
    assert_eq!(out[0].matched_stop.as_deref(), Some(" Berlin"));
    assert_eq!(events, out[0].token_ids.len());
    // Cancelling after the first token stops that sequence.
    let req = GenerationRequest { prompt_ids: prompt, params: SamplingParams::greedy(32) };
    let out = lm.generate_stream(&[req], &mut |_| false).unwrap();
    assert_eq!((out[0].token_ids.len(), out[0].finish_reason), (1, FinishReason::Cancelled));
}

#[test]
fn imported_tokenizer_splits_digits_and_knows_special_tokens() {
    let Some(dir) = common::test_model_or_missing() else { return };
    let tok = nextstate::model::TextTokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    // "smollm" pre-tokenizer: every digit is its own token.
    let ids = tok.encode("2024").unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(tok.decode(&ids, false).unwrap(), "2024");
    // Special tokens in text map to their ids; no BOS is added.
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>").unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (1, 2));
    assert!(tok.is_special(2) && !tok.is_special(ids[1]));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi");
    // Byte-level tokens give back their bytes (" Paris" starts with a space byte).
    let paris = tok.encode(" Paris").unwrap();
    assert_eq!(tok.token_bytes(paris[0]), b" Paris".to_vec());
    assert_eq!(tok.token_bytes(2), b"<|im_end|>".to_vec());
    // Round trip of mixed text, including non-ASCII.
    let text = "Grüße, 東京! 3.14 café\n\tend";
    assert_eq!(tok.decode(&tok.encode(text).unwrap(), false).unwrap(), text);
}

#[test]
fn kv_cache_decoding_and_growth_match_a_full_forward() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let _g = tch::no_grad_guard();
    let t = lm.transformer();
    let ids: Vec<i64> = lm.encode("One, two, three, four").unwrap().iter().map(|&x| x as i64).collect();
    let n = ids.len() as i64;
    let full = t.forward_logits(&Tensor::from_slice(&ids).view([1, n])).unwrap();
    // Prefill all but the last token into a cache with no spare room, grow it, then decode the last.
    let mut cache = nextstate::model::KvCache::new(&t.config, 1, (n - 1) as usize, t.dtype(), t.device()).unwrap();
    let pre = Tensor::from_slice(&ids[..(n - 1) as usize]).view([1, n - 1]);
    let pos = Tensor::arange(n - 1, (Kind::Int64, tch::Device::Cpu)).view([1, n - 1]);
    let _ = t.forward_hidden(&pre, &pos, nextstate::model::AttnMask::Causal, Some(&mut cache)).unwrap();
    assert!(t.forward_hidden(&pre.narrow(1, 0, 1), &pos.narrow(1, 0, 1), nextstate::model::AttnMask::Causal, Some(&mut cache)).is_err(), "a full cache refuses more tokens");
    cache.reserve(n as usize + 3).unwrap();
    assert_eq!((cache.len(), cache.capacity()), ((n - 1) as usize, n as usize + 3));
    let mask = Tensor::ones([1, 1, 1, n], (Kind::Bool, tch::Device::Cpu));
    let last = Tensor::from_slice(&ids[(n - 1) as usize..]).view([1, 1]);
    let h = t.forward_hidden(&last, &Tensor::from_slice(&[n - 1]).view([1, 1]), nextstate::model::AttnMask::Explicit(&mask), Some(&mut cache)).unwrap();
    let step = t.logits(&h).unwrap().to_kind(Kind::Float);
    let diff = (step.get(0).get(0) - full.get(0).get(n - 1)).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "cached decode vs full forward: {diff}");
}

/// Qwen2 architecture check (QKV bias, untied head, qwen2 pre-tokenizer, Q4_K/Q5_0/Q6_K blocks)
/// against values from HF transformers 5.24 on the same import of the optional Qwen2.5-Coder-0.5B GGUF
/// (see ../shared/docs/MODELS.md). Runs only when `NEXTSTATE_TEST_QWEN` names the imported directory.
#[test]
fn qwen2_import_matches_transformers() {
    let Some(dir) = std::env::var("NEXTSTATE_TEST_QWEN").ok().map(PathBuf::from) else {
        common::optional_missing("NEXTSTATE_TEST_QWEN (an imported Qwen2.5-Coder-0.5B directory) not set");
        return;
    };
    threads();
    let lm = LanguageModel::load(&dir, &LoadOptions::default()).unwrap();
    let tricky = "x = 12345 + 0.5;\n\n  it's DONE's   ok\t\r\n🙂 naïve";
    assert_eq!(
        lm.encode(tricky).unwrap(),
        vec![87, 284, 220, 16, 17, 18, 19, 20, 488, 220, 15, 13, 20, 401, 220, 432, 594, 54685, 594, 256, 5394, 4474, 145080, 94880, 586]
    );
    let prompt = lm.encode(include_str!("../data/chat_templates/qwen2.5_tools.expected")).unwrap();
    assert_eq!(prompt.len(), 266);
    let g = lm.generate(&[prompt], &SamplingParams::greedy(12)).unwrap();
    assert_eq!(g[0].token_ids, vec![2610, 2299, 10565, 0, 1416, 498, 614, 894, 1008, 4755, 11, 2666]);
    assert!((g[0].logprobs[0] - (-0.004_678_612_6)).abs() < 1e-4);
}

// ---- LoRA adapters in PEFT's layout (issue 16): what vLLM, SGLang and `peft` load ----

/// r 8, α 20: scale α / r = 2.5 (α / sqrt(r) would be 7.07, r / α 0.4: a wrong rule shows).
fn peft_cfg() -> LoraConfig {
    LoraConfig { rank: 8, alpha: 20.0, targets: LoraTarget::ALL.to_vec() }
}

/// SmolLM2 with LoRA (`peft_cfg`) in `dtype`, B moved away from zero as training would.
fn lora_with_nonzero_b(dtype: Kind) -> Option<LanguageModel> {
    threads();
    let dir = common::test_model_or_missing()?;
    let lm = LanguageModel::load(&dir, &LoadOptions { dtype, trainable: Trainable::Lora(peft_cfg()), ..Default::default() }).expect("load model");
    let _g = tch::no_grad_guard();
    tch::manual_seed(16);
    for (name, mut t) in lm.transformer().adapter_state() {
        if name.contains("lora_B") {
            t.copy_(&(Tensor::randn_like(&t) * 0.02));
        }
    }
    Some(lm)
}

fn read_st(path: &std::path::Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Key names and shapes of a saved adapter are exactly those PEFT's `save_pretrained` writes for
/// SmolLM2 (`get_peft_model_state_dict`: `base_model.model.` + module path + `lora_A.weight`, no
/// adapter name; A `[r, in]`, B `[out, r]`), in the trained dtype, with a complete `adapter_config.json`.
#[test]
fn peft_adapter_has_peft_key_names_shapes_and_config() {
    let Some(lm) = lora_with_nonzero_b(Kind::Float) else { return };
    let dir = tempfile::tempdir().unwrap();
    lm.save_adapters(dir.path()).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, vec!["adapter_config.json", "adapter_model.safetensors"]);

    let path = dir.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    let tensors = read_st(&path);
    // SmolLM2-135M: hidden 576, 3 KV heads × 64 = 192, MLP 1536; r = 8.
    let (h, kv, f, r) = (576i64, 192i64, 1536i64, 8i64);
    let layer0: Vec<(&str, Vec<i64>)> = vec![
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", vec![h, r]),
        ("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight", vec![kv, r]),
        ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight", vec![kv, r]),
        ("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight", vec![h, r]),
        ("base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight", vec![f, r]),
        ("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", vec![r, h]),
        ("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", vec![f, r]),
        ("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight", vec![r, f]),
        ("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight", vec![h, r]),
    ];
    let mut got0: Vec<(String, Vec<i64>)> = tensors.iter().filter(|(k, _)| k.starts_with("base_model.model.model.layers.0.")).map(|(k, t)| (k.clone(), t.size())).collect();
    got0.sort();
    let mut want0: Vec<(String, Vec<i64>)> = layer0.iter().map(|(k, s)| (k.to_string(), s.clone())).collect();
    want0.sort();
    assert_eq!(got0, want0);
    // All 30 layers: the same 14 tensors, and nothing else.
    assert_eq!(tensors.len(), 30 * 14);
    for i in 0..30 {
        for (k, shape) in &layer0 {
            let key = k.replace(".layers.0.", &format!(".layers.{i}."));
            let t = tensors.get(&key).unwrap_or_else(|| panic!("missing {key}"));
            assert_eq!((&t.size(), t.kind()), (shape, Kind::Float), "{key}");
        }
    }

    let cfg = read_json(&dir.path().join("adapter_config.json"));
    let base = std::fs::canonicalize(common::test_model_or_missing().unwrap()).unwrap();
    for (field, want) in [
        ("peft_type", serde_json::json!("LORA")),
        ("task_type", serde_json::json!("CAUSAL_LM")),
        ("r", serde_json::json!(8)),
        ("lora_alpha", serde_json::json!(20)),
        ("lora_dropout", serde_json::json!(0.0)),
        ("bias", serde_json::json!("none")),
        ("fan_in_fan_out", serde_json::json!(false)),
        ("inference_mode", serde_json::json!(true)),
        ("use_rslora", serde_json::json!(false)),
        ("use_dora", serde_json::json!(false)),
        ("modules_to_save", serde_json::Value::Null),
        ("layers_to_transform", serde_json::Value::Null),
        ("rank_pattern", serde_json::json!({})),
        ("alpha_pattern", serde_json::json!({})),
        ("base_model_name_or_path", serde_json::json!(base.to_string_lossy())),
    ] {
        assert_eq!(cfg.get(field), Some(&want), "adapter_config.json field {field}");
    }
    let mut targets: Vec<&str> = cfg["target_modules"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    targets.sort();
    assert_eq!(targets, vec!["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]);

    // Trained in bf16: written in bf16.
    drop(lm);
    let Some(lm16) = lora_with_nonzero_b(Kind::BFloat16) else { return };
    let dir16 = tempfile::tempdir().unwrap();
    lm16.save_adapters(dir16.path()).unwrap();
    let t16 = read_st(&dir16.path().join("adapter_model.safetensors"));
    assert_eq!(t16.len(), 30 * 14);
    assert!(t16.values().all(|t| t.kind() == Kind::BFloat16));
}

/// What a PEFT consumer computes from the saved folder alone — `W + scale·B·A` with PEFT's scale rule
/// read from `adapter_config.json` — equals the weights our server serves (`load_checkpoint` +
/// `merge_lora`, as `serve` and its reloads do) within 1e-6, for every adapted matrix.
#[test]
fn peft_adapter_on_the_base_equals_the_served_merged_weights() {
    let Some(lm) = lora_with_nonzero_b(Kind::Float) else { return };
    let base_dir = common::test_model_or_missing().unwrap();
    let dir = tempfile::tempdir().unwrap();
    lm.save_adapters(dir.path()).unwrap();
    drop(lm);
    let mut served = LanguageModel::load_checkpoint(dir.path(), Some(&base_dir), &LoadOptions::default()).unwrap();
    served.transformer_mut().merge_lora().unwrap();
    let merged = served.transformer().var_store().variables();

    let cfg = read_json(&dir.path().join("adapter_config.json"));
    let (r, alpha) = (cfg["r"].as_f64().unwrap(), cfg["lora_alpha"].as_f64().unwrap());
    let scale = if cfg["use_rslora"].as_bool().unwrap_or(false) { alpha / r.sqrt() } else { alpha / r };
    assert_eq!(scale, 2.5);
    let base = read_st(&base_dir.join("model.safetensors"));
    let adapters = read_st(&dir.path().join("adapter_model.safetensors"));
    let mut checked = 0;
    for (key, a) in &adapters {
        let Some(module) = key.strip_prefix("base_model.model.").and_then(|k| k.strip_suffix(".lora_A.weight")) else { continue };
        let b = &adapters[&format!("base_model.model.{module}.lora_B.weight")];
        let w = base[&format!("{module}.weight")].to_kind(Kind::Double);
        let delta = b.to_kind(Kind::Double).matmul(&a.to_kind(Kind::Double)) * scale;
        let expected = &w + &delta;
        let got = merged[&format!("{module}.weight")].to_kind(Kind::Double);
        let diff = (&expected - &got).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{module}: |base + scale·B·A − served| = {diff:e}");
        assert!(delta.abs().max().double_value(&[]) > 1e-3, "{module}: the adapter changes the weight");
        checked += 1;
    }
    assert_eq!(checked, 30 * 7);
}

/// Write → read gives identical tensors in both layouts: PEFT's folder, and an older checkpoint's
/// `adapter.safetensors` with bare names and the old config fields; both load as a served model with
/// the same logits.
#[test]
fn peft_and_legacy_adapter_folders_round_trip() {
    let Some(lm) = lora_with_nonzero_b(Kind::Float) else { return };
    let base_dir = common::test_model_or_missing().unwrap();
    let want = lm.transformer().adapter_state();
    assert_eq!(want.len(), 30 * 14);
    let root = tempfile::tempdir().unwrap();
    let peft = root.path().join("peft");
    lm.save_adapters(&peft).unwrap();
    // The layout nextstate wrote before issue 16.
    let legacy = root.path().join("legacy");
    std::fs::create_dir_all(&legacy).unwrap();
    Tensor::write_safetensors(&want, legacy.join("adapter.safetensors")).unwrap();
    let old_cfg = serde_json::json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 20.0, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "base_model_name_or_path": base_dir.to_string_lossy(),
    });
    std::fs::write(legacy.join("adapter_config.json"), old_cfg.to_string()).unwrap();

    let ids = Tensor::from_slice(&lm.encode("The capital of France is").unwrap().iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]);
    let logits = |m: &LanguageModel| {
        let _g = tch::no_grad_guard();
        m.transformer().forward_logits(&ids).unwrap()
    };
    let trained = logits(&lm);
    for (dir, base) in [(&peft, None), (&legacy, Some(base_dir.as_path()))] {
        // As the trainer resumes (LoRA, trainable) and as `serve --model <ckpt>` loads (frozen).
        let back = LanguageModel::load_checkpoint(dir, base, &LoadOptions { trainable: Trainable::Lora(peft_cfg()), ..Default::default() }).unwrap();
        let got = back.transformer().adapter_state();
        assert_eq!(got.len(), want.len());
        for ((n1, t1), (n2, t2)) in want.iter().zip(&got) {
            assert_eq!(n1, n2);
            assert!(t1.equal(t2), "{}: {n1} differs after the round trip", dir.display());
        }
        let files = nextstate::model::peft::read_adapter_weights(dir).unwrap();
        assert!(files.iter().zip(&want).all(|((n1, t1), (n2, t2))| n1 == n2 && t1.equal(t2)));
        let frozen = LanguageModel::load_checkpoint(dir, base, &LoadOptions::default()).unwrap();
        assert_eq!((&logits(&frozen) - &trained).abs().max().double_value(&[]), 0.0, "{}", dir.display());
    }
}

/// The fixture of `scripts/peft_parity.py` (Python `peft` + `transformers` load our adapter and compare
/// logits): writes into `$NEXTSTATE_PEFT_PARITY_DIR` the PEFT folder `adapter/` (SmolLM2, r 8, α 20, B
/// nonzero) and `ours.safetensors` with `input_ids` `[1, L]` int64, `logits` `[1, L, V]` f32 of the
/// model with the adapters attached, `logits_merged` of the model as `serve` runs it (merged), and
/// `logits_base` of the base model alone (the runtimes' difference without any adapter).
#[test]
#[ignore = "writes the fixture of scripts/peft_parity.py; needs NEXTSTATE_PEFT_PARITY_DIR"]
fn peft_parity_fixture() {
    let out = PathBuf::from(std::env::var("NEXTSTATE_PEFT_PARITY_DIR").expect("set NEXTSTATE_PEFT_PARITY_DIR"));
    let Some(lm) = lora_with_nonzero_b(Kind::Float) else { return };
    let adapter = out.join("adapter");
    lm.save_adapters(&adapter).unwrap();
    let prompt = lm.chat_prompt_ids(&[Message::text("user", "Name three rivers of Europe and their seas.")], None, true).unwrap();
    let ids = Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]);
    let _g = tch::no_grad_guard();
    let logits = lm.transformer().forward_logits(&ids).unwrap();
    let mut served = LanguageModel::load_checkpoint(&adapter, Some(&common::test_model_or_missing().unwrap()), &LoadOptions::default()).unwrap();
    served.transformer_mut().merge_lora().unwrap();
    let merged = served.transformer().forward_logits(&ids).unwrap();
    let base = load(Trainable::Frozen).unwrap().transformer().forward_logits(&ids).unwrap();
    Tensor::write_safetensors(&[("input_ids", &ids), ("logits", &logits), ("logits_merged", &merged), ("logits_base", &base)], out.join("ours.safetensors")).unwrap();
}
