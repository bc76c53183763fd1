//! The trainer's loss math on tensors (docs/method.md §6; paper arXiv 2603.10165, §3–§4 and the reference
//! training scripts). Pure functions of tensors: no model, no I/O.
//!
//! Notation: B samples, T = Tmax response positions (right-padded), K teacher top-K width, V vocabulary.
//! `new` = log π_θ(response_t | …) under the current weights (carries gradients), `student` = the same
//! values without gradient (the policy at the start of the optimizer step: the weights change only
//! after every micro-batch of the step has been evaluated, so the step's one forward pass gives them and
//! no extra pass is needed), `old` = the rollout log-probs the response was sampled with (or recomputed,
//! see `TrainerConfig::recompute_old_logprobs`; used **only** in the PPO ratio), `teacher` = log-probs of
//! the same tokens under the hint-enhanced prompt, `mask` = 1 on trained response tokens. All log-probs are natural logs (nats). Every function accepts f32 or f64 tensors on
//! any device; the mask must have the same kind as the values.
//!
//! Which terms each method uses (docs/method.md §6; `opd_loss` picks how the teacher signal enters):
//!
//! | method | PPO advantage A_t | top-K term | KL / entropy |
//! |---|---|---|---|
//! | binary | `r` | never | `kl_coef`, `entropy_coef` (0 by default) |
//! | opd, `opd_loss = ppo` | `teacher_t − student_t` | no | same |
//! | opd, `opd_loss = topk` | 0 (the PPO term vanishes) | `topk_coef · topk_kl` | same |
//! | opd, `opd_loss = both` | `teacher_t − student_t` | `topk_coef · topk_kl` | same |
//! | combined, `ppo` | `w_rl·r + w_opd·(teacher_t − student_t)` | no | same |
//! | combined, `topk` | `w_rl·r` | `topk_coef · topk_kl` | same |
//! | combined, `both` | `w_rl·r + w_opd·(teacher_t − student_t)` | `topk_coef · topk_kl` | same |
//! | opd, `overlap` | 0 | `w_opd · overlap term` ([`overlap_opd_loss`]) | same |
//! | combined, `overlap` | `w_rl·r` | `w_opd · overlap term` | same |
//!
//! Total loss: `loss = pg_loss + kl_coef·kl − entropy_coef·entropy + topk_coef·topk_kl` (with
//! `overlap`, `+ w_opd·overlap term`, reported in the `topk_kl` slot), every term
//! aggregated as the mean over the step's samples of each sample's mean over its trained tokens
//! ([`mean_of_sample_means`], docs/method.md §6: the reference's effective loss).
//!
//! Where we differ from the reference (docs/method.md §6), and where it is implemented:
//! - **Temperature**: the reference divides the training logits by the rollout temperature (0.6); its
//!   combined launcher's default ("megatron") teacher goes through the same code, so teacher and student
//!   meet at 0.6, while its "inference" teacher source scores at T = 1 (docs/method.md §4). We train,
//!   score rollouts and score the teacher at T = 1 (the trainer's log-softmax in `trainer::evaluate` and
//!   `model::score::score` apply no temperature), so the OPD advantage `teacher − student` compares two
//!   log-probs at one temperature, as the reference's default does, but not at its temperature.
//! - **Old log-probs in the PPO ratio**: the reference recomputes `old` with the current weights just
//!   before the step (ratio exactly 1 on the first pass); by default we use the rollout log-probs (the
//!   true importance ratio for samples of an older policy version); `TrainerConfig::recompute_old_logprobs`
//!   gives the reference's behaviour (`old = new` detached, in the same forward pass). This choice is
//!   the ratio's only: the OPD term is always `teacher − student` with `student` the current policy, as
//!   in the reference (openclaw-combine/combine_loss.py takes the OPD student side from the training
//!   engine's log-probs whatever the ratio uses). A target against the rollout log-probs never sees the
//!   policy move and drives it past the teacher: measured, an offline OPD arm collapsed that way.
//!
//! Every term is a per-token value times a per-token aggregation weight `w_b / (n_b · N)` (n_b the
//! sample's trained tokens, N the step's samples), so the loss of a batch is the sum of the losses of
//! any split of its positions into chunks when each chunk is given the whole samples' token counts
//! ([`LossInputs::sample_tokens`]) and the step's sample count ([`LossInputs::num_samples`]): the
//! trainer evaluates the output head on chunks of positions that way.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::method::Method;
use crate::schema::SampleType;
use crate::{input_err, Result};

