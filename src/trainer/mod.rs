//! The trainer: METHOD.md §6 losses, one AdamW step per batch of samples, checkpoints with lineage.
//!
//! Layers:
//! - [`loss`]: the loss math on tensors (advantages, PPO clip, k3 KL, entropy, top-K reverse KL, the
//!   mean over the step's samples of sample means); pure and unit-tested with hand-computed values.
//! - [`batch`]: [`Sample`] rows → padded tensors ([`PackedBatch`]), dropping bad rows with reasons.
//! - [`optim`]: AdamW with checkpointable state.
//! - [`checkpoint`]: `checkpoints/<run>/<version>/` folders, manifests, resume, consumed sample ids.
//! - this module: the [`Policy`] trait the model runtime implements, the [`Trainer`] (one optimizer step
//!   per batch, `train_steps` rows, checkpoints every K steps) and the [`loss_report`] (every loss
//!   component per sample, without updating weights).
//!
//! **Memory.** No `[B, T, V]` tensor is built. The trunk gives the hidden states that predict the
//! response tokens (`[B, T, H]`, [`Policy::response_hidden`]); the output head, the log-softmax and
//! every per-token loss term run on chunks of at most `logits_chunk_tokens` positions, each chunk's
//! loss is backpropagated into its own detached slice of the hidden states, and the accumulated
//! `∂loss/∂hidden` then goes through the trunk once ([`HiddenPass::backward`]) — the technique of
//! Liger's fused linear cross-entropy and slime's chunked log-probs. With `recompute_layers` the trunk
//! keeps only each layer's input and reruns one layer at a time in the backward pass. The gradients
//! equal those of the unchunked loss (tested to 1e-5).
//!
//! The wiring (Kafka, SQL, CLI) is not here: it collects `batch_size` samples, skips those in
//! [`checkpoint::consumed_sample_ids`] after a resume, calls [`Trainer::train_step`], writes the
//! returned `TrainStep` row, dead-letters the dropped samples and the skipped ones
//! ([`StepOutcome::skipped`]: non-finite loss or gradient, libtorch error) and publishes the `Checkpoint`
//! row of each checkpoint written.

pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod loss;
pub mod model_policy;
pub mod optim;
#[cfg(test)]
mod test_util;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

pub use batch::{pack_samples, DropReason, Dropped, PackOptions, Packed, PackedBatch};
pub use checkpoint::{ancestry, consumed_sample_ids, latest_complete, scan, CheckpointScan, CheckpointWriter, LineageEntry, Manifest, OptimizerRecord, StepRecord};
pub use config::{AdvantageSign, CandidateSelection, LoraSettings, OverlapSettings, OverlapSubset, Staleness, TeacherSource, TrainerConfig};
pub use loss::{LossConfig, LossMetrics, OpdLoss};
pub use optim::{AdamW, AdamWConfig};

pub use crate::model::score::{position_chunks, Gradients, HiddenPass, LOGIT_CHUNK_TOKENS};

use crate::config::Method;
use crate::schema::{now_ms, Checkpoint, Sample, Table, TrainStep};
use crate::{config_err, input_err, Error, Result};

/// How the trainable weights are checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightsFormat {
    /// All trainable weights (`model.safetensors`).
    Full,
    /// Only the LoRA adapter tensors (the model runtime's policy: PEFT's `adapter_model.safetensors` +
    /// `adapter_config.json`; the default [`Policy::save_weights`]: `adapter.safetensors`).
    Lora,
}

impl WeightsFormat {
    /// `full` or `lora` (the `checkpoints.weights_format` column).
    pub fn as_str(self) -> &'static str {
        match self {
            WeightsFormat::Full => "full",
            WeightsFormat::Lora => "lora",
        }
    }
    /// File written by the default [`Policy::save_weights`]: `model.safetensors` or `adapter.safetensors`.
    pub fn file_name(self) -> &'static str {
        match self {
            WeightsFormat::Full => "model.safetensors",
            WeightsFormat::Lora => "adapter.safetensors",
        }
    }
}

/// A trainable policy: what the trainer needs from the model runtime. Kept minimal; the real
/// transformer implements it with its trunk (`response_hidden`) and output head and, for checkpoints a
/// server can load directly, its own `save_weights`/`load_weights`.
pub trait Policy {
    /// The parameters. The trainer optimizes the tensors with `requires_grad` (all weights, or only the
    /// LoRA adapters when the base is frozen).
    fn var_store(&self) -> &VarStore;

    /// Vocabulary size V (token ids must be below it).
    fn vocab_size(&self) -> usize;

    /// Id used to right-pad `input_ids` (0 by default; never attended to under a causal mask).
    fn pad_id(&self) -> i64 {
        0
    }

    /// Runs the trunk over `batch`: the hidden states `[B, T, H]` that predict each response token, at
    /// the alignment of [`PackedBatch::predict_positions`], with the backward path `grad` asks for
    /// ([`Gradients::None`] for scoring; a policy without recomputation may treat
    /// [`Gradients::Recomputed`] as [`Gradients::Stored`]).
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure, or any error of the model.
    fn response_hidden(&self, batch: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>>;

    /// The output head: hidden states `[.., H]` → logits `[.., V]` (any float kind; the trainer takes
    /// the log-softmax in f32). Differentiable in `hidden` and the head's trainable weights.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;

    /// Per-token log-probs `[B, T]` f32 of the response tokens of `batch` under the current weights,
    /// without gradients (any value on padding), the head applied in chunks of
    /// [`LOGIT_CHUNK_TOKENS`] positions.
    ///
    /// # Errors
    /// As [`Policy::response_hidden`] and [`Policy::logits`].
    fn response_logprobs(&self, batch: &PackedBatch) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let pass = self.response_hidden(batch, Gradients::None)?;
        let (b, t) = (batch.batch_size() as i64, batch.max_response_len() as i64);
        let mut parts = Vec::new();
        for (t0, n) in position_chunks(b, t, LOGIT_CHUNK_TOKENS) {
            let lsm = self.logits(&pass.hidden.f_narrow(1, t0, n)?)?.f_log_softmax(-1, Kind::Float)?;
            parts.push(lsm.f_gather(2, &batch.response_ids.f_narrow(1, t0, n)?.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?);
        }
        if parts.is_empty() {
            return Ok(Tensor::f_zeros([b, 0], (Kind::Float, self.var_store().device()))?);
        }
        Ok(Tensor::f_cat(&parts, 1)?)
    }

    /// Writes the trainable weights into `dir` and returns the names of the files written. Default: the
    /// trainable tensors of [`Policy::var_store`] under their names, in `format`'s file (safetensors).
    ///
    /// # Errors
    /// [`Error::Torch`] when the file cannot be written.
    fn save_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<Vec<String>> {
        save_trainable(self.var_store(), dir, format)
    }

    /// Loads weights written by [`Policy::save_weights`] from `dir` into the trainable tensors.
    ///
    /// # Errors
    /// [`Error::Model`] when a tensor is missing, extra or of another shape; [`Error::Torch`] when the
    /// file cannot be read.
    fn load_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<()> {
        load_trainable(self.var_store(), dir, format)
    }
}

/// Writes the trainable tensors of `vs` (by name, on the CPU) to `dir/<format's file>`; returns the
/// file name.
///
/// # Errors
/// [`Error::Torch`] when the file cannot be written.
pub fn save_trainable(vs: &VarStore, dir: &Path, format: WeightsFormat) -> Result<Vec<String>> {
    let named = optim::trainable_named(vs)
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_detach()?.f_to_device(tch::Device::Cpu)?)))
        .collect::<Result<Vec<_>>>()?;
    Tensor::write_safetensors(&named, dir.join(format.file_name()))?;
    Ok(vec![format.file_name().to_string()])
}

