//! OpenClaw-RL record JSONL (the reference proxy's `OPENCLAW_RECORD_FILE`): one main turn per line,
//! `{session_id, turn, timestamp, messages, prompt_text, response_text, tool_calls, next_state}`.
//!
//! What the reference writes (read from its proxy, not copied): `messages` = the request messages as
//! the client sent them; `prompt_text` = the chat-template rendering with the generation prompt;
//! `response_text` = the template rendering of the response (may hold `<think>…</think>` and an
//! end-of-turn token); `tool_calls` = the OpenAI tool calls or null; `turn` counts main turns from 1;
//! `timestamp` is local time `YYYY-MM-DD HH:MM:SS` without a zone (read as UTC, noted);
//! `next_state` = the **last** message of the session's next main request, or null.
//!
//! We differ (docs/method.md §1): when the next record of the same session is in the file and its
//! messages continue this record (same request, then one assistant message), the next state is
//! **all** messages after that assistant message (every parallel tool result), not just the last.
//! To do that each session's latest record is held back until the session's next record or the end
//! of the file (memory: one record per open session). A record without a `session_id` (or with the
//! reference's fallback `unknown`) gets an inferred session ([`super::sessions`]).
//! Turns are `main` unless the record says `turn_type: side`; `session_done` is read when present.
//! Optional token fields are accepted: `prompt_token_ids`/`prompt_ids`,
//! `response_token_ids`/`response_ids`, `rollout_logprobs`/`response_logprobs`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::canonical::{message_key, prefix_keys, Key};
use super::normalize::{json_type, normalize_message, normalize_request, normalize_with_role, split_reasoning};
use super::sessions::SessionInferrer;
use super::sink::{Sink, Turn};
use super::timestamp::parse_timestamp;
use crate::schema::{Interaction, Message, TurnType};
use crate::Result;

/// End-of-turn markers a rendered response may end with (not visible text).
const END_MARKERS: [&str; 5] = ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<end_of_turn>"];

struct Held {
    row: Interaction,
    /// Canonical keys of the request messages.
    request_keys: Vec<Key>,
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut held: HashMap<String, Held> = HashMap::new();
    let mut inferrer = SessionInferrer::with_salt(sink.opts.session_cache, &sink.file);
    let mut counters: HashMap<String, i32> = HashMap::new();
    super::sink::read_object_lines(path, sink, progress, &mut |sink, n, text, obj| record(sink, n, text, &obj, &mut held, &mut inferrer, &mut counters))?;
    // End of file: the held records keep the next state the log gave them.
    let mut rest: Vec<Held> = held.into_values().collect();
    rest.sort_by_key(|h| h.row.source_line);
    for h in rest {
        sink.emit(h.row)?;
    }
    Ok(())
}