/// How the teacher signal of the OPD and combined methods enters the loss (docs/method.md §6: the token-level
/// advantage `teacher − student` in the PPO term, the top-K reverse-KL distillation term, or both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpdLoss {
    /// The teacher term `w_opd·(teacher − student)` is part of the PPO advantage (the reference default).
    #[default]
    Ppo,
    /// The teacher signal enters only through the top-K reverse KL; the PPO advantage keeps the
    /// reward part only (`w_rl·r` for combined, 0 for OPD).
    Topk,
    /// Both the PPO teacher advantage and the top-K term.
    Both,
    /// Multi-candidate hints with overlap-guided selection (docs/method.md §3b): the teacher signal enters
    /// through [`overlap_opd_loss`] over a subset of each position's top-K ids (weighted `w_opd`); the
    /// PPO advantage keeps the reward part only. Needs samples with hint candidates
    /// (`teacher.candidates` > 1) and recomputed old log-probs.
    Overlap,
}

impl OpdLoss {
    /// Lower-case name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            OpdLoss::Ppo => "ppo",
            OpdLoss::Topk => "topk",
            OpdLoss::Both => "both",
            OpdLoss::Overlap => "overlap",
        }
    }
}

/// The loss's method and coefficients (docs/method.md §6). Built from `TrainerConfig::loss_config`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    /// Training method (decides the advantage, see the module table).
    pub method: Method,
    /// Lower clip ε: the ratio is clipped below at `1 − ε` (0.2).
    pub eps_clip: f64,
    /// Upper clip ε_high: the ratio is clipped above at `1 + ε_high` (0.28).
    pub eps_clip_high: f64,
    /// Weight of the reward in the combined advantage (1).
    pub w_rl: f64,
    /// Weight of the teacher term in the combined advantage (1).
    pub w_opd: f64,
    /// Weight of the k3 KL to the reference policy (0: reported only when a reference is given).
    pub kl_coef: f64,
    /// Weight of the entropy bonus (0: reported only).
    pub entropy_coef: f64,
    /// Weight of the top-K reverse-KL term when [`LossConfig::uses_topk`] (1).
    pub topk_coef: f64,
    /// How the teacher signal enters (OPD and combined only).
    pub opd_loss: OpdLoss,
    /// Bound c on each id's log-prob difference `teacher − old` in the overlap term (docs/method.md §3b:
    /// 1.0 in the reference's launcher).
    pub overlap_clip: f64,
}

impl LossConfig {
    /// The docs/method.md §6 defaults for `method`: ε = 0.2, ε_high = 0.28, w_rl = w_opd = 1, kl and entropy
    /// weights 0, top-K weight 1, `opd_loss = ppo`.
    pub fn new(method: Method) -> LossConfig {
        LossConfig {
            method,
            eps_clip: 0.2,
            eps_clip_high: 0.28,
            w_rl: 1.0,
            w_opd: 1.0,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            topk_coef: 1.0,
            opd_loss: OpdLoss::Ppo,
            overlap_clip: 1.0,
        }
    }

    /// Whether the PPO advantage contains the teacher term `teacher − student` (OPD/combined with
    /// `opd_loss` `ppo` or `both`).
    pub fn teacher_in_advantage(&self) -> bool {
        self.method.uses_hints() && matches!(self.opd_loss, OpdLoss::Ppo | OpdLoss::Both)
    }

    /// Whether the top-K reverse KL is part of the loss (OPD/combined with `opd_loss` `topk` or `both`).
    pub fn uses_topk(&self) -> bool {
        self.method.uses_hints() && matches!(self.opd_loss, OpdLoss::Topk | OpdLoss::Both)
    }

    /// Whether the overlap-guided multi-candidate term is part of the loss (OPD/combined with
    /// `opd_loss = overlap`).
    pub fn uses_overlap(&self) -> bool {
        self.method.uses_hints() && self.opd_loss == OpdLoss::Overlap
    }
}

fn check_shape(what: &str, t: &Tensor, want: &[i64]) -> Result<()> {
    let got = t.size();
    if got != want {
        return Err(input_err!("{what}: shape {got:?}, expected {want:?}"));
    }
    Ok(())
}

/// `[B, T]` of a 2-D tensor.
fn dims2(what: &str, t: &Tensor) -> Result<(i64, i64)> {
    match t.size().as_slice() {
        [b, l] => Ok((*b, *l)),
        s => Err(input_err!("{what}: shape {s:?}, expected [B, T]")),
    }
}

/// `x` where `mask > 0`, else 0 — unlike `x · mask`, a non-finite value at a masked-out position
/// cannot leak into the result.
fn masked(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let keep = mask.f_gt(0.0)?;
    Ok(x.f_where_self(&keep, &x.f_zeros_like()?)?)
}

