//! Turning one session's full message list into interactions (shared by the trajectory formats:
//! tau-bench, SWE-agent, mini-swe-agent, OpenHands, ToolBench, AgentBench, and the session formats:
//! OpenClaw sessions, Claude Code, Codex, OpenHands V1).
//!
//! Every assistant message at index i not marked [`MessageMeta::not_turn`] is one turn: request =
//! messages[..i], response = messages[i]. The last turn of a complete trajectory carries
//! `session_done = true` and, as its next state, the messages that follow it in the log (minus those marked as never a next state, e.g. SWE-agent
//! demonstrations), or the adapter's `final_observation` when the log keeps the last observation
//! elsewhere; [`Trajectory::tail_is_next_state`] gives the last turn that next state without ending the
//! session. Other turns leave `next_state` empty: the pairing stage derives it from the next turn's
//! request.

use serde_json::Value;

use super::normalize::{normalize_message, Normalized};
use super::sink::{Sink, Turn};
use crate::schema::Message;
use crate::Result;

/// Per-message extras an adapter may know.
#[derive(Debug, Clone, Default)]
pub(crate) struct MessageMeta {
    /// Event time of the message (ms).
    pub event_time: Option<i64>,
    /// Finish reason of an assistant message.
    pub finish_reason: Option<String>,
    /// Model that wrote an assistant message.
    pub model: Option<String>,
    /// Never use this message as a next state (in-context demonstrations).
    pub not_next_state: bool,
    /// The reasoning block of this assistant message never closed.
    pub truncated: bool,
    /// Normalisation notes of this message.
    pub notes: Vec<String>,
    /// Record index of this message in the file, when it has its own (event streams).
    pub line: Option<i64>,
    /// An assistant message that is context but not a turn: written by a gateway rather than the
    /// model (OpenClaw's `delivery-mirror`), or kept across a compaction and emitted before it.
    pub not_turn: bool,
}

/// One session's messages and what is known about them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Trajectory {
    pub messages: Vec<Message>,
    pub meta: Vec<MessageMeta>,
    /// The file holds the whole session (the agent finished): the last turn is `session_done`.
    pub complete: bool,
    /// Next state of the last turn when the log keeps it outside `messages`.
    pub final_observation: Option<Message>,
    /// Session outcome label (tau-bench reward).
    pub outcome_reward: Option<f64>,
    /// Model of the whole session, when known.
    pub model: Option<String>,
    /// Tool definitions (JSON) offered to the agent.
    pub tools: Option<String>,
    /// Notes for every turn of the session.
    pub notes: Vec<String>,
    /// Turn index of the first turn (a session rebuilt in segments, e.g. across a compaction, numbers
    /// its turns on from the previous segment).
    pub first_turn: i32,
    /// The messages after the last turn are its whole next state even though the session goes on
    /// (the segment before a compaction: the next segment's requests no longer hold this one's).
    pub tail_is_next_state: bool,
}

impl Trajectory {
    /// Appends a normalised message: first the tool results it carried as content parts
    /// ([`Normalized::before`], with the message's time and record), then the message itself unless
    /// it only carried those ([`Normalized::into_messages`]).
    pub fn push(&mut self, mut n: Normalized, mut meta: MessageMeta) {
        meta.truncated |= n.truncated;
        meta.notes.append(&mut n.notes);
        let results = n.before.len();
        let messages = n.into_messages();
        let own = messages.len() > results;
        for (k, m) in messages.into_iter().enumerate() {
            self.messages.push(m);
            if k < results {
                self.meta.push(MessageMeta { event_time: meta.event_time, line: meta.line, ..MessageMeta::default() });
            } else {
                self.meta.push(std::mem::take(&mut meta));
            }
        }
        if !own && !meta.notes.is_empty() {
            // Notes of a message that only carried tool results go with the last of them.
            if let Some(last) = self.meta.last_mut() {
                last.notes.append(&mut meta.notes);
            }
        }
    }

