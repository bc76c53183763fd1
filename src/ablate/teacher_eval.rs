//! The hint-conditioned teacher, measured: what distillation can reach at best.
//!
//! OPD moves the student toward the teacher — the same initial weights reading the hint appended to the
//! user's message (docs/method.md §3–§4). Whether an arm's gain is large or small only means something beside
//! the teacher's own score, so every ablation evaluates the teacher on the held-out problems the arms are
//! scored on, once per hint strategy:
//!
//! | strategy | the hint for a held-out problem |
//! |---|---|
//! | `verbatim` | the student's reply to v0's greedy answer, its first 1–3 sentences (the complaint copied; the rule backend's `verbatim` style) |
//! | `instruction` | that reply rewritten as instructions ([`crate::hint::instruction_from`]; the rule backend's default `instruction` style), the verbatim hint when nothing can be rewritten |
//! | `oracle` | every preference of the student named ([`oracle_hint`]): the in-context bound, what a perfect hint extractor could say |
//!
//! For `verbatim` and `instruction` a problem whose v0 answer already satisfied the student gets no
//! hint (the student thanked, the pipeline extracts none), so the teacher's answer there is v0's.
//! The teacher answers greedily, as every evaluated version does, and is scored by the same checker
//! ([`crate::demo::check`]).

use serde::{Deserialize, Serialize};

use crate::demo::{Preference, Preferences, Problem, Student};
use crate::error::Result;
use crate::hint::{first_sentences, instruction_from, teacher_messages, MAX_RULE_HINT_CHARS};
use crate::model::LanguageModel;
use crate::schema::Message;

/// How the teacher's hint for a held-out problem is made (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HintStrategy {
    /// The student's complaint copied.
    Verbatim,
    /// The complaint rewritten as instructions.
    Instruction,
    /// Every preference named.
    Oracle,
}

impl HintStrategy {
    /// Every strategy, in report order.
    pub const ALL: [HintStrategy; 3] = [HintStrategy::Verbatim, HintStrategy::Instruction, HintStrategy::Oracle];

    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            HintStrategy::Verbatim => "verbatim",
            HintStrategy::Instruction => "instruction",
            HintStrategy::Oracle => "oracle",
        }
    }
}