/// Copies `dir/<format's file>` into the trainable tensors of `vs`; every trainable tensor must be in the
/// file with its shape, and the file must hold nothing else.
///
/// # Errors
/// [`Error::Model`] naming the missing, extra or mis-shaped tensor; [`Error::Torch`] on read failure.
pub fn load_trainable(vs: &VarStore, dir: &Path, format: WeightsFormat) -> Result<()> {
    let path = dir.join(format.file_name());
    let mut file: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)?.into_iter().collect();
    let _guard = tch::no_grad_guard();
    for (name, mut t) in optim::trainable_named(vs) {
        let src = file.remove(&name).ok_or_else(|| Error::Model(format!("{}: no tensor {name}", path.display())))?;
        if src.size() != t.size() {
            return Err(Error::Model(format!("{}: {name} has shape {:?}, the model's is {:?}", path.display(), src.size(), t.size())));
        }
        t.f_copy_(&src)?;
    }
    if let Some(extra) = file.keys().next() {
        return Err(Error::Model(format!("{}: tensor {extra} is not a trainable tensor of the model", path.display())));
    }
    Ok(())
}

/// The loss of one packed batch and the rollout/current log-prob gap.
struct Evaluated {
    out: loss::LossOutput,
    rollout_abs_diff: f64,
}

fn check_hidden(hidden: &Tensor, b: i64, t: i64) -> Result<()> {
    let size = hidden.size();
    if size.len() != 3 || size[..2] != [b, t] {
        return Err(input_err!("policy returned hidden states {size:?} for a batch of [{b}, {t}]"));
    }
    Ok(())
}

