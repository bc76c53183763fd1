//! Normalisation shared by every adapter: raw JSON chat messages → [`Message`].
//!
//! Rules (docs/method.md §1 and the ingest issues):
//! - roles: `developer` → `system`, `function`, `ipython` and `toolResult` (OpenClaw) → `tool` (each
//!   mapping leaves a note); any other role outside `system`/`user`/`assistant`/`tool` is an error
//!   ([`NormError::UnknownRole`]).
//! - content: `null` → `""`; a string as is; a list of **content parts** is read by one part
//!   normaliser whatever API spelled it (Anthropic content blocks, OpenClaw blocks, OpenAI chat and
//!   Responses parts, OpenTelemetry GenAI message parts):
//!   - text — `text`, `input_text`, `output_text`, `refusal`, bare strings: joined with `"\n"`;
//!   - reasoning — `thinking` (`thinking`), `think` (`think`: Kimi CLI's kosong), `reasoning` (`text`/`content`/`summary[].text`): the
//!     reasoning text; `redacted_thinking` has none and is counted as dropped;
//!   - tool call — `tool_use`/`server_tool_use` (`id, name, input`), `toolCall` (`id, name,
//!     arguments` object), `function_call` (`call_id, name, arguments` string), `tool_call` (`id,
//!     name, arguments`): the message's tool calls;
//!   - tool result — `tool_result` (`tool_use_id, content`; `is_error` is not a field of ours: the
//!     result's text says what failed), `toolResult` (`toolCallId`),
//!     `function_call_output` (`call_id, output`), `tool_call_response` (`id, response`): each becomes
//!     its own `tool` message answering that id, placed before the message's own text
//!     ([`Normalized::before`]), so the tool's output survives as the next state;
//!   - Gemini parts (Gemini CLI, Qwen Code; no `type`): `{text}` is text, `{text, thought: true}`
//!     reasoning, `{functionCall: {id, name, args}}` a tool call, `{functionResponse: {id, name,
//!     response: {output} | {error}}}` a tool result;
//!   - everything else (images, audio, files, documents, blobs, URIs) is dropped and counted in a note
//!     ("dropped 2 non-text content parts").
//! - reasoning (assistant messages only): a `reasoning_content` or `reasoning` string field; a
//!   `<think>…</think>` block in the content; a content carrying only the closing `</think>` (the
//!   opening tag was in the prompt) = everything before it is reasoning; an unclosed `<think>` =
//!   truncated reasoning: all of it is reasoning and [`Normalized::truncated`] is set.
//! - tool calls: OpenAI `tool_calls` (`{id, type, function: {name, arguments}}`), flat
//!   `{id, name, arguments}`, or the legacy `function_call` object. String arguments are parsed as JSON
//!   into [`ToolCall::arguments`] and the string is kept in [`ToolCall::arguments_raw`]; unparseable
//!   arguments give `null` and a note.
//! - the id a tool message answers: `tool_call_id`, `toolCallId`, `tool_use_id` or `call_id`.
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
            NormError::NotAnObject(found) => {
                write!(f, "message is a JSON {found}, expected an object")
            }
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
    /// Tool results carried as content parts of this message (Anthropic `tool_result` blocks in a
    /// user message, Responses `function_call_output` items, ...), as `tool` messages in part order.
    /// They come before [`Normalized::message`] in the conversation.
    pub before: Vec<Message>,
}

impl Normalized {
    /// A message that needed no normalisation (no notes, not truncated, no tool results).
    pub fn new(message: Message) -> Normalized {
        Normalized { message, notes: vec![], truncated: false, before: vec![] }
    }

