//! Where an arm's training moved probability mass: each evaluated version's log-probs of two fixed token
//! sets, by token class, position and advantage sign, so the report can say which tokens an arm raised
//! and which it lowered (issue 37: why sampled-token OPD falls below v0 offline while top-K distillation
//! rises).
//!
//! The two sets, scored unchanged at every version of an arm (so a difference between versions is the
//! policy moving, not the tokens changing):
//! - [`HELDOUT`]: v0's greedy answers to the held-out problems (every response token, the stop token
//!   included when an answer ended on one);
//! - [`TRAINED`]: the arm's own training samples (the tokens its loss mask trains), each labelled with
//!   two [`Direction`]s: the sign of its advantage at the start of training (docs/method.md §6 with the
//!   rollout log-probs as the current policy, [`super::eval::token_advantages`]; `+` tokens are the ones
//!   the first step pushes up, `−` the ones it pushes down), and where the sample has teacher log-probs
//!   the sign of `teacher − rollout` (the hint-conditioned teacher's direction on that token, the same
//!   split for every arm that trains on a teacher, whatever its loss: a top-K arm's advantage is 0).
//!
//!
//! For an arm trained on a teacher, three more sets measure the teacher's own choices (which unsampled
//! tokens an arm raised):
//! - [`TEACHER_TOP1`] and [`TEACHER_TOPK_OTHER`]: at the trained positions, the teacher's [`TEACHER_K`]
//!   most likely tokens (scored once, [`teacher_choices`]); the version's log-prob of the teacher's top
//!   token where the student sampled another, and of the teacher's other top-K tokens together;
//! - [`TEACHER_ANSWERS`]: the instruction-hint teacher's greedy answers to the hinted held-out problems,
//!   under the student's prompt (no hint);
//!
//! and at version 0 the teacher's own log-probs of the same tokens ([`BY_TEACHER_SETS`],
//! [`BY_TEACHER_ANSWERS`], [`BY_TEACHER_V0_ANSWERS`]).
//!
//! Each version stores, per (set, class, band, sign), the token count and the summed log-prob (nats,
//! temperature 1). The change of a group from v0 to version v is `(Σ log π_v − Σ log π_0) / n` over the
//! same n tokens (nats per token), pooled over an arm's replicates by summing both before dividing.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::input_err;
use crate::model::LanguageModel;
use crate::report::cell;

/// The set of v0's greedy answers to the held-out problems.
pub const HELDOUT: &str = "heldout";
/// The set of the arm's training samples' trained tokens.
pub const TRAINED: &str = "trained";
/// Trained positions where the teacher's most likely token is not the sampled one: the version's log-prob
/// of the teacher's token there (a token the student did not sample; class = the teacher's token's).
pub const TEACHER_TOP1: &str = "teacher-top1";
/// Trained positions with teacher top-K ids: the log of the version's probability mass on the teacher's
/// [`TEACHER_K`] most likely tokens other than the sampled one (the mass a top-K loss can move and a
/// sampled-token loss cannot aim at).
pub const TEACHER_TOPK_OTHER: &str = "teacher-topk-other";
/// Scored by the teacher itself, written at version 0 only: its log-prob of the sampled token at every
/// trained position with teacher top-K ids.
pub const BY_TEACHER_SAMPLED: &str = "by-teacher-sampled";
/// Scored by the teacher itself, written at version 0 only: its log-prob of its own most likely token at
/// the same positions (the token it would write greedily there).
pub const BY_TEACHER_TOP1: &str = "by-teacher-top1";
/// The teacher's greedy answers to the held-out problems it got a hint for (instruction hints), scored
/// by the version under the student's own prompt (no hint): how likely the student is to say what the
/// teacher says, the sequence-level target of distillation.
pub const TEACHER_ANSWERS: &str = "teacher-answers";
/// Scored by the teacher itself, written at version 0 only: its log-probs of its own greedy answers.
pub const BY_TEACHER_ANSWERS: &str = "by-teacher-answers";
/// Scored by the teacher itself, written at version 0 only: its log-probs of v0's greedy answers to the
/// same problems, under the same hinted prompt.
pub const BY_TEACHER_V0_ANSWERS: &str = "by-teacher-v0-answers";
/// How many of the teacher's most likely tokens [`TeacherChoice`] keeps per position.
pub const TEACHER_K: usize = 8;

/// The token sets scored at every version of an arm whose trained samples have teacher choices.
pub const CHOICE_SETS: [&str; 2] = [TEACHER_TOP1, TEACHER_TOPK_OTHER];
/// The token sets scored by the teacher at version 0.
pub const BY_TEACHER_SETS: [&str; 2] = [BY_TEACHER_SAMPLED, BY_TEACHER_TOP1];

/// What a response token is, from its decoded text: the first matching class in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TokenClass {
    /// A stop token (end of the turn): its mass is the probability of ending the answer there.
    End,
    /// Another special token (one that decodes to nothing once special tokens are skipped).
    Special,
    /// A token with an ASCII digit (the numbers of the working and the final answer).
    Number,
    /// A token with markdown punctuation (`*`, `#`, `` ` ``, `|`).
    Markdown,
    /// A token with a line break.
    Newline,
    /// Every other token (words, spaces, punctuation).
    Word,
}

impl TokenClass {
    /// Every class, in report order.
    pub const ALL: [TokenClass; 6] = [TokenClass::End, TokenClass::Special, TokenClass::Number, TokenClass::Markdown, TokenClass::Newline, TokenClass::Word];

    /// The class of a token whose decoded text is `text` (special tokens kept); `stop` when its id is one
    /// of the model's stop ids, `special` when it is another special token.
    pub fn of(text: &str, stop: bool, special: bool) -> TokenClass {
        if stop {
            TokenClass::End
        } else if special {
            TokenClass::Special
        } else if text.chars().any(|c| c.is_ascii_digit()) {
            TokenClass::Number
        } else if text.contains(['*', '#', '`', '|']) {
            TokenClass::Markdown
        } else if text.contains('\n') {
            TokenClass::Newline
        } else {
            TokenClass::Word
        }
    }

