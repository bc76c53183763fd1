//! Parsing a judge's answer and aggregating votes (docs/method.md §2).

use std::sync::OnceLock;

use regex::Regex;

/// `\boxed{d}` with d an optionally signed single ASCII digit. Whitespace (ASCII spaces, tabs,
/// newlines) is allowed between the braces and the value (`\boxed{ 1 }`, `\boxed{ -1}`), not between
/// the sign and the digit (`\boxed{- 1}` is no match). `\boxed{10}` and `\boxed{1.0}` are no match.
fn boxed_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // A constant pattern, checked by every test below.
    RE.get_or_init(|| Regex::new(r"\\boxed\{[ \t\r\n]*([+-]?[0-9])[ \t\r\n]*\}").expect("constant regex"))
}

/// The signed digit of the **last** `\boxed{d}` in `text` (docs/method.md §2), before the range check;
/// `None` when there is no such box. See [`parse_vote`] for the accepted forms.
pub fn last_boxed_digit(text: &str) -> Option<i32> {
    let caps = boxed_re().captures_iter(text).last()?;
    // The capture is at most a sign and one ASCII digit: always parses.
    caps.get(1)?.as_str().parse::<i32>().ok()
}

/// A whole answer that is only a grade: an optionally signed single ASCII digit, with surrounding
/// whitespace and one trailing `.`, `,` or `!` allowed (`1`, `-1`, `1,`, ` 0.`). What small judges
/// (Qwen2.5-Coder-0.5B-Instruct) answer instead of reasoning and boxing: 16 of its first 18 votes on
/// the demo's turns were `1`, `1,`, `-0`, `0` or `-1` alone, and none had a box (docs/prm-eval). A
/// list of grades (`1, 0`, 2 of the 18) stays unusable.
fn bare_grade(text: &str) -> Option<i32> {
    let t = text.trim();
    let t = t.strip_suffix(['.', ',', '!']).unwrap_or(t).trim_end();
    let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
    (digits.len() == 1 && digits.as_bytes()[0].is_ascii_digit()).then(|| t.parse::<i32>().ok()).flatten()
}

/// Parses one judge vote: the value of the last `\boxed{d}` if it is 1, 0 or −1; without any box, an
/// answer that is only a grade ([`bare_grade`]: `1`, `-1`, `0.`) is read the same way.
///
/// Accepted: `\boxed{1}`, `\boxed{+1}`, `\boxed{0}`, `\boxed{-0}` (= 0), `\boxed{-1}`, each with optional
/// ASCII whitespace inside the braces. Only the last box counts, so `\boxed{-1} … \boxed{1}` is 1.
/// Not a box at all: `\boxed{10}`, `\boxed{1.0}`, `\boxed{- 1}`, `\boxed{−1}` (Unicode minus),
/// `boxed{1}` (no backslash).
///
/// # Errors
/// The reason the vote is invalid, as stored in `Vote.error`: no box, or the last box's value is
/// outside {1, 0, −1}.
pub fn parse_vote(text: &str) -> std::result::Result<i32, String> {
    match last_boxed_digit(text).or_else(|| bare_grade(text)) {
        None => Err("no \\boxed{d} with a single signed digit in the judge's answer".to_string()),
        Some(v @ (-1..=1)) => Ok(v),
        Some(v) => Err(format!("last \\boxed{{}} holds {v}, not one of 1, 0, -1")),
    }
}

/// The majority of a turn's votes (docs/method.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Majority {
    /// Majority score in {1, 0, −1}.
    pub score: i32,
    /// Number of valid votes.
    pub valid: i32,
    /// True when the top count is shared by two or more values (score forced to 0).
    pub tie: bool,
}

