//! Normalisation shared by every adapter: raw JSON chat messages → [`Message`].
//!
//! Rules (METHOD.md §1 and the ingest issue):
//! - roles: `developer` → `system`, `function` and `ipython` → `tool` (each mapping leaves a note);
//!   any other role outside `system`/`user`/`assistant`/`tool` is an error ([`NormError::UnknownRole`]).
//! - content: `null` → `""`; a list of parts → the text parts joined with `"\n"` (parts of type `text`,
//!   `input_text`, `output_text`, or bare strings); every other part is dropped and counted in a note
//!   ("dropped 2 non-text content parts"); `thinking`/`reasoning` parts go to the reasoning text.
//! - reasoning (assistant messages only): a `reasoning_content` or `reasoning` string field; a
//!   `<think>…</think>` block in the content; a content carrying only the closing `</think>` (the
//!   opening tag was in the prompt) = everything before it is reasoning; an unclosed `<think>` =
//!   truncated reasoning: all of it is reasoning and [`Normalized::truncated`] is set.
//! - tool calls: OpenAI `tool_calls` (`{id, type, function: {name, arguments}}`), flat
//!   `{id, name, arguments}`, or the legacy `function_call` object. String arguments are parsed as JSON
//!   into [`ToolCall::arguments`] and the string is kept in [`ToolCall::arguments_raw`]; unparseable
//!   arguments give `null` and a note.
//! - text is never rewritten otherwise: CRLF line ends and whitespace stay as logged (except the
//!   whitespace between a closing `</think>` and the visible answer, which belongs to the tag).

use serde_json::{Map, Value};

use crate::schema::{Message, ToolCall};

/// Why a raw message could not be normalised (becomes a dead-letter reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NormError {
    /// The message is not a JSON object.
    NotAnObject(&'static str),
    /// `role` is missing or not a string.
    MissingRole,
    /// A role we do not know how to map.
    UnknownRole(String),
    /// A field has the wrong JSON type (field name, type found).
    WrongType(&'static str, &'static str),
    /// A tool call without a function name (index of the call).
    ToolCallWithoutName(usize),
}

impl NormError {
    /// Short machine-readable reason code for dead letters.
    pub fn code(&self) -> &'static str {
        match self {
            NormError::NotAnObject(_) | NormError::WrongType(..) => "wrong_type",
            NormError::MissingRole => "missing_role",
            NormError::UnknownRole(_) => "unknown_role",
            NormError::ToolCallWithoutName(_) => "tool_call_without_name",
        }
    }
}

impl std::fmt::Display for NormError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NormError::NotAnObject(found) => write!(f, "message is a JSON {found}, expected an object"),
            NormError::MissingRole => write!(f, "message has no string `role`"),
            NormError::UnknownRole(r) => write!(f, "unknown message role {r:?}"),
            NormError::WrongType(field, found) => write!(f, "field `{field}` is a JSON {found}"),
            NormError::ToolCallWithoutName(i) => write!(f, "tool call {i} has no function name"),
        }
    }
}

/// A normalised message plus what normalisation noticed.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalized {
    /// The message.
    pub message: Message,
    /// Notes for the interaction (role mapped, parts dropped, unparseable arguments, ...).
    pub notes: Vec<String>,
    /// The reasoning block never closed (`<think>` without `</think>`): the response was cut.
    pub truncated: bool,
}

/// Name of a JSON value's type, for error messages.
pub fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Maps a logged role to one of `system`, `user`, `assistant`, `tool`; the second value is the note
/// to record when the role was changed.
///
/// # Errors
/// [`NormError::UnknownRole`] for any other role.
pub fn map_role(role: &str) -> Result<(&'static str, Option<String>), NormError> {
    Ok(match role {
        "system" => ("system", None),
        "user" => ("user", None),
        "assistant" => ("assistant", None),
        "tool" => ("tool", None),
        "developer" => ("system", Some("developer role mapped to system".into())),
        "function" => ("tool", Some("function role mapped to tool".into())),
        "ipython" => ("tool", Some("ipython role mapped to tool".into())),
        other => return Err(NormError::UnknownRole(other.to_string())),
    })
}

/// Normalises one raw chat message (OpenAI chat format and its common variants).
///
/// # Errors
/// [`NormError`] when the value is not an object, has no or an unknown role, a field has the wrong
/// type, or a tool call has no name.
pub fn normalize_message(raw: &Value) -> Result<Normalized, NormError> {
    let obj = raw.as_object().ok_or(NormError::NotAnObject(json_type(raw)))?;
    let role_raw = match obj.get("role") {
        Some(Value::String(s)) => s.as_str(),
        _ => return Err(NormError::MissingRole),
    };
    let (role, role_note) = map_role(role_raw)?;
    normalize_with_role(obj, role, role_note)
}

