//! Sample assembly: what the trainer receives for a main turn, given its PRM judgment, its hint and
//! the teacher's log-probs (docs/method.md §5; the value checks of §4).
//!
//! | method | hint accepted | PRM score ±1 | outcome |
//! |---|---|---|---|
//! | binary | — | yes | [`SampleType::Binary`], r = score |
//! | binary | — | 0 / no judgment | no sample ([`NoSampleReason::ZeroScore`] / [`NoSampleReason::NoJudgment`]) |
//! | opd | yes | — | [`SampleType::Opd`], teacher log-probs, r = 0 |
//! | opd | no | — | no sample ([`NoSampleReason::NoHint`]) |
//! | combined | yes | yes | [`SampleType::CombinedBoth`], teacher log-probs, r = score |
//! | combined | yes | no | [`SampleType::CombinedHintOnly`], teacher log-probs, r = 0 |
//! | combined | no | yes | [`SampleType::CombinedScoreOnly`], r = score, teacher log-probs := rollout log-probs |
//! | combined | no | no | no sample ([`NoSampleReason::NoSignal`]) |
//!
//! The reference submits a binary score-0 turn with loss mask 0 (it fills a batch slot), except the
//! first such turn with a next state of a session that has no trained sample yet, which it trains
//! with mask 1 and reward 0 (zero advantage); we emit nothing (docs/method.md §5). The loss mask is all
//! ones over the response.

use serde::{Deserialize, Serialize};

use crate::schema::{content_hash, now_ms, HintRecord, Interaction, Judgment, Sample, SampleType, Table, TeacherCandidate, TeacherLogprobs, TurnType};
use crate::{input_err, Error, Result};

use crate::method::Method;

/// Sample-assembly options (a pipeline's `[samples]` table). Unknown fields are an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SampleConfig {
    /// Copy the teacher's top-K ids and log-probs ([T, K]) into the sample when the teacher row has
    /// them (default true; the top-K distillation loss needs them, docs/method.md §6).
    pub keep_topk: bool,
    /// Emit no sample for a response cut by the token limit (default false: trained like any other).
    pub skip_truncated: bool,
}

impl Default for SampleConfig {
    fn default() -> Self {
        SampleConfig { keep_topk: true, skip_truncated: false }
    }
}

/// Why a turn yields no sample (counted by the wiring under [`NoSampleReason::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoSampleReason {
    /// A side turn: recorded, never trained on (docs/method.md §1).
    SideTurn,
    /// The response has no tokens.
    EmptyResponse,
    /// The response was truncated and `skip_truncated` is on.
    Truncated,
    /// Binary: the turn has no judgment.
    NoJudgment,
    /// Binary: the PRM majority is 0 (neutral, tie or no valid votes).
    ZeroScore,
    /// OPD: no hint was accepted.
    NoHint,
    /// Combined: neither an accepted hint nor a PRM score of ±1.
    NoSignal,
}

impl NoSampleReason {
    /// Snake-case name, for counters and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            NoSampleReason::SideTurn => "side_turn",
            NoSampleReason::EmptyResponse => "empty_response",
            NoSampleReason::Truncated => "truncated",
            NoSampleReason::NoJudgment => "no_judgment",
            NoSampleReason::ZeroScore => "zero_score",
            NoSampleReason::NoHint => "no_hint",
            NoSampleReason::NoSignal => "no_signal",
        }
    }
}

impl std::fmt::Display for NoSampleReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a turn yields: one sample, or none with the reason.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum SampleOutcome {
    /// The sample.
    Sample(Sample),
    /// No sample, and why.
    NoSample {
        /// Why.
        reason: NoSampleReason,
    },
}

/// `sample_id`: hash of the interaction id, the pipeline name and the method configuration (method and
/// [`SampleConfig`]).
pub fn sample_id(interaction_id: &str, pipeline: &str, method: Method, cfg: &SampleConfig) -> String {
    let method_cfg = format!("method={};keep_topk={};skip_truncated={}", method.as_str(), cfg.keep_topk, cfg.skip_truncated);
    content_hash(&[interaction_id.as_bytes(), pipeline.as_bytes(), method_cfg.as_bytes()])
}

fn check_same_turn(what: &str, id: &str, interaction_id: &str) -> Result<()> {
    if id != interaction_id {
        return Err(input_err!("{what} is for interaction {id}, not {interaction_id}"));
    }
    Ok(())
}

fn check_same_tokens(what: &str, got: &[i32], want: &[i32]) -> Result<()> {
    if got.len() != want.len() {
        return Err(input_err!("{what}: {} tokens, the response has {}", got.len(), want.len()));
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(input_err!("{what}: token {i} is {}, the response's is {}", got[i], want[i]));
    }
    Ok(())
}