/// Forward pass and loss for `batch` (METHOD.md §6), aggregated over `num_samples` = the samples of the
/// whole optimizer step. With `train`, also the backward pass: the trainable weights' `.grad`
/// accumulate `∂loss/∂θ` of this batch's share of the step's loss. The output head and every
/// per-token term run on chunks of `cfg.logits_chunk_tokens` positions (see the module docs); the
/// returned metrics and per-sample terms are computed once more from the per-token values, under
/// `no_grad`, by [`loss::compute_loss`] — the same formulas.
fn evaluate<P: Policy + ?Sized>(policy: &P, reference: Option<&dyn Policy>, cfg: &TrainerConfig, lcfg: &LossConfig, batch: &PackedBatch, num_samples: f64, train: bool) -> Result<Evaluated> {
    let (b, t) = (batch.batch_size() as i64, batch.max_response_len() as i64);
    let kind = Kind::Float;
    let mask = batch.loss_mask.f_to_kind(kind)?;
    let rollout = batch.old_logprobs.f_to_kind(kind)?;
    // trainer.teacher = current: the teacher is the weights being trained, scored without gradient on
    // the teacher prompts, before this micro-batch's update (so every micro-batch of a step sees the
    // same teacher).
    let teacher = match (&batch.teacher_pass, cfg.teacher) {
        (Some(pass), TeacherSource::Current) => {
            let lp = policy.response_logprobs(pass)?;
            check_hidden(&lp.f_unsqueeze(-1)?, b, t)?;
            Some(lp.f_detach()?.f_to_kind(kind)?)
        }
        _ => batch.teacher_logprobs.as_ref().map(|x| x.f_to_kind(kind)).transpose()?,
    };
    let ref_lp = match reference {
        Some(r) => {
            let lp = r.response_logprobs(batch)?;
            check_hidden(&lp.f_unsqueeze(-1)?, b, t)?;
            Some(lp.f_to_kind(kind)?)
        }
        None => None,
    };
    let topk = match (&batch.topk_ids, &batch.topk_logprobs, &batch.topk_mask) {
        (Some(ids), Some(lps), Some(m)) => Some((ids.shallow_clone(), lps.f_to_kind(kind)?, m.f_to_kind(kind)?)),
        _ => None,
    };
    let subset = batch.topk_subset.as_ref().map(|x| x.f_to_kind(kind)).transpose()?;
    let teacher_topk_grad = lcfg.uses_topk() || lcfg.uses_overlap();
    let weights = batch.sample_weight.f_to_kind(kind)?;
    let tokens = mask.f_sum_dim_intlist(1i64, false, kind)?;
    let topk_tokens = match &topk {
        Some((_, _, m)) => m.f_sum_dim_intlist(1i64, false, kind)?,
        None => tokens.f_zeros_like()?,
    };

    let grad = match (train, cfg.recompute_layers) {
        (false, _) => Gradients::None,
        (true, false) => Gradients::Stored,
        (true, true) => Gradients::Recomputed,
    };
    let _no_grad = (!train).then(tch::no_grad_guard);
    let pass = policy.response_hidden(batch, grad)?;
    check_hidden(&pass.hidden, b, t)?;
    let new_all = Tensor::f_zeros([b, t], (kind, mask.device()))?;
    let ent_all = Tensor::f_zeros([b, t], (kind, mask.device()))?;
    let student_all = match &topk {
        Some((ids, _, _)) => Some(Tensor::f_zeros(ids.size(), (kind, mask.device()))?),
        None => None,
    };
    let grad_hidden = if train { Some(pass.hidden.f_zeros_like()?) } else { None };
    for (t0, n) in position_chunks(b, t, cfg.logits_chunk_tokens) {
        let cut = |x: &Tensor| x.f_narrow(1, t0, n);
        let hc = cut(&pass.hidden)?;
        let hc = if train { hc.f_detach()?.f_requires_grad_(true)? } else { hc };
        let lsm = policy.logits(&hc)?.f_to_kind(kind)?.f_log_softmax(-1, kind)?;
        let new_c = lsm.f_gather(2, &cut(&batch.response_ids)?.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
        let ent_c = if train && lcfg.entropy_coef != 0.0 {
            loss::entropy(&lsm)?
        } else {
            let _guard = tch::no_grad_guard();
            loss::entropy(&lsm.f_detach()?)?
        };
        let student_c = match &topk {
            Some((ids, _, _)) => {
                let s = lsm.f_gather(2, &cut(ids)?, false)?;
                Some(if teacher_topk_grad { s } else { s.f_detach()? })
            }
            None => None,
        };
        if let Some(g) = &grad_hidden {
            let old_c = if cfg.recompute_old_logprobs { new_c.f_detach()? } else { cut(&rollout)? };
            let (mask_c, teacher_c, ref_c) = (cut(&mask)?, teacher.as_ref().map(cut).transpose()?, ref_lp.as_ref().map(cut).transpose()?);
            let topk_c = match (&topk, &student_c) {
                (Some((_, lps, m)), Some(st)) => Some((st.shallow_clone(), cut(lps)?, cut(m)?)),
                _ => None,
            };
            let subset_c = subset.as_ref().map(cut).transpose()?;
            let inputs = loss::LossInputs {
                new_logprobs: &new_c,
                old_logprobs: &old_c,
                teacher_logprobs: teacher_c.as_ref(),
                reward: &batch.reward,
                mask: &mask_c,
                sample_types: &batch.sample_types,
                sample_weights: Some(&weights),
                advantage_signs: Some(&batch.advantage_sign),
                ref_logprobs: ref_c.as_ref(),
                entropy: Some(&ent_c),
                topk: topk_c.as_ref().map(|(s, t, m)| loss::TopkInputs { student: s, teacher: t, mask: m, subset: subset_c.as_ref() }),
                sample_tokens: Some((&tokens, &topk_tokens)),
                num_samples: Some(num_samples),
            };
            let chunk_loss = loss::compute_loss(lcfg, &inputs)?.loss;
            if chunk_loss.requires_grad() {
                chunk_loss.f_backward()?;
                cut(g)?.f_copy_(&hc.f_grad()?)?;
            }
        }
        let _guard = tch::no_grad_guard();
        cut(&new_all)?.f_copy_(&new_c.f_detach()?)?;
        cut(&ent_all)?.f_copy_(&ent_c.f_detach()?)?;
        if let (Some(all), Some(st)) = (&student_all, &student_c) {
            cut(all)?.f_copy_(&st.f_detach()?)?;
        }
    }
    if let Some(g) = &grad_hidden {
        pass.backward(g)?;
    }

    let _guard = tch::no_grad_guard();
    let tokens_total = mask.f_sum(Kind::Double)?.f_double_value(&[])?;
    let rollout_abs_diff = if tokens_total > 0.0 {
        let d = rollout.f_sub(&new_all)?.f_abs()?;
        d.f_where_self(&mask.f_gt(0.0)?, &d.f_zeros_like()?)?.f_sum(Kind::Double)?.f_double_value(&[])? / tokens_total
    } else {
        0.0
    };
    let old = if cfg.recompute_old_logprobs { new_all.shallow_clone() } else { rollout };
    let inputs = loss::LossInputs {
        new_logprobs: &new_all,
        old_logprobs: &old,
        teacher_logprobs: teacher.as_ref(),
        reward: &batch.reward,
        mask: &mask,
        sample_types: &batch.sample_types,
        sample_weights: Some(&weights),
        advantage_signs: Some(&batch.advantage_sign),
        ref_logprobs: ref_lp.as_ref(),
        entropy: Some(&ent_all),
        topk: match (&topk, &student_all) {
            (Some((_, lps, m)), Some(st)) => Some(loss::TopkInputs { student: st, teacher: lps, mask: m, subset: subset.as_ref() }),
            _ => None,
        },
        sample_tokens: None,
        num_samples: Some(num_samples),
    };
    Ok(Evaluated { out: loss::compute_loss(lcfg, &inputs)?, rollout_abs_diff })
}

/// Groups `samples` into micro-batches whose padded size (count × longest prompt + response) stays
/// within `budget` tokens: the samples are taken in order of length (shortest first, ties in input
/// order), so samples of similar length share a micro-batch and little padding is computed; a single
/// sample over the budget gets a micro-batch of its own. Returns each micro-batch's input indices, in
/// input order within it. The step's loss does not depend on the grouping (it is a mean over samples).
pub fn micro_batches(samples: &[Sample], budget: usize) -> Vec<Vec<usize>> {
    let len = |i: usize| samples[i].prompt_token_ids.len() + samples[i].response_token_ids.len();
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by_key(|&i| len(i));
    let mut out: Vec<Vec<usize>> = vec![];
    let mut cur: Vec<usize> = vec![];
    for i in order {
        // Sorted ascending: the newest sample is the longest of the group.
        if !cur.is_empty() && len(i) * (cur.len() + 1) > budget {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    for g in &mut out {
        g.sort_unstable();
    }
    out
}

/// Combines the metrics of a step's micro-batches: the loss terms add up (each micro-batch's are already
/// divided by the step's sample count, so their sum is the step's mean of sample means), tokens and
/// samples add up, token means are token-weighted
/// (clip fraction, PPO KL, |rollout − new|), per-type advantage means are sample-weighted.
fn merge_metrics(parts: &[(LossMetrics, f64, BTreeMap<String, i64>)]) -> (LossMetrics, f64) {
    let tokens: i64 = parts.iter().map(|(m, _, _)| m.tokens).sum();
    let tw = |f: &dyn Fn(&LossMetrics, f64) -> f64| -> f64 {
        if tokens == 0 {
            0.0
        } else {
            parts.iter().map(|(m, d, _)| f(m, *d) * m.tokens as f64).sum::<f64>() / tokens as f64
        }
    };
    let mut adv: BTreeMap<String, (f64, i64)> = BTreeMap::new();
    for (m, _, counts) in parts {
        for (k, v) in &m.advantage_by_type {
            let n = counts.get(k).copied().unwrap_or(0);
            let e = adv.entry(k.clone()).or_insert((0.0, 0));
            e.0 += v * n as f64;
            e.1 += n;
        }
    }
    let merged = LossMetrics {
        loss: parts.iter().map(|(m, _, _)| m.loss).sum(),
        pg_loss: parts.iter().map(|(m, _, _)| m.pg_loss).sum(),
        clip_fraction: tw(&|m, _| m.clip_fraction),
        ppo_kl: tw(&|m, _| m.ppo_kl),
        kl: parts.iter().map(|(m, _, _)| m.kl).sum(),
        entropy: parts.iter().map(|(m, _, _)| m.entropy).sum(),
        topk_kl: parts.iter().map(|(m, _, _)| m.topk_kl).sum(),
        advantage_by_type: adv.into_iter().filter(|(_, (_, n))| *n > 0).map(|(k, (s, n))| (k, s / n as f64)).collect(),
        tokens,
        samples: parts.iter().map(|(m, _, _)| m.samples).sum(),
    };
    (merged, tw(&|_, d| d))
}

/// How samples are packed for `policy` (its vocabulary, pad id and device) under `method` and `cfg`, with
/// staleness measured against policy version `version`.
fn pack_options_for<P: Policy + ?Sized>(policy: &P, method: Method, cfg: &TrainerConfig, version: i64) -> PackOptions {
    PackOptions { method, vocab_size: policy.vocab_size(), pad_id: policy.pad_id(), current_version: version, device: policy.var_store().device(), config: cfg.clone() }
}

/// What [`accumulate_gradients`] did.
#[derive(Debug)]
pub struct Accumulated {
    /// The step's loss metrics; `None` when every sample was dropped (no gradient was computed).
    pub metrics: Option<LossMetrics>,
    /// Mean |rollout − current| log-prob over the trained tokens (nats).
    pub rollout_abs_diff: f64,
    /// Samples left out, with reasons (indices into the input slice, ascending).
    pub dropped: Vec<Dropped>,
}

/// The forward and backward pass of one optimizer step without the update: packs `samples` (dropping
/// bad or stale rows with reasons, `version` = the policy version of the weights for staleness) into
/// micro-batches of at most `cfg.micro_batch_tokens` padded tokens ([`micro_batches`]), and adds
/// `∂loss/∂θ` of the step's loss (METHOD.md §6: the mean over the kept samples of each sample's mean
/// over its trained tokens) to the trainable tensors' `.grad` — call `zero_grad` first. Each
/// micro-batch is aggregated over the samples of the whole step, so the result equals one pass over
/// the whole batch. [`Trainer::train_step`] is this, then clipping and AdamW.
///
/// # Errors
/// [`Error::Config`] for an invalid configuration; [`Error::InvalidInput`] when the configuration needs
/// an input the samples or the reference lack; [`Error::Torch`] on a tensor failure.
pub fn accumulate_gradients<P: Policy + ?Sized>(policy: &P, reference: Option<&dyn Policy>, method: Method, cfg: &TrainerConfig, version: i64, samples: &[Sample]) -> Result<Accumulated> {
    let lcfg = cfg.loss_config(method);
    let opts = pack_options_for(policy, method, cfg, version);
    let mut dropped: Vec<Dropped> = vec![];
    let mut packed_parts: Vec<PackedBatch> = vec![];
    for group in micro_batches(samples, cfg.micro_batch_tokens) {
        let chunk: Vec<Sample> = group.iter().map(|&i| samples[i].clone()).collect();
        let packed = pack_samples(&chunk, &opts)?;
        dropped.extend(packed.dropped.into_iter().map(|mut d| {
            d.index = group[d.index];
            d
        }));
        if let Some(mut batch) = packed.batch {
            for si in &mut batch.source_index {
                *si = group[*si];
            }
            packed_parts.push(batch);
        }
    }
    dropped.sort_by_key(|d| d.index);
    let num_samples: usize = packed_parts.iter().map(|b| b.batch_size()).sum();
    let mut parts: Vec<(LossMetrics, f64, BTreeMap<String, i64>)> = vec![];
    for batch in &packed_parts {
        let mut type_counts: BTreeMap<String, i64> = BTreeMap::new();
        for t in &batch.sample_types {
            *type_counts.entry(t.as_str().to_string()).or_default() += 1;
        }
        let ev = evaluate(policy, reference, cfg, &lcfg, batch, num_samples as f64, true)?;
        parts.push((ev.out.metrics, ev.rollout_abs_diff, type_counts));
    }
    if parts.is_empty() {
        return Ok(Accumulated { metrics: None, rollout_abs_diff: 0.0, dropped });
    }
    let (m, rollout_abs_diff) = merge_metrics(&parts);
    Ok(Accumulated { metrics: Some(m), rollout_abs_diff, dropped })
}

/// A checkpoint the trainer wrote.
#[derive(Debug, Clone)]
pub struct WrittenCheckpoint {
    /// Its folder (`checkpoints/<run>/<version>`).
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The `checkpoints` table row to publish.
    pub row: Checkpoint,
}

/// What one [`Trainer::train_step`] did.
#[derive(Debug)]
pub struct StepOutcome {
    /// The `train_steps` row; `None` when every sample was dropped (no optimizer step was taken).
    pub train_step: Option<TrainStep>,
    /// The step's loss metrics (same values as the row).
    pub metrics: Option<LossMetrics>,
    /// Samples left out, with reasons (indices into the input slice).
    pub dropped: Vec<Dropped>,
    /// The checkpoint written after this step (every `checkpoint_every` steps).
    pub checkpoint: Option<WrittenCheckpoint>,
    /// Samples left untrained because their loss or gradient was not finite or libtorch failed on them
    /// (dead-letter each). With `train_step` `None` the whole step was skipped and the weights and the
    /// optimizer state are exactly as before; with `train_step` `Some` the step was retried and taken
    /// without these samples.
    pub skipped: Option<SkippedStep>,
}

/// Why a step left the weights unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The loss of the batch (or of the sample, alone) was NaN or ±inf.
    NonFiniteLoss,
    /// The loss was finite but the global gradient norm was NaN or ±inf.
    NonFiniteGrad,
    /// libtorch failed during the forward or backward pass.
    TorchError,
}

impl SkipReason {
    /// Snake-case name for counters and the dead letters' `reason_code`: `non_finite_loss`,
    /// `non_finite_grad`, `torch_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NonFiniteLoss => "non_finite_loss",
            SkipReason::NonFiniteGrad => "non_finite_grad",
            SkipReason::TorchError => "torch_error",
        }
    }
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step that was not taken (weights unchanged; its samples go to dead_letters).
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedStep {
    /// Why the step failed first.
    pub reason: SkipReason,
    /// The failure with its numbers (the batch's loss components or gradient norm, the libtorch
    /// message), then, per offending sample found by evaluating the samples one at a time, its id, its
    /// own reason and its loss or gradient norm.
    pub detail: String,
    /// indices into the input slice
    pub samples: Vec<usize>,
}

/// How one sample fared when evaluated alone (forward, loss, backward, gradient norm; no step).
enum Probe {
    /// Finite loss and gradient norm.
    Good,
    /// Left out by the packer (the step itself drops and reports it).
    Dropped,
    /// Non-finite loss or gradient, or a libtorch error: (why, the numbers).
    Offender(SkipReason, String),
}

/// Why an attempt at a step ([`Trainer::try_step`]) failed.
enum StepFailure {
    /// The batch's fault — a non-finite loss or gradient norm, or a libtorch error — with the error
    /// that says so: the step can be skipped.
    Skip(SkipReason, Error),
    /// Not the batch's fault (configuration, a policy returning wrongly shaped log-probs): ends the step
    /// with the error.
    Fatal(Error),
}

impl From<Error> for StepFailure {
    fn from(e: Error) -> Self {
        match e {
            Error::Torch(_) => StepFailure::Skip(SkipReason::TorchError, e),
            e => StepFailure::Fatal(e),
        }
    }
}

/// Where [`Trainer::resume`] started from.
#[derive(Debug)]
pub struct Resumed {
    /// The checkpoint loaded (`None`: no complete checkpoint, fresh start at version 0).
    pub from: Option<(PathBuf, Manifest)>,
    /// Sample ids consumed on the path to it: skip these (exactly-once into the trainer).
    pub consumed: HashSet<String>,
}

/// The training loop's state: the policy, AdamW, the step and version counters, and the lineage and
/// metrics gathered since the last checkpoint.
pub struct Trainer<P: Policy> {
    policy: P,
    reference: Option<Box<dyn Policy>>,
    method: Method,
    cfg: TrainerConfig,
    opt: AdamW,
    writer: CheckpointWriter,
    config_hash: String,
    step: i64,
    version: i64,
    pending_lineage: Vec<LineageEntry>,
    pending_steps: Vec<StepRecord>,
    /// Positions of samples read from the `samples` topic, by sample id (see [`Trainer::note_positions`]).
    positions: std::collections::HashMap<String, (String, i32, i64)>,
}

impl<P: Policy> std::fmt::Debug for Trainer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("run_id", &self.writer.run_id())
            .field("method", &self.method)
            .field("step", &self.step)
            .field("version", &self.version)
            .field("optimizer", &self.opt)
            .finish()
    }
}

