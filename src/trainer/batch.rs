//! Batch assembly: [`Sample`] rows → padded tensors for one optimizer step (docs/method.md §5–§6).
//!
//! **Alignment** (the model runtime's scoring convention, docs/method.md §4): a row is read as
//! `x = prompt ++ response`; response token `t` is predicted by the hidden state at input position
//! `P − 1 + t` ([`PackedBatch::predict_positions`]), so `logprobs[t]` scores `response[t]` and lines up
//! with `rollout_logprobs[t]`, `teacher_logprobs[t]`, `loss_mask[t]` and `topk_*[t]`.
//!
//! **Validation**: a row that cannot be trained is dropped with a [`DropReason`] (never silently):
//! empty prompt or response, a per-token series of the wrong length, a non-finite value at a trained
//! position (docs/method.md §4), a token id outside the vocabulary, a sample type that does not belong to the
//! method, missing teacher log-probs, inconsistent or (when required) missing top-K lists, or a policy
//! version too old ([`TrainerConfig::staleness_weight`]), and the quarantine rules of
//! [`TrainerConfig::quarantine`](super::config::QuarantineSettings) that the packer can apply (a
//! truncated or near-empty response; the log-prob gap rule needs the forward pass and lives in the
//! step). Non-finite values at positions with loss mask 0
//! are replaced by 0 (they are never trained).

use tch::{Device, Tensor};

use super::config::{CandidateSelection, OverlapSubset, TeacherSource, TrainerConfig};
use super::loss::OpdLoss;
use crate::method::Method;
use crate::model;
use crate::schema::{Sample, SampleType};
use crate::Result;

/// Why a sample was left out of a batch (counted by the wiring under [`DropReason::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// The prompt has no token (the first response token needs a context).
    EmptyPrompt,
    /// The response has no token.
    EmptyResponse,
    /// `loss_mask`, `rollout_logprobs`, `teacher_logprobs` or a top-K list is not one per response token.
    LengthMismatch,
    /// A non-finite log-prob at a trained position.
    NonFinite,
    /// A token id (prompt, response or top-K) outside `0..vocab_size`.
    TokenOutOfVocab,
    /// The sample type does not belong to the trainer's method (e.g. a binary sample for `combined`).
    WrongMethod,
    /// OPD/combined sample without teacher log-probs.
    MissingTeacher,
    /// The top-K loss is the only teacher loss (`opd_loss = topk`) and a sample with a hint has no top-K lists.
    MissingTopk,
    /// Top-K rows of different widths, or narrower than `topk_k`.
    TopkWidth,
    /// Produced by a policy version more than `max_staleness` versions behind (drop mode).
    Stale,
    /// Prompt + response longer than `max_sequence_tokens`.
    TooLong,
    /// Fewer trained response tokens than `quarantine.min_response_tokens` (a one-token reply).
    NearEmptyResponse,
    /// The response was cut at the token cap ([`Sample::truncated`]; `quarantine.truncated`).
    Truncated,
    /// Mean |rollout − current| log-prob over the trained tokens above `quarantine.max_logprob_gap`
    /// (found in the step's forward pass; the step is retried without the sample).
    LogprobGap,
}

impl DropReason {
    /// Snake-case name for counters and dead letters.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::EmptyPrompt => "empty_prompt",
            DropReason::EmptyResponse => "empty_response",
            DropReason::LengthMismatch => "length_mismatch",
            DropReason::NonFinite => "non_finite",
            DropReason::TokenOutOfVocab => "token_out_of_vocab",
            DropReason::WrongMethod => "wrong_method",
            DropReason::MissingTeacher => "missing_teacher",
            DropReason::MissingTopk => "missing_topk",
            DropReason::TopkWidth => "topk_width",
            DropReason::Stale => "stale",
            DropReason::TooLong => "too_long",
            DropReason::NearEmptyResponse => "near_empty_response",
            DropReason::Truncated => "truncated",
            DropReason::LogprobGap => "logprob_gap",
        }
    }
}

