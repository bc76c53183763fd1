//! Baselines without training, evaluated on the same held-out problems as every arm: what a team could
//! do instead of training, and so what training has to beat.
//!
//! | baseline | the initial weights answer with |
//! |---|---|
//! | `prompted` | the student's preferences written in the system prompt ([`prompted_system`], the same words as the oracle hint, [`super::teacher_eval::oracle_hint`]): the in-context bound |
//! | `memory` | the accepted hints of the training interactions accumulated into the system prompt, newest first, deduplicated, at most [`MEMORY_TOKENS`] tokens ([`memory_system`]): what a Mem0-style memory does, and what the paper's second version compares with |
//!
//! Both answer greedily (as every evaluated version) and are scored by the student's checker.

use serde::{Deserialize, Serialize};

use crate::demo::{Preferences, Problem, Student};
use crate::error::Result;
use crate::model::LanguageModel;
use crate::schema::Message;

pub use crate::demo::memory::{memory_system, MEMORY_TOKENS};

/// The `prompted` baseline's system prompt: "The user has these preferences for every answer: " and the
/// oracle hint.
pub fn prompted_system(prefs: &Preferences) -> String {
    format!("The user has these preferences for every answer: {}", super::teacher_eval::oracle_hint(prefs))
}

/// A baseline as an arm of the online mode (`baseline = "prompted"` or `"memory"` in an `[[arms]]`
/// entry; [`super::online`]): the initial weights serve the student with the baseline's system prompt
/// and no weight changes; at the end they answer the held-out problems with it. Offline, both
/// baselines are evaluated beside every run without being arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Baseline {
    /// The student's preferences in the system prompt ([`prompted_system`]).
    Prompted,
    /// The hints accepted so far in the system prompt ([`memory_system`], at most [`MEMORY_TOKENS`]
    /// tokens); the pipeline judges and extracts hints as for a trained arm, but nothing trains.
    Memory,
}

impl Baseline {
    /// `prompted` or `memory`.
    pub fn as_str(self) -> &'static str {
        match self {
            Baseline::Prompted => "prompted",
            Baseline::Memory => "memory",
        }
    }
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

    #[test]
    fn prompted_names_the_preferences() {
        let prefs = Preferences { no_markdown: false, plain_sentences: false, answer_at_end: false, correct_answer: false, max_words: 50, ..Preferences::default() };
        assert_eq!(prompted_system(&prefs), "The user has these preferences for every answer: Use at most 50 words.");
    }
}
