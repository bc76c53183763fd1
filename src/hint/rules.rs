//! The embedded rule-based hint judge: a cheap, deterministic **baseline**, not an LLM. It answers in
//! the hint judge's format (`\boxed{1}` + `[HINT_START]…[HINT_END]`, or `\boxed{-1}`) so the same
//! parser and selection apply.

use std::sync::OnceLock;

use futures::future::BoxFuture;
use regex::Regex;

use serde::{Deserialize, Serialize};

use crate::judge::{BackendKind, CallError, TurnContext, VoteBackend, VoteRequest};
use crate::schema::NextStateKind;

/// Model id recorded for the rule-based hint judge.
pub const RULES_HINT_MODEL: &str = "hint-rules-v1";

/// Longest hint the rules produce, in characters.
pub const MAX_RULE_HINT_CHARS: usize = 400;

/// What the rule backend writes for a user's correction (`[hint] rules_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleHintStyle {
    /// An imperative rewritten from the user's message ([`instruction_from`]): what to do, addressed to
    /// the assistant ("Do not use bold text. Put the final number at the very end."), as the hint
    /// contract (docs/method.md §3: "a concrete instruction") and the reference ask. Falls back to
    /// `verbatim` when no sentence of the message can be rewritten.
    #[default]
    Instruction,
    /// The user's own message, its first 1–3 sentences: the complaint copied (the earlier behaviour,
    /// kept as a strategy to compare with).
    Verbatim,
}

impl RuleHintStyle {
    /// Lower-case name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            RuleHintStyle::Instruction => "instruction",
            RuleHintStyle::Verbatim => "verbatim",
        }
    }
}

/// The rule-based hint judge (backend `rules` of the `[hint]` table). Rules, first match wins:
///
/// | rule | condition | answer |
/// |---|---|---|
/// | `user_instruction` | the next state is a user message with a correction cue (from the signal stage) or an instruction cue (please, instead, don't, do not, make sure, should, must, need to, always, never, avoid, rather than, prefer) | `\boxed{1}`, hint = with `style = instruction`, the imperative [`instruction_from`] rewrites from the message (the verbatim hint when nothing can be rewritten); with `verbatim`, the user's message itself, its first 1–3 sentences; at most 400 characters either way |
/// | `environment_error` | a tool/environment next state with an error or a non-zero exit code | `\boxed{1}`, hint naming the error line (the last line that mentions an error, exception, failure, ...) |
/// | `no_hindsight` | anything else | `\boxed{-1}` |
#[derive(Debug, Clone, Copy, Default)]
pub struct RulesHint {
    /// How a user's correction becomes a hint.
    pub style: RuleHintStyle,
}

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
    /// The rule backend writing imperative hints (the default).
    pub const INSTRUCTION: RulesHint = RulesHint { style: RuleHintStyle::Instruction };
    /// The rule backend copying the user's sentences.
    pub const VERBATIM: RulesHint = RulesHint { style: RuleHintStyle::Verbatim };

    /// The hint (if any) and the rule that fired.
    pub fn decide(&self, turn: &TurnContext) -> (Option<String>, &'static str) {
        if turn.next_state_kind == NextStateKind::User {
            let text = turn.next_user_text();
            if !text.is_empty() && (turn.correction_cue || instruction_re().is_match(&text)) {
                let rewritten = match self.style {
                    RuleHintStyle::Instruction => instruction_from(&text),
                    RuleHintStyle::Verbatim => None,
                };
                let hint = cap_chars(&rewritten.unwrap_or_else(|| first_sentences(&text, 3)), MAX_RULE_HINT_CHARS);
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
    pub fn answer(&self, turn: &TurnContext) -> String {
        let prefix = format!("Rule-based hint judge {RULES_HINT_MODEL} (a baseline, not an LLM).");
        match self.decide(turn) {
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
        Box::pin(async move { Ok(self.answer(req.turn)) })
    }
}

/// Words that start an imperative clause (a verb in its base form) among the short clauses users write
/// when they correct an assistant. A clause that starts with one of them is kept as an instruction.
const IMPERATIVE_VERBS: &[&str] = &[
    "add", "answer", "avoid", "be", "call", "change", "check", "convert", "copy", "delete", "describe", "do", "double-check",
    "drop", "end", "explain", "fix", "focus", "follow", "format", "give", "go", "include", "keep", "leave", "let", "list",
    "make", "mention", "move", "name", "open", "print", "put", "read", "remember", "remove", "rename", "reply", "respond",
    "return", "run", "say", "send", "show", "skip", "start", "state", "stick", "stop", "summarize", "take", "talk", "tell",
    "try", "turn", "update", "use", "verify", "wait", "write",
];

/// Clauses that are only a request to redo (no content once the filler words are gone): dropped.
const EMPTY_REDO: &[&str] = &["try", "do it", "redo it", "fix it", "do that", "do it that way", "check it", "say it", "answer", "write it"];

fn lead_filler_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"(?i)^(?:(?:hmm+|ok(?:ay)?|ugh|well|oh|so|but|and|also|plus|hey|sorry|yeah|yes|actually|again|then|now)\b[\s,.!:;-]*)+")
            .expect("constant regex")
    })
}

