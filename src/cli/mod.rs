//! The commands of the `nextstate` binary, one file each: its arguments (`<Command>Args`) and its
//! `run`. `model`, `serve` and `proxy` keep theirs in the library (`nextstate::model::cli`,
//! `nextstate::serve`, `nextstate::serve::proxy`), beside the runtimes they start.
pub mod common;

pub mod ablate;
pub mod compact;
pub mod demo;
pub mod export;
pub mod ingest;
pub mod loss;
pub mod prm_eval;
pub mod replay;
pub mod run;
pub mod schema;
pub mod sql;
pub mod train;
