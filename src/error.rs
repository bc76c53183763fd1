//! The crate's one error type (DataFusion's pattern: one enum, `pub type Result<T>`).
//!
//! Every variant belongs to a [`Domain`] (Arroyo's pattern) so the wiring knows what to do with it:
//! a `User` error (bad input, bad config) dead-letters the record or stops with a clear message, an
//! `External` error (broker, judge endpoint, HTTP) is retried with backoff, an `Internal` error stops
//! the stage.

use std::path::PathBuf;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who is at fault for an error, which decides retry vs dead-letter vs stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// Bad input or configuration: not retried; the record is dead-lettered or the command stops.
    User,
    /// A service we call (Kafka broker, judge/teacher endpoint): retried with backoff.
    External,
    /// A bug or an environment failure (disk, libtorch): the stage stops.
    Internal,
}

/// All errors returned by the `nextstate` library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file-system operation failed; `path` names the file.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("open", "rename", ...).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Arrow array or schema error.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Parquet read/write error.
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    /// SQL planning or execution error (names the table/column).
    #[error("sql: {0}")]
    Sql(#[from] datafusion::error::DataFusionError),
    /// Conversion between Rust records and Arrow arrays.
    #[error("record conversion: {0}")]
    Records(#[from] serde_arrow::Error),
    /// Kafka client or broker error.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// JSON (de)serialisation error.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// libtorch error (surfaced by tch's fallible `f_` methods).
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    /// Invalid configuration (pipeline TOML, flags).
    #[error("config: {0}")]
    Config(String),
    /// A malformed input record; the message is the dead-letter reason.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// An HTTP call to a judge, teacher or policy endpoint failed.
    #[error("http: {0}")]
    Http(String),
    /// A service could not be reached at all; the message names it and, where the client library
    /// said, why (e.g. librdkafka's `SSL handshake failed: ... certificate verify failed`).
    #[error("cannot reach {0}")]
    Unreachable(String),
    /// A call timed out after the configured number of seconds.
    #[error("timeout after {0:.1} s")]
    Timeout(f64),
    /// Model loading, tokenisation or inference error.
    #[error("model: {0}")]
    Model(String),
    /// Token ids and per-token log-probs of different lengths.
    #[error("log-prob length mismatch: expected {expected} values (one per token), got {got}")]
    LogprobLenMismatch {
        /// Number of tokens.
        expected: usize,
        /// Number of log-probs.
        got: usize,
    },
    /// A non-finite (NaN/inf) value in an unmasked position.
    #[error("non-finite {what} at position {position}")]
    NonFinite {
        /// Which series ("teacher log-prob", "rollout log-prob").
        what: &'static str,
        /// Index in the response.
        position: usize,
    },
    /// A record larger than the bus carries: the embedded cluster's per-record limit
    /// ([`crate::bus::flow::EMBEDDED_MAX_RECORD_BYTES`]), the producer's `message.max.bytes` or the
    /// broker's limit. Callers dead-letter the record instead of failing.
    #[error("a record of {bytes} bytes for topic {topic} is over the bus's record limit of {limit} bytes")]
    RecordTooLarge {
        /// Full topic name.
        topic: String,
        /// Payload size, bytes.
        bytes: u64,
        /// The limit that refused it, bytes.
        limit: u64,
    },
    /// The process was asked to stop.
    #[error("cancelled")]
    Cancelled,
    /// Anything else that is a bug on our side.
    #[error("internal: {0}")]
    Internal(String),
}

impl Error {
    /// The [`Domain`] of this error.
    pub fn domain(&self) -> Domain {
        match self {
            Error::Kafka(_) | Error::Http(_) | Error::Unreachable(_) | Error::Timeout(_) => Domain::External,
            Error::Config(_)
            | Error::InvalidInput(_)
            | Error::Json(_)
            | Error::LogprobLenMismatch { .. }
            | Error::NonFinite { .. }
            | Error::RecordTooLarge { .. } => Domain::User,
            // A query that does not parse or names a table/column that is not there is the user's.
            Error::Sql(e)
                if matches!(
                    e.find_root(),
                    datafusion::error::DataFusionError::SQL(..) | datafusion::error::DataFusionError::Plan(_) | datafusion::error::DataFusionError::SchemaError(..)
                ) =>
            {
                Domain::User
            }
            _ => Domain::Internal,
        }
    }

    /// Whether retrying the same call may succeed (external, transient errors).
    pub fn retryable(&self) -> bool {
        self.domain() == Domain::External
    }

    /// Wraps an I/O error with the operation and path.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { op, path: path.into(), source }
    }
}

/// `Error::Config(format!(...))`.
#[macro_export]
macro_rules! config_err {
    ($($t:tt)*) => { $crate::error::Error::Config(format!($($t)*)) };
}

/// `Error::InvalidInput(format!(...))`.
#[macro_export]
macro_rules! input_err {
    ($($t:tt)*) => { $crate::error::Error::InvalidInput(format!($($t)*)) };
}
