//! The personal-agent demo's environment (docs/method.md §7): GSM8K homework problems, a rule-based simulated
//! **student** with hidden preferences who replies like a person, the **personalization score** and the
//! demo report.
//!
//! The paper's personal-agent experiment has a student who wants homework answers that don't look
//! AI-written; the agent learns those preferences from the student's replies (the next states). This module
//! is a fixed, documented stand-in for that student: deterministic given a seed, never tuned to a result.
//!
//! - [`load_gsm8k`] reads `data/gsm8k_test.json` (1,319 problems, see `data/README.md`);
//!   [`split_problems`] splits them into held-out evaluation and training problems by a seeded permutation.
//! - [`student`]: the preferences, [`student::check`] (the verdict on one response) and [`student::Student`]
//!   (first messages and replies: corrections, "that's wrong", thanks).
//! - [`score`]: [`score::personalization_score`] (fraction of responses meeting all preferences, per-preference
//!   rates) and the `eval_scores` rows ([`crate::schema::EvalScore`]).
//! - [`report`]: `report.md` and `personalization.png` (charts from [`crate::report`]).

pub mod fleet;
pub mod heldout;
pub mod memory;
pub mod prm_eval;
mod problems;
pub mod report;
pub mod run;
pub mod score;
pub mod sessions;
pub mod student;

pub use problems::{canonical_answer, default_gsm8k_path, load_gsm8k, parse_number, same_number, split_problems, EvalSplit, Problem, Split};
pub use report::{write_report, CheckpointEval, DemoReport, ReportFiles, TimeRow, TimeTable};
pub use score::{eval_rows, personalization_score, Score};
pub use student::{check, Preference, Preferences, Student, StudentReply, Verdict, Violation, ViolationKind};

#[cfg(test)]
mod tests;