impl std::fmt::Display for DropReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One sample left out, with the numbers behind the reason.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Dropped {
    /// Index in the input slice.
    pub index: usize,
    /// The sample's id.
    pub sample_id: String,
    /// Why.
    #[serde(serialize_with = "ser_reason")]
    pub reason: DropReason,
    /// Details with numbers (lengths, position, id, versions).
    pub detail: String,
}

fn ser_reason<S: serde::Serializer>(r: &DropReason, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

/// How to pack: the method, the tokenizer's facts and the staleness rule.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Training method: decides which sample types are accepted and whether teacher log-probs are required.
    pub method: Method,
    /// Vocabulary size V: every token id must be in `0..V`.
    pub vocab_size: usize,
    /// Id used to right-pad `input_ids` (never attended to under a causal mask).
    pub pad_id: i64,
    /// The trainer's current policy version (for staleness).
    pub current_version: i64,
    /// Device of the tensors.
    pub device: Device,
    /// Trainer settings used here: `topk_k`, `opd_loss`, `max_staleness`, `staleness`, `staleness_decay`,
    /// `advantage_sign` and `seed`.
    pub config: TrainerConfig,
}

/// Padded tensors of one batch. B = rows kept, L = longest prompt + response, T = longest response
/// (Tmax), K = top-K width. The first six fields are the model runtime's [`model::PackedBatch`], built by it.
#[derive(Debug)]
pub struct PackedBatch {
    /// `[B, L]` int64: prompt ++ response, right-padded with `pad_id`.
    pub input_ids: Tensor,
    /// `[B, T]` int64: response ids, right-padded with 0.
    pub response_ids: Tensor,
    /// `[B, T]` f32: 1 on real response tokens, 0 on padding.
    pub response_mask: Tensor,
    /// `[B, T]` int64: input position whose hidden state predicts response token t (`P_b − 1 + t`; 0 on padding).
    pub predict_positions: Tensor,
    /// Prompt length P_b of each row.
    pub prompt_lens: Vec<usize>,
    /// Response length T_b of each row.
    pub response_lens: Vec<usize>,
    /// `[B, T]` f32: trained tokens = `response_mask` × the sample's loss mask.
    pub loss_mask: Tensor,
    /// `[B, T]` f32: rollout log-probs (nats), 0 on padding.
    pub old_logprobs: Tensor,
    /// `[B, T]` f32: teacher log-probs (nats), 0 on padding; `Some` for OPD and combined.
    pub teacher_logprobs: Option<Tensor>,
    /// `[B]` f32: reward r.
    pub reward: Tensor,
    /// `[B]` f32: aggregation weight (1, or the staleness weight).
    pub sample_weight: Tensor,
    /// `[B]` f32: factor on each row's advantage, ±1 ([`TrainerConfig::advantage_sign_of`]; all 1
    /// unless `advantage_sign = random`).
    pub advantage_sign: Tensor,
    /// `[B, T, K]` int64: teacher top-K ids (0 where absent); `Some` when any row has top-K lists.
    pub topk_ids: Option<Tensor>,
    /// `[B, T, K]` f32: teacher top-K log-probs (0 where absent).
    pub topk_logprobs: Option<Tensor>,
    /// `[B, T]` f32: `loss_mask` of the rows that carry top-K lists (0 elsewhere).
    pub topk_mask: Option<Tensor>,
    /// `[B, T, K]` f32, 0/1, `opd_loss = overlap` only: which of `topk_ids` form each position's subset
    /// ([`OverlapSubset`]). With `overlap`, `topk_ids` / `topk_logprobs` hold each position's subset
    /// candidates (the student's or the chosen teacher's top-K ids) and the chosen candidate teacher's
    /// log-probs at them ([`overlap_rows`]).
    pub topk_subset: Option<Tensor>,
    /// `trainer.teacher = current`: the same rows and responses with each hinted row's teacher prompt
    /// (`samples.teacher_prompt_token_ids`) in place of its prompt, for scoring the teacher with the
    /// current weights; `None` otherwise.
    pub teacher_pass: Option<Box<PackedBatch>>,
    /// `opd_loss = overlap`: for each row, the chosen candidate per response position (empty for rows
    /// without candidates).
    pub chosen_candidates: Vec<Vec<usize>>,
    /// `opd_loss = overlap`: for each row, the mean over its trained positions of
    /// `O[k*,t] / K`, the share of the student's top-K the chosen teacher also ranks top-K (`None` for
    /// rows without candidates).
    pub overlap_fraction: Vec<Option<f64>>,
    /// Sample type of each row.
    pub sample_types: Vec<SampleType>,
    /// Sample id of each row.
    pub sample_ids: Vec<String>,
    /// Reward of each row.
    pub rewards: Vec<f32>,
    /// Weight of each row.
    pub weights: Vec<f64>,
    /// Index of each row in the input slice.
    pub source_index: Vec<usize>,
}

