//! The personalization score (docs/method.md §7): the fraction of held-out responses that meet **all** of the
//! student's preferences, with each preference's own satisfaction rate, and the `eval_scores` rows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::problems::Problem;
use super::student::{check, Preference, Preferences, Verdict};
use crate::schema::{EvalScore, Table};

/// Scores of one set of responses (one policy version on the held-out problems).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Number of responses scored.
    pub n: usize,
    /// Fraction (0–1) of responses meeting every enabled preference: the personalization score.
    /// 0 when `n` is 0.
    pub fraction_all_satisfied: f64,
    /// Per enabled preference (by [`Preference::name`]): the fraction (0–1) of responses meeting it.
    pub per_preference_rate: BTreeMap<String, f64>,
    /// Fraction (0–1) of responses whose last number is the answer (GSM8K accuracy).
    pub accuracy: f64,
}

fn rate(k: usize, n: usize) -> f64 {
    if n == 0 {
        0.0
    } else {
        k as f64 / n as f64
    }
}

impl Score {
    /// The score of verdicts already computed with `prefs` ([`check`]).
    pub fn from_verdicts(verdicts: &[Verdict], prefs: &Preferences) -> Score {
        let n = verdicts.len();
        let per_preference_rate = prefs
            .enabled()
            .into_iter()
            .map(|p| (p.name().to_string(), rate(verdicts.iter().filter(|v| v.meets(p)).count(), n)))
            .collect();
        Score {
            n,
            fraction_all_satisfied: rate(verdicts.iter().filter(|v| v.satisfied).count(), n),
            per_preference_rate,
            accuracy: rate(verdicts.iter().filter(|v| v.correct).count(), n),
        }
    }

    /// The score of stored `eval_scores` rows (one policy version's): a preference is met by a row when
    /// none of its violations starts with `<preference name>: `. Rates are over `prefs`' enabled preferences.
    pub fn from_rows(rows: &[EvalScore], prefs: &Preferences) -> Score {
        let n = rows.len();
        let meets = |r: &EvalScore, p: Preference| {
            let tag = format!("{}: ", p.name());
            !r.violations.iter().any(|v| v.starts_with(&tag))
        };
        let per_preference_rate = prefs
            .enabled()
            .into_iter()
            .map(|p| (p.name().to_string(), rate(rows.iter().filter(|r| meets(r, p)).count(), n)))
            .collect();
        Score {
            n,
            fraction_all_satisfied: rate(rows.iter().filter(|r| r.satisfied).count(), n),
            per_preference_rate,
            accuracy: rate(rows.iter().filter(|r| r.correct).count(), n),
        }
    }
}

/// The personalization score of `(problem, response)` pairs under `prefs`: every response is
/// [`check`]ed; the score is the fraction meeting all enabled preferences (docs/method.md §7; the paper reports
/// this fraction on held-out problems). Empty input gives `n = 0` and zero rates.
pub fn personalization_score(responses: &[(Problem, String)], prefs: &Preferences) -> Score {
    let verdicts: Vec<Verdict> = responses.iter().map(|(p, r)| check(r, p, prefs)).collect();
    Score::from_verdicts(&verdicts, prefs)
}