/// The first position `i` with `mask[i] != 0` and a non-finite `values[i]`.
fn check_finite(what: &'static str, values: &[f32], mask: &[i32]) -> Result<()> {
    match values.iter().zip(mask).position(|(v, m)| *m != 0 && !v.is_finite()) {
        Some(position) => Err(Error::NonFinite { what, position }),
        None => Ok(()),
    }
}

/// Top-K rows: T rows of K columns each, ids and log-probs the same shape, log-probs finite where
/// the mask is on.
fn check_topk(ids: &[Vec<i32>], lps: &[Vec<f32>], mask: &[i32]) -> Result<()> {
    let t = mask.len();
    for rows in [ids.len(), lps.len()] {
        if rows != t {
            return Err(Error::LogprobLenMismatch { expected: t, got: rows });
        }
    }
    let k = ids.first().map_or(0, Vec::len);
    for (i, (ri, rl)) in ids.iter().zip(lps).enumerate() {
        if ri.len() != k || rl.len() != k {
            return Err(input_err!("top-K row {i} has {} ids and {} log-probs, expected K = {k}", ri.len(), rl.len()));
        }
        if mask[i] != 0 && rl.iter().any(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "teacher top-K log-prob", position: i });
        }
    }
    Ok(())
}

/// What the docs/method.md §5 table says for a turn, before any tokens are looked at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// No sample, and why.
    NoSample(NoSampleReason),
    /// A sample of this type with this reward; `uses_teacher`: it needs the teacher row.
    Emit {
        /// The §5 case.
        sample_type: SampleType,
        /// r.
        reward: f32,
        /// Whether the teacher log-probs are part of the sample.
        uses_teacher: bool,
    },
}

/// The docs/method.md §5 decision for a turn (side turns, truncation policy, method × hint × score), so the
/// wiring can skip model work for turns that yield no sample. [`assemble`] applies the same decision.
pub fn decide(method: Method, cfg: &SampleConfig, interaction: &Interaction, judgment: Option<&Judgment>, hint: Option<&HintRecord>) -> Decision {
    use Decision::NoSample as No;
    if interaction.turn_type == TurnType::Side {
        return No(NoSampleReason::SideTurn);
    }
    if cfg.skip_truncated && interaction.truncated {
        return No(NoSampleReason::Truncated);
    }
    let score = judgment.map(|j| j.score);
    let scored = matches!(score, Some(1 | -1));
    let hint_accepted = hint.is_some_and(|h| h.chosen_hint.is_some());
    let r = score.unwrap_or(0) as f32;
    let emit = |sample_type, reward, uses_teacher| Decision::Emit { sample_type, reward, uses_teacher };
    match method {
        Method::Binary => match score {
            None => No(NoSampleReason::NoJudgment),
            Some(0) => No(NoSampleReason::ZeroScore),
            Some(_) => emit(SampleType::Binary, r, false),
        },
        Method::Opd if hint_accepted => emit(SampleType::Opd, 0.0, true),
        Method::Opd => No(NoSampleReason::NoHint),
        Method::Combined => match (hint_accepted, scored) {
            (true, true) => emit(SampleType::CombinedBoth, r, true),
            (true, false) => emit(SampleType::CombinedHintOnly, 0.0, true),
            (false, true) => emit(SampleType::CombinedScoreOnly, r, false),
            (false, false) => No(NoSampleReason::NoSignal),
        },
    }
}