impl<P: Policy> Trainer<P> {
    /// A fresh trainer at version 0 (the policy's current weights), step 0. Seeds libtorch with
    /// `cfg.seed` (seed before building the policy too if its initialisation is random, e.g. LoRA).
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration, a run folder that already has checkpoints (use
    /// [`Trainer::resume`]) or a policy without trainable tensors; [`Error::Io`] when the run folder
    /// cannot be listed.
    pub fn new(policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<Trainer<P>> {
        if let Some((path, m)) = latest_complete(writer.run_dir())? {
            return Err(config_err!("run {} already has checkpoints up to version {} ({}); resume it or choose another run id", writer.run_id(), m.version, path.display()));
        }
        Self::fresh(policy, method, cfg, writer)
    }

    fn fresh(policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<Trainer<P>> {
        cfg.validate()?;
        tch::manual_seed(cfg.seed as i64);
        let opt = AdamW::new(
            policy.var_store(),
            AdamWConfig { lr: cfg.lr, beta1: cfg.betas.0, beta2: cfg.betas.1, eps: cfg.adam_eps, weight_decay: cfg.weight_decay },
        )?;
        Ok(Trainer {
            config_hash: cfg.hash(method)?,
            policy,
            reference: None,
            method,
            cfg,
            opt,
            writer,
            step: 0,
            version: 0,
            pending_lineage: Vec::new(),
            pending_steps: Vec::new(),
            positions: std::collections::HashMap::new(),
        })
    }

    /// Resumes the run from its newest complete checkpoint ([`latest_complete`]): loads the weights
    /// ([`Policy::load_weights`]) and the AdamW moments and step, sets the step and version counters,
    /// and returns the consumed sample ids of its [`ancestry`]. Without a checkpoint: a fresh start.
    /// A changed configuration hash is allowed (logged); a changed method or weights format is not.
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`Error::Config`] when the checkpoint's method or weights format differs;
    /// the errors of [`Policy::load_weights`] and [`AdamW::load`].
    pub fn resume(mut policy: P, method: Method, cfg: TrainerConfig, writer: CheckpointWriter) -> Result<(Trainer<P>, Resumed)> {
        let found = scan(writer.run_dir())?;
        let Some((path, manifest)) = found.complete.last().cloned() else {
            let t = Self::fresh(policy, method, cfg, writer)?;
            return Ok((t, Resumed { from: None, consumed: HashSet::new() }));
        };
        if manifest.method != method.as_str() {
            return Err(config_err!("checkpoint {} was trained with method {}, not {}", path.display(), manifest.method, method.as_str()));
        }
        let format = if cfg.lora.enabled { WeightsFormat::Lora } else { WeightsFormat::Full };
        if manifest.weights_format != format.as_str() {
            return Err(config_err!("checkpoint {} holds {} weights, the configuration asks for {}", path.display(), manifest.weights_format, format.as_str()));
        }
        policy.load_weights(&path, format)?;
        let mut t = Self::fresh(policy, method, cfg, writer)?;
        if manifest.config_hash != t.config_hash {
            tracing::warn!(checkpoint = %path.display(), old = %manifest.config_hash, new = %t.config_hash, "trainer configuration changed since the checkpoint");
        }
        t.opt.load(&path.join(&manifest.optimizer.file), manifest.optimizer.step)?;
        t.step = manifest.step;
        t.version = manifest.version;
        let manifests: Vec<Manifest> = found.complete.into_iter().map(|(_, m)| m).collect();
        let consumed = consumed_sample_ids(ancestry(&manifests, manifest.version));
        Ok((t, Resumed { from: Some((path, manifest)), consumed }))
    }

    /// Records where samples were read (`samples` topic, partition, offset) so the checkpoint lineage
    /// names those positions (exactly-once into the trainer is checked against them).
    pub fn note_positions(&mut self, positions: impl IntoIterator<Item = (String, (String, i32, i64))>) {
        self.positions.extend(positions);
    }

    /// Adds a frozen reference policy for the k3 KL term (needed when `kl_coef ≠ 0`).
    pub fn with_reference(mut self, reference: Box<dyn Policy>) -> Trainer<P> {
        self.reference = Some(reference);
        self
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }
    /// The policy, mutably (e.g. to hot-swap into a server).
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }
    /// Optimizer steps taken.
    pub fn step(&self) -> i64 {
        self.step
    }
    /// Version of the last checkpoint written or resumed (0 = initial weights).
    pub fn version(&self) -> i64 {
        self.version
    }
    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }
    /// The method.
    pub fn method(&self) -> Method {
        self.method
    }
    /// The run id.
    pub fn run_id(&self) -> &str {
        self.writer.run_id()
    }
    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    fn weights_format(&self) -> WeightsFormat {
        if self.cfg.lora.enabled {
            WeightsFormat::Lora
        } else {
            WeightsFormat::Full
        }
    }

