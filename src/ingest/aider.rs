//! Aider logs (`--format aider`): the chat transcript `.aider.chat.history.md` (one file per repository,
//! appended to by every launch) and the `--llm-history-file` log. Read from Aider-AI/aider
//! `aider/io.py` (`InputOutput.__init__`, `user_input`, `ai_output`, `_tool_message`, `tool_output`,
//! `confirm_ask`, `append_chat_history`, `log_llm_history`), `aider/utils.py` (`format_messages`,
//! `format_content`, `split_chat_history_markdown`) and `aider/coders/base_coder.py` (`send`).
//!
//! **Chat transcript** (markdown, the way `split_chat_history_markdown` reads it back):
//! - `# aider chat started at YYYY-MM-DD HH:MM:SS` starts a launch: each launch is a session
//!   `aider:<repo>:<YYYY-MM-DDTHH:MM:SS>` (`<repo>` = the folder of a `.aider*` file, else the file
//!   stem); lines before the first header are a session `aider:<repo>`;
//! - `#### ` lines are what the user typed (a multi-line input is consecutive `#### ` lines; `<blank>`
//!   an empty input; commands such as `/run` kept as typed): one user message;
//! - `> ` lines are Aider's own output (tool output, warnings, confirmations, `Applied edit to …`):
//!   kept as `system` messages — context the user saw, so a turn's next state is the next user message
//!   (or, after the last reply of a launch, that output: an environment next state);
//! - every other line is assistant text: each run of it (blank lines inside kept) is one reply, one
//!   turn, without tool calls (Aider's edits are SEARCH/REPLACE blocks in the text).
//!
//! A launch followed by another header ended: its last turn is `session_done`. A launch without a reply
//! is counted, not a dead letter. Like `split_chat_history_markdown`, a reply line that itself starts
//! with `#### ` or `> ` (a markdown heading or quote) is read as user input or output.
//!
//! **LLM history** (`log_llm_history`): `TO LLM <ISO time>` followed by the whole request as
//! `format_messages` writes it (`-------` before each message, every content line prefixed by the upper
//! case role: `SYSTEM …`, `USER …`, `ASSISTANT …`), then `LLM RESPONSE <ISO time>` followed by the reply
//! as `ASSISTANT …` lines. Each response is one turn whose request is exactly the request logged before
//! it: the replayed history is never a turn again. A request holding the previous response as an
//! assistant message continues that session, and the previous turn's next state is what follows the
//! request's last assistant message (the user's next message or Aider's reflected error, without the
//! system reminder); any other request starts a session `aider:<repo>:llm:<ISO time>`. A line without a
//! role prefix continues the line before it (a list item's text with new lines). An empty response (an
//! interrupted reply) and a request without a logged response are counted.
//!
//! Lines that are not UTF-8, and lines of the LLM history outside any block, are dead letters; the rest
//! of the file is read. Times are the writer's local time without a zone, so they are not event times.

use std::collections::HashMap;
use std::path::Path;

use serde_json::json;

use super::normalize::{normalize_message, NormError, Normalized};
use super::sink::{read_lines, Sink, Turn};
use super::trajectory::{emit_event_session, MessageMeta, Trajectory};
use crate::schema::Message;
use crate::Result;

/// The header `InputOutput.__init__` writes at each launch.
pub(crate) const LAUNCH_HEADER: &str = "# aider chat started at ";

/// One UTF-8 line with its 1-based number (blank lines are not kept: gaps in the numbers are blank lines).
type Line = (i64, String);

/// The block a header line of the LLM history opens (`TO LLM` / `LLM RESPONSE`) and its time.
pub(crate) fn llm_header(line: &str) -> Option<(bool, &str)> {
    let (response, stamp) = match line.strip_prefix("TO LLM ") {
        Some(s) => (false, s),
        None => (true, line.strip_prefix("LLM RESPONSE ")?),
    };
    let stamp = stamp.trim();
    (stamp.len() >= 10 && stamp.as_bytes()[..4].iter().all(u8::is_ascii_digit) && stamp.as_bytes()[4] == b'-').then_some((response, stamp))
}

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let mut lines: Vec<Line> = Vec::new();
    read_lines(path, sink, progress, &mut |sink, n, text| match std::str::from_utf8(text) {
        Ok(s) => {
            lines.push((n, s.trim_end_matches('\r').to_string()));
            Ok(())
        }
        Err(e) => sink.dead(Some(n), "invalid_utf8", format!("line {n}: {e}"), text),
    })?;
    let name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let folder = path.parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned());
    let repo = match folder {
        Some(f) if name.starts_with(".aider") => f,
        _ => sink.stem.clone(),
    };
    let llm = lines.iter().find_map(|(_, l)| if l.starts_with(LAUNCH_HEADER) { Some(false) } else { llm_header(l).map(|_| true) });
    if llm == Some(true) {
        llm_history(&lines, sink, &repo)
    } else {
        chat_history(&lines, sink, &repo)
    }
}

