//! nextstate: a stream processor that turns what deployed LLM agents already see — the next state after
//! each action — into training signal, and trains the policy online (OpenClaw-RL, arXiv 2603.10165).
//!
//! The pipeline, one module per stage (see README and `docs/method.md`):
//!
//! ```text
//! ingest / proxy ─► interactions ─► signals ─► judgments ─► hints ─► teacher_logprobs ─► samples ─► trainer ─► checkpoints
//! ```
//!
//! Every table is a Kafka topic ([`bus`]) and a Parquet table in the lake ([`lake`]), queryable with SQL
//! ([`sql`]). Record types and their Arrow schemas are in [`schema`].
#![warn(missing_docs)]

pub mod ablate;
pub mod bus;
pub mod config;
pub mod demo;
pub mod error;
pub mod export;
pub mod hint;
pub mod ingest;
pub mod judge;
pub mod lake;
pub mod method;
pub mod metrics;
pub mod model;
pub mod net;
pub mod report;
pub mod runtime;
pub mod samples;
pub mod schema;
pub mod serve;
pub mod signals;
pub mod sql;
pub mod stages;
pub mod stats;
pub mod teacher;
pub mod trainer;

pub use error::{Error, Result};