    fn pack_options(&self) -> PackOptions {
        pack_options_for(&self.policy, self.method, &self.cfg, self.version)
    }

    fn record_lineage(&mut self, samples: &[Sample], dropped: &[Dropped], step: i64) {
        for (i, s) in samples.iter().enumerate() {
            let drop = dropped.iter().find(|d| d.index == i);
            self.pending_lineage.push(LineageEntry {
                sample_id: s.sample_id.clone(),
                interaction_id: s.interaction_id.clone(),
                source_topic: s.source_topic.clone(),
                source_partition: s.source_partition,
                source_offset: s.source_offset,
                policy_version: s.policy_version,
                sample_topic: self.positions.get(&s.sample_id).map(|p| p.0.clone()),
                sample_partition: self.positions.get(&s.sample_id).map(|p| p.1),
                sample_offset: self.positions.get(&s.sample_id).map(|p| p.2),
                step,
                trained: drop.is_none(),
                drop_reason: drop.map(|d| d.reason.as_str().to_string()),
            });
        }
    }

    /// One optimizer step on `samples` (normally `batch_size` of them): pack (dropping bad or stale rows
    /// with reasons), forward, loss (METHOD.md §6), backward, gradient-norm clipping to `grad_clip`,
    /// AdamW. Every `checkpoint_every` steps a checkpoint is written ([`Trainer::checkpoint`]). When every
    /// sample is dropped no step is taken; the dropped samples still enter the lineage.
    ///
    /// **A bad batch never stops training**: when the loss or the gradient norm is not finite, or
    /// libtorch fails in the forward or backward pass, the weights and the AdamW state stay exactly as
    /// they were, each sample is evaluated alone (forward, loss, backward, gradient norm; no step) to
    /// find the offenders, and the step is retried once without them. The offenders — or, when none can
    /// be told apart or the retry fails too, every sample the packer kept — are returned in
    /// [`StepOutcome::skipped`] and enter the lineage as not trained, with the reason
    /// ([`SkipReason::as_str`]). A fully skipped step takes no optimizer step and counts no step.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an input the configuration needs and the batch lacks (e.g. a
    /// reference policy for `kl_coef ≠ 0`) or a policy returning wrongly shaped log-probs;
    /// [`Error::Internal`] when libtorch failed inside the AdamW update (the weights may be half
    /// updated); the checkpoint's errors.
    pub fn train_step(&mut self, samples: &[Sample]) -> Result<StepOutcome> {
        let adam_steps = self.opt.steps();
        let mut outcome = match self.try_step(samples) {
            Ok(o) => o,
            Err(StepFailure::Skip(reason, e)) if self.opt.steps() == adam_steps => self.recover(samples, reason, &e)?,
            Err(StepFailure::Skip(_, e)) => return Err(Error::Internal(format!("step {}: the AdamW update failed part-way: {e}", self.step + 1))),
            Err(StepFailure::Fatal(e)) => return Err(e),
        };
        if outcome.train_step.is_some() && (self.step as u64).is_multiple_of(self.cfg.checkpoint_every) {
            outcome.checkpoint = self.checkpoint()?;
        }
        Ok(outcome)
    }