/// Per-token advantages `A_t` `[B, T]` (same kind as `student`, no gradient, 0 where `mask` is 0)
/// (docs/method.md §6):
/// - binary: `A_t = r`;
/// - OPD: `A_t = teacher_t − student_t` (0 when `opd_loss = topk`);
/// - combined: `A_t = w_rl·r + w_opd·(teacher_t − student_t)` (the teacher part left out when
///   `opd_loss = topk`).
///
/// `student` is the **current policy's** log-prob of each response token (the weights at the start of
/// the optimizer step, no gradient; [`compute_loss`] passes `new` detached), never the rollout
/// log-probs: the reference's OPD target (openclaw-combine/combine_loss.py; docs/method.md §6). After a step
/// that lowered the policy's log-prob of a token by δ, that token's OPD advantage is δ higher.
///
/// A [`SampleType::CombinedScoreOnly`] row has no hint: its teacher log-probs are the rollout
/// log-probs (docs/method.md §5), so its teacher term would be `rollout − current`, noise that says nothing
/// about a teacher; it is set to exactly 0.
///
/// `reward` is `[B]`, `student`, `teacher` and `mask` `[B, T]` (nats), `sample_types` has B entries.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch, or when the method needs teacher log-probs and
/// `teacher` is `None`; [`crate::Error::Torch`] on a tensor failure.
pub fn advantages(cfg: &LossConfig, reward: &Tensor, student: &Tensor, teacher: Option<&Tensor>, sample_types: &[SampleType], mask: &Tensor) -> Result<Tensor> {
    let (b, t) = dims2("student log-probs", student)?;
    check_shape("reward", reward, &[b])?;
    check_shape("mask", mask, &[b, t])?;
    if sample_types.len() as i64 != b {
        return Err(input_err!("{} sample types for a batch of {b}", sample_types.len()));
    }
    let kind = student.kind();
    let r = reward.f_detach()?.f_to_kind(kind)?.f_unsqueeze(1)?.f_expand([b, t], false)?;
    let teacher_term = |teacher: Option<&Tensor>| -> Result<Tensor> {
        let teacher = teacher.ok_or_else(|| input_err!("method {} needs teacher log-probs", cfg.method.as_str()))?;
        check_shape("teacher log-probs", teacher, &[b, t])?;
        let diff = teacher.f_detach()?.f_sub(&student.f_detach()?)?;
        let has_hint: Vec<f64> = sample_types.iter().map(|s| if *s == SampleType::CombinedScoreOnly { 0.0 } else { 1.0 }).collect();
        let has_hint = Tensor::f_from_slice(&has_hint)?.f_to_kind(kind)?.f_to_device(student.device())?.f_unsqueeze(1)?;
        Ok(diff.f_mul(&has_hint)?)
    };
    let a = match cfg.method {
        Method::Binary => r,
        Method::Opd if cfg.teacher_in_advantage() => teacher_term(teacher)?,
        Method::Opd => student.f_zeros_like()?,
        Method::Combined => {
            let rl = r.f_mul_scalar(cfg.w_rl)?;
            if cfg.teacher_in_advantage() {
                rl.f_add(&teacher_term(teacher)?.f_mul_scalar(cfg.w_opd)?)?
            } else {
                rl
            }
        }
    };
    masked(&a, mask)
}

/// Per-token PPO terms (see [`ppo_clipped_loss`]).
#[derive(Debug)]
pub struct PpoTerms {
    /// `[B, T]`: `L_t = max(−ratio_t·A_t, −clip(ratio_t, 1−ε, 1+ε_high)·A_t)`, differentiable in `new`.
    pub loss: Tensor,
    /// `[B, T]`, 0/1 (kind of `new`, no gradient): 1 where the clipped term is strictly greater than
    /// the unclipped one, i.e. the clipped term was taken and the token's gradient is 0.
    pub clipped: Tensor,
    /// `[B, T]`: `ratio_t = exp(new_t − old_t)`.
    pub ratio: Tensor,
}

/// Bound on `|new − old|` (nats) before the PPO ratio's `exp` (docs/method.md §6: 20).
pub const LOG_RATIO_CLAMP: f64 = 20.0;

/// PPO clipped surrogate with an asymmetric clip (docs/method.md §6; the reference uses ε = 0.2,
/// ε_high = 0.28): `ratio_t = exp(new_t − old_t)`,
/// `L_t = max(−ratio_t·A_t, −clip(ratio_t, 1−ε, 1+ε_high)·A_t)`.
///
/// The log-ratio `new − old` is clamped to [−[`LOG_RATIO_CLAMP`], +[`LOG_RATIO_CLAMP`]] before `exp`
/// (docs/method.md §6), so one broken sample cannot make the step non-finite; where the clamp binds the
/// token's gradient is 0.
///
/// `new` `[B, T]` (with gradient), `old` and `adv` `[B, T]` (treated as constants). Padding is not
/// masked here: aggregate with [`mean_of_sample_means`].
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch; [`crate::Error::Torch`] on a tensor failure.
pub fn ppo_clipped_loss(new: &Tensor, old: &Tensor, adv: &Tensor, eps_clip: f64, eps_clip_high: f64) -> Result<PpoTerms> {
    let (b, t) = dims2("new log-probs", new)?;
    check_shape("old log-probs", old, &[b, t])?;
    check_shape("advantages", adv, &[b, t])?;
    clipped_surrogate(new, old, adv, eps_clip, eps_clip_high)
}

