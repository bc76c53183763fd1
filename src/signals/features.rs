//! Classifying a next state and extracting cheap features from it (docs/method.md §1–2).
//!
//! The pattern lists are public so the rule-based judge can use the same cues. All are Rust `regex`
//! sources; each list is compiled once. They are heuristics for features and a coarse kind, not
//! verdicts: the PRM judge reads the full next-state text.
//!
//! **Kind** ([`classify`]): the kind of the first non-system message of the next state: role
//! `tool` → [`NextStateKind::Tool`]; role `user` whose text looks like program output
//! ([`ENVIRONMENT_PATTERNS`]) → [`NextStateKind::Environment`]; any other `user` message →
//! [`NextStateKind::User`]; only system messages → `Environment`.
//!
//! **Features** ([`features`]): `has_error` and `exit_code` look at every message; `correction_cue` and
//! `thanks_cue` only at human user messages (user role, not program output); `success_cue` only at
//! tool and environment messages (or an exit code of 0), and only when nothing in the next state is
//! an error (so "1 failed, 1 passed" is an error, not a success).

use std::sync::LazyLock;

use regex::{Regex, RegexSet};

use crate::schema::{Message, NextStateKind};

/// A `user` message matching any of these is program/tool output sent back as a user message
/// (mini-swe-agent `<returncode>`/`<output>`, SWE-agent observations with their `(Open file: …)` /
/// `(Current directory: …)` / `bash-$` footer, `[File: …]` editor views, diffs, tracebacks,
/// `OBSERVATION` blocks, exit-code lines).
pub const ENVIRONMENT_PATTERNS: &[&str] = &[
    r"<returncode>\s*-?\d+\s*</returncode>",
    r"<output>",
    r"(?m)^\s*OBSERVATION\b",
    r"Traceback \(most recent call last\)",
    r"\(Current directory: [^)]*\)",
    r"\(Open file: [^)]*\)",
    r"(?m)^bash-\$\s*$",
    r"(?m)^\s*diff --git ",
    r"(?m)^\[File: [^\]]+\]",
    r"Your command ran successfully and did not produce any output",
    r"(?i)\bcommand (?:exited|completed|finished) with (?:exit )?code -?\d+",
];

/// An error in the next state: tracebacks, `SomethingError:` / `Exception:` / `Error:`, `error:` at
/// the start of a tool's message line, a non-empty JSON `"error"` field (an empty `"error": ""`, as
/// ToolBench logs on success, is not an error), missing files, API/HTTP failures. A non-zero exit code
/// also sets `has_error`.
pub const ERROR_PATTERNS: &[&str] = &[
    r"Traceback \(most recent call last\)",
    r"\b(?:[A-Z]\w*)?(?:Error|Exception)\b:",
    r"(?m)^(?:\S+: )*error: ",
    r#""error"\s*:\s*"[^"]"#,
    r#""error"\s*:\s*\{"#,
    r"No such file or directory",
    r"(?i)\bcommand not found\b",
    r"(?i)\b(?:api error|rate limit(?:ed)?|internal server error|service unavailable|bad gateway)\b",
    r"(?i)\b(?:status code|HTTP) [45]\d\d\b",
];

/// Exit codes: `<returncode>N</returncode>`, `exit code N`, `exit code: N`, `exited with code N`,
/// `exited with exit code N` (the first match in message order is used).
pub const EXIT_CODE_PATTERNS: &[&str] = &[
    r"<returncode>\s*(-?\d+)\s*</returncode>",
    r"(?i)\bexit(?:ed)?(?: with)?(?: exit)? code:?\s*(-?\d+)",
];

/// Explicit correction / redo cues in a person's reply: a reply opening with "no", "that's wrong",
/// "not what I asked/meant", "again", "instead", an imperative "don't"/"do not" (at the start of a
/// sentence, so "I don't have it" is not a cue), "redo", "you forgot", "I said/meant", "it's
/// incorrect".
pub const CORRECTION_CUES: &[&str] = &[
    r"(?i)^\s*no\b",
    r"(?i)\b(?:that'?s|that is|it'?s|it is|you'?re|you are|this is) (?:wrong|incorrect|not right|not correct|not what)\b",
    r"(?i)\bnot what i (?:asked|meant|wanted|said)\b",
    r"(?i)\bagain\b",
    r"(?i)\binstead\b",
    r"(?i)(?:^|[.!?]\s+)(?:don'?t|do not)\b",
    r"(?i)\b(?:please )?redo\b",
    r"(?i)\byou forgot\b",
    r"(?i)\bi (?:said|meant)\b",
];