    /// After `try_step(samples)` failed with `reason` (`err`; weights and AdamW untouched): finds the
    /// offending samples by probing each alone, retries the step once without them, and otherwise skips
    /// the step. See [`Trainer::train_step`].
    fn recover(&mut self, samples: &[Sample], reason: SkipReason, err: &Error) -> Result<StepOutcome> {
        self.opt.zero_grad()?;
        let mut detail = format!("step {}: {err}", self.step + 1);
        tracing::warn!(step = self.step + 1, reason = reason.as_str(), error = %err, samples = samples.len(), "training step failed; evaluating its samples one at a time");
        let mut offenders: Vec<usize> = vec![];
        let mut dropped_alone: Vec<usize> = vec![];
        for (i, s) in samples.iter().enumerate() {
            match self.probe(s)? {
                Probe::Good => {}
                Probe::Dropped => dropped_alone.push(i),
                Probe::Offender(r, d) => {
                    detail.push_str(&format!("; sample {} alone: {} ({d})", s.sample_id, r.as_str()));
                    offenders.push(i);
                }
            }
        }
        let rest: Vec<usize> = (0..samples.len()).filter(|i| !offenders.contains(i)).collect();
        let kept_rest = rest.iter().filter(|i| !dropped_alone.contains(i)).count();
        if !offenders.is_empty() && kept_rest > 0 {
            let subset: Vec<Sample> = rest.iter().map(|&i| samples[i].clone()).collect();
            let adam_steps = self.opt.steps();
            match self.try_step(&subset) {
                Ok(mut o) => {
                    for d in &mut o.dropped {
                        d.index = rest[d.index];
                    }
                    let step = self.step;
                    let picked: Vec<Sample> = offenders.iter().map(|&i| samples[i].clone()).collect();
                    self.record_skipped(&picked, &[], &(0..picked.len()).collect::<Vec<_>>(), reason, step);
                    tracing::warn!(step, reason = reason.as_str(), skipped = offenders.len(), trained = kept_rest, "step retried without the offending samples");
                    o.skipped = Some(SkippedStep { reason, detail, samples: offenders });
                    return Ok(o);
                }
                Err(StepFailure::Skip(_, e)) if self.opt.steps() == adam_steps => {
                    self.opt.zero_grad()?;
                    detail.push_str(&format!("; the retry without them failed too: {e}"));
                }
                Err(StepFailure::Skip(_, e)) => {
                    return Err(Error::Internal(format!("step {}: the AdamW update failed part-way: {e}", self.step + 1)));
                }
                Err(StepFailure::Fatal(e)) => return Err(e),
            }
        } else if offenders.is_empty() {
            detail.push_str("; no sample fails alone, so the whole batch is skipped");
        }
        // Skip the whole step: the packer's drops stay drops (with their reasons), the rest is skipped.
        let mut dropped: Vec<Dropped> = vec![];
        for &i in &dropped_alone {
            let packed = pack_samples(std::slice::from_ref(&samples[i]), &self.pack_options())?;
            dropped.extend(packed.dropped.into_iter().map(|d| Dropped { index: i, ..d }));
        }
        let skipped: Vec<usize> = (0..samples.len()).filter(|i| !dropped_alone.contains(i)).collect();
        let step = self.step;
        self.record_skipped(samples, &dropped, &skipped, reason, step);
        tracing::warn!(step = step + 1, reason = reason.as_str(), skipped = skipped.len(), dropped = dropped.len(), detail = %detail, "training step skipped; weights unchanged");
        Ok(StepOutcome { train_step: None, metrics: None, dropped, checkpoint: None, skipped: Some(SkippedStep { reason, detail, samples: skipped }) })
    }

