//! The judge stage (docs/method.md §2): `signals` → PRM votes → `judgments`.
//!
//! The stage's folder: its wiring and task (`stage.rs`: the stage's name, its [`crate::stages::StageLogic`]
//! and its `build`) and its embedded-default catch-up (`catchup.rs`: [`publish_pending`]). The registry,
//! `crate::stages::run::Stage`, is the one place that knows where it sits in each method's chain.

mod catchup;
mod stage;

pub use catchup::publish_pending;
pub use stage::{NAME, JudgeStage, build};
pub(crate) use stage::turn_of;