    /// Normalises and appends every element of a JSON array of chat messages.
    ///
    /// # Errors
    /// The index and the normalisation error of the first bad message.
    pub fn push_all(&mut self, raw: &[Value]) -> std::result::Result<(), (usize, super::normalize::NormError)> {
        for (i, m) in raw.iter().enumerate() {
            let n = normalize_message(m).map_err(|e| (i, e))?;
            self.push(n, MessageMeta::default());
        }
        Ok(())
    }

    /// Number of assistant turns.
    pub fn turns(&self) -> usize {
        self.turn_positions().len()
    }

    /// Indices of the messages that are turns (assistant messages not marked [`MessageMeta::not_turn`]).
    pub fn turn_positions(&self) -> Vec<usize> {
        self.messages.iter().zip(&self.meta).enumerate().filter(|(_, (m, meta))| m.role == "assistant" && !meta.not_turn).map(|(i, _)| i).collect()
    }
}

/// Emits one interaction per assistant message of `t`. Returns the number of turns emitted.
///
/// # Errors
/// Errors from the sink's callback.
pub(crate) fn emit(sink: &mut Sink<'_>, session_id: &str, t: &Trajectory, source_line: Option<i64>) -> Result<usize> {
    let assistant = t.turn_positions();
    let Some(&last) = assistant.last() else {
        return Ok(0);
    };
    let mut notes_so_far: Vec<String> = t.notes.clone();
    let mut seen_upto = 0usize;
    for (turn, &i) in assistant.iter().enumerate() {
        for m in &t.meta[seen_upto..=i] {
            for n in &m.notes {
                if !notes_so_far.contains(n) {
                    notes_so_far.push(n.clone());
                }
            }
        }
        seen_upto = i + 1;
        let meta = &t.meta[i];
        let is_last = i == last;
        let next_state = if is_last && (t.complete || t.tail_is_next_state) {
            let after: Vec<Message> = t.messages[i + 1..].iter().zip(&t.meta[i + 1..]).filter(|(_, m)| !m.not_next_state).map(|(msg, _)| msg.clone()).collect();
            if !after.is_empty() {
                Some(after)
            } else {
                t.final_observation.clone().map(|m| vec![m])
            }
        } else {
            None
        };
        let mut turn_row = Turn::new(session_id.to_string(), t.first_turn + turn as i32, &t.messages[..i], &t.messages[i]);
        turn_row.session_done = is_last && t.complete;
        turn_row.model = meta.model.clone().or_else(|| t.model.clone());
        turn_row.tools = t.tools.clone();
        turn_row.finish_reason = meta.finish_reason.clone();
        turn_row.truncated = meta.truncated;
        turn_row.next_state = next_state;
        turn_row.outcome_reward = t.outcome_reward;
        turn_row.notes = notes_so_far.clone();
        turn_row.event_time = meta.event_time;
        turn_row.source_line = meta.line.or(source_line);
        sink.turn(turn_row)?;
    }
    Ok(assistant.len())
}

/// The end of an event-stream session (OpenHands V1, Copilot CLI): the per-kind `counts` go to the
/// sink (sorted by name), the session's turns are emitted with `complete` and the tail as next state
/// ([`Trajectory::tail_is_next_state`]), and a stream of `records` events without a turn is one
/// `no_assistant_turn` dead letter saying `why`.
///
/// # Errors
/// Errors from the sink's callback.
pub(crate) fn emit_event_session(sink: &mut Sink<'_>, session_id: &str, mut t: Trajectory, complete: bool, counts: std::collections::HashMap<String, u64>, records: usize, why: &str) -> Result<()> {
    let mut c: Vec<(String, u64)> = counts.into_iter().collect();
    c.sort();
    for (k, v) in c {
        sink.count(&k, v);
    }
    t.complete = complete;
    t.tail_is_next_state = true;
    if emit(sink, session_id, &t, Some(1))? == 0 && records > 0 {
        sink.dead_in_session(None, session_id, "no_assistant_turn", why, b"")?;
    }
    Ok(())
}
