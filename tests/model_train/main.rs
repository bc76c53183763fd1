//! The model runtime and the trainer on the imported SmolLM2, the caching CPU allocator, checkpoint reloads
//! into engines, and the network judge and remote teacher backends.
//!
//! One test binary per area (linking tch, DataFusion and rdkafka once, not once per file); each module
//! is one former test file, its own doc says what it covers. `cargo test --test model_train <module>::` runs one.

#[path = "../common/mod.rs"]
mod common;

mod cpu_allocator;
mod judge_backends;
mod model;
mod reload;
mod teacher_remote;
mod trainer;
