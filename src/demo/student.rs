//! The simulated student: hidden preferences, the verdict on a response ([`check`]), and replies in a
//! person's casual voice ([`Student`]). Rule-based and deterministic given a seed; a fixed, documented
//! environment (docs/method.md §7), not tuned to any result.
//!
//! # Preferences (all but `labeled_steps` on by default)
//!
//! | name | the response must | violations |
//! |---|---|---|
//! | `no_markdown` | use no markdown or LaTeX | bold (`**x**`, `__x__`, a bare `**`/`__`), italics (`*x*`, `_x_`), a header line (`# x`), a list line (`- x`, `* x`, `+ x`, `1. x`, `1) x`), LaTeX (`\(`, `\[`, `\boxed`, `\frac`, `\dfrac`, `\times`, `\cdot`, `\div`, `\text{`, `\left`, `\right`, `$$`), a code fence (a line starting with three backticks or `~~~`) |
//! | `concise` | have at most `max_words` words (default 80) | a word is a whitespace-separated token with at least one letter or digit (so `**`, `-`, `=` are not words) |
//! | `plain_sentences` | read as casual sentences | a label (`Step 1:` / `Step 1)` anywhere; `Solution:`, `Answer:`, `Final answer:`, `Explanation:`, `Given:`, `Result:`, `Calculation(s):`, `Conclusion:`, `Summary:`, `Therefore:`, `Note:`, `Problem:`, `Question:`, `Reasoning:`, `Total:`, `Verification:`, `Check:` at the start of a line or sentence); a bullet-like line start (`•`, `·`, `▪`, `◦`, `→`, `->`, `=>`, `>`, `–`, `—`, `✓`, `✔`, `a)`, `(a)`) |
//! | `answer_at_end` | end with its final number | there is no number, or the last number is not in the last sentence |
//! | `correct_answer` | get the answer right | the last number differs from the answer, or there is no number |
//! | `labeled_steps` (off by default; conflicts with `plain_sentences`) | show the work as steps labeled `Step 1:`, `Step 2:`, … | fewer than 2 step labels (missing steps), or labels not numbered 1, 2, 3, … in the order they appear (misnumbered steps: a skipped, repeated or out-of-order number) |
//!
//! A **step label** (`labeled_steps`) is `step`, any case, optional spaces or tabs, 1–3 digits and a colon right
//! after them (`Step 1:`, `step 2:`, `Step3:`), at the start of a line or of a sentence (after `.`, `!` or `?`
//! and spaces or tabs, so `Step 1: add. Step 2: subtract.` in one paragraph counts), possibly after leading
//! `>`, `#`, `*`, `-`, spaces or tabs: the check sees through markdown, so `**Step 1:**`, `## Step 1:` and
//! `- Step 1:` count (they break `no_markdown`, which is that preference's business). `Step 1)`,
//! `**Step 1**:`, `__Step 1:__` and a label in the middle of a sentence ("after step 1: we add") do not
//! count. Every step label counts toward the order. `labeled_steps` asks nothing about the answer: with it,
//! `answer_at_end` asks for the final number in the last sentence (after the last step or in it). Every step
//! label is also a label of `plain_sentences`, so no response meets both, and [`Preferences::validate`]
//! (hence [`Student::new`]) refuses preferences that enable both.
//!
//! Together `answer_at_end` and `correct_answer` are "the correct final number stated at the end". They are
//! two preferences so that each has its own rate, and so that a demo whose policy is too small to solve
//! GSM8K can switch correctness off and measure style alone (accuracy is reported either way).
//!
//! The text checked is the **visible** text: `<think>…</think>` blocks (and an unclosed `<think>` to the end)
//! are removed first. Numbers are found by `-?$?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?` (a `-` counts only when not
//! preceded by a letter or digit) and compared by value (`1,234` = `1234.0` = `$1234`); numbers written in
//! words are not read. A sentence ends at `.`, `!` or `?` followed by whitespace or the end, or at a line
//! break; the last sentence is the last one with a letter or digit in it.
//!
//! **Correct** ([`Verdict::correct`]) means the last number in the visible text equals the answer, the usual
//! GSM8K final-number rule. It is computed whatever the preferences are.
//!
//! # Replies
//!
//! The student reacts to the enabled preferences only. It thanks ("thanks, that's perfect", "great,
//! thanks!") when every one is met. Otherwise the reply names at most two things to change, in this order:
//! a missing number ("you forgot the final number…") or a wrong answer ("hmm, I don't think that's right,
//! can you check it again?") first, then the other violations in the order of the table above. Every correction is one sentence that carries one
//! of the pipeline's correction cues ([`crate::signals::features::CORRECTION_CUES`]: "instead", "again",
//! "that's wrong", "that's not right", "you forgot") wherever it sits in the reply, so the rule-based
//! judge scores it −1 and the rule-based hint judge takes the whole reply (at most two sentences) as the
//! hint. Thanks carry a thanks cue and no correction or instruction cue (+1, no hint). Phrasings are
//! picked by a `StdRng` seeded from sha256 of `(seed, problem id, turn, response)` ([`Student::reply_at`]),
//! so a reply does not depend on how sessions interleave, and the first message from `(seed, problem id)`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use regex::Regex;
use serde::{Deserialize, Serialize};