/// The PPO clipped surrogate elementwise, for any shape (no checks): the ratio from the log-ratio
/// clamped to ±[`LOG_RATIO_CLAMP`], `max(−ratio·A, −clip(ratio)·A)` and where the clipped term won.
/// Shared by [`ppo_clipped_loss`] and [`overlap_opd_loss`].
fn clipped_surrogate(new: &Tensor, old: &Tensor, adv: &Tensor, eps_clip: f64, eps_clip_high: f64) -> Result<PpoTerms> {
    let adv = adv.f_detach()?;
    let ratio = new.f_sub(&old.f_detach()?)?.f_clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?.f_exp()?;
    let unclipped = ratio.f_mul(&adv)?.f_neg()?;
    let clipped_term = ratio.f_clamp(1.0 - eps_clip, 1.0 + eps_clip_high)?.f_mul(&adv)?.f_neg()?;
    let loss = unclipped.f_maximum(&clipped_term)?;
    let clipped = clipped_term.f_gt_tensor(&unclipped)?.f_to_kind(new.kind())?.f_detach()?;
    Ok(PpoTerms { loss, clipped, ratio })
}

/// k3 ("low-variance") estimator of KL(π_θ ‖ π_ref) per token (docs/method.md §6):
/// `kl_t = exp(ref_t − new_t) − 1 − (ref_t − new_t)`, clamped to [−10, 10] (k3 is ≥ 0, so only the
/// upper bound can bind). `new` `[B, T]` with gradient, `reference` `[B, T]` constant.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch; [`crate::Error::Torch`] on a tensor failure.
pub fn k3_kl(new: &Tensor, reference: &Tensor) -> Result<Tensor> {
    let (b, t) = dims2("new log-probs", new)?;
    check_shape("reference log-probs", reference, &[b, t])?;
    let d = reference.f_detach()?.f_sub(new)?;
    Ok(d.f_exp()?.f_sub_scalar(1.0)?.f_sub(&d)?.f_clamp(-10.0, 10.0)?)
}

/// Entropy `H_t = −Σ_v p_v log p_v` (nats) from the full log-softmax `[B, T, V]` → `[B, T]`
/// (docs/method.md §6, the entropy bonus; differentiable when `log_probs_full` is).
///
/// # Errors
/// [`crate::Error::Torch`] on a tensor failure.
pub fn entropy(log_probs_full: &Tensor) -> Result<Tensor> {
    let p = log_probs_full.f_exp()?;
    Ok(p.f_mul(log_probs_full)?.f_sum_dim_intlist(-1i64, false, log_probs_full.kind())?.f_neg()?)
}

/// Upper bound on the log of the top-K mass before the tail bin is computed (docs/method.md §6: the
/// logsumexp is clamped to ≤ −1e−7 so the tail `log(1 − exp(·))` stays finite).
pub const TOPK_LOGSUMEXP_MAX: f64 = -1e-7;

/// Appends the tail bin to top-K log-probs `[..., K]` → `[..., K + 1]` (docs/method.md §6):
/// `tail = log(1 − exp(min(logsumexp(topK), −1e−7)))`, computed as `log(−expm1(·))` (the same value,
/// accurate when the top-K mass is close to 1).
///
/// # Errors
/// [`crate::Error::Torch`] on a tensor failure (e.g. a 0-dimensional input).
pub fn add_tail_bin(topk_logprobs: &Tensor) -> Result<Tensor> {
    let lse = topk_logprobs.f_logsumexp(-1i64, true)?.f_clamp_max(TOPK_LOGSUMEXP_MAX)?;
    let tail = lse.f_expm1()?.f_neg()?.f_log()?;
    Ok(Tensor::f_cat(&[topk_logprobs, &tail], -1)?)
}

/// Top-K reverse-KL distillation per position (docs/method.md §6): with `s` = the student's log-probs at the
/// teacher's top-K ids and `t` = the teacher's top-K log-probs, both `[B, T, K]`, each extended with its
/// tail bin ([`add_tail_bin`]), `loss_t = Σ_{k=1}^{K+1} p_s,k · (log p_s,k − log p_t,k)` → `[B, T]`.
/// Differentiable in `student`; `teacher` is a constant.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the shapes differ or are not 3-D; [`crate::Error::Torch`] on a
/// tensor failure.
pub fn topk_reverse_kl(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    let size = student.size();
    if size.len() != 3 {
        return Err(input_err!("student top-K log-probs: shape {size:?}, expected [B, T, K]"));
    }
    check_shape("teacher top-K log-probs", teacher, &size)?;
    let s = add_tail_bin(student)?;
    let t = add_tail_bin(&teacher.f_detach()?)?;
    Ok(s.f_exp()?.f_mul(&s.f_sub(&t)?)?.f_sum_dim_intlist(-1i64, false, student.kind())?)
}

