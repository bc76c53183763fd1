//! Integration tests of the ingest adapters and the pairing transform on real public agent logs
//! (tests/fixtures/agent-logs and ../shared/data/agent-logs) and synthetic fixtures.

mod common;
mod detect;
mod formats_2026;
mod mixed_folder;
mod pairing;
mod real_logs;
mod robustness;
mod synthetic;
mod tenants;
use crate::common as test_env;
