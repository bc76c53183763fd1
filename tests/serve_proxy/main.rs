//! The policy server and the capture proxy over real HTTP, and TLS end to end.
//!
//! One test binary per area (linking tch, DataFusion and rdkafka once, not once per file); each module
//! is one former test file, its own doc says what it covers. `cargo test --test serve_proxy <module>::` runs one.

#[path = "../common/mod.rs"]
mod common;

mod proxy;
mod serve;
mod tls;