/// Like [`normalize_message`] but with the role already decided by the adapter (e.g. AgentBench's
/// `agent` → `assistant`, an OpenAI response message without a role).
///
/// # Errors
/// As [`normalize_message`], except for role errors.
pub fn normalize_with_role(obj: &Map<String, Value>, role: &str, role_note: Option<String>) -> Result<Normalized, NormError> {
    let mut notes: Vec<String> = role_note.into_iter().collect();
    let (mut content, part_reasoning) = content_text(obj.get("content"), &mut notes)?;
    let mut reasoning = part_reasoning;
    for key in ["reasoning_content", "reasoning"] {
        match obj.get(key) {
            Some(Value::String(s)) if !s.is_empty() => append(&mut reasoning, s),
            Some(Value::Null) | None | Some(Value::String(_)) => {}
            // Some servers log structured reasoning (`{"summary": ...}`): keep its text.
            Some(v @ Value::Object(_)) | Some(v @ Value::Array(_)) => append(&mut reasoning, &v.to_string()),
            Some(v) => return Err(NormError::WrongType(if key == "reasoning" { "reasoning" } else { "reasoning_content" }, json_type(v))),
        }
    }
    let mut truncated = false;
    if role == "assistant" {
        let split = split_reasoning(&content);
        if let Some(r) = split.reasoning {
            append(&mut reasoning, &r);
            content = split.visible;
        }
        truncated = split.truncated;
    }
    let mut tool_calls = Vec::new();
    match obj.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (i, c) in calls.iter().enumerate() {
                tool_calls.push(tool_call(c, i, &mut notes)?);
            }
        }
        Some(v) => return Err(NormError::WrongType("tool_calls", json_type(v))),
    }
    match obj.get("function_call") {
        None | Some(Value::Null) => {}
        Some(c @ Value::Object(_)) => {
            let i = tool_calls.len();
            tool_calls.push(tool_call(c, i, &mut notes)?);
        }
        Some(v) => return Err(NormError::WrongType("function_call", json_type(v))),
    }
    let tool_call_id = match obj.get("tool_call_id") {
        Some(Value::String(s)) => Some(s.clone()),
        None | Some(Value::Null) => match obj.get("tool_call_ids") {
            // SWE-agent (function-calling versions) logs a list of ids on tool messages.
            Some(Value::Array(ids)) => {
                if ids.len() > 1 {
                    notes.push(format!("tool message answers {} call ids; kept the first", ids.len()));
                }
                ids.first().and_then(Value::as_str).map(str::to_string)
            }
            _ => None,
        },
        Some(v) => return Err(NormError::WrongType("tool_call_id", json_type(v))),
    };
    let name = match obj.get("name") {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    Ok(Normalized {
        message: Message { role: role.to_string(), content, reasoning, tool_calls, tool_call_id, name },
        notes,
        truncated,
    })
}

fn append(dst: &mut Option<String>, s: &str) {
    match dst {
        Some(d) if !d.is_empty() => {
            d.push('\n');
            d.push_str(s);
        }
        _ => *dst = Some(s.to_string()),
    }
}

/// Content → (visible text, reasoning from `thinking` parts). Non-text parts are dropped with a note.
fn content_text(content: Option<&Value>, notes: &mut Vec<String>) -> Result<(String, Option<String>), NormError> {
    match content {
        None | Some(Value::Null) => Ok((String::new(), None)),
        Some(Value::String(s)) => Ok((s.clone(), None)),
        Some(Value::Array(parts)) => {
            let mut texts: Vec<&str> = Vec::new();
            let mut reasoning: Option<String> = None;
            let mut dropped = 0usize;
            for p in parts {
                match p {
                    Value::String(s) => texts.push(s),
                    Value::Object(o) => {
                        let ty = o.get("type").and_then(Value::as_str).unwrap_or("text");
                        match (ty, o.get("text"), o.get("thinking")) {
                            ("text" | "input_text" | "output_text", Some(Value::String(t)), _) => texts.push(t),
                            ("thinking" | "reasoning", _, Some(Value::String(t))) | ("thinking" | "reasoning", Some(Value::String(t)), _) => {
                                append(&mut reasoning, t)
                            }
                            _ => dropped += 1,
                        }
                    }
                    _ => dropped += 1,
                }
            }
            if dropped > 0 {
                notes.push(format!("dropped {dropped} non-text content part{}", if dropped == 1 { "" } else { "s" }));
            }
            Ok((texts.join("\n"), reasoning))
        }
        Some(Value::Object(o)) => match o.get("text") {
            Some(Value::String(t)) => Ok((t.clone(), None)),
            _ => Err(NormError::WrongType("content", "object")),
        },
        Some(v) => Err(NormError::WrongType("content", json_type(v))),
    }
}