/// Assembles the sample of one turn by the docs/method.md §5 table (see the module docs).
///
/// Inputs: the turn; its judgment, hint record and teacher row when the stages produced them;
/// `prompt_ids` (the policy's prompt, length P), `response_ids` (length T) and `rollout_logprobs`
/// (length T, nats) as the wiring resolved them (from the interaction, or tokenised/recomputed; when
/// the interaction has no rollout log-probs the sample is marked `rollout_logprobs_recomputed`).
/// Output tensors: tokens `prompt_ids ++ response_ids`, loss mask `[T]` of ones, rollout log-probs
/// `[T]`, teacher log-probs `[T]` (null for binary), top-K `[T, K]` when kept; `reward` r ∈ {−1, 0, 1}.
/// The judgment is recorded (`judgment_id`) when the method uses it, the hint record likewise, the
/// teacher row when its log-probs are used. Inputs are only validated when a sample is emitted.
///
/// # Errors
/// The record is to be dead-lettered (all [`crate::error::Domain::User`]):
/// - [`Error::LogprobLenMismatch`] when `rollout_logprobs`, the teacher's log-probs or its top-K rows
///   do not have one entry per response token;
/// - [`Error::NonFinite`] for a NaN/±inf rollout, teacher or top-K log-prob at an unmasked position
///   (never zeroed silently, docs/method.md §4);
/// - [`Error::InvalidInput`] when a judgment/hint/teacher row belongs to another interaction, a PRM
///   score is outside {−1, 0, 1}, the teacher's (or the interaction's) response tokens differ from
///   `response_ids`, top-K rows have unequal K, or a hint was accepted but no teacher row was given.
#[allow(clippy::too_many_arguments)]
pub fn assemble(
    method: Method,
    cfg: &SampleConfig,
    interaction: &Interaction,
    judgment: Option<&Judgment>,
    hint: Option<&HintRecord>,
    teacher: Option<&TeacherLogprobs>,
    prompt_ids: &[i32],
    response_ids: &[i32],
    rollout_logprobs: &[f32],
    pipeline: &str,
) -> Result<SampleOutcome> {
    let iid = &interaction.interaction_id;
    if let Some(j) = judgment {
        check_same_turn("judgment", &j.interaction_id, iid)?;
        if !(-1..=1).contains(&j.score) {
            return Err(input_err!("judgment {} has score {}, not one of -1, 0, 1", j.judgment_id, j.score));
        }
    }
    if let Some(h) = hint {
        check_same_turn("hint record", &h.interaction_id, iid)?;
    }
    if let Some(t) = teacher {
        check_same_turn("teacher row", &t.interaction_id, iid)?;
    }
    if response_ids.is_empty() && interaction.turn_type != TurnType::Side && !(cfg.skip_truncated && interaction.truncated) {
        return Ok(SampleOutcome::NoSample { reason: NoSampleReason::EmptyResponse });
    }
    let (sample_type, reward, uses_teacher) = match decide(method, cfg, interaction, judgment, hint) {
        Decision::NoSample(reason) => return Ok(SampleOutcome::NoSample { reason }),
        Decision::Emit { sample_type, reward, uses_teacher } => (sample_type, reward, uses_teacher),
    };

    let t = response_ids.len();
    let loss_mask = vec![1i32; t];
    if rollout_logprobs.len() != t {
        return Err(Error::LogprobLenMismatch { expected: t, got: rollout_logprobs.len() });
    }
    if let Some(ids) = &interaction.response_token_ids {
        check_same_tokens(&format!("interaction {iid} response_token_ids"), ids, response_ids)?;
    }
    check_finite("rollout log-prob", rollout_logprobs, &loss_mask)?;

    let mut teacher_logprobs = None;
    let mut topk_ids = None;
    let mut topk_logprobs = None;
    let mut teacher_id = None;
    let mut teacher_prompt_token_ids = None;
    if uses_teacher {
        let hint_id = hint.map(|h| h.hint_id.as_str()).unwrap_or("");
        let tr = teacher.ok_or_else(|| input_err!("hint {hint_id} was accepted for interaction {iid} but no teacher log-probs were given"))?;
        if tr.teacher_logprobs.len() != t {
            return Err(Error::LogprobLenMismatch { expected: t, got: tr.teacher_logprobs.len() });
        }
        check_same_tokens(&format!("teacher row {} response_token_ids", tr.teacher_id), &tr.response_token_ids, response_ids)?;
        check_finite("teacher log-prob", &tr.teacher_logprobs, &loss_mask)?;
        if cfg.keep_topk {
            match (&tr.topk_ids, &tr.topk_logprobs) {
                (Some(ids), Some(lps)) => {
                    check_topk(ids, lps, &loss_mask)?;
                    topk_ids = Some(ids.clone());
                    topk_logprobs = Some(lps.clone());
                }
                (None, None) => {}
                _ => return Err(input_err!("teacher row {} has only one of topk_ids and topk_logprobs", tr.teacher_id)),
            }
        }
        teacher_logprobs = Some(tr.teacher_logprobs.clone());
        teacher_id = Some(tr.teacher_id.clone());
        teacher_prompt_token_ids = Some(tr.teacher_prompt_token_ids.clone());
    } else if sample_type == SampleType::CombinedScoreOnly {
        // No hint: teacher := rollout (docs/method.md §5); the trainer sets this type's teacher term to exactly 0.
        teacher_logprobs = Some(rollout_logprobs.to_vec());
    }

    let uses_judgment = matches!(method, Method::Binary | Method::Combined);
    let uses_hint = matches!(method, Method::Opd | Method::Combined);
    Ok(SampleOutcome::Sample(Sample {
        schema_version: Sample::SCHEMA_VERSION,
        sample_id: sample_id(iid, pipeline, method, cfg),
        pipeline: pipeline.to_string(),
        method: method.as_str().to_string(),
        sample_type,
        interaction_id: iid.clone(),
        session_id: interaction.session_id.clone(),
        tenant: interaction.tenant.clone(),
        turn_index: interaction.turn_index,
        prompt_token_ids: prompt_ids.to_vec(),
        response_token_ids: response_ids.to_vec(),
        loss_mask,
        rollout_logprobs: rollout_logprobs.to_vec(),
        rollout_logprobs_recomputed: interaction.rollout_logprobs.is_none(),
        reward,
        teacher_logprobs,
        topk_ids,
        topk_logprobs,
        teacher_prompt_token_ids,
        student_topk_ids: None,
        candidates: None,
        truncated: Some(interaction.truncated),
        policy_version: interaction.policy_version,
        judgment_id: judgment.filter(|_| uses_judgment).map(|j| j.judgment_id.clone()),
        hint_id: hint.filter(|_| uses_hint).map(|h| h.hint_id.clone()),
        teacher_id,
        source_topic: interaction.source_topic.clone(),
        source_partition: interaction.source_partition,
        source_offset: interaction.source_offset,
        event_time: interaction.event_time,
        processed_time: now_ms(),
    }))
}