    /// Forward, loss and backward of `sample` alone, then the gradient norm; no optimizer step, and the
    /// gradients are zeroed again. Used to find the offenders of a failed step.
    fn probe(&mut self, sample: &Sample) -> Result<Probe> {
        self.opt.zero_grad()?;
        let result = (|| -> Result<Probe> {
            let acc = accumulate_gradients(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, std::slice::from_ref(sample))?;
            let Some(m) = acc.metrics else { return Ok(Probe::Dropped) };
            if !m.loss.is_finite() {
                return Ok(Probe::Offender(SkipReason::NonFiniteLoss, format!("loss {}, pg {}, kl {}, entropy {}, top-K {}", m.loss, m.pg_loss, m.kl, m.entropy, m.topk_kl)));
            }
            let norm = self.opt.grad_norm()?;
            if !norm.is_finite() {
                return Ok(Probe::Offender(SkipReason::NonFiniteGrad, format!("loss {}, gradient norm {norm}", m.loss)));
            }
            Ok(Probe::Good)
        })();
        self.opt.zero_grad()?;
        match result {
            Err(Error::Torch(e)) => Ok(Probe::Offender(SkipReason::TorchError, e.to_string())),
            other => other,
        }
    }

    /// Lineage entries of every sample of `samples`, none trained: those in `dropped` with the packer's
    /// reason, those at the indices `skipped` with `reason`.
    fn record_skipped(&mut self, samples: &[Sample], dropped: &[Dropped], skipped: &[usize], reason: SkipReason, step: i64) {
        let start = self.pending_lineage.len();
        self.record_lineage(samples, dropped, step);
        for (k, l) in self.pending_lineage[start..].iter_mut().enumerate() {
            if skipped.contains(&k) {
                l.trained = false;
                l.drop_reason = Some(reason.as_str().to_string());
            }
        }
    }

    /// [`Trainer::train_step`] without the recovery and without the checkpoint: any failure is an error
    /// (the non-finite checks zero the gradients before returning).
    fn try_step(&mut self, samples: &[Sample]) -> std::result::Result<StepOutcome, StepFailure> {
        let started = Instant::now();
        let step = self.step + 1;
        self.opt.zero_grad()?;
        let acc = accumulate_gradients(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, samples)?;
        let dropped = acc.dropped;
        let Some(m) = acc.metrics else {
            self.record_lineage(samples, &dropped, self.step);
            return Ok(StepOutcome { train_step: None, metrics: None, dropped, checkpoint: None, skipped: None });
        };
        let rollout_abs_diff = acc.rollout_abs_diff;
        if !m.loss.is_finite() {
            self.opt.zero_grad()?;
            return Err(StepFailure::Skip(
                SkipReason::NonFiniteLoss,
                input_err!("step {step}: loss is {} (pg {}, kl {}, entropy {}, top-K {}); weights not updated", m.loss, m.pg_loss, m.kl, m.entropy, m.topk_kl),
            ));
        }
        let grad_norm = self.opt.clip_grad_norm(self.cfg.grad_clip)?;
        if !grad_norm.is_finite() {
            self.opt.zero_grad()?;
            return Err(StepFailure::Skip(SkipReason::NonFiniteGrad, input_err!("step {step}: gradient norm is {grad_norm}; weights not updated")));
        }
        self.opt.step()?;
        self.opt.zero_grad()?;
        self.step = step;
        self.record_lineage(samples, &dropped, step);
        let seconds = started.elapsed().as_secs_f64();
        self.pending_steps.push(StepRecord {
            step,
            metrics: m.clone(),
            grad_norm,
            rollout_logprob_abs_diff: rollout_abs_diff,
            dropped: dropped.len() as i64,
            seconds,
        });
        let run_id = self.writer.run_id().to_string();
        let row = TrainStep {
            schema_version: TrainStep::SCHEMA_VERSION,
            step_id: format!("{run_id}/{step}"),
            run_id,
            step,
            version: self.version + 1,
            method: self.method.as_str().to_string(),
            loss: m.loss,
            pg_loss: m.pg_loss,
            clip_fraction: m.clip_fraction,
            ppo_kl: m.ppo_kl,
            kl: m.kl,
            entropy: m.entropy,
            topk_kl: m.topk_kl,
            rollout_logprob_abs_diff: rollout_abs_diff,
            grad_norm,
            advantage_by_type: serde_json::to_string(&m.advantage_by_type).map_err(Error::from)?,
            samples: m.samples,
            tokens: m.tokens,
            seconds,
            created_time: now_ms(),
        };
        Ok(StepOutcome { train_step: Some(row), metrics: Some(m), dropped, checkpoint: None, skipped: None })
    }