impl PackedBatch {
    /// Number of rows B.
    pub fn batch_size(&self) -> usize {
        self.prompt_lens.len()
    }
    /// Longest response Tmax.
    pub fn max_response_len(&self) -> usize {
        self.response_lens.iter().copied().max().unwrap_or(0)
    }
}

/// The result of [`pack_samples`]: the batch of kept rows (none when every sample was dropped) and the
/// dropped ones.
#[derive(Debug)]
pub struct Packed {
    /// The batch, `None` when nothing was kept.
    pub batch: Option<PackedBatch>,
    /// Samples left out, with reasons, in input order.
    pub dropped: Vec<Dropped>,
}

fn allowed(method: Method, t: SampleType) -> bool {
    t.method() == method.as_str()
}

fn has_hint(t: SampleType) -> bool {
    t.has_hint()
}

/// A row that passed validation, with its top-K width (0 = none) and weight.
struct Checked<'a> {
    index: usize,
    sample: &'a Sample,
    weight: f64,
    topk: usize,
}

type Check = std::result::Result<(), (DropReason, String)>;

fn check_series(what: &str, got: usize, want: usize) -> Check {
    if got != want {
        return Err((DropReason::LengthMismatch, format!("{what}: {got} values for {want} response tokens")));
    }
    Ok(())
}

fn check_finite(what: &str, values: &[f32], mask: &[i32]) -> Check {
    match values.iter().zip(mask).position(|(v, m)| *m != 0 && !v.is_finite()) {
        Some(p) => Err((DropReason::NonFinite, format!("{what} {} at trained position {p}", values[p]))),
        None => Ok(()),
    }
}

fn check_ids(what: &str, ids: &[i32], vocab: usize) -> Check {
    match ids.iter().position(|&t| t < 0 || t as usize >= vocab) {
        Some(p) => Err((DropReason::TokenOutOfVocab, format!("{what} id {} at position {p} outside 0..{vocab}", ids[p]))),
        None => Ok(()),
    }
}