    /// The conversation messages this raw message stands for: its tool results, then the message
    /// itself — left out when it only carried tool results (no text, reasoning or tool calls).
    pub fn into_messages(self) -> Vec<Message> {
        let mut out = self.before;
        let m = self.message;
        if out.is_empty() || !m.content.trim().is_empty() || m.reasoning.is_some() || !m.tool_calls.is_empty() {
            out.push(m);
        }
        out
    }
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
        "toolResult" | "tool_result" => ("tool", None),
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

/// Normalises a request's raw messages in order, appending what normalisation noticed to `notes`; a
/// message carrying tool results as content parts stands for several ([`Normalized::into_messages`]).
///
/// # Errors
/// The index and error of the first message that does not normalise.
pub fn normalize_request(raw: &[Value], notes: &mut Vec<String>) -> Result<Vec<Message>, (usize, NormError)> {
    let mut out = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let mut n = normalize_message(m).map_err(|e| (i, e))?;
        notes.append(&mut n.notes);
        out.extend(n.into_messages());
    }
    Ok(out)
}

/// Like [`normalize_message`] but with the role already decided by the adapter (e.g. AgentBench's
/// `agent` → `assistant`, an OpenAI response message without a role).
///
/// # Errors
/// As [`normalize_message`], except for role errors.
pub fn normalize_with_role(obj: &Map<String, Value>, role: &str, role_note: Option<String>) -> Result<Normalized, NormError> {
    let mut notes: Vec<String> = role_note.into_iter().collect();
    let parts = content_parts(obj.get("content"), &mut notes)?;
    let mut content = parts.text;
    let mut reasoning = parts.reasoning;
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
    let mut tool_calls = parts.tool_calls;
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
    let id_field = ["tool_call_id", "toolCallId", "tool_use_id", "call_id"].into_iter().find_map(|k| obj.get(k).filter(|v| !v.is_null()));
    let tool_call_id = match id_field {
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
    let name = match obj.get("name").or_else(|| obj.get("toolName")) {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    Ok(Normalized { message: Message { role: role.to_string(), content, reasoning, tool_calls, tool_call_id, name }, notes, truncated, before: parts.results })
}

/// Appends `s` to an optional text, on a new line when there is text already.
pub(crate) fn append(dst: &mut Option<String>, s: &str) {
    match dst {
        Some(d) if !d.is_empty() => {
            d.push('\n');
            d.push_str(s);
        }
        _ => *dst = Some(s.to_string()),
    }
}

/// A message's content read part by part (see the module doc).
#[derive(Debug, Default)]
struct Parts {
    text: String,
    reasoning: Option<String>,
    tool_calls: Vec<ToolCall>,
    results: Vec<Message>,
}

/// What one content part is.
enum Part<'a> {
    Text(&'a str),
    Reasoning(String),
    Call,
    Result,
    Dropped,
}

fn classify(p: &Value) -> Part<'_> {
    let o = match p {
        Value::String(s) => return Part::Text(s),
        Value::Object(o) => o,
        _ => return Part::Dropped,
    };
    let str_of = |k: &str| o.get(k).and_then(Value::as_str);
    // Gemini `Part`s (Gemini CLI, Qwen Code) carry no `type`: the key names the part.
    if o.get("functionCall").is_some_and(Value::is_object) {
        return Part::Call;
    }
    if o.get("functionResponse").is_some_and(Value::is_object) {
        return Part::Result;
    }
    if o.get("thought") == Some(&Value::Bool(true)) {
        return str_of("text").map(|t| Part::Reasoning(t.to_string())).unwrap_or(Part::Dropped);
    }
    let ty = o.get("type").and_then(Value::as_str).unwrap_or("text");
    match ty {
        "text" | "input_text" | "output_text" => str_of("text").or_else(|| str_of("content")).map(Part::Text).unwrap_or(Part::Dropped),
        "refusal" => str_of("refusal").map(Part::Text).unwrap_or(Part::Dropped),
        "thinking" | "think" | "reasoning" | "reasoning_text" | "summary_text" => {
            if let Some(t) = str_of("thinking").or_else(|| str_of("think")).or_else(|| str_of("text")).or_else(|| str_of("content")) {
                return Part::Reasoning(t.to_string());
            }
            // Responses reasoning items: `summary: [{type: summary_text, text}]`.
            let summary: Vec<&str> =
                o.get("summary").and_then(Value::as_array).map(|a| a.iter().filter_map(|x| x.get("text").and_then(Value::as_str)).collect()).unwrap_or_default();
            if summary.is_empty() {
                Part::Dropped
            } else {
                Part::Reasoning(summary.join("\n"))
            }
        }
        "tool_use" | "server_tool_use" | "toolCall" | "function_call" | "tool_call" => Part::Call,
        "tool_result" | "toolResult" | "function_call_output" | "tool_call_response" => Part::Result,
        _ => Part::Dropped,
    }
}

/// The text of a tool result's payload: a string, content parts (their text joined; other parts
/// counted in `dropped`), or any other JSON written as JSON.
fn result_text(v: Option<&Value>, dropped: &mut usize) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts: Vec<&str> = vec![];
            for it in items {
                match classify(it) {
                    Part::Text(t) => texts.push(t),
                    _ => *dropped += 1,
                }
            }
            texts.join("\n")
        }
        Some(other) => other.to_string(),
    }
}

