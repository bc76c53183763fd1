//! End-to-end trainer tests with a tiny policy (embedding + linear head over a 16-token vocabulary):
//! overfitting a fixed batch, checkpoints with lineage, bit-exact resume (f32 and bf16), LoRA-format
//! checkpoints, the loss report.

use std::time::Instant;

use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

use super::test_util::sample;
use super::*;
use crate::method::Method;
use crate::schema::{Sample, SampleType};
use crate::{Error, Result};

const V: i64 = 16;
const H: i64 = 8;

/// A bigram-style policy: the hidden state of a position is the embedding of its token.
struct Tiny {
    vs: VarStore,
    emb: nn::Embedding,
    head: nn::Linear,
}

/// Initialised from `seed` with our own generator (libtorch's global one is shared by parallel tests).
fn tiny(seed: u64) -> Tiny {
    use rand::{Rng, SeedableRng};
    let vs = VarStore::new(Device::Cpu);
    let emb = nn::embedding(vs.root() / "emb", V, H, Default::default());
    let head = nn::linear(vs.root() / "head", H, V, Default::default());
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    tch::no_grad(|| {
        for (_, mut t) in optim::trainable_named(&vs) {
            let vals: Vec<f32> = (0..t.numel()).map(|_| rng.gen_range(-0.5f32..0.5)).collect();
            t.copy_(&Tensor::from_slice(&vals).view(t.size().as_slice()));
        }
    });
    Tiny { vs, emb, head }
}

impl Policy for Tiny {
    fn var_store(&self) -> &VarStore {
        &self.vs
    }
    fn vocab_size(&self) -> usize {
        V as usize
    }
    fn response_hidden(&self, b: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>> {
        let _guard = (grad == Gradients::None).then(tch::no_grad_guard);
        let (bs, t) = (b.batch_size() as i64, b.max_response_len() as i64);
        let hidden = self.emb.forward(&b.input_ids);
        let idx = b.predict_positions.f_unsqueeze(-1)?.f_expand([bs, t, H], false)?;
        HiddenPass::from_graph(hidden.f_gather(1, &idx, false)?)
    }
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.head.forward(hidden))
    }
}

fn weights(p: &Tiny) -> Vec<(String, Tensor)> {
    optim::trainable_named(&p.vs).into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
}

fn same_weights(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((na, ta), (nb, tb))| na == nb && ta.equal(tb))
}

/// Sets each sample's rollout log-probs to the policy's current ones (on-policy samples), and, when
/// `teacher_shift` is given, teacher log-probs = rollout + shift.
fn score(p: &Tiny, samples: &mut [Sample]) {
    let opts = PackOptions { method: Method::Binary, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: quiet() };
    let as_binary: Vec<Sample> = samples.iter().map(|s| Sample { sample_type: SampleType::Binary, ..s.clone() }).collect();
    let batch = pack_samples(&as_binary, &opts).unwrap().batch.unwrap();
    let lp = p.response_logprobs(&batch).unwrap();
    let rows = Vec::<Vec<f32>>::try_from(&lp).unwrap();
    for (s, row) in samples.iter_mut().zip(rows) {
        s.rollout_logprobs = row[..s.response_token_ids.len()].to_vec();
    }
}

fn binary_batch(p: &Tiny) -> Vec<Sample> {
    let mut v = vec![
        sample("b1", SampleType::Binary, &[1, 2], &[3, 4, 5], &[0.0; 3], 1.0),
        sample("b2", SampleType::Binary, &[6], &[7, 8], &[0.0; 2], -1.0),
        sample("b3", SampleType::Binary, &[9, 10, 11], &[12], &[0.0], 1.0),
        sample("b4", SampleType::Binary, &[13], &[14, 15, 1, 2], &[0.0; 4], -1.0),
    ];
    for (i, s) in v.iter_mut().enumerate() {
        s.source_offset = Some(100 + i as i64);
    }
    score(p, &mut v);
    v
}

/// The defaults with the quarantine off: the toy policies' hand-made rollout log-probs are far from
/// their own, and some responses are one token (the quarantine has its own tests).
fn quiet() -> TrainerConfig {
    TrainerConfig { quarantine: QuarantineSettings::off(), ..TrainerConfig::default() }
}

fn cfg(lr: f64) -> TrainerConfig {
    TrainerConfig { lr, weight_decay: 0.0, ..quiet() }
}

#[test]
fn binary_ppo_overfits_a_fixed_batch() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(1);
    let samples = binary_batch(&p);
    let mut t = Trainer::new(p, Method::Binary, TrainerConfig { checkpoint_every: 1000, ..cfg(0.05) }, CheckpointWriter::new(dir.path(), "run")).unwrap();
    let mut losses = Vec::new();
    for _ in 0..20 {
        let out = t.train_step(&samples).unwrap();
        assert!(out.dropped.is_empty());
        losses.push(out.train_step.unwrap().loss);
    }
    // Step 1 is on-policy: ratio 1, L_t = −A_t, so loss = −1 + 1 − 1 + 1 = 0 and nothing is clipped.
    assert!(losses[0].abs() < 1e-6, "{losses:?}");
    // Then the rewarded samples' ratios rise toward 1.28 and the punished ones' fall toward 0.8: the
    // loss (the mean over the 4 samples) falls toward (2·(−1.28) + 2·(0.8))/4 = −0.24, its floor under
    // the clip.
    assert!(losses[19] < -0.125, "{losses:?}");
    assert!(losses[19] >= -0.24 - 1e-6, "{losses:?}");
    assert!(losses.windows(2).filter(|w| w[1] > w[0] + 1e-6).count() <= 2, "mostly decreasing: {losses:?}");
}

#[test]
fn opd_topk_distillation_overfits_a_fixed_batch() {
    // Teacher top-3 at every position: ids 3, 4, 5 with probabilities 0.6, 0.2, 0.1 (tail 0.1).
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(2);
    let mut samples = vec![
        sample("o1", SampleType::Opd, &[1, 2], &[3, 4, 5], &[0.0; 3], 0.0),
        sample("o2", SampleType::Opd, &[6], &[7, 8], &[0.0; 2], 0.0),
    ];
    score(&p, &mut samples);
    for s in &mut samples {
        let t = s.response_token_ids.len();
        s.teacher_logprobs = Some(s.rollout_logprobs.clone());
        s.topk_ids = Some(vec![vec![3, 4, 5]; t]);
        s.topk_logprobs = Some(vec![vec![0.6f32.ln(), 0.2f32.ln(), 0.1f32.ln()]; t]);
    }
    let c = TrainerConfig { opd_loss: OpdLoss::Topk, checkpoint_every: 1000, ..cfg(0.02) };
    let mut t = Trainer::new(p, Method::Opd, c, CheckpointWriter::new(dir.path(), "run")).unwrap();
    let mut kls = Vec::new();
    for _ in 0..20 {
        let row = t.train_step(&samples).unwrap().train_step.unwrap();
        // opd + topk: A = 0, so the loss is the top-K term alone.
        assert!((row.loss - row.topk_kl).abs() < 1e-6 && row.pg_loss == 0.0, "{row:?}");
        kls.push(row.topk_kl);
    }
    assert!(kls[19] < 0.2 * kls[0], "top-K KL should fall by > 80 %: {kls:?}");
    assert!(kls.windows(2).all(|w| w[1] < w[0]), "decreasing: {kls:?}");
}