/// Validates one sample; `Ok(top-K width)` (0 when the row has no top-K lists).
fn check_sample(s: &Sample, opts: &PackOptions) -> std::result::Result<usize, (DropReason, String)> {
    let t = s.response_token_ids.len();
    if !allowed(opts.method, s.sample_type) {
        return Err((DropReason::WrongMethod, format!("sample type {} under method {}", s.sample_type.as_str(), opts.method.as_str())));
    }
    if s.prompt_token_ids.is_empty() {
        return Err((DropReason::EmptyPrompt, "0 prompt tokens".into()));
    }
    if t == 0 {
        return Err((DropReason::EmptyResponse, "0 response tokens".into()));
    }
    let q = &opts.config.quarantine;
    if q.truncated && s.truncated == Some(true) {
        return Err((DropReason::Truncated, format!("response of {t} tokens cut at the token cap (trainer.quarantine.truncated)")));
    }
    let trained = s.loss_mask.iter().filter(|&&m| m != 0).count();
    if s.loss_mask.len() == t && trained < q.min_response_tokens {
        return Err((DropReason::NearEmptyResponse, format!("{trained} trained response tokens, fewer than trainer.quarantine.min_response_tokens = {}", q.min_response_tokens)));
    }
    let total = s.prompt_token_ids.len() + t;
    if total > opts.config.max_sequence_tokens {
        return Err((DropReason::TooLong, format!("{total} tokens exceed trainer.max_sequence_tokens = {}", opts.config.max_sequence_tokens)));
    }
    check_series("loss_mask", s.loss_mask.len(), t)?;
    check_series("rollout_logprobs", s.rollout_logprobs.len(), t)?;
    check_ids("prompt token", &s.prompt_token_ids, opts.vocab_size)?;
    check_ids("response token", &s.response_token_ids, opts.vocab_size)?;
    check_finite("rollout log-prob", &s.rollout_logprobs, &s.loss_mask)?;
    if !s.reward.is_finite() {
        return Err((DropReason::NonFinite, format!("reward {}", s.reward)));
    }
    if opts.method.uses_hints() {
        let teacher = s.teacher_logprobs.as_ref().ok_or((DropReason::MissingTeacher, format!("{} sample without teacher log-probs", s.sample_type.as_str())))?;
        check_series("teacher_logprobs", teacher.len(), t)?;
        check_finite("teacher log-prob", teacher, &s.loss_mask)?;
    }
    let k = match (&s.topk_ids, &s.topk_logprobs) {
        (Some(ids), Some(lps)) => {
            check_series("topk_ids", ids.len(), t)?;
            check_series("topk_logprobs", lps.len(), t)?;
            let k = ids.first().map_or(0, Vec::len);
            if k == 0 {
                return Err((DropReason::TopkWidth, "top-K lists of width 0".into()));
            }
            for (p, (row_ids, row_lps)) in ids.iter().zip(lps).enumerate() {
                if row_ids.len() != k || row_lps.len() != k {
                    return Err((DropReason::TopkWidth, format!("top-K width {} / {} at position {p}, {k} at position 0", row_ids.len(), row_lps.len())));
                }
                check_ids("top-K", row_ids, opts.vocab_size).map_err(|(r, d)| (r, format!("{d} (response position {p})")))?;
                if s.loss_mask[p] != 0 {
                    if let Some(j) = row_lps.iter().position(|v| !v.is_finite()) {
                        return Err((DropReason::NonFinite, format!("top-K log-prob {} at trained position {p}, column {j}", row_lps[j])));
                    }
                }
            }
            let want = opts.config.topk_k;
            if want > 0 && k < want {
                return Err((DropReason::TopkWidth, format!("top-K width {k} below topk_k = {want}")));
            }
            if want > 0 { want } else { k }
        }
        (None, None) => 0,
        _ => return Err((DropReason::LengthMismatch, "top-K ids and log-probs: one present, the other absent".into())),
    };
    if k == 0 && opts.method.uses_hints() && matches!(opts.config.opd_loss, OpdLoss::Topk | OpdLoss::Both) && has_hint(s.sample_type) {
        return Err((DropReason::MissingTopk, format!("{} sample without top-K lists and opd_loss = {}", s.sample_type.as_str(), opts.config.opd_loss.as_str())));
    }
    if opts.method.uses_hints() && opts.config.teacher == TeacherSource::Current && has_hint(s.sample_type) {
        let tp = s.teacher_prompt_token_ids.as_deref().filter(|p| !p.is_empty()).ok_or_else(|| {
            (DropReason::MissingTeacher, format!("{} sample without teacher prompt ids and trainer.teacher = current (samples made before the column existed?)", s.sample_type.as_str()))
        })?;
        check_ids("teacher prompt token", tp, opts.vocab_size)?;
        let total = tp.len() + t;
        if total > opts.config.max_sequence_tokens {
            return Err((DropReason::TooLong, format!("teacher prompt + response: {total} tokens exceed trainer.max_sequence_tokens = {}", opts.config.max_sequence_tokens)));
        }
    }
    if opts.method.uses_hints() && opts.config.opd_loss == OpdLoss::Overlap {
        return if has_hint(s.sample_type) { check_candidates(s, opts) } else { Ok(0) };
    }
    Ok(k)
}