/// The OPD term of multi-candidate hints with overlap-guided selection (docs/method.md §3b), per position
/// `[B, T]`. At each position, over the ids v of the position's subset (the `J` ids given, those with
/// `subset` = 1; all when `None`):
/// - `old(v)` = `new(v)` detached (the reference recomputes old log-probs with the current weights),
/// - weight `w_v = softmax over the subset of old(v)`,
/// - advantage `A_v = clip(teacher(v) − old(v), −c, c) · w_v`,
/// - ratio `ρ_v = exp(clamp(new(v) − old(v), ±20))`, term
///   `max(−ρ_v·A_v, −clip(ρ_v, 1−ε, 1+ε_high)·A_v)`,
///
/// summed over the subset (0 where the subset is empty). `new` `[B, T, J]` = the current policy's
/// log-probs at the ids (with gradient), `teacher` `[B, T, J]` the chosen candidate teacher's log-probs
/// at the same ids, `subset` `[B, T, J]` 0/1. At ratio 1 the gradient is `−Σ_v A_v ∇new(v)`: the ids
/// the teacher prefers over the student are pushed up, in proportion to the student's own mass on them.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the shapes differ or are not 3-D; [`crate::Error::Torch`] on a
/// tensor failure.
pub fn overlap_opd_loss(new: &Tensor, teacher: &Tensor, subset: Option<&Tensor>, clip: f64, eps_clip: f64, eps_clip_high: f64) -> Result<Tensor> {
    let size = new.size();
    if size.len() != 3 {
        return Err(input_err!("log-probs at the subset ids: shape {size:?}, expected [B, T, J]"));
    }
    check_shape("teacher log-probs at the subset ids", teacher, &size)?;
    let kind = new.kind();
    let keep = match subset {
        Some(m) => {
            check_shape("subset mask", m, &size)?;
            m.f_detach()?.f_gt(0.0)?
        }
        None => new.f_ones_like()?.f_gt(0.0)?,
    };
    let old = new.f_detach()?;
    // A large finite negative, so an empty subset gives weights 0 and never NaN.
    let logits = old.f_where_self(&keep, &old.f_full_like(-1e30)?)?;
    let keep_f = keep.f_to_kind(kind)?;
    let w = logits.f_softmax(-1, kind)?.f_mul(&keep_f)?;
    let teacher = teacher.f_detach()?.f_where_self(&keep, &old)?;
    let adv = teacher.f_sub(&old)?.f_clamp(-clip, clip)?.f_mul(&w)?;
    let term = clipped_surrogate(new, &old, &adv, eps_clip, eps_clip_high)?.loss.f_mul(&keep_f)?;
    Ok(term.f_sum_dim_intlist(-1i64, false, kind)?)
}

/// Mean of `x` over each sample's masked tokens: `[B, T]` → `[B]`, `Σ_t x·m / max(Σ_t m, 1)` (a sample
/// with no masked token gives 0). Masked-out values never leak, even if non-finite.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch; [`crate::Error::Torch`] on a tensor failure.
pub fn sample_means(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    sample_means_over(x, mask, None)
}

/// [`sample_means`] with the denominators given: `Σ_t x·m / max(n_b, 1)` with `tokens` `[B]` = n_b,
/// the sample's trained tokens over all its positions (for a chunk of positions of the sample);
/// `None` counts them from `mask`.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch; [`crate::Error::Torch`] on a tensor failure.
pub fn sample_means_over(x: &Tensor, mask: &Tensor, tokens: Option<&Tensor>) -> Result<Tensor> {
    let (b, t) = dims2("values", x)?;
    check_shape("mask", mask, &[b, t])?;
    let num = masked(x, mask)?.f_sum_dim_intlist(1i64, false, x.kind())?;
    let den = match tokens {
        Some(n) => {
            check_shape("sample token counts", n, &[b])?;
            n.f_detach()?.f_to_kind(x.kind())?
        }
        None => mask.f_sum_dim_intlist(1i64, false, x.kind())?,
    };
    Ok(num.f_div(&den.f_clamp_min(1.0)?)?)
}

/// The step's aggregation (docs/method.md §6, the reference's effective loss): each sample's mean over its
/// masked tokens, multiplied by its weight (`weights` `[B]`, e.g. staleness down-weighting; all 1 when
/// `None`), summed, and divided by `num_samples` = N, the samples of the optimizer step (B when the
/// batch is the whole step): `(1/N) Σ_b w_b · Σ_t x_bt·m_bt / max(n_b, 1)`. `tokens` gives n_b when
/// `x` holds only some of the samples' positions ([`sample_means_over`]). Returns a 0-dimensional
/// tensor, differentiable in `x`.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch or `num_samples ≤ 0`; [`crate::Error::Torch`] on a
/// tensor failure.
pub fn mean_of_sample_means(x: &Tensor, mask: &Tensor, weights: Option<&Tensor>, tokens: Option<&Tensor>, num_samples: f64) -> Result<Tensor> {
    if !(num_samples > 0.0) {
        return Err(input_err!("the step's sample count must be positive, got {num_samples}"));
    }
    let means = sample_means_over(x, mask, tokens)?;
    let means = match weights {
        Some(w) => {
            check_shape("sample weights", w, &means.size())?;
            means.f_mul(&w.f_detach()?.f_to_kind(means.kind())?)?
        }
        None => means,
    };
    Ok(means.f_sum(means.kind())?.f_div_scalar(num_samples)?)
}