    /// Its name in the table and the report.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenClass::End => "end",
            TokenClass::Special => "special",
            TokenClass::Number => "number",
            TokenClass::Markdown => "markdown",
            TokenClass::Newline => "newline",
            TokenClass::Word => "word",
        }
    }
}

/// Advantages and teacher − rollout differences within this many nats of 0 count as 0 ([`Direction`]):
/// below the float noise between two scoring passes of the same weights, above it a real push.
pub const DEAD_BAND: f32 = 1e-3;

/// The sign of a per-token quantity (nats), with [`DEAD_BAND`] around 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Direction {
    /// Above `DEAD_BAND`.
    Up,
    /// Below `−DEAD_BAND`.
    Down,
    /// Within the band.
    Flat,
    /// Not defined for this token (a held-out answer; a sample without teacher log-probs; an arm trained
    /// at a temperature other than 1).
    None,
}

impl Direction {
    /// The direction of `x` (nats; a non-finite `x` is `None`).
    pub fn of(x: f32) -> Direction {
        if !x.is_finite() {
            Direction::None
        } else if x > DEAD_BAND {
            Direction::Up
        } else if x < -DEAD_BAND {
            Direction::Down
        } else {
            Direction::Flat
        }
    }

    /// `+`, `-`, `0` or `""`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Up => "+",
            Direction::Down => "-",
            Direction::Flat => "0",
            Direction::None => "",
        }
    }
}

/// The third of a response that token `t` (0-based) of `len` tokens lies in: `first`, `middle` or
/// `last` (`3·t / len` = 0, 1, 2).
pub fn band(t: usize, len: usize) -> &'static str {
    BANDS[band_index(t, len)]
}

/// The band names, first to last.
pub const BANDS: [&str; 3] = ["first", "middle", "last"];

fn band_index(t: usize, len: usize) -> usize {
    (3 * t / len.max(1)).min(2)
}

/// One response to score: its prompt and response ids, which response tokens count, and per response
/// token its two [`Direction`]s (every vector one entry per response token).
#[derive(Debug, Clone, PartialEq)]
pub struct MassItem {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Response token ids.
    pub response_ids: Vec<u32>,
    /// Whether each response token is counted (the loss mask of a sample; all for an answer).
    pub counted: Vec<bool>,
    /// The sign of each token's advantage at the start of training.
    pub signs: Vec<Direction>,
    /// The sign of each token's `teacher − rollout` log-prob.
    pub teacher: Vec<Direction>,
    /// The teacher's most likely tokens at each response position (a trained sample with a teacher
    /// prompt; `None` otherwise).
    pub choice: Option<TeacherChoice>,
}

/// The hint-conditioned teacher's view of one trained sample, scored once with the initial weights on
/// the sample's teacher prompt (temperature 1): per response position its [`TEACHER_K`] most likely
/// tokens and its log-prob of the sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherChoice {
    /// `[T][K]` token ids, most likely first.
    pub ids: Vec<Vec<u32>>,
    /// `[T][K]` their log-probs under the teacher (nats), descending.
    pub logprobs: Vec<Vec<f32>>,
    /// `[T]` the teacher's log-prob of the sampled token (nats).
    pub sampled: Vec<f32>,
}

/// Per response position, from a version's log-probs `at[t][k]` of the teacher's ids `ids[t][k]`: the
/// log-prob of the teacher's most likely token where it is not the sampled token `response[t]` (NaN where
/// it is), and `log Σ_k exp(at[t][k])` over the teacher's ids other than the sampled token (NaN when
/// there is none). Returns `(top1, other)`, each of length T.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `ids` or `at` has another length than `response`, or a row of
/// `at` another width than its row of `ids`.
pub fn choice_values(response: &[u32], ids: &[Vec<u32>], at: &[Vec<f32>]) -> Result<(Vec<f32>, Vec<f32>)> {
    if ids.len() != response.len() || at.len() != response.len() {
        return Err(input_err!("teacher choices: {} id rows and {} log-prob rows for {} tokens", ids.len(), at.len(), response.len()));
    }
    let (mut top1, mut other) = (Vec::with_capacity(response.len()), Vec::with_capacity(response.len()));
    for (t, (&sampled, (row, lp))) in response.iter().zip(ids.iter().zip(at)).enumerate() {
        if row.len() != lp.len() {
            return Err(input_err!("teacher choices, token {t}: {} ids but {} log-probs", row.len(), lp.len()));
        }
        top1.push(match row.first() {
            Some(&id) if id != sampled => lp[0],
            _ => f32::NAN,
        });
        let kept: Vec<f32> = row.iter().zip(lp).filter(|(id, _)| **id != sampled).map(|(_, l)| *l).collect();
        other.push(match kept.iter().copied().fold(f32::NEG_INFINITY, f32::max) {
            m if m.is_finite() => m + kept.iter().map(|l| (l - m).exp()).sum::<f32>().ln(),
            _ => f32::NAN,
        });
    }
    Ok((top1, other))
}

/// One group's tokens at one version (`token_mass`): the tokens of one set with the same class, third
/// and directions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MassRow {
    /// Arm.
    pub arm: String,
    /// Checkpoint version (0 = the initial weights).
    pub version: i64,
    /// The token set: [`HELDOUT`], [`TRAINED`], [`TEACHER_TOP1`], [`TEACHER_TOPK_OTHER`],
    /// [`TEACHER_ANSWERS`], or one of the teacher's own ([`BY_TEACHER_SETS`], [`BY_TEACHER_ANSWERS`],
    /// [`BY_TEACHER_V0_ANSWERS`]; version 0 only).
    pub set: String,
    /// [`TokenClass::as_str`].
    pub class: String,
    /// [`band`].
    pub band: String,
    /// [`Direction::as_str`] of the token's advantage at the start of training (`""` for the held-out
    /// set).
    pub sign: String,
    /// [`Direction::as_str`] of the token's `teacher − rollout` log-prob (`""` without teacher
    /// log-probs).
    #[serde(default)]
    pub teacher_sign: String,
    /// Tokens in the group.
    pub tokens: i64,
    /// Their summed log-prob under the version, nats (temperature 1).
    pub logprob_sum: f64,
}

