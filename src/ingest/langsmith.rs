//! LangSmith runs: the SDK's run create/update payloads `{"post": [run], "patch": [run]}`, a JSON
//! array of runs, or JSONL of runs (exports): `--format langsmith`.
//!
//! From the LangSmith run schema (langsmith-sdk `schemas.py`, `client.py`; read, not copied):
//! - a run is created (post) and updated (patch) under one `id`: the two are merged, later fields
//!   winning (`outputs`, `end_time`, `error` arrive in the patch);
//! - only `run_type = "llm"` runs are turns; chain, tool, retriever, ... runs are counted by type;
//! - `inputs.messages` is the chat request: OpenAI messages (`role`), LangChain message dicts
//!   (`type` = `human`/`ai`/`system`/`tool`) or serialised LangChain messages (`lc`, `id[-1]` =
//!   `HumanMessage`/`AIMessage`/..., `kwargs`), possibly nested one list deep (a batch of one);
//! - `outputs` is the OpenAI response (`choices[0].message`, `finish_reason`) or LangChain
//!   `generations[0][0]` (`message` or `text`); a run with an `error` and no outputs is an
//!   `api_error` dead letter, one without outputs `no_outputs`;
//! - session = `trace_id` (the runs of one trace, in `dotted_order`, are one session's turns);
//!   model = `extra.metadata.ls_model_name`, else the request's or response's `model`; tenant =
//!   `extra.metadata.agent_id`, else `extra.metadata.user_id` (else the default tenant).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{normalize_message, normalize_with_role};
use super::sink::{Sink, Turn};
use super::stream;
use super::timestamp::parse_timestamp;
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut runs: Vec<super::sink::Record> = vec![];
    match stream::read_document(path, sink.opts.max_document_bytes)? {
        stream::Document::TooLarge { .. } => {
            // An export too large to read whole is JSONL: one run per line.
            runs = super::sink::jsonl_objects(path, sink, progress)?;
        }
        stream::Document::Whole(bytes) => {
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(v) => {
                    sink.set_bytes(bytes.len() as u64);
                    progress(bytes.len() as u64);
                    match v {
                        Value::Object(mut o) if o.contains_key("post") || o.contains_key("patch") => {
                            for key in ["post", "patch"] {
                                if let Some(Value::Array(a)) = o.remove(key) {
                                    run_list(sink, key, a, &mut runs)?;
                                }
                            }
                        }
                        Value::Object(mut o) if o.contains_key("runs") => {
                            if let Some(Value::Array(a)) = o.remove("runs") {
                                run_list(sink, "runs", a, &mut runs)?;
                            }
                        }
                        Value::Object(o) => {
                            sink.record_read();
                            runs.push((1, o));
                        }
                        Value::Array(a) => run_list(sink, "element", a, &mut runs)?,
                        other => {
                            sink.dead(None, "wrong_type", format!("a LangSmith file is a JSON object or array, not a {}", super::normalize::json_type(&other)), b"")?
                        }
                    }
                }
                // Not one JSON document: JSONL, one run per line.
                Err(_) => runs = super::sink::jsonl_objects(path, sink, progress)?,
            }
        }
    }
    // Merge post and patch by run id (file order; later fields win).
    let mut merged: Vec<super::sink::Record> = vec![];
    let mut at: HashMap<String, usize> = HashMap::new();
    for (n, r) in runs {
        match r.get("id").and_then(Value::as_str).map(str::to_string) {
            Some(id) if at.contains_key(&id) => {
                let m = &mut merged[at[&id]].1;
                for (k, v) in r {
                    if !v.is_null() {
                        m.insert(k, v);
                    }
                }
                sink.count("run updates merged by id", 1);
            }
            id => {
                if let Some(id) = id {
                    at.insert(id, merged.len());
                }
                merged.push((n, r));
            }
        }
    }
    // Sessions = traces; turns in dotted order.
    let key = |r: &Map<String, Value>| -> (String, String) {
        let trace = r.get("trace_id").or_else(|| r.get("id")).and_then(Value::as_str).unwrap_or("").to_string();
        let order = r.get("dotted_order").and_then(Value::as_str).or_else(|| r.get("start_time").and_then(Value::as_str)).unwrap_or("").to_string();
        (trace, order)
    };
    merged.sort_by_key(|(n, r)| (key(r), *n));
    let mut turns: HashMap<String, i32> = HashMap::new();
    for (n, r) in &merged {
        let run_type = r.get("run_type").and_then(Value::as_str).unwrap_or("");
        if run_type != "llm" {
            sink.count(&format!("{} runs (not model calls)", if run_type.is_empty() { "untyped" } else { run_type }), 1);
            continue;
        }
        let (trace, _) = key(r);
        let session = if trace.is_empty() { format!("langsmith:{}:{n}", sink.stem) } else { format!("langsmith:{trace}") };
        let payload = || serde_json::to_vec(r).unwrap_or_default();
        let outputs = r.get("outputs").filter(|o| o.as_object().is_some_and(|m| !m.is_empty()));
        let Some(outputs) = outputs else {
            match r.get("error").filter(|e| !e.is_null()) {
                Some(e) => sink.dead_in_session(Some(*n), &session, "api_error", format!("run {n}: the model call failed: {e}"), &payload())?,
                None => sink.dead_in_session(
                    Some(*n),
                    &session,
                    "no_outputs",
                    format!("run {n}: an llm run without outputs (not finished, or its update is not in the file)"),
                    &payload(),
                )?,
            }
            continue;
        };
        let mut notes = vec![];
        let raw_messages = r.get("inputs").and_then(|i| i.get("messages")).map(flatten_batch).unwrap_or_default();
        let mut request: Vec<Message> = vec![];
        let mut bad = None;
        for (i, m) in raw_messages.iter().enumerate() {
            match normalize_message(&langchain_to_chat(m)) {
                Ok(mut nm) => {
                    notes.append(&mut nm.notes);
                    request.extend(nm.into_messages());
                }
                Err(e) => {
                    bad = Some((e.code(), format!("run {n}, input message {i}: {e}")));
                    break;
                }
            }
        }
        if let Some((code, reason)) = bad {
            sink.dead_in_session(Some(*n), &session, code, reason, &payload())?;
            continue;
        }
        let (resp_obj, finish) = match response_of(outputs) {
            Some(x) => x,
            None => {
                sink.dead_in_session(Some(*n), &session, "missing_message", format!("run {n}: outputs hold neither choices[0].message nor generations"), &payload())?;
                continue;
            }
        };
        let response = match normalize_with_role(&resp_obj, "assistant", None) {
            Ok(mut r) => {
                notes.append(&mut r.notes);
                r.message
            }
            Err(e) => {
                sink.dead_in_session(Some(*n), &session, e.code(), format!("run {n}, response: {e}"), &payload())?;
                continue;
            }
        };
        let turn = turns.entry(session.clone()).or_insert(0);
        let mut t = Turn::new(session.clone(), *turn, &request, &response);
        *turn += 1;
        t.model = r
            .get("extra")
            .and_then(|e| e.get("metadata"))
            .and_then(|m| m.get("ls_model_name"))
            .or_else(|| r.get("inputs").and_then(|i| i.get("model")))
            .or_else(|| outputs.get("model"))
            .and_then(Value::as_str)
            .map(str::to_string);
        // The tenant the run's metadata names (`extra.metadata.agent_id`, else `user_id`, as users tag
        // runs for filtering); an invalid id dead-letters the turn (`Sink::turn`).
        let metadata = r.get("extra").and_then(|e| e.get("metadata"));
        t.tenant = ["agent_id", "user_id"].into_iter().find_map(|k| metadata.and_then(|m| m.get(k)).and_then(Value::as_str).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string));
        t.tools = r.get("inputs").and_then(|i| i.get("tools")).filter(|v| !v.is_null()).map(Value::to_string);
        t.truncated = finish.as_deref() == Some("length");
        t.finish_reason = finish;
        t.notes = notes;
        t.event_time = r.get("start_time").and_then(parse_timestamp);
        t.source_line = Some(*n);
        sink.turn(t)?;
    }
    Ok(())
}