#[test]
fn train_step_row_and_drops() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(3);
    let mut samples = binary_batch(&p);
    let mut bad = samples[0].clone();
    bad.sample_id = "bad".into();
    bad.response_token_ids = vec![99];
    bad.loss_mask = vec![1];
    bad.rollout_logprobs = vec![-1.0];
    samples.push(bad);
    let mut t = Trainer::new(p, Method::Binary, TrainerConfig { checkpoint_every: 1000, ..cfg(0.01) }, CheckpointWriter::new(dir.path(), "r1")).unwrap();
    let (m, oov) = (crate::metrics::get(), vec![("reason", "token_out_of_vocab".to_string())]);
    let before = (m.trainer_steps.get(), m.trainer_skipped_samples.get_or_create(&oov).get());
    let out = t.train_step(&samples).unwrap();
    // The process-wide metrics moved (at least: other tests of this process may train too).
    assert!(m.trainer_steps.get() > before.0 && m.trainer_skipped_samples.get_or_create(&oov).get() > before.1);
    assert_eq!(out.dropped.len(), 1);
    assert_eq!((out.dropped[0].index, out.dropped[0].reason), (4, DropReason::TokenOutOfVocab));
    let row = out.train_step.unwrap();
    assert_eq!((row.step_id.as_str(), row.step, row.version, row.samples, row.tokens), ("r1/1", 1, 1, 4, 10));
    assert_eq!(row.method, "binary");
    // On-policy rollout log-probs: |rollout − current| is f32 round-off only, nothing clipped, ppo_kl 0.
    assert!(row.rollout_logprob_abs_diff < 1e-6 && row.clip_fraction == 0.0 && row.ppo_kl.abs() < 1e-6, "{row:?}");
    let adv: std::collections::BTreeMap<String, f64> = serde_json::from_str(&row.advantage_by_type).unwrap();
    // Two samples with A = +1 and two with −1: mean 0; A > 0 on b1, b3 (4 of 10 tokens), A < 0 on 6.
    assert_eq!(adv["binary"], 0.0);
    let f = (row.reward_mean, row.reward_std, row.learning_rate, row.response_length_mean, row.response_length_max, row.staleness_max);
    assert_eq!(f, (Some(0.0), Some(1.0), Some(0.01), Some(2.5), Some(4), Some(0)));
    assert_eq!((row.positive_advantage_fraction, row.negative_advantage_fraction), (Some(0.4), Some(0.6)));
    assert!(row.grad_norm > 0.0 && row.seconds > 0.0 && row.tokens_per_second.is_some_and(|x| x > 0.0));
    // All dropped: no step.
    let out = t.train_step(&samples[4..]).unwrap();
    assert!(out.train_step.is_none() && out.dropped.len() == 1);
    assert_eq!(t.step(), 1);
}

#[test]
fn checkpoints_lineage_and_bit_exact_resume() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(4);
    let samples = binary_batch(&p);
    let c = TrainerConfig { checkpoint_every: 2, ..cfg(0.01) };
    let mut a = Trainer::new(p, Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "run")).unwrap();
    let mut written = Vec::new();
    for i in 0..4 {
        // Steps 1 and 3 take samples b1, b2; steps 2 and 4 take b3, b4 plus an out-of-vocabulary one.
        let mut batch = if i % 2 == 0 { samples[..2].to_vec() } else { samples[2..].to_vec() };
        if i % 2 == 1 {
            let mut bad = samples[0].clone();
            bad.sample_id = format!("bad{i}");
            bad.prompt_token_ids = vec![16];
            batch.push(bad);
        }
        let out = a.train_step(&batch).unwrap();
        assert_eq!(out.checkpoint.is_some(), i % 2 == 1, "checkpoint every 2 steps");
        written.extend(out.checkpoint);
    }
    assert_eq!(written.len(), 2);
    let m1 = &written[0].manifest;
    assert_eq!((m1.version, m1.parent_version, m1.step, m1.weights_format.as_str()), (1, 0, 2, "full"));
    assert_eq!(m1.weight_files, vec!["model.safetensors".to_string()]);
    assert_eq!(m1.metrics.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1, 2]);
    let ids: Vec<(&str, bool, Option<i64>)> = m1.lineage.iter().map(|l| (l.sample_id.as_str(), l.trained, l.source_offset)).collect();
    assert_eq!(ids, vec![("b1", true, Some(100)), ("b2", true, Some(101)), ("b3", true, Some(102)), ("b4", true, Some(103)), ("bad1", false, Some(100))]);
    assert_eq!(m1.lineage[4].drop_reason.as_deref(), Some("token_out_of_vocab"));
    assert_eq!(written[0].row.samples, 4);
    assert_eq!(written[0].row.checkpoint_id, "run/1");
    assert_eq!((written[1].manifest.version, written[1].manifest.parent_version, written[1].manifest.step), (2, 1, 4));
    assert!(dir.path().join("run/2/manifest.json").is_file() && dir.path().join("run/2/optimizer/optimizer.safetensors").is_file());
    // The TrainStep version of step 3 was 2 (the checkpoint it led to).
    assert_eq!(a.version(), 2);

    // Resume a differently initialised policy: weights, moments, step and version come back.
    let at_4 = weights(a.policy());
    let (mut b, resumed) = Trainer::resume(tiny(99), Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "run")).unwrap();
    assert_eq!(resumed.from.as_ref().map(|(_, m)| m.version), Some(2));
    assert_eq!(resumed.consumed, ["b1", "b2", "b3", "b4", "bad1", "bad3"].iter().map(|s| s.to_string()).collect());
    assert_eq!((b.step(), b.version(), b.optimizer().steps()), (4, 2, 4));
    assert!(same_weights(&weights(b.policy()), &at_4));
    // The next step from the resumed trainer equals the next step of the uninterrupted one, bit for bit.
    let ra = a.train_step(&samples).unwrap().train_step.unwrap();
    let rb = b.train_step(&samples).unwrap().train_step.unwrap();
    assert_eq!((ra.loss, ra.grad_norm, ra.step, ra.version), (rb.loss, rb.grad_norm, rb.step, rb.version));
    assert!(same_weights(&weights(a.policy()), &weights(b.policy())));
    // A fresh trainer refuses a run that has checkpoints; another method cannot resume it.
    assert!(Trainer::new(tiny(5), Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "run")).unwrap_err().to_string().contains("resume"));
    assert!(Trainer::resume(tiny(5), Method::Opd, c, CheckpointWriter::new(dir.path(), "run")).is_err());
}

/// [`tiny`] with its tensors cast to bf16 (as a policy loaded with `dtype = "bf16"`).
fn tiny_bf16(seed: u64) -> Tiny {
    let mut p = tiny(seed);
    p.vs.bfloat16();
    p
}

#[test]
fn bf16_training_keeps_small_updates_and_resumes_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_bf16(4);
    let start = weights(&p);
    let samples = binary_batch(&p);
    let c = TrainerConfig { checkpoint_every: 2, ..cfg(1e-5) };
    let mut a = Trainer::new(p, Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "run")).unwrap();
    for _ in 0..2 {
        a.train_step(&samples).unwrap();
    }
    assert_eq!(a.version(), 1, "checkpoint after step 2");
    let at_2 = weights(a.policy());
    assert!(at_2.iter().all(|(_, t)| t.kind() == Kind::BFloat16), "checkpointed weights stay bf16");
    // lr 1e-5 moves the bf16 weights whose half-ulp is below 2e-5 (|w| ≲ 0.01) …
    let moved: i64 = start.iter().zip(&at_2).map(|((_, s), (_, t))| s.ne_tensor(t).sum(Kind::Int64).int64_value(&[])).sum();
    assert!(moved > 0, "no bf16 weight moved in 2 steps at lr 1e-5");
    // … and the rest of the update waits in the f32 masters, which the rounded weights do not hold.
    let opt = a.optimizer();
    let unrounded: i64 = opt.names().iter().map(|n| {
        let m = opt.master(n).unwrap();
        m.ne_tensor(&m.to_kind(Kind::BFloat16).to_kind(Kind::Float)).sum(Kind::Int64).int64_value(&[])
    }).sum();
    assert!(unrounded > 0, "every master is on the bf16 grid ({moved} weights moved)");

    // Resume from the checkpoint (bf16 weights + f32 masters in the optimizer state) into another
    // initialisation: the masters come back, and the next step equals the uninterrupted one bit for bit.
    let (mut b, _) = Trainer::resume(tiny_bf16(99), Method::Binary, c, CheckpointWriter::new(dir.path(), "run")).unwrap();
    assert!(same_weights(&weights(b.policy()), &at_2));
    for n in a.optimizer().names() {
        assert!(a.optimizer().master(n).unwrap().equal(b.optimizer().master(n).unwrap()), "{n}: master not restored");
    }
    let ra = a.train_step(&samples).unwrap().train_step.unwrap();
    let rb = b.train_step(&samples).unwrap().train_step.unwrap();
    assert_eq!((ra.loss, ra.grad_norm, ra.step), (rb.loss, rb.grad_norm, rb.step));
    assert!(same_weights(&weights(a.policy()), &weights(b.policy())));
    for n in a.optimizer().names() {
        assert!(a.optimizer().master(n).unwrap().equal(b.optimizer().master(n).unwrap()), "{n}: master differs after the resumed step");
    }
}