use super::problems::{parse_number, same_number, Problem};
use crate::schema::content_hash;
use crate::{Error, Result};

/// One of the student's hidden preferences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preference {
    /// No markdown or LaTeX.
    NoMarkdown,
    /// At most [`Preferences::max_words`] words.
    Concise,
    /// Plain casual sentences: no labels, no bullet-like line starts.
    PlainSentences,
    /// The final number stated at the end (the last number is in the last sentence).
    AnswerAtEnd,
    /// The last number is the correct answer.
    CorrectAnswer,
    /// The work shown as steps labeled `Step 1:`, `Step 2:`, … (the module doc's step labels).
    LabeledSteps,
}

impl Preference {
    /// Every preference, in check and reply order (`labeled_steps`, added last, keeps the columns of
    /// earlier reports in their order).
    pub const ALL: [Preference; 6] = [
        Preference::NoMarkdown,
        Preference::Concise,
        Preference::PlainSentences,
        Preference::AnswerAtEnd,
        Preference::CorrectAnswer,
        Preference::LabeledSteps,
    ];

    /// The name used in reports and `eval_scores` rows (`no_markdown`, `concise`, `plain_sentences`,
    /// `answer_at_end`, `correct_answer`, `labeled_steps`).
    pub fn name(self) -> &'static str {
        match self {
            Preference::NoMarkdown => "no_markdown",
            Preference::Concise => "concise",
            Preference::PlainSentences => "plain_sentences",
            Preference::AnswerAtEnd => "answer_at_end",
            Preference::CorrectAnswer => "correct_answer",
            Preference::LabeledSteps => "labeled_steps",
        }
    }

    /// The preference with this [`Preference::name`], if any.
    pub fn from_name(name: &str) -> Option<Preference> {
        Preference::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for Preference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which preferences the student holds (the default: all but `labeled_steps`, 80 words; the second named
/// profile: [`Preferences::worked_steps`]). The student reacts to the enabled ones only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Preferences {
    /// No markdown or LaTeX.
    pub no_markdown: bool,
    /// At most `max_words` words.
    pub concise: bool,
    /// Word limit of `concise` (words as defined in the module doc).
    pub max_words: usize,
    /// Plain casual sentences.
    pub plain_sentences: bool,
    /// The work as `Step 1:`, `Step 2:`, … steps (conflicts with `plain_sentences`). Not serialised when
    /// off, so the serialised default (and every hash of a configuration that holds it) is what it was
    /// before this preference existed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub labeled_steps: bool,
    /// The final number at the end.
    pub answer_at_end: bool,
    /// The correct answer.
    pub correct_answer: bool,
}

impl Default for Preferences {
    fn default() -> Self {
        Preferences {
            no_markdown: true,
            concise: true,
            max_words: 80,
            plain_sentences: true,
            labeled_steps: false,
            answer_at_end: true,
            correct_answer: true,
        }
    }
}

impl Preferences {
    /// The second named student, whose style conflicts with the default's: no markdown, the work as
    /// labeled steps (`Step 1:`, `Step 2:`, …), the final number at the end and (as in
    /// [`Preferences::default`]) the correct answer; no word limit and no plain sentences. No response
    /// meets both this and the default (module doc).
    pub fn worked_steps() -> Preferences {
        Preferences {
            no_markdown: true,
            concise: false,
            max_words: 80,
            plain_sentences: false,
            labeled_steps: true,
            answer_at_end: true,
            correct_answer: true,
        }
    }

    /// Checks that the preferences can all be met by one response.
    ///
    /// # Errors
    /// [`Error::Config`] when both `plain_sentences` and `labeled_steps` are enabled.
    pub fn validate(&self) -> Result<()> {
        if self.plain_sentences && self.labeled_steps {
            return Err(Error::Config(
                "the student's preferences plain_sentences and labeled_steps conflict (plain_sentences forbids `Step 1:` labels, labeled_steps asks for them): enable at most one".into(),
            ));
        }
        Ok(())
    }

    /// The enabled preferences, in [`Preference::ALL`] order.
    pub fn enabled(&self) -> Vec<Preference> {
        Preference::ALL.into_iter().filter(|p| self.holds(*p)).collect()
    }

    /// Whether preference `p` is enabled.
    pub fn holds(&self, p: Preference) -> bool {
        match p {
            Preference::NoMarkdown => self.no_markdown,
            Preference::Concise => self.concise,
            Preference::PlainSentences => self.plain_sentences,
            Preference::AnswerAtEnd => self.answer_at_end,
            Preference::CorrectAnswer => self.correct_answer,
            Preference::LabeledSteps => self.labeled_steps,
        }
    }

    /// One line per enabled preference, in words (for reports).
    pub fn describe(&self) -> Vec<String> {
        self.enabled()
            .into_iter()
            .map(|p| match p {
                Preference::NoMarkdown => "no_markdown: no bold/italics, headers, lists, LaTeX or code fences".to_string(),
                Preference::Concise => format!("concise: at most {} words", self.max_words),
                Preference::PlainSentences => {
                    "plain_sentences: casual sentences, no `Step 1:` / `Answer:` labels or bullet-like lines".to_string()
                }
                Preference::AnswerAtEnd => "answer_at_end: the final number is stated in the last sentence".to_string(),
                Preference::CorrectAnswer => "correct_answer: the last number is the correct answer".to_string(),
                Preference::LabeledSteps => {
                    "labeled_steps: the work as at least 2 lines or sentences starting `Step 1:`, `Step 2:`, … in order".to_string()
                }
            })
            .collect()
    }
}

/// What exactly is wrong with a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// `**x**`, `__x__` or a bare `**` / `__`.
    Bold,
    /// `*x*` or `_x_`.
    Italics,
    /// A markdown header line.
    Header,
    /// A markdown list line (bulleted or numbered).
    List,
    /// LaTeX markup.
    Latex,
    /// A code fence.
    CodeFence,
    /// More words than the limit.
    TooLong,
    /// A label such as `Step 1:` or `Answer:`.
    Label,
    /// A line starting with a bullet-like symbol.
    BulletLike,
    /// The last number is not the answer, or there is no number.
    WrongAnswer,
    /// No number at all.
    NoNumber,
    /// The last number is not in the last sentence.
    AnswerNotAtEnd,
    /// Fewer than 2 step labels.
    MissingSteps,
    /// Step labels not numbered 1, 2, 3, … in order.
    MisnumberedSteps,
}

