//! The text the samples table does not hold, looked up in the lake by id: [`Texts`] (a sample's
//! request messages and response text from `interactions`, its hint from `hints`).

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{Message, Sample};

/// A chat message as trainers take it: `{role, content}` (tool calls and reasoning of the lake's
/// messages are not carried).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub(super) fn from_json_messages(json: &str) -> Option<Vec<ChatMessage>> {
        let msgs: Vec<Message> = serde_json::from_str(json).ok()?;
        Some(msgs.into_iter().map(|m| ChatMessage { role: m.role, content: m.content }).collect())
    }
}

/// The turn's text from `interactions`.
#[derive(Debug, Clone, Deserialize)]
struct TurnText {
    interaction_id: String,
    request_messages: String,
    response_text: String,
}

/// The hint's text from `hints`.
#[derive(Debug, Clone, Deserialize)]
struct HintText {
    hint_id: String,
    chosen_hint: Option<String>,
    teacher_messages: Option<String>,
}

/// Text of the selected samples' turns and hints, by id.
#[derive(Debug, Default)]
pub(crate) struct Texts {
    turns: HashMap<String, TurnText>,
    hints: HashMap<String, HintText>,
}

/// Why a row needing text is not written.
pub(crate) enum Missing {
    /// No `interactions` row with the sample's interaction_id in the lake.
    NoInteraction,
    /// Its `request_messages` are not a JSON array of messages.
    BadRequestMessages,
}

impl Missing {
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Missing::NoInteraction => "no_interaction_row",
            Missing::BadRequestMessages => "bad_request_messages",
        }
    }
}

impl Texts {
    /// Looks up the interactions (and with `hints` the hint rows) of `samples` in the lake.
    pub(super) async fn lookup(lake: &Lake, samples: &[Sample], hints: bool) -> Result<Texts> {
        let ids: Vec<&str> = samples.iter().map(|s| s.interaction_id.as_str()).collect();
        let mut texts = Texts::default();
        for t in select_by_key::<TurnText>(lake, "interactions", "interaction_id", "interaction_id, request_messages, response_text", &ids).await? {
            texts.turns.entry(t.interaction_id.clone()).or_insert(t);
        }
        if hints {
            let ids: Vec<&str> = samples.iter().filter_map(|s| s.hint_id.as_deref()).collect();
            for h in select_by_key::<HintText>(lake, "hints", "hint_id", "hint_id, chosen_hint, teacher_messages", &ids).await? {
                texts.hints.entry(h.hint_id.clone()).or_insert(h);
            }
        }
        Ok(texts)
    }

    /// The request messages and response text of a sample's turn.
    pub(crate) fn turn(&self, s: &Sample) -> std::result::Result<(Vec<ChatMessage>, &str), Missing> {
        let t = self.turns.get(&s.interaction_id).ok_or(Missing::NoInteraction)?;
        let msgs = ChatMessage::from_json_messages(&t.request_messages).ok_or(Missing::BadRequestMessages)?;
        Ok((msgs, t.response_text.as_str()))
    }

    /// The hint row of a sample: (chosen hint, teacher context messages JSON).
    pub(crate) fn hint(&self, s: &Sample) -> Option<(Option<&str>, Option<&str>)> {
        let h = self.hints.get(s.hint_id.as_deref()?)?;
        Some((h.chosen_hint.as_deref(), h.teacher_messages.as_deref()))
    }
}

/// Rows of `table` whose `key` is one of `ids` (1,000 per query).
async fn select_by_key<T: DeserializeOwned>(lake: &Lake, table: &str, key: &str, columns: &str, ids: &[&str]) -> Result<Vec<T>> {
    let mut uniq: Vec<&str> = ids.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let mut out = vec![];
    for chunk in uniq.chunks(1000) {
        let list: Vec<String> = chunk.iter().map(|id| format!("'{}'", id.replace('\'', "''"))).collect();
        let q = format!("SELECT {columns} FROM {table} WHERE {key} IN ({})", list.join(", "));
        for b in crate::sql::query(lake, &q).await? {
            out.extend(serde_arrow::from_record_batch::<Vec<T>>(&b)?);
        }
    }
    Ok(out)
}
