//! OpenTelemetry GenAI spans: `--format otel`. Reads OTLP/JSON exports (`{"resourceSpans": ...}`,
//! one per line for the collector's file exporter), SDK span dumps (`{"spans": [...]}` or a JSON
//! array of spans with `context.trace_id`, `attributes` as a flat object).
//!
//! From the GenAI semantic conventions (`docs/gen-ai/gen-ai-spans.md`, `gen-ai-events.md`) and the
//! instrumentations that emit them (OpenLLMetry, OpenInference; read, not copied):
//! - **model calls**: spans whose `gen_ai.operation.name` is `chat`, `call_llm`, `text_completion`
//!   or `generate_content`, or OpenInference `openinference.span.kind = LLM`, or with indexed prompt
//!   attributes. The request is, first found: `gen_ai.input.messages` (JSON; messages with `parts`
//!   or `content`) plus `gen_ai.system_instructions`, on the span or its
//!   `gen_ai.client.inference.operation.details` event; the deprecated per-message events
//!   (`gen_ai.system.message`, `gen_ai.user.message`, `gen_ai.assistant.message`,
//!   `gen_ai.tool.message`); the indexed `gen_ai.prompt.N.*`; OpenInference `llm.input_messages.N.*`.
//!   The response likewise: `gen_ai.output.messages`, `gen_ai.choice` events, `gen_ai.completion.N.*`,
//!   `llm.output_messages.N.*`, or `gen_ai.output` (any-agent: a JSON list of `{tool.name,
//!   tool.args}` calls, else the text). Parts go through the one content-parts normaliser.
//! - a model call **without** request messages continues the conversation: the previous call's
//!   request and response, then the tool results recorded since (`execute_tool` spans: `gen_ai.tool.name`,
//!   `gen_ai.tool.call.id`, result from `gen_ai.tool.call.result`, `gen_ai.output` or OpenInference
//!   `output.value`; a result without an id answers the earliest unanswered call of that name);
//! - sessions: `gen_ai.conversation.id` (or OpenInference `session.id`) of any span of the trace,
//!   else the trace id. Trace and span ids may be hex strings or JSON integers of up to 128 bits (read
//!   exactly, never through `f64`); ids are written as lower-case hex. Spans are ordered by start time;
//!   a trace with an agent span (`invoke_agent`) is done when read.
//! - a model call with no message content (content capture is opt-in in every instrumentation) is a
//!   `no_message_content` dead letter; other spans are counted by operation.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::normalize::{normalize_message, normalize_with_role};
use super::sink::{Sink, Turn};
use super::stream;
use crate::schema::{Message, ToolCall};
use crate::Result;

#[derive(Deserialize, Default)]
#[serde(default)]
struct SdkContext {
    trace_id: Option<Box<RawValue>>,
    span_id: Option<Box<RawValue>>,
}

