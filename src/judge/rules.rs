//! The embedded rule-based judge: a cheap, deterministic **baseline**, not an LLM. It reads the
//! next-state features the signal stage computed (and, for rephrasing, the texts) and answers in the
//! same `\boxed{}` format as an LLM judge so the same parser applies.

use std::collections::HashSet;

use futures::future::BoxFuture;

use super::backend::{BackendKind, CallError, VoteBackend, VoteRequest};
use super::turn::TurnContext;
use crate::schema::NextStateKind;

/// Model id recorded for the rule-based judge.
pub const RULES_JUDGE_MODEL: &str = "rules-v1";

/// Word-set Jaccard similarity at or above which a user's reply counts as rephrasing the request.
pub const REPHRASE_JACCARD: f64 = 0.6;

/// The rule-based judge (backend `rules`). Rules, first match wins:
///
/// | rule | condition | vote |
/// |---|---|---|
/// | `no_next_state` | next state kind `none` | 0 |
/// | `correction_cue` | the user asks to redo/retry/correct | −1 |
/// | `rephrased_request` | a user reply whose word set overlaps the last request's by Jaccard ≥ 0.6 (both ≥ 3 words) | −1 |
/// | `error_in_next_state` | an error message or traceback in the next state | −1 |
/// | `nonzero_exit_code` | an exit code ≠ 0 | −1 |
/// | `thanks_cue` | explicit thanks / approval | +1 |
/// | `success_cue` | the environment reports success (tests pass, "success") | +1 |
/// | `zero_exit_code` | exit code 0 | +1 |
/// | `user_moved_on` | any other user reply (a new request) | +1 |
/// | `no_rule` | anything else (a tool result with no error or success cue) | 0 |
///
/// Its raw text names the rule and ends in `\boxed{v}`. Every vote of a turn is the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct RulesJudge;

/// Lower-case alphanumeric words of `s`.
fn words(s: &str) -> HashSet<String> {
    s.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(|w| w.to_lowercase()).collect()
}

/// Jaccard similarity of the word sets of `a` and `b`, or `None` when either has fewer than 3 words.
fn rephrase_similarity(a: &str, b: &str) -> Option<f64> {
    let (wa, wb) = (words(a), words(b));
    if wa.len() < 3 || wb.len() < 3 {
        return None;
    }
    let inter = wa.intersection(&wb).count() as f64;
    let union = wa.union(&wb).count() as f64;
    Some(inter / union)
}

impl RulesJudge {
    /// The vote, the rule that fired and a one-line explanation.
    pub fn decide(turn: &TurnContext) -> (i32, &'static str, String) {
        if turn.next_state_kind == NextStateKind::None {
            return (0, "no_next_state", "the turn has no next state".into());
        }
        if turn.correction_cue {
            return (-1, "correction_cue", "the user asked for a redo, retry or correction".into());
        }
        if turn.next_state_kind == NextStateKind::User {
            if let (Some(req), next) = (turn.last_user_request(), turn.next_user_text()) {
                if let Some(j) = rephrase_similarity(req, &next) {
                    if j >= REPHRASE_JACCARD {
                        return (-1, "rephrased_request", format!("the user's reply repeats the request (word overlap {j:.2})"));
                    }
                }
            }
        }
        if turn.has_error {
            return (-1, "error_in_next_state", "the next state reports an error".into());
        }
        if let Some(code) = turn.exit_code {
            if code != 0 {
                return (-1, "nonzero_exit_code", format!("the command exited with code {code}"));
            }
        }
        if turn.thanks_cue {
            return (1, "thanks_cue", "the user thanked or approved".into());
        }
        if turn.success_cue {
            return (1, "success_cue", "the environment reports success".into());
        }
        if turn.exit_code == Some(0) {
            return (1, "zero_exit_code", "the command exited with code 0".into());
        }
        if turn.next_state_kind == NextStateKind::User {
            return (1, "user_moved_on", "the user went on with a new message".into());
        }
        (0, "no_rule", "no rule applies to this next state".into())
    }

