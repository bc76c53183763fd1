//! Gemini CLI chat recordings: `--format gemini-cli`. Read from google-gemini/gemini-cli
//! `packages/core/src/services/chatRecordingService.ts` (`loadConversationRecord`, the writer's
//! `recordMessage`/`recordToolCalls`/`rewindTo`/`updateMessagesFromHistory`) and
//! `chatRecordingTypes.ts`, and the real capture in `../shared/data/agent-logs-2026`. Two forms:
//!
//! - the JSONL recording (2026, `~/.gemini/tmp/<project hash>/chats/session-*.jsonl`), one record a
//!   line, read the way the CLI's loader reads it:
//!   - a header `{sessionId, projectHash, startTime, lastUpdated, kind}` (a whole legacy record on
//!     one line also carries `messages`, each read as a message record);
//!   - a message record (any object with a string `id`): the CLI appends a message again, under the
//!     same id, each time it changes (tokens arrive, tool calls are added and then finished): the
//!     **last version of each id wins**, at the place where the id first appeared;
//!   - `{"$set": {...}}` metadata updates (counted); `{"$set": {"messages": [...]}}` is a checkpoint
//!     that restates the whole conversation (after compression or masking): the conversation is
//!     rebuilt from it;
//!   - `{"$rewindTo": id}`: the user rewound; that message and every later one leave the
//!     conversation (all of it when the id is unknown).
//! - the legacy single JSON document (`session-*.json`, pretty-printed):
//!   `{sessionId, projectHash, startTime, lastUpdated, messages: [...]}`.
//!
//! A message is `{id, timestamp, type, content, displayContent?}` with `content` a Gemini
//! `PartListUnion` (string or `{text}` / `functionCall` / `functionResponse` parts, read by the shared
//! normaliser). `type`:
//! - `user` → a user message (`displayContent`, what the UI showed, is not read);
//! - `gemini` → an assistant message, one turn (one model response, however many times it was
//!   rewritten): `content`, `thoughts[]` (`{subject, description}`, as reasoning), `model`, and
//!   `toolCalls[]` (`{id, name, args, result, status, ...}`) as its tool calls. A call's `result`
//!   (`functionResponse` parts, `response: {output}` or `{error}`) is emitted as the `tool` message
//!   answering it, right after the assistant message: the call's next state. A result already given
//!   in the conversation (a checkpoint restating it as a user message) is not added twice; a gemini
//!   record with no text, thoughts or calls is counted, not a turn;
//! - `info`, `error`, `warning`: the CLI's notices to the user, not model context (counted).
//!
//! Segments: the turns of the conversation as it stood before a checkpoint or a rewind are emitted
//! then (their messages then leave or are restated); the conversation after it numbers its turns on,
//! and a model response already emitted is context there, never a second turn. The file has no end
//! marker: the session is never `session_done`, and the messages after the last turn are its next
//! state.
//!
//! Session id = `gemini-cli:<sessionId>` (else the file stem). A line that is not a JSON object is a
//! dead letter and the rest of the file is read; a message the normaliser rejects is a dead letter
//! (once) and left out. The session is held in memory while it is read.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{normalize_with_role, Normalized};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, emit_event_session, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    if is_pretty_document(path, sink.opts.max_line_bytes)? {
        return read_legacy(path, sink, progress);
    }
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let session = session_id(records.iter().map(|(_, r)| r), &sink.stem);
    let mut s = Session::new(session);
    for (n, r) in records.iter() {
        if let Some(id) = r.get("$rewindTo").and_then(Value::as_str) {
            s.count("$rewindTo records (later messages leave the conversation)", 1);
            s.flush(sink)?;
            let removed = s.conversation.rewind(id);
            s.count("messages removed by $rewindTo", removed as u64);
        } else if r.get("id").is_some_and(Value::is_string) {
            s.upsert(Some(*n), r.clone());
        } else if let Some(Value::Object(set)) = r.get("$set") {
            if let Some(Value::Array(messages)) = set.get("messages") {
                s.count("checkpoints ($set.messages, the conversation restated)", 1);
                s.flush(sink)?;
                s.conversation = Conversation::default();
                s.upsert_all(Some(*n), messages);
            } else {
                s.count("metadata updates ($set)", 1);
            }
        } else if r.get("sessionId").is_some_and(Value::is_string) {
            s.count("header records", 1);
            if let Some(Value::Array(messages)) = r.get("messages") {
                s.upsert_all(Some(*n), messages);
            }
        } else {
            s.count("records of no known shape", 1);
        }
    }
    s.finish(sink, records.len())
}