/// One span in either layout (SDK dump or OTLP/JSON).
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawSpan {
    name: Option<String>,
    context: Option<SdkContext>,
    parent: Option<SdkContext>,
    parent_id: Option<Box<RawValue>>,
    #[serde(rename = "traceId")]
    trace_id: Option<Box<RawValue>>,
    #[serde(rename = "spanId")]
    span_id: Option<Box<RawValue>>,
    #[serde(rename = "parentSpanId")]
    parent_span_id: Option<Box<RawValue>>,
    start_time: Option<Value>,
    #[serde(rename = "startTimeUnixNano")]
    start_time_unix_nano: Option<Value>,
    attributes: Option<Value>,
    events: Option<Vec<Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ScopeSpans {
    spans: Vec<RawSpan>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ResourceSpans {
    #[serde(rename = "scopeSpans", alias = "instrumentationLibrarySpans")]
    scope_spans: Vec<ScopeSpans>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Document {
    spans: Vec<RawSpan>,
    #[serde(rename = "resourceSpans")]
    resource_spans: Vec<ResourceSpans>,
}

/// A span reduced to what the adapter reads.
struct Span {
    record: i64,
    trace: String,
    has_parent: bool,
    start_ns: i128,
    name: String,
    attrs: Map<String, Value>,
    events: Vec<(String, Map<String, Value>)>,
}

/// An id as lower-case hex: hex strings as written (trimmed, lower-cased), integers (up to 128 bits,
/// read from their digits) in hex.
fn id_hex(raw: Option<&RawValue>) -> Option<String> {
    let text = raw?.get().trim();
    if let Some(s) = text.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
        let s = s.trim();
        return (!s.is_empty()).then(|| s.to_ascii_lowercase());
    }
    text.parse::<u128>().ok().map(|x| format!("{x:x}"))
}

/// OTLP `AnyValue` (`{stringValue}`, `{intValue}`, `{arrayValue: {values}}`, ...) → plain JSON.
fn any_value(v: &Value) -> Value {
    let Some(o) = v.as_object() else {
        return v.clone();
    };
    if let Some(s) = o.get("stringValue") {
        return s.clone();
    }
    if let Some(i) = o.get("intValue") {
        return match i {
            Value::String(s) => s.parse::<i64>().map(Value::from).unwrap_or_else(|_| i.clone()),
            other => other.clone(),
        };
    }
    for k in ["doubleValue", "boolValue", "bytesValue"] {
        if let Some(x) = o.get(k) {
            return x.clone();
        }
    }
    if let Some(a) = o.get("arrayValue") {
        return Value::Array(a.get("values").and_then(Value::as_array).map(|v| v.iter().map(any_value).collect()).unwrap_or_default());
    }
    if let Some(kv) = o.get("kvlistValue") {
        return Value::Object(attributes(kv.get("values")));
    }
    v.clone()
}

/// Attributes as a flat object, from a flat object (SDK dumps) or an OTLP key/value list.
fn attributes(v: Option<&Value>) -> Map<String, Value> {
    match v {
        Some(Value::Object(o)) => o.clone(),
        Some(Value::Array(kvs)) => {
            kvs.iter().filter_map(|kv| Some((kv.get("key")?.as_str()?.to_string(), kv.get("value").map(any_value).unwrap_or(Value::Null)))).collect()
        }
        _ => Map::new(),
    }
}

fn time_ns(v: Option<&Value>) -> Option<i128> {
    match v? {
        Value::Number(n) => n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)),
        Value::String(s) => s.parse::<i128>().ok().or_else(|| super::timestamp::parse_timestamp(&Value::String(s.clone())).map(|ms| i128::from(ms) * 1_000_000)),
        _ => None,
    }
}