#[test]
fn lora_checkpoints_hold_only_the_trainable_tensors() {
    // The "base" (embedding) is frozen; the head plays the adapters.
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(6);
    for (name, mut t) in p.vs.variables() {
        if name.starts_with("emb") {
            let _ = t.requires_grad_(false);
        }
    }
    let samples = binary_batch(&p);
    let emb_before = p.emb.ws.copy();
    let c = TrainerConfig { lora: LoraSettings { enabled: true, ..Default::default() }, ..cfg(0.01) };
    let mut t = Trainer::new(p, Method::Binary, c, CheckpointWriter::new(dir.path(), "lora")).unwrap();
    assert_eq!(t.optimizer().names(), vec!["head.bias", "head.weight"]);
    let ck = t.train_step(&samples).unwrap().checkpoint.unwrap();
    assert_eq!((ck.manifest.weights_format.as_str(), ck.row.weights_format.as_str()), ("lora", "lora"));
    let file = Tensor::read_safetensors(ck.path.join("adapter.safetensors")).unwrap();
    let mut names: Vec<String> = file.into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(names, vec!["head.bias", "head.weight"]);
    assert!(t.policy().emb.ws.equal(&emb_before), "the frozen base does not move");
}

#[test]
fn loss_report_matches_hand_values_and_leaves_weights_alone() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(7);
    let mut samples = binary_batch(&p);
    samples[3].policy_version = Some(-5);
    let c = TrainerConfig { batch_size: 3, max_staleness: Some(2), ..cfg(0.01) };
    let t = Trainer::new(p, Method::Binary, c, CheckpointWriter::new(dir.path(), "rep")).unwrap();
    let before = weights(t.policy());
    let report = t.loss_report(&samples).unwrap();
    assert!(same_weights(&before, &weights(t.policy())));
    // On-policy samples: ratio 1, so pg = −A = −r per sample; b4 is 5 versions old → dropped as stale.
    let got: Vec<(&str, f64, f64, i64)> = report.samples.iter().map(|s| (s.sample_id.as_str(), s.advantage, s.pg_loss, s.tokens)).collect();
    let want = [("b1", 1.0, -1.0, 3), ("b2", -1.0, 1.0, 2), ("b3", 1.0, -1.0, 1)];
    assert_eq!(got.len(), 3);
    for (g, w) in got.iter().zip(want) {
        assert!(g.0 == w.0 && (g.1 - w.1).abs() < 1e-6 && (g.2 - w.2).abs() < 1e-5 && g.3 == w.3, "{got:?}");
    }
    assert!(report.samples.iter().all(|s| s.entropy > 0.0 && s.entropy <= (16f64).ln() + 1e-6));
    assert_eq!((report.dropped.len(), report.dropped[0].index, report.dropped[0].reason), (1, 3, DropReason::Stale));
    // Chunks of 3: [b1, b2, b3] and [b4] (dropped → no metrics).
    assert_eq!(report.batches.len(), 1);
    // The batch's pg_loss is the mean over its samples of each sample's token mean: (−1 + 1 − 1)/3.
    assert!((report.batches[0].pg_loss - (-1.0 / 3.0)).abs() < 1e-6, "{}", report.batches[0].pg_loss);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["dropped"][0]["reason"], "stale");
    assert_eq!(json["samples"][0]["sample_type"], "binary");
}

/// The loss report shows each sample's |rollout − current| gap, the quantity of the `logprob_gap`
/// quarantine rule, and whether a training step would quarantine it (bound 2 nats, the default; the
/// other rules off: b3's response is one token).
#[test]
fn loss_report_shows_the_logprob_gap_of_the_quarantine_rule() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(7);
    let mut samples = binary_batch(&p);
    samples.truncate(3);
    // b1's rollout log-probs 0.5 nats above the policy's, b2's 3 below, b3 on-policy.
    for (s, shift) in samples.iter_mut().zip([0.5f32, -3.0, 0.0]) {
        s.rollout_logprobs.iter_mut().for_each(|l| *l += shift);
    }
    let c = TrainerConfig { batch_size: 3, quarantine: QuarantineSettings { max_logprob_gap: 2.0, ..QuarantineSettings::off() }, ..cfg(0.01) };
    let t = Trainer::new(p, Method::Binary, c, CheckpointWriter::new(dir.path(), "gap")).unwrap();
    let report = t.loss_report(&samples).unwrap();
    let got: Vec<(&str, f64, bool)> = report.samples.iter().map(|s| (s.sample_id.as_str(), s.logprob_gap, s.over_gap_bound)).collect();
    let want = [("b1", 0.5, false), ("b2", 3.0, true), ("b3", 0.0, false)];
    for (g, w) in got.iter().zip(want) {
        assert!(g.0 == w.0 && (g.1 - w.1).abs() < 1e-5 && g.2 == w.2, "{got:?}");
    }
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["samples"][1]["over_gap_bound"], true);
}

#[test]
fn recompute_old_logprobs_makes_the_step_on_policy() {
    // Rollout log-probs far from the policy's (all −0.1): without recomputation the ratios are far from 1
    // and clip; with it, ratio = 1 everywhere and the gap is reported.
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(8);
    let mut samples = binary_batch(&p);
    for s in &mut samples {
        s.rollout_logprobs = vec![-0.1; s.len()];
    }
    let c = TrainerConfig { recompute_old_logprobs: true, checkpoint_every: 1000, ..cfg(0.01) };
    let mut t = Trainer::new(p, Method::Binary, c, CheckpointWriter::new(dir.path(), "rc")).unwrap();
    let row = t.train_step(&samples).unwrap().train_step.unwrap();
    assert_eq!(row.clip_fraction, 0.0);
    assert!(row.ppo_kl.abs() < 1e-7 && row.loss.abs() < 1e-6, "{row:?}");
    // The tiny policy's log-probs are around ln(1/16) = −2.77, so the gap is about 2.7 nats.
    assert!(row.rollout_logprob_abs_diff > 1.5, "{row:?}");
}

#[test]
fn kl_needs_a_reference_and_uses_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(9);
    let samples = binary_batch(&p);
    let c = TrainerConfig { kl_coef: 0.5, checkpoint_every: 1000, ..cfg(0.01) };
    let mut t = Trainer::new(p, Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "kl")).unwrap();
    assert!(t.train_step(&samples).unwrap_err().to_string().contains("reference"));
    // Reference = a copy of the initial policy: KL 0 at step 1 (k3 of identical distributions).
    let mut t = Trainer::new(tiny(9), Method::Binary, c, CheckpointWriter::new(dir.path(), "kl2")).unwrap().with_reference(Box::new(tiny(9)));
    let r1 = t.train_step(&samples).unwrap().train_step.unwrap();
    assert!(r1.kl.abs() < 1e-9, "{r1:?}");
    let r2 = t.train_step(&samples).unwrap().train_step.unwrap();
    assert!(r2.kl > 0.0, "{r2:?}");
}

