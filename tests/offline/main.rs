//! Tests that need neither a broker nor a model: the module layering and the generated configuration
//! reference, errors a person reads, the ingest adapters on real public logs, the SQL surface, export and
//! compaction of a lake.
//!
//! One test binary per area (linking tch, DataFusion and rdkafka once, not once per file); each module
//! is one former test file, its own doc says what it covers. `cargo test --test offline <module>::` runs one.

#[path = "../common/mod.rs"]
mod common;

mod architecture;
mod compact;
mod errors;
mod export;
mod ingest;
mod sql;