/// The rows of one version from the log-probs `logprobs[i][t]` (nats) of `items[i]`'s response tokens,
/// with `class_of(id)` the class of a token id; only counted tokens with a finite log-prob add (a NaN
/// marks a position a set leaves out, e.g. [`choice_values`]). Rows come in (class, band, sign, teacher
/// sign) order.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `logprobs` has another length than `items`, or an item's
/// log-probs, `counted`, `signs` or `teacher` have another length than its response.
pub fn aggregate(arm: &str, version: i64, set: &str, items: &[MassItem], logprobs: &[Vec<f32>], mut class_of: impl FnMut(u32) -> TokenClass) -> Result<Vec<MassRow>> {
    if logprobs.len() != items.len() {
        return Err(input_err!("token mass of {arm} v{version} ({set}): {} log-prob rows for {} responses", logprobs.len(), items.len()));
    }
    let mut acc: BTreeMap<(TokenClass, usize, Direction, Direction), (i64, f64)> = BTreeMap::new();
    for (k, (item, lp)) in items.iter().zip(logprobs).enumerate() {
        let n = item.response_ids.len();
        let lens = [lp.len(), item.counted.len(), item.signs.len(), item.teacher.len()];
        if lens.iter().any(|l| *l != n) {
            return Err(input_err!("token mass of {arm} v{version} ({set}), response {k}: {n} tokens but log-probs/counted/signs/teacher lengths {lens:?}"));
        }
        for t in 0..n {
            if !item.counted[t] || !lp[t].is_finite() {
                continue;
            }
            let e = acc.entry((class_of(item.response_ids[t]), band_index(t, n), item.signs[t], item.teacher[t])).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += f64::from(lp[t]);
        }
    }
    Ok(acc
        .into_iter()
        .map(|((class, band, sign, teacher), (tokens, sum))| MassRow {
            arm: arm.into(),
            version,
            set: set.into(),
            class: class.as_str().into(),
            band: BANDS[band].into(),
            sign: sign.as_str().into(),
            teacher_sign: teacher.as_str().into(),
            tokens,
            logprob_sum: sum,
        })
        .collect())
}

/// The rows of one version for `items` as set `set` ([`aggregate`] of their log-probs under `lm`,
/// temperature 1, at most `batch` items per scoring call) and, where items have a teacher choice, the
/// rows of [`CHOICE_SETS`] on the same counted positions ([`TEACHER_TOP1`] only where the teacher's top
/// token is not the sampled one), from the same scoring pass. A token's class
/// comes from its decoded text, the model's stop ids and whether it decodes to nothing with special
/// tokens skipped; a [`TEACHER_TOP1`] row's class is that of the teacher's token.
///
/// # Errors
/// Model and tokenizer errors; those of [`aggregate`] and [`choice_values`]; a teacher choice whose
/// width is not [`TEACHER_K`].
pub fn mass_rows(lm: &LanguageModel, arm: &str, version: i64, set: &str, items: &[MassItem], batch: usize) -> Result<Vec<MassRow>> {
    let with_choice = items.iter().any(|i| i.choice.is_some());
    let mut scored = Vec::with_capacity(items.len());
    for chunk in items.chunks(batch.max(1)) {
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = chunk.iter().map(|i| (i.prompt_ids.clone(), i.response_ids.clone())).collect();
        let at: Vec<Vec<Vec<u32>>> = match with_choice {
            false => vec![],
            true => chunk
                .iter()
                .map(|i| match &i.choice {
                    Some(c) if c.ids.iter().all(|r| r.len() == TEACHER_K) => Ok(c.ids.clone()),
                    Some(_) => Err(input_err!("token mass of {arm} v{version}: a teacher choice without {TEACHER_K} ids per position")),
                    None => Ok(vec![vec![0; TEACHER_K]; i.response_ids.len()]),
                })
                .collect::<Result<_>>()?,
        };
        scored.extend(lm.score_at(&pairs, 0, &at)?);
    }
    let classes = token_classes(lm, items)?;
    let class_of = |id: u32| classes.get(&id).copied().unwrap_or(TokenClass::Word);
    let logprobs: Vec<Vec<f32>> = scored.iter().map(|s| s.logprobs.clone()).collect();
    let mut rows = aggregate(arm, version, set, items, &logprobs, class_of)?;
    if with_choice {
        let (mut top1_items, mut top1_lp, mut other_items, mut other_lp) = (vec![], vec![], vec![], vec![]);
        for (item, sc) in items.iter().zip(&scored) {
            let (Some(c), Some(at)) = (&item.choice, &sc.at_logprobs) else { continue };
            let (top1, other) = choice_values(&item.response_ids, &c.ids, at)?;
            top1_items.push(with_ids(item, c.ids.iter().map(|r| r[0]).collect()));
            top1_lp.push(top1);
            other_items.push(item.clone());
            other_lp.push(other);
        }
        rows.extend(aggregate(arm, version, TEACHER_TOP1, &top1_items, &top1_lp, class_of)?);
        rows.extend(aggregate(arm, version, TEACHER_TOPK_OTHER, &other_items, &other_lp, class_of)?);
    }
    Ok(rows)
}

/// The rows of [`BY_TEACHER_SETS`] (version 0) for the items with a teacher choice: the teacher's own
/// log-probs of the sampled tokens and of its most likely tokens, on the counted positions; `class_of`
/// as in [`aggregate`] ([`BY_TEACHER_TOP1`] by the teacher's token).
///
/// # Errors
/// Those of [`aggregate`].
pub fn by_teacher_rows(arm: &str, items: &[MassItem], class_of: impl Fn(u32) -> TokenClass) -> Result<Vec<MassRow>> {
    let (mut sampled_items, mut sampled, mut top1_items, mut top1) = (vec![], vec![], vec![], vec![]);
    for item in items {
        let Some(c) = &item.choice else { continue };
        let best: Vec<f32> = c.logprobs.iter().map(|r| r.first().copied().unwrap_or(f32::NAN)).collect();
        sampled_items.push(item.clone());
        sampled.push(c.sampled.clone());
        top1_items.push(with_ids(item, c.ids.iter().map(|r| r.first().copied().unwrap_or(0)).collect()));
        top1.push(best);
    }
    let mut rows = aggregate(arm, 0, BY_TEACHER_SAMPLED, &sampled_items, &sampled, &class_of)?;
    rows.extend(aggregate(arm, 0, BY_TEACHER_TOP1, &top1_items, &top1, &class_of)?);
    Ok(rows)
}