/// Result of splitting reasoning tags off an assistant text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningSplit {
    /// The visible text (outside the reasoning block).
    pub visible: String,
    /// The reasoning text, when the text had a reasoning block.
    pub reasoning: Option<String>,
    /// An opening `<think>` never closed: the response was cut inside its reasoning.
    pub truncated: bool,
}

/// Splits `<think>…</think>` reasoning off an assistant text (see the module doc for the three cases).
/// Leading whitespace after the closing tag and around the reasoning is trimmed; the text before an
/// opening tag is kept.
pub fn split_reasoning(text: &str) -> ReasoningSplit {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    match (text.find(OPEN), text.find(CLOSE)) {
        (Some(o), Some(c)) if o < c => {
            let before = &text[..o];
            let inner = &text[o + OPEN.len()..c];
            let after = text[c + CLOSE.len()..].trim_start();
            let mut visible = before.to_string();
            visible.push_str(after);
            ReasoningSplit { visible, reasoning: Some(inner.trim().to_string()), truncated: false }
        }
        (_, Some(c)) => {
            // Only the closing tag (the template opened the block in the prompt).
            ReasoningSplit {
                visible: text[c + CLOSE.len()..].trim_start().to_string(),
                reasoning: Some(text[..c].trim().to_string()),
                truncated: false,
            }
        }
        (Some(o), None) => ReasoningSplit {
            visible: text[..o].to_string(),
            reasoning: Some(text[o + OPEN.len()..].trim().to_string()),
            truncated: true,
        },
        (None, None) => ReasoningSplit { visible: text.to_string(), reasoning: None, truncated: false },
    }
}