fn reduce(record: i64, s: RawSpan) -> Span {
    let trace = id_hex(s.trace_id.as_deref()).or_else(|| id_hex(s.context.as_ref().and_then(|c| c.trace_id.as_deref()))).unwrap_or_default();
    let has_parent = id_hex(s.parent_span_id.as_deref()).is_some()
        || id_hex(s.parent_id.as_deref()).is_some()
        || s.parent.as_ref().is_some_and(|p| id_hex(p.span_id.as_deref()).is_some());
    let start_ns = time_ns(s.start_time_unix_nano.as_ref()).or_else(|| time_ns(s.start_time.as_ref())).unwrap_or(0);
    let events = s
        .events
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let name = e.get("name").and_then(Value::as_str).unwrap_or("").to_string();
            let mut a = attributes(e.get("attributes"));
            if let Some(body) = e.get("body") {
                a.insert("body".into(), any_value(body));
            }
            (name, a)
        })
        .collect();
    Span { record, trace, has_parent, start_ns, name: s.name.unwrap_or_default(), attrs: attributes(s.attributes.as_ref()), events }
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut spans: Vec<Span> = vec![];
    let push_doc = |d: Document, spans: &mut Vec<Span>, sink: &mut Sink<'_>| {
        let all = d.spans.into_iter().chain(d.resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans));
        for s in all {
            sink.record_read();
            let n = spans.len() as i64 + 1;
            spans.push(reduce(n, s));
        }
    };
    match stream::read_document(path, sink.opts.max_document_bytes)? {
        stream::Document::TooLarge { size, head } => {
            let max = sink.opts.max_document_bytes;
            sink.set_bytes(head.len() as u64);
            return sink.dead(None, "document_too_large", format!("{size} bytes is over the single-document limit of {max} bytes (payload: first bytes)"), &head);
        }
        stream::Document::Whole(bytes) => {
            sink.set_bytes(bytes.len() as u64);
            progress(bytes.len() as u64);
            let first = bytes.iter().find(|b| !b.is_ascii_whitespace()).copied();
            let whole = if first == Some(b'[') {
                serde_json::from_slice::<Vec<RawSpan>>(&bytes).map(|spans| Document { spans, ..Document::default() })
            } else {
                serde_json::from_slice::<Document>(&bytes)
            };
            match whole {
                Ok(d) => push_doc(d, &mut spans, sink),
                Err(whole_err) => {
                    // The collector's file exporter writes one export request per line.
                    let mut lines = 0;
                    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
                        if line.iter().all(u8::is_ascii_whitespace) {
                            continue;
                        }
                        lines += 1;
                        match serde_json::from_slice::<Document>(line) {
                            Ok(d) => push_doc(d, &mut spans, sink),
                            Err(e) => sink.dead(Some(i as i64 + 1), "malformed_json", format!("line {}: {e}", i + 1), &line[..line.len().min(1 << 16)])?,
                        }
                    }
                    if lines <= 1 && spans.is_empty() {
                        sink.dead(None, "malformed_json", format!("not an OTLP/JSON export or span list: {whole_err}"), &bytes[..bytes.len().min(1 << 16)])?;
                    }
                }
            }
        }
    }
    // Traces in order of their first span's start; spans by start time. A conversation spread over
    // several traces (one per user turn, as agents usually trace) numbers its turns on across them.
    let mut by_trace: HashMap<String, Vec<Span>> = HashMap::new();
    for s in spans {
        by_trace.entry(s.trace.clone()).or_default().push(s);
    }
    let mut traces: Vec<(String, Vec<Span>)> = by_trace.into_iter().collect();
    for (_, ss) in traces.iter_mut() {
        ss.sort_by_key(|s| (s.start_ns, s.record));
    }
    traces.sort_by_key(|(t, ss)| (ss.first().map(|s| (s.start_ns, s.record)), t.clone()));
    let mut next_turn: HashMap<String, i32> = HashMap::new();
    for (trace, ss) in traces {
        conversation(sink, &trace, &ss, &mut next_turn)?;
    }
    Ok(())
}

#[derive(PartialEq)]
enum Kind {
    Model,
    Tool,
    Agent,
    Other(String),
}

fn kind(s: &Span) -> Kind {
    let op = s.attrs.get("gen_ai.operation.name").and_then(Value::as_str).unwrap_or("");
    let oi = s.attrs.get("openinference.span.kind").and_then(Value::as_str).unwrap_or("");
    match (op, oi) {
        ("chat" | "call_llm" | "text_completion" | "generate_content" | "completion", _) | (_, "LLM") => Kind::Model,
        ("execute_tool", _) | (_, "TOOL") => Kind::Tool,
        ("invoke_agent" | "create_agent", _) | (_, "AGENT") => Kind::Agent,
        _ if s.attrs.contains_key("gen_ai.prompt.0.role") || s.attrs.contains_key("gen_ai.completion.0.role") => Kind::Model,
        ("", "") => Kind::Other(match s.attrs.get("traceloop.span.kind").and_then(Value::as_str) {
            Some(k) => k.to_string(),
            None if s.name.is_empty() => "unnamed".into(),
            None => s.name.split_whitespace().next().unwrap_or("").to_string(),
        }),
        (op, "") => Kind::Other(op.to_string()),
        (_, oi) => Kind::Other(oi.to_ascii_lowercase()),
    }
}

/// A JSON attribute that may be a JSON string or already structured.
fn json_attr(v: Option<&Value>) -> Option<Value> {
    match v? {
        Value::String(s) => serde_json::from_str(s).ok(),
        Value::Null => None,
        other => Some(other.clone()),
    }
}

