//! OpenAI Responses-style items → messages, shared by `openai-responses` (request `input`, response
//! `output`) and `codex` (rollout `response_item` payloads), which use the same item types
//! (openai-python `types/responses/`, codex-rs `protocol/src/models.rs`; read, not copied):
//! - `message` (`role`, `content` string or parts; also a bare `{role, content}`) → a message of
//!   that role (`developer` → `system`);
//! - `reasoning` (`summary[].text`, `content[].text`), `function_call` (`call_id, name, arguments`
//!   string), `custom_tool_call` (`call_id, name, input`) and `local_shell_call` (`call_id`,
//!   `action.command`) are parts of the assistant message being built: consecutive assistant-side
//!   items are **one** assistant message (one model response = one turn);
//! - `function_call_output`, `custom_tool_call_output`, `local_shell_call_output` (`call_id`,
//!   `output` string, content items, or `{content, success}`) → a `tool` message answering `call_id`;
//! - any other item type (web search, computer, MCP, image generation, ...) is counted by type.

use std::collections::BTreeMap;

use serde_json::Value;

use super::normalize::{append, json_type, map_role, normalize_with_role, NormError, Normalized};
use crate::schema::{Message, ToolCall};

/// Where an item came from: its record (line) number, time (ms) and the model then in use.
pub(crate) type Mark = (i64, Option<i64>, Option<String>);

/// Builds messages from items in order.
#[derive(Debug, Default)]
pub(crate) struct Items {
    /// Messages so far (the open assistant message not included), each with the [`Mark`] of its
    /// first item.
    pub out: Vec<(Normalized, Mark)>,
    open: Option<(Normalized, Mark)>,
    /// The mark of the item being read.
    mark: Mark,
    /// Items of other types, by type.
    pub skipped: BTreeMap<String, u64>,
}

impl Items {
    fn flush(&mut self) {
        if let Some(a) = self.open.take() {
            self.out.push(a);
        }
    }

    fn assistant(&mut self) -> &mut Normalized {
        let mark = self.mark.clone();
        &mut self.open.get_or_insert_with(|| (Normalized::new(Message::text("assistant", "")), mark)).0
    }

    fn push_out(&mut self, n: Normalized) {
        self.out.push((n, self.mark.clone()));
    }

    /// [`Items::push`] of an item from `mark`.
    ///
    /// # Errors
    /// As [`Items::push`].
    pub fn push_at(&mut self, item: &Value, mark: Mark) -> Result<(), NormError> {
        self.mark = mark;
        self.push(item)
    }