/// Timing at the real vocabulary size (SmolLM2's 49,152): a 16-sample batch of 64 prompt + 128 response
/// tokens through an embedding+linear policy (H = 64, 6.3 M parameters), top-K 20, combined method.
/// `cargo test --lib trainer::tests::timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn timing_at_real_vocabulary_size() {
    const BIG_V: i64 = 49_152;
    struct Big {
        vs: VarStore,
        emb: nn::Embedding,
        head: nn::Linear,
    }
    impl Policy for Big {
        fn var_store(&self) -> &VarStore {
            &self.vs
        }
        fn vocab_size(&self) -> usize {
            BIG_V as usize
        }
        fn response_hidden(&self, b: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>> {
            let _guard = (grad == Gradients::None).then(tch::no_grad_guard);
            let (bs, t) = (b.batch_size() as i64, b.max_response_len() as i64);
            let idx = b.predict_positions.f_unsqueeze(-1)?.f_expand([bs, t, 64], false)?;
            HiddenPass::from_graph(self.emb.forward(&b.input_ids).f_gather(1, &idx, false)?)
        }
        fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
            Ok(self.head.forward(hidden))
        }
    }
    fn big() -> Big {
        let vs = VarStore::new(Device::Cpu);
        let emb = nn::embedding(vs.root() / "emb", BIG_V, 64, Default::default());
        let head = nn::linear(vs.root() / "head", 64, BIG_V, Default::default());
        Big { vs, emb, head }
    }
    let samples: Vec<Sample> = (0..16)
        .map(|i| {
            let prompt: Vec<i32> = (0..64).map(|j| (i * 997 + j * 31) % 49_152).collect();
            let resp: Vec<i32> = (0..128).map(|j| (i * 7919 + j * 131) % 49_152).collect();
            let mut s = sample(&format!("s{i}"), SampleType::CombinedBoth, &prompt, &resp, &[-10.8; 128], 1.0);
            s.teacher_logprobs = Some(vec![-10.5; 128]);
            s.topk_ids = Some((0..128).map(|j| (0..20).map(|k| (j * 20 + k) % 49_152).collect()).collect());
            s.topk_logprobs = Some(vec![(1..=20).map(|k| -(k as f32)).collect(); 128]);
            s
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for opd_loss in [OpdLoss::Ppo, OpdLoss::Both] {
        let c = TrainerConfig { opd_loss, checkpoint_every: 2, ..quiet() };
        let mut t = Trainer::new(big(), Method::Combined, c, CheckpointWriter::new(dir.path(), opd_loss.as_str())).unwrap();
        let mut secs = Vec::new();
        for _ in 0..4 {
            let started = Instant::now();
            let out = t.train_step(&samples).unwrap();
            secs.push(started.elapsed().as_secs_f64());
            assert!(out.train_step.unwrap().loss.is_finite());
        }
        let started = Instant::now();
        let packed = pack_samples(&samples, &t.pack_options()).unwrap();
        let pack_s = started.elapsed().as_secs_f64();
        let b = packed.batch.unwrap();
        let started = Instant::now();
        let _ = tch::no_grad(|| t.policy().response_logprobs(&b).unwrap());
        let fwd_s = started.elapsed().as_secs_f64();
        eprintln!("opd_loss={}: step seconds {secs:.3?} (steps 2 and 4 also write a 75 MB checkpoint: 25 MB weights, 50 MB moments); pack {pack_s:.4} s; forward alone {fwd_s:.3} s", opd_loss.as_str());
    }
}

/// Gradients of every trainable tensor, by name (`None` where no gradient flowed).
fn grads(p: &Tiny) -> Vec<(String, Option<Tensor>)> {
    optim::trainable_named(&p.vs).into_iter().map(|(n, t)| {
        let g = t.grad();
        (n, g.defined().then(|| g.copy()))
    }).collect()
}

fn max_rel_diff(a: &[(String, Option<Tensor>)], b: &[(String, Option<Tensor>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for ((na, ga), (nb, gb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let (ga, gb) = (ga.as_ref().unwrap_or_else(|| panic!("no gradient for {na}")), gb.as_ref().unwrap_or_else(|| panic!("no gradient for {nb}")));
        let scale = ga.abs().max().double_value(&[]).max(1e-12);
        worst = worst.max((ga - gb).abs().max().double_value(&[]) / scale);
    }
    worst
}

/// Samples of different lengths with teacher log-probs and top-3 lists (combined: two with a hint, one
/// score-only), rollout = the policy's own log-probs shifted so ratios differ from 1.
fn combined_batch(p: &Tiny) -> Vec<Sample> {
    let mut v = vec![
        sample("c1", SampleType::CombinedBoth, &[1, 2], &[3, 4, 5, 6, 7], &[0.0; 5], 1.0),
        sample("c2", SampleType::CombinedBoth, &[6], &[7, 8], &[0.0; 2], -1.0),
        sample("c3", SampleType::CombinedScoreOnly, &[9, 10, 11], &[12, 13, 14], &[0.0; 3], 1.0),
        sample("c4", SampleType::CombinedBoth, &[13, 2, 2, 2], &[14], &[0.0], -1.0),
    ];
    score(p, &mut v);
    for (i, s) in v.iter_mut().enumerate() {
        let t = s.response_token_ids.len();
        for (j, x) in s.rollout_logprobs.iter_mut().enumerate() {
            *x += 0.3 * ((i + j) % 3) as f32 - 0.3;
        }
        s.teacher_logprobs = Some(if s.sample_type == SampleType::CombinedScoreOnly {
            s.rollout_logprobs.clone()
        } else {
            s.rollout_logprobs.iter().enumerate().map(|(j, x)| x + 0.3 - 0.2 * j as f32).collect()
        });
        s.topk_ids = Some((0..t).map(|j| vec![(3 + j) as i32 % 16, (5 + 2 * j) as i32 % 16, 1]).collect());
        s.topk_logprobs = Some(vec![vec![0.5f32.ln(), 0.2f32.ln(), 0.1f32.ln()]; t]);
        s.loss_mask = (0..t).map(|j| if i == 0 && j == 2 { 0 } else { 1 }).collect();
    }
    v
}

#[test]
fn chunked_gradients_equal_the_unchunked_loss() {
    // The reference: the whole [B, T, V] log-softmax of the tiny policy built directly from its
    // embedding and head, one compute_loss over the batch (mean of sample means over B = 4), backward.
    let c = TrainerConfig { opd_loss: OpdLoss::Both, entropy_coef: 0.01, ..cfg(0.01) };
    let lcfg = c.loss_config(Method::Combined);
    let reference = tiny(11);
    let samples = combined_batch(&reference);
    let opts = PackOptions { method: Method::Combined, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: c.clone() };
    let b = pack_samples(&samples, &opts).unwrap().batch.unwrap();
    let (bs, t) = (b.batch_size() as i64, b.max_response_len() as i64);
    let idx = b.predict_positions.unsqueeze(-1).expand([bs, t, H], false);
    let full = reference.head.forward(&reference.emb.forward(&b.input_ids).gather(1, &idx, false)).log_softmax(-1, tch::Kind::Float);
    let new = full.gather(2, &b.response_ids.unsqueeze(-1), false).squeeze_dim(-1);
    let ent = loss::entropy(&full).unwrap();
    let student = full.gather(2, b.topk_ids.as_ref().unwrap(), false);
    let inputs = loss::LossInputs {
        new_logprobs: &new,
        old_logprobs: &b.old_logprobs,
        teacher_logprobs: b.teacher_logprobs.as_ref(),
        reward: &b.reward,
        mask: &b.loss_mask,
        sample_types: &b.sample_types,
        sample_weights: Some(&b.sample_weight),
        advantage_signs: Some(&b.advantage_sign),
        ref_logprobs: None,
        entropy: Some(&ent),
        topk: Some(loss::TopkInputs { student: &student, teacher: b.topk_logprobs.as_ref().unwrap(), mask: b.topk_mask.as_ref().unwrap(), subset: None }),
        sample_tokens: None,
        num_samples: None,
    };
    let want = loss::compute_loss(&lcfg, &inputs).unwrap();
    want.loss.backward();
    let want_grads = grads(&reference);
    assert!(want.metrics.loss.is_finite() && want.metrics.topk_kl > 0.0 && want.metrics.clip_fraction > 0.0, "{:?}", want.metrics);

    // Chunked: head chunks of 1, 2, 3 and 64 rows; micro-batches of 6 and 4096 tokens.
    for (chunk, micro) in [(1, 4096), (2, 6), (3, 6), (64, 4096)] {
        let p = tiny(11);
        let c = TrainerConfig { logits_chunk_tokens: chunk, micro_batch_tokens: micro, ..c.clone() };
        let acc = accumulate_gradients(&p, None, Method::Combined, &c, 0, &samples).unwrap();
        let m = acc.metrics.unwrap();
        assert!(acc.dropped.is_empty());
        assert!((m.loss - want.metrics.loss).abs() < 1e-6, "chunk {chunk}, micro {micro}: loss {} vs {}", m.loss, want.metrics.loss);
        assert!((m.pg_loss - want.metrics.pg_loss).abs() < 1e-6 && (m.topk_kl - want.metrics.topk_kl).abs() < 1e-6 && (m.entropy - want.metrics.entropy).abs() < 1e-6);
        assert!((m.clip_fraction - want.metrics.clip_fraction).abs() < 1e-9 && m.tokens == want.metrics.tokens && m.samples == 4);
        let d = max_rel_diff(&grads(&p), &want_grads);
        assert!(d <= 1e-5, "chunk {chunk}, micro {micro}: gradients differ by {d:e} (relative)");
    }
}

#[test]
fn micro_batches_group_by_length_and_keep_every_sample_once() {
    let lens = [10usize, 3, 7, 3, 12, 1];
    let samples: Vec<Sample> = lens.iter().enumerate().map(|(i, &n)| sample(&format!("m{i}"), SampleType::Binary, &vec![1; n], &[2], &[0.0], 1.0)).collect();
    // Lengths (prompt + 1): 11, 4, 8, 4, 13, 2. Sorted: 5(2), 1(4), 3(4), 2(8), 0(11), 4(13).
    // Budget 12: [5, 1, 3] (3 × 4 = 12), [2] (2 × 11 > 12 → alone), [0], [4] (13 > 12, alone).
    assert_eq!(micro_batches(&samples, 12), vec![vec![1, 3, 5], vec![2], vec![0], vec![4]]);
    let mut all: Vec<usize> = micro_batches(&samples, 30).into_iter().flatten().collect();
    all.sort_unstable();
    assert_eq!(all, (0..6).collect::<Vec<_>>());
}

/// OPD samples o1..o3 on the policy's own log-probs, teacher = rollout + 0.1 at every token (so each
/// token's advantage is 0.1); `poison` gives the sample at that index a teacher log-prob of `f32::MIN`
/// (−3.4028235e38, the "log 0" some teacher servers send instead of −inf, which JSON cannot carry) at
/// every token: finite, so packing keeps it, but its advantage −3.4e38 makes the per-token PPO loss
/// ≈ 3.4e38 and the sum over its tokens overflows to +inf.
fn opd_batch(p: &Tiny, poison: &[usize]) -> Vec<Sample> {
    let mut v = vec![
        sample("o1", SampleType::Opd, &[1, 2], &[3, 4, 5], &[0.0; 3], 0.0),
        sample("o2", SampleType::Opd, &[6], &[7, 8], &[0.0; 2], 0.0),
        sample("o3", SampleType::Opd, &[9, 10], &[11, 12], &[0.0; 2], 0.0),
    ];
    score(p, &mut v);
    for (i, s) in v.iter_mut().enumerate() {
        s.source_offset = Some(200 + i as i64);
        s.teacher_logprobs = Some(if poison.contains(&i) { vec![f32::MIN; s.len()] } else { s.rollout_logprobs.iter().map(|x| x + 0.1).collect() });
    }
    v
}

/// docs/method.md §6, the reference's OPD target: `teacher − π_θ` with π_θ the weights being trained. A real
/// optimizer step on a teacher below the policy lowers the policy's log-probs, and the loss report's
/// advantage of every token rises by exactly that amount; off-policy rollout log-probs never enter it.
#[test]
fn opd_advantage_is_teacher_minus_the_current_policy_across_a_step() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(11);
    let mut samples = opd_batch(&p, &[]);
    for s in &mut samples {
        // The teacher 0.3 nats below the policy on every token, the rollout log-probs 0.4 nats off it.
        s.teacher_logprobs = Some(s.rollout_logprobs.iter().map(|x| x - 0.3).collect());
        s.rollout_logprobs = s.rollout_logprobs.iter().map(|x| x - 0.4).collect();
    }
    let c = TrainerConfig { checkpoint_every: 1000, ..cfg(0.05) };
    let mut t = Trainer::new(p, Method::Opd, c, CheckpointWriter::new(dir.path(), "opd-target")).unwrap();
    let before = t.loss_report(&samples).unwrap();
    t.train_step(&samples).unwrap();
    let after = t.loss_report(&samples).unwrap();
    let mut lowered = 0;
    for (s, (b, a)) in samples.iter().zip(before.samples.iter().zip(&after.samples)) {
        assert_eq!((b.sample_id.as_str(), a.sample_id.as_str()), (s.sample_id.as_str(), s.sample_id.as_str()));
        let teacher = s.teacher_logprobs.as_ref().unwrap();
        assert_eq!(a.teacher_logprobs.as_ref().unwrap().len(), teacher.len());
        for i in 0..s.response_token_ids.len() {
            // Before the step the policy is where the rollout would have been: A = −0.3.
            assert!((b.token_advantages[i] + 0.3).abs() < 1e-5, "{b:?}");
            assert!((a.token_advantages[i] - (f64::from(teacher[i]) - a.student_logprobs[i])).abs() < 1e-5, "{a:?}");
            let moved = a.student_logprobs[i] - b.student_logprobs[i];
            assert!((a.token_advantages[i] - b.token_advantages[i] + moved).abs() < 1e-5, "{b:?} {a:?}");
            lowered += usize::from(moved < -1e-3);
        }
    }
    // The step moved the policy: most of the 7 tokens went down.
    assert!(lowered >= 4, "{lowered} of 7 tokens lowered");
}

/// `trainer.temperature`: the trainer's log-probs are the log-softmax of `logits / T` (by hand from the
/// tiny policy's embedding and head), and the OPD advantage compares the teacher with them.
#[test]
fn the_trainer_scores_and_trains_the_distribution_at_its_temperature() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(12);
    let mut samples = opd_batch(&p, &[]);
    // By hand for o1 (prompt [1, 2], response [3, 4, 5]): the positions predicting 3, 4, 5 read 2, 3, 4.
    let logits = p.head.forward(&p.emb.forward(&Tensor::from_slice(&[2i64, 3, 4])));
    let want: Vec<f32> = Vec::<f32>::try_from(&(logits / 0.6).log_softmax(-1, Kind::Float).gather(1, &Tensor::from_slice(&[3i64, 4, 5]).unsqueeze(-1), false).squeeze_dim(-1)).unwrap();
    for s in &mut samples {
        s.teacher_logprobs = Some(vec![-1.0; s.len()]);
    }
    let c = TrainerConfig { temperature: 0.6, recompute_old_logprobs: true, checkpoint_every: 1000, ..cfg(0.05) };
    let t = Trainer::new(p, Method::Opd, c, CheckpointWriter::new(dir.path(), "temp")).unwrap();
    let r = t.loss_report(&samples).unwrap();
    let o1 = r.samples.iter().find(|s| s.sample_id == "o1").unwrap();
    for i in 0..3 {
        assert!((o1.student_logprobs[i] - f64::from(want[i])).abs() < 1e-6, "{:?} vs {want:?}", o1.student_logprobs);
        assert!((o1.token_advantages[i] - (-1.0 - f64::from(want[i]))).abs() < 1e-6, "{o1:?}");
    }
    // At temperature 1 the same weights give other log-probs (the rollout ones).
    assert!((f64::from(samples[0].rollout_logprobs[0]) - o1.student_logprobs[0]).abs() > 1e-3);
}

#[test]
fn f32_min_teacher_logprob_passes_packing_and_makes_the_loss_infinite() {
    let p = tiny(20);
    let samples = opd_batch(&p, &[1]);
    let opts = PackOptions { method: Method::Opd, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: quiet() };
    assert!(pack_samples(&samples, &opts).unwrap().dropped.is_empty(), "a finite teacher log-prob is not a packing error");
    let r = loss_report(&p, None, Method::Opd, &quiet(), 0, &samples).unwrap();
    // On-policy (ratio 1): o1, o3 have pg = −0.1 (mean of −A); o2 = (3.4e38 + 3.4e38) / 2 overflows.
    assert!((r.samples[0].pg_loss + 0.1).abs() < 1e-6 && (r.samples[2].pg_loss + 0.1).abs() < 1e-6, "{:?}", r.samples);
    // Its per-token advantage is f32::MIN − old = f32::MIN (rounded), whose f32 sum over its 2 tokens
    // is already −inf.
    assert_eq!(r.samples[1].advantage, f64::NEG_INFINITY);
    assert_eq!(r.samples[1].loss, f64::INFINITY);
    assert_eq!(r.batches[0].loss, f64::INFINITY);
}

#[test]
fn poisoned_sample_is_skipped_and_the_rest_trained_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = TrainerConfig { checkpoint_every: 1, ..cfg(0.05) };
    let samples = opd_batch(&tiny(21), &[1]);
    let mut t = Trainer::new(tiny(21), Method::Opd, c.clone(), CheckpointWriter::new(dir.path(), "poison")).unwrap();
    let out = t.train_step(&samples).unwrap();
    let skipped = out.skipped.clone().expect("o2 skipped");
    assert_eq!((skipped.reason, skipped.samples.clone()), (SkipReason::NonFiniteLoss, vec![1]));
    assert_eq!(skipped.reason.as_str(), "non_finite_loss");
    assert!(skipped.detail.contains("loss is inf") && skipped.detail.contains("sample o2 alone: non_finite_loss (loss inf"), "{}", skipped.detail);
    assert!(out.dropped.is_empty());
    // Retried on o1 and o3: on-policy, A = 0.1 per token → loss = mean(−0.1, −0.1) = −0.1, 5 tokens.
    let row = out.train_step.unwrap();
    assert!((row.loss + 0.1).abs() < 1e-6, "{row:?}");
    assert_eq!((row.step, row.samples, row.tokens), (1, 2, 5));
    assert_eq!((t.step(), t.optimizer().steps()), (1, 1));
    // Bit for bit the step a trainer takes on o1 and o3 alone.
    let mut alone = Trainer::new(tiny(21), Method::Opd, c, CheckpointWriter::new(dir.path(), "alone")).unwrap();
    let ra = alone.train_step(&[samples[0].clone(), samples[2].clone()]).unwrap().train_step.unwrap();
    assert_eq!((ra.loss, ra.grad_norm), (row.loss, row.grad_norm));
    assert!(same_weights(&weights(t.policy()), &weights(alone.policy())));
    // The checkpoint's lineage: o1, o3 trained; o2 consumed, not trained, with the reason.
    let m = out.checkpoint.unwrap().manifest;
    let got: Vec<(&str, bool, Option<&str>, i64)> = m.lineage.iter().map(|l| (l.sample_id.as_str(), l.trained, l.drop_reason.as_deref(), l.step)).collect();
    assert_eq!(got, vec![("o1", true, None, 1), ("o3", true, None, 1), ("o2", false, Some("non_finite_loss"), 1)]);
}

#[test]
fn fully_poisoned_step_leaves_weights_and_adam_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let c = TrainerConfig { checkpoint_every: 2, ..cfg(0.05) };
    let p = tiny(22);
    let good = opd_batch(&p, &[]);
    let mut bad = opd_batch(&p, &[0, 1, 2]);
    // Plus one the packer drops: it stays a drop with its own reason.
    let mut oov = good[0].clone();
    oov.sample_id = "oov".into();
    oov.response_token_ids = vec![16, 3, 4];
    bad.push(oov);
    let mut t = Trainer::new(p, Method::Opd, c.clone(), CheckpointWriter::new(dir.path(), "full")).unwrap();
    let first = t.train_step(&good).unwrap().train_step.unwrap();
    let (before, adam_before) = (weights(t.policy()), t.optimizer().steps());
    let out = t.train_step(&bad).unwrap();
    assert!(out.train_step.is_none() && out.metrics.is_none() && out.checkpoint.is_none());
    let skipped = out.skipped.unwrap();
    assert_eq!((skipped.reason, skipped.samples), (SkipReason::NonFiniteLoss, vec![0, 1, 2]));
    assert_eq!(out.dropped.len(), 1);
    assert_eq!((out.dropped[0].index, out.dropped[0].reason), (3, DropReason::TokenOutOfVocab));
    assert!(same_weights(&before, &weights(t.policy())), "weights bit-identical after a skipped step");
    assert_eq!((t.step(), t.optimizer().steps(), adam_before), (1, 1, 1));
    // The AdamW moments did not move either: the next step equals that of a trainer that never saw the
    // poisoned batch, bit for bit.
    let mut clean = Trainer::new(tiny(22), Method::Opd, c, CheckpointWriter::new(dir.path(), "clean")).unwrap();
    assert_eq!(clean.train_step(&good).unwrap().train_step.unwrap().loss, first.loss);
    let a = t.train_step(&good).unwrap();
    let b = clean.train_step(&good).unwrap();
    let (ra, rb) = (a.train_step.unwrap(), b.train_step.unwrap());
    assert_eq!((ra.step, ra.loss, ra.grad_norm), (2, rb.loss, rb.grad_norm));
    assert!(same_weights(&weights(t.policy()), &weights(clean.policy())));
    // Checkpoint at step 2: the skipped batch's samples are consumed but not trained.
    let m = a.checkpoint.unwrap().manifest;
    let got: Vec<(&str, bool, Option<&str>, i64)> = m.lineage.iter().map(|l| (l.sample_id.as_str(), l.trained, l.drop_reason.as_deref(), l.step)).collect();
    assert_eq!(
        got,
        vec![
            ("o1", true, None, 1),
            ("o2", true, None, 1),
            ("o3", true, None, 1),
            ("o1", false, Some("non_finite_loss"), 1),
            ("o2", false, Some("non_finite_loss"), 1),
            ("o3", false, Some("non_finite_loss"), 1),
            ("oov", false, Some("token_out_of_vocab"), 1),
            ("o1", true, None, 2),
            ("o2", true, None, 2),
            ("o3", true, None, 2),
        ]
    );
    assert_eq!(m.metrics.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1, 2]);
}