/// The top-K inputs of [`compute_loss`].
#[derive(Debug, Clone, Copy)]
pub struct TopkInputs<'a> {
    /// `[B, T, K]`: the student's (current policy's) log-probs at the teacher's top-K ids, with gradient.
    pub student: &'a Tensor,
    /// `[B, T, K]`: the teacher's top-K log-probs.
    pub teacher: &'a Tensor,
    /// `[B, T]`: positions that have top-K data (the loss mask of rows that carry top-K lists).
    pub mask: &'a Tensor,
    /// `[B, T, K]` 0/1: the ids of each position's subset for the overlap term (`opd_loss = overlap`);
    /// `None` = all K.
    pub subset: Option<&'a Tensor>,
}

/// Everything [`compute_loss`] reads. Shapes: B samples, T response positions.
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a> {
    /// `[B, T]`: current-policy log-probs of the response tokens, with gradient.
    pub new_logprobs: &'a Tensor,
    /// `[B, T]`: old (rollout or recomputed) log-probs.
    pub old_logprobs: &'a Tensor,
    /// `[B, T]`: teacher log-probs (required by OPD and combined).
    pub teacher_logprobs: Option<&'a Tensor>,
    /// `[B]`: scalar reward r per sample.
    pub reward: &'a Tensor,
    /// `[B, T]`, 0/1: trained response tokens (padding and loss-mask 0 are 0).
    pub mask: &'a Tensor,
    /// B entries: which docs/method.md §5 case produced each row.
    pub sample_types: &'a [SampleType],
    /// `[B]`: per-sample weight in the aggregation (staleness); all 1 when `None`.
    pub sample_weights: Option<&'a Tensor>,
    /// `[B]`: factor on each sample's advantages (±1 in a random-sign control arm,
    /// `TrainerConfig::advantage_sign`); all 1 when `None`.
    pub advantage_signs: Option<&'a Tensor>,
    /// `[B, T]`: reference-policy log-probs for the k3 KL (required when `kl_coef ≠ 0`).
    pub ref_logprobs: Option<&'a Tensor>,
    /// `[B, T]`: per-token entropy (required when `entropy_coef ≠ 0`).
    pub entropy: Option<&'a Tensor>,
    /// Top-K inputs (required when [`LossConfig::uses_topk`]).
    pub topk: Option<TopkInputs<'a>>,
    /// `[B]`: each sample's trained tokens over all its positions, `(mask, top-K mask)` sums, when the
    /// tensors above hold only a chunk of the positions; `None` counts them from the masks.
    pub sample_tokens: Option<(&'a Tensor, &'a Tensor)>,
    /// N, the samples of the optimizer step (the aggregation's denominator); `None` = B.
    pub num_samples: Option<f64>,
}

/// Scalar metrics of one batch (serialisable; the `train_steps` table's loss columns).
///
/// `loss`, `pg_loss`, `kl`, `entropy` and `topk_kl` are means over the step's samples of sample means
/// (weighted; [`mean_of_sample_means`]), exactly the quantities that enter the loss, so `loss = pg_loss + kl_coef·kl − entropy_coef·entropy +
/// topk_coef·topk_kl` (the last term only when the top-K loss is on). `clip_fraction` and `ppo_kl` are
/// means over all masked tokens of the batch (unweighted).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LossMetrics {
    /// Total loss.
    pub loss: f64,
    /// PPO clipped policy-gradient loss.
    pub pg_loss: f64,
    /// Fraction of masked tokens where the clipped PPO term was taken.
    pub clip_fraction: f64,
    /// Mean `old − new` log-prob over masked tokens (nats).
    pub ppo_kl: f64,
    /// k3 KL to the reference policy (0 without a reference).
    pub kl: f64,
    /// Policy entropy (nats; 0 when not computed).
    pub entropy: f64,
    /// Top-K reverse KL (0 without top-K data); with `opd_loss = overlap`, the overlap term
    /// ([`overlap_opd_loss`]) instead, which enters the loss with weight `w_opd`.
    pub topk_kl: f64,
    /// Mean advantage by sample type (kebab-case names): the mean over that type's samples of each
    /// sample's mean advantage over its masked tokens.
    pub advantage_by_type: BTreeMap<String, f64>,
    /// Masked (trained) response tokens in the batch.
    pub tokens: i64,
    /// Samples in the batch.
    pub samples: i64,
}

