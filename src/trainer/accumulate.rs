//! One optimizer step's forward and backward pass without the update: samples grouped into
//! micro-batches by length ([`micro_batches`]), each packed and evaluated with the output head and the
//! per-token loss terms on chunks of positions ([`evaluate`]; see the [`crate::trainer`] module docs,
//! "Memory"), their gradients accumulated and their metrics merged into the step's.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::advantage_parts::AdvantageParts;
use super::batch::{pack_samples, Dropped, PackOptions, PackedBatch};
use super::config::{TeacherSource, TrainerConfig};
use super::loss::{self, LossConfig, LossMetrics};
use super::policy::Policy;
use crate::method::Method;
use crate::input_err;
use crate::model::score::{position_chunks, tempered, Gradients};
use crate::schema::Sample;
use crate::Result;

/// The loss of one packed batch and the rollout/current log-prob gap.
pub(super) struct Evaluated {
    /// The loss, its metrics and per-sample terms.
    pub(super) out: loss::LossOutput,
    /// Mean |rollout − current| log-prob over the trained tokens (nats).
    pub(super) rollout_abs_diff: f64,
    /// `[B]`: each row's mean |rollout − current| log-prob over its trained tokens (nats; 0 for a row
    /// without one).
    pub(super) row_gaps: Vec<f64>,
    /// `[B, T]` f32: the current policy's log-probs of the response tokens (the OPD target's student
    /// side), no gradient.
    pub(super) student: Tensor,
    /// `[B, T]` f32: the teacher log-probs the loss used (`None` when the method has none).
    pub(super) teacher: Option<Tensor>,
}

fn check_hidden(hidden: &Tensor, b: i64, t: i64) -> Result<()> {
    let size = hidden.size();
    if size.len() != 3 || size[..2] != [b, t] {
        return Err(input_err!("policy returned hidden states {size:?} for a batch of [{b}, {t}]"));
    }
    Ok(())
}