/// [`Tiny`] whose log-prob of response token 6 has an infinite gradient (`√x` at x = 0) while its value
/// is unchanged, and whose forward pass fails with a libtorch error on a batch holding response token 9.
struct Faulty(Tiny);

impl Policy for Faulty {
    fn var_store(&self) -> &VarStore {
        &self.0.vs
    }
    fn vocab_size(&self) -> usize {
        V as usize
    }
    fn response_hidden(&self, b: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>> {
        if b.response_ids.f_eq(9)?.f_any()?.f_int64_value(&[])? != 0 {
            return Err(Error::Torch(tch::TchError::Torch("simulated kernel failure on token 9".into())));
        }
        let _guard = (grad == Gradients::None).then(tch::no_grad_guard);
        let (bs, t) = (b.batch_size() as i64, b.max_response_len() as i64);
        let idx = b.predict_positions.f_unsqueeze(-1)?.f_expand([bs, t, H], false)?;
        let at = self.0.emb.forward(&b.input_ids).f_gather(1, &idx, false)?;
        let bad = b.response_ids.f_eq(6)?.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?;
        // x = 0 where bad (gradient of √x: +inf), 1 elsewhere (gradient masked to 0 by `bad`).
        let x = at.f_sub(&at.f_detach()?)?.f_mul(&bad)?.f_add(&bad.f_neg()?.f_add_scalar(1.0)?)?;
        HiddenPass::from_graph(at.f_add(&bad.f_mul(&x.f_sqrt()?)?)?)
    }
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.0.head.forward(hidden))
    }
}