/// Per-sample values of every term (all `[B]`, no gradient): means over each sample's masked tokens,
/// unweighted.
#[derive(Debug)]
pub struct PerSampleTerms {
    /// Mean advantage.
    pub advantage: Tensor,
    /// Mean PPO loss.
    pub pg_loss: Tensor,
    /// Fraction of tokens clipped.
    pub clip_fraction: Tensor,
    /// Mean `old − new`.
    pub ppo_kl: Tensor,
    /// Mean k3 KL (0 without a reference).
    pub kl: Tensor,
    /// Mean entropy (0 when not given).
    pub entropy: Tensor,
    /// Mean top-K reverse KL over the row's top-K positions (0 without top-K data).
    pub topk_kl: Tensor,
    /// The sample's loss: `pg + kl_coef·kl − entropy_coef·entropy (+ topk_coef·topk_kl)`.
    pub loss: Tensor,
    /// Masked tokens.
    pub tokens: Tensor,
}

/// What [`compute_loss`] returns.
#[derive(Debug)]
pub struct LossOutput {
    /// 0-dimensional total loss, differentiable in the policy's parameters.
    pub loss: Tensor,
    /// `[B, T]` per-token advantages (no gradient).
    pub advantages: Tensor,
    /// Per-sample terms.
    pub per_sample: PerSampleTerms,
    /// Scalar metrics.
    pub metrics: LossMetrics,
}

fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.f_double_value(&[])?)
}