impl ViolationKind {
    /// The preference this kind violates.
    pub fn preference(self) -> Preference {
        use ViolationKind::*;
        match self {
            Bold | Italics | Header | List | Latex | CodeFence => Preference::NoMarkdown,
            TooLong => Preference::Concise,
            Label | BulletLike => Preference::PlainSentences,
            NoNumber | AnswerNotAtEnd => Preference::AnswerAtEnd,
            WrongAnswer => Preference::CorrectAnswer,
            MissingSteps | MisnumberedSteps => Preference::LabeledSteps,
        }
    }

    /// Short description ("bold text", "too long", ...).
    pub fn describe(self) -> &'static str {
        use ViolationKind::*;
        match self {
            Bold => "bold text",
            Italics => "italics",
            Header => "header",
            List => "list",
            Latex => "LaTeX",
            CodeFence => "code fence",
            TooLong => "too long",
            Label => "label",
            BulletLike => "bullet-like line",
            WrongAnswer => "wrong answer",
            NoNumber => "no number",
            AnswerNotAtEnd => "final number not at the end",
            MissingSteps => "missing steps",
            MisnumberedSteps => "misnumbered steps",
        }
    }
}

/// One violated preference with its evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The preference violated.
    pub preference: Preference,
    /// What is wrong.
    pub kind: ViolationKind,
    /// Evidence: the offending text in backticks (at most 40 characters of its first line), or a count
    /// ("93 words, limit 80", "found 1 step label, need at least 2"), or the numbers ("last number is 40,
    /// expected 36", "steps numbered 2, 1, expected 1, 2").
    pub evidence: String,
}

