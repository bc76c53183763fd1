//! The machinery every ingest adapter shares: [`Sink`] (counts what a file gave, builds
//! [`Interaction`]s and dead letters with the file's lineage, refuses a second row of one session and
//! turn), [`Turn`] (what an adapter knows of one assistant turn) and the JSONL line readers
//! ([`read_lines`], [`read_object_lines`], [`jsonl_objects`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use serde_json::{Map, Value};

use super::format::Format;
use super::options::IngestOptions;
use super::output::{FileSummary, IngestItem};
use super::stream::Compression;
use super::{normalize, stream};
use crate::schema::{DeadLetter, Interaction, Lineage, Message, TurnType};
use crate::Result;

/// A JSON object of an input file with its record number (1-based line or element index).
pub(crate) type Record = (i64, Map<String, Value>);

/// What reads one line of a JSONL log: (sink, 1-based line number, the line's bytes).
pub(crate) type LineFn<'f> = dyn FnMut(&mut Sink<'_>, i64, &[u8]) -> Result<()> + 'f;

/// Reads every non-blank line of a JSONL log, handing each line's bytes to `record`; an over-long
/// line is a `line_too_long` dead letter. The bytes read and the blank lines go to the sink's summary.
///
/// # Errors
/// [`crate::Error::Io`] on read errors; errors from `record`.
pub(crate) fn read_lines(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64), record: &mut LineFn<'_>) -> Result<()> {
    let max = sink.opts.max_line_bytes;
    let (bytes, blank) = stream::for_each_line(path, max, sink.opts.read_limit, progress, &mut |n, line, _| {
        sink.next_record()?;
        match line {
            stream::Line::TooLong { head, len } => sink.dead(Some(n), "line_too_long", format!("line of {len} bytes is over the {max}-byte limit"), head),
            stream::Line::Text(text) => record(sink, n, text),
        }
    })?;
    sink.set_bytes(bytes);
    sink.count("blank lines", blank);
    Ok(())
}

/// [`read_lines`] for logs of one JSON object a line: `record` gets (sink, line number, the line's
/// bytes, its object). A line that is not JSON (e.g. stray bytes before the object) is a
/// `malformed_json` dead letter, one that is not an object a `wrong_type` one; the rest of the file
/// is still read.
///
/// # Errors
/// As [`read_lines`].
pub(crate) fn read_object_lines(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64), record: &mut dyn FnMut(&mut Sink<'_>, i64, &[u8], Map<String, Value>) -> Result<()>) -> Result<()> {
    read_lines(path, sink, progress, &mut |sink, n, text| match serde_json::from_slice::<Value>(text) {
        Ok(Value::Object(o)) => record(sink, n, text, o),
        Ok(v) => sink.dead(Some(n), "wrong_type", format!("line {n} is a JSON {}, expected an object", normalize::json_type(&v)), text),
        Err(e) => sink.dead(Some(n), "malformed_json", format!("line {n}: {e}"), text),
    })
}

/// Every JSON-object line of a JSONL file with its 1-based line number ([`read_object_lines`]), for
/// formats that need a whole session file before emitting (session transcripts, event streams).
///
/// # Errors
/// As [`read_lines`].
pub(crate) fn jsonl_objects(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<Vec<Record>> {
    let mut out = vec![];
    read_object_lines(path, sink, progress, &mut |_, n, _, o| {
        out.push((n, o));
        Ok(())
    })?;
    Ok(out)
}

/// Counts and forwards adapter output; builds interactions and dead letters with the file's lineage.
pub(crate) struct Sink<'a> {
    pub format: Format,
    pub file: String,
    /// File name without extension, used in session ids of single-trajectory formats.
    pub stem: String,
    pub opts: &'a IngestOptions,
    out: &'a mut dyn FnMut(IngestItem) -> Result<()>,
    summary: FileSummary,
    /// Turn indices emitted so far, by session (a second row with the same session and turn is a
    /// `duplicate_turn` dead letter).
    turns: HashMap<String, HashSet<i32>>,
}