/// Validates a sample's hint candidates for `opd_loss = overlap`; `Ok(K)`, the student's top-K width.
fn check_candidates(s: &Sample, opts: &PackOptions) -> std::result::Result<usize, (DropReason, String)> {
    let t = s.response_token_ids.len();
    let (Some(student), Some(cands)) = (&s.student_topk_ids, &s.candidates) else {
        return Err((DropReason::MissingTopk, format!("{} sample without hint candidates and opd_loss = overlap (set teacher.candidates > 1)", s.sample_type.as_str())));
    };
    if cands.is_empty() {
        return Err((DropReason::MissingTopk, "0 hint candidates and opd_loss = overlap".into()));
    }
    let k = student.first().map_or(0, Vec::len);
    if k == 0 {
        return Err((DropReason::TopkWidth, "student top-K lists of width 0".into()));
    }
    check_series("student_topk_ids", student.len(), t)?;
    let width = |what: &str, rows: usize, widths: &mut dyn Iterator<Item = usize>| -> Check {
        check_series(what, rows, t)?;
        match widths.enumerate().find(|(_, w)| *w != k) {
            Some((p, w)) => Err((DropReason::TopkWidth, format!("{what}: width {w} at position {p}, the student's is {k}"))),
            None => Ok(()),
        }
    };
    width("student_topk_ids", student.len(), &mut student.iter().map(Vec::len))?;
    for row in student {
        check_ids("student top-K", row, opts.vocab_size)?;
    }
    for (c, cand) in cands.iter().enumerate() {
        width(&format!("candidate {c} topk_ids"), cand.topk_ids.len(), &mut cand.topk_ids.iter().map(Vec::len))?;
        width(&format!("candidate {c} topk_logprobs"), cand.topk_logprobs.len(), &mut cand.topk_logprobs.iter().map(Vec::len))?;
        width(&format!("candidate {c} logprobs_at_student_topk"), cand.logprobs_at_student_topk.len(), &mut cand.logprobs_at_student_topk.iter().map(Vec::len))?;
        for row in &cand.topk_ids {
            check_ids(&format!("candidate {c} top-K"), row, opts.vocab_size)?;
        }
        for (p, (a, b)) in cand.topk_logprobs.iter().zip(&cand.logprobs_at_student_topk).enumerate() {
            if s.loss_mask[p] != 0 && a.iter().chain(b).any(|v| !v.is_finite()) {
                return Err((DropReason::NonFinite, format!("candidate {c}: a non-finite teacher log-prob at trained position {p}")));
            }
        }
    }
    Ok(k)
}

/// `O[t] = |S_t ∩ P_t|` for each position: how many of the student's top-K ids `student[t]` the
/// candidate teacher's top-K `candidate[t]` also holds (docs/method.md §3b).
pub fn overlap_counts(student: &[Vec<i32>], candidate: &[Vec<i32>]) -> Vec<usize> {
    student.iter().zip(candidate).map(|(s, p)| s.iter().filter(|id| p.contains(id)).count()).collect()
}

/// The chosen candidate k*(t) per position (docs/method.md §3b) from `overlaps[k][t]` = O[k,t]
/// ([`overlap_counts`]), given the loss mask (only trained positions count in the sequence sum). Ties go
/// to the lower k, i.e. the shorter hint.
pub fn select_candidates(selection: CandidateSelection, overlaps: &[Vec<usize>], mask: &[i32]) -> Vec<usize> {
    let t = mask.len();
    let argmax = |score: &dyn Fn(usize) -> usize| (0..overlaps.len()).fold(0, |best, k| if score(k) > score(best) { k } else { best });
    match selection {
        CandidateSelection::Shortest => vec![0; t],
        CandidateSelection::TokenOptimal => (0..t).map(|p| argmax(&|k| overlaps[k][p])).collect(),
        CandidateSelection::SequenceOptimal => {
            let k = argmax(&|k| overlaps[k].iter().zip(mask).filter(|(_, m)| **m != 0).map(|(o, _)| *o).sum());
            vec![k; t]
        }
    }
}