impl fmt::Display for Violation {
    /// `bold text: `**Step 1**``.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.describe(), self.evidence)
    }
}

impl Violation {
    /// The violation prefixed with its preference name, as stored in `eval_scores.violations`:
    /// `no_markdown: bold text: `**Step 1**``.
    pub fn tagged(&self) -> String {
        format!("{}: {self}", self.preference.name())
    }
}

/// The student's verdict on one response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Violations of enabled preferences, at most one per kind, in [`ViolationKind`] order except that
    /// a wrong answer comes before a missing number.
    pub violations: Vec<Violation>,
    /// No enabled preference is violated.
    pub satisfied: bool,
    /// The last number equals the answer (computed whatever the preferences).
    pub correct: bool,
    /// Words in the visible text (module doc).
    pub words: usize,
    /// The last number in the visible text as written, if any.
    pub last_number: Option<String>,
}

impl Verdict {
    /// Whether preference `p` is met (no violation of it).
    pub fn meets(&self, p: Preference) -> bool {
        !self.violations.iter().any(|v| v.preference == p)
    }
}

fn re(src: &str) -> Regex {
    // Constant patterns, checked by the unit tests: a bad pattern is a bug on our side.
    Regex::new(src).unwrap_or_else(|e| panic!("invalid built-in pattern {src}: {e}"))
}

static THINK: LazyLock<Regex> = LazyLock::new(|| re(r"(?s)<think>.*?(?:</think>|\z)"));
static BOLD: LazyLock<Regex> = LazyLock::new(|| re(r"\*\*[^\n]*?\*\*|__[^\n]*?__|\*\*|__"));
static ITALICS: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?m)(?:^|[\s(])(\*[^\s*](?:[^*\n]*[^\s*])?\*|_[^\s_](?:[^_\n]*[^\s_])?_)(?:$|[\s.,;:!?)])"));
static HEADER: LazyLock<Regex> = LazyLock::new(|| re(r"(?m)^[ \t]{0,3}#{1,6}[ \t]+\S.*$"));
static LIST: LazyLock<Regex> = LazyLock::new(|| re(r"(?m)^[ \t]*(?:[-*+]|\d{1,3}[.)])[ \t]+\S.*$"));
static LATEX: LazyLock<Regex> =
    LazyLock::new(|| re(r"\\\(|\\\[|\\boxed|\\d?frac|\\times|\\cdot|\\div|\\text\{|\\left|\\right|\$\$"));
