//! The loss report: every loss component of each sample under the current weights, without updating
//! them (`nextstate loss-report`, the ablation's held-out losses).

use serde::Serialize;
use tch::{Kind, Tensor};

use super::accumulate::{evaluate, pack_options_for};
use super::batch::{pack_samples, Dropped};
use super::config::TrainerConfig;
use super::loss::LossMetrics;
use super::policy::Policy;
use crate::method::Method;
use crate::schema::Sample;
use crate::Result;

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
    /// Mean |rollout − current| log-prob over its trained tokens (nats): what the trainer's
    /// `logprob_gap` quarantine rule measures ([`super::config::QuarantineSettings::max_logprob_gap`]).
    pub logprob_gap: f64,
    /// `logprob_gap` is above `trainer.quarantine.max_logprob_gap`: a training step would quarantine
    /// this sample (drop reason `logprob_gap`) instead of training on it.
    pub over_gap_bound: bool,
    /// Per response token (length = the sample's response length): the advantage `A_t` the loss used
    /// (docs/method.md §6; 0 on untrained tokens), times the sample's sign in a random-sign control arm.
    pub token_advantages: Vec<f64>,
    /// Per response token: the current policy's log-prob (nats) of the token under the weights
    /// evaluated — the student side of the OPD target `teacher − student`.
    pub student_logprobs: Vec<f64>,
    /// Per response token: the teacher log-probs (nats) of the PPO teacher term; `None` when the
    /// configuration has no such term (binary, `opd_loss = topk` or `overlap`) or the sample has none.
    pub teacher_logprobs: Option<Vec<f64>>,
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

/// Row `i` of a `[B, T]` tensor, its first `len` positions (at most T).
fn row(t: &Tensor, i: usize, len: usize) -> Result<Vec<f64>> {
    let r = to_vec(&t.f_get(i as i64)?)?;
    Ok(r[..len.min(r.len())].to_vec())
}

/// Computes, without updating weights (under `no_grad`), the advantages and every loss component of each
/// sample under `policy`'s current weights, in chunks of `cfg.batch_size` (docs/method.md §6). `version` is
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
            let len = s.response_token_ids.len();
            let token_advantages = row(&ev.out.advantages, i, len)?;
            let student_logprobs = row(&ev.student, i, len)?;
            let teacher_logprobs = match (&ev.teacher, &s.teacher_logprobs) {
                (Some(t), Some(_)) if lcfg.teacher_in_advantage() => Some(row(t, i, len)?),
                _ => None,
            };
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
                logprob_gap: ev.row_gaps[i],
                over_gap_bound: ev.row_gaps[i] > cfg.quarantine.max_logprob_gap,
                token_advantages,
                student_logprobs,
                teacher_logprobs,
            });
        }
        report.batches.push(ev.out.metrics);
    }
    Ok(report)
}