/// The text of a Gemini `functionResponse.response`: its `output` string, else `error: <error>`, else
/// the object as JSON (Gemini CLI writes `{output}` or `{error}`).
pub(crate) fn function_response_text(response: Option<&Value>) -> String {
    let Some(Value::Object(r)) = response else {
        return match response {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        };
    };
    let text = |v: &Value| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
    match (r.get("output"), r.get("error")) {
        (Some(out), _) if !out.is_null() => text(out),
        (_, Some(err)) if !err.is_null() => format!("error: {}", text(err)),
        _ => Value::Object(r.clone()).to_string(),
    }
}

/// A tool call content part → [`ToolCall`]: `call_id` (Responses) wins over `id`, `input` (Anthropic)
/// stands for `arguments`.
fn call_part(o: &Map<String, Value>, index: usize, notes: &mut Vec<String>) -> Result<ToolCall, NormError> {
    let o = o.get("functionCall").and_then(Value::as_object).unwrap_or(o);
    let mut tc = tool_call(&Value::Object(o.clone()), index, notes)?;
    if let Some(Value::String(cid)) = o.get("call_id") {
        tc.id = Some(cid.clone());
    }
    Ok(tc)
}

/// A tool result content part → a `tool` message answering its call id.
fn result_part(o: &Map<String, Value>, dropped: &mut usize) -> Message {
    if let Some(Value::Object(r)) = o.get("functionResponse") {
        let id = r.get("id").and_then(Value::as_str).map(str::to_string);
        let name = r.get("name").and_then(Value::as_str).map(str::to_string);
        return Message { tool_call_id: id, name, ..Message::text("tool", function_response_text(r.get("response"))) };
    }
    let id = ["tool_use_id", "toolCallId", "call_id", "id"].into_iter().find_map(|k| o.get(k).and_then(Value::as_str)).map(str::to_string);
    let payload = ["content", "output", "response", "result"].into_iter().find_map(|k| o.get(k));
    let name = o.get("name").or_else(|| o.get("toolName")).and_then(Value::as_str).map(str::to_string);
    Message { tool_call_id: id, name, ..Message::text("tool", result_text(payload, dropped)) }
}