static FENCE: LazyLock<Regex> = LazyLock::new(|| re(r"(?m)^[ \t]*(?:```|~~~).*$"));
static STEP_LABEL: LazyLock<Regex> = LazyLock::new(|| re(r"(?i)\bstep\s*\d+\s*[:)]"));
static WORD_LABEL: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?im)(?:^|[.!?][ \t]+)[ \t>#*_-]*((?:final answer|solution|answer|explanation|given|result|calculations?|conclusion|summary|therefore|note|problem|question|reasoning|total|verification|check)[ \t]*[*_]*[ \t]*:)")
});
// `\b` before `step` as in STEP_LABEL, so every step label is also a plain_sentences label.
static STEP_START: LazyLock<Regex> = LazyLock::new(|| re(r"(?im)(?:^|[.!?][ \t]+)[ \t>#*-]*\bstep[ \t]*(\d{1,3}):"));
static BULLET_LIKE: LazyLock<Regex> = LazyLock::new(|| re(r"(?m)^[ \t]*(?:[•·▪◦→>–—✓✔]|->|=>|\(?[a-z]\)[ \t]).*$"));
static NUMBER: LazyLock<Regex> = LazyLock::new(|| re(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"));

/// The visible text of a response: `<think>…</think>` blocks (and an unclosed `<think>` to the end) removed.
pub fn visible_text(response: &str) -> String {
    THINK.replace_all(response, "").into_owned()
}

/// Words of `text`: whitespace-separated tokens with at least one letter or digit.
pub fn count_words(text: &str) -> usize {
    text.split_whitespace().filter(|w| w.chars().any(char::is_alphanumeric)).count()
}

/// Backticked evidence: the first line of `s`, trimmed, at most 40 characters (then `…`).
fn evidence(s: &str) -> String {
    let line = s.trim().lines().next().unwrap_or_default().trim();
    let mut out: String = line.chars().take(40).collect();
    if line.chars().count() > 40 {
        out.push('…');
    }
    format!("`{out}`")
}

/// The numbers of `text` with their byte offsets (module doc for what counts as a number).
pub fn numbers(text: &str) -> Vec<(usize, String)> {
    NUMBER
        .find_iter(text)
        .map(|m| {
            let s = m.as_str();
            // A minus right after a letter or digit is subtraction ("44-20"), not a sign.
            let glued = s.starts_with('-') && text[..m.start()].chars().next_back().is_some_and(char::is_alphanumeric);
            if glued {
                (m.start() + 1, s[1..].to_string())
            } else {
                (m.start(), s.to_string())
            }
        })
        .collect()
}

/// The numbers of the step labels of `text` (module doc), in order of appearance.
pub fn step_numbers(text: &str) -> Vec<u32> {
    STEP_START.captures_iter(text).filter_map(|c| c.get(1)?.as_str().parse().ok()).collect()
}

/// The `labeled_steps` violation of `text`, if any: fewer than 2 step labels, or labels not numbered 1, 2, …
fn steps_violation(text: &str) -> Option<(ViolationKind, String)> {
    let steps = step_numbers(text);
    let n = steps.len();
    if n < 2 {
        let s = if n == 1 { "" } else { "s" };
        return Some((ViolationKind::MissingSteps, format!("found {n} step label{s}, need at least 2")));
    }
    if steps.iter().zip(1..).all(|(&got, want)| got == want) {
        return None;
    }
    // At most 10 numbers of each list in the evidence.
    let list = |v: Vec<u32>| {
        let mut shown: Vec<String> = v.iter().take(10).map(u32::to_string).collect();
        if n > 10 {
            shown.push("…".into());
        }
        shown.join(", ")
    };
    let expected = (1..).take(n).collect();
    Some((ViolationKind::MisnumberedSteps, format!("steps numbered {}, expected {}", list(steps), list(expected))))
}

/// Byte spans `[start, end)` of the sentences of `text` (module doc), skipping those with no letter or digit.
pub fn sentence_spans(text: &str) -> Vec<(usize, usize)> {
    let mut spans = vec![];
    let mut start = 0;
    let mut it = text.char_indices().peekable();
    while let Some((i, c)) = it.next() {
        let next_is_space = it.peek().is_none_or(|(_, d)| d.is_whitespace());
        let end = if c == '\n' {
            Some(i)
        } else if matches!(c, '.' | '!' | '?') && next_is_space {
            Some(i + c.len_utf8())
        } else {
            None
        };
        if let Some(end) = end {
            spans.push((start, end));
            start = i + c.len_utf8();
        }
    }
    spans.push((start, text.len()));
    spans.into_iter().filter(|&(s, e)| text[s..e].chars().any(char::is_alphanumeric)).collect()
}

/// Checks one response against the enabled preferences for `problem` (see the module doc for every rule).
pub fn check(response: &str, problem: &Problem, prefs: &Preferences) -> Verdict {
    let text = visible_text(response);
    let mut v: Vec<Violation> = vec![];
    let mut push = |kind: ViolationKind, ev: String| {
        if prefs.holds(kind.preference()) {
            v.push(Violation { preference: kind.preference(), kind, evidence: ev });
        }
    };
    let first = |r: &Regex| r.find(&text).map(|m| evidence(m.as_str()));
    let first_group = |r: &Regex| r.captures(&text).and_then(|c| c.get(1)).map(|m| evidence(m.as_str()));

    if let Some(e) = first(&BOLD) {
        push(ViolationKind::Bold, e);
    }
    if let Some(e) = first_group(&ITALICS) {
        push(ViolationKind::Italics, e);
    }
    if let Some(e) = first(&HEADER) {
        push(ViolationKind::Header, e);
    }
    if let Some(e) = first(&LIST) {
        push(ViolationKind::List, e);
    }
    if let Some(m) = LATEX.find(&text) {
        push(ViolationKind::Latex, evidence(&text[m.start()..]));
    }
    if let Some(e) = first(&FENCE) {
        push(ViolationKind::CodeFence, e);
    }
    let words = count_words(&text);
    if words > prefs.max_words {
        push(ViolationKind::TooLong, format!("{words} words, limit {}", prefs.max_words));
    }
    let step = STEP_LABEL.find(&text).map(|m| (m.start(), m.as_str()));
    let word = WORD_LABEL.captures(&text).and_then(|c| c.get(1)).map(|m| (m.start(), m.as_str()));
    if let Some((_, label)) = [step, word].into_iter().flatten().min_by_key(|(at, _)| *at) {
        push(ViolationKind::Label, evidence(label));
    }
    if let Some(e) = first(&BULLET_LIKE) {
        push(ViolationKind::BulletLike, e);
    }

    let nums = numbers(&text);
    let answer = parse_number(&problem.answer);
    let last = nums.last().cloned();
    let correct = match (&last, answer) {
        (Some((_, s)), Some(a)) => parse_number(s).is_some_and(|x| same_number(x, a)),
        _ => false,
    };
    match &last {
        None => {
            push(ViolationKind::WrongAnswer, format!("no number, expected {}", problem.answer));
            push(ViolationKind::NoNumber, "no number in the response".to_string());
        }
        Some((at, s)) => {
            if !correct {
                push(ViolationKind::WrongAnswer, format!("last number is {s}, expected {}", problem.answer));
            }
            if let Some(&(s, e)) = sentence_spans(&text).last() {
                if !(s..e).contains(at) {
                    push(ViolationKind::AnswerNotAtEnd, format!("last sentence has no number: {}", evidence(&text[s..e])));
                }
            }
        }
    }
    if let Some((kind, ev)) = steps_violation(&text) {
        push(kind, ev);
    }
    let satisfied = v.is_empty();
    Verdict { violations: v, satisfied, correct, words, last_number: last.map(|(_, s)| s) }
}

// ---- the student's voice ----

/// Ways to ask for help; `{q}` is the question.
const ASKS: &[&str] = &[
    "can you help me with this one? {q}",
    "hey, I'm stuck on this homework problem: {q}",
    "how do I solve this? {q}",
    "{q} I don't get how to do this one.",
    "ok next one. {q}",
    "I have this for math homework, can you help? {q}",
];

/// Thanks when every preference is met (each carries a thanks cue and no correction or instruction cue).
const THANKS: &[&str] = &[
    "thanks, that's perfect",
    "great, thanks!",
    "perfect, thank you!",
    "ok that makes sense, thanks!",
    "awesome, thanks a lot",
];

/// Openers before the first correction.
const OPENERS: &[&str] = &["", "hmm, ", "ok but ", "ugh, "];

/// Connectors before the second correction.
const CONNECTORS: &[&str] = &["also ", "and ", "oh and ", "plus "];

/// One-sentence corrections per kind (`{label}` is the offending label text). Each carries a correction
/// cue that matches wherever the sentence sits.
fn corrections(kind: ViolationKind) -> &'static [&'static str] {
    use ViolationKind::*;
    match kind {
        Bold | Italics => &[
            "don't use bold, just write it out plainly instead.",
            "can you not use the bold and starred stuff and just write it normally instead?",
            "no bold text, just write it out like a normal message instead.",
        ],
        Header => &[
            "don't put headings in it, just write it like a normal message instead.",
            "no headers, can you write it again like you're texting me?",
        ],
        List | BulletLike => &[
            "don't make it a list, write it as normal sentences instead.",
            "can you write it in normal sentences instead of a list?",
            "no bullet points, can you talk me through it again in plain sentences?",
        ],
        Latex => &[
            "don't use the latex math code, just write the numbers normally instead.",
            "the math code symbols look weird, can you write it in plain words instead?",
        ],
        CodeFence => &[
            "can you take it out of the code block and just write it normally instead?",
            "no code blocks, just plain text instead.",
        ],
        TooLong => &[
            "way too long, can you do it again in a few sentences?",
            "that's way more than I need, keep it to a few sentences instead.",
            "too long, I only need a few sentences, can you try again?",
        ],
        Label => &[
            "don't label things like {label}, just talk me through it instead.",
            "it reads like a textbook with the {label} labels, can you say it casually instead?",
            "no labels like {label}, can you explain it again like a friend would?",
        ],
        AnswerNotAtEnd => &[
            "can you put the final number at the very end instead?",
            "just tell me the final number at the end instead of burying it.",
            "the final number should be the last thing, can you do it again that way?",
        ],
        WrongAnswer => &[
            "I don't think that's right, can you check it again?",
            "that's wrong I think, my answer key says something different.",
            "I'm pretty sure that's not right, can you check your math again?",
        ],
        NoNumber => &[
            "you forgot the final number, can you say it at the end?",
            "you forgot to tell me the actual number at the end.",
        ],
        MissingSteps => &[
            "can you show the work as numbered lines like Step 1: and Step 2: instead?",
            "you forgot to number the steps, write it again with Step 1: and Step 2: lines ending with the answer.",
            "I can't follow it like this, write it as steps like Step 1: and Step 2: instead.",
        ],
        MisnumberedSteps => &[
            "can you number the steps in order starting from Step 1: instead?",
            "the step numbers jump around, write the steps again in order as Step 1: then Step 2: and so on.",
        ],
    }
}

/// The student's reply to one response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudentReply {
    /// What the student says (the next state of the agent's turn).
    pub text: String,
    /// The student is happy: every enabled preference met (the reply is a thanks).
    pub satisfied: bool,
    /// The last number equals the answer.
    pub correct: bool,
    /// Every violation found ([`check`]), also those not mentioned in the reply.
    pub violations: Vec<Violation>,
    /// The violations the reply mentions (at most two; a missing number or a wrong answer first).
    pub mentioned: Vec<ViolationKind>,
    /// 1-based number of this reply within the problem's session.
    pub turn: u32,
    /// The session ends after this reply: a thanks, or `turn` reached `max_turns`.
    pub session_done: bool,
}