/// Parses one tool call in any of the logged shapes.
fn tool_call(c: &Value, index: usize, notes: &mut Vec<String>) -> Result<ToolCall, NormError> {
    let obj = c.as_object().ok_or(NormError::WrongType("tool_calls[]", json_type(c)))?;
    let func = match obj.get("function") {
        Some(Value::Object(f)) => f,
        _ => obj,
    };
    let name = match func.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(NormError::ToolCallWithoutName(index)),
    };
    let id = match obj.get("id") {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    let (arguments, arguments_raw) = match func.get("arguments").or_else(|| func.get("input")) {
        None | Some(Value::Null) => (Value::Null, None),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v) => (v, Some(s.clone())),
            Err(e) => {
                notes.push(format!("tool call {index} ({name}) arguments are not valid JSON ({e}); kept raw"));
                (Value::Null, Some(s.clone()))
            }
        },
        Some(v) => (v.clone(), None),
    };
    Ok(ToolCall { id, name, arguments, arguments_raw })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn developer_becomes_system_with_a_note() {
        let n = normalize_message(&json!({"role": "developer", "content": "be brief"})).unwrap();
        assert_eq!(n.message.role, "system");
        assert_eq!(n.message.content, "be brief");
        assert_eq!(n.notes, vec!["developer role mapped to system".to_string()]);
    }

    #[test]
    fn function_becomes_tool_and_keeps_name() {
        let n = normalize_message(&json!({"role": "function", "name": "f", "content": "{\"error\": \"\"}"})).unwrap();
        assert_eq!(n.message.role, "tool");
        assert_eq!(n.message.name.as_deref(), Some("f"));
        assert_eq!(n.notes, vec!["function role mapped to tool".to_string()]);
    }

    #[test]
    fn unknown_role_is_an_error() {
        let e = normalize_message(&json!({"role": "narrator", "content": "x"})).unwrap_err();
        assert_eq!(e, NormError::UnknownRole("narrator".into()));
        assert_eq!(e.code(), "unknown_role");
        assert_eq!(normalize_message(&json!("hi")).unwrap_err(), NormError::NotAnObject("string"));
        assert_eq!(normalize_message(&json!({"content": "x"})).unwrap_err(), NormError::MissingRole);
        assert_eq!(normalize_message(&json!({"role": "user", "content": 5})).unwrap_err(), NormError::WrongType("content", "number"));
    }

    #[test]
    fn list_content_joins_text_and_counts_dropped_parts() {
        let n = normalize_message(&json!({"role": "user", "content": [
            {"type": "text", "text": "look at"},
            {"type": "image_url", "image_url": {"url": "data:..."}},
            "this",
            {"type": "input_audio"}
        ]}))
        .unwrap();
        assert_eq!(n.message.content, "look at\nthis");
        assert_eq!(n.notes, vec!["dropped 2 non-text content parts".to_string()]);
    }

    #[test]
    fn null_content_is_empty() {
        let n = normalize_message(&json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"user_id\":\"mia\"}"}}
        ]}))
        .unwrap();
        assert_eq!(n.message.content, "");
        assert_eq!(n.message.tool_calls.len(), 1);
        let tc = &n.message.tool_calls[0];
        assert_eq!(tc.id.as_deref(), Some("c1"));
        assert_eq!(tc.arguments, json!({"user_id": "mia"}));
        assert_eq!(tc.arguments_raw.as_deref(), Some("{\"user_id\":\"mia\"}"));
    }

    #[test]
    fn unparseable_arguments_are_null_with_a_note() {
        let n = normalize_message(&json!({"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"a\": 1"}}
        ]}))
        .unwrap();
        assert_eq!(n.message.tool_calls[0].arguments, Value::Null);
        assert_eq!(n.message.tool_calls[0].arguments_raw.as_deref(), Some("{\"a\": 1"));
        assert_eq!(n.notes.len(), 1);
        assert!(n.notes[0].starts_with("tool call 0 (f) arguments are not valid JSON"), "{}", n.notes[0]);
    }

    #[test]
    fn legacy_function_call_is_a_tool_call() {
        let n = normalize_message(&json!({"role": "assistant", "content": null,
            "function_call": {"name": "Finish", "arguments": "{\n  \"return_type\": \"give_answer\"\n}"}}))
        .unwrap();
        assert_eq!(n.message.tool_calls.len(), 1);
        assert_eq!(n.message.tool_calls[0].name, "Finish");
        assert_eq!(n.message.tool_calls[0].id, None);
        assert_eq!(n.message.tool_calls[0].arguments, json!({"return_type": "give_answer"}));
    }

    #[test]
    fn think_block_is_split() {
        let s = split_reasoning("<think>\nplan it\n</think>\n\nThe answer is 4.");
        assert_eq!(s.visible, "The answer is 4.");
        assert_eq!(s.reasoning.as_deref(), Some("plan it"));
        assert!(!s.truncated);
    }

    #[test]
    fn closing_tag_only_means_everything_before_is_reasoning() {
        let s = split_reasoning("first I add\n</think>\n\n4");
        assert_eq!(s.visible, "4");
        assert_eq!(s.reasoning.as_deref(), Some("first I add"));
        assert!(!s.truncated);
    }

    #[test]
    fn unclosed_think_is_truncated_reasoning() {
        let s = split_reasoning("<think>let me count: 1, 2, 3");
        assert_eq!(s.visible, "");
        assert_eq!(s.reasoning.as_deref(), Some("let me count: 1, 2, 3"));
        assert!(s.truncated);
        let n = normalize_message(&json!({"role": "assistant", "content": "<think>going on"})).unwrap();
        assert!(n.truncated);
        assert_eq!(n.message.reasoning.as_deref(), Some("going on"));
    }

    #[test]
    fn think_tags_in_user_messages_are_left_alone() {
        let n = normalize_message(&json!({"role": "user", "content": "what does <think> do?"})).unwrap();
        assert_eq!(n.message.content, "what does <think> do?");
        assert!(n.message.reasoning.is_none());
    }

    #[test]
    fn reasoning_field_is_kept() {
        let n = normalize_message(&json!({"role": "assistant", "content": "4", "reasoning_content": "2+2"})).unwrap();
        assert_eq!(n.message.reasoning.as_deref(), Some("2+2"));
        assert_eq!(n.message.content, "4");
    }

    #[test]
    fn crlf_is_kept_verbatim() {
        let n = normalize_message(&json!({"role": "tool", "content": "line1\r\nline2\r\n", "tool_call_id": "x"})).unwrap();
        assert_eq!(n.message.content, "line1\r\nline2\r\n");
        assert_eq!(n.message.tool_call_id.as_deref(), Some("x"));
    }

    #[test]
    fn swe_agent_tool_call_ids_list() {
        let n = normalize_message(&json!({"role": "tool", "content": "ok", "tool_call_ids": ["a", "b"]})).unwrap();
        assert_eq!(n.message.tool_call_id.as_deref(), Some("a"));
        assert_eq!(n.notes, vec!["tool message answers 2 call ids; kept the first".to_string()]);
    }
}
