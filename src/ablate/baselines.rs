//! Baselines without training, evaluated on the same held-out problems as every arm: what a team could
//! do instead of training, and so what training has to beat.
//!
//! | baseline | the initial weights answer with |
//! |---|---|
//! | `prompted` | the student's preferences written in the system prompt ([`prompted_system`], the same words as the oracle hint, [`super::teacher_eval::oracle_hint`]): the in-context bound |
//! | `memory` | the accepted hints of the training interactions accumulated into the system prompt, newest first, deduplicated, at most [`MEMORY_TOKENS`] tokens ([`memory_system`]): what a Mem0-style memory does, and what the paper's second version compares with |
//!
//! Both answer greedily (as every evaluated version) and are scored by the student's checker.

use crate::demo::{Preferences, Problem, Student};
use crate::error::Result;
use crate::model::LanguageModel;
use crate::schema::Message;

/// Most tokens of remembered hints in the `memory` baseline's system prompt.
pub const MEMORY_TOKENS: usize = 256;

/// The `prompted` baseline's system prompt: "The user has these preferences for every answer: " and the
/// oracle hint.
pub fn prompted_system(prefs: &Preferences) -> String {
    format!("The user has these preferences for every answer: {}", super::teacher_eval::oracle_hint(prefs))
}

/// The `memory` baseline's system prompt from `hints` (accepted hints in the order they were given,
/// oldest first): the newest first, each once (exact text after trimming, case-insensitive), as long as
/// the list stays within `cap_tokens` tokens counted by `tokens`; `None` without any hint that fits.
/// The kept hints are listed oldest first under "Notes from earlier conversations with this user:".
pub fn memory_system(hints: &[String], cap_tokens: usize, tokens: impl Fn(&str) -> usize) -> Option<String> {
    let mut kept: Vec<&str> = vec![];
    let mut used = 0;
    for h in hints.iter().rev().map(|h| h.trim()).filter(|h| !h.is_empty()) {
        if kept.iter().any(|k| k.eq_ignore_ascii_case(h)) {
            continue;
        }
        let n = tokens(&format!("- {h}\n"));
        if used + n > cap_tokens {
            break;
        }
        used += n;
        kept.push(h);
    }
    if kept.is_empty() {
        return None;
    }
    kept.reverse();
    Some(format!("Notes from earlier conversations with this user:\n{}", kept.iter().map(|h| format!("- {h}")).collect::<Vec<_>>().join("\n")))
}

/// Greedy answers to the student's first message about each problem with `system` as the system prompt,
/// `batch` problems per generation call, at most `max_tokens` tokens each, in problem order.
///
/// # Errors
/// Model errors.
pub fn answers_with_system(lm: &LanguageModel, problems: &[Problem], student: &Student, system: &str, max_tokens: usize, batch: usize) -> Result<Vec<(Problem, String)>> {
    let chats: Vec<Vec<Message>> = problems.iter().map(|p| vec![Message::text("system", system), Message::text("user", student.first_message(p))]).collect();
    let gens = crate::demo::heldout::greedy_chat(lm, &chats, max_tokens, batch)?;
    Ok(problems.iter().zip(gens).map(|(p, (_, g))| (p.clone(), g.text)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    #[test]
    fn memory_keeps_the_newest_distinct_hints_within_the_cap() {
        let hints: Vec<String> = ["Keep it short.", "Do not use bold text.", "keep it short.", "Put the final number at the end."].map(String::from).to_vec();
        // Newest first: "- Put ..." (8 words), "- keep it short." (4), "- Do not use bold text." (6) = 18.
        assert_eq!(
            memory_system(&hints, 18, words).as_deref(),
            Some("Notes from earlier conversations with this user:\n- Do not use bold text.\n- keep it short.\n- Put the final number at the end.")
        );
        // A cap of 12 keeps the two newest; the older "Keep it short." is a duplicate either way.
        assert_eq!(memory_system(&hints, 12, words).as_deref(), Some("Notes from earlier conversations with this user:\n- keep it short.\n- Put the final number at the end."));
        assert_eq!(memory_system(&hints, 7, words), None);
        assert_eq!(memory_system(&[], 100, words), None);
    }

    #[test]
    fn prompted_names_the_preferences() {
        let prefs = Preferences { no_markdown: false, plain_sentences: false, answer_at_end: false, correct_answer: false, max_words: 50, ..Preferences::default() };
        assert_eq!(prompted_system(&prefs), "The user has these preferences for every answer: Use at most 50 words.");
    }
}