/// One sample's overlap-term inputs ([`overlap_rows`]), per response position.
#[derive(Debug, Clone, PartialEq)]
pub struct OverlapRows {
    /// `[T][K]`: the ids of the term (the student's top-K, or the chosen teacher's for `teacher`).
    pub ids: Vec<Vec<i32>>,
    /// `[T][K]`: the chosen candidate teacher's log-probs at `ids`.
    pub teacher: Vec<Vec<f32>>,
    /// `[T][K]`: which ids are in the subset.
    pub subset: Vec<Vec<bool>>,
    /// `[T]`: the chosen candidate k*(t).
    pub chosen: Vec<usize>,
    /// Mean over trained positions of `O[k*,t] / K` (0 with no trained position).
    pub overlap_fraction: f64,
}

/// Selects a candidate per position and lays out the overlap term's ids, teacher log-probs and subset
/// (docs/method.md §3b) for a validated sample (`student_topk_ids` and `candidates` present, widths K).
pub fn overlap_rows(s: &Sample, selection: CandidateSelection, subset: OverlapSubset) -> OverlapRows {
    let student = s.student_topk_ids.as_deref().unwrap_or_default();
    let cands = s.candidates.as_deref().unwrap_or_default();
    let overlaps: Vec<Vec<usize>> = cands.iter().map(|c| overlap_counts(student, &c.topk_ids)).collect();
    let chosen = select_candidates(selection, &overlaps, &s.loss_mask);
    let k = student.first().map_or(1, Vec::len).max(1);
    let (mut ids, mut teacher, mut keep) = (vec![], vec![], vec![]);
    let (mut sum, mut n) = (0.0, 0usize);
    for (t, &c) in chosen.iter().enumerate() {
        let cand = &cands[c];
        let (row_ids, row_lps, row_keep) = match subset {
            OverlapSubset::Student => (student[t].clone(), cand.logprobs_at_student_topk[t].clone(), vec![true; k]),
            OverlapSubset::Teacher => (cand.topk_ids[t].clone(), cand.topk_logprobs[t].clone(), vec![true; k]),
            OverlapSubset::Overlap => {
                let keep = student[t].iter().map(|id| cand.topk_ids[t].contains(id)).collect();
                (student[t].clone(), cand.logprobs_at_student_topk[t].clone(), keep)
            }
        };
        ids.push(row_ids);
        teacher.push(row_lps);
        keep.push(row_keep);
        if s.loss_mask[t] != 0 {
            sum += overlaps[c][t] as f64 / k as f64;
            n += 1;
        }
    }
    OverlapRows { ids, teacher, subset: keep, chosen, overlap_fraction: if n > 0 { sum / n as f64 } else { 0.0 } }
}