#[test]
fn infinite_gradient_and_torch_error_samples_are_skipped_with_their_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let c = TrainerConfig { checkpoint_every: 1000, ..cfg(0.05) };
    let p = tiny(23);
    let mut samples = binary_batch(&p);
    let mut grad = samples[0].clone();
    grad.sample_id = "grad".into();
    grad.response_token_ids = vec![6, 3];
    grad.rollout_logprobs = vec![-2.0; 2];
    grad.loss_mask = vec![1; 2];
    let mut torch = samples[1].clone();
    torch.sample_id = "torch".into();
    torch.response_token_ids = vec![9, 3];
    torch.rollout_logprobs = vec![-2.0; 2];
    torch.loss_mask = vec![1; 2];
    let good = samples.clone();

    // Infinite gradient: the loss is finite, the gradient norm is not.
    samples.insert(1, grad);
    let mut t = Trainer::new(Faulty(p), Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "grad")).unwrap();
    let out = t.train_step(&samples).unwrap();
    let k = out.skipped.unwrap();
    assert_eq!((k.reason, k.samples.clone()), (SkipReason::NonFiniteGrad, vec![1]));
    assert!(k.detail.contains("gradient norm is NaN") || k.detail.contains("gradient norm is inf"), "{}", k.detail);
    assert!(k.detail.contains("sample grad alone: non_finite_grad"), "{}", k.detail);
    let row = out.train_step.unwrap();
    assert_eq!((row.samples, row.tokens), (4, 10));
    // The same step as on the four good samples alone.
    let mut alone = Trainer::new(Faulty(tiny(23)), Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "alone")).unwrap();
    let ra = alone.train_step(&good).unwrap().train_step.unwrap();
    assert_eq!((ra.loss, ra.grad_norm), (row.loss, row.grad_norm));
    assert!(same_weights(&weights(&t.policy().0), &weights(&alone.policy().0)));

    // libtorch error: reason torch_error, the message in the detail; the others train.
    let mut batch = good.clone();
    batch.push(torch);
    let out = t.train_step(&batch).unwrap();
    let k = out.skipped.unwrap();
    assert_eq!((k.reason, k.samples.clone(), k.reason.as_str()), (SkipReason::TorchError, vec![4], "torch_error"));
    assert!(k.detail.contains("simulated kernel failure on token 9"), "{}", k.detail);
    assert_eq!(out.train_step.unwrap().samples, 4);
    assert_eq!((t.step(), t.optimizer().steps()), (2, 2));
}