/// The simulated student: deterministic given its seed.
///
/// A session is one problem: the student sends [`Student::start_session`]'s message, the agent answers,
/// the student [`Student::reply`]s (a correction, "that's wrong", or thanks), the agent answers again, and
/// so on until a reply has `session_done` (a thanks, or `max_turns` replies). Each reply is the next state
/// of the agent's answer before it, so it must reach the pipeline as the next user message of the same
/// session, the last one (a thanks, or the final correction) included.
#[derive(Debug, Clone)]
pub struct Student {
    seed: u64,
    prefs: Preferences,
    max_turns: u32,
    turns: BTreeMap<usize, u32>,
}

impl Student {
    /// A student with these preferences who gives up on a problem after `max_turns` replies.
    ///
    /// # Errors
    /// [`Error::Config`] when `max_turns` is 0 or the preferences conflict ([`Preferences::validate`]).
    pub fn new(seed: u64, prefs: Preferences, max_turns: u32) -> Result<Student> {
        if max_turns == 0 {
            return Err(Error::Config("the student's max_turns must be at least 1, got 0".into()));
        }
        prefs.validate()?;
        Ok(Student { seed, prefs, max_turns, turns: BTreeMap::new() })
    }

    /// The hidden preferences.
    pub fn preferences(&self) -> &Preferences {
        &self.prefs
    }