impl<'a> Sink<'a> {
    pub(super) fn new(format: Format, path: &Path, opts: &'a IngestOptions, out: &'a mut dyn FnMut(IngestItem) -> Result<()>) -> Sink<'a> {
        Sink {
            format,
            file: path.display().to_string(),
            stem: {
                // `x.jsonl.gz` → `x`: the compression extension, then the format's.
                let inner = if Compression::of(path) == Compression::None { path.to_path_buf() } else { path.with_extension("") };
                inner.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
            },
            opts,
            out,
            summary: FileSummary {
                format,
                detection: None,
                bytes: 0,
                records: 0,
                sessions: 0,
                interactions: 0,
                dead_letters: 0,
                dead_letters_by_reason: BTreeMap::new(),
                counters: BTreeMap::new(),
            },
            turns: HashMap::new(),
        }
    }

    pub(super) fn finish(mut self) -> FileSummary {
        self.summary.sessions = self.turns.len() as u64;
        self.summary
    }

    pub fn lineage(&self, line: Option<i64>) -> Lineage {
        Lineage { source_file: Some(self.file.clone()), source_line: line, ..Lineage::default() }
    }

    /// Emits a dead letter for the record at `line`.
    pub fn dead(&mut self, line: Option<i64>, code: &str, reason: impl Into<String>, payload: &[u8]) -> Result<()> {
        self.opts.check_stop()?;
        let dl = DeadLetter::new("ingest", code, reason, payload, self.lineage(line));
        self.summary.dead_letters += 1;
        *self.summary.dead_letters_by_reason.entry(code.to_string()).or_insert(0) += 1;
        (self.out)(IngestItem::DeadLetter(Box::new(dl)))
    }

    /// Emits a dead letter that names its session.
    pub fn dead_in_session(&mut self, line: Option<i64>, session: &str, code: &str, reason: impl Into<String>, payload: &[u8]) -> Result<()> {
        self.opts.check_stop()?;
        let dl = DeadLetter::new("ingest", code, reason, payload, self.lineage(line)).with_keys(session, None);
        self.summary.dead_letters += 1;
        *self.summary.dead_letters_by_reason.entry(code.to_string()).or_insert(0) += 1;
        (self.out)(IngestItem::DeadLetter(Box::new(dl)))
    }

    /// Adds `n` to a named counter.
    pub fn count(&mut self, name: &str, n: u64) {
        if n > 0 {
            *self.summary.counters.entry(name.to_string()).or_insert(0) += n;
        }
    }

    pub fn record_read(&mut self) {
        self.summary.records += 1;
    }

    /// Counts a record about to be read, after checking [`IngestOptions::stop`]: the check every
    /// streaming reader makes between records.
    ///
    /// # Errors
    /// [`crate::Error::Cancelled`] once a stop was requested.
    pub fn next_record(&mut self) -> Result<()> {
        self.opts.check_stop()?;
        self.record_read();
        Ok(())
    }

    pub fn set_bytes(&mut self, bytes: u64) {
        self.summary.bytes = bytes;
    }

    /// Reads a single-document file (bounded by [`IngestOptions::max_document_bytes`]) and parses it
    /// as JSON; a too-large or malformed document becomes a dead letter and `None`.
    ///
    /// # Errors
    /// [`crate::Error::Io`] on read errors; errors from the callback.
    pub fn load_document(&mut self, path: &Path, progress: &mut dyn FnMut(u64)) -> Result<Option<serde_json::Value>> {
        match stream::read_document(path, self.opts.max_document_bytes)? {
            stream::Document::TooLarge { size, head } => {
                self.set_bytes(head.len() as u64);
                let max = self.opts.max_document_bytes;
                self.dead(None, "document_too_large", format!("{size} bytes is over the single-document limit of {max} bytes (payload: first bytes)"), &head)?;
                Ok(None)
            }
            stream::Document::Whole(bytes) => {
                self.record_read();
                self.set_bytes(bytes.len() as u64);
                progress(bytes.len() as u64);
                match serde_json::from_slice::<serde_json::Value>(&bytes) {
                    Ok(v) => Ok(Some(v)),
                    Err(e) => {
                        let head = &bytes[..bytes.len().min(1 << 16)];
                        self.dead(None, "malformed_json", format!("not valid JSON: {e} (payload: first bytes)"), head)?;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Builds the interaction for `t` and emits it.
    pub fn turn(&mut self, t: Turn<'_>) -> Result<()> {
        let row = self.build(t)?;
        self.emit(row)
    }

    /// Emits a built interaction; a second row of the same session and turn index in this file
    /// becomes a `duplicate_turn` dead letter instead (the first one wins), and a row whose tenant (as
    /// the log named it) is not a valid tenant id an `invalid_tenant` one.
    pub fn emit(&mut self, row: Interaction) -> Result<()> {
        self.opts.check_stop()?;
        // Per tenant: two tenants' sessions of one id are two sessions (as the signals stage pairs them).
        let key = crate::schema::tenant_session_key(row.tenant.as_deref(), &row.session_id);
        let fresh = match self.turns.get_mut(&key) {
            Some(t) => t.insert(row.turn_index),
            None => {
                self.turns.insert(key, HashSet::from([row.turn_index]));
                true
            }
        };
        if !fresh {
            let reason = format!("turn {} of session {:?} already read from this file", row.turn_index, row.session_id);
            let payload = serde_json::to_vec(&row)?;
            return self.dead_in_session(row.source_line, &row.session_id.clone(), "duplicate_turn", reason, &payload);
        }
        if let Some(Err(e)) = row.tenant.as_deref().map(crate::schema::validate_tenant) {
            // The log named it (e.g. OpenAI's `user`); `--tenant` would have replaced it.
            let reason = format!("turn {} of session {:?}: the log's {e}; `ingest --tenant NAME` sets the tenant of every turn instead", row.turn_index, row.session_id);
            let payload = serde_json::to_vec(&row)?;
            return self.dead_in_session(row.source_line, &row.session_id.clone(), "invalid_tenant", reason, &payload);
        }
        self.summary.interactions += 1;
        (self.out)(IngestItem::Interaction(Box::new(row)))
    }

    /// Builds the interaction for `t` (fills ids, JSON columns, lineage and times).
    ///
    /// # Errors
    /// [`crate::Error::Json`] if a message cannot be serialised (does not happen for valid strings).
    pub fn build(&self, mut t: Turn<'_>) -> Result<Interaction> {
        validate_tokens(&mut t);
        let request_messages = serde_json::to_string(t.request)?;
        let tool_calls = if t.response.tool_calls.is_empty() { None } else { Some(serde_json::to_string(&t.response.tool_calls)?) };
        let next_state = match &t.next_state {
            Some(ns) => Some(serde_json::to_string(ns)?),
            None => None,
        };
        let tenant = self.opts.tenant.clone().or(t.tenant).unwrap_or_else(|| crate::schema::DEFAULT_TENANT.to_string());
        let interaction_id = Interaction::compute_id_for(&tenant, &t.session_id, t.turn_index, &request_messages, &t.response.content, tool_calls.as_deref());
        let truncated = t.truncated || t.finish_reason.as_deref() == Some("length");
        let mut notes: Vec<String> = Vec::with_capacity(t.notes.len());
        for n in t.notes {
            if !notes.contains(&n) {
                notes.push(n);
            }
        }
        let row = Interaction {
            schema_version: <Interaction as crate::schema::Table>::SCHEMA_VERSION,
            interaction_id,
            session_id: t.session_id,
            tenant: Some(tenant),
            session_inferred: t.session_inferred,
            turn_index: t.turn_index,
            turn_type: t.turn_type,
            session_done: t.session_done,
            policy_version: None,
            model: t.model,
            request_messages,
            tools: t.tools,
            response_text: t.response.content.clone(),
            reasoning_text: t.response.reasoning.clone(),
            tool_calls,
            finish_reason: t.finish_reason,
            truncated,
            prompt_text: t.prompt_text,
            prompt_token_ids: t.prompt_token_ids,
            response_token_ids: t.response_token_ids,
            rollout_logprobs: t.rollout_logprobs,
            next_state,
            outcome_reward: t.outcome_reward,
            notes,
            source_format: self.format.name().to_string(),
            source_topic: None,
            source_partition: None,
            source_offset: None,
            source_file: Some(self.file.clone()),
            source_line: t.source_line,
            event_time: t.event_time.unwrap_or(self.opts.ingest_time_ms),
            ingest_time: self.opts.ingest_time_ms,
        };
        Ok(row)
    }
}

/// Checks a turn's token data, whatever adapter read it: token ids must be non-negative, log-probs
/// finite as `f32` (a JSON `-1e300` is finite as `f64` but `-inf` as `f32`), and one log-prob per
/// response token id. Invalid parts are removed with a note saying what and where (the teacher stage
/// recomputes rollout log-probs from the text); the turn itself is kept.
fn validate_tokens(t: &mut Turn<'_>) {
    let negative = |ids: &[i32]| ids.iter().position(|&x| x < 0).map(|i| (i, ids[i]));
    if let Some((i, x)) = t.prompt_token_ids.as_deref().and_then(negative) {
        t.notes.push(format!("negative token id {x} at prompt position {i}: prompt token ids dropped"));
        t.prompt_token_ids = None;
    }
    if let Some((i, x)) = t.response_token_ids.as_deref().and_then(negative) {
        t.notes.push(format!("negative token id {x} at response position {i}: response token ids and log-probs dropped"));
        t.response_token_ids = None;
        t.rollout_logprobs = None;
    }
    if let Some(i) = t.rollout_logprobs.as_deref().and_then(|lp| lp.iter().position(|x| !x.is_finite())) {
        t.notes.push(format!("non-finite log-prob at response position {i} (as f32): log-probs dropped"));
        t.rollout_logprobs = None;
    }
    if let (Some(ids), Some(lps)) = (&t.response_token_ids, &t.rollout_logprobs) {
        if ids.len() != lps.len() {
            t.notes.push(format!("{} log-probs for {} token ids: log-probs dropped", lps.len(), ids.len()));
            t.rollout_logprobs = None;
        }
    }
}

/// Everything an adapter knows about one assistant turn; [`Sink::turn`] turns it into an
/// [`Interaction`].
pub(crate) struct Turn<'m> {
    pub session_id: String,
    pub session_inferred: bool,
    pub turn_index: i32,
    pub turn_type: TurnType,
    pub session_done: bool,
    pub model: Option<String>,
    pub request: &'m [Message],
    pub tools: Option<String>,
    pub response: &'m Message,
    pub finish_reason: Option<String>,
    pub truncated: bool,
    pub prompt_text: Option<String>,
    pub prompt_token_ids: Option<Vec<i32>>,
    pub response_token_ids: Option<Vec<i32>>,
    pub rollout_logprobs: Option<Vec<f32>>,
    pub next_state: Option<Vec<Message>>,
    pub outcome_reward: Option<f64>,
    pub notes: Vec<String>,
    pub event_time: Option<i64>,
    pub source_line: Option<i64>,
    /// The tenant the log names for this turn ([`request_tenant`]); `IngestOptions::tenant` wins over it.
    pub tenant: Option<String>,
}

/// The tenant a logged request names: its `headers`' `X-Agent-Id`, else `X-User-Id` (any case; what
/// the capture proxy reads, [`crate::schema::TENANT_HEADERS`]; not checked here: [`Sink::emit`]
/// dead-letters a turn whose header names an invalid tenant), else the tenant its body names
/// ([`super::normalize::body_tenant`], valid ids only; an invalid one is a note in `notes`).
pub(crate) fn request_tenant(line: &Map<String, Value>, req: &Map<String, Value>, notes: &mut Vec<String>) -> Option<String> {
    let headers = line.get("headers").and_then(Value::as_object);
    let header = |name: &str| headers.and_then(|h| h.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v));
    crate::schema::TENANT_HEADERS
        .iter()
        .filter_map(|h| header(h))
        .filter_map(Value::as_str)
        .map(str::trim)
        .find(|s| !s.is_empty())
        .map(str::to_string)
        .or_else(|| super::normalize::body_tenant(req, notes))
}

impl<'m> Turn<'m> {
    /// A turn with every optional field empty.
    pub fn new(session_id: String, turn_index: i32, request: &'m [Message], response: &'m Message) -> Turn<'m> {
        Turn {
            session_id,
            session_inferred: false,
            turn_index,
            turn_type: TurnType::Main,
            session_done: false,
            model: None,
            request,
            tools: None,
            response,
            finish_reason: None,
            truncated: false,
            prompt_text: None,
            prompt_token_ids: None,
            response_token_ids: None,
            rollout_logprobs: None,
            next_state: None,
            outcome_reward: None,
            notes: vec![],
            event_time: None,
            source_line: None,
            tenant: None,
        }
    }
}