/// `item` with its response ids replaced by `ids` (the tokens whose class a row takes: the teacher's
/// top tokens at the same positions).
fn with_ids(item: &MassItem, ids: Vec<u32>) -> MassItem {
    MassItem { prompt_ids: vec![], response_ids: ids, counted: item.counted.clone(), signs: item.signs.clone(), teacher: item.teacher.clone(), choice: None }
}

/// The class of every response id of `items` and of their teacher choices' most likely ids.
///
/// # Errors
/// Tokenizer errors.
pub fn token_classes(lm: &LanguageModel, items: &[MassItem]) -> Result<HashMap<u32, TokenClass>> {
    let stops = lm.eos_token_ids().to_vec();
    let mut classes: HashMap<u32, TokenClass> = HashMap::new();
    let firsts = items.iter().filter_map(|i| i.choice.as_ref()).flat_map(|c| c.ids.iter().filter_map(|r| r.first().copied()));
    for id in items.iter().flat_map(|i| i.response_ids.iter().copied()).chain(firsts) {
        if let std::collections::hash_map::Entry::Vacant(e) = classes.entry(id) {
            let (text, plain) = (lm.decode(&[id], false)?, lm.decode(&[id], true)?);
            e.insert(TokenClass::of(&text, stops.contains(&id), plain.is_empty() && !text.is_empty()));
        }
    }
    Ok(classes)
}

/// The teacher's choices for `items` (`(teacher prompt ids, response ids)`, `None` for a sample without a
/// teacher prompt), scored by `teacher` (the initial weights) at temperature 1, at most `batch` per call.
///
/// # Errors
/// Model errors.
pub fn teacher_choices(teacher: &LanguageModel, items: &[Option<(Vec<u32>, Vec<u32>)>], batch: usize) -> Result<Vec<Option<TeacherChoice>>> {
    let todo: Vec<(Vec<u32>, Vec<u32>)> = items.iter().flatten().cloned().collect();
    let mut scored = Vec::with_capacity(todo.len());
    for chunk in todo.chunks(batch.max(1)) {
        scored.extend(teacher.score(chunk, TEACHER_K)?);
    }
    let mut scored = scored.into_iter();
    Ok(items
        .iter()
        .map(|i| {
            i.as_ref().and_then(|_| scored.next()).and_then(|s| match (s.topk_ids, s.topk_logprobs) {
                (Some(ids), Some(logprobs)) => Some(TeacherChoice { ids, logprobs, sampled: s.logprobs }),
                _ => None,
            })
        })
        .collect())
}

/// Pooled change of a selection of rows from v0 to each replicate's last version: the arm groups'
/// `(Σ log π_last − Σ log π_0, n)` over the rows `keep` selects (n counted at v0).
fn pooled(rows: &[MassRow], replicates: &[(&str, i64)], keep: &dyn Fn(&MassRow) -> bool) -> Option<(f64, i64)> {
    sums(rows, replicates, keep).map(|(s0, s1, n)| (s1 - s0, n))
}

/// The pooled sums behind [`pooled`]: `(Σ log π_0, Σ log π_last, n)` over the replicates; `None` when a
/// replicate's last version has other tokens than its v0 or nothing is selected.
fn sums(rows: &[MassRow], replicates: &[(&str, i64)], keep: &dyn Fn(&MassRow) -> bool) -> Option<(f64, f64, i64)> {
    let (mut a, mut b, mut n) = (0.0, 0.0, 0i64);
    for (arm, last) in replicates {
        let sum = |v: i64| rows.iter().filter(|r| r.arm == *arm && r.version == v && keep(r)).fold((0.0, 0i64), |(s, k), r| (s + r.logprob_sum, k + r.tokens));
        let ((s0, n0), (s1, n1)) = (sum(0), sum(*last));
        if n0 != n1 {
            return None; // not the same tokens (a version without rows)
        }
        a += s0;
        b += s1;
        n += n0;
    }
    (n > 0).then_some((a, b, n))
}

/// The pooled `(Σ, n)` of the version-0 rows `keep` selects (the teacher's own sets, and counts at v0).
fn at_v0(rows: &[MassRow], replicates: &[(&str, i64)], keep: &dyn Fn(&MassRow) -> bool) -> Option<(f64, i64)> {
    let (s, n) = rows.iter().filter(|r| r.version == 0 && replicates.iter().any(|(a, _)| r.arm == *a) && keep(r)).fold((0.0, 0i64), |(s, k), r| (s + r.logprob_sum, k + r.tokens));
    (n > 0).then_some((s, n))
}

/// A report cell of [`sums`]: mean log-prob at v0 → at the last version (nats per token).
fn levels_cell(p: Option<(f64, f64, i64)>) -> String {
    match p {
        Some((a, b, n)) => format!("{:.2} → {:.2}", a / n as f64, b / n as f64),
        None => "–".into(),
    }
}

/// A report cell: the pooled change in nats per token and the group's share of `total` tokens.
fn delta_cell(p: Option<(f64, i64)>, total: i64) -> String {
    match p {
        Some((d, n)) if total > 0 => format!("{:+.3} ({:.0} %)", d / n as f64, 100.0 * n as f64 / total as f64),
        Some((d, n)) => format!("{:+.3} ({n})", d / n as f64),
        None => "–".into(),
    }
}