/// The legacy `session-*.json`: one `ConversationRecord` document.
fn read_legacy(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let Some(doc) = sink.load_document(path, progress)? else {
        return Ok(());
    };
    let Some(messages) = doc.get("messages").and_then(Value::as_array) else {
        let why = "document has no messages array (expected a Gemini CLI ConversationRecord)";
        return sink.dead(None, "wrong_type", why, doc.to_string().as_bytes());
    };
    let mut s = Session::new(session_id(doc.as_object().into_iter(), &sink.stem));
    s.upsert_all(None, messages);
    s.finish(sink, messages.len())
}

/// Whether the file's first non-blank line is a lone `{`: the pretty-printed legacy document (a
/// recording's first line is a whole JSON record).
fn is_pretty_document(path: &Path, max_line: usize) -> Result<bool> {
    let mut lines = BufReader::new(super::stream::open(path)?.take(max_line as u64)).split(b'\n');
    for line in lines.by_ref() {
        let line = line.map_err(|e| crate::Error::io("read", path, e))?;
        let line = line.strip_prefix(super::stream::UTF8_BOM).unwrap_or(&line).trim_ascii();
        if !line.is_empty() {
            return Ok(line == b"{");
        }
    }
    Ok(false)
}

/// `gemini-cli:<sessionId>` of the first record that names one, else `gemini-cli:<stem>`.
fn session_id<'a>(mut records: impl Iterator<Item = &'a Map<String, Value>>, stem: &str) -> String {
    let id = records.find_map(|r| r.get("sessionId").and_then(Value::as_str).filter(|s| !s.is_empty())).unwrap_or(stem);
    format!("gemini-cli:{id}")
}

/// The message records by id, in first-appearance order, each in its last version (with the line it
/// was read from).
#[derive(Default)]
struct Conversation {
    order: Vec<String>,
    records: HashMap<String, (Option<i64>, Map<String, Value>)>,
}

impl Conversation {
    /// Removes `id` and every later message (all of them when `id` is unknown); returns how many.
    fn rewind(&mut self, id: &str) -> usize {
        let at = self.order.iter().position(|x| x == id).unwrap_or(0);
        let gone: Vec<String> = self.order.drain(at..).collect();
        for g in &gone {
            self.records.remove(g);
        }
        gone.len()
    }
}

/// One recording being read: the conversation, what was already emitted, and the counters.
struct Session {
    id: String,
    conversation: Conversation,
    /// Gemini message ids already emitted as turns (in an earlier segment).
    emitted: HashSet<String>,
    /// Message ids already dead-lettered (a segment rebuilt later does not report them again).
    reported: HashSet<String>,
    next_turn: i32,
    counts: HashMap<String, u64>,
}

impl Session {
    fn new(id: String) -> Session {
        Session { id, conversation: Conversation::default(), emitted: HashSet::new(), reported: HashSet::new(), next_turn: 0, counts: HashMap::new() }
    }

    fn count(&mut self, what: &str, n: u64) {
        if n > 0 {
            *self.counts.entry(what.to_string()).or_insert(0) += n;
        }
    }