    /// Writes checkpoint `version + 1` now if any optimizer step was taken since the last one (call it at
    /// shutdown); `None` otherwise. The manifest holds the steps' metrics and the lineage of every sample
    /// consumed since the parent.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Torch`] when a file cannot be written; [`Error::Config`] when the version
    /// folder already exists.
    pub fn checkpoint(&mut self) -> Result<Option<WrittenCheckpoint>> {
        if self.pending_steps.is_empty() {
            return Ok(None);
        }
        let format = self.weights_format();
        let oc = self.opt.config();
        let mut manifest = Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            run_id: self.writer.run_id().to_string(),
            version: self.version + 1,
            parent_version: self.version,
            step: self.step,
            method: self.method.as_str().to_string(),
            config_hash: self.config_hash.clone(),
            weights_format: format.as_str().to_string(),
            weight_files: Vec::new(),
            optimizer: OptimizerRecord {
                kind: "adamw".into(),
                step: self.opt.steps(),
                lr: oc.lr,
                betas: (oc.beta1, oc.beta2),
                eps: oc.eps,
                weight_decay: oc.weight_decay,
                file: checkpoint::OPTIMIZER_FILE.into(),
            },
            metrics: self.pending_steps.clone(),
            lineage: self.pending_lineage.clone(),
            created_time: now_ms(),
        };
        let (policy, opt) = (&mut self.policy, &self.opt);
        let path = self.writer.write(&mut manifest, |dir| {
            let files = policy.save_weights(dir, format)?;
            let opt_path = dir.join(checkpoint::OPTIMIZER_FILE);
            if let Some(parent) = opt_path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
            }
            opt.save(&opt_path)?;
            Ok(files)
        })?;
        self.version = manifest.version;
        self.pending_steps.clear();
        self.pending_lineage.clear();
        let row = manifest.to_row(&path)?;
        tracing::info!(run = %manifest.run_id, version = manifest.version, step = manifest.step, samples = row.samples, path = %path.display(), "checkpoint written");
        Ok(Some(WrittenCheckpoint { path, manifest, row }))
    }

    /// [`loss_report`] with this trainer's policy, reference, method, configuration and version.
    ///
    /// # Errors
    /// As [`loss_report`].
    pub fn loss_report(&self, samples: &[Sample]) -> Result<LossReport> {
        let mut r = loss_report(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, samples)?;
        r.step = self.step;
        Ok(r)
    }
}

/// Every loss component of one sample under the current weights (means over its trained tokens).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampleLoss {
    /// Sample id.
    pub sample_id: String,
    /// Sample type (kebab-case).
    pub sample_type: String,
    /// Policy version that produced the response.
    pub policy_version: Option<i64>,
    /// Trained tokens.
    pub tokens: i64,
    /// Reward r.
    pub reward: f64,
    /// Aggregation weight (staleness).
    pub weight: f64,
    /// Mean advantage.
    pub advantage: f64,
    /// Mean PPO loss.
    pub pg_loss: f64,
    /// Fraction of tokens clipped.
    pub clip_fraction: f64,
    /// Mean `old − new` (nats).
    pub ppo_kl: f64,
    /// Mean k3 KL to the reference (0 without one).
    pub kl: f64,
    /// Mean entropy (nats).
    pub entropy: f64,
    /// Mean top-K reverse KL (0 without top-K lists).
    pub topk_kl: f64,
    /// The sample's loss `pg + kl_coef·kl − entropy_coef·entropy (+ topk_coef·topk_kl)`, before its weight.
    pub loss: f64,
}

/// What [`loss_report`] returns (serialisable to JSON).
#[derive(Debug, Clone, Serialize)]
pub struct LossReport {
    /// Method.
    pub method: String,
    /// Policy version of the weights evaluated.
    pub version: i64,
    /// Optimizer steps taken (0 outside a trainer).
    pub step: i64,
    /// Samples per chunk (`batch_size`).
    pub batch_size: usize,
    /// One row per kept sample, in input order.
    pub samples: Vec<SampleLoss>,
    /// The metrics of each chunk of `batch_size` samples, exactly as a training step would report them.
    pub batches: Vec<LossMetrics>,
    /// Samples left out, with reasons (indices into the whole input).
    pub dropped: Vec<Dropped>,
}

fn to_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(Vec::<f64>::try_from(&t.f_to_kind(Kind::Double)?.f_to_device(tch::Device::Cpu)?)?)
}

/// Computes, without updating weights (under `no_grad`), the advantages and every loss component of each
/// sample under `policy`'s current weights, in chunks of `cfg.batch_size` (METHOD.md §6). `version` is
/// the policy version of these weights (for staleness).
///
/// # Errors
/// [`Error::Config`] for an invalid configuration; [`Error::InvalidInput`] when the configuration needs
/// an input the samples or the reference lack; [`Error::Torch`] on a tensor failure.
pub fn loss_report<P: Policy + ?Sized>(policy: &P, reference: Option<&dyn Policy>, method: Method, cfg: &TrainerConfig, version: i64, samples: &[Sample]) -> Result<LossReport> {
    cfg.validate()?;
    let _guard = tch::no_grad_guard();
    let lcfg = cfg.loss_config(method);
    let opts = pack_options_for(policy, method, cfg, version);
    let mut report = LossReport { method: method.as_str().into(), version, step: 0, batch_size: cfg.batch_size, samples: Vec::new(), batches: Vec::new(), dropped: Vec::new() };
    for (c, chunk) in samples.chunks(cfg.batch_size).enumerate() {
        let offset = c * cfg.batch_size;
        let packed = pack_samples(chunk, &opts)?;
        report.dropped.extend(packed.dropped.into_iter().map(|d| Dropped { index: d.index + offset, ..d }));
        let Some(batch) = packed.batch else { continue };
        let ev = evaluate(policy, reference, cfg, &lcfg, &batch, batch.batch_size() as f64, false)?;
        let ps = &ev.out.per_sample;
        let cols = [&ps.advantage, &ps.pg_loss, &ps.clip_fraction, &ps.ppo_kl, &ps.kl, &ps.entropy, &ps.topk_kl, &ps.loss, &ps.tokens].map(to_vec);
        let [adv, pg, clip, pkl, kl, ent, tk, l, tok] = cols;
        let (adv, pg, clip, pkl, kl, ent, tk, l, tok) = (adv?, pg?, clip?, pkl?, kl?, ent?, tk?, l?, tok?);
        for (i, &src) in batch.source_index.iter().enumerate() {
            let s = &chunk[src];
            report.samples.push(SampleLoss {
                sample_id: s.sample_id.clone(),
                sample_type: s.sample_type.as_str().into(),
                policy_version: s.policy_version,
                tokens: tok[i].round() as i64,
                reward: f64::from(s.reward),
                weight: batch.weights[i],
                advantage: adv[i],
                pg_loss: pg[i],
                clip_fraction: clip[i],
                ppo_kl: pkl[i],
                kl: kl[i],
                entropy: ent[i],
                topk_kl: tk[i],
                loss: l[i],
            });
        }
        report.batches.push(ev.out.metrics);
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