/// Packs `samples` into one right-padded batch on `opts.device`, dropping (with reasons) the rows that
/// cannot be trained. All rows with top-K lists must share one width K (after `topk_k`); the first
/// kept row with top-K lists sets it and later rows of another width are dropped with
/// [`DropReason::TopkWidth`].
///
/// # Errors
/// [`crate::Error::Torch`] when a tensor cannot be built or moved to the device. Bad samples are not
/// errors: they are in [`Packed::dropped`].
pub fn pack_samples(samples: &[Sample], opts: &PackOptions) -> Result<Packed> {
    let mut dropped = Vec::new();
    let mut kept: Vec<Checked<'_>> = Vec::new();
    let mut batch_k = 0usize;
    for (index, s) in samples.iter().enumerate() {
        let mut reject = |reason: DropReason, detail: String| dropped.push(Dropped { index, sample_id: s.sample_id.clone(), reason, detail });
        let weight = match opts.config.staleness_weight(opts.current_version, s.policy_version) {
            Some(w) => w,
            None => {
                let age = opts.current_version - s.policy_version.unwrap_or(opts.current_version);
                reject(DropReason::Stale, format!("policy version {:?} is {age} versions behind {} (max_staleness {:?})", s.policy_version, opts.current_version, opts.config.max_staleness));
                continue;
            }
        };
        match check_sample(s, opts) {
            Ok(k) => {
                if k > 0 && batch_k > 0 && k != batch_k {
                    reject(DropReason::TopkWidth, format!("top-K width {k}, the batch's is {batch_k}"));
                    continue;
                }
                if k > 0 {
                    batch_k = k;
                }
                kept.push(Checked { index, sample: s, weight, topk: k });
            }
            Err((reason, detail)) => reject(reason, detail),
        }
    }
    if kept.is_empty() {
        return Ok(Packed { batch: None, dropped });
    }
    let mut batch = build(&kept, batch_k, opts)?;
    if opts.method.uses_hints() && opts.config.teacher == TeacherSource::Current {
        // The same rows with the teacher prompt in place of the prompt (validated above).
        let swapped: Vec<Sample> = kept
            .iter()
            .map(|r| match (&r.sample.teacher_prompt_token_ids, has_hint(r.sample.sample_type)) {
                (Some(tp), true) => Sample { prompt_token_ids: tp.clone(), ..r.sample.clone() },
                _ => r.sample.clone(),
            })
            .collect();
        let rows: Vec<Checked<'_>> = kept.iter().zip(&swapped).map(|(r, s)| Checked { index: r.index, sample: s, weight: r.weight, topk: 0 }).collect();
        let plain = PackOptions { config: TrainerConfig { teacher: TeacherSource::Samples, opd_loss: OpdLoss::Ppo, ..opts.config.clone() }, ..opts.clone() };
        batch.teacher_pass = Some(Box::new(build(&rows, 0, &plain)?));
    }
    Ok(Packed { batch: Some(batch), dropped })
}