fn chat_history(lines: &[Line], sink: &mut Sink<'_>, repo: &str) -> Result<()> {
    let mut launches: Vec<(Option<&str>, &[Line])> = Vec::new();
    let (mut start, mut stamp) = (0, None);
    for (i, (_, l)) in lines.iter().enumerate() {
        if let Some(ts) = l.strip_prefix(LAUNCH_HEADER) {
            if i > start || stamp.is_some() {
                launches.push((stamp, &lines[start..i]));
            }
            (start, stamp) = (i + 1, Some(ts.trim()));
        }
    }
    if start < lines.len() || stamp.is_some() {
        launches.push((stamp, &lines[start..]));
    }
    let last = launches.len().saturating_sub(1);
    for (k, (stamp, body)) in launches.into_iter().enumerate() {
        let session = match stamp {
            Some(ts) => format!("aider:{repo}:{}", ts.replace(' ', "T")),
            None => format!("aider:{repo}"),
        };
        launch(sink, &session, body, k < last)?;
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    User,
    Output,
    Reply,
}

/// One launch of the chat transcript: its blocks as messages, each reply a turn.
fn launch(sink: &mut Sink<'_>, session: &str, body: &[Line], ended: bool) -> Result<()> {
    let mut blocks: Vec<(Block, i64, String)> = Vec::new();
    let mut prev = 0i64;
    for (n, l) in body {
        let (kind, text) = if let Some(t) = l.strip_prefix("#### ") {
            (Block::User, t.trim_end())
        } else if l.starts_with("> ") || l.trim_end() == ">" {
            (Block::Output, l.get(2..).unwrap_or("").trim_end())
        } else {
            (Block::Reply, l.trim_end())
        };
        match blocks.last_mut() {
            // A multi-line input is consecutive `#### ` lines; two inputs are apart.
            Some((k, _, acc)) if *k == kind && (kind != Block::User || *n == prev + 1) => {
                acc.push_str(&"\n".repeat((n - prev).max(1) as usize));
                acc.push_str(text);
            }
            _ => blocks.push((kind, *n, text.to_string())),
        }
        prev = *n;
    }
    let mut t = Trajectory::default();
    let mut counts: HashMap<String, u64> = HashMap::new();
    for (kind, n, text) in blocks {
        let meta = MessageMeta { line: Some(n), ..MessageMeta::default() };
        match kind {
            Block::User => t.push(Normalized::new(Message::text("user", if text == "<blank>" { "" } else { text.as_str() })), meta),
            Block::Output => {
                *counts.entry("aider output blocks ('> ' lines, kept as system messages)".into()).or_insert(0) += 1;
                t.push(Normalized::new(Message::text("system", text)), meta);
            }
            Block::Reply => match normalize_text("assistant", &text) {
                Ok(nm) => t.push(nm, meta),
                Err(err) => sink.dead_in_session(Some(n), session, err.code(), format!("line {n}: {err}"), text.as_bytes())?,
            },
        }
    }
    let replies = t.turns();
    if replies == 0 {
        *counts.entry("launches without an assistant reply".into()).or_insert(0) += 1;
    }
    emit_event_session(sink, session, t, ended, counts, replies, "launch has no assistant reply")
}

/// A message of `role` with `text` through the shared normaliser (a `<think>` block becomes reasoning).
fn normalize_text(role: &str, text: &str) -> std::result::Result<Normalized, NormError> {
    normalize_message(&json!({ "role": role, "content": text }))
}

/// One `TO LLM` or `LLM RESPONSE` block of the LLM history.
struct LlmBlock<'a> {
    response: bool,
    line: i64,
    stamp: &'a str,
    /// (role in lower case, text) of each message.
    messages: Vec<(String, String)>,
}

const ROLES: [&str; 5] = ["SYSTEM", "USER", "ASSISTANT", "TOOL", "FUNCTION"];

