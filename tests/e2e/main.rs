//! The commands as a user runs them: the stage chain end to end, the CLI through the real broker,
//! `replay`/`ablate`, a short `demo`, and the chaos tests.
//!
//! One test binary per area (linking tch, DataFusion and rdkafka once, not once per file); each module
//! is one former test file, its own doc says what it covers. `cargo test --test e2e <module>::` runs one.

#[path = "../common/mod.rs"]
mod common;

mod ablate;
mod chaos;
mod cli;
mod demo;
mod pipeline;