/// Multi-candidate hints (docs/method.md §3b): sets `sample.student_topk_ids` and `sample.candidates` from
/// the teacher rows of a turn's hint candidates, `rows[c]` scored under candidate c's teacher context
/// (shortest hint first; `hint_indices[c]` is the vote it came from). `rows[0]` must be the row the
/// sample was assembled with ([`assemble`]). Every row must carry `student_topk_ids` and
/// `logprobs_at_student_topk` ([T, K]) and top-K lists of the same width K, all for the sample's
/// response tokens, with finite values at trained positions; the rows must agree on the student's ids.
///
/// # Errors
/// [`Error::InvalidInput`] (and [`Error::LogprobLenMismatch`] / [`Error::NonFinite`] from the checks)
/// naming the row and what is wrong; the sample is left unchanged then.
pub fn attach_candidates(sample: &mut Sample, rows: &[TeacherLogprobs], hint_indices: &[i32]) -> Result<()> {
    if rows.is_empty() || rows.len() != hint_indices.len() {
        return Err(input_err!("{} teacher rows for {} hint candidates", rows.len(), hint_indices.len()));
    }
    if sample.teacher_id.as_deref() != Some(rows[0].teacher_id.as_str()) {
        return Err(input_err!("candidate 0 is teacher row {}, the sample was assembled with {:?}", rows[0].teacher_id, sample.teacher_id));
    }
    let mask = &sample.loss_mask;
    let mut student: Option<&Vec<Vec<i32>>> = None;
    let mut out = Vec::with_capacity(rows.len());
    for (r, &hint_index) in rows.iter().zip(hint_indices) {
        check_same_turn("teacher row", &r.interaction_id, &sample.interaction_id)?;
        check_same_tokens(&format!("teacher row {} response_token_ids", r.teacher_id), &r.response_token_ids, &sample.response_token_ids)?;
        let (Some(ids), Some(lps), Some(s_ids), Some(at_s)) = (&r.topk_ids, &r.topk_logprobs, &r.student_topk_ids, &r.logprobs_at_student_topk) else {
            return Err(input_err!("teacher row {} lacks top-K lists or log-probs at the student's top-K ids", r.teacher_id));
        };
        check_topk(ids, lps, mask)?;
        check_topk(s_ids, at_s, mask)?;
        let k = |v: &[Vec<i32>]| v.first().map_or(0, Vec::len);
        if k(ids) != k(s_ids) {
            return Err(input_err!("teacher row {}: top-K width {} but {} student ids per position", r.teacher_id, k(ids), k(s_ids)));
        }
        match student {
            Some(s) if s != s_ids => return Err(input_err!("teacher row {} has other student top-K ids than candidate 0", r.teacher_id)),
            _ => student = Some(s_ids),
        }
        out.push(TeacherCandidate {
            teacher_id: r.teacher_id.clone(),
            hint_index,
            topk_ids: ids.clone(),
            topk_logprobs: lps.clone(),
            logprobs_at_student_topk: at_s.clone(),
        });
    }
    sample.student_topk_ids = student.cloned();
    sample.candidates = Some(out);
    Ok(())
}

#[cfg(test)]
mod tests;
