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
        "weights: {}  method: {}  version: {}\n{:<34} {:<20} {:>6} {:>6} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10} {:>11}\n",
        r.weights, r.report.method, r.report.version, "sample_id", "type", "tokens", "reward", "advantage", "pg_loss", "clip", "ppo_kl", "entropy", "t-s gap", "r-c gap"
    );
    // The report's rows are the kept samples in input order; `teacher_gap` has one entry per input
    // sample, dropped ones included.
    let dropped: std::collections::HashSet<usize> = r.report.dropped.iter().map(|d| d.index).collect();
    let kept: Vec<usize> = (0..r.teacher_gap.len()).filter(|i| !dropped.contains(i)).collect();
    for (i, x) in r.report.samples.iter().enumerate() {
        let gap = kept.get(i).and_then(|&k| r.teacher_gap[k]).map(|g| format!("{g:.4}")).unwrap_or_else(|| "-".into());
        let rollout_gap = format!("{:.4}{}", x.logprob_gap, if x.over_gap_bound { "*" } else { " " });
        s.push_str(&format!(
            "{:<34} {:<20} {:>6} {:>6.1} {:>10.4} {:>10.4} {:>8.3} {:>10.2e} {:>10.4} {:>10} {:>11}\n",
            x.sample_id, x.sample_type, x.tokens, x.reward, x.advantage, x.pg_loss, x.clip_fraction, x.ppo_kl, x.entropy, gap, rollout_gap
        ));
    }
    let over = r.report.samples.iter().filter(|x| x.over_gap_bound).count();
    if over > 0 {
        s.push_str(&format!(
            "* r-c gap (mean |rollout − current| log-prob, nats per trained token) above trainer.quarantine.max_logprob_gap: a training step would quarantine these {over} sample(s) (reason logprob_gap)\n"
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::{DropReason, Dropped, LossReport, SampleLoss};

    fn row(id: &str, logprob_gap: f64, over_gap_bound: bool) -> SampleLoss {
        SampleLoss {
            sample_id: id.into(),
            sample_type: "opd".into(),
            policy_version: Some(0),
            tokens: 2,
            reward: 0.0,
            weight: 1.0,
            advantage: 0.0,
            pg_loss: 0.0,
            clip_fraction: 0.0,
            ppo_kl: 0.0,
            kl: 0.0,
            entropy: 1.0,
            topk_kl: 0.0,
            loss: 0.0,
            logprob_gap,
            over_gap_bound,
            token_advantages: vec![],
            student_logprobs: vec![],
            teacher_logprobs: None,
        }
    }

    /// The teacher − student gap is an input-order column: with the middle sample dropped, the third
    /// sample's row shows the third input's gap, not the second's. The rollout − current gap is marked
    /// where a training step would quarantine the sample.
    #[test]
    fn columns_line_up_with_dropped_samples_and_mark_the_quarantine() {
        let report = LossReport {
            method: "opd".into(),
            version: 0,
            step: 0,
            batch_size: 3,
            samples: vec![row("s1", 0.25, false), row("s3", 3.5, true)],
            batches: vec![],
            dropped: vec![Dropped { index: 1, sample_id: "s2".into(), reason: DropReason::MissingTeacher, detail: "no teacher".into() }],
        };
        let r = LossCommandReport { weights: "w".into(), report, token_logprobs: vec![vec![]; 3], teacher_gap: vec![Some(0.125), None, Some(-0.5)] };
        let text = render_loss_report(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].ends_with("t-s gap     r-c gap"), "{text}");
        assert!(lines[2].starts_with("s1 ") && lines[2].ends_with("0.1250     0.2500 "), "{text}");
        assert!(lines[3].starts_with("s3 ") && lines[3].ends_with("-0.5000     3.5000*"), "{text}");
        assert!(lines[4].starts_with("* r-c gap") && lines[4].contains("these 1 sample(s)"), "{text}");
        assert_eq!(lines[5], "dropped s2: missing_teacher (no teacher)");
    }
}