fn ids<T: TryFrom<i64>>(v: Option<&Value>) -> Option<Vec<T>> {
    v?.as_array()?.iter().map(|x| x.as_i64().and_then(|i| T::try_from(i).ok())).collect()
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], obj: &Map<String, Value>, held: &mut HashMap<String, Held>, inferrer: &mut SessionInferrer, counters: &mut HashMap<String, i32>) -> Result<()> {
    let raw_messages = match obj.get("messages") {
        Some(Value::Array(a)) => a,
        other => {
            let found = other.map(json_type).unwrap_or("missing");
            return sink.dead(Some(n), "missing_messages", format!("line {n}: `messages` is {found}, expected an array"), text);
        }
    };
    let mut notes: Vec<String> = vec![];
    let request = match normalize_request(raw_messages, &mut notes) {
        Ok(ms) => ms,
        Err((i, e)) => return sink.dead(Some(n), e.code(), format!("line {n}, message {i}: {e}"), text),
    };
    // The response: rendered text (reasoning split off, end-of-turn marker dropped) + tool calls.
    let mut response_text = match obj.get("response_text") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(v) => return sink.dead(Some(n), "wrong_type", format!("line {n}: `response_text` is a JSON {}", json_type(v)), text),
    };
    for m in END_MARKERS {
        if let Some(stripped) = response_text.trim_end().strip_suffix(m) {
            response_text = stripped.to_string();
            notes.push(format!("end-of-turn marker {m} removed from the response"));
            break;
        }
    }
    let split = split_reasoning(&response_text);
    let mut resp_obj = Map::new();
    resp_obj.insert("content".into(), Value::String(split.visible.clone()));
    if let Some(tc) = obj.get("tool_calls") {
        resp_obj.insert("tool_calls".into(), tc.clone());
    }
    let mut response = match normalize_with_role(&resp_obj, "assistant", None) {
        Ok(r) => {
            notes.extend(r.notes);
            r.message
        }
        Err(e) => return sink.dead(Some(n), e.code(), format!("line {n}, response: {e}"), text),
    };
    response.reasoning = split.reasoning;
    if response.content.is_empty() && response.tool_calls.is_empty() && response.reasoning.is_none() {
        return sink.dead(Some(n), "empty_response", format!("line {n}: no response_text and no tool_calls"), text);
    }
    // Session.
    let (session_id, inferred) = match obj.get("session_id").and_then(Value::as_str) {
        Some(s) if !s.is_empty() && s != "unknown" => (s.to_string(), None),
        _ => {
            let inf = inferrer.assign(&request, &response);
            notes.push("no session_id: session inferred from the messages".into());
            (inf.session_id.clone(), Some(inf))
        }
    };
    let turn_index = match (&inferred, obj.get("turn").and_then(Value::as_i64)) {
        (Some(inf), _) => inf.turn_index,
        (None, Some(t)) if t >= 1 && t <= i32::MAX as i64 => (t - 1) as i32,
        (None, _) => {
            let c = counters.entry(session_id.clone()).or_insert(0);
            *c += 1;
            notes.push("no turn number: turn index counted in file order".into());
            *c - 1
        }
    };
    let event_time = obj.get("timestamp").and_then(parse_timestamp);
    if matches!(obj.get("timestamp"), Some(Value::String(s)) if !s.contains('Z') && !s.contains('+')) && event_time.is_some() {
        notes.push("timestamp has no time zone: read as UTC".into());
    }
    let log_next = match obj.get("next_state") {
        None | Some(Value::Null) => None,
        Some(ns) => match normalize_message(ns) {
            Ok(nm) => Some(vec![nm.message]),
            Err(e) => {
                notes.push(format!("next_state unusable ({e}); left to pairing"));
                None
            }
        },
    };
    let truthy = |k: &str| match obj.get(k) {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => matches!(s.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"),
        Some(Value::Number(x)) => x.as_i64() == Some(1),
        _ => false,
    };
    let mut t = Turn::new(session_id.clone(), turn_index, &request, &response);
    t.session_inferred = inferred.is_some();
    t.turn_type = obj.get("turn_type").and_then(Value::as_str).and_then(TurnType::parse).unwrap_or(TurnType::Main);
    t.session_done = truthy("session_done");
    t.model = obj.get("model").and_then(Value::as_str).map(str::to_string);
    t.prompt_text = obj.get("prompt_text").and_then(Value::as_str).map(str::to_string);
    t.prompt_token_ids = ids(obj.get("prompt_token_ids").or_else(|| obj.get("prompt_ids")));
    t.response_token_ids = ids(obj.get("response_token_ids").or_else(|| obj.get("response_ids")));
    t.rollout_logprobs = obj
        .get("rollout_logprobs")
        .or_else(|| obj.get("response_logprobs"))
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect());
    t.truncated = split.truncated;
    t.next_state = log_next;
    t.notes = notes;
    t.event_time = event_time;
    t.source_line = Some(n);
    let row = sink.build(t)?;
    let request_keys = prefix_keys(&request);
    // Release the session's previous record, with its next state taken from this request if it
    // continues it.
    if let Some(mut prev) = held.remove(&session_id) {
        let k = prev.request_keys.len();
        let continues = request.len() > k + 1 && (k == 0 || request_keys.get(k - 1) == prev.request_keys.last()) && request[k].role == "assistant";
        let suffix: &[Message] = if continues { &request[k + 1..] } else { &[] };
        if !suffix.is_empty() && suffix.iter().all(|m| m.role != "assistant") {
            let derived = serde_json::to_string(suffix)?;
            let same = prev
                .row
                .next_state
                .as_deref()
                .and_then(|s| serde_json::from_str::<Vec<Message>>(s).ok())
                .map(|v| v.len() == suffix.len() && v.iter().zip(suffix).all(|(a, b)| message_key(a) == message_key(b)));
            if same != Some(true) {
                prev.row.notes.push(format!(
                    "next state taken from the next record's request ({} message{}) instead of the record's next_state",
                    suffix.len(),
                    if suffix.len() == 1 { "" } else { "s" }
                ));
            }
            prev.row.next_state = Some(derived);
        }
        sink.emit(prev.row)?;
    }
    held.insert(session_id, Held { row, request_keys });
    Ok(())
}