/// Semantic-convention messages (`parts` or `content`) → our messages.
fn semconv_messages(v: &Value, notes: &mut Vec<String>) -> std::result::Result<Vec<Message>, String> {
    let list = match v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    let mut out = vec![];
    for (i, m) in list.iter().enumerate() {
        let mut m = m.as_object().cloned().ok_or_else(|| format!("message {i} is not an object"))?;
        if let Some(parts) = m.remove("parts") {
            m.insert("content".into(), parts);
        }
        let mut n = normalize_message(&Value::Object(m)).map_err(|e| format!("message {i}: {e}"))?;
        notes.append(&mut n.notes);
        out.extend(n.into_messages());
    }
    Ok(out)
}

/// Indexed attributes `{prefix}.{i}.{field}` (traceloop `gen_ai.prompt`, OpenInference
/// `llm.input_messages` with `inner = "message."`) → raw chat messages in index order.
fn indexed(attrs: &Map<String, Value>, prefix: &str, inner: &str) -> Vec<Value> {
    let mut by_index: BTreeMap<usize, Map<String, Value>> = BTreeMap::new();
    let head = format!("{prefix}.");
    for (k, v) in attrs {
        let Some(rest) = k.strip_prefix(&head) else {
            continue;
        };
        let Some((idx, field)) = rest.split_once('.') else {
            continue;
        };
        let Ok(i) = idx.parse::<usize>() else {
            continue;
        };
        let field = field.strip_prefix(inner).unwrap_or(field);
        by_index.entry(i).or_default().insert(field.to_string(), v.clone());
    }
    by_index
        .into_values()
        .map(|f| {
            let mut m = Map::new();
            for k in ["role", "content", "tool_call_id", "finish_reason", "name"] {
                if let Some(v) = f.get(k) {
                    m.insert(k.into(), v.clone());
                }
            }
            // Content that is a JSON-dumped list of parts.
            if let Some(Value::String(s)) = m.get("content") {
                if s.trim_start().starts_with('[') {
                    if let Ok(parts @ Value::Array(_)) = serde_json::from_str::<Value>(s) {
                        m.insert("content".into(), parts);
                    }
                }
            }
            // Tool calls: `tool_calls.{j}.{id,name,arguments}` or OpenInference
            // `tool_calls.{j}.tool_call.{id,function.name,function.arguments}`.
            let mut calls: BTreeMap<usize, Map<String, Value>> = BTreeMap::new();
            for (k, v) in &f {
                let Some(rest) = k.strip_prefix("tool_calls.") else {
                    continue;
                };
                let Some((j, field)) = rest.split_once('.') else {
                    continue;
                };
                let Ok(j) = j.parse::<usize>() else { continue };
                let field = field.strip_prefix("tool_call.").unwrap_or(field);
                let field = field.strip_prefix("function.").unwrap_or(field);
                calls.entry(j).or_default().insert(field.to_string(), v.clone());
            }
            if !calls.is_empty() {
                m.insert("tool_calls".into(), Value::Array(calls.into_values().map(Value::Object).collect()));
            }
            // OpenInference content parts: `contents.{k}.message_content.{type,text}`.
            let mut parts: BTreeMap<usize, Map<String, Value>> = BTreeMap::new();
            for (k, v) in &f {
                let Some(rest) = k.strip_prefix("contents.") else {
                    continue;
                };
                let Some((j, field)) = rest.split_once('.') else {
                    continue;
                };
                let Ok(j) = j.parse::<usize>() else { continue };
                parts.entry(j).or_default().insert(field.strip_prefix("message_content.").unwrap_or(field).to_string(), v.clone());
            }
            if !parts.is_empty() && !m.contains_key("content") {
                m.insert("content".into(), Value::Array(parts.into_values().map(Value::Object).collect()));
            }
            Value::Object(m)
        })
        .collect()
}