/// Thanks / approval cues in a person's reply.
pub const THANKS_CUES: &[&str] = &[
    r"(?i)\bthank(?:s| you)\b",
    r"(?i)\bgreat\b",
    r"(?i)\bperfect\b",
    r"(?i)\bworks\b",
    r"(?i)\bawesome\b",
    r"(?i)\bexcellent\b",
    r"(?i)\bappreciate",
];

/// Success cues in tool/environment output (an exit code of 0 also counts).
pub const SUCCESS_CUES: &[&str] = &[
    r"(?i)\btests? passed\b",
    r"(?i)\ball tests pass",
    r"(?i)\b\d+ passed\b",
    r"(?i)\bsuccess(?:ful|fully)?\b",
];

fn set(p: &[&str]) -> RegexSet {
    // The lists are constants checked by the unit tests: a bad pattern is a bug on our side.
    RegexSet::new(p).unwrap_or_else(|e| panic!("invalid built-in pattern: {e}"))
}

static ENV: LazyLock<RegexSet> = LazyLock::new(|| set(ENVIRONMENT_PATTERNS));
static ERR: LazyLock<RegexSet> = LazyLock::new(|| set(ERROR_PATTERNS));
static EXIT: LazyLock<Vec<Regex>> =
    LazyLock::new(|| EXIT_CODE_PATTERNS.iter().map(|p| Regex::new(p).unwrap_or_else(|e| panic!("invalid built-in pattern: {e}"))).collect());
static CORRECTION: LazyLock<RegexSet> = LazyLock::new(|| set(CORRECTION_CUES));
static THANKS: LazyLock<RegexSet> = LazyLock::new(|| set(THANKS_CUES));
static SUCCESS: LazyLock<RegexSet> = LazyLock::new(|| set(SUCCESS_CUES));

/// True when a user-role text looks like program output ([`ENVIRONMENT_PATTERNS`]).
pub fn is_environment_output(text: &str) -> bool {
    ENV.is_match(text)
}

/// True when `m` is a person speaking (role `user`, not program output).
pub fn is_human(m: &Message) -> bool {
    m.role == "user" && !is_environment_output(&m.content)
}

/// The kind of a next state (see the module doc).
pub fn classify(next_state: &[Message]) -> NextStateKind {
    match next_state.iter().find(|m| m.role != "system") {
        Some(m) if m.role == "tool" => NextStateKind::Tool,
        Some(m) if m.role == "user" && !is_environment_output(&m.content) => NextStateKind::User,
        _ => NextStateKind::Environment,
    }
}

/// Cheap features of a next state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// An error message or traceback, or a non-zero exit code.
    pub has_error: bool,
    /// The first exit code reported.
    pub exit_code: Option<i32>,
    /// A person asks for a correction or redo.
    pub correction_cue: bool,
    /// A person thanks or approves.
    pub thanks_cue: bool,
    /// Tool/environment output reports success (or exit code 0).
    pub success_cue: bool,
}

/// The first exit code in `text`, if any.
pub fn exit_code(text: &str) -> Option<i32> {
    EXIT.iter()
        .filter_map(|re| re.captures(text).and_then(|c| c.get(1)).map(|m| (m.start(), m.as_str())))
        .min_by_key(|(pos, _)| *pos)
        .and_then(|(_, s)| s.parse().ok())
}

/// Features of a next state (see the module doc for which messages each feature reads).
pub fn features(next_state: &[Message]) -> Features {
    let mut f = Features::default();
    for m in next_state {
        let text = m.content.as_str();
        f.has_error |= ERR.is_match(text);
        if f.exit_code.is_none() {
            f.exit_code = exit_code(text);
        }
        if is_human(m) {
            f.correction_cue |= CORRECTION.is_match(text);
            f.thanks_cue |= THANKS.is_match(text);
        } else if m.role == "tool" || m.role == "user" {
            f.success_cue |= SUCCESS.is_match(text);
        }
    }
    match f.exit_code {
        Some(0) => f.success_cue = true,
        Some(_) => f.has_error = true,
        None => {}
    }
    // A success cue is a clean success: output that also reports an error ("1 failed, 1 passed",
    // exit 0 after a traceback) is not one.
    f.success_cue &= !f.has_error;
    f
}

