//! The embedded rule-based hint judge: a cheap, deterministic **baseline**, not an LLM. It answers in
//! the hint judge's format (`\boxed{1}` + `[HINT_START]…[HINT_END]`, or `\boxed{-1}`) so the same
//! parser and selection apply.

use std::sync::OnceLock;

use futures::future::BoxFuture;
use regex::Regex;

use crate::judge::{BackendKind, CallError, TurnContext, VoteBackend, VoteRequest};
use crate::schema::NextStateKind;

/// Model id recorded for the rule-based hint judge.
pub const RULES_HINT_MODEL: &str = "hint-rules-v1";

/// Longest hint the rules produce, in characters.
pub const MAX_RULE_HINT_CHARS: usize = 400;

/// The rule-based hint judge (backend `rules` of the `[hint]` table). Rules, first match wins:
///
/// | rule | condition | answer |
/// |---|---|---|
/// | `user_instruction` | the next state is a user message with a correction cue (from the signal stage) or an instruction cue (please, instead, don't, do not, make sure, should, must, need to, always, never, avoid, rather than, prefer) | `\boxed{1}`, hint = the user's message itself, its first 1–3 sentences (at most 400 characters) |
/// | `environment_error` | a tool/environment next state with an error or a non-zero exit code | `\boxed{1}`, hint naming the error line (the last line that mentions an error, exception, failure, ...) |
/// | `no_hindsight` | anything else | `\boxed{-1}` |
#[derive(Debug, Clone, Copy, Default)]
pub struct RulesHint;

fn instruction_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?i)\b(please|instead|don'?t|do not|make sure|should|must|need to|needs to|always|never|avoid|rather than|prefer)\b")
            .expect("constant regex")
    })
}

fn error_line_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?i)(error|exception|traceback|failed|failure|fatal|panic|no such file|not found|permission denied|denied)")
            .expect("constant regex")
    })
}

/// The first `n` sentences of `text`, whitespace collapsed. A sentence ends at `.`, `!` or `?`
/// followed by whitespace (or the end), or at a line break.
pub fn first_sentences(text: &str, n: usize) -> String {
    let mut sentences: Vec<String> = vec![];
    let mut cur = String::new();
    let chars: Vec<char> = text.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c == '\n' {
            push_sentence(&mut sentences, &mut cur);
        } else {
            cur.push(c);
            let at_end = chars.get(i + 1).is_none_or(|d| d.is_whitespace());
            if matches!(c, '.' | '!' | '?') && at_end {
                push_sentence(&mut sentences, &mut cur);
            }
        }
        if sentences.len() >= n {
            break;
        }
    }
    if sentences.len() < n {
        push_sentence(&mut sentences, &mut cur);
    }
    sentences.truncate(n);
    sentences.join(" ")
}

fn push_sentence(out: &mut Vec<String>, cur: &mut String) {
    let s = cur.split_whitespace().collect::<Vec<_>>().join(" ");
    if !s.is_empty() {
        out.push(s);
    }
    cur.clear();
}

fn cap_chars(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        s.chars().take(max).collect::<String>().trim_end().to_string()
    }
}

/// The line of `text` that names the error: the last line matching error words, skipping a bare
/// `Traceback (most recent call last):` header when a later line exists; trimmed, at most 200
/// characters. `None` when no line matches.
pub fn error_line(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let hit = lines
        .iter()
        .rev()
        .find(|l| error_line_re().is_match(l) && !l.starts_with("Traceback (most recent call last)"))
        .or_else(|| lines.iter().rev().find(|l| error_line_re().is_match(l)))?;
    Some(cap_chars(hit, 200))
}

impl RulesHint {
    /// The hint (if any) and the rule that fired.
    pub fn decide(turn: &TurnContext) -> (Option<String>, &'static str) {
        if turn.next_state_kind == NextStateKind::User {
            let text = turn.next_user_text();
            if !text.is_empty() && (turn.correction_cue || instruction_re().is_match(&text)) {
                let hint = cap_chars(&first_sentences(&text, 3), MAX_RULE_HINT_CHARS);
                if !hint.is_empty() {
                    return (Some(hint), "user_instruction");
                }
            }
        }
        let env = matches!(turn.next_state_kind, NextStateKind::Tool | NextStateKind::Environment);
        let nonzero = turn.exit_code.is_some_and(|c| c != 0);
        if env && (turn.has_error || nonzero) {
            let what = match (error_line(&turn.next_state_text), turn.exit_code) {
                (Some(line), _) => format!("`{line}`"),
                (None, Some(code)) if code != 0 => format!("exit code {code}"),
                _ => "an error".to_string(),
            };
            let hint = format!("The previous action failed with {what}. Find and avoid the cause of this error before acting.");
            return (Some(hint), "environment_error");
        }
        (None, "no_hindsight")
    }

    /// The raw answer text for a turn.
    pub fn answer(turn: &TurnContext) -> String {
        let prefix = format!("Rule-based hint judge {RULES_HINT_MODEL} (a baseline, not an LLM).");
        match RulesHint::decide(turn) {
            (Some(hint), rule) => format!("{prefix} Rule `{rule}` fired.\n\\boxed{{1}}\n[HINT_START]{hint}[HINT_END]"),
            (None, rule) => format!("{prefix} Rule `{rule}` fired.\n\\boxed{{-1}}"),
        }
    }
}

impl VoteBackend for RulesHint {
    fn kind(&self) -> BackendKind {
        BackendKind::Rules
    }
    fn model(&self) -> &str {
        RULES_HINT_MODEL
    }
    fn cacheable(&self) -> bool {
        false
    }
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, Result<String, CallError>> {
        Box::pin(async move { Ok(RulesHint::answer(req.turn)) })
    }
}