/// The request messages of a model-call span, if the span records them.
fn request_of(s: &Span, notes: &mut Vec<String>) -> std::result::Result<Option<Vec<Message>>, String> {
    let details = s.events.iter().find(|(n, _)| n == "gen_ai.client.inference.operation.details").map(|(_, a)| a);
    let find = |key: &str| json_attr(s.attrs.get(key)).or_else(|| details.and_then(|d| json_attr(d.get(key))));
    if let Some(input) = find("gen_ai.input.messages") {
        let mut out = vec![];
        if let Some(sys) = find("gen_ai.system_instructions") {
            let mut o = Map::new();
            o.insert("content".into(), sys);
            let mut n = normalize_with_role(&o, "system", None).map_err(|e| format!("system instructions: {e}"))?;
            notes.append(&mut n.notes);
            out.push(n.message);
        }
        out.extend(semconv_messages(&input, notes)?);
        return Ok(Some(out));
    }
    // Deprecated per-message events (content in the body or flattened into attributes).
    let per_message: Vec<Value> = s
        .events
        .iter()
        .filter_map(|(name, a)| {
            let role = match name.as_str() {
                "gen_ai.system.message" => "system",
                "gen_ai.user.message" => "user",
                "gen_ai.assistant.message" => "assistant",
                "gen_ai.tool.message" => "tool",
                _ => return None,
            };
            let mut m = a.get("body").and_then(Value::as_object).cloned().unwrap_or_else(|| a.clone());
            m.insert("role".into(), Value::String(role.into()));
            if role == "tool" {
                if let Some(id) = m.remove("id") {
                    m.insert("tool_call_id".into(), id);
                }
            }
            Some(Value::Object(m))
        })
        .collect();
    let raw = if !per_message.is_empty() {
        per_message
    } else {
        let traceloop = indexed(&s.attrs, "gen_ai.prompt", "");
        if !traceloop.is_empty() {
            traceloop
        } else {
            indexed(&s.attrs, "llm.input_messages", "message.")
        }
    };
    if raw.is_empty() {
        return Ok(None);
    }
    let mut out = vec![];
    for (i, m) in raw.iter().enumerate() {
        let mut n = normalize_message(m).map_err(|e| format!("input message {i}: {e}"))?;
        notes.append(&mut n.notes);
        out.extend(n.into_messages());
    }
    Ok(Some(out))
}

/// The response message and finish reason of a model-call span, if recorded.
fn response_of(s: &Span, notes: &mut Vec<String>) -> std::result::Result<Option<(Message, Option<String>)>, String> {
    let details = s.events.iter().find(|(n, _)| n == "gen_ai.client.inference.operation.details").map(|(_, a)| a);
    let out = json_attr(s.attrs.get("gen_ai.output.messages")).or_else(|| details.and_then(|d| json_attr(d.get("gen_ai.output.messages"))));
    let mut raw: Option<(Value, Option<String>)> = None;
    if let Some(v) = out {
        let first = match &v {
            Value::Array(a) => a.first().cloned(),
            other => Some(other.clone()),
        };
        if let Some(mut m) = first.and_then(|m| m.as_object().cloned()) {
            let finish = m.get("finish_reason").and_then(Value::as_str).map(str::to_string);
            if let Some(parts) = m.remove("parts") {
                m.insert("content".into(), parts);
            }
            raw = Some((Value::Object(m), finish));
        }
    }
    if raw.is_none() {
        if let Some((_, a)) = s.events.iter().find(|(n, _)| n == "gen_ai.choice") {
            let body = a.get("body").and_then(Value::as_object).cloned().unwrap_or_else(|| a.clone());
            let mut m = body.get("message").and_then(Value::as_object).cloned().unwrap_or_default();
            if let Some(tc) = body.get("tool_calls") {
                m.entry("tool_calls").or_insert(tc.clone());
            }
            raw = Some((Value::Object(m), body.get("finish_reason").and_then(Value::as_str).map(str::to_string)));
        }
    }
    if raw.is_none() {
        let traceloop = indexed(&s.attrs, "gen_ai.completion", "");
        let oi = if traceloop.is_empty() { indexed(&s.attrs, "llm.output_messages", "message.") } else { traceloop };
        if let Some(m) = oi.into_iter().next() {
            let finish = m.get("finish_reason").and_then(Value::as_str).map(str::to_string);
            raw = Some((m, finish));
        }
    }
    if raw.is_none() {
        // any-agent: `gen_ai.output` holds the calls (`[{tool.name, tool.args}]`) or the text.
        if let Some(Value::String(text)) = s.attrs.get("gen_ai.output") {
            let calls: Option<Vec<ToolCall>> = serde_json::from_str::<Value>(text).ok().and_then(|v| {
                let a = v.as_array()?;
                a.iter()
                    .map(|c| {
                        let name = c.get("tool.name")?.as_str()?.to_string();
                        let args = c.get("tool.args").cloned().unwrap_or(Value::Null);
                        let (arguments, arguments_raw) = match args {
                            Value::String(s) => (serde_json::from_str(&s).unwrap_or(Value::Null), Some(s)),
                            v => (v, None),
                        };
                        Some(ToolCall { id: c.get("tool.id").and_then(Value::as_str).map(str::to_string), name, arguments, arguments_raw })
                    })
                    .collect::<Option<Vec<_>>>()
                    .filter(|c| !c.is_empty())
            });
            let msg = match calls {
                Some(tool_calls) => Message { tool_calls, ..Message::text("assistant", "") },
                None => Message::text("assistant", text.clone()),
            };
            let finish = if msg.tool_calls.is_empty() { "stop" } else { "tool_calls" };
            return Ok(Some((msg, Some(finish.to_string()))));
        }
    }
    let Some((m, finish)) = raw else {
        return Ok(None);
    };
    let obj = m.as_object().cloned().unwrap_or_default();
    let mut n = normalize_with_role(&obj, "assistant", None).map_err(|e| format!("output message: {e}"))?;
    notes.append(&mut n.notes);
    let finish = finish.map(|f| if f == "tool_call" { "tool_calls".to_string() } else { f });
    Ok(Some((n.message, finish)))
}

