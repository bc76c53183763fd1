//! Evaluation of one policy version (the initial weights or a checkpoint): the personalization score on
//! held-out GSM8K problems (greedy answers from [`crate::demo::heldout`], scored by
//! [`crate::demo::personalization_score`]), the held-out loss components of the arm's own held-out
//! samples ([`crate::trainer::loss_report`]), and the teacher/student log-prob gap on hinted held-out
//! samples. Also the per-sample advantages of the training samples (no model needed: docs/method.md §6 with
//! the rollout log-probs as `old`) and judge-vs-outcome agreement.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::results::{AgreementRow, GapRow, HeldoutRow, JudgeSessionRow, ResponseRow};
use crate::method::Method;
use crate::demo::{check, personalization_score, Preferences, Problem, Score};
use crate::error::Result;
use crate::model::LanguageModel;
use crate::schema::{Interaction, Judgment, Sample, TurnType};
use crate::trainer::TrainerConfig;

/// Everything measured for one version of one arm (cached as `eval/v<version>.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionEval {
    /// Policy version.
    pub version: i64,
    /// Optimizer steps behind it.
    pub step: i64,
    /// Position of the last trained interaction in the ordered stream (0 for v0).
    pub interactions_seen: i64,
    /// Samples trained on.
    pub samples_seen: i64,
    /// Personalization score of the greedy answers.
    pub score: Score,
    /// The answers and their verdicts.
    pub responses: Vec<ResponseRow>,
    /// Held-out loss terms, one row per held-out sample of the arm's data pipeline.
    pub heldout: Vec<HeldoutRow>,
    /// Teacher/student gap, one row per hinted held-out sample.
    pub gaps: Vec<GapRow>,
    /// Log-prob sums of the fixed token sets by group ([`super::mass`]; empty in evaluations written
    /// before it existed).
    #[serde(default)]
    pub mass: Vec<super::mass::MassRow>,
    /// The token sets `mass` scored (empty in evaluations written before it existed: then the sets of
    /// its rows).
    #[serde(default)]
    pub mass_sets: Vec<String>,
}

impl VersionEval {
    /// The token sets this evaluation scored: `mass_sets`, or where that is empty the sets of its rows.
    pub fn scored_sets(&self) -> Vec<String> {
        if !self.mass_sets.is_empty() {
            return self.mass_sets.clone();
        }
        let mut sets: Vec<String> = self.mass.iter().map(|r| r.set.clone()).collect();
        sets.sort();
        sets.dedup();
        sets
    }
}

/// The personalization score and the response rows of `answers`.
pub fn score_answers(arm: &str, version: i64, answers: &[(Problem, String)], prefs: &Preferences) -> (Score, Vec<ResponseRow>) {
    let rows = answers
        .iter()
        .map(|(p, r)| {
            let v = check(r, p, prefs);
            ResponseRow {
                arm: arm.into(),
                version,
                problem_id: p.id as i64,
                satisfied: v.satisfied,
                correct: v.correct,
                violations: v.violations.iter().map(|x| x.tagged()).collect(),
                response_text: r.clone(),
            }
        })
        .collect();
    (personalization_score(answers, prefs), rows)
}

/// Every loss term of each held-out sample under `lm`, with the arm's method and trainer settings
/// (means over each sample's trained tokens; [`crate::trainer::loss_report`]).
///
/// # Errors
/// The errors of [`crate::trainer::loss_report`].
pub fn heldout_rows(lm: &LanguageModel, arm: &str, version: i64, method: Method, trainer: &TrainerConfig, samples: &[Sample]) -> Result<Vec<HeldoutRow>> {
    if samples.is_empty() {
        return Ok(vec![]);
    }
    let r = crate::trainer::loss_report(lm, None, method, trainer, version, samples)?;
    Ok(r.samples
        .into_iter()
        .map(|s| HeldoutRow {
            arm: arm.into(),
            version,
            sample_id: s.sample_id,
            sample_type: s.sample_type,
            tokens: s.tokens,
            reward: s.reward,
            advantage: s.advantage,
            pg_loss: s.pg_loss,
            clip_fraction: s.clip_fraction,
            ppo_kl: s.ppo_kl,
            entropy: s.entropy,
            topk_kl: s.topk_kl,
            loss: s.loss,
        })
        .collect())
}