    /// The raw answer text for a turn: which rule fired, ending in `\boxed{v}`.
    pub fn answer(turn: &TurnContext) -> String {
        let (v, rule, why) = RulesJudge::decide(turn);
        format!("Rule-based judge {RULES_JUDGE_MODEL} (a baseline, not an LLM). Rule `{rule}` fired: {why}.\n\\boxed{{{v}}}")
    }
}

impl VoteBackend for RulesJudge {
    fn kind(&self) -> BackendKind {
        BackendKind::Rules
    }
    fn model(&self) -> &str {
        RULES_JUDGE_MODEL
    }
    fn cacheable(&self) -> bool {
        false
    }
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, Result<String, CallError>> {
        Box::pin(async move { Ok(RulesJudge::answer(req.turn)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::parse_vote;
    use crate::judge::turn::tests::turn;
    use crate::schema::Message;

    fn rule(t: &TurnContext) -> (i32, &'static str) {
        let (v, r, _) = RulesJudge::decide(t);
        (v, r)
    }

    #[test]
    fn each_rule_fires() {
        let req = vec![Message::text("user", "write a haiku about autumn leaves")];
        let base = turn(req.clone(), "Leaves fall...", NextStateKind::User, "now one about winter snow please");
        assert_eq!(rule(&base), (1, "user_moved_on"));

        let mut t = base.clone();
        t.correction_cue = true;
        assert_eq!(rule(&t), (-1, "correction_cue"));

        let t = turn(req.clone(), "x", NextStateKind::User, "Write a haiku about the autumn leaves");
        assert_eq!(rule(&t), (-1, "rephrased_request"));

        let mut t = turn(req.clone(), "x", NextStateKind::Tool, "Traceback ...");
        t.has_error = true;
        assert_eq!(rule(&t), (-1, "error_in_next_state"));

        let mut t = turn(req.clone(), "x", NextStateKind::Environment, "out");
        t.exit_code = Some(2);
        assert_eq!(rule(&t), (-1, "nonzero_exit_code"));

        let mut t = base.clone();
        t.thanks_cue = true;
        assert_eq!(rule(&t), (1, "thanks_cue"));

        let mut t = turn(req.clone(), "x", NextStateKind::Tool, "5 passed");
        t.success_cue = true;
        assert_eq!(rule(&t), (1, "success_cue"));

        let mut t = turn(req.clone(), "x", NextStateKind::Environment, "ok");
        t.exit_code = Some(0);
        assert_eq!(rule(&t), (1, "zero_exit_code"));

        let t = turn(req.clone(), "x", NextStateKind::Tool, "{\"flights\": []}");
        assert_eq!(rule(&t), (0, "no_rule"));

        let t = turn(req, "x", NextStateKind::None, "");
        assert_eq!(rule(&t), (0, "no_next_state"));
    }

    #[test]
    fn negative_rules_beat_positive_cues() {
        let mut t = turn(vec![Message::text("user", "run tests")], "x", NextStateKind::Environment, "...");
        t.success_cue = true;
        t.exit_code = Some(1);
        assert_eq!(rule(&t), (-1, "nonzero_exit_code"));
        t.thanks_cue = true;
        t.correction_cue = true;
        assert_eq!(rule(&t), (-1, "correction_cue"));
    }

    #[test]
    fn similarity_needs_three_words() {
        assert_eq!(rephrase_similarity("fix it", "fix it"), None);
        assert_eq!(rephrase_similarity("a b c", "a b c"), Some(1.0));
        assert_eq!(rephrase_similarity("a b c d", "a b e f"), Some(2.0 / 6.0));
    }

    #[test]
    fn answer_names_rule_and_parses() {
        let mut t = turn(vec![], "x", NextStateKind::Tool, "boom");
        t.has_error = true;
        let raw = RulesJudge::answer(&t);
        assert_eq!(
            raw,
            "Rule-based judge rules-v1 (a baseline, not an LLM). Rule `error_in_next_state` fired: the next state reports an error.\n\\boxed{-1}"
        );
        assert_eq!(parse_vote(&raw), Ok(-1));
    }
}
