//! Cline and Roo Code task histories (`tasks/<task id>/api_conversation_history.json` in the VS Code
//! extension's global storage): `--format cline`. Read from cline/cline `src/core/Cline.ts` (later
//! `src/core/task/`: `addToApiConversationHistory`, `presentAssistantMessage`'s `toolDescription` and
//! `pushToolResult`) and RooCodeInc/Roo-Code `src/core/task-persistence/{apiMessages,rooMessage}.ts`.
//!
//! The file is one JSON document, read whole: an array of Anthropic messages `{role, content, ts}`
//! (`ts` in ms; Cline and Roo Code), or Roo Code's versioned envelope `{version: 2, messages}` whose
//! messages use AI SDK parts (`tool-call {toolCallId, toolName, input}` in assistant messages, `role:
//! "tool"` messages of `tool-result {toolCallId, output}`). Each assistant message is a turn; what
//! answers its tool calls is its next state:
//! - native tool calls: `tool_use` / `tool-call` parts, answered by `tool_result` / `tool-result`
//!   parts by id (the shared normaliser); a result whose call is not in the file is counted and left
//!   out;
//! - XML tool calls (Cline, and Roo Code before native tools): the tool is written in the assistant's
//!   text, `<read_file>\n<path>src/a.ts</path>\n</read_file>`, one per message; each block of a known
//!   tool name becomes a tool call (`name`, its `<param>value</param>` children as string arguments,
//!   id `xml-<message index>-<k>`); the text is kept as the model wrote it. The next user message
//!   returns the result as text blocks: `[read_file for 'src/a.ts'] Result:`, then the output, up to
//!   the next such header, `<environment_details>` or the user's feedback: that output becomes the `tool` message answering
//!   the first unanswered call of that name in the assistant message before (a header without such a
//!   call stays user text, counted). The rest of the user message (feedback, environment details)
//!   stays a user message after the results;
//! - Roo Code's condense summary (`isSummary: true`) is an assistant message written by the
//!   condenser: context, never a turn; the turns before it are emitted there, with the messages after
//!   their last turn as its next state, and the turns after it number on. Messages hidden by a condense or truncation (`condenseParent`,
//!   `truncationParent`) stay in the request of later turns (the file keeps them; what the API was
//!   sent then is not rebuilt). Stand-alone encrypted `reasoning` items are counted.
//!
//! Session id = `cline:<task id>` (the folder of `api_conversation_history.json`, else the file
//! stem). The session is done when its last message is an assistant message calling
//! `attempt_completion`; otherwise the messages after the last turn are its next state. A file that
//! is not JSON is one dead letter; a message the normaliser rejects is a dead letter and left out.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{json_type, normalize_with_role, Normalized};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, emit_event_session, MessageMeta, Trajectory};
use crate::schema::{Message, ToolCall};
use crate::Result;