fn clause_split_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // Sentence ends, semicolons, commas, the marks `join_re` leaves, and "also"/"plus" between requests.
    RE.get_or_init(|| Regex::new(r"(?i)[.!?;]+(?:\s+|$)|,\s*|\x1f|\s+(?:also|plus|oh and)\s+").expect("constant regex"))
}

/// "and"/"but" that start a new request ("... and just write it ...", "... but can you ..."): replaced by
/// a split mark (\x1f) before the request's first word.
fn join_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(?i)\s+(?:and|but)\s+(just|then|also|please|can|could|would)\b").expect("constant regex"))
}

/// Rewrites a user's correction into instructions for the assistant (the rule backend's `instruction`
/// style): the message is cut into clauses at sentence ends, commas and connectives ("also", "plus",
/// "and just"); leading fillers ("hmm", "ok but", "ugh") and "please" are dropped; each clause becomes
/// at most one imperative:
///
/// | the user writes | the hint says |
/// |---|---|
/// | `can/could/would you (not) X` | `X` (`Do not X`) |
/// | `don't / do not / never / stop X` | `Do not X` |
/// | `no X` | `Do not use X` |
/// | `just X` | `X` when X starts with a verb, else `Use X` |
/// | `you forgot to X` / `you forgot X` | `Remember to X` / `Include X` |
/// | `too long`, `more than I need` | `Keep it short` |
/// | `that's wrong`, `not right`, `incorrect` | `Check the work and make sure the final answer is correct` |
/// | `I (only) want/need/asked for X` | `Give the user (only) X` |
/// | a clause with `should` / `must` / `needs to` | the clause as a statement |
/// | a clause that starts with a verb | itself |
///
/// Other clauses (remarks such as "it reads like a textbook") are left out, and so is a clause whose
/// verb is not in the short list of verbs this rule knows (`IMPERATIVE_VERBS`); "again", "instead" at
/// the end, "that way" and "for me" are dropped; "me"/"my"/"I" become "the user"/"the user's". Clauses that
/// say only "try again" or "do it again" are dropped. At most three instructions, each ending with a
/// period, joined by spaces, duplicates removed. `None` when no clause gives one.
pub fn instruction_from(text: &str) -> Option<String> {
    static WRONG: OnceLock<Regex> = OnceLock::new();
    let wrong = WRONG.get_or_init(|| Regex::new(r"(?i)\b(wrong|not right|incorrect|not correct|isn'?t right|mistake|(?:don'?t|do not) think (?:that'?s|it'?s|this is) (?:right|correct))\b").expect("constant regex"));
    static LONG: OnceLock<Regex> = OnceLock::new();
    let long = LONG.get_or_init(|| Regex::new(r"(?i)\b(too long|too wordy|too verbose|more than i need|way too much)\b").expect("constant regex"));
    let mut out: Vec<String> = vec![];
    let text = first_sentences(text, 3).replace('\x1f', " ");
    let text = join_re().replace_all(&text, "\x1f$1");
    for raw in clause_split_re().split(&text) {
        let Some(instr) = clause_instruction(raw, wrong, long) else { continue };
        let instr = finish(&instr);
        if instr.chars().count() > 3 && !out.iter().any(|o| o.eq_ignore_ascii_case(&instr)) {
            out.push(instr);
        }
        if out.len() == 3 {
            break;
        }
    }
    (!out.is_empty()).then(|| out.join(" "))
}

