//! Prompt templates for the PRM judge and the hint judge, and how a [`TurnContext`] is rendered into
//! them. The wording is ours (docs/method.md §2, §3 give the contract: the `\boxed{}` answer and the hint
//! delimiters); a template is identified by its id and the hash of its text, both stored with every
//! judgment and hint row and part of every vote-cache key.

use serde::{Deserialize, Serialize};

use super::turn::TurnContext;
use crate::schema::{content_hash, Message, NextStateKind};
use crate::{Error, Result};

/// One chat message sent to a judge endpoint (role and text only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system` or `user`.
    pub role: String,
    /// Text.
    pub content: String,
}

/// A judge prompt: a system message and a user message with `{{ request }}`, `{{ response }}`,
/// `{{ next_state }}` and `{{ next_state_kind }}` placeholders (minijinja syntax, no auto-escaping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptTemplate {
    /// Stable id stored with every row (`nextstate-prm-v1`, ...); bump it when the text changes.
    pub id: &'static str,
    /// System message text.
    pub system: &'static str,
    /// User message template.
    pub user: &'static str,
}

impl PromptTemplate {
    /// sha256 of the template text (system and user parts), truncated to 32 hex characters
    /// ([`content_hash`]).
    pub fn hash(&self) -> String {
        content_hash(&[self.id.as_bytes(), self.system.as_bytes(), self.user.as_bytes()])
    }

    /// Renders the two messages for one turn; every field is cut to at most `max_field_chars`
    /// characters by [`truncate_middle`].
    ///
    /// # Errors
    /// [`Error::Internal`] when the template itself does not parse (a bug in a template constant).
    pub fn render(&self, turn: &TurnContext, max_field_chars: usize) -> Result<Vec<ChatMessage>> {
        let env = minijinja::Environment::new();
        let ctx = minijinja::context! {
            request => truncate_middle(&render_request(&turn.request), max_field_chars),
            response => truncate_middle(&render_response(&turn.response), max_field_chars),
            next_state => truncate_middle(&render_next_state(turn), max_field_chars),
            next_state_kind => describe_kind(turn.next_state_kind),
        };
        let user = env
            .render_str(self.user, ctx)
            .map_err(|e| Error::Internal(format!("prompt template {}: {e}", self.id)))?;
        Ok(vec![
            ChatMessage { role: "system".into(), content: self.system.to_string() },
            ChatMessage { role: "user".into(), content: user },
        ])
    }
}

/// The turn as the judge and the hint judge see it (the user message of [`JUDGE_TEMPLATE`] and
/// `crate::hint::HINT_TEMPLATE` starts with it): the request, the assistant's step, and what came back
/// next, each under its heading; a string literal, so each template stays one `&'static str`.
macro_rules! turn_sections {
    () => {
        "### The user's request (most recent user message and anything after it)
{{ request }}

### The assistant's step
{{ response }}

### What came back next ({{ next_state_kind }})
{{ next_state }}

"
    };
}
pub(crate) use turn_sections;

/// Our PRM judge prompt (docs/method.md §2): succeeded → `\boxed{1}`, failed → `\boxed{-1}`, can't tell →
/// `\boxed{0}`; change requests count negative, successful tool results positive.
pub const JUDGE_TEMPLATE: PromptTemplate = PromptTemplate {
    id: "nextstate-prm-v1",
    system: "You grade a single step taken by an AI assistant. You are shown what the user asked, \
the step the assistant took (its reply and any tool calls), and what came back right after that step: \
the user's next message, or the output of the tools or environment. Treat what came back as evidence \
of whether the step worked. Grade the step, not the user or the tools.",
    user: concat!(
        turn_sections!(),
        "Decide whether the assistant's step succeeded.
- 1: it worked. The user accepts it, thanks the assistant or goes on to something new, or the tool or \
environment reports success (the command ran, the tests pass, the requested data came back).
- -1: it did not work. The user asks for it to be redone, retried or changed, corrects it, or repeats \
or rephrases the same request; or the tool or environment reports an error that the step caused \
(traceback, failing tests, non-zero exit code, rejected arguments).
- 0: what came back does not show either way.
A request to change the result counts as -1. A tool result that reports success counts as 1.
Reason briefly, then end with your grade as the last thing you write: \\boxed{1}, \\boxed{0} or \\boxed{-1}."
    ),
};