/// Content → text, reasoning, tool calls and tool results. Other parts are dropped with a note.
fn content_parts(content: Option<&Value>, notes: &mut Vec<String>) -> Result<Parts, NormError> {
    let mut out = Parts::default();
    match content {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.text = s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts: Vec<&str> = Vec::new();
            let mut dropped = 0usize;
            for p in parts {
                match classify(p) {
                    Part::Text(t) => texts.push(t),
                    Part::Reasoning(r) => append(&mut out.reasoning, &r),
                    Part::Call => {
                        let i = out.tool_calls.len();
                        out.tool_calls.push(call_part(p.as_object().expect("classified as an object"), i, notes)?);
                    }
                    Part::Result => out.results.push(result_part(p.as_object().expect("classified as an object"), &mut dropped)),
                    Part::Dropped => dropped += 1,
                }
            }
            if dropped > 0 {
                notes.push(format!("dropped {dropped} non-text content part{}", if dropped == 1 { "" } else { "s" }));
            }
            out.text = texts.join("\n");
        }
        Some(Value::Object(o)) => match o.get("text") {
            Some(Value::String(t)) => out.text = t.clone(),
            _ => return Err(NormError::WrongType("content", "object")),
        },
        Some(v) => return Err(NormError::WrongType("content", json_type(v))),
    }
    Ok(out)
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
            ReasoningSplit { visible: text[c + CLOSE.len()..].trim_start().to_string(), reasoning: Some(text[..c].trim().to_string()), truncated: false }
        }
        (Some(o), None) => ReasoningSplit { visible: text[..o].to_string(), reasoning: Some(text[o + OPEN.len()..].trim().to_string()), truncated: true },
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
    let (arguments, arguments_raw) = match func.get("arguments").or_else(|| func.get("input")).or_else(|| func.get("args")) {
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

    #[test]
    fn content_parts_of_four_apis_are_one_idea() {
        // Anthropic: tool results in a user message become tool messages before the user's text.
        let n = normalize_message(&json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}, {"type": "image", "source": {}}], "is_error": false},
            {"type": "tool_result", "tool_use_id": "t2", "content": "done"},
            {"type": "text", "text": "thanks"}
        ]}))
        .unwrap();
        let ms = n.clone().into_messages();
        assert_eq!(
            ms.iter().map(|m| (m.role.as_str(), m.tool_call_id.as_deref(), m.content.as_str())).collect::<Vec<_>>(),
            vec![("tool", Some("t1"), "ok"), ("tool", Some("t2"), "done"), ("user", None, "thanks"),]
        );
        assert_eq!(n.notes, vec!["dropped 1 non-text content part".to_string()]);
        // Only tool results: no empty user message after them.
        let only = normalize_message(&json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]})).unwrap();
        assert_eq!(only.into_messages().len(), 1);
        // Anthropic tool_use + thinking, OpenClaw toolCall, Responses function_call, OTel tool_call.
        let a = normalize_message(&json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "plan", "signature": "s"},
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}},
            {"type": "toolCall", "id": "t2", "name": "bash", "arguments": {"cmd": "ls"}},
            {"type": "function_call", "id": "fc_1", "call_id": "call_3", "name": "get", "arguments": "{\"k\":1}"},
            {"type": "tool_call", "id": "t4", "name": "w", "arguments": {"x": 2}},
            {"type": "redacted_thinking", "data": "..."}
        ]}))
        .unwrap();
        assert_eq!(a.message.content, "let me look");
        assert_eq!(a.message.reasoning.as_deref(), Some("plan"));
        let calls: Vec<(Option<&str>, &str, &Value)> = a.message.tool_calls.iter().map(|c| (c.id.as_deref(), c.name.as_str(), &c.arguments)).collect();
        assert_eq!(
            calls,
            vec![
                (Some("t1"), "read", &json!({"path": "a"})),
                (Some("t2"), "bash", &json!({"cmd": "ls"})),
                (Some("call_3"), "get", &json!({"k": 1})),
                (Some("t4"), "w", &json!({"x": 2})),
            ]
        );
        assert_eq!(a.notes, vec!["dropped 1 non-text content part".to_string()]);
        // OTel tool_call_response (`response`, or `result` as the spec's own example writes it),
        // Responses function_call_output; OpenClaw toolResult role with toolCallId.
        let o = normalize_message(&json!({"role": "tool", "content": [
            {"type": "tool_call_response", "id": "t4", "result": "rainy"},
            {"type": "function_call_output", "call_id": "call_3", "output": "{\"v\":1}"}
        ]}))
        .unwrap();
        assert_eq!(
            o.into_messages().iter().map(|m| (m.tool_call_id.as_deref(), m.content.as_str())).collect::<Vec<_>>(),
            vec![(Some("t4"), "rainy"), (Some("call_3"), "{\"v\":1}")]
        );
        let r =
            normalize_message(&json!({"role": "toolResult", "toolCallId": "t2", "toolName": "bash", "content": [{"type": "text", "text": "a.txt"}], "isError": false}))
                .unwrap();
        assert_eq!(
            (r.message.role.as_str(), r.message.tool_call_id.as_deref(), r.message.name.as_deref(), r.message.content.as_str()),
            ("tool", Some("t2"), Some("bash"), "a.txt")
        );
    }

    #[test]
    fn gemini_parts_are_text_reasoning_calls_and_results() {
        let a = normalize_message(&json!({"role": "assistant", "content": [
            {"text": "plan", "thought": true},
            {"text": "reading"},
            {"functionCall": {"id": "c1", "name": "read_file", "args": {"path": "a"}}, "thoughtSignature": "x"}
        ]}))
        .unwrap();
        assert_eq!((a.message.content.as_str(), a.message.reasoning.as_deref()), ("reading", Some("plan")));
        assert_eq!(a.message.tool_calls.iter().map(|c| (c.id.as_deref(), c.name.as_str(), &c.arguments)).collect::<Vec<_>>(), vec![(Some("c1"), "read_file", &json!({"path": "a"}))]);
        let u = normalize_message(&json!({"role": "user", "content": [
            {"functionResponse": {"id": "c1", "name": "read_file", "response": {"output": "text of a"}}},
            {"functionResponse": {"id": "c2", "name": "shell", "response": {"error": "denied"}}}
        ]}))
        .unwrap();
        let ms = u.into_messages();
        assert_eq!(
            ms.iter().map(|m| (m.role.as_str(), m.tool_call_id.as_deref(), m.name.as_deref(), m.content.as_str())).collect::<Vec<_>>(),
            vec![("tool", Some("c1"), Some("read_file"), "text of a"), ("tool", Some("c2"), Some("shell"), "error: denied")]
        );
    }

    #[test]
    fn kosong_think_part_is_reasoning() {
        let a = normalize_message(&json!({"role": "assistant", "content": [{"type": "think", "think": "count first", "encrypted": null}, {"type": "text", "text": "42"}]})).unwrap();
        assert_eq!((a.message.content.as_str(), a.message.reasoning.as_deref(), a.notes.len()), ("42", Some("count first"), 0));
    }
}

/// The tenant a request body of the OpenAI or Anthropic APIs names: OpenAI's end-user id `user`, else
/// its successor `safety_identifier`, else Anthropic's `metadata.user_id` — the first that is a valid
/// tenant id ([`crate::schema::validate_tenant`]). A value that is not (Claude Code sends a 120-character
/// account-and-session id in `metadata.user_id`; an e-mail with `+`) is skipped with a note in `notes`,
/// so the turn falls back to the `default` tenant instead of being refused: a body field is the client
/// library's, not a tenant the user chose. Blank values count as none. Read by ingest and the proxy alike.
pub fn body_tenant(req: &Map<String, Value>, notes: &mut Vec<String>) -> Option<String> {
    let fields = [("user", req.get("user")), ("safety_identifier", req.get("safety_identifier")), ("metadata.user_id", req.get("metadata").and_then(|m| m.get("user_id")))];
    for (name, v) in fields {
        let Some(v) = v.and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty()) else { continue };
        match crate::schema::validate_tenant(v) {
            Ok(()) => return Some(v.to_string()),
            Err(e) => notes.push(format!("the request's {name} is not a tenant: {e}")),
        }
    }
    None
}