fn llm_history(lines: &[Line], sink: &mut Sink<'_>, repo: &str) -> Result<()> {
    let mut blocks: Vec<LlmBlock<'_>> = Vec::new();
    let (mut prev, mut separated) = (0i64, true);
    for (n, l) in lines {
        if let Some((response, stamp)) = llm_header(l) {
            blocks.push(LlmBlock { response, line: *n, stamp, messages: Vec::new() });
            (prev, separated) = (*n, true);
            continue;
        }
        let Some(block) = blocks.last_mut() else {
            sink.dead(Some(*n), "unrecognised_line", format!("line {n}: before the first TO LLM / LLM RESPONSE header"), l.as_bytes())?;
            continue;
        };
        if l.trim_end() == "-------" {
            (prev, separated) = (*n, true);
            continue;
        }
        let (word, rest) = l.split_once(' ').unwrap_or((l.as_str(), ""));
        match (ROLES.contains(&word), block.messages.last_mut()) {
            (true, Some((role, text))) if !separated && *n == prev + 1 && *role == word.to_ascii_lowercase() => {
                text.push('\n');
                text.push_str(rest);
            }
            (true, _) => block.messages.push((word.to_ascii_lowercase(), rest.to_string())),
            (false, Some((_, text))) => {
                text.push('\n');
                text.push_str(l);
            }
            (false, None) => sink.dead(Some(*n), "unrecognised_line", format!("line {n}: no role prefix and no message to continue"), l.as_bytes())?,
        }
        (prev, separated) = (*n, false);
    }

    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut bump = |k: &str| *counts.entry(k.to_string()).or_insert(0) += 1;
    // (session, turn index, request, response, line) of the turn waiting for its next state.
    let mut pending: Option<(String, i32, Vec<Message>, Message, i64)> = None;
    let mut request: Option<&LlmBlock<'_>> = None;
    for b in &blocks {
        if !b.response {
            if request.replace(b).is_some() {
                bump("requests without a logged response");
            }
            continue;
        }
        let Some(req) = request.take() else {
            sink.dead(Some(b.line), "missing_request", format!("line {}: LLM RESPONSE without a TO LLM request before it", b.line), b.stamp.as_bytes())?;
            continue;
        };
        let text = b.messages.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n");
        if text.trim().is_empty() {
            bump("empty responses (interrupted, or a function call the log does not keep)");
            continue;
        }
        let normalized: std::result::Result<Vec<Normalized>, NormError> = req.messages.iter().map(|(r, t)| normalize_text(r, t)).chain([normalize_text("assistant", &text)]).collect();
        let mut msgs: Vec<Message> = match normalized {
            Ok(v) => v.into_iter().flat_map(Normalized::into_messages).collect(),
            Err(err) => {
                sink.dead(Some(b.line), err.code(), format!("line {}: {err}", b.line), text.as_bytes())?;
                continue;
            }
        };
        let Some(response) = msgs.pop() else { continue };
        // Does this request carry on from the pending turn? Its response is an assistant message here.
        let continues = pending.as_ref().is_some_and(|p| msgs.iter().any(|m| m.role == "assistant" && m.content.trim() == p.3.content.trim()));
        let (session, turn) = match pending.take() {
            Some((session, turn, req_msgs, resp, line)) => {
                let next = continues.then(|| {
                    let after = msgs.iter().rposition(|m| m.role == "assistant").map_or(0, |i| i + 1);
                    msgs[after..].iter().filter(|m| m.role != "system").cloned().collect::<Vec<_>>()
                });
                let mut row = Turn::new(session.clone(), turn, &req_msgs, &resp);
                row.next_state = next.filter(|v| !v.is_empty());
                row.source_line = Some(line);
                sink.turn(row)?;
                if continues {
                    (session, turn + 1)
                } else {
                    (format!("aider:{repo}:llm:{}", req.stamp), 0)
                }
            }
            None => (format!("aider:{repo}:llm:{}", req.stamp), 0),
        };
        pending = Some((session, turn, msgs, response, b.line));
    }
    if request.is_some() {
        bump("requests without a logged response");
    }
    if let Some((session, turn, req_msgs, resp, line)) = pending {
        let mut row = Turn::new(session, turn, &req_msgs, &resp);
        row.source_line = Some(line);
        sink.turn(row)?;
    }
    let mut c: Vec<(String, u64)> = counts.into_iter().collect();
    c.sort();
    for (k, v) in c {
        sink.count(&k, v);
    }
    Ok(())
}