#[test]
fn the_current_policy_as_teacher_scores_the_teacher_prompt_with_the_weights_being_trained() {
    let p = tiny(11);
    // Two OPD rows; the bigram policy reads the last prompt token for the first response token, so the
    // teacher prompt (last token 7 or 9 instead of 2) changes the teacher's first log-prob.
    let mut samples = vec![
        sample("o1", SampleType::Opd, &[1, 2], &[3, 4, 5], &[0.0; 3], 0.0),
        sample("o2", SampleType::Opd, &[6, 2], &[8, 5], &[0.0; 2], 0.0),
    ];
    score(&p, &mut samples);
    samples[0].teacher_prompt_token_ids = Some(vec![1, 2, 7]);
    samples[1].teacher_prompt_token_ids = Some(vec![6, 2, 9]);
    // What the current weights give on the teacher prompts.
    let mut swapped: Vec<Sample> = samples.iter().map(|s| Sample { prompt_token_ids: s.teacher_prompt_token_ids.clone().unwrap(), ..s.clone() }).collect();
    score(&p, &mut swapped);
    let current: Vec<Vec<f32>> = swapped.iter().map(|s| s.rollout_logprobs.clone()).collect();
    assert_ne!(current[0][0], samples[0].rollout_logprobs[0], "the teacher prompt matters at t = 0");

    // Stored teacher log-probs that are far off: `samples` uses them, `current` ignores them.
    for s in &mut samples {
        s.teacher_logprobs = Some(vec![-9.0; s.response_token_ids.len()]);
    }
    let cur = TrainerConfig { teacher: TeacherSource::Current, ..quiet() };
    let with_current = loss_report(&p, None, Method::Opd, &cur, 0, &samples).unwrap();
    let exact: Vec<Sample> = samples.iter().zip(&current).map(|(s, c)| Sample { teacher_logprobs: Some(c.clone()), ..s.clone() }).collect();
    let with_exact = loss_report(&p, None, Method::Opd, &quiet(), 0, &exact).unwrap();
    let stale = loss_report(&p, None, Method::Opd, &quiet(), 0, &samples).unwrap();
    for ((a, b), c) in with_current.samples.iter().zip(&with_exact.samples).zip(&stale.samples) {
        assert!((a.advantage - b.advantage).abs() < 1e-6, "{} vs {}", a.advantage, b.advantage);
        assert!((a.advantage - c.advantage).abs() > 1.0, "the stored −9 teacher is not used");
    }
    // By hand for o1: the mean over its 3 tokens of current − rollout; tokens 1 and 2 have the same
    // context under both prompts (bigram), so only t = 0 differs.
    let want = f64::from(current[0][0] - samples[0].rollout_logprobs[0]) / 3.0;
    assert!((with_current.samples[0].advantage - want).abs() < 1e-6, "{} vs {want}", with_current.samples[0].advantage);

    // The gradients of a step are those of the samples with the current teacher stored.
    let grads = |cfg: &TrainerConfig, s: &[Sample]| {
        p.vs.trainable_variables().iter().for_each(|t| { let mut g = t.grad(); if g.defined() { let _ = g.zero_(); } });
        accumulate_gradients(&p, None, Method::Opd, cfg, 0, s).unwrap();
        p.vs.trainable_variables().iter().map(|t| t.grad().copy()).collect::<Vec<_>>()
    };
    let (g1, g2) = (grads(&cur, &samples), grads(&TrainerConfig::default(), &exact));
    for (a, b) in g1.iter().zip(&g2) {
        assert!(a.allclose(b, 1e-6, 1e-7, false));
    }

    // A hinted sample without teacher prompt ids cannot use the current teacher: dropped with the reason.
    let mut bare = samples.clone();
    bare[1].teacher_prompt_token_ids = None;
    let r = loss_report(&p, None, Method::Opd, &cur, 0, &bare).unwrap();
    assert_eq!(r.dropped.iter().map(|d| (d.index, d.reason)).collect::<Vec<_>>(), vec![(1, DropReason::MissingTeacher)]);
    // And the switch refuses the top-K and overlap losses.
    assert!(TrainerConfig { opd_loss: OpdLoss::Topk, ..cur.clone() }.validate().unwrap_err().to_string().contains("trainer.teacher = \"current\""));
    assert!(!serde_json::to_string(&TrainerConfig::default()).unwrap().contains("teacher"), "the default is not serialised");
}

/// The advantages split into their reward and teacher parts (`train_steps.advantage_reward_abs_mean`
/// and `advantage_teacher_abs_mean`), by hand: combined with w_rl = 0.5, w_opd = 1, the current policy
/// at −1 on every token.
#[test]
fn advantage_parts_split_the_reward_and_the_teacher_term() {
    // a: hint and score +1, teacher −0.75 and −0.5 → teacher − student = +0.25, +0.5; reward part 0.5.
    // b: score-only −1 (no hint: teacher term exactly 0); reward part −0.5.
    let mut a = sample("a", SampleType::CombinedBoth, &[1], &[5, 6], &[-1.0, -1.0], 1.0);
    a.teacher_logprobs = Some(vec![-0.75, -0.5]);
    let mut b = sample("b", SampleType::CombinedScoreOnly, &[1], &[5], &[-1.0], -1.0);
    b.teacher_logprobs = Some(vec![-1.0]);
    let c = TrainerConfig { w_rl: 0.5, w_opd: 1.0, ..quiet() };
    let opts = PackOptions { method: Method::Combined, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: c.clone() };
    let mut batch = pack_samples(&[a, b], &opts).unwrap().batch.unwrap();
    let student = batch.old_logprobs.shallow_clone();
    let adv = loss::advantages(&c.loss_config(Method::Combined), &batch.reward, &student, batch.teacher_logprobs.as_ref(), &batch.sample_types, &batch.loss_mask).unwrap();
    // reward: |0.5| × 2 tokens + |−0.5| × 1 = 1.5; teacher: 0.25 + 0.5 = 0.75, both tokens positive
    let p = advantage_parts(&adv, &batch, 0.5).unwrap();
    assert_eq!(p, AdvantageParts { reward_abs: 1.5, teacher_abs: 0.75, teacher_positive: 2, teacher_negative: 0, tokens: 3 });
    // The random-sign control flips a's whole advantage: the magnitudes stay, the teacher part's sign
    // flips with it (the reward part is taken with the row's sign).
    batch.advantage_sign = Tensor::from_slice(&[-1.0f32, 1.0]);
    let flipped = &adv * batch.advantage_sign.unsqueeze(1);
    let q = advantage_parts(&flipped, &batch, 0.5).unwrap();
    assert_eq!(q, AdvantageParts { teacher_positive: 0, teacher_negative: 2, ..p });
    // A w_rl that is not exact in f32 (0.3): a score-only row still has a teacher part of exactly 0.
    let c3 = TrainerConfig { w_rl: 0.3, w_opd: 1.0, ..quiet() };
    let mut so = sample("so", SampleType::CombinedScoreOnly, &[1], &[5, 6], &[-1.0, -1.0], -1.0);
    so.teacher_logprobs = Some(vec![-1.0, -1.0]);
    let opts3 = PackOptions { method: Method::Combined, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: c3.clone() };
    let b3 = pack_samples(&[so], &opts3).unwrap().batch.unwrap();
    let adv3 = loss::advantages(&c3.loss_config(Method::Combined), &b3.reward, &b3.old_logprobs, b3.teacher_logprobs.as_ref(), &b3.sample_types, &b3.loss_mask).unwrap();
    let p3 = advantage_parts(&adv3, &b3, 0.3).unwrap();
    assert_eq!((p3.teacher_abs, p3.teacher_positive, p3.teacher_negative, p3.tokens), (0.0, 0, 0, 2), "{p3:?}");
    assert!((p3.reward_abs - 0.6).abs() < 1e-6, "{p3:?}");
    // Binary: the whole advantage is the reward's.
    let bin = TrainerConfig::default();
    let x = sample("x", SampleType::Binary, &[1], &[5, 6, 7], &[-1.0; 3], -1.0);
    let opts = PackOptions { method: Method::Binary, vocab_size: 16, pad_id: 0, current_version: 0, device: Device::Cpu, config: bin.clone() };
    let bb = pack_samples(&[x], &opts).unwrap().batch.unwrap();
    let adv = loss::advantages(&bin.loss_config(Method::Binary), &bb.reward, &bb.old_logprobs, None, &bb.sample_types, &bb.loss_mask).unwrap();
    assert_eq!(advantage_parts(&adv, &bb, 1.0).unwrap(), AdvantageParts { reward_abs: 3.0, teacher_abs: 0.0, teacher_positive: 0, teacher_negative: 0, tokens: 3 });
}