/// Cuts `s` to at most `max_chars` characters (Unicode scalar values) by keeping its head and tail
/// and replacing the middle with a `[... N characters omitted ...]` line, so that both the start of a
/// request and the end of a traceback survive. `max_chars = 0` means no limit.
pub fn truncate_middle(s: &str, max_chars: usize) -> String {
    let n = s.chars().count();
    if max_chars == 0 || n <= max_chars {
        return s.to_string();
    }
    let head = max_chars / 2;
    let tail = max_chars - head;
    let omitted = n - head - tail;
    let head_s: String = s.chars().take(head).collect();
    let tail_s: String = s.chars().skip(n - tail).collect();
    format!("{head_s}\n[... {omitted} characters omitted ...]\n{tail_s}")
}

/// Renders one message as `[role]` then its text, tool calls as `[tool call] name(arguments)`, tool
/// results as `[tool result: name]`.
pub fn render_message(m: &Message) -> String {
    let header = match (m.role.as_str(), &m.name) {
        ("tool", Some(name)) => format!("[tool result: {name}]"),
        ("tool", None) => "[tool result]".to_string(),
        (role, _) => format!("[{role}]"),
    };
    let mut out = header;
    if !m.content.trim().is_empty() {
        out.push('\n');
        out.push_str(m.content.trim_end());
    }
    for c in &m.tool_calls {
        let args = match &c.arguments_raw {
            Some(raw) => raw.clone(),
            None => c.arguments.to_string(),
        };
        out.push_str(&format!("\n[tool call] {}({})", c.name, args));
    }
    out
}

/// The request as the judge sees it: the last user message and every message after it (tool
/// results the assistant already saw). Without a user message: a note and the last message.
pub fn render_request(request: &[Message]) -> String {
    match request.iter().rposition(|m| m.role == "user") {
        Some(i) => request[i..].iter().map(render_message).collect::<Vec<_>>().join("\n\n"),
        None => match request.last() {
            Some(last) => format!("(the request has no user message; its last message follows)\n{}", render_message(last)),
            None => "(empty request)".to_string(),
        },
    }
}

/// The response as the judge sees it: visible text and tool calls (reasoning is left out: the judge
/// grades what the assistant did).
pub fn render_response(response: &Message) -> String {
    let mut m = response.clone();
    m.role = "assistant".into();
    let out = render_message(&m);
    if response.content.trim().is_empty() && response.tool_calls.is_empty() {
        return "[assistant]\n(empty response)".to_string();
    }
    out
}

/// The next state as the judge sees it: the signal's plain text, else the rendered messages.
pub fn render_next_state(turn: &TurnContext) -> String {
    if !turn.next_state_text.trim().is_empty() {
        return turn.next_state_text.clone();
    }
    if turn.next_state.is_empty() {
        return "(nothing came back)".to_string();
    }
    turn.next_state.iter().map(render_message).collect::<Vec<_>>().join("\n\n")
}

/// Words for a next-state kind, used in the prompt heading.
pub fn describe_kind(kind: NextStateKind) -> &'static str {
    match kind {
        NextStateKind::User => "the user's reply",
        NextStateKind::Tool => "tool results",
        NextStateKind::Environment => "environment output",
        NextStateKind::None => "nothing",
    }
}