    /// Adds a message record, or replaces the earlier version of its id in place.
    fn upsert(&mut self, line: Option<i64>, record: Map<String, Value>) {
        let Some(id) = record.get("id").and_then(Value::as_str).map(str::to_string) else {
            self.count("messages without an id", 1);
            return;
        };
        if self.conversation.records.insert(id.clone(), (line, record)).is_some() {
            self.count("message records rewritten (the last version kept)", 1);
        } else {
            self.conversation.order.push(id);
        }
    }

    fn upsert_all(&mut self, line: Option<i64>, messages: &[Value]) {
        for m in messages {
            match m {
                Value::Object(o) => self.upsert(line, o.clone()),
                _ => self.count("messages that are not objects", 1),
            }
        }
    }

    /// The current conversation as a trajectory (turns already emitted marked `not_turn`), with the
    /// ids of its new turns.
    fn trajectory(&mut self, sink: &mut Sink<'_>) -> Result<(Trajectory, Vec<String>)> {
        let mut t = Trajectory { first_turn: self.next_turn, ..Trajectory::default() };
        let mut turns = vec![];
        let mut answered: HashSet<String> = HashSet::new();
        let mut notices: HashMap<String, u64> = HashMap::new();
        for id in &self.conversation.order {
            let Some((line, rec)) = self.conversation.records.get(id) else { continue };
            let meta = MessageMeta { event_time: rec.get("timestamp").and_then(parse_timestamp), line: *line, ..MessageMeta::default() };
            let kind = rec.get("type").and_then(Value::as_str).unwrap_or("");
            let built = match kind {
                "user" => match user_message(rec, &mut answered) {
                    Ok(Some(n)) => Ok(vec![(n, meta)]),
                    Ok(None) => {
                        *notices.entry("user records only restating tool results already given".into()).or_insert(0) += 1;
                        continue;
                    }
                    Err(e) => Err(e),
                },
                "gemini" => match gemini_message(rec, &mut answered) {
                    Ok(None) => {
                        *notices.entry("gemini records without text, thoughts or calls".into()).or_insert(0) += 1;
                        continue;
                    }
                    Ok(Some((n, results))) => {
                        let not_turn = self.emitted.contains(id);
                        if !not_turn {
                            turns.push(id.clone());
                        }
                        let model = rec.get("model").and_then(Value::as_str).map(str::to_string);
                        let mut out = vec![(n, MessageMeta { model, not_turn, ..meta.clone() })];
                        out.extend(results.into_iter().map(|m| (Normalized::new(m), MessageMeta { not_turn: false, model: None, ..meta.clone() })));
                        Ok(out)
                    }
                    Err(e) => Err(e),
                },
                "info" | "error" | "warning" => {
                    *notices.entry(format!("{kind} messages (CLI notices, not model context)")).or_insert(0) += 1;
                    continue;
                }
                other => {
                    *notices.entry(format!("messages of type {other:?} (not read)")).or_insert(0) += 1;
                    continue;
                }
            };
            match built {
                Ok(ms) => ms.into_iter().for_each(|(n, m)| t.push(n, m)),
                Err(err) => {
                    if self.reported.insert(id.clone()) {
                        let why = format!("message {id}: {err}");
                        sink.dead_in_session(*line, &self.id, err.code(), why, &serde_json::to_vec(rec)?)?;
                    }
                }
            }
        }
        // Notices are counted for the conversation as last read (a segment before it may hold more).
        self.counts.extend(notices);
        Ok((t, turns))
    }

    /// Emits the turns of the conversation as it stands (the segment before a checkpoint or rewind).
    fn flush(&mut self, sink: &mut Sink<'_>) -> Result<()> {
        let (mut t, turns) = self.trajectory(sink)?;
        t.tail_is_next_state = true;
        self.next_turn += emit(sink, &self.id, &t, Some(1))? as i32;
        self.emitted.extend(turns);
        Ok(())
    }