/// Mean over the masked response tokens of `values` (None when no token is masked in).
fn masked_mean(values: impl Iterator<Item = f64>, mask: &[i32]) -> Option<f64> {
    let (mut s, mut n) = (0.0, 0usize);
    for (v, m) in values.zip(mask) {
        if *m != 0 {
            s += v;
            n += 1;
        }
    }
    (n > 0).then(|| s / n as f64)
}

/// The teacher/student gap of each sample that has teacher log-probs: mean over its masked response
/// tokens of `teacher_t − student_t`, where `student_t` is `lm`'s log-prob of the response token
/// (nats) at `temperature` (the arm's `trainer.temperature`, which its teacher stage scored at);
/// samples are scored `batch` at a time. Samples without teacher log-probs are skipped.
///
/// # Errors
/// Model errors.
pub fn gap_rows(lm: &LanguageModel, arm: &str, version: i64, samples: &[Sample], batch: usize, temperature: f64) -> Result<Vec<GapRow>> {
    let with: Vec<&Sample> = samples.iter().filter(|s| s.teacher_logprobs.is_some()).collect();
    let mut out = vec![];
    for chunk in with.chunks(batch.max(1)) {
        let items: Vec<(Vec<u32>, Vec<u32>)> = chunk
            .iter()
            .map(|s| (s.prompt_token_ids.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect()))
            .collect();
        for (s, scored) in chunk.iter().zip(lm.score_at_temperature(&items, 0, &[], temperature)?) {
            let teacher = s.teacher_logprobs.as_deref().unwrap_or_default();
            if teacher.len() != scored.logprobs.len() {
                continue;
            }
            let student = masked_mean(scored.logprobs.iter().map(|x| f64::from(*x)), &s.loss_mask);
            if let (Some((gap, abs_gap)), Some(student_logprob)) = (token_gap(teacher, &scored.logprobs, &s.loss_mask), student) {
                out.push(GapRow { arm: arm.into(), version, sample_id: s.sample_id.clone(), tokens: s.loss_mask.iter().filter(|m| **m != 0).count() as i64, gap, abs_gap: Some(abs_gap), student_logprob });
            }
        }
    }
    Ok(out)
}

/// The signed and the absolute teacher − student gap of one response: the means over the tokens with a
/// non-zero `mask` of `teacher − student` and of `|teacher − student|` (log-probs, nats; all three
/// slices one entry per response token). The signed mean can be 0 for a student that is above the
/// teacher on some tokens and below on others; the absolute one is 0 only where they agree. None when
/// no token is masked in.
fn token_gap(teacher: &[f32], student: &[f32], mask: &[i32]) -> Option<(f64, f64)> {
    let diff = || teacher.iter().zip(student).map(|(t, s)| f64::from(*t) - f64::from(*s));
    Some((masked_mean(diff(), mask)?, masked_mean(diff().map(f64::abs), mask)?))
}

/// Each sample's mean advantage over its masked tokens as the arm's loss computes it at the start of
/// training: the mean over its trained tokens of [`token_advantages`] (0 for a sample without one).
///
/// # Errors
/// As [`token_advantages`].
pub fn sample_advantages(method: Method, trainer: &TrainerConfig, samples: &[Sample]) -> Result<Vec<f64>> {
    samples
        .iter()
        .map(|s| Ok(masked_mean(token_advantages(method, trainer, s)?.iter().map(|x| f64::from(*x)), &s.loss_mask).unwrap_or(0.0)))
        .collect()
}

/// One sample's advantage per response token (length `response_token_ids`, f32) as the arm's loss
/// computes it at the start of training (docs/method.md §6, [`crate::trainer::loss::advantages`]): the OPD
/// target's student side is the current policy, which at the start is v0, the weights that collected
/// every sample, so its log-probs of the response are the sample's rollout log-probs; times the sample's
/// sign in a random-sign control arm ([`TrainerConfig::advantage_sign_of`]).
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the sample lacks what the method needs; tensor errors.
pub fn token_advantages(method: Method, trainer: &TrainerConfig, s: &Sample) -> Result<Vec<f32>> {
    let cfg = trainer.loss_config(method);
    let t = s.response_token_ids.len() as i64;
    let old = Tensor::f_from_slice(&s.rollout_logprobs)?.f_reshape([1, t])?;
    let mask = Tensor::f_from_slice(&s.loss_mask)?.f_to_kind(tch::Kind::Float)?.f_reshape([1, t])?;
    let reward = Tensor::f_from_slice(&[s.reward])?;
    let teacher = match &s.teacher_logprobs {
        Some(v) => Some(Tensor::f_from_slice(v)?.f_reshape([1, t])?),
        None => None,
    };
    let a = crate::trainer::loss::advantages(&cfg, &reward, &old, teacher.as_ref(), &[s.sample_type], &mask)?;
    let sign = trainer.advantage_sign_of(&s.sample_id);
    Ok(Vec::<f32>::try_from(&a.f_reshape([t])?)?.into_iter().map(|x| x * sign).collect())
}