/// Forward pass and loss for `batch` (docs/method.md §6), aggregated over `num_samples` = the samples of the
/// whole optimizer step. With `train`, also the backward pass: the trainable weights' `.grad`
/// accumulate `∂loss/∂θ` of this batch's share of the step's loss. The output head and every
/// per-token term run on chunks of `cfg.logits_chunk_tokens` positions (see the module docs); the
/// returned metrics and per-sample terms are computed once more from the per-token values, under
/// `no_grad`, by [`loss::compute_loss`] — the same formulas.
pub(super) fn evaluate<P: Policy + ?Sized>(policy: &P, reference: Option<&dyn Policy>, cfg: &TrainerConfig, lcfg: &LossConfig, batch: &PackedBatch, num_samples: f64, train: bool) -> Result<Evaluated> {
    let (b, t) = (batch.batch_size() as i64, batch.max_response_len() as i64);
    let kind = Kind::Float;
    let mask = batch.loss_mask.f_to_kind(kind)?;
    let rollout = batch.old_logprobs.f_to_kind(kind)?;
    // trainer.teacher = current: the teacher is the weights being trained, scored without gradient on
    // the teacher prompts, before this micro-batch's update (so every micro-batch of a step sees the
    // same teacher).
    let teacher = match (&batch.teacher_pass, cfg.teacher) {
        (Some(pass), TeacherSource::Current) => {
            let lp = policy.response_logprobs_at(pass, cfg.temperature)?;
            check_hidden(&lp.f_unsqueeze(-1)?, b, t)?;
            Some(lp.f_detach()?.f_to_kind(kind)?)
        }
        _ => batch.teacher_logprobs.as_ref().map(|x| x.f_to_kind(kind)).transpose()?,
    };
    let ref_lp = match reference {
        Some(r) => {
            let lp = r.response_logprobs_at(batch, cfg.temperature)?;
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
        let lsm = tempered(&policy.logits(&hc)?.f_to_kind(kind)?, cfg.temperature)?.f_log_softmax(-1, kind)?;
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
    let gap = {
        let d = rollout.f_sub(&new_all)?.f_abs()?;
        d.f_where_self(&mask.f_gt(0.0)?, &d.f_zeros_like()?)?.f_to_kind(Kind::Double)?
    };
    let rollout_abs_diff = if tokens_total > 0.0 { gap.f_sum(Kind::Double)?.f_double_value(&[])? / tokens_total } else { 0.0 };
    let row_sums = Vec::<f64>::try_from(&gap.f_sum_dim_intlist(1i64, false, Kind::Double)?.f_to_device(tch::Device::Cpu)?)?;
    let row_tokens = Vec::<f64>::try_from(&mask.f_gt(0.0)?.f_sum_dim_intlist(1i64, false, Kind::Double)?.f_to_device(tch::Device::Cpu)?)?;
    let row_gaps = row_sums.iter().zip(&row_tokens).map(|(g, n)| if *n > 0.0 { g / n } else { 0.0 }).collect();
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
    let out = loss::compute_loss(lcfg, &inputs)?;
    Ok(Evaluated { out, rollout_abs_diff, row_gaps, student: new_all, teacher })
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
pub(super) fn pack_options_for<P: Policy + ?Sized>(policy: &P, method: Method, cfg: &TrainerConfig, version: i64) -> PackOptions {
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
    /// Each evaluated sample's mean |rollout − current| log-prob over its trained tokens (nats), by
    /// index into the input slice, ascending (the step's gap quarantine reads it).
    pub sample_gaps: Vec<(usize, f64)>,
    /// Masked tokens by sample type (kebab-case): `(advantage > 0, advantage < 0, all)` (tokens).
    pub advantage_signs: BTreeMap<String, (i64, i64, i64)>,
    /// The advantages split into their reward and teacher parts, over the step's masked tokens.
    pub parts: AdvantageParts,
}

/// [`AdvantageParts`] of a micro-batch's advantages `adv` `[B, T]` (0 off the mask, signs applied), with
/// `reward_coef` the reward's weight in `A_t` (1 binary, `w_rl` combined, 0 OPD).
///
/// # Errors
/// [`crate::Error::Torch`] on a tensor failure.
pub fn advantage_parts(adv: &Tensor, batch: &PackedBatch, reward_coef: f64) -> Result<AdvantageParts> {
    let _guard = tch::no_grad_guard();
    // The reward part in the advantages' own dtype and order of operations (`r·c`, then the sign, as
    // `loss::advantages` and `compute_loss` do), so a row without a teacher term leaves exactly 0 here
    // whatever `w_rl` (0.3 is not exact in f32); sums in f64.
    let kind = adv.kind();
    let keep = batch.loss_mask.f_gt(0.0)?;
    let mask = keep.f_to_kind(kind)?;
    let adv = adv.f_mul(&mask)?;
    let per_row = batch.reward.f_to_kind(kind)?.f_mul_scalar(reward_coef)?.f_mul(&batch.advantage_sign.f_to_kind(kind)?)?;
    let reward = per_row.f_unsqueeze(1)?.f_mul(&mask)?;
    let teacher = adv.f_sub(&reward)?;
    let (reward, teacher) = (reward.f_to_kind(Kind::Double)?, teacher.f_to_kind(Kind::Double)?);
    let kind = Kind::Double;
    let sum = |x: &Tensor| -> Result<f64> { Ok(x.f_abs()?.f_sum(kind)?.f_double_value(&[])?) };
    let count = |x: &Tensor| -> Result<i64> { Ok(x.f_sum(Kind::Int64)?.f_int64_value(&[])?) };
    Ok(AdvantageParts {
        reward_abs: sum(&reward)?,
        teacher_abs: sum(&teacher)?,
        teacher_positive: count(&teacher.f_gt(0.0)?)?,
        teacher_negative: count(&teacher.f_lt(0.0)?)?,
        tokens: count(&keep)?,
    })
}

/// Adds `batch`'s masked-token counts by sign of the advantage `adv` `[B, T]` to `into`, by sample type.
fn count_advantage_signs(adv: &Tensor, batch: &PackedBatch, into: &mut BTreeMap<String, (i64, i64, i64)>) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let mask = batch.loss_mask.f_gt(0.0)?;
    let count = |x: &Tensor| -> Result<Vec<i64>> {
        let per_row = x.f_logical_and(&mask)?.f_sum_dim_intlist(1i64, false, Kind::Int64)?.f_to_device(tch::Device::Cpu)?;
        Ok(Vec::<i64>::try_from(&per_row)?)
    };
    let pos = count(&adv.f_gt(0.0)?)?;
    let neg = count(&adv.f_lt(0.0)?)?;
    let all = count(&mask)?;
    for (i, t) in batch.sample_types.iter().enumerate() {
        let e = into.entry(t.as_str().to_string()).or_default();
        e.0 += pos[i];
        e.1 += neg[i];
        e.2 += all[i];
    }
    Ok(())
}

/// The forward and backward pass of one optimizer step without the update: packs `samples` (dropping
/// bad or stale rows with reasons, `version` = the policy version of the weights for staleness) into
/// micro-batches of at most `cfg.micro_batch_tokens` padded tokens ([`micro_batches`]), and adds
/// `∂loss/∂θ` of the step's loss (docs/method.md §6: the mean over the kept samples of each sample's mean
/// over its trained tokens) to the trainable tensors' `.grad` — call `zero_grad` first. Each
/// micro-batch is aggregated over the samples of the whole step, so the result equals one pass over
/// the whole batch. [`Trainer::train_step`](super::Trainer::train_step) is this, then clipping and AdamW.
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
    let mut advantage_signs = BTreeMap::new();
    let mut parts_sum = AdvantageParts::default();
    let mut sample_gaps: Vec<(usize, f64)> = vec![];
    let reward_coef = match method {
        Method::Binary => 1.0,
        Method::Combined => lcfg.w_rl,
        Method::Opd => 0.0,
    };
    for batch in &packed_parts {
        let mut type_counts: BTreeMap<String, i64> = BTreeMap::new();
        for t in &batch.sample_types {
            *type_counts.entry(t.as_str().to_string()).or_default() += 1;
        }
        let ev = evaluate(policy, reference, cfg, &lcfg, batch, num_samples as f64, true)?;
        sample_gaps.extend(batch.source_index.iter().copied().zip(ev.row_gaps.iter().copied()));
        count_advantage_signs(&ev.out.advantages, batch, &mut advantage_signs)?;
        parts_sum.add(&advantage_parts(&ev.out.advantages, batch, reward_coef)?);
        parts.push((ev.out.metrics, ev.rollout_abs_diff, type_counts));
    }
    if parts.is_empty() {
        return Ok(Accumulated { metrics: None, rollout_abs_diff: 0.0, dropped, sample_gaps, advantage_signs, parts: parts_sum });
    }
    sample_gaps.sort_by_key(|g| g.0);
    let (m, rollout_abs_diff) = merge_metrics(&parts);
    Ok(Accumulated { metrics: Some(m), rollout_abs_diff, dropped, sample_gaps, advantage_signs, parts: parts_sum })
}
