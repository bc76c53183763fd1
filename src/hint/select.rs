//! Parsing a hint vote and choosing the hint of a turn (docs/method.md §3).

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::judge::last_boxed_digit;
use crate::schema::HintCandidate;

/// How the hint of a turn is chosen among its votes (`strategy` in the `[hint]` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Among votes with score 1 and a hint longer than `min_hint_chars`, the longest (the reference's
    /// rule; the default). Ties: the lowest vote index.
    #[default]
    Longest,
    /// Same candidates, the shortest. Ties: the lowest vote index.
    Shortest,
    /// Only when a strict majority of the valid votes scores 1; then the longest.
    MajorityGated,
}

impl Strategy {
    /// `longest`, `shortest` or `majority-gated`, as stored in `hints.strategy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Longest => "longest",
            Strategy::Shortest => "shortest",
            Strategy::MajorityGated => "majority-gated",
        }
    }
}

/// A parsed hint vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHint {
    /// 1 or −1; `None` when the vote is invalid.
    pub score: Option<i32>,
    /// The last `[HINT_START]…[HINT_END]` block, trimmed; `None` when absent or blank.
    pub hint: Option<String>,
    /// Why the score is invalid, if it is.
    pub error: Option<String>,
}

fn hint_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // A constant pattern, checked by the tests below.
    RE.get_or_init(|| Regex::new(r"(?s)\[HINT_START\](.*?)\[HINT_END\]").expect("constant regex"))
}

/// The hint: the last `[HINT_START]…[HINT_END]` block (non-greedy, scanning left to right, so
/// `[HINT_START] a [HINT_START] b [HINT_END]` yields `a [HINT_START] b`), trimmed; `None` when there is
/// no complete block or it is blank.
pub fn last_hint_block(raw: &str) -> Option<String> {
    let caps = hint_re().captures_iter(raw).last()?;
    let h = caps.get(1)?.as_str().trim();
    (!h.is_empty()).then(|| h.to_string())
}

/// Parses one hint vote: the score is the last `\boxed{d}` as for PRM votes
/// ([`crate::judge::parse_vote`]) but only 1 and −1 are accepted; the hint is [`last_hint_block`]
/// (kept whatever the score; selection only looks at score-1 votes).
pub fn parse_hint_vote(raw: &str) -> ParsedHint {
    let hint = last_hint_block(raw);
    let (score, error) = match last_boxed_digit(raw) {
        None => (None, Some("no \\boxed{d} with a single signed digit in the answer".to_string())),
        Some(v @ (1 | -1)) => (Some(v), None),
        Some(v) => (None, Some(format!("last \\boxed{{}} holds {v}; a hint vote must be 1 or -1"))),
    };
    ParsedHint { score, hint, error }
}

/// The outcome of hint selection for one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Index of the chosen vote.
    pub chosen_index: Option<i32>,
    /// The chosen hint.
    pub chosen_hint: Option<String>,
    /// Human-readable reason, e.g. `3 valid votes, 2 accepted, chose vote 1 (longest, 84 chars)`.
    pub reason: String,
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Chooses a turn's hint by `strategy`. A vote is *accepted* when its score is 1 and its hint has
/// more than `min_hint_chars` characters (Unicode scalar values; the reference uses 10).
pub fn select_hint(strategy: Strategy, candidates: &[HintCandidate], min_hint_chars: usize) -> Selection {
    let valid = candidates.iter().filter(|c| c.score.is_some()).count();
    let positive = candidates.iter().filter(|c| c.score == Some(1)).count();
    let accepted: Vec<(i32, &str, usize)> = candidates
        .iter()
        .filter(|c| c.score == Some(1))
        .filter_map(|c| c.hint.as_deref().map(|h| (c.index, h, h.chars().count())))
        .filter(|(_, _, n)| *n > min_hint_chars)
        .collect();
    let head = format!("{}, {} accepted", plural(valid, "valid vote", "valid votes"), accepted.len());
    let none = |reason: String| Selection { chosen_index: None, chosen_hint: None, reason };
    if strategy == Strategy::MajorityGated && 2 * positive <= valid {
        return none(format!(
            "{}, {} with score 1: no majority for a hint (majority-gated)",
            plural(valid, "valid vote", "valid votes"),
            positive
        ));
    }
    // min_by_key / max_by_key return the last of equal elements for max; fold keeps the first.
    let pick = accepted.iter().fold(None::<&(i32, &str, usize)>, |best, c| match best {
        None => Some(c),
        Some(b) => {
            let better = match strategy {
                Strategy::Shortest => c.2 < b.2,
                Strategy::Longest | Strategy::MajorityGated => c.2 > b.2,
            };
            Some(if better { c } else { b })
        }
    });
    match pick {
        None => none(format!("{head}: no vote with score 1 and a hint > {min_hint_chars} chars")),
        Some(&(index, hint, n)) => {
            let rule = match strategy {
                Strategy::Shortest => "shortest",
                Strategy::Longest => "longest",
                Strategy::MajorityGated => "majority of valid votes scored 1, longest",
            };
            Selection {
                chosen_index: Some(index),
                chosen_hint: Some(hint.to_string()),
                reason: format!("{head}, chose vote {index} ({rule}, {n} chars)"),
            }
        }
    }
}