/// The quarantine rules on by default (`trainer.quarantine`): a truncated response, a one-token
/// response and a sample whose rollout log-probs are 3 nats per token away from the policy's are each
/// dropped once with their reason, enter the lineage untrained, and the step on the others leaves the
/// same weights as a step on the others alone.
#[test]
fn quarantine_drops_truncated_near_empty_and_high_gap_samples_and_trains_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut samples = binary_batch(&tiny(11));
    samples.truncate(2); // b1 (3 tokens), b2 (2 tokens): on-policy, kept
    let mut cut = sample("cut", SampleType::Binary, &[1], &[2, 3, 4], &[0.0; 3], -1.0);
    cut.truncated = Some(true);
    let short = sample("short", SampleType::Binary, &[5], &[6], &[0.0], 1.0);
    let mut gap = sample("gap", SampleType::Binary, &[7], &[8, 9], &[0.0; 2], 1.0);
    let p = tiny(11);
    score(&p, std::slice::from_mut(&mut gap));
    for x in &mut gap.rollout_logprobs {
        *x -= 3.0;
    }
    let batch = vec![samples[0].clone(), cut, samples[1].clone(), short, gap];
    assert_eq!(TrainerConfig::default().quarantine, QuarantineSettings { min_response_tokens: 2, truncated: true, max_logprob_gap: 2.0 });
    let c = TrainerConfig { checkpoint_every: 1000, ..cfg(0.05) };
    let c = TrainerConfig { quarantine: QuarantineSettings::default(), ..c };
    let mut t = Trainer::new(p, Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "q")).unwrap();
    let out = t.train_step(&batch).unwrap();
    let got: Vec<(usize, &str, DropReason)> = out.dropped.iter().map(|d| (d.index, d.sample_id.as_str(), d.reason)).collect();
    assert_eq!(got, vec![(1, "cut", DropReason::Truncated), (3, "short", DropReason::NearEmptyResponse), (4, "gap", DropReason::LogprobGap)]);
    assert!(out.dropped[2].detail.contains("3.0000 nats") && out.dropped[2].detail.contains("max_logprob_gap = 2"), "{}", out.dropped[2].detail);
    assert!(out.dropped[1].detail.contains("1 trained response tokens"), "{}", out.dropped[1].detail);
    let row = out.train_step.expect("the step is taken on the two good samples");
    assert_eq!((row.step, row.samples), (1, 2));
    // The lineage: every sample once, the three quarantined ones untrained with their reasons.
    let mut lineage: Vec<(String, bool, Option<String>)> = t.pending_lineage.iter().map(|l| (l.sample_id.clone(), l.trained, l.drop_reason.clone())).collect();
    lineage.sort();
    let want = |id: &str, r: Option<&str>| (id.to_string(), r.is_none(), r.map(str::to_string));
    assert_eq!(lineage, vec![want("b1", None), want("b2", None), want("cut", Some("truncated")), want("gap", Some("logprob_gap")), want("short", Some("near_empty_response"))]);
    // The same weights as a step on the two good samples alone.
    let dir2 = tempfile::tempdir().unwrap();
    let mut alone = Trainer::new(tiny(11), Method::Binary, c, CheckpointWriter::new(dir2.path(), "q")).unwrap();
    let out2 = alone.train_step(&samples).unwrap();
    assert!(out2.dropped.is_empty());
    assert!(same_weights(&weights(t.policy()), &weights(alone.policy())));

    // Each rule can be turned off: with all off, all five are trained.
    let dir3 = tempfile::tempdir().unwrap();
    let mut off = Trainer::new(tiny(11), Method::Binary, TrainerConfig { checkpoint_every: 1000, ..cfg(0.05) }, CheckpointWriter::new(dir3.path(), "q")).unwrap();
    let out3 = off.train_step(&batch).unwrap();
    assert!(out3.dropped.is_empty(), "{:?}", out3.dropped);
    assert_eq!(out3.train_step.unwrap().samples, 5);
}

/// `checkpoint_every_samples` and `checkpoint_every_secs` write checkpoints between the
/// `checkpoint_every` steps: a run whose step interval is never reached still leaves one.
#[test]
fn checkpoints_also_by_trained_samples_and_by_wall_time() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(12);
    let samples = binary_batch(&p);
    // 4 samples per step, a checkpoint once 6 are trained: after steps 2 (8 trained) and 4 (8 more).
    let c = TrainerConfig { checkpoint_every: 1000, checkpoint_every_samples: Some(6), ..cfg(0.01) };
    let mut t = Trainer::new(p, Method::Binary, c, CheckpointWriter::new(dir.path(), "s")).unwrap();
    let written: Vec<Option<i64>> = (0..4).map(|_| t.train_step(&samples).unwrap().checkpoint.map(|c| c.manifest.version)).collect();
    assert_eq!(written, vec![None, Some(1), None, Some(2)]);
    // By wall time: 0.2 s; the first step after the interval writes one.
    let c = TrainerConfig { checkpoint_every: 1000, checkpoint_every_secs: Some(0.2), ..cfg(0.01) };
    let mut t = Trainer::new(tiny(12), Method::Binary, c, CheckpointWriter::new(dir.path(), "t")).unwrap();
    assert!(t.train_step(&samples).unwrap().checkpoint.is_none());
    std::thread::sleep(std::time::Duration::from_millis(250));
    assert_eq!(t.train_step(&samples).unwrap().checkpoint.map(|c| c.manifest.version), Some(1));
    assert!(t.train_step(&samples).unwrap().checkpoint.is_none(), "the clock restarts at the checkpoint");
    // Bad values are config errors naming the key.
    for (bad, key) in [
        (TrainerConfig { checkpoint_every_secs: Some(0.0), ..quiet() }, "trainer.checkpoint_every_secs"),
        (TrainerConfig { checkpoint_every_samples: Some(0), ..quiet() }, "trainer.checkpoint_every_samples"),
        (TrainerConfig { quarantine: QuarantineSettings { max_logprob_gap: 0.0, ..QuarantineSettings::default() }, ..quiet() }, "trainer.quarantine.max_logprob_gap"),
        (TrainerConfig { alarms: AlarmSettings { factor: 1.0, ..AlarmSettings::default() }, ..quiet() }, "trainer.alarms.factor"),
    ] {
        assert!(bad.validate().unwrap_err().to_string().contains(key), "{key}");
    }
    // TOML: the tables parse, `inf` turns the gap rule off, and defaults keep the configuration hash.
    let c: TrainerConfig = toml::from_str("[quarantine]\nmax_logprob_gap = inf\ntruncated = false\n[alarms]\nwindow = 8\n").unwrap();
    assert_eq!((c.quarantine.max_logprob_gap, c.quarantine.truncated, c.quarantine.min_response_tokens, c.alarms.window), (f64::INFINITY, false, 2, 8));
    assert!(!serde_json::to_string(&TrainerConfig::default()).unwrap().contains("quarantine"));
}

/// A step that quarantines a high-gap sample and whose step on the others then fails (an infinite
/// gradient): the offender is found among the others and skipped with its own reason, the quarantined
/// sample keeps `logprob_gap`, and the good samples are trained as if alone.
#[test]
fn a_gap_quarantine_whose_retry_fails_keeps_each_reason() {
    let dir = tempfile::tempdir().unwrap();
    // (b3's one-token response stays in: min_response_tokens 0)
    let c = TrainerConfig { checkpoint_every: 1000, quarantine: QuarantineSettings { min_response_tokens: 0, ..QuarantineSettings::default() }, ..cfg(0.05) };
    let p = tiny(23);
    let good = binary_batch(&p);
    let mut grad = good[0].clone();
    grad.sample_id = "grad".into();
    (grad.response_token_ids, grad.rollout_logprobs, grad.loss_mask) = (vec![6, 3], vec![-2.0; 2], vec![1; 2]);
    let mut gap = good[1].clone();
    gap.sample_id = "gap".into();
    for x in &mut gap.rollout_logprobs {
        *x -= 3.0;
    }
    let mut batch = good.clone();
    batch.push(grad);
    batch.push(gap);
    let mut t = Trainer::new(Faulty(p), Method::Binary, c.clone(), CheckpointWriter::new(dir.path(), "both")).unwrap();
    let out = t.train_step(&batch).unwrap();
    assert_eq!(out.dropped.iter().map(|d| (d.index, d.reason)).collect::<Vec<_>>(), vec![(5, DropReason::LogprobGap)]);
    let k = out.skipped.expect("the infinite-gradient sample is skipped");
    assert_eq!((k.reason, k.samples), (SkipReason::NonFiniteGrad, vec![4]));
    assert_eq!(out.train_step.expect("the good samples train").samples, 4);
    let mut alone = Trainer::new(Faulty(tiny(23)), Method::Binary, c, CheckpointWriter::new(dir.path(), "alone")).unwrap();
    alone.train_step(&good).unwrap();
    assert!(same_weights(&weights(&t.policy().0), &weights(&alone.policy().0)));
    let reasons: Vec<(String, Option<String>)> = t.pending_lineage.iter().map(|l| (l.sample_id.clone(), l.drop_reason.clone())).collect();
    for (id, want) in [("grad", Some("non_finite_grad")), ("gap", Some("logprob_gap")), ("b1", None)] {
        let got: Vec<_> = reasons.iter().filter(|(s, _)| s == id).collect();
        assert_eq!(got.len(), 1, "{id} once in the lineage: {reasons:?}");
        assert_eq!(got[0].1.as_deref(), want, "{id}");
    }
    // The manifest's step record counts the quarantined sample among the step's drops.
    assert_eq!(t.pending_steps.last().unwrap().dropped, 1);
}