/// The full loss of a batch (docs/method.md §6): advantages ([`advantages`], times
/// [`LossInputs::advantage_signs`] when given), the PPO clipped surrogate
/// ([`ppo_clipped_loss`]), the k3 KL ([`k3_kl`]), the entropy bonus, the top-K reverse KL
/// ([`topk_reverse_kl`]), each aggregated by [`mean_of_sample_means`], combined as
/// `loss = pg_loss + kl_coef·kl − entropy_coef·entropy + topk_coef·topk_kl` (the top-K term only when
/// [`LossConfig::uses_topk`]). Terms whose inputs are given but whose weight is 0 are still reported.
///
/// # Errors
/// [`crate::Error::InvalidInput`] on a shape mismatch or a missing input the configuration needs
/// (teacher log-probs for OPD/combined, a reference for `kl_coef ≠ 0`, entropy for
/// `entropy_coef ≠ 0`, top-K inputs when the top-K loss is on); [`crate::Error::Torch`] on a tensor
/// failure.
pub fn compute_loss(cfg: &LossConfig, inp: &LossInputs<'_>) -> Result<LossOutput> {
    let new = inp.new_logprobs;
    let (b, t) = dims2("new log-probs", new)?;
    check_shape("old log-probs", inp.old_logprobs, &[b, t])?;
    check_shape("mask", inp.mask, &[b, t])?;
    let kind = new.kind();
    let mask = inp.mask.f_detach()?.f_to_kind(kind)?;
    let weights = inp.sample_weights;
    let n = inp.num_samples.unwrap_or(b as f64);
    let (tok, topk_tok) = match inp.sample_tokens {
        Some((a, t)) => (Some(a), Some(t)),
        None => (None, None),
    };
    let agg = |x: &Tensor, m: &Tensor, tokens: Option<&Tensor>| mean_of_sample_means(x, m, weights, tokens, n);

    // The OPD target's student side: the current policy (docs/method.md §6), `new` without gradient.
    let student = new.f_detach()?;
    let mut adv = advantages(cfg, inp.reward, &student, inp.teacher_logprobs, inp.sample_types, &mask)?;
    if let Some(s) = inp.advantage_signs {
        check_shape("advantage signs", s, &[b])?;
        adv = adv.f_mul(&s.f_detach()?.f_to_kind(kind)?.f_unsqueeze(1)?)?;
    }
    let ppo = ppo_clipped_loss(new, inp.old_logprobs, &adv, cfg.eps_clip, cfg.eps_clip_high)?;
    let pg_per = sample_means_over(&ppo.loss, &mask, tok)?;
    let pg_loss = agg(&ppo.loss, &mask, tok)?;
    let mut loss = pg_loss.shallow_clone();
    let mut sample_loss = pg_per.f_detach()?;
    let zeros_b = pg_per.f_zeros_like()?.f_detach()?;

    let kl_per = match inp.ref_logprobs {
        Some(r) => {
            let kl = k3_kl(new, r)?;
            if cfg.kl_coef != 0.0 {
                loss = loss.f_add(&agg(&kl, &mask, tok)?.f_mul_scalar(cfg.kl_coef)?)?;
            }
            let per = sample_means_over(&kl, &mask, tok)?.f_detach()?;
            sample_loss = sample_loss.f_add(&per.f_mul_scalar(cfg.kl_coef)?)?;
            per
        }
        None if cfg.kl_coef != 0.0 => return Err(input_err!("kl_coef = {} needs reference log-probs", cfg.kl_coef)),
        None => zeros_b.shallow_clone(),
    };

    let ent_per = match inp.entropy {
        Some(h) => {
            check_shape("entropy", h, &[b, t])?;
            if cfg.entropy_coef != 0.0 {
                loss = loss.f_sub(&agg(h, &mask, tok)?.f_mul_scalar(cfg.entropy_coef)?)?;
            }
            let per = sample_means_over(h, &mask, tok)?.f_detach()?;
            sample_loss = sample_loss.f_sub(&per.f_mul_scalar(cfg.entropy_coef)?)?;
            per
        }
        None if cfg.entropy_coef != 0.0 => return Err(input_err!("entropy_coef = {} needs the entropy", cfg.entropy_coef)),
        None => zeros_b.shallow_clone(),
    };

    let topk_per = match inp.topk {
        Some(tk) => {
            check_shape("top-K mask", tk.mask, &[b, t])?;
            let tmask = tk.mask.f_detach()?.f_to_kind(kind)?;
            let (term, coef) = if cfg.uses_overlap() {
                (overlap_opd_loss(tk.student, tk.teacher, tk.subset, cfg.overlap_clip, cfg.eps_clip, cfg.eps_clip_high)?, cfg.w_opd)
            } else {
                (topk_reverse_kl(tk.student, tk.teacher)?, cfg.topk_coef)
            };
            check_shape("top-K term", &term, &[b, t])?;
            let per = sample_means_over(&term, &tmask, topk_tok)?.f_detach()?;
            if cfg.uses_topk() || cfg.uses_overlap() {
                loss = loss.f_add(&agg(&term, &tmask, topk_tok)?.f_mul_scalar(coef)?)?;
                sample_loss = sample_loss.f_add(&per.f_mul_scalar(coef)?)?;
            }
            per
        }
        // A batch of rows without a hint (e.g. only combined-score-only rows) has no teacher term; a
        // hinted row without the term's data is an error (the packing drops such rows first).
        None if (cfg.uses_topk() || cfg.uses_overlap()) && inp.sample_types.iter().any(|s| s.has_hint()) => {
            return Err(input_err!("opd_loss = {} needs top-K teacher log-probs", cfg.opd_loss.as_str()))
        }
        None => zeros_b.shallow_clone(),
    };

    // Metrics (no gradient).
    let w = match weights {
        Some(w) => w.f_detach()?.f_to_kind(kind)?,
        None => pg_per.f_ones_like()?.f_detach()?,
    };
    let wsum = |per: &Tensor| -> Result<f64> { Ok(scalar(&per.f_mul(&w)?.f_sum(kind)?)? / n) };
    let tokens_per = mask.f_sum_dim_intlist(1i64, false, kind)?;
    let tokens = scalar(&tokens_per.f_sum(kind)?)?;
    let token_mean = |x: &Tensor| -> Result<f64> {
        if tokens <= 0.0 {
            return Ok(0.0);
        }
        Ok(scalar(&masked(x, &mask)?.f_sum(kind)?)? / tokens)
    };
    let log_ratio = inp.old_logprobs.f_detach()?.f_sub(&new.f_detach()?)?;
    let adv_per = sample_means(&adv, &mask)?;
    let adv_vals: Vec<f64> = Vec::<f64>::try_from(&adv_per.f_to_kind(Kind::Double)?.f_to_device(tch::Device::Cpu)?)?;
    let mut by_type: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for (st, a) in inp.sample_types.iter().zip(&adv_vals) {
        let e = by_type.entry(st.as_str().to_string()).or_default();
        e.0 += a;
        e.1 += 1;
    }
    let metrics = LossMetrics {
        loss: scalar(&loss)?,
        pg_loss: scalar(&pg_loss)?,
        clip_fraction: token_mean(&ppo.clipped)?,
        ppo_kl: token_mean(&log_ratio)?,
        kl: wsum(&kl_per)?,
        entropy: wsum(&ent_per)?,
        topk_kl: wsum(&topk_per)?,
        advantage_by_type: by_type.into_iter().map(|(k, (s, n))| (k, s / n as f64)).collect(),
        tokens: tokens.round() as i64,
        samples: b,
    };
    let per_sample = PerSampleTerms {
        advantage: adv_per,
        pg_loss: pg_per.f_detach()?,
        clip_fraction: sample_means(&ppo.clipped, &mask)?,
        ppo_kl: sample_means(&log_ratio, &mask)?,
        kl: kl_per,
        entropy: ent_per,
        topk_kl: topk_per,
        loss: sample_loss,
        tokens: tokens_per,
    };
    Ok(LossOutput { loss, advantages: adv, per_sample, metrics })
}

#[cfg(test)]
mod tests;