/// The `eval_scores` rows of one policy version: one per `(problem, response)`, in input order, each with
/// the [`check`] verdict (violations as [`super::Violation::tagged`]) and `eval_time` = `time_ms`.
pub fn eval_rows(
    run_id: &str,
    arm: &str,
    policy_version: i64,
    interactions_seen: i64,
    responses: &[(Problem, String)],
    prefs: &Preferences,
    time_ms: i64,
) -> Vec<EvalScore> {
    responses
        .iter()
        .map(|(p, r)| {
            let v = check(r, p, prefs);
            let problem_id = p.id as i64;
            EvalScore {
                schema_version: EvalScore::SCHEMA_VERSION,
                eval_id: EvalScore::id_for(run_id, arm, policy_version, problem_id),
                run_id: run_id.to_string(),
                tenant: None,
                arm: arm.to_string(),
                policy_version,
                interactions_seen,
                problem_id,
                response_text: r.clone(),
                satisfied: v.satisfied,
                violations: v.violations.iter().map(|x| x.tagged()).collect(),
                correct: v.correct,
                eval_time: time_ms,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::field_refs;

    fn p(id: usize, answer: &str) -> Problem {
        Problem { id, question: format!("question {id}"), answer: answer.into() }
    }

    fn four() -> Vec<(Problem, String)> {
        vec![
            // meets everything
            (p(0, "36"), "They need 36 more.".into()),
            // bold only (answer right and at the end)
            (p(1, "5"), "It is **5**.".into()),
            // wrong answer only
            (p(2, "7"), "It is 8.".into()),
            // bold + label + too long (90 words) + wrong
            (p(3, "9"), format!("**Answer:** {}10", "x ".repeat(88))),
        ]
    }

    #[test]
    fn score_arithmetic() {
        let s = personalization_score(&four(), &Preferences::default());
        assert_eq!(s.n, 4);
        assert_eq!(s.fraction_all_satisfied, 0.25);
        assert_eq!(s.accuracy, 0.5);
        let want: BTreeMap<String, f64> = [
            ("no_markdown", 0.5),      // 1 and 3 use bold
            ("concise", 0.75),         // 3 is 90 words
            ("plain_sentences", 0.75), // 3 has a label
            ("answer_at_end", 1.0),    // every last number is in the last sentence
            ("correct_answer", 0.5),   // 2 and 3 are wrong
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(s.per_preference_rate, want);
    }

    #[test]
    fn disabled_preferences_are_not_rated() {
        let prefs = Preferences { no_markdown: false, correct_answer: false, ..Preferences::default() };
        let s = personalization_score(&four(), &prefs);
        assert_eq!(s.fraction_all_satisfied, 0.75);
        assert_eq!(s.per_preference_rate.keys().collect::<Vec<_>>(), vec!["answer_at_end", "concise", "plain_sentences"]);
        assert_eq!(s.accuracy, 0.5);
    }

    #[test]
    fn empty_input() {
        let s = personalization_score(&[], &Preferences::default());
        assert_eq!((s.n, s.fraction_all_satisfied, s.accuracy), (0, 0.0, 0.0));
        assert!(s.per_preference_rate.values().all(|v| *v == 0.0));
    }

    #[test]
    fn rows_carry_the_verdict_and_rescore_the_same() {
        let rows = eval_rows("run1", "combined", 3, 36, &four(), &Preferences::default(), 1_700_000_000_000);
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[1].violations, vec!["no_markdown: bold text: `**5**`".to_string()]);
        assert_eq!(rows[2].violations, vec!["correct_answer: wrong answer: last number is 8, expected 7".to_string()]);
        assert!(rows[0].satisfied && rows[0].correct && rows[0].violations.is_empty());
        assert_eq!((rows[3].policy_version, rows[3].interactions_seen, rows[3].problem_id), (3, 36, 3));
        assert_eq!(rows[0].eval_id, EvalScore::id_for("run1", "combined", 3, 0));
        assert_ne!(rows[0].eval_id, EvalScore::id_for("run1", "binary", 3, 0));
        assert_ne!(rows[0].eval_id, EvalScore::id_for("run1", "combined", 4, 0));
        assert_eq!(rows[0].eval_id.len(), 32);
        assert_eq!(Score::from_rows(&rows, &Preferences::default()), personalization_score(&four(), &Preferences::default()));
        // Arrow round trip with the table's schema.
        let batch = serde_arrow::to_record_batch(&field_refs::<EvalScore>(), &rows).unwrap();
        assert_eq!(batch.num_rows(), 4);
        let back: Vec<EvalScore> = serde_arrow::from_record_batch(&batch).unwrap();
        assert_eq!(back, rows);
    }

    #[test]
    fn checked_in_schema_matches_the_code() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/eval_scores.json");
        let file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(file, crate::schema::schema_json(&crate::schema::schema_of::<EvalScore>()));
        assert_eq!(file["primary_key"], "eval_id");
    }
}