/// Judge-vs-outcome agreement of `pipeline`'s judgments: per labelled session (main turns with an
/// `outcome_reward`), the mean PRM score of its judged turns; a session is predicted a success when that
/// mean is > 0 and is one when its reward ≥ `threshold`. Sessions without judged turns count in
/// `sessions` but not in the confusion counts.
pub fn judge_agreement(pipeline: &str, arms: &str, interactions: &[Interaction], judgments: &[Judgment], threshold: f64) -> (AgreementRow, Vec<JudgeSessionRow>) {
    let mut reward: BTreeMap<&str, f64> = BTreeMap::new();
    for i in interactions.iter().filter(|i| i.turn_type == TurnType::Main) {
        if let Some(r) = i.outcome_reward {
            reward.insert(&i.session_id, r);
        }
    }
    let mut scores: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
    for j in judgments.iter().filter(|j| j.pipeline == pipeline) {
        scores.entry(&j.session_id).or_default().push(j.score);
    }
    let mut row = AgreementRow {
        judge_pipeline: pipeline.into(),
        arms: arms.into(),
        sessions: reward.len() as i64,
        sessions_judged: 0,
        agree: 0,
        true_pos: 0,
        false_pos: 0,
        true_neg: 0,
        false_neg: 0,
        accuracy: None,
        mean_score_success: None,
        mean_score_failure: None,
        turns_judged: 0,
        turns_pos: 0,
        turns_zero: 0,
        turns_neg: 0,
    };
    let mut sessions = vec![];
    let (mut succ, mut fail) = (vec![], vec![]);
    for (sid, r) in &reward {
        let s = scores.get(sid).cloned().unwrap_or_default();
        let mean = (!s.is_empty()).then(|| s.iter().map(|&x| f64::from(x)).sum::<f64>() / s.len() as f64);
        row.turns_judged += s.len() as i64;
        row.turns_pos += s.iter().filter(|x| **x > 0).count() as i64;
        row.turns_zero += s.iter().filter(|x| **x == 0).count() as i64;
        row.turns_neg += s.iter().filter(|x| **x < 0).count() as i64;
        if let Some(m) = mean {
            row.sessions_judged += 1;
            let (pred, actual) = (m > 0.0, *r >= threshold);
            match (pred, actual) {
                (true, true) => row.true_pos += 1,
                (true, false) => row.false_pos += 1,
                (false, false) => row.true_neg += 1,
                (false, true) => row.false_neg += 1,
            }
            if actual {
                succ.push(m);
            } else {
                fail.push(m);
            }
        }
        sessions.push(JudgeSessionRow { judge_pipeline: pipeline.into(), session_id: sid.to_string(), outcome_reward: *r, turns_judged: s.len() as i64, mean_score: mean });
    }
    row.agree = row.true_pos + row.true_neg;
    row.accuracy = (row.sessions_judged > 0).then(|| row.agree as f64 / row.sessions_judged as f64);
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    row.mean_score_success = mean(&succ);
    row.mean_score_failure = mean(&fail);
    (row, sessions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ablate::fixtures::{interaction, judgment, sample};
    use crate::schema::SampleType;

    #[test]
    fn advantages_follow_method_6() {
        let t = TrainerConfig { w_rl: 0.5, w_opd: 2.0, ..Default::default() };
        // binary: A = r
        let b = sample(SampleType::Binary, -1.0, &[-1.0, -2.0], None, &[1, 1]);
        assert_eq!(sample_advantages(Method::Binary, &t, &[b]).unwrap(), vec![-1.0]);
        // OPD: mean(teacher − old) over masked tokens: (−0.5 − 1.0)/2 (third token masked out)
        let o = sample(SampleType::Opd, 0.0, &[-1.0, -1.0, -3.0], Some(&[-1.5, -2.0, 9.0]), &[1, 1, 0]);
        assert_eq!(sample_advantages(Method::Opd, &t, std::slice::from_ref(&o)).unwrap(), vec![-0.75]);
        // combined both: 0.5·1 + 2·(teacher − old) = 0.5 + 2·(−0.75) = −1.0
        let c = sample(SampleType::CombinedBoth, 1.0, &[-1.0, -1.0, -3.0], Some(&[-1.5, -2.0, 9.0]), &[1, 1, 0]);
        assert_eq!(sample_advantages(Method::Combined, &t, &[c]).unwrap(), vec![-1.0]);
        // OPD with the top-K loss only: no teacher term in the advantage
        let topk = TrainerConfig { opd_loss: crate::trainer::OpdLoss::Topk, ..Default::default() };
        assert_eq!(sample_advantages(Method::Opd, &topk, &[o]).unwrap(), vec![0.0]);
        // the random-sign control: the same magnitude, the sample's own sign
        let control = TrainerConfig { advantage_sign: crate::trainer::AdvantageSign::Random, ..t.clone() };
        let c = sample(SampleType::CombinedBoth, 1.0, &[-1.0, -1.0, -3.0], Some(&[-1.5, -2.0, 9.0]), &[1, 1, 0]);
        let sign = f64::from(control.advantage_sign_of(&c.sample_id));
        assert_eq!(sample_advantages(Method::Combined, &control, &[c]).unwrap(), vec![-sign]);
    }

    #[test]
    fn agreement_counts_by_hand() {
        let mut rows = vec![];
        for (sid, r) in [("a", 1.0), ("b", 0.0), ("c", 1.0), ("d", 0.0), ("e", 1.0)] {
            let mut i = interaction(sid, 0);
            i.outcome_reward = Some(r);
            rows.push(i);
        }
        let js = vec![
            judgment("p", "a", 1),
            judgment("p", "a", -1),
            judgment("p", "a", 1),  // a: mean 1/3 > 0, success → TP
            judgment("p", "b", 1),  // b: 1 > 0, failure → FP
            judgment("p", "c", 0),  // c: 0, success → FN
            judgment("p", "d", -1), // d: −1, failure → TN
            judgment("q", "e", 1),  // other pipeline: e is not judged
        ];
        let (row, sessions) = judge_agreement("p", "binary", &rows, &js, 0.5);
        assert_eq!((row.sessions, row.sessions_judged, row.agree), (5, 4, 2));
        assert_eq!((row.true_pos, row.false_pos, row.true_neg, row.false_neg), (1, 1, 1, 1));
        assert_eq!(row.accuracy, Some(0.5));
        assert_eq!((row.turns_judged, row.turns_pos, row.turns_zero, row.turns_neg), (6, 3, 1, 2));
        // successes a (1/3) and c (0) → 1/6; failures b (1) and d (−1) → 0
        assert!((row.mean_score_success.unwrap() - 1.0 / 6.0).abs() < 1e-12);
        assert_eq!(row.mean_score_failure, Some(0.0));
        assert_eq!(sessions.len(), 5);
        assert_eq!(sessions.iter().find(|s| s.session_id == "e").unwrap().mean_score, None);
    }

    #[test]
    fn masked_means() {
        assert_eq!(masked_mean([1.0, 2.0, 4.0].into_iter(), &[1, 0, 1]), Some(2.5));
        assert_eq!(masked_mean([1.0].into_iter(), &[0]), None);
    }

    #[test]
    fn the_absolute_gap_sees_an_overshoot_the_signed_gap_hides() {
        // student above the teacher on one token, below on another, equal on the third; a masked-out
        // fourth token does not count
        let (gap, abs) = token_gap(&[-1.0, -2.0, -3.0, -9.0], &[-2.0, -1.0, -3.0, 0.0], &[1, 1, 1, 0]).unwrap();
        assert_eq!(gap, 0.0);
        assert!((abs - 2.0 / 3.0).abs() < 1e-12, "{abs}");
        assert_eq!(token_gap(&[-1.0], &[-2.0], &[0]), None);
    }
}
