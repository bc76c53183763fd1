//! The figures of one optimizer step a practitioner reads first — reward mean and std, learning rate,
//! response lengths, tokens/s, staleness, positive/negative advantage token fractions, and how much of
//! the advantage came from the reward and how much from the teacher — computed from the step's trained
//! samples and advantages (pure; the `train_steps` columns of schema versions 2 and 3).

use std::collections::BTreeMap;

use serde::Serialize;

use super::advantage_parts::AdvantageParts;
use super::batch::Dropped;
use crate::schema::Sample;

/// What [`step_figures`] returns (the new `train_steps` columns, same units).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StepFigures {
    pub reward_mean: f64,
    /// Population standard deviation (divides by n).
    pub reward_std: f64,
    pub learning_rate: f64,
    /// Tokens.
    pub response_length_mean: f64,
    /// Tokens.
    pub response_length_max: i64,
    /// Masked tokens per second of wall time (0 when `seconds` is 0).
    pub tokens_per_second: f64,
    /// Versions behind; `None` when no trained sample has a policy version.
    pub staleness_mean: Option<f64>,
    pub staleness_max: Option<i64>,
    pub positive_advantage_fraction: f64,
    pub negative_advantage_fraction: f64,
    /// JSON `{"<type>": {"positive": f, "negative": f}}`.
    pub advantage_sign_by_type: String,
    /// Mean over the masked tokens of |reward part of `A_t`| ([`AdvantageParts`]).
    pub advantage_reward_abs_mean: f64,
    /// Mean over the masked tokens of |teacher part of `A_t`|.
    pub advantage_teacher_abs_mean: f64,
    /// Fraction of the masked tokens whose teacher part is > 0.
    pub teacher_term_positive_fraction: f64,
    /// Fraction of the masked tokens whose teacher part is < 0.
    pub teacher_term_negative_fraction: f64,
}

#[derive(Serialize)]
struct SignFractions {
    positive: f64,
    negative: f64,
}

fn fraction(part: i64, all: i64) -> f64 {
    if all == 0 {
        0.0
    } else {
        part as f64 / all as f64
    }
}