    /// Replies per session before the student gives up.
    pub fn max_turns(&self) -> u32 {
        self.max_turns
    }

    /// A generator seeded from sha256 of (seed, what, problem id, turn, text).
    fn rng(&self, what: &str, problem_id: usize, turn: u32, text: &str) -> rand::rngs::StdRng {
        let h = content_hash(&[
            &self.seed.to_le_bytes(),
            what.as_bytes(),
            &(problem_id as u64).to_le_bytes(),
            &turn.to_le_bytes(),
            text.as_bytes(),
        ]);
        // content_hash is 32 hex digits; the first 16 are a u64.
        let seed = u64::from_str_radix(&h[..16], 16).unwrap_or(self.seed);
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    /// The student's first message for `problem`: the question phrased casually (same text for the same
    /// seed and problem).
    pub fn first_message(&self, problem: &Problem) -> String {
        let mut rng = self.rng("ask", problem.id, 0, "");
        let t = ASKS.choose(&mut rng).copied().unwrap_or("{q}");
        t.replace("{q}", problem.question.trim())
    }

    /// Starts (or restarts) the session for `problem`: resets its turn count and returns the first message.
    pub fn start_session(&mut self, problem: &Problem) -> String {
        self.turns.insert(problem.id, 0);
        self.first_message(problem)
    }

    /// Replies to the agent's `response` for `problem` as the next turn of its session (turns count per
    /// problem since [`Student::start_session`], or since the first reply).
    pub fn reply(&mut self, response: &str, problem: &Problem) -> StudentReply {
        let turn = self.turns.entry(problem.id).or_insert(0);
        *turn += 1;
        let turn = *turn;
        self.reply_at(response, problem, turn)
    }

    /// The reply at a given 1-based `turn` of the problem's session, without touching the turn counts
    /// (a pure function of seed, preferences, `max_turns`, problem, response and turn).
    pub fn reply_at(&self, response: &str, problem: &Problem, turn: u32) -> StudentReply {
        let verdict = check(response, problem, &self.prefs);
        let satisfied = verdict.satisfied;
        let mut rng = self.rng("reply", problem.id, turn, response);
        let has = |k: ViolationKind| verdict.violations.iter().any(|v| v.kind == k);
        // The answer first: "you forgot the number" covers a wrong answer when there is no number at all.
        let mut mentioned: Vec<(ViolationKind, String)> = vec![];
        if has(ViolationKind::NoNumber) || (has(ViolationKind::WrongAnswer) && verdict.last_number.is_none()) {
            mentioned.push((ViolationKind::NoNumber, String::new()));
        } else if has(ViolationKind::WrongAnswer) {
            mentioned.push((ViolationKind::WrongAnswer, String::new()));
        }
        for v in &verdict.violations {
            let covered = matches!(v.kind, ViolationKind::NoNumber | ViolationKind::WrongAnswer);
            // List and bullet-like lines get the same correction: mention it once.
            let same = mentioned.iter().any(|(k, _)| corrections(*k) == corrections(v.kind));
            if !covered && !same {
                mentioned.push((v.kind, v.evidence.replace('`', "\"")));
            }
        }
        mentioned.truncate(2);
        let text = if satisfied {
            THANKS.choose(&mut rng).copied().unwrap_or("thanks").to_string()
        } else {
            let mut parts = vec![];
            for (i, (kind, ev)) in mentioned.iter().enumerate() {
                let t = corrections(*kind).choose(&mut rng).copied().unwrap_or_default().replace("{label}", ev);
                let lead = if i == 0 { OPENERS } else { CONNECTORS };
                parts.push(format!("{}{t}", lead.choose(&mut rng).copied().unwrap_or_default()));
            }
            parts.join(" ")
        };
        StudentReply {
            text,
            satisfied,
            correct: verdict.correct,
            violations: verdict.violations,
            mentioned: mentioned.into_iter().map(|(k, _)| k).collect(),
            turn,
            session_done: satisfied || turn >= self.max_turns,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
