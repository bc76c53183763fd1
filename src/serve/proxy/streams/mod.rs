//! Stream accumulators: an upstream SSE stream assembled into one finished turn while it is relayed,
//! one accumulator per API ([`chat`], [`responses`], [`messages`]) behind [`Accumulator`].

pub mod chat;
pub mod messages;
pub mod responses;

use serde_json::Value;

pub use self::chat::StreamAccumulator;
pub use self::messages::MessagesStream;
pub use self::responses::ResponsesStream;
use super::apis::Api;
use super::response::{Completed, NoTurn};

/// A stream being assembled, whichever the API.
#[derive(Debug, Clone)]
pub enum Accumulator {
    /// Chat-completions chunks.
    Chat(StreamAccumulator),
    /// Responses events.
    Responses(ResponsesStream),
    /// Messages events.
    Messages(MessagesStream),
}

impl Accumulator {
    /// An empty accumulator for `api`.
    pub fn new(api: Api) -> Accumulator {
        match api {
            Api::ChatCompletions => Accumulator::Chat(StreamAccumulator::default()),
            Api::Responses => Accumulator::Responses(ResponsesStream::default()),
            Api::Messages => Accumulator::Messages(MessagesStream::default()),
        }
    }

    /// Feeds one event's parsed data.
    pub fn push(&mut self, v: &Value) {
        match self {
            Accumulator::Chat(a) => a.push(v),
            Accumulator::Responses(a) => a.push(v),
            Accumulator::Messages(a) => a.push(v),
        }
    }

    /// The Responses API's response id, once a `response` snapshot was seen (None for the other APIs).
    pub fn response_id(&self) -> Option<&str> {
        match self {
            Accumulator::Responses(a) => a.response_id(),
            _ => None,
        }
    }

    /// Feeds a `[DONE]` marker (chat completions; the other APIs send none).
    pub fn done_marker(&mut self) {
        if let Accumulator::Chat(a) = self {
            a.push_data("[DONE]");
        }
    }

    /// Notes an event whose data is not JSON: the turn cannot be recorded.
    pub fn unreadable_chunk(&mut self, e: &serde_json::Error) {
        match self {
            Accumulator::Chat(a) => a.unreadable_chunk(e),
            Accumulator::Responses(a) => a.unreadable_chunk(e),
            Accumulator::Messages(a) => a.unreadable_chunk(e),
        }
    }

    /// The assembled turn.
    ///
    /// # Errors
    /// As [`StreamAccumulator::finish`], [`ResponsesStream::finish`], [`MessagesStream::finish`].
    pub fn finish(self) -> Result<Completed, NoTurn> {
        match self {
            Accumulator::Chat(a) => a.finish(),
            Accumulator::Responses(a) => a.finish(),
            Accumulator::Messages(a) => a.finish(),
        }
    }
}