/// The oracle hint: one instruction per enabled preference, in [`Preference::ALL`] order, e.g. for the
/// default student "Do not use markdown: no bold or italics, headers, lists, LaTeX or code blocks. Use at
/// most 80 words. Write casual plain sentences without labels such as "Step 1:" or "Answer:". State the
/// final number in the last sentence."
pub fn oracle_hint(prefs: &Preferences) -> String {
    prefs
        .enabled()
        .into_iter()
        .map(|p| match p {
            Preference::NoMarkdown => "Do not use markdown: no bold or italics, headers, lists, LaTeX or code blocks.".to_string(),
            Preference::Concise => format!("Use at most {} words.", prefs.max_words),
            Preference::PlainSentences => "Write casual plain sentences without labels such as \"Step 1:\" or \"Answer:\".".to_string(),
            Preference::AnswerAtEnd => "State the final number in the last sentence.".to_string(),
            Preference::CorrectAnswer => "Check the arithmetic so that the final number is the correct answer.".to_string(),
            Preference::LabeledSteps => "Show the work as lines labeled \"Step 1:\", \"Step 2:\" and so on, numbered in order.".to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The hint `strategy` gives for a problem whose v0 answer drew `reply` from the student (`None`: no
/// hint, the student was satisfied). The verbatim hint is capped at the rule backend's length.
pub fn hint_for(strategy: HintStrategy, reply_text: &str, satisfied: bool, prefs: &Preferences) -> Option<String> {
    let verbatim = || first_sentences(reply_text, 3).chars().take(MAX_RULE_HINT_CHARS).collect::<String>();
    match strategy {
        HintStrategy::Oracle => Some(oracle_hint(prefs)),
        _ if satisfied => None,
        HintStrategy::Verbatim => Some(verbatim()),
        HintStrategy::Instruction => Some(instruction_from(reply_text).unwrap_or_else(verbatim)),
    }
}

/// One hinted problem's teacher answer as token ids (the token sets of [`super::mass`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherAnswer {
    /// The problem's id.
    pub problem_id: i64,
    /// The teacher's prompt ids (the student's first message with the hint appended; generation prompt
    /// added).
    pub prompt_ids: Vec<u32>,
    /// The teacher's greedy answer ids (a final stop token included when it stopped on one).
    pub response_ids: Vec<u32>,
    /// The teacher's log-prob of each of its answer tokens (nats, temperature 1), same length.
    pub logprobs: Vec<f32>,
}

/// The teacher's greedy answers under `strategy`: for each `(problem, v0 answer)`, the student's reply to
/// the v0 answer gives the hint ([`hint_for`]); the teacher context is the student's first message with
/// the hint appended ([`teacher_messages`]); without a hint the answer is v0's own (no generation).
/// Returns the answers in problem order, per problem the hint used, and per hinted problem the teacher's
/// answer as token ids with its log-probs. `batch` prompts per generation call, at most `max_tokens`
/// tokens each.
///
/// # Errors
/// Model errors.
pub fn hinted_answers(
    lm: &LanguageModel,
    v0: &[(Problem, String)],
    student: &Student,
    strategy: HintStrategy,
    max_tokens: usize,
    batch: usize,
) -> Result<(Vec<(Problem, String)>, Vec<Option<String>>, Vec<TeacherAnswer>)> {
    let prefs = student.preferences();
    let hints: Vec<Option<String>> = v0
        .iter()
        .map(|(p, answer)| {
            let reply = student.reply_at(answer, p, 1);
            hint_for(strategy, &reply.text, reply.satisfied, prefs)
        })
        .collect();
    let todo: Vec<usize> = (0..v0.len()).filter(|&i| hints[i].is_some()).collect();
    let chats: Vec<Vec<Message>> =
        todo.iter().map(|&i| teacher_messages(&[Message::text("user", student.first_message(&v0[i].0))], hints[i].as_deref().unwrap_or_default())).collect();
    let mut out: Vec<(Problem, String)> = v0.to_vec();
    let mut ids = Vec::with_capacity(todo.len());
    for (&i, (prompt_ids, g)) in todo.iter().zip(crate::demo::heldout::greedy_chat(lm, &chats, max_tokens, batch)?) {
        out[i].1 = g.text;
        ids.push(TeacherAnswer { problem_id: v0[i].0.id as i64, prompt_ids, response_ids: g.token_ids, logprobs: g.logprobs });
    }
    Ok((out, hints, ids))
}

/// The hint-conditioned teacher's score on the held-out problems under one hint strategy
/// (module docs), as the ablation's markers keep it (`work/state/base-eval.json`, `work/online/teacher.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TeacherEval {
    /// The hint strategy.
    pub(crate) strategy: HintStrategy,
    /// The teacher's score (greedy answers, the student's checker).
    pub(crate) score: crate::demo::Score,
    /// Problems that got a hint (the others keep v0's answer).
    pub(crate) hinted: usize,
    /// Up to three (hint, teacher answer) examples, for the report.
    pub(crate) examples: Vec<(String, String)>,
    /// The hinted problems' teacher answers as token ids (those whose v0 answer has token ids), for the
    /// instruction strategy of an offline ablation ([`super::mass`]'s teacher-answer sets; empty
    /// otherwise).
    #[serde(default)]
    pub(crate) answers: Vec<TeacherAnswer>,
    /// Whether `answers` was computed (false in markers written before it existed: then the teacher
    /// is evaluated again).
    #[serde(default)]
    pub(crate) answers_kept: bool,
    /// Per entry of `answers`, the teacher's log-probs (nats) of v0's greedy answer to that problem
    /// under the same hinted prompt (one per v0 response token).
    #[serde(default)]
    pub(crate) v0_logprobs: Vec<Vec<f32>>,
    /// Seconds the evaluation took.
    pub(crate) seconds: f64,
}

/// Per problem id, v0's greedy answer as token ids: `(problem id, prompt ids, response ids)`.
pub(crate) type V0Ids = [(i64, Vec<u32>, Vec<u32>)];

/// The teacher evaluated under every hint strategy ([`HintStrategy::ALL`], in that order) on `v0`'s
/// answers (`(problem, v0's answer)`, as [`hinted_answers`] takes them): per strategy its greedy answers'
/// score by the student's checker, the problems hinted, up to three (hint, answer) examples and the
/// seconds it took. With `v0_ids` (`(v0's ids per problem, scoring batch)`; the offline ablation) the
/// instruction strategy also keeps its answers as token ids, for the problems whose v0 answer has ids,
/// and the teacher's log-probs of v0's answers under the same hinted prompts (nats, one per v0 response
/// token; [`super::mass`]'s teacher sets); without, those stay empty (the online ablation). `stop` is
/// read before each strategy.
///
/// # Errors
/// Model errors; [`crate::Error::Cancelled`] when `stop` was requested.
pub(crate) fn evaluate(
    lm: &LanguageModel,
    v0: &[(Problem, String)],
    student: &Student,
    max_tokens: usize,
    batch: usize,
    v0_ids: Option<(&V0Ids, usize)>,
    stop: &crate::runtime::Stop,
) -> Result<Vec<TeacherEval>> {
    let mut out = vec![];
    for strategy in HintStrategy::ALL {
        if stop.requested() {
            return Err(crate::Error::Cancelled);
        }
        let t = std::time::Instant::now();
        let (texts, hints, mut ids) = hinted_answers(lm, v0, student, strategy, max_tokens, batch)?;
        let mut v0_logprobs = vec![];
        let answers_kept = strategy == HintStrategy::Instruction && v0_ids.is_some();
        match v0_ids.filter(|_| answers_kept) {
            Some((v0_ids, score_batch)) => {
                ids.retain(|a| v0_ids.iter().any(|(id, _, r)| *id == a.problem_id && !r.is_empty()));
                let pairs: Vec<(Vec<u32>, Vec<u32>)> =
                    ids.iter().filter_map(|a| v0_ids.iter().find(|(id, ..)| *id == a.problem_id).map(|(_, _, r)| (a.prompt_ids.clone(), r.clone()))).collect();
                for chunk in pairs.chunks(score_batch.max(1)) {
                    v0_logprobs.extend(lm.score(chunk, 0)?.into_iter().map(|s| s.logprobs));
                }
            }
            None => ids.clear(),
        }
        let examples = hints.iter().zip(&texts).filter_map(|(h, (_, a))| h.clone().map(|h| (h, a.clone()))).take(3).collect();
        let score = crate::demo::personalization_score(&texts, student.preferences());
        let e = TeacherEval { strategy, score, hinted: hints.iter().filter(|h| h.is_some()).count(), examples, seconds: t.elapsed().as_secs_f64(), answers: ids, answers_kept, v0_logprobs };
        eprintln!("[ablate] teacher with {} hints ({} of {} problems hinted): personalization score {:.3} ({:.0} s)", strategy.as_str(), e.hinted, texts.len(), e.score.fraction_all_satisfied, e.seconds);
        out.push(e);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oracle_names_every_enabled_preference() {
        let prefs = Preferences { correct_answer: false, ..Preferences::default() };
        assert_eq!(
            oracle_hint(&prefs),
            "Do not use markdown: no bold or italics, headers, lists, LaTeX or code blocks. Use at most 80 words. Write casual plain \
             sentences without labels such as \"Step 1:\" or \"Answer:\". State the final number in the last sentence."
        );
        let only = Preferences { no_markdown: false, plain_sentences: false, answer_at_end: false, correct_answer: false, max_words: 50, ..Preferences::default() };
        assert_eq!(oracle_hint(&only), "Use at most 50 words.");
    }

    #[test]
    fn hints_per_strategy() {
        let prefs = Preferences::default();
        let reply = "ugh, no bold text, just write it out like a normal message instead.";
        assert_eq!(hint_for(HintStrategy::Verbatim, reply, false, &prefs).as_deref(), Some(reply));
        assert_eq!(hint_for(HintStrategy::Instruction, reply, false, &prefs).as_deref(), Some("Do not use bold text. Write it out like a normal message."));
        assert_eq!(hint_for(HintStrategy::Oracle, reply, false, &prefs), Some(oracle_hint(&prefs)));
        // A satisfied student gives no hint, except to the oracle.
        assert_eq!(hint_for(HintStrategy::Instruction, "thanks!", true, &prefs), None);
        assert_eq!(hint_for(HintStrategy::Verbatim, "thanks!", true, &prefs), None);
        assert!(hint_for(HintStrategy::Oracle, "thanks!", true, &prefs).is_some());
        // Nothing to rewrite: the instruction strategy falls back to the verbatim hint.
        assert_eq!(hint_for(HintStrategy::Instruction, "it reads like a textbook.", false, &prefs).as_deref(), Some("it reads like a textbook."));
    }
}