/// Majority of votes: invalid votes (`None`) are dropped; none left → 0; otherwise the most common
/// value, but a tie for the top count → 0 with `tie = true`. Values outside {1, 0, −1} are treated as
/// invalid. docs/method.md §2 examples: `[1,1,−1]`→1; `[1,−1,invalid]`→0 (tie); `[1,−1,0]`→0 (tie); `[0,0,1]`→0.
pub fn majority_vote(values: &[Option<i32>]) -> Majority {
    let mut counts = [0i32; 3]; // −1, 0, 1
    for v in values.iter().flatten() {
        if (-1..=1).contains(v) {
            counts[(v + 1) as usize] += 1;
        }
    }
    let valid: i32 = counts.iter().sum();
    let top = counts.iter().copied().max().unwrap_or(0);
    if valid == 0 {
        return Majority { score: 0, valid, tie: false };
    }
    let at_top = counts.iter().filter(|&&c| c == top).count();
    if at_top > 1 {
        return Majority { score: 0, valid, tie: true };
    }
    let score = counts.iter().position(|&c| c == top).map(|i| i as i32 - 1).unwrap_or(0);
    Majority { score, valid, tie: false }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn method_examples() {
        assert_eq!(majority_vote(&[Some(1), Some(1), Some(-1)]), Majority { score: 1, valid: 3, tie: false });
        assert_eq!(majority_vote(&[Some(1), Some(-1), None]), Majority { score: 0, valid: 2, tie: true });
        assert_eq!(majority_vote(&[Some(1), Some(-1), Some(0)]), Majority { score: 0, valid: 3, tie: true });
        assert_eq!(majority_vote(&[Some(0), Some(0), Some(1)]), Majority { score: 0, valid: 3, tie: false });
    }

    #[test]
    fn majority_edge_cases() {
        assert_eq!(majority_vote(&[]), Majority { score: 0, valid: 0, tie: false });
        assert_eq!(majority_vote(&[None, None, None]), Majority { score: 0, valid: 0, tie: false });
        assert_eq!(majority_vote(&[None, Some(-1), None]), Majority { score: -1, valid: 1, tie: false });
        assert_eq!(majority_vote(&[Some(-1), Some(-1), Some(1), Some(1), Some(0)]), Majority { score: 0, valid: 5, tie: true });
        assert_eq!(majority_vote(&[Some(-1), Some(-1), Some(1), Some(0)]), Majority { score: -1, valid: 4, tie: false });
        // Out-of-range values never count.
        assert_eq!(majority_vote(&[Some(2), Some(1)]), Majority { score: 1, valid: 1, tie: false });
    }

    #[test]
    fn parse_accepted_forms() {
        assert_eq!(parse_vote("so \\boxed{1}"), Ok(1));
        assert_eq!(parse_vote("\\boxed{+1}"), Ok(1));
        assert_eq!(parse_vote("\\boxed{0}"), Ok(0));
        assert_eq!(parse_vote("\\boxed{-0}"), Ok(0));
        assert_eq!(parse_vote("\\boxed{-1}"), Ok(-1));
        assert_eq!(parse_vote("\\boxed{ 1 }"), Ok(1));
        assert_eq!(parse_vote("\\boxed{\n-1\t}"), Ok(-1));
        assert_eq!(parse_vote("$\\boxed{1}$."), Ok(1));
    }

    /// Real answers of Qwen2.5-Coder-0.5B-Instruct to the judge prompt on the demo's turns
    /// (docs/prm-eval/judgments): a bare grade is read; a list of grades is not.
    #[test]
    fn bare_grades_of_a_small_judge() {
        for (raw, want) in [("1", 1), ("1,", 1), ("-0", 0), ("0", 0), ("-1", -1), (" +1.\n", 1), ("0!", 0)] {
            assert_eq!(parse_vote(raw), Ok(want), "{raw:?}");
        }
        assert_eq!(parse_vote("2"), Err("last \\boxed{} holds 2, not one of 1, 0, -1".into()));
        let no_box = Err("no \\boxed{d} with a single signed digit in the judge's answer".to_string());
        for raw in ["1, 0", "-1, 0", "1.0", "11", "- 1", "1..", "\u{2212}1", "grade: 1"] {
            assert_eq!(parse_vote(raw), no_box, "{raw:?}");
        }
        // A box still wins over a bare grade.
        assert_eq!(parse_vote("\\boxed{-1}"), Ok(-1));
    }

    #[test]
    fn parse_takes_the_last_box() {
        assert_eq!(parse_vote("\\boxed{-1} on reflection \\boxed{1}"), Ok(1));
        assert_eq!(parse_vote("\\boxed{1} \\boxed{0}"), Ok(0));
        // A later non-box does not hide an earlier box.
        assert_eq!(parse_vote("\\boxed{1} then \\boxed{10}"), Ok(1));
        // The last box out of range makes the vote invalid even after a valid one.
        assert_eq!(parse_vote("\\boxed{1} \\boxed{2}"), Err("last \\boxed{} holds 2, not one of 1, 0, -1".into()));
    }

    #[test]
    fn parse_rejections() {
        let no_box = Err("no \\boxed{d} with a single signed digit in the judge's answer".to_string());
        assert_eq!(parse_vote("The answer is 1."), no_box);
        assert_eq!(parse_vote(""), no_box);
        assert_eq!(parse_vote("\\boxed{10}"), no_box);
        assert_eq!(parse_vote("\\boxed{1.0}"), no_box);
        assert_eq!(parse_vote("\\boxed{- 1}"), no_box);
        assert_eq!(parse_vote("\\boxed{\u{2212}1}"), no_box);
        assert_eq!(parse_vote("boxed{1}"), no_box);
        assert_eq!(parse_vote("\\boxed{}"), no_box);
        assert_eq!(parse_vote("\\boxed{2}"), Err("last \\boxed{} holds 2, not one of 1, 0, -1".into()));
        assert_eq!(parse_vote("\\boxed{-9}"), Err("last \\boxed{} holds -9, not one of 1, 0, -1".into()));
    }

    proptest! {
        /// The majority is always in {−1, 0, 1}; it is non-zero only when that value has strictly the
        /// most votes; valid counts only the in-range values; order does not matter.
        #[test]
        fn majority_invariants(values in proptest::collection::vec(proptest::option::of(-2i32..=2), 0..12)) {
            let m = majority_vote(&values);
            let count = |x: i32| values.iter().filter(|v| **v == Some(x)).count() as i32;
            prop_assert_eq!(m.valid, count(-1) + count(0) + count(1));
            prop_assert!((-1..=1).contains(&m.score));
            if m.score != 0 {
                for other in [-1, 0, 1] {
                    if other != m.score { prop_assert!(count(m.score) > count(other)); }
                }
                prop_assert!(!m.tie);
            }
            let mut rev = values.clone();
            rev.reverse();
            prop_assert_eq!(majority_vote(&rev), m);
        }
    }
}