fn clause_instruction(raw: &str, wrong: &Regex, long: &Regex) -> Option<String> {
    let c = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    let c = lead_filler_re().replace(&c, "").trim().to_string();
    let c = c.trim_start_matches(|ch: char| !ch.is_alphanumeric() && ch != '"' && ch != '`').to_string();
    let c = strip_word_prefix(&c, "please").unwrap_or(c);
    if c.is_empty() {
        return None;
    }
    let lower = c.to_lowercase();
    if long.is_match(&c) {
        return Some("Keep it short".into());
    }
    if wrong.is_match(&c) && !lower.starts_with("don") && !lower.starts_with("no ") {
        return Some("Check the work and make sure the final answer is correct".into());
    }
    for modal in ["can you", "could you", "would you", "will you", "can u"] {
        if let Some(rest) = strip_word_prefix(&c, modal) {
            let rest = strip_word_prefix(&rest, "please").unwrap_or(rest);
            if let Some(neg) = strip_word_prefix(&rest, "not") {
                return Some(format!("Do not {}", tidy(&neg)?));
            }
            let rest = strip_word_prefix(&rest, "just").unwrap_or(rest);
            return imperative(&rest);
        }
    }
    for neg in ["don't", "dont", "do not", "never", "stop"] {
        if let Some(rest) = strip_word_prefix(&c, neg) {
            return Some(format!("Do not {}", tidy(&rest)?));
        }
    }
    if let Some(rest) = strip_word_prefix(&c, "no more").or_else(|| strip_word_prefix(&c, "no")) {
        return Some(format!("Do not use {}", tidy(&rest)?));
    }
    if let Some(rest) = strip_word_prefix(&c, "just") {
        let t = tidy(&rest)?;
        return if starts_with_verb(&t) { imperative(&t) } else { Some(format!("Use {t}")) };
    }
    if let Some(rest) = strip_word_prefix(&c, "you forgot to").or_else(|| strip_word_prefix(&c, "you forgot")) {
        let t = tidy(&rest)?;
        return Some(if lower.starts_with("you forgot to") { format!("Remember to {t}") } else { format!("Include {t}") });
    }
    for want in ["i only want", "i only need", "i only wanted", "i only needed"] {
        if let Some(rest) = strip_word_prefix(&c, want) {
            return Some(format!("Give the user only {}", tidy(&rest)?));
        }
    }
    for want in ["i want", "i need", "i wanted", "i needed", "i asked for", "i'd like", "i would like", "i prefer"] {
        if let Some(rest) = strip_word_prefix(&c, want) {
            return Some(format!("Give the user {}", tidy(&rest)?));
        }
    }
    static MODAL: OnceLock<Regex> = OnceLock::new();
    if MODAL.get_or_init(|| Regex::new(r"(?i)\b(should|must|needs? to|has to|have to)\b").expect("constant regex")).is_match(&c) {
        return tidy(&c);
    }
    if starts_with_verb(&c) {
        return imperative(&c);
    }
    None
}

/// `text` without the leading word(s) `prefix` (case-insensitive, whole words), trimmed.
fn strip_word_prefix(text: &str, prefix: &str) -> Option<String> {
    let n = prefix.len();
    let head = text.get(..n)?;
    if !head.eq_ignore_ascii_case(prefix) {
        return None;
    }
    let rest = &text[n..];
    if rest.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '\'') {
        return None;
    }
    Some(rest.trim().to_string())
}

fn starts_with_verb(text: &str) -> bool {
    let first = text.split_whitespace().next().unwrap_or("").trim_matches(|c: char| !c.is_alphanumeric() && c != '-').to_lowercase();
    IMPERATIVE_VERBS.contains(&first.as_str())
}

/// An imperative from a verb phrase, `None` when it is only a request to redo.
fn imperative(text: &str) -> Option<String> {
    let t = tidy(text)?;
    EMPTY_REDO.iter().all(|e| !t.eq_ignore_ascii_case(e)).then_some(t)
}

/// Drops trailing "again"/"instead"/"that way"/"for me" and punctuation, turns the speaker into "the
/// user"; `None` when nothing is left.
fn tidy(text: &str) -> Option<String> {
    static TAIL: OnceLock<Regex> = OnceLock::new();
    let tail = TAIL.get_or_init(|| Regex::new(r"(?i)(?:\s+(?:again|instead|that way|for me|please|now|thanks|thank you))+[\s.!?]*$").expect("constant regex"));
    static SPEAKER: OnceLock<Regex> = OnceLock::new();
    let speaker = SPEAKER.get_or_init(|| Regex::new(r"\b(me|my|I'm|I am|I)\b").expect("constant regex"));
    let t = text.trim().trim_end_matches(['.', '!', '?', ',', ';', ':', ' ']);
    let t = tail.replace(t, "");
    static AGAIN: OnceLock<Regex> = OnceLock::new();
    let t = AGAIN.get_or_init(|| Regex::new(r"(?i)\s+again\b").expect("constant regex")).replace_all(&t, "");
    let t = speaker.replace_all(&t, |c: &regex::Captures<'_>| match &c[1] {
        "me" => "the user".to_string(),
        "my" => "the user's".to_string(),
        "I'm" | "I am" => "the user is".to_string(),
        _ => "the user".to_string(),
    });
    let t = t.trim().trim_end_matches(['.', '!', '?', ',', ';', ':', ' ']).trim().to_string();
    (!t.is_empty()).then_some(t)
}

/// Capitalises the first letter and ends with a period.
fn finish(text: &str) -> String {
    let mut c = text.chars();
    let first: String = c.next().map(|f| f.to_uppercase().collect()).unwrap_or_default();
    format!("{first}{}.", c.as_str())
}