/// Renders chat messages into one prompt string for endpoints that take raw text (SGLang's native
/// `/generate`): each message as a `<|role|>` line followed by its text, then `<|assistant|>` to
/// cue the answer. This is a generic, model-agnostic rendering, **not** the judge model's own chat
/// template; pass the model's template as a renderer when it matters, or use the model's
/// OpenAI-compatible endpoint, which applies it.
pub fn render_role_tagged(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
    }
    out.push_str("<|assistant|>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::turn::tests::turn;
    use crate::schema::ToolCall;

    #[test]
    fn truncate_keeps_head_and_tail() {
        assert_eq!(truncate_middle("abcdef", 6), "abcdef");
        assert_eq!(truncate_middle("abcdef", 0), "abcdef");
        assert_eq!(truncate_middle("abcdefgh", 4), "ab\n[... 4 characters omitted ...]\ngh");
        // Counts characters, not bytes.
        assert_eq!(truncate_middle("ééééé", 2), "é\n[... 3 characters omitted ...]\né");
    }

    #[test]
    fn request_starts_at_last_user_message() {
        let req = vec![
            Message::text("system", "sys"),
            Message::text("user", "old"),
            Message::text("assistant", "a"),
            Message::text("user", "new request"),
            Message { name: Some("grep".into()), ..Message::text("tool", "match") },
        ];
        assert_eq!(render_request(&req), "[user]\nnew request\n\n[tool result: grep]\nmatch");
        assert_eq!(
            render_request(&req[..1]),
            "(the request has no user message; its last message follows)\n[system]\nsys"
        );
        assert_eq!(render_request(&[]), "(empty request)");
    }

    #[test]
    fn response_shows_tool_calls() {
        let mut r = Message::text("assistant", "Let me look.");
        r.tool_calls.push(ToolCall {
            id: None,
            name: "bash".into(),
            arguments: serde_json::json!({"cmd": "ls"}),
            arguments_raw: Some("{\"cmd\": \"ls\"}".into()),
        });
        assert_eq!(render_response(&r), "[assistant]\nLet me look.\n[tool call] bash({\"cmd\": \"ls\"})");
        assert_eq!(render_response(&Message::text("assistant", " ")), "[assistant]\n(empty response)");
    }

    #[test]
    fn judge_prompt_renders_all_fields_once() {
        let t = turn(vec![Message::text("user", "sum 2+2")], "4", NextStateKind::User, "thanks!");
        let msgs = JUDGE_TEMPLATE.render(&t, 1000).unwrap();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].role, "system");
        let u = &msgs[1].content;
        assert!(u.contains("### The user's request (most recent user message and anything after it)\n[user]\nsum 2+2\n"));
        assert!(u.contains("### The assistant's step\n[assistant]\n4\n"));
        assert!(u.contains("### What came back next (the user's reply)\nthanks!\n"));
        assert!(u.ends_with("\\boxed{1}, \\boxed{0} or \\boxed{-1}."));
        assert!(!u.contains("{{"));
    }

    #[test]
    fn placeholders_in_user_content_are_not_expanded() {
        let t = turn(vec![Message::text("user", "{{ response }} {% if x %}")], "R", NextStateKind::User, "{{ next_state }}");
        let u = &JUDGE_TEMPLATE.render(&t, 1000).unwrap()[1].content;
        assert!(u.contains("[user]\n{{ response }} {% if x %}\n"));
        assert!(u.contains("(the user's reply)\n{{ next_state }}\n"));
    }

    #[test]
    fn template_hash_is_stable_and_distinct() {
        assert_eq!(JUDGE_TEMPLATE.hash(), JUDGE_TEMPLATE.hash());
        assert_eq!(JUDGE_TEMPLATE.hash().len(), 32);
        let other = PromptTemplate { user: "x", ..JUDGE_TEMPLATE };
        assert_ne!(JUDGE_TEMPLATE.hash(), other.hash());
    }

    #[test]
    fn role_tagged_rendering() {
        let m = vec![
            ChatMessage { role: "system".into(), content: "S".into() },
            ChatMessage { role: "user".into(), content: "U".into() },
        ];
        assert_eq!(render_role_tagged(&m), "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n");
    }
}