/// Tool names of Cline's and Roo Code's XML tool protocol (system prompts and `toolDescription`).
const XML_TOOLS: &[&str] = &[
    "execute_command",
    "read_file",
    "write_to_file",
    "replace_in_file",
    "apply_diff",
    "insert_content",
    "search_and_replace",
    "search_files",
    "list_files",
    "list_code_definition_names",
    "codebase_search",
    "browser_action",
    "use_mcp_tool",
    "access_mcp_resource",
    "load_mcp_documentation",
    "ask_followup_question",
    "plan_mode_respond",
    "attempt_completion",
    "new_task",
    "switch_mode",
    "fetch_instructions",
    "update_todo_list",
    "web_fetch",
    "condense",
    "summarize_task",
    "new_rule",
    "report_bug",
];

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let Some(doc) = sink.load_document(path, progress)? else {
        return Ok(());
    };
    let folder = path.parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned());
    let named = path.file_name().is_some_and(|f| f.to_string_lossy().starts_with("api_conversation_history"));
    let session = format!("cline:{}", folder.filter(|_| named).unwrap_or_else(|| sink.stem.clone()));
    let messages = match &doc {
        Value::Array(a) => a,
        Value::Object(o) => match o.get("messages") {
            Some(Value::Array(a)) => a,
            _ => return sink.dead(None, "wrong_type", "object without a messages array (expected a Cline/Roo Code conversation history)", doc.to_string().as_bytes()),
        },
        other => return sink.dead(None, "wrong_type", format!("document is a JSON {}, expected an array of messages", json_type(other)), doc.to_string().as_bytes()),
    };
    let mut t = Trajectory::default();
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut count = |what: &str, n: usize| {
        if n > 0 {
            *counts.entry(what.to_string()).or_insert(0) += n as u64;
        }
    };
    let mut native: HashSet<String> = HashSet::new();
    // XML calls of the last assistant message not answered yet: (name, id).
    let mut pending: Vec<(String, String)> = vec![];
    let mut last_is_completion = false;
    let mut emitted = 0usize;
    for (i, raw) in messages.iter().enumerate() {
        let Some(o) = raw.as_object() else {
            sink.dead_in_session(None, &session, "wrong_type", format!("message {i} is a JSON {}, expected an object", json_type(raw)), raw.to_string().as_bytes())?;
            continue;
        };
        let meta = MessageMeta { event_time: o.get("ts").and_then(parse_timestamp), ..MessageMeta::default() };
        let role = o.get("role").and_then(Value::as_str).unwrap_or("");
        // The whole message (Roo Code keeps DeepSeek's `reasoning_content` on it), its parts in the
        // shape the normaliser reads.
        let mut msg = o.clone();
        msg.insert("content".into(), sdk_parts(o.get("content")));
        let normalized = match role {
            "assistant" => normalize_with_role(&msg, "assistant", None),
            "user" | "tool" => normalize_with_role(&msg, "user", None),
            "" if o.get("type").and_then(Value::as_str) == Some("reasoning") => {
                count("stand-alone reasoning items (encrypted, not read)", 1);
                continue;
            }
            other => {
                count(&format!("messages with role {other:?} (not read)"), 1);
                continue;
            }
        };
        let mut nm = match normalized {
            Ok(nm) => nm,
            Err(err) => {
                sink.dead_in_session(None, &session, err.code(), format!("message {i}: {err}"), raw.to_string().as_bytes())?;
                continue;
            }
        };
        if role == "assistant" {
            let summary = o.get("isSummary").and_then(Value::as_bool) == Some(true);
            if summary {
                // The turns before a condense are emitted now, the messages after the last its next
                // state (a summary between a turn and its successor's request would hide it from the
                // pairing); later turns keep them as context and number on.
                count("condense summaries (context, not turns)", 1);
                t.tail_is_next_state = true;
                emitted += emit(sink, &session, &t, Some(1))?;
                t.meta.iter_mut().for_each(|m| m.not_turn = true);
                t.first_turn = emitted as i32;
                t.tail_is_next_state = false;
            }
            let xml = xml_tool_calls(&nm.message.content, i);
            pending = xml.iter().filter_map(|c| Some((c.name.clone(), c.id.clone()?))).collect();
            nm.message.tool_calls.extend(xml);
            native.extend(nm.message.tool_calls.iter().filter_map(|c| c.id.clone()));
            last_is_completion = nm.message.tool_calls.iter().any(|c| c.name == "attempt_completion");
            t.push(nm, MessageMeta { not_turn: summary, ..meta });
            continue;
        }
        last_is_completion = false;
        let results = nm.before.len();
        nm.before.retain(|m| m.tool_call_id.as_ref().is_none_or(|id| native.contains(id)));
        count("orphan tool results (their call is not in the file)", results - nm.before.len());
        let (answers, rest, orphans) = xml_results(o.get("content"), &mut pending);
        count("tool result headers without a call before them (kept as user text)", orphans);
        for m in answers {
            t.push(Normalized::new(m), meta.clone());
        }
        if let Some(rest) = rest {
            nm.message.content = rest;
        }
        if nm.before.is_empty() && nm.message.content.trim().is_empty() {
            continue;
        }
        t.push(nm, meta);
    }
    let records = if emitted > 0 { 0 } else { messages.len() };
    emit_event_session(sink, &session, t, last_is_completion, counts, records, "conversation history has no assistant message")
}

/// Roo Code v2 (AI SDK) parts → the Anthropic blocks the normaliser reads: `tool-call` →
/// `tool_use`, `tool-result` → `tool_result` (its `output` `{type, value}` as text). Other content is
/// returned as is.
fn sdk_parts(content: Option<&Value>) -> Value {
    let Some(Value::Array(parts)) = content else {
        return content.cloned().unwrap_or(Value::Null);
    };
    let field = |p: &Value, k: &str| p.get(k).cloned().unwrap_or(Value::Null);
    Value::Array(
        parts
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("tool-call") => serde_json::json!({"type": "tool_use", "id": field(p, "toolCallId"), "name": field(p, "toolName"), "input": field(p, "input")}),
                Some("tool-result") => {
                    let out = p.get("output");
                    let value = out.and_then(|o| o.get("value")).or(out).cloned().unwrap_or(Value::Null);
                    let text = match value {
                        Value::String(s) => s,
                        Value::Array(items) => items.iter().filter_map(|x| x.get("text").or_else(|| x.get("value")).and_then(Value::as_str)).collect::<Vec<_>>().join("\n"),
                        other => other.to_string(),
                    };
                    let error = out.and_then(|o| o.get("type")).and_then(Value::as_str).is_some_and(|t| t.starts_with("error"));
                    serde_json::json!({"type": "tool_result", "tool_use_id": field(p, "toolCallId"), "content": if error { format!("error: {text}") } else { text }})
                }
                _ => p.clone(),
            })
            .collect(),
    )
}

