//! `nextstate loss`: every loss component per sample under a policy or checkpoint, without updating
//! weights ([`crate::trainer::loss_report`] plus the per-token log-probs the trainer's forward pass sees).

use crate::config::PipelineConfig;
use crate::error::Result;
use crate::model::{LanguageModel, LoadOptions, Trainable};
use crate::schema::Sample;

/// What `nextstate loss` prints: the trainer's loss report plus each sample's per-token log-probs under
/// the evaluated weights (the same numbers the trainer's forward pass sees).
#[derive(Debug, serde::Serialize)]
pub struct LossCommandReport {
    /// Weights evaluated (model or checkpoint folder).
    pub weights: String,
    /// Per-sample advantages and loss components, per-chunk metrics, dropped samples.
    pub report: crate::trainer::LossReport,
    /// Per sample (input order): log π(response_t | prompt, response_<t) for every response token (nats),
    /// at `trainer.temperature`.
    pub token_logprobs: Vec<Vec<f32>>,
    /// Per sample: mean (teacher − student) log-prob over the response (null without teacher log-probs).
    pub teacher_gap: Vec<Option<f64>>,
}

/// Computes [`LossCommandReport`] for `samples` under the pipeline's policy or `checkpoint`.
///
/// # Errors
/// Model loading errors; the errors of [`crate::trainer::loss_report`].
pub fn loss_command(cfg: &PipelineConfig, checkpoint: Option<&std::path::Path>, samples: &[Sample]) -> Result<LossCommandReport> {
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let opts = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable: Trainable::Frozen };
    let (lm, version, weights) = match checkpoint {
        Some(dir) => {
            let lm = LanguageModel::load_checkpoint(dir, Some(&cfg.policy.model), &opts)?;
            let version = crate::trainer::Manifest::read(dir).map(|m| m.version).unwrap_or(0);
            (lm, version, dir.display().to_string())
        }
        None => (LanguageModel::load(&cfg.policy.model, &opts)?, 0, cfg.policy.model.display().to_string()),
    };
    let report = crate::trainer::loss_report(&lm, None, cfg.method, &cfg.trainer, version, samples)?;
    let items: Vec<(Vec<u32>, Vec<u32>)> = samples
        .iter()
        .map(|s| (s.prompt_token_ids.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect()))
        .collect();
    let mut token_logprobs = vec![];
    for chunk in items.chunks(cfg.trainer.batch_size.max(1)) {
        token_logprobs.extend(lm.score_at_temperature(chunk, 0, &[], cfg.trainer.temperature)?.into_iter().map(|s| s.logprobs));
    }
    let teacher_gap = samples
        .iter()
        .zip(&token_logprobs)
        .map(|(s, lp)| {
            s.teacher_logprobs.as_ref().filter(|t| t.len() == lp.len() && !lp.is_empty()).map(|t| {
                t.iter().zip(lp).map(|(a, b)| (*a - *b) as f64).sum::<f64>() / lp.len() as f64
            })
        })
        .collect();
    Ok(LossCommandReport { weights, report, token_logprobs, teacher_gap })
}

/// A text table of a loss report, one line per sample plus the batch totals.
pub fn render_loss_report(r: &LossCommandReport) -> String {
    let mut s = format!(
        "weights: {}  method: {}  version: {}\n{:<34} {:<20} {:>6} {:>6} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10}\n",
        r.weights, r.report.method, r.report.version, "sample_id", "type", "tokens", "reward", "advantage", "pg_loss", "clip", "ppo_kl", "entropy", "t-s gap"
    );
    for (i, x) in r.report.samples.iter().enumerate() {
        let gap = r.teacher_gap.get(i).copied().flatten().map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "{:<34} {:<20} {:>6} {:>6.1} {:>10.4} {:>10.4} {:>8.3} {:>10.2e} {:>10.4} {:>10}\n",
            x.sample_id, x.sample_type, x.tokens, x.reward, x.advantage, x.pg_loss, x.clip_fraction, x.ppo_kl, x.entropy, gap
        ));
    }
    for (i, b) in r.report.batches.iter().enumerate() {
        s.push_str(&format!(
            "batch {i}: loss={:.5} pg_loss={:.5} clip_fraction={:.3} ppo_kl={:.2e} kl={:.4} entropy={:.4} topk_kl={:.4} tokens={}\n",
            b.loss, b.pg_loss, b.clip_fraction, b.ppo_kl, b.kl, b.entropy, b.topk_kl, b.tokens
        ));
    }
    for d in &r.report.dropped {
        s.push_str(&format!("dropped {}: {} ({})\n", d.sample_id, d.reason.as_str(), d.detail));
    }
    s
}
