//! [`IngestOptions`]: the options every ingest adapter reads.

use super::sessions;
use crate::schema::TurnType;
use crate::{Error, Result};

/// Options shared by all adapters.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Turn type of a turn the log does not mark (used by `openai-chat`; docs/method.md §1 says this is
    /// configurable, the reference defaults to side). Other formats log only the agent's own turns,
    /// which are `main`.
    pub default_turn_type: TurnType,
    /// Ingest time (ms since the Unix epoch): `ingest_time` of every row, and `event_time` when the
    /// log has no timestamp.
    pub ingest_time_ms: i64,
    /// Longest JSONL line accepted, in bytes (default 256 MiB); longer lines are dead-lettered.
    pub max_line_bytes: usize,
    /// Largest single-document file (`.traj`, mini-swe-agent, ToolBench) read whole, in bytes
    /// (default 512 MiB); larger ones are dead-lettered.
    pub max_document_bytes: u64,
    /// Capacity of the session inferrer (`openai-chat` rows without a session id); see
    /// [`sessions::SessionInferrer`].
    pub session_cache: usize,
    /// Read at most this many bytes of a JSONL file (`ingest --follow`: up to the end of its last
    /// complete line, so a line being written is not read half); `None` reads everything.
    pub read_limit: Option<u64>,
    /// Raised to stop reading (Ctrl-C / SIGTERM): readers check it before each record (JSONL line,
    /// array element) and before handing on each item, and then return [`Error::Cancelled`]. A single
    /// record being parsed (one line or one whole document) is finished first. `None`: never stopped.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The tenant of every row (`ingest --tenant`); `None`: [`crate::schema::DEFAULT_TENANT`]. Checked
    /// by the caller ([`crate::schema::validate_tenant`]).
    pub tenant: Option<String>,
}

impl IngestOptions {
    /// Defaults with the given ingest time: unmarked turns are `main`, rows of the `default` tenant.
    pub fn new(ingest_time_ms: i64) -> IngestOptions {
        IngestOptions {
            default_turn_type: TurnType::Main,
            ingest_time_ms,
            max_line_bytes: 256 << 20,
            max_document_bytes: 512 << 20,
            session_cache: sessions::DEFAULT_CAPACITY,
            read_limit: None,
            stop: None,
            tenant: None,
        }
    }

    /// `Err(`[`Error::Cancelled`]`)` once [`IngestOptions::stop`] is raised.
    ///
    /// # Errors
    /// [`Error::Cancelled`] when a stop was requested.
    pub fn check_stop(&self) -> Result<()> {
        match &self.stop {
            Some(s) if s.load(std::sync::atomic::Ordering::Relaxed) => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }
}