/// Packs validated rows: the token tensors (`input_ids` .. `response_lens`) by the model runtime's
/// [`crate::model::PackedBatch::new`] (one alignment convention for trainer and scoring), the loss,
/// teacher and top-K tensors here.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `opts.pad_id` is not a token id (negative or above `u32`);
/// [`crate::Error::Torch`] on a tensor failure.
fn build(rows: &[Checked<'_>], k: usize, opts: &PackOptions) -> Result<PackedBatch> {
    // Ids are validated non-negative and below the vocabulary size (`check_ids`).
    let ids = |v: &[i32]| -> Vec<u32> { v.iter().map(|&t| t as u32).collect() };
    let owned: Vec<(Vec<u32>, Vec<u32>)> = rows.iter().map(|r| (ids(&r.sample.prompt_token_ids), ids(&r.sample.response_token_ids))).collect();
    let items: Vec<(&[u32], &[u32])> = owned.iter().map(|(p, r)| (p.as_slice(), r.as_slice())).collect();
    let pad_id = u32::try_from(opts.pad_id).map_err(|_| crate::input_err!("pad id {} is not a token id", opts.pad_id))?;
    let model::PackedBatch { input_ids, response_ids, response_mask, predict_positions, prompt_lens, response_lens } =
        model::PackedBatch::new(&items, pad_id, opts.vocab_size, opts.device)?;
    let b = rows.len();
    let t = rows.iter().map(|r| r.sample.response_token_ids.len()).max().unwrap_or(0);
    let mut lmask = vec![0f32; b * t];
    let mut old = vec![0f32; b * t];
    let with_teacher = opts.method.uses_hints();
    let mut teacher = if with_teacher { vec![0f32; b * t] } else { Vec::new() };
    let with_topk = k > 0;
    let mut tk_ids = if with_topk { vec![0i64; b * t * k] } else { Vec::new() };
    let mut tk_lps = if with_topk { vec![0f32; b * t * k] } else { Vec::new() };
    let mut tk_mask = if with_topk { vec![0f32; b * t] } else { Vec::new() };
    // opd_loss = overlap: each row with candidates gets its selected ids, teacher log-probs and subset.
    let overlap_mode = opts.method.uses_hints() && opts.config.opd_loss == OpdLoss::Overlap;
    let overlap: Vec<Option<OverlapRows>> = rows
        .iter()
        .map(|r| (overlap_mode && r.topk > 0).then(|| overlap_rows(r.sample, opts.config.overlap.selection, opts.config.overlap.subset)))
        .collect();
    let mut tk_subset = if overlap_mode && with_topk { vec![0f32; b * t * k] } else { Vec::new() };
    // Only values at trained positions are used; anything else (possibly non-finite) becomes 0.
    let clean = |v: f32, trained: bool| if trained && v.is_finite() { v } else { 0.0 };
    for (i, row) in rows.iter().enumerate() {
        let s = row.sample;
        for j in 0..s.response_token_ids.len() {
            let at = i * t + j;
            let trained = s.loss_mask[j] != 0;
            lmask[at] = if trained { 1.0 } else { 0.0 };
            old[at] = clean(s.rollout_logprobs[j], trained);
            if let (true, Some(tl)) = (with_teacher, &s.teacher_logprobs) {
                teacher[at] = clean(tl[j], trained);
            }
            if let Some(o) = &overlap[i] {
                for c in 0..k {
                    tk_ids[at * k + c] = i64::from(o.ids[j][c]);
                    tk_lps[at * k + c] = clean(o.teacher[j][c], trained);
                    tk_subset[at * k + c] = if o.subset[j][c] { 1.0 } else { 0.0 };
                }
                tk_mask[at] = lmask[at];
            } else if let (true, Some(ids), Some(lps)) = (row.topk > 0, &s.topk_ids, &s.topk_logprobs) {
                for c in 0..k {
                    tk_ids[at * k + c] = i64::from(ids[j][c]);
                    tk_lps[at * k + c] = clean(lps[j][c], trained);
                }
                tk_mask[at] = lmask[at];
            }
        }
    }
    let dev = opts.device;
    let (bi, ti, ki) = (b as i64, t as i64, k as i64);
    let f2 = |v: &[f32]| -> Result<Tensor> { Ok(Tensor::f_from_slice(v)?.f_view([bi, ti])?.f_to_device(dev)?) };
    let rewards: Vec<f32> = rows.iter().map(|r| r.sample.reward).collect();
    let weights: Vec<f64> = rows.iter().map(|r| r.weight).collect();
    let weights_f32: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
    let signs: Vec<f32> = rows.iter().map(|r| opts.config.advantage_sign_of(&r.sample.sample_id)).collect();
    Ok(PackedBatch {
        input_ids,
        response_ids,
        response_mask,
        predict_positions,
        prompt_lens,
        response_lens,
        loss_mask: f2(&lmask)?,
        old_logprobs: f2(&old)?,
        teacher_logprobs: if with_teacher { Some(f2(&teacher)?) } else { None },
        reward: Tensor::f_from_slice(&rewards)?.f_to_device(dev)?,
        sample_weight: Tensor::f_from_slice(&weights_f32)?.f_to_device(dev)?,
        advantage_sign: Tensor::f_from_slice(&signs)?.f_to_device(dev)?,
        topk_ids: if with_topk { Some(Tensor::f_from_slice(&tk_ids)?.f_view([bi, ti, ki])?.f_to_device(dev)?) } else { None },
        topk_logprobs: if with_topk { Some(Tensor::f_from_slice(&tk_lps)?.f_view([bi, ti, ki])?.f_to_device(dev)?) } else { None },
        topk_mask: if with_topk { Some(f2(&tk_mask)?) } else { None },
        topk_subset: if tk_subset.is_empty() { None } else { Some(Tensor::f_from_slice(&tk_subset)?.f_view([bi, ti, ki])?.f_to_device(dev)?) },
        teacher_pass: None,
        chosen_candidates: overlap.iter().map(|o| o.as_ref().map(|o| o.chosen.clone()).unwrap_or_default()).collect(),
        overlap_fraction: overlap.iter().map(|o| o.as_ref().map(|o| o.overlap_fraction)).collect(),
        sample_types: rows.iter().map(|r| r.sample.sample_type).collect(),
        sample_ids: rows.iter().map(|r| r.sample.sample_id.clone()).collect(),
        rewards,
        weights,
        source_index: rows.iter().map(|r| r.index).collect(),
    })
}

#[cfg(test)]
mod tests;
