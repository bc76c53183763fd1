//! The hint stage (docs/method.md §3): `judgments` (combined) or `signals` (OPD) → hint votes → `hints`.
//!
//! The stage's folder: its wiring and task (`stage.rs`: the stage's name, its [`crate::stages::StageLogic`]
//! and its `build`) and its embedded-default catch-up (`catchup.rs`: [`publish_pending`]). The registry,
//! `crate::stages::run::Stage`, is the one place that knows where it sits in each method's chain.

mod catchup;
mod stage;

pub use catchup::publish_pending;
pub use stage::{NAME, HintStage, TemplateRenderer, build};