    /// Reads one item.
    ///
    /// # Errors
    /// [`NormError`] for an item that is not an object, a message with an unknown role or bad
    /// content, or a call without a name.
    pub fn push(&mut self, item: &Value) -> Result<(), NormError> {
        let o = item.as_object().ok_or(NormError::NotAnObject(json_type(item)))?;
        let ty = o.get("type").and_then(Value::as_str).unwrap_or(if o.contains_key("role") { "message" } else { "" });
        match ty {
            "message" => {
                let role_raw = o.get("role").and_then(Value::as_str).ok_or(NormError::MissingRole)?;
                let (role, note) = map_role(role_raw)?;
                let n = normalize_with_role(o, role, note)?;
                if role == "assistant" {
                    let a = self.assistant();
                    if !n.message.content.is_empty() {
                        if !a.message.content.is_empty() {
                            a.message.content.push('\n');
                        }
                        a.message.content.push_str(&n.message.content);
                    }
                    if let Some(r) = n.message.reasoning {
                        append(&mut a.message.reasoning, &r);
                    }
                    a.message.tool_calls.extend(n.message.tool_calls);
                    a.notes.extend(n.notes);
                    a.truncated |= n.truncated;
                } else {
                    self.flush();
                    self.push_out(n);
                }
            }
            "reasoning" => {
                let mut texts: Vec<&str> = vec![];
                for key in ["summary", "content"] {
                    if let Some(Value::Array(parts)) = o.get(key) {
                        texts.extend(parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)));
                    }
                }
                if !texts.is_empty() {
                    let t = texts.join("\n");
                    append(&mut self.assistant().message.reasoning, &t);
                } else {
                    // Encrypted reasoning only: nothing readable, but the response had reasoning.
                    *self.skipped.entry("reasoning items without readable text".into()).or_insert(0) += 1;
                }
            }
            "function_call" | "custom_tool_call" | "local_shell_call" => {
                let name = match ty {
                    "local_shell_call" => "local_shell".to_string(),
                    _ => o.get("name").and_then(Value::as_str).filter(|s| !s.is_empty()).ok_or(NormError::ToolCallWithoutName(0))?.to_string(),
                };
                let id = o.get("call_id").or_else(|| o.get("id")).and_then(Value::as_str).map(str::to_string);
                let raw = match ty {
                    "local_shell_call" => o.get("action").cloned().unwrap_or(Value::Null),
                    "custom_tool_call" => o.get("input").cloned().unwrap_or(Value::Null),
                    _ => o.get("arguments").cloned().unwrap_or(Value::Null),
                };
                let (arguments, arguments_raw) = match raw {
                    Value::String(s) => match serde_json::from_str::<Value>(&s) {
                        Ok(v) => (v, Some(s)),
                        Err(_) if ty == "custom_tool_call" => (Value::String(s.clone()), Some(s)),
                        Err(e) => {
                            self.assistant().notes.push(format!("tool call ({name}) arguments are not valid JSON ({e}); kept raw"));
                            (Value::Null, Some(s))
                        }
                    },
                    v => (v, None),
                };
                self.assistant().message.tool_calls.push(ToolCall { id, name, arguments, arguments_raw });
            }
            "function_call_output" | "custom_tool_call_output" | "local_shell_call_output" => {
                self.flush();
                let id = o.get("call_id").and_then(Value::as_str).map(str::to_string);
                let text = output_text(o.get("output"));
                self.push_out(Normalized::new(Message { tool_call_id: id, ..Message::text("tool", text) }));
            }
            "" => *self.skipped.entry("items without a type".into()).or_insert(0) += 1,
            other => *self.skipped.entry(format!("{other} items")).or_insert(0) += 1,
        }
        Ok(())
    }

    /// All messages with their marks, the open assistant message last.
    pub fn finish(mut self) -> (Vec<(Normalized, Mark)>, BTreeMap<String, u64>) {
        self.flush();
        (self.out, self.skipped)
    }
}

/// A tool output: a string (Codex shell outputs are a JSON string `{output, metadata}`: kept as
/// logged), content items (their text joined), or `{content, success}`.
fn output_text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => items.iter().filter_map(|i| i.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n"),
        Some(Value::Object(o)) => match o.get("content") {
            Some(c) => output_text(Some(c)),
            None => Value::Object(o.clone()).to_string(),
        },
        Some(other) => other.to_string(),
    }
}

/// Items of other types, by type.
pub(crate) type Skipped = BTreeMap<String, u64>;

/// The messages of a list of items and the items skipped, by type.
pub(crate) type ReadItems = (Vec<Normalized>, Skipped);

/// Reads a list of items (or a bare string = one user message).
///
/// # Errors
/// The index and error of the first bad item.
pub(crate) fn read_items(v: Option<&Value>) -> Result<ReadItems, (usize, NormError)> {
    let mut b = Items::default();
    match v {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => b.push_out(Normalized::new(Message::text("user", s.clone()))),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                b.push(it).map_err(|e| (i, e))?;
            }
        }
        Some(other) => return Err((0, NormError::WrongType("input", json_type(other)))),
    }
    let (out, skipped) = b.finish();
    Ok((out.into_iter().map(|(n, _)| n).collect(), skipped))
}