/// The next state as plain text: one `[role] content` block per message, joined by newlines.
pub fn render(next_state: &[Message]) -> String {
    let mut s = String::new();
    for (i, m) in next_state.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push('[');
        s.push_str(&m.role);
        s.push_str("] ");
        s.push_str(&m.content);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(s: &str) -> Message {
        Message::text("user", s)
    }
    fn tool(s: &str) -> Message {
        Message::text("tool", s)
    }

    #[test]
    fn all_patterns_compile() {
        for p in [ENVIRONMENT_PATTERNS, ERROR_PATTERNS, EXIT_CODE_PATTERNS, CORRECTION_CUES, THANKS_CUES, SUCCESS_CUES].concat() {
            Regex::new(p).unwrap();
        }
    }

    #[test]
    fn kinds() {
        assert_eq!(classify(&[tool("{}")]), NextStateKind::Tool);
        assert_eq!(classify(&[user("No, I mean by Goldbach's conjecture!")]), NextStateKind::User);
        assert_eq!(classify(&[user("<returncode>1</returncode>\n<output>\nboom\n</output>")]), NextStateKind::Environment);
        assert_eq!(classify(&[user("Script completed successfully, no errors. Result: True\n\n(Open file: /a.py)\n(Current directory: /r)\nbash-$")]), NextStateKind::Environment);
        assert_eq!(classify(&[user("\ndiff --git a/x b/x\n")]), NextStateKind::Environment);
        assert_eq!(classify(&[Message::text("system", "note"), user("thanks")]), NextStateKind::User);
        assert_eq!(classify(&[]), NextStateKind::Environment);
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code("<returncode>1</returncode>\n<output>"), Some(1));
        assert_eq!(exit_code("Command `ls` executed with exit code 0."), Some(0));
        assert_eq!(exit_code("process exited with code 137"), Some(137));
        assert_eq!(exit_code("exit code: -1"), Some(-1));
        assert_eq!(exit_code("[The command completed with exit code 2.]"), Some(2));
        assert_eq!(exit_code("no code here"), None);
    }

    #[test]
    fn errors() {
        let f = features(&[user("<returncode>1</returncode>\n<output>\nTraceback (most recent call last):\nZeroDivisionError: division by zero\n</output>")]);
        assert!(f.has_error && !f.success_cue);
        assert_eq!(f.exit_code, Some(1));
        assert!(features(&[tool("Error: flight HAT030 not available on date 2024-05-13")]).has_error);
        assert!(features(&[tool("- E999 SyntaxError: unmatched ']'")]).has_error);
        // ToolBench logs an empty error field on success.
        let ok = features(&[tool("{\"error\": \"\", \"response\": \"[{\\\"id\\\":\\\"EKVF\\\"}]\"}")]);
        assert!(!ok.has_error);
        assert!(features(&[tool("{\"error\": \"Rate limit exceeded\", \"response\": \"\"}")]).has_error);
        assert!(!features(&[user("I don't have any errors to report")]).has_error);
    }

    #[test]
    fn cues() {
        let f = features(&[user("No, I mean by Goldbach's conjecture!")]);
        assert!(f.correction_cue && !f.thanks_cue);
        assert!(features(&[user("That's not what I asked, please redo it")]).correction_cue);
        assert!(features(&[user("Don't book that one.")]).correction_cue);
        assert!(!features(&[user("I don't have my reservation ID with me.")]).correction_cue);
        assert!(features(&[user("Thank you. I'll reach out if needed. Appreciate your help.  ###STOP###")]).thanks_cue);
        assert!(features(&[user("Perfect, that works")]).thanks_cue);
        // Cues of a person are not read in program output, and success is not read from a person.
        let env = features(&[user("<returncode>0</returncode>\n<output>\nno thanks, again\n</output>")]);
        assert!(!env.correction_cue && !env.thanks_cue && env.success_cue);
        assert!(!features(&[user("it was a success")]).success_cue);
        assert!(features(&[tool("===== 12 passed in 0.3s =====")]).success_cue);
        let mixed = features(&[tool("FAILED test_x.py::test_add - AssertionError: assert 3 == 4\r\n1 failed, 1 passed")]);
        assert!(mixed.has_error && !mixed.success_cue);
    }

    #[test]
    fn rendering() {
        assert_eq!(render(&[tool("a\r\nb"), user("c")]), "[tool] a\r\nb\n[user] c");
        assert_eq!(render(&[]), "");
    }
}