/// The step's figures over the samples not in `dropped` (the trained ones): `version` is the trainer's
/// checkpoint version (staleness = `version − policy_version`, at least 0), `lr` the learning rate of
/// the step, `tokens` / `seconds` the step's masked tokens and wall time, `signs` the masked tokens by
/// sample type as `(advantage > 0, advantage < 0, all)`, `parts` the advantages' reward and teacher
/// parts.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_figures(
    samples: &[Sample],
    dropped: &[Dropped],
    version: i64,
    lr: f64,
    tokens: i64,
    seconds: f64,
    signs: &BTreeMap<String, (i64, i64, i64)>,
    parts: &AdvantageParts,
) -> StepFigures {
    let kept: Vec<&Sample> = samples.iter().enumerate().filter(|(i, _)| !dropped.iter().any(|d| d.index == *i)).map(|(_, s)| s).collect();
    let n = kept.len().max(1) as f64;
    let reward_mean = kept.iter().map(|s| s.reward as f64).sum::<f64>() / n;
    let reward_std = (kept.iter().map(|s| (s.reward as f64 - reward_mean).powi(2)).sum::<f64>() / n).sqrt();
    let lengths: Vec<i64> = kept.iter().map(|s| s.response_token_ids.len() as i64).collect();
    let stale: Vec<i64> = kept.iter().filter_map(|s| s.policy_version).map(|v| (version - v).max(0)).collect();
    let (pos, neg, all) = signs.values().fold((0, 0, 0), |a, s| (a.0 + s.0, a.1 + s.1, a.2 + s.2));
    let by_type: BTreeMap<&str, SignFractions> =
        signs.iter().map(|(k, s)| (k.as_str(), SignFractions { positive: fraction(s.0, s.2), negative: fraction(s.1, s.2) })).collect();
    let means = parts.means();
    StepFigures {
        reward_mean,
        reward_std,
        learning_rate: lr,
        response_length_mean: lengths.iter().sum::<i64>() as f64 / n,
        response_length_max: lengths.iter().copied().max().unwrap_or(0),
        tokens_per_second: if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 },
        staleness_mean: (!stale.is_empty()).then(|| stale.iter().sum::<i64>() as f64 / stale.len() as f64),
        staleness_max: stale.iter().copied().max(),
        positive_advantage_fraction: fraction(pos, all),
        negative_advantage_fraction: fraction(neg, all),
        advantage_sign_by_type: serde_json::to_string(&by_type).unwrap_or_else(|_| "{}".into()),
        advantage_reward_abs_mean: means.map_or(0.0, |m| m.reward),
        advantage_teacher_abs_mean: means.map_or(0.0, |m| m.teacher),
        teacher_term_positive_fraction: means.map_or(0.0, |m| m.teacher_positive),
        teacher_term_negative_fraction: means.map_or(0.0, |m| m.teacher_negative),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::SampleType;
    use crate::trainer::batch::DropReason;
    use crate::trainer::test_util::sample;

    #[test]
    fn figures_of_a_hand_made_step() {
        let mut a = sample("a", SampleType::Binary, &[1], &[5, 6], &[-1.0, -1.0], 1.0);
        a.policy_version = Some(3);
        let mut b = sample("b", SampleType::Binary, &[1], &[5, 6, 7, 8], &[-1.0; 4], -1.0);
        b.policy_version = Some(1);
        let mut c = sample("c", SampleType::Opd, &[1], &[5, 6, 7], &[-1.0; 3], 0.0);
        c.policy_version = None;
        // dropped: its reward, length and version must not count
        let mut d = sample("d", SampleType::Opd, &[1], &[5; 20], &[-1.0; 20], 100.0);
        d.policy_version = Some(-50);
        let dropped = vec![Dropped { index: 3, sample_id: "d".into(), reason: DropReason::EmptyPrompt, detail: String::new() }];
        let signs = BTreeMap::from([("binary".to_string(), (2, 4, 6)), ("opd".to_string(), (1, 1, 3))]);
        let parts = AdvantageParts { reward_abs: 6.0, teacher_abs: 1.5, teacher_positive: 1, teacher_negative: 2, tokens: 9 };
        let f = step_figures(&[a, b, c, d], &dropped, 4, 1e-5, 9, 0.5, &signs, &parts);
        assert_eq!((f.advantage_reward_abs_mean, f.advantage_teacher_abs_mean), (6.0 / 9.0, 1.5 / 9.0));
        assert_eq!((f.teacher_term_positive_fraction, f.teacher_term_negative_fraction), (1.0 / 9.0, 2.0 / 9.0));
        // rewards 1, −1, 0: mean 0, population variance 2/3
        assert_eq!(f.reward_mean, 0.0);
        assert!((f.reward_std - (2.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(f.learning_rate, 1e-5);
        assert_eq!(f.response_length_mean, 3.0);
        assert_eq!(f.response_length_max, 4);
        assert_eq!(f.tokens_per_second, 18.0);
        // versions 3 and 1 against 4 (c has none): staleness 1 and 3
        assert_eq!(f.staleness_mean, Some(2.0));
        assert_eq!(f.staleness_max, Some(3));
        assert!((f.positive_advantage_fraction - 3.0 / 9.0).abs() < 1e-12);
        assert!((f.negative_advantage_fraction - 5.0 / 9.0).abs() < 1e-12);
        let by_type: serde_json::Value = serde_json::from_str(&f.advantage_sign_by_type).unwrap();
        assert!((by_type["binary"]["positive"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);
        assert!((by_type["binary"]["negative"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((by_type["opd"]["negative"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);

        let e = Sample { policy_version: None, ..sample("e", SampleType::Opd, &[1], &[5], &[-1.0], 0.0) };
        let none = step_figures(&[e], &[], 2, 1e-5, 1, 0.0, &BTreeMap::new(), &AdvantageParts::default());
        assert_eq!((none.advantage_reward_abs_mean, none.teacher_term_positive_fraction), (0.0, 0.0));
        assert_eq!((none.staleness_mean, none.staleness_max, none.tokens_per_second), (None, None, 0.0));
    }
}
