//! GSM8K homework problems: [`load_gsm8k`], the held-out/training [`split_problems`] (or a validation
//! split instead of the held-out problems, [`Split::evaluated_on`]), and how answers are read as numbers
//! ([`parse_number`], [`same_number`], [`canonical_answer`]).

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::{input_err, Error, Result};

/// One homework problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// 0-based index of the problem in its file (stable across runs: the `eval_scores.problem_id`).
    pub id: usize,
    /// The question text, as in the file.
    pub question: String,
    /// The final answer as a plain number in text: thousands separators, `$` and a trailing `.0` removed
    /// (`"65,960"` → `"65960"`), sign kept (`"-3"`).
    pub answer: String,
}

/// A number as written in a text (`1,234`, `1234.0`, `$1234`, `-3`, `12.50`) parsed to `f64`: `$`, thousands
/// commas and surrounding whitespace are ignored. `None` when what is left is not a finite decimal number.
pub fn parse_number(text: &str) -> Option<f64> {
    let t: String = text.trim().chars().filter(|c| !matches!(c, ',' | '$')).collect();
    let t = t.trim();
    // Only plain decimals: `f64::from_str` would also take "inf", "NaN" and "1e5".
    let body = t.strip_prefix('-').unwrap_or(t);
    if body.is_empty() || !body.chars().all(|c| c.is_ascii_digit() || c == '.') || body.starts_with('.') {
        return None;
    }
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Whether two numbers are the same answer: equal up to 1e-6 relative (at least 1e-6 absolute), so
/// `1234` = `1234.0` and `0.1 + 0.2` = `0.3`.
pub fn same_number(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// The canonical text of an answer: the number without `$`, commas or a zero fraction (`"1,234.00"` →
/// `"1234"`, `"2.50"` → `"2.5"`). `None` when `text` is not a number ([`parse_number`]).
pub fn canonical_answer(text: &str) -> Option<String> {
    let v = parse_number(text)?;
    let t: String = text.trim().chars().filter(|c| !matches!(c, ',' | '$' | ' ')).collect();
    Some(if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else if t.contains('.') {
        t.trim_end_matches('0').to_string()
    } else {
        t
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProblem {
    question: String,
    ground_truth_answer: String,
}

/// Reads GSM8K problems from a JSON array of `{question, ground_truth_answer}` (the shape of
/// `data/gsm8k_test.json`). `ground_truth_answer` may be the bare final number or a full GSM8K rationale
/// ending in `#### <number>` (the text after the last `####` is taken); it is stored canonically
/// ([`canonical_answer`]). Ids are the 0-based positions in the array.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Json`] when it is not such an array;
/// [`Error::InvalidInput`] naming the index when a question is empty or an answer is not a number.
pub fn load_gsm8k(path: impl AsRef<Path>) -> Result<Vec<Problem>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io("read", path, e))?;
    let raw: Vec<RawProblem> = serde_json::from_slice(&bytes)?;
    raw.into_iter()
        .enumerate()
        .map(|(id, r)| {
            let final_part = r.ground_truth_answer.rsplit("####").next().unwrap_or_default();
            let answer = canonical_answer(final_part).ok_or_else(|| {
                input_err!("{}: problem {id}: ground_truth_answer {:?} is not a number", path.display(), r.ground_truth_answer)
            })?;
            if r.question.trim().is_empty() {
                return Err(input_err!("{}: problem {id}: empty question", path.display()));
            }
            Ok(Problem { id, question: r.question, answer })
        })
        .collect()
}

/// Held-out evaluation problems and training problems, disjoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Held-out problems: only ever asked in evaluation, never while training.
    pub eval: Vec<Problem>,
    /// Problems the student works through while the pipeline trains.
    pub train: Vec<Problem>,
}

/// Splits `problems` by a seeded permutation (rand 0.8 `StdRng::seed_from_u64(seed)`, Fisher–Yates
/// shuffle): the first `n_eval` of the permutation are held out, the rest are training problems, each part
/// in permutation order. The same seed always gives the same split; the parts never overlap and together
/// hold every problem once.
///
/// # Errors
/// [`Error::Config`] when `n_eval` exceeds the number of problems.
pub fn split_problems(problems: &[Problem], n_eval: usize, seed: u64) -> Result<Split> {
    if n_eval > problems.len() {
        return Err(Error::Config(format!("{n_eval} evaluation problems requested but only {} exist", problems.len())));
    }
    let mut order: Vec<usize> = (0..problems.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let pick = |ix: &[usize]| ix.iter().map(|&i| problems[i].clone()).collect::<Vec<_>>();
    Ok(Split { eval: pick(&order[..n_eval]), train: pick(&order[n_eval..]) })
}

/// Which problems a run is evaluated on (`nextstate demo --eval-split`, an ablation's `[eval] split`).
///
/// A recipe (learning rate, weights, steps) chosen by its score on the problems a result is then reported
/// on overstates that result. `Validation` gives the choice its own problems: the evaluation moves to the
/// first `n_eval` training problems of the split, training draws from the training problems after them,
/// and the test problems are left out of the run entirely (neither trained on nor evaluated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EvalSplit {
    /// The held-out test problems ([`Split::eval`]): the reported result.
    #[default]
    Test,
    /// A validation split: the first `n_eval` of [`Split::train`], for choosing a recipe.
    Validation,
}

impl EvalSplit {
    /// What a report adds after "… held-out problems": nothing for `Test`; for `Validation` that they are
    /// a validation split and the test problems were not used.
    pub fn report_note(self) -> &'static str {
        match self {
            EvalSplit::Test => "",
            EvalSplit::Validation => " of a validation split (training problems set aside for choosing a recipe; the test problems were neither trained on nor evaluated)",
        }
    }

    /// Whether this is the default (`Test`); configuration hashes leave the default out, so runs made
    /// before the option existed keep their keys.
    pub fn is_test(&self) -> bool {
        *self == EvalSplit::Test
    }
}

impl Split {
    /// The split a run evaluated on `on` uses: `self` for [`EvalSplit::Test`]; for
    /// [`EvalSplit::Validation`] the first `self.eval.len()` training problems become the evaluation
    /// problems and the rest stay training problems, in order (the test problems are dropped from the
    /// run). The training problems that follow the validation ones are the same in both modes, shifted:
    /// a validation run never trains on a problem it is evaluated on, and never sees a test problem.
    ///
    /// # Errors
    /// [`Error::Config`] when there are fewer training problems than evaluation problems.
    pub fn evaluated_on(self, on: EvalSplit) -> Result<Split> {
        match on {
            EvalSplit::Test => Ok(self),
            EvalSplit::Validation => {
                let n = self.eval.len();
                if self.train.len() < n {
                    return Err(Error::Config(format!("a validation split of {n} problems needs at least {n} training problems; there are {}", self.train.len())));
                }
                let mut train = self.train;
                let rest = train.split_off(n);
                Ok(Split { eval: train, train: rest })
            }
        }
    }
}

/// Path of the GSM8K test file shipped with the crate (`<crate root>/data/gsm8k_test.json`).
pub fn default_gsm8k_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join("gsm8k_test.json")
}