    /// Emits the last segment and the counters; a recording without any turn is one dead letter.
    fn finish(mut self, sink: &mut Sink<'_>, records: usize) -> Result<()> {
        let (t, _) = self.trajectory(sink)?;
        let records = if self.emitted.is_empty() { records } else { 0 };
        emit_event_session(sink, &self.id, t, false, self.counts, records, "chat recording has no gemini message")
    }
}

/// A `user` record → a user message; the tool results it restates (`functionResponse` parts of a
/// checkpoint) are kept only when not given already; `None` when nothing else is left.
fn user_message(rec: &Map<String, Value>, answered: &mut HashSet<String>) -> std::result::Result<Option<Normalized>, super::normalize::NormError> {
    let mut raw = Map::new();
    raw.insert("content".into(), rec.get("content").cloned().unwrap_or(Value::Null));
    let mut n = normalize_with_role(&raw, "user", None)?;
    let restated = n.before.len();
    n.before.retain(|m| m.tool_call_id.as_ref().is_none_or(|id| answered.insert(id.clone())));
    if restated > 0 && n.before.is_empty() && n.message.content.trim().is_empty() {
        return Ok(None);
    }
    Ok(Some(n))
}

/// A `gemini` record → the assistant message and the `tool` messages answering its finished calls;
/// `None` for a record with no text, thoughts or calls.
fn gemini_message(rec: &Map<String, Value>, answered: &mut HashSet<String>) -> std::result::Result<Option<(Normalized, Vec<Message>)>, super::normalize::NormError> {
    let mut raw = Map::new();
    raw.insert("content".into(), rec.get("content").cloned().unwrap_or(Value::Null));
    let thoughts: Vec<String> = rec
        .get("thoughts")
        .and_then(Value::as_array)
        .map(|ts| {
            ts.iter()
                .filter_map(|t| {
                    let part = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("").trim().to_string();
                    let text = [part("subject"), part("description")].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>().join("\n");
                    (!text.is_empty()).then_some(text)
                })
                .collect()
        })
        .unwrap_or_default();
    if !thoughts.is_empty() {
        raw.insert("reasoning_content".into(), Value::String(thoughts.join("\n\n")));
    }
    let calls: Vec<&Value> = rec.get("toolCalls").and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default();
    let wire: Vec<Value> = calls.iter().map(|c| serde_json::json!({"id": c.get("id"), "name": c.get("name"), "arguments": c.get("args").cloned().unwrap_or(Value::Null)})).collect();
    if !wire.is_empty() {
        raw.insert("tool_calls".into(), Value::Array(wire));
    }
    let mut n = normalize_with_role(&raw, "assistant", None)?;
    // A call restated as a `functionCall` part and listed in `toolCalls` is one call.
    let mut seen = HashSet::new();
    n.message.tool_calls.retain(|c| c.id.as_ref().is_none_or(|id| seen.insert(id.clone())));
    if n.message.content.trim().is_empty() && n.message.reasoning.as_deref().is_none_or(str::is_empty) && n.message.tool_calls.is_empty() {
        return Ok(None);
    }
    let mut results = vec![];
    for c in calls {
        let Some(id) = c.get("id").and_then(Value::as_str) else { continue };
        let result = match c.get("result") {
            None | Some(Value::Null) => continue,
            Some(v @ Value::Array(_)) => v.clone(),
            Some(v) => Value::Array(vec![v.clone()]),
        };
        if !answered.insert(id.to_string()) {
            continue;
        }
        let mut wrap = Map::new();
        wrap.insert("content".into(), result);
        let r = normalize_with_role(&wrap, "user", None)?;
        let name = c.get("name").and_then(Value::as_str).map(str::to_string);
        // The functionResponse part is the result; text parts beside it join its text.
        let mut text = r.before.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n");
        if !r.message.content.is_empty() {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&r.message.content);
        }
        results.push(Message { tool_call_id: Some(id.to_string()), name, ..Message::text("tool", text) });
    }
    Ok(Some((n, results)))
}