/// The report's `## Where the probability mass moved`: per arm group (replicates pooled), the change of
/// mean log-prob from v0 to the last version on v0's held-out answers by token class and by third of the
/// answer, and on the arm's trained tokens by the sign of their starting advantage and the teacher's
/// direction; then, for arms with teacher sets, the student's mass on the teacher's top-K at the trained
/// positions ([`CHOICE_SETS`]) and on the teacher's greedy answers ([`TEACHER_ANSWERS`]). The teacher is
/// always scored at temperature 1, whatever `teacher.temperature` the arm trained with. `arms` are (arm,
/// group) pairs (an empty group is the arm itself); `last` gives each arm's last evaluated version.
/// Nothing is written when no arm has rows at a version above 0.
pub fn render(s: &mut String, arms: &[(&str, &str)], rows: &[MassRow], last: &dyn Fn(&str) -> Option<i64>) {
    let mut groups: Vec<(String, Vec<(&str, i64)>)> = vec![];
    for &(arm, group) in arms {
        let Some(v) = last(arm).filter(|v| *v > 0) else { continue };
        if !rows.iter().any(|r| r.arm == arm && r.version == v) {
            continue;
        }
        let g = if group.is_empty() { arm } else { group };
        match groups.iter_mut().find(|(x, _)| x == g) {
            Some((_, v2)) => v2.push((arm, v)),
            None => groups.push((g.to_string(), vec![(arm, v)])),
        }
    }
    if groups.is_empty() {
        return;
    }
    let _ = writeln!(s, "## Where the probability mass moved\n");
    let _ = writeln!(
        s,
        "Each version scores fixed token sets (`src/ablate/mass.rs`): v0's greedy answers to the held-out problems, and the arm's own trained tokens (and, for an arm trained on a teacher, the teacher's own choices: the last two tables). A cell is the change of mean log-prob from v0 to the arm's last checkpoint on the same tokens (nats per token; negative = the arm lowered them; replicates pooled) and, in brackets, the group's share of the set's tokens. `end` is the stop token (the probability of ending the answer there), `number` a token with a digit.\n"
    );
    let heldout = |r: &MassRow| r.set == HELDOUT;
    let _ = write!(s, "On v0's held-out answers:\n\n| arm | all |");
    for c in TokenClass::ALL {
        let _ = write!(s, " {} |", c.as_str());
    }
    let _ = writeln!(s, " first third | middle third | last third |");
    let _ = writeln!(s, "|---|---:|{}---:|---:|---:|", "---:|".repeat(TokenClass::ALL.len()));
    for (g, reps) in &groups {
        let total = pooled(rows, reps, &heldout).map_or(0, |p| p.1);
        let _ = write!(s, "| {} | {} |", cell(g), delta_cell(pooled(rows, reps, &heldout), total));
        for c in TokenClass::ALL {
            let _ = write!(s, " {} |", delta_cell(pooled(rows, reps, &|r: &MassRow| heldout(r) && r.class == c.as_str()), total));
        }
        for b in BANDS {
            let _ = write!(s, " {} |", delta_cell(pooled(rows, reps, &|r: &MassRow| heldout(r) && r.band == b), total));
        }
        s.push('\n');
    }
    let trained = |r: &MassRow| r.set == TRAINED;
    let _ = writeln!(
        s,
        "\nOn the arm's trained tokens: by the sign of their advantage at the start of training (adv `+` = the first step pushes them up, `-` down, `0` = not pushed by the advantage: a reward of 0, a score-only sample, or a top-K loss whose teacher term is outside the advantage), and by the hint-conditioned teacher's direction on them (`t > s`: the teacher's log-prob above the rollout's, `t < s` below; the same split for every arm trained on a teacher; within {DEAD_BAND} nats counts as neither):\n"
    );
    let _ = writeln!(s, "| arm | all | adv + | adv - | adv 0 | t > s | t < s | t < s, numbers | t < s, last third | t < s, end | t > s, end |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (g, reps) in &groups {
        let Some((_, total)) = pooled(rows, reps, &trained) else { continue };
        let adv = |sign: &'static str| delta_cell(pooled(rows, reps, &move |r: &MassRow| trained(r) && r.sign == sign), total);
        let tea = |sign: &'static str, extra: fn(&MassRow) -> bool| delta_cell(pooled(rows, reps, &move |r: &MassRow| trained(r) && r.teacher_sign == sign && extra(r)), total);
        let any: fn(&MassRow) -> bool = |_| true;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(g),
            delta_cell(pooled(rows, reps, &trained), total),
            adv("+"),
            adv("-"),
            adv("0"),
            tea("+", any),
            tea("-", any),
            tea("-", |r| r.class == "number"),
            tea("-", |r| r.band == "last"),
            tea("-", |r| r.class == "end"),
            tea("+", |r| r.class == "end"),
        );
    }
    s.push('\n');
    render_choices(s, &groups, rows);
    render_teacher_answers(s, &groups, rows);
}

/// The fourth table of [`render`]: the student's log-prob of the teacher's own greedy answers to the
/// held-out problems, for the arm groups with [`TEACHER_ANSWERS`] rows, after a line with the teacher's
/// own log-probs of its answers and of v0's ([`BY_TEACHER_ANSWERS`], [`BY_TEACHER_V0_ANSWERS`]).
fn render_teacher_answers(s: &mut String, groups: &[(String, Vec<(&str, i64)>)], rows: &[MassRow]) {
    let answers = |r: &MassRow| r.set == TEACHER_ANSWERS;
    let with: Vec<&(String, Vec<(&str, i64)>)> = groups.iter().filter(|(_, reps)| sums(rows, reps, &answers).is_some()).collect();
    let Some((_, first)) = with.first() else { return };
    // The teacher's figures are the same for every arm: those of the first replicate with them.
    let one = &first[..1];
    let mean = |set: &str| at_v0(rows, one, &|r: &MassRow| r.set == set).map(|(x, n)| (x / n as f64, n));
    let answers_n = sums(rows, one, &answers).map_or(0, |p| p.2);
    let _ = write!(s, "On the teacher's own greedy answers to the held-out problems it got an instruction hint for ({answers_n} tokens): ");
    if let (Some((own, _)), Some((v0, n0))) = (mean(BY_TEACHER_ANSWERS), mean(BY_TEACHER_V0_ANSWERS)) {
        let _ = write!(s, "the teacher's mean log-prob of its own tokens is {own:.3}, of v0's answers to the same problems ({n0} tokens) {v0:.3} (both read with the hint). ");
    }
    let _ = writeln!(
        s,
        "A cell is the student's mean log-prob of the teacher's answers under its own prompt (no hint), v0 → last checkpoint, and the change by class and third of the answer (the sequence-level target of distillation: positive = the arm made the student more likely to write what the teacher writes).\n"
    );
    let _ = writeln!(s, "| arm | teacher's answers | Δ | end | number | newline | word | first third | middle third | last third |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (g, reps) in with {
        let total = pooled(rows, reps, &answers).map_or(0, |p| p.1);
        let by = |f: &dyn Fn(&MassRow) -> bool| delta_cell(pooled(rows, reps, &|r: &MassRow| answers(r) && f(r)), total);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(g),
            levels_cell(sums(rows, reps, &answers)),
            by(&|_| true),
            by(&|r| r.class == "end"),
            by(&|r| r.class == "number"),
            by(&|r| r.class == "newline"),
            by(&|r| r.class == "word"),
            by(&|r| r.band == "first"),
            by(&|r| r.band == "middle"),
            by(&|r| r.band == "last"),
        );
    }
    s.push('\n');
}