/// The hint candidates of a turn for multi-candidate hints (docs/method.md §3b): every accepted vote
/// (score 1, hint longer than `min_hint_chars` characters), deduplicated by its trimmed text (the
/// first vote of equal hints is kept), shortest first (ties: the lowest vote index), at most `max`.
/// Returns `(vote index, hint)` pairs; empty when no vote is accepted.
pub fn candidate_hints(candidates: &[HintCandidate], min_hint_chars: usize, max: usize) -> Vec<(i32, String)> {
    let mut out: Vec<(i32, String)> = vec![];
    for c in candidates.iter().filter(|c| c.score == Some(1)) {
        let Some(h) = c.hint.as_deref().map(str::trim) else { continue };
        if h.chars().count() > min_hint_chars && !out.iter().any(|(_, o)| o == h) {
            out.push((c.index, h.to_string()));
        }
    }
    // A stable sort keeps vote order among hints of equal length.
    out.sort_by_key(|(i, h)| (h.chars().count(), *i));
    out.truncate(max);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(index: i32, score: Option<i32>, hint: Option<&str>) -> HintCandidate {
        HintCandidate {
            index,
            raw: String::new(),
            score,
            hint: hint.map(str::to_string),
            error: None,
            cached: false,
        }
    }

    #[test]
    fn parse_score_and_last_block() {
        let p = parse_hint_vote("\\boxed{1}\n[HINT_START] Use the v2 API. [HINT_END]");
        assert_eq!(p, ParsedHint { score: Some(1), hint: Some("Use the v2 API.".into()), error: None });
        let p = parse_hint_vote("[HINT_START]old[HINT_END] \\boxed{-1} \\boxed{+1} [HINT_START]\n new \n[HINT_END]");
        assert_eq!((p.score, p.hint.as_deref()), (Some(1), Some("new")));
        let p = parse_hint_vote("\\boxed{0} [HINT_START]x[HINT_END]");
        assert_eq!(p.score, None);
        assert_eq!(p.error.as_deref(), Some("last \\boxed{} holds 0; a hint vote must be 1 or -1"));
        assert_eq!(p.hint.as_deref(), Some("x"));
        assert_eq!(parse_hint_vote("\\boxed{-1}").hint, None);
        assert_eq!(parse_hint_vote("nothing").error.as_deref(), Some("no \\boxed{d} with a single signed digit in the answer"));
        // Unclosed or blank blocks are no hint.
        assert_eq!(last_hint_block("[HINT_START] never closed"), None);
        assert_eq!(last_hint_block("[HINT_START]  \n [HINT_END]"), None);
        assert_eq!(last_hint_block("[HINT_START] a [HINT_START] b [HINT_END]").as_deref(), Some("a [HINT_START] b"));
        assert_eq!(last_hint_block("[HINT_END] x [HINT_START] y [HINT_END]").as_deref(), Some("y"));
    }

    fn three() -> Vec<HintCandidate> {
        vec![
            cand(0, Some(1), Some("Check the file path first.")), // 26 chars
            cand(1, Some(1), Some("Run `ls` before `cat` to find the right path, then read it.")), // 59
            cand(2, Some(-1), Some("A much longer hint that must be ignored because the score is -1.")),
        ]
    }

    #[test]
    fn longest_and_shortest() {
        let s = select_hint(Strategy::Longest, &three(), 10);
        assert_eq!(s.chosen_index, Some(1));
        assert_eq!(s.chosen_hint.as_deref(), Some("Run `ls` before `cat` to find the right path, then read it."));
        assert_eq!(s.reason, "3 valid votes, 2 accepted, chose vote 1 (longest, 59 chars)");
        let s = select_hint(Strategy::Shortest, &three(), 10);
        assert_eq!(s.chosen_index, Some(0));
        assert_eq!(s.reason, "3 valid votes, 2 accepted, chose vote 0 (shortest, 26 chars)");
    }

    #[test]
    fn length_threshold_is_strict_and_counts_chars() {
        let c = vec![cand(0, Some(1), Some("exactly10!")), cand(1, Some(1), Some("ééééééééééé"))];
        let s = select_hint(Strategy::Longest, &c, 10);
        assert_eq!(s.chosen_index, Some(1), "11 two-byte chars pass, 10 chars do not");
        let s = select_hint(Strategy::Longest, &c[..1], 10);
        assert_eq!(s, Selection { chosen_index: None, chosen_hint: None, reason: "1 valid vote, 0 accepted: no vote with score 1 and a hint > 10 chars".into() });
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        let c = vec![cand(0, Some(1), Some("same length A")), cand(1, Some(1), Some("same length B"))];
        assert_eq!(select_hint(Strategy::Longest, &c, 10).chosen_index, Some(0));
        assert_eq!(select_hint(Strategy::Shortest, &c, 10).chosen_index, Some(0));
    }

    #[test]
    fn invalid_votes_and_no_hint() {
        let c = vec![cand(0, None, Some("a hint from an invalid vote")), cand(1, Some(1), None), cand(2, Some(-1), None)];
        let s = select_hint(Strategy::Longest, &c, 10);
        assert_eq!(s.chosen_index, None);
        assert_eq!(s.reason, "2 valid votes, 0 accepted: no vote with score 1 and a hint > 10 chars");
        let s = select_hint(Strategy::Longest, &[], 10);
        assert_eq!(s.reason, "0 valid votes, 0 accepted: no vote with score 1 and a hint > 10 chars");
    }

    #[test]
    fn majority_gated() {
        // 2 of 3 valid votes score 1: a majority, then the longest.
        let s = select_hint(Strategy::MajorityGated, &three(), 10);
        assert_eq!(s.chosen_index, Some(1));
        assert_eq!(s.reason, "3 valid votes, 2 accepted, chose vote 1 (majority of valid votes scored 1, longest, 59 chars)");
        // 1 of 2 valid votes: not a strict majority (the invalid vote does not count).
        let c = vec![cand(0, Some(1), Some("Check the file path first.")), cand(1, Some(-1), None), cand(2, None, None)];
        let s = select_hint(Strategy::MajorityGated, &c, 10);
        assert_eq!(s.chosen_index, None);
        assert_eq!(s.reason, "2 valid votes, 1 with score 1: no majority for a hint (majority-gated)");
        // Longest would have taken it.
        assert_eq!(select_hint(Strategy::Longest, &c, 10).chosen_index, Some(0));
    }

    #[test]
    fn candidate_hints_are_accepted_distinct_shortest_first_and_capped() {
        let c = vec![
            cand(0, Some(1), Some("Run `ls` before `cat` to find the right path, then read it.")), // 59
            cand(1, Some(1), Some("Check the file path first.")),                                   // 26
            cand(2, Some(-1), Some("A hint from a vote that scored -1 is never a candidate.")),
            cand(3, Some(1), Some("  Check the file path first.  ")), // a duplicate once trimmed
            cand(4, Some(1), Some("short")),                          // not > 10 chars
            cand(5, None, Some("an invalid vote's hint, also ignored")),
            cand(6, Some(1), Some("Use the absolute path /srv/data.")), // 32
        ];
        let got = candidate_hints(&c, 10, 3);
        assert_eq!(
            got,
            vec![
                (1, "Check the file path first.".to_string()),
                (6, "Use the absolute path /srv/data.".to_string()),
                (0, "Run `ls` before `cat` to find the right path, then read it.".to_string()),
            ]
        );
        assert_eq!(candidate_hints(&c, 10, 2).len(), 2);
        assert_eq!(candidate_hints(&c, 10, 1), vec![(1, "Check the file path first.".to_string())], "C = 1 is the shortest strategy's choice");
        assert_eq!(select_hint(Strategy::Shortest, &c, 10).chosen_index, Some(1));
        // Equal lengths keep vote order.
        let tie = vec![cand(0, Some(1), Some("same length B")), cand(1, Some(1), Some("same length A"))];
        assert_eq!(candidate_hints(&tie, 10, 3).iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1]);
        assert!(candidate_hints(&c[2..3], 10, 3).is_empty());
    }

    #[test]
    fn strategy_names() {
        for (s, name) in [(Strategy::Longest, "longest"), (Strategy::Shortest, "shortest"), (Strategy::MajorityGated, "majority-gated")] {
            assert_eq!(s.as_str(), name);
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{name}\""));
        }
    }
}