/// Appends the run objects of a JSON array (numbered from 1); other elements are dead letters.
fn run_list(sink: &mut Sink<'_>, what: &str, a: Vec<Value>, runs: &mut Vec<super::sink::Record>) -> Result<()> {
    for (i, r) in a.into_iter().enumerate() {
        sink.record_read();
        match r {
            Value::Object(r) => runs.push((i as i64 + 1, r)),
            other => sink.dead(
                Some(i as i64 + 1),
                "wrong_type",
                format!("{what} {i} is a JSON {}, expected a run object", super::normalize::json_type(&other)),
                other.to_string().as_bytes(),
            )?,
        }
    }
    Ok(())
}

/// `inputs.messages` as a flat list (LangChain logs a batch: a list of message lists).
fn flatten_batch(v: &Value) -> Vec<Value> {
    match v {
        Value::Array(a) if a.len() == 1 && a[0].is_array() => a[0].as_array().cloned().unwrap_or_default(),
        Value::Array(a) => a.clone(),
        _ => vec![],
    }
}

/// A LangChain message (dict with `type`, or serialised with `lc`/`kwargs`) as an OpenAI chat
/// message; OpenAI messages are returned unchanged.
fn langchain_to_chat(v: &Value) -> Value {
    let Some(o) = v.as_object() else {
        return v.clone();
    };
    if o.contains_key("role") {
        return v.clone();
    }
    let (kind, body) = if o.contains_key("lc") {
        let kind = o.get("id").and_then(Value::as_array).and_then(|a| a.last()).and_then(Value::as_str).unwrap_or("");
        (kind.to_string(), o.get("kwargs").and_then(Value::as_object).cloned().unwrap_or_default())
    } else {
        let kind = o.get("type").and_then(Value::as_str).unwrap_or("").to_string();
        let body = o.get("data").and_then(Value::as_object).cloned().unwrap_or_else(|| o.clone());
        (kind, body)
    };
    let role = match kind.as_str() {
        "HumanMessage" | "HumanMessageChunk" | "human" | "user" => "user",
        "AIMessage" | "AIMessageChunk" | "ai" | "assistant" => "assistant",
        "SystemMessage" | "system" => "system",
        "ToolMessage" | "FunctionMessage" | "tool" | "function" => "tool",
        _ => return v.clone(),
    };
    let mut m = Map::new();
    m.insert("role".into(), Value::String(role.into()));
    m.insert("content".into(), body.get("content").cloned().unwrap_or(Value::Null));
    if let Some(id) = body.get("tool_call_id") {
        m.insert("tool_call_id".into(), id.clone());
    }
    // LangChain tool calls: `[{name, args (object), id}]`.
    if let Some(Value::Array(calls)) = body.get("tool_calls") {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let mut f = Map::new();
                f.insert("name".into(), c.get("name").cloned().unwrap_or(Value::Null));
                f.insert("arguments".into(), c.get("args").or_else(|| c.get("arguments")).cloned().unwrap_or(Value::Null));
                let mut call = Map::new();
                call.insert("id".into(), c.get("id").cloned().unwrap_or(Value::Null));
                call.insert("function".into(), Value::Object(f));
                Value::Object(call)
            })
            .collect();
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(m)
}

/// The response message and finish reason of an llm run's outputs.
fn response_of(outputs: &Value) -> Option<(Map<String, Value>, Option<String>)> {
    if let Some(choice) = outputs.get("choices").and_then(|c| c.get(0)) {
        let msg = choice.get("message").and_then(Value::as_object)?.clone();
        return Some((msg, choice.get("finish_reason").and_then(Value::as_str).map(str::to_string)));
    }
    let g = outputs.get("generations")?;
    let g = if g.get(0).is_some_and(Value::is_array) { g.get(0)?.get(0)? } else { g.get(0)? };
    let finish = g.pointer("/generation_info/finish_reason").and_then(Value::as_str).map(str::to_string);
    if let Some(msg) = g.get("message") {
        let chat = langchain_to_chat(msg);
        return chat.as_object().cloned().map(|m| (m, finish));
    }
    let mut m = Map::new();
    m.insert("content".into(), g.get("text").cloned().unwrap_or(Value::Null));
    Some((m, finish))
}