/// The tool message of an `execute_tool` span.
fn tool_result(s: &Span) -> Message {
    let a = &s.attrs;
    let name = a.get("gen_ai.tool.name").or_else(|| a.get("tool.name")).and_then(Value::as_str).map(str::to_string);
    let id = ["gen_ai.tool.call.id", "tool_call.id", "tool.id"].into_iter().find_map(|k| a.get(k).and_then(Value::as_str)).map(|x| x.trim().to_string());
    let result = a.get("gen_ai.tool.call.result").or_else(|| a.get("gen_ai.output")).or_else(|| a.get("output.value"));
    let text = match result {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    Message { tool_call_id: id, name, ..Message::text("tool", text) }
}

/// A model call read from its span, waiting to be emitted.
struct Call {
    request: Vec<Message>,
    response: Message,
    finish: Option<String>,
    model: Option<String>,
    notes: Vec<String>,
    record: i64,
    start_ms: i64,
}

fn conversation(sink: &mut Sink<'_>, trace: &str, spans: &[Span], next_turn: &mut HashMap<String, i32>) -> Result<()> {
    let conv = spans.iter().find_map(|s| s.attrs.get("gen_ai.conversation.id").or_else(|| s.attrs.get("session.id")).and_then(Value::as_str).map(str::to_string));
    let session = match conv {
        Some(c) => c,
        None if !trace.is_empty() => format!("otel:{trace}"),
        None => format!("otel:{}", sink.stem),
    };
    // The tenant the trace names: the agent (`gen_ai.agent.id`), else the user (`user.id`, older
    // `enduser.id`), the first span carrying one; an invalid id dead-letters the turns (`Sink::turn`).
    let tenant = ["gen_ai.agent.id", "user.id", "enduser.id"]
        .into_iter()
        .find_map(|k| spans.iter().find_map(|s| s.attrs.get(k).and_then(Value::as_str).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string)));
    let done = spans.iter().any(|s| kind(s) == Kind::Agent && !s.has_parent);
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    // Turns are emitted one behind: the last one's next state is what follows it.
    let mut context: Vec<Message> = vec![];
    let mut pending: Option<Call> = None;
    let mut turn = next_turn.get(&session).copied().unwrap_or(0);
    let emit = |sink: &mut Sink<'_>, p: Call, turn: i32, next: Option<Vec<Message>>, last: bool| -> Result<()> {
        let Call { request, response, finish, model, notes, record, start_ms } = p;
        let mut t = Turn::new(session.clone(), turn, &request, &response);
        t.tenant = tenant.clone();
        t.model = model;
        t.truncated = finish.as_deref() == Some("length");
        t.finish_reason = finish;
        t.notes = notes;
        t.next_state = next.filter(|n| !n.is_empty());
        t.session_done = last && done;
        t.event_time = (start_ms > 0).then_some(start_ms);
        t.source_line = Some(record);
        sink.turn(t)
    };
    for s in spans {
        match kind(s) {
            Kind::Model => {
                let mut notes = vec![];
                let req = match request_of(s, &mut notes) {
                    Ok(r) => r,
                    Err(e) => {
                        sink.dead_in_session(Some(s.record), &session, "wrong_type", format!("span {}: {e}", s.record), s.name.as_bytes())?;
                        continue;
                    }
                };
                let resp = match response_of(s, &mut notes) {
                    Ok(r) => r,
                    Err(e) => {
                        sink.dead_in_session(Some(s.record), &session, "wrong_type", format!("span {}: {e}", s.record), s.name.as_bytes())?;
                        continue;
                    }
                };
                let Some((response, finish)) = resp else {
                    let what = if req.is_none() { "no request or response messages" } else { "no response message" };
                    sink.dead_in_session(
                        Some(s.record),
                        &session,
                        "no_message_content",
                        format!("span {} ({}): {what} (message content capture is opt-in in GenAI instrumentations)", s.record, s.name),
                        s.name.as_bytes(),
                    )?;
                    continue;
                };
                let request = match req {
                    Some(r) => r,
                    None if !context.is_empty() => {
                        notes.push("request rebuilt from the earlier spans of the trace".into());
                        context.clone()
                    }
                    None => {
                        sink.dead_in_session(
                            Some(s.record),
                            &session,
                            "no_message_content",
                            format!("span {} ({}): no request messages and no earlier model call in the trace (message content capture is opt-in)", s.record, s.name),
                            s.name.as_bytes(),
                        )?;
                        continue;
                    }
                };
                if let Some(p) = pending.take() {
                    emit(sink, p, turn, None, false)?;
                    turn += 1;
                }
                let model = s
                    .attrs
                    .get("gen_ai.response.model")
                    .or_else(|| s.attrs.get("gen_ai.request.model"))
                    .or_else(|| s.attrs.get("llm.model_name"))
                    .and_then(Value::as_str)
                    .map(str::to_string);
                context = request.clone();
                context.push(response.clone());
                pending = Some(Call { request, response, finish, model, notes, record: s.record, start_ms: (s.start_ns / 1_000_000) as i64 });
            }
            Kind::Tool => {
                let mut m = tool_result(s);
                if m.tool_call_id.is_none() {
                    // Answer the earliest unanswered call of this name in the last response.
                    if let Some(last) = context.iter().rev().find(|x| x.role == "assistant") {
                        let taken = context.iter().rev().take_while(|x| x.role == "tool").filter(|x| x.name == m.name).count();
                        m.tool_call_id = last.tool_calls.iter().filter(|c| Some(&c.name) == m.name.as_ref()).nth(taken).and_then(|c| c.id.clone());
                    }
                }
                context.push(m);
                *counts.entry("tool spans".into()).or_insert(0) += 1;
            }
            Kind::Agent => *counts.entry("agent spans".into()).or_insert(0) += 1,
            Kind::Other(op) => *counts.entry(format!("{op} spans")).or_insert(0) += 1,
        }
    }
    if let Some(p) = pending.take() {
        let k = p.request.len() + 1;
        let tail = context.get(k..).map(<[Message]>::to_vec);
        emit(sink, p, turn, tail, true)?;
        turn += 1;
    }
    next_turn.insert(session.clone(), turn);
    for (k, v) in counts {
        sink.count(&k, v);
    }
    Ok(())
}