/// The XML tool blocks of an assistant text, in text order: `<name>` of a known tool up to its
/// `</name>`, each `<param>value</param>` child (trimmed) a string argument. An unclosed block (the
/// response was cut) is not a call.
fn xml_tool_calls(text: &str, message: usize) -> Vec<ToolCall> {
    let mut found: Vec<(usize, ToolCall)> = vec![];
    for name in XML_TOOLS {
        let (open, close) = (format!("<{name}>"), format!("</{name}>"));
        let mut from = 0;
        while let Some(at) = text[from..].find(&open).map(|k| k + from) {
            let body_start = at + open.len();
            let Some(end) = text[body_start..].find(&close).map(|k| k + body_start) else { break };
            let arguments: Map<String, Value> = xml_params(&text[body_start..end]).into_iter().map(|(k, v)| (k, Value::String(v))).collect();
            found.push((at, ToolCall { id: None, name: name.to_string(), arguments: Value::Object(arguments), arguments_raw: None }));
            from = end + close.len();
        }
    }
    found.sort_by_key(|(at, _)| *at);
    found.into_iter().enumerate().map(|(k, (_, c))| ToolCall { id: Some(format!("xml-{message}-{k}")), ..c }).collect()
}

/// The `<param>value</param>` children of an XML tool block, values trimmed.
fn xml_params(body: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let mut rest = body;
    while let Some(lt) = rest.find('<') {
        let after = &rest[lt + 1..];
        let Some(gt) = after.find('>') else { break };
        let name = &after[..gt];
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            rest = after;
            continue;
        }
        let close = format!("</{name}>");
        let value_start = &after[gt + 1..];
        let Some(end) = value_start.find(&close) else { break };
        out.push((name.to_string(), value_start[..end].trim().to_string()));
        rest = &value_start[end + close.len()..];
    }
    out
}

/// Text blocks that Cline appends after a tool's output and that are not part of it: the environment
/// details, the user's feedback on the tool use (`pushAdditionalToolFeedback`), and the notes on tool
/// uses skipped after a rejection or after the one tool a message may use.
const ENDS_RESULT: &[&str] = &["<environment_details>", "The user provided the following feedback:", "Skipping tool ", "Tool ["];

/// The tool name of a result header text block: `[name for '...'] Result:` or `[name] Result:`.
fn result_header(text: &str) -> Option<&str> {
    let t = text.trim();
    let inner = t.strip_prefix('[')?.strip_suffix("Result:")?.trim_end().strip_suffix(']')?;
    let name = inner.split(" for ").next()?.trim();
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(name)
}

/// Splits a user message's text blocks into the results of the XML calls in `pending` (each header
/// and the blocks after it, up to the next header or a block of [`ENDS_RESULT`]) and the rest. Returns
/// the `tool` messages, the rest's text (`None` when the message has no result header, so the
/// normaliser's reading stands), and how many headers had no pending call.
fn xml_results(content: Option<&Value>, pending: &mut Vec<(String, String)>) -> (Vec<Message>, Option<String>, usize) {
    let Some(Value::Array(blocks)) = content else { return (vec![], None, 0) };
    let texts: Vec<&str> = blocks.iter().filter(|b| b.get("type").and_then(Value::as_str) == Some("text")).filter_map(|b| b.get("text").and_then(Value::as_str)).collect();
    if !texts.iter().any(|t| result_header(t).is_some()) {
        return (vec![], None, 0);
    }
    let (mut answers, mut rest, mut orphans) = (vec![], vec![], 0);
    let mut current: Option<(Message, Vec<&str>)> = None;
    let close = |current: &mut Option<(Message, Vec<&str>)>, answers: &mut Vec<Message>| {
        if let Some((m, body)) = current.take() {
            answers.push(Message { content: body.join("\n"), ..m });
        }
    };
    for text in texts {
        if let Some(name) = result_header(text) {
            close(&mut current, &mut answers);
            match pending.iter().position(|(n, _)| n == name) {
                Some(k) => {
                    let (name, id) = pending.remove(k);
                    current = Some((Message { tool_call_id: Some(id), name: Some(name), ..Message::text("tool", "") }, vec![]));
                }
                None => {
                    orphans += 1;
                    rest.push(text);
                }
            }
        } else if ENDS_RESULT.iter().any(|p| text.trim_start().starts_with(p)) {
            close(&mut current, &mut answers);
            rest.push(text);
        } else if let Some((_, body)) = current.as_mut() {
            body.push(text);
        } else {
            rest.push(text);
        }
    }
    close(&mut current, &mut answers);
    (answers, Some(rest.join("\n")), orphans)
}
