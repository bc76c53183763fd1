//! The bus and the lake against a real Kafka-protocol broker (scripts/broker.sh) and local object stores:
//! topics and consumer groups, Kafka over TLS, exactly-once sinks under SIGKILL, catch-up, scale-out, the
//! lake on S3/Azure, `/metrics`, and the bad-input corpus.
//!
//! One test binary per area (linking tch, DataFusion and rdkafka once, not once per file); each module
//! is one former test file, its own doc says what it covers. `cargo test --test bus_lake <module>::` runs one.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod bus;
mod exactly_once;
mod kafka_tls;
mod metrics;
mod object_store;
mod pending;
mod scale_out;