/// The third table of [`render`]: the student's mass on the teacher's own choices at the trained
/// positions, for the arm groups with [`CHOICE_SETS`] rows.
fn render_choices(s: &mut String, groups: &[(String, Vec<(&str, i64)>)], rows: &[MassRow]) {
    let with: Vec<&(String, Vec<(&str, i64)>)> = groups.iter().filter(|(_, reps)| at_v0(rows, reps, &|r| r.set == BY_TEACHER_SAMPLED).is_some()).collect();
    if with.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "On the teacher's own choices at the same trained positions (the teacher = the initial weights reading the hint; its {TEACHER_K} most likely tokens per position, scored once). `top ≠ sampled` is the share of positions where the teacher's most likely token is not the one the student sampled; `teacher: sampled / top` the teacher's mean log-prob of the sampled token and of its own top token, over all these positions. Then the student's mean log-prob, v0 → last checkpoint, of the teacher's top token where the student sampled another (by the class of the teacher's token), and of the teacher's other top-{TEACHER_K} tokens together (the log of their summed probability): mass a top-K loss aims at and a sampled-token loss does not.\n"
    );
    let _ = writeln!(s, "| arm | top ≠ sampled | teacher: sampled / top | teacher's top token | Δ | Δ, top = end | Δ, top = number | Δ, top = word | other top-{TEACHER_K} mass | Δ |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (g, reps) in with {
        let all = at_v0(rows, reps, &|r| r.set == BY_TEACHER_SAMPLED);
        let differ = at_v0(rows, reps, &|r| r.set == TEACHER_TOP1);
        let own = at_v0(rows, reps, &|r| r.set == BY_TEACHER_TOP1);
        let share = match (differ, all) {
            (Some((_, d)), Some((_, n))) => format!("{:.0} %", 100.0 * d as f64 / n as f64),
            (None, Some(_)) => "0 %".into(),
            _ => "–".into(),
        };
        let teacher = match (all, own) {
            (Some((a, n)), Some((b, m))) => format!("{:.2} / {:.2}", a / n as f64, b / m as f64),
            _ => "–".into(),
        };
        let top1 = |extra: fn(&MassRow) -> bool| pooled(rows, reps, &move |r: &MassRow| r.set == TEACHER_TOP1 && extra(r));
        let ntop = top1(|_| true).map_or(0, |p| p.1);
        let other = |r: &MassRow| r.set == TEACHER_TOPK_OTHER;
        let _ = writeln!(
            s,
            "| {} | {share} | {teacher} | {} | {} | {} | {} | {} | {} | {} |",
            cell(g),
            levels_cell(sums(rows, reps, &|r: &MassRow| r.set == TEACHER_TOP1)),
            delta_cell(top1(|_| true), ntop),
            delta_cell(top1(|r| r.class == "end"), ntop),
            delta_cell(top1(|r| r.class == "number"), ntop),
            delta_cell(top1(|r| r.class == "word"), ntop),
            levels_cell(sums(rows, reps, &other)),
            delta_cell(pooled(rows, reps, &other), pooled(rows, reps, &other).map_or(0, |p| p.1)),
        );
    }
    s.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use Direction::{Down, Flat, Up};

    fn item(ids: &[u32], counted: &[bool], signs: &[Direction], teacher: &[Direction]) -> MassItem {
        MassItem { prompt_ids: vec![1], response_ids: ids.to_vec(), counted: counted.to_vec(), signs: signs.to_vec(), teacher: teacher.to_vec(), choice: None }
    }

    #[test]
    fn choice_values_by_hand() {
        // Two positions, K = 3. Position 0 sampled 5, the teacher's top is 7: top1 = the version's
        // log-prob of 7; the others are 7 and 9 (5 left out): ln(e^-1 + e^-2).
        // Position 1 sampled the teacher's top token 7: no top1; the others are 5 and 9.
        let ids = vec![vec![7, 5, 9], vec![7, 5, 9]];
        let at = vec![vec![-1.0, -0.5, -2.0], vec![-0.1, -3.0, -4.0]];
        let (top1, other) = choice_values(&[5, 7], &ids, &at).unwrap();
        assert_eq!(top1[0], -1.0);
        assert!(top1[1].is_nan());
        assert!((other[0] - ((-1.0f32).exp() + (-2.0f32).exp()).ln()).abs() < 1e-6);
        assert!((other[1] - ((-3.0f32).exp() + (-4.0f32).exp()).ln()).abs() < 1e-6);
        // K = 1 and the sampled token is the teacher's: nothing else to count
        let (t, o) = choice_values(&[7], &[vec![7]], &[vec![-0.2]]).unwrap();
        assert!(t[0].is_nan() && o[0].is_nan());
        assert!(choice_values(&[5, 7], &ids[..1], &at).is_err());
        assert!(choice_values(&[5], &[vec![7, 5]], &[vec![-1.0]]).is_err());
    }

    #[test]
    fn by_teacher_rows_by_hand() {
        let class = |id: u32| if id == 9 { TokenClass::End } else { TokenClass::Word };
        // 3 tokens, the last not counted; the teacher's top tokens are 9, 5, 9 (5 is the sampled token at
        // position 1)
        let mut it = item(&[5, 5, 5], &[true, true, false], &[Up, Up, Up], &[Down, Down, Down]);
        it.choice = Some(TeacherChoice { ids: vec![vec![9, 5], vec![5, 9], vec![9, 5]], logprobs: vec![vec![-0.5, -1.5], vec![-0.25, -2.0], vec![-0.1, -3.0]], sampled: vec![-1.5, -0.25, -3.0] });
        let rows = by_teacher_rows("a", &[it, item(&[5], &[true], &[Up], &[Up])], class).unwrap();
        let got: Vec<(&str, &str, &str, i64, f64)> = rows.iter().map(|r| (r.set.as_str(), r.class.as_str(), r.band.as_str(), r.tokens, r.logprob_sum)).collect();
        assert_eq!(
            got,
            vec![
                (BY_TEACHER_SAMPLED, "word", "first", 1, -1.5),
                (BY_TEACHER_SAMPLED, "word", "middle", 1, -0.25),
                (BY_TEACHER_TOP1, "end", "first", 1, -0.5),
                (BY_TEACHER_TOP1, "word", "middle", 1, -0.25),
            ]
        );
        assert!(rows.iter().all(|r| r.version == 0 && r.sign == "+" && r.teacher_sign == "-"));
    }

    #[test]
    fn classes_bands_and_directions_by_hand() {
        assert_eq!(TokenClass::of(" 42", false, false), TokenClass::Number);
        assert_eq!(TokenClass::of("**", false, false), TokenClass::Markdown);
        assert_eq!(TokenClass::of("\n", false, false), TokenClass::Newline);
        assert_eq!(TokenClass::of(" the", false, false), TokenClass::Word);
        assert_eq!(TokenClass::of("<|im_end|>", true, true), TokenClass::End);
        assert_eq!(TokenClass::of("<|im_start|>", false, true), TokenClass::Special);
        // 6 tokens: 0,1 first; 2,3 middle; 4,5 last. 1 token: first.
        assert_eq!((0..6).map(|t| band(t, 6)).collect::<Vec<_>>(), ["first", "first", "middle", "middle", "last", "last"]);
        assert_eq!(band(0, 1), "first");
        let d = [0.5, 2e-3, 1e-3, 0.0, -1e-3, -2e-3, f32::NAN].map(|x| Direction::of(x).as_str());
        assert_eq!(d, ["+", "+", "0", "0", "0", "-", ""]);
    }

    #[test]
    fn aggregate_sums_counted_tokens_by_group() {
        // ids: 7 = a number, 9 = the stop token, everything else a word
        let class = |id: u32| match id {
            7 => TokenClass::Number,
            9 => TokenClass::End,
            _ => TokenClass::Word,
        };
        let items = vec![
            item(&[5, 7, 9], &[true, true, true], &[Up, Down, Down], &[Up, Down, Flat]),
            item(&[5, 5, 7], &[false, true, true], &[Up, Up, Down], &[Up, Up, Down]),
        ];
        let lp = vec![vec![-1.0, -2.0, -0.5], vec![-9.0, -0.25, -3.0]];
        let rows = aggregate("a", 2, TRAINED, &items, &lp, class).unwrap();
        let got: Vec<(&str, &str, &str, &str, i64, f64)> = rows.iter().map(|r| (r.class.as_str(), r.band.as_str(), r.sign.as_str(), r.teacher_sign.as_str(), r.tokens, r.logprob_sum)).collect();
        assert_eq!(
            got,
            vec![
                ("end", "last", "-", "0", 1, -0.5),
                ("number", "middle", "-", "-", 1, -2.0),
                ("number", "last", "-", "-", 1, -3.0),
                ("word", "first", "+", "+", 1, -1.0),
                ("word", "middle", "+", "+", 1, -0.25),
            ]
        );
        assert!(rows.iter().all(|r| r.arm == "a" && r.version == 2 && r.set == TRAINED));
        // a length that does not match is an error, not a silent skip
        let short = vec![vec![-1.0, -2.0, -0.5], vec![-1.0]];
        assert!(aggregate("a", 2, TRAINED, &items, &short, class).unwrap_err().to_string().contains("response 1"));
        assert!(aggregate("a", 2, TRAINED, &items, &lp[..1], class).is_err());
    }

    #[allow(clippy::too_many_arguments)]
    fn row(arm: &str, version: i64, set: &str, class: &str, band: &str, sign: &str, teacher: &str, tokens: i64, sum: f64) -> MassRow {
        MassRow { arm: arm.into(), version, set: set.into(), class: class.into(), band: band.into(), sign: sign.into(), teacher_sign: teacher.into(), tokens, logprob_sum: sum }
    }

    #[test]
    fn render_pools_replicates_by_hand() {
        let arms = [("opd.seed=1", "opd"), ("opd.seed=2", "opd")];
        let rows = vec![
            // replicate 1: 4 held-out tokens (3 numbers in the last third, 1 end), v0 → v2
            row("opd.seed=1", 0, HELDOUT, "number", "last", "", "", 3, -3.0),
            row("opd.seed=1", 0, HELDOUT, "end", "last", "", "", 1, -1.0),
            row("opd.seed=1", 2, HELDOUT, "number", "last", "", "", 3, -6.0),
            row("opd.seed=1", 2, HELDOUT, "end", "last", "", "", 1, -1.5),
            row("opd.seed=1", 0, TRAINED, "word", "first", "-", "-", 2, -2.0),
            row("opd.seed=1", 2, TRAINED, "word", "first", "-", "-", 2, -4.0),
            row("opd.seed=1", 0, TRAINED, "end", "last", "+", "+", 2, -2.0),
            row("opd.seed=1", 2, TRAINED, "end", "last", "+", "+", 2, -1.0),
            // replicate 2: 1 number, raised by 1 nat
            row("opd.seed=2", 0, HELDOUT, "number", "first", "", "", 1, -2.0),
            row("opd.seed=2", 2, HELDOUT, "number", "first", "", "", 1, -1.0),
        ];
        let mut s = String::new();
        render(&mut s, &arms, &rows, &|_| Some(2));
        // all: (−7.5 + 4 − 1 + 2)/5 = −0.5; numbers (−6 + 3 − 1 + 2)/4 = −0.5 over 4 of 5 tokens; end −0.5
        // (20 %); first third +1 (20 %); last third (−7.5 + 4)/4 = −0.875 (80 %)
        assert!(s.contains("| opd | -0.500 (100 %) | -0.500 (20 %) | – | -0.500 (80 %) | – | – | – | +1.000 (20 %) | – | -0.875 (80 %) |"), "{s}");
        // trained (replicate 1 only): 4 tokens, all (−5 + 4)/4 = −0.25; the two − tokens lost 1 nat each,
        // the two + end tokens gained 0.5
        assert!(s.contains("| opd | -0.250 (100 %) | +0.500 (50 %) | -1.000 (50 %) | – | +0.500 (50 %) | -1.000 (50 %) | – | – | – | +0.500 (50 %) |"), "{s}");
        assert!(!s.contains("On the teacher's own choices"), "no choice rows, no third table");
        // nothing after v0: no section
        let mut t = String::new();
        render(&mut t, &arms, &rows, &|_| Some(0));
        assert!(t.is_empty());
    }

    #[test]
    fn render_choices_by_hand() {
        let arms = [("opd.seed=1", "opd"), ("opd.seed=2", "opd")];
        let mut rows = vec![
            row("opd.seed=1", 0, TRAINED, "word", "first", "-", "-", 4, -8.0),
            row("opd.seed=1", 2, TRAINED, "word", "first", "-", "-", 4, -9.0),
            row("opd.seed=2", 0, TRAINED, "word", "first", "-", "-", 2, -4.0),
            row("opd.seed=2", 2, TRAINED, "word", "first", "-", "-", 2, -4.0),
        ];
        // the teacher on 6 positions (4 + 2): sampled −1.0 per token, its top token −0.25
        rows.push(row("opd.seed=1", 0, BY_TEACHER_SAMPLED, "word", "first", "-", "-", 4, -4.0));
        rows.push(row("opd.seed=2", 0, BY_TEACHER_SAMPLED, "word", "first", "-", "-", 2, -2.0));
        rows.push(row("opd.seed=1", 0, BY_TEACHER_TOP1, "word", "first", "-", "-", 4, -1.0));
        rows.push(row("opd.seed=2", 0, BY_TEACHER_TOP1, "end", "first", "-", "-", 2, -0.5));
        // the teacher's top token differs on 3 of the 6: 2 words (rep 1), 1 end (rep 2)
        for (arm, v, class, n, sum) in [("opd.seed=1", 0, "word", 2, -6.0), ("opd.seed=1", 2, "word", 2, -5.0), ("opd.seed=2", 0, "end", 1, -4.0), ("opd.seed=2", 2, "end", 1, -2.0)] {
            rows.push(row(arm, v, TEACHER_TOP1, class, "first", "-", "-", n, sum));
        }
        for (arm, v, sum) in [("opd.seed=1", 0, -8.0), ("opd.seed=1", 2, -6.0), ("opd.seed=2", 0, -2.0), ("opd.seed=2", 2, -2.0)] {
            rows.push(row(arm, v, TEACHER_TOPK_OTHER, "word", "first", "-", "-", if arm.ends_with('1') { 4 } else { 2 }, sum));
        }
        let mut s = String::new();
        render(&mut s, &arms, &rows, &|_| Some(2));
        // 3 of 6 = 50 %; teacher −6/6 = −1.00 sampled, −1.5/6 = −0.25 top; top token −10/3 = −3.33 → −7/3 =
        // −2.33, Δ +1.000 (100 %), end +2.000 (33 %), word +0.500 (67 %); other mass −10/6 → −8/6: Δ +0.333
        assert!(s.contains("| opd | 50 % | -1.00 / -0.25 | -3.33 → -2.33 | +1.000 (100 %) | +2.000 (33 %) | – | +0.500 (67 %) | -1.67 → -1.33 | +0.333 (100 %) |"), "{s}");
        assert!(!s.contains("the teacher's own greedy answers"), "no teacher answers, no fourth table");
        // The teacher's answers: 3 tokens per replicate (2 numbers first, 1 end last); the teacher's own
        // figures from replicate 1's v0 rows only (replicate 2 repeats them).
        for arm in ["opd.seed=1", "opd.seed=2"] {
            rows.push(row(arm, 0, TEACHER_ANSWERS, "number", "first", "", "", 2, -4.0));
            rows.push(row(arm, 0, TEACHER_ANSWERS, "end", "last", "", "", 1, -2.0));
            rows.push(row(arm, 2, TEACHER_ANSWERS, "number", "first", "", "", 2, -3.0));
            rows.push(row(arm, 2, TEACHER_ANSWERS, "end", "last", "", "", 1, if arm.ends_with('1') { -2.0 } else { -1.0 }));
            rows.push(row(arm, 0, BY_TEACHER_ANSWERS, "number", "first", "", "", 3, -0.75));
            rows.push(row(arm, 0, BY_TEACHER_V0_ANSWERS, "word", "first", "", "", 4, -2.0));
        }
        let mut s = String::new();
        render(&mut s, &arms, &rows, &|_| Some(2));
        // own −0.75/3, v0's −2/4; student −12/6 = −2.00 → −9/6 = −1.50, Δ +0.5; numbers +2/4 = +0.5 (67 %);
        // end +1/2 (33 %)
        assert!(s.contains("(3 tokens): the teacher's mean log-prob of its own tokens is -0.250, of v0's answers to the same problems (4 tokens) -0.500"), "{s}");
        assert!(s.contains("| opd | -2.00 → -1.50 | +0.500 (100 %) | +0.500 (33 %) | +0.500 (67 %) | – | – | +0.500 (67 %) | – | +0.500 (33 %) |"), "{s}");
    }
}
