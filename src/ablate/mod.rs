//! Offline replay and ablations (`nextstate replay`, `nextstate ablate`): compare binary RL, OPD,
//! combined and their variants on the **same** historical interactions, and write a report a person
//! would rather look at than read.
//!
//! # Design
//!
//! An ablation file ([`config::AblationConfig`], `ablations/<name>.toml`) names the data (a SQL query over
//! a lake, optionally filled first by the simulated student of [`crate::demo`]), the shared settings, the
//! arms and the evaluation. [`run::run_ablation`]:
//!
//! 1. **Data, once.** The selected interactions are replayed ([`replay`]) into the ablation's own lake.
//!    The pipeline stages differ between arms only in which stages run and how samples are assembled
//!    (method, judge, hint, teacher and sample settings: the arm's *data key*, [`config::data_key`]);
//!    each distinct data key runs the stages once under its own pipeline name, so arms that differ only
//!    in the trainer (`w_rl`/`w_opd`, `opd_loss`, learning rate) train on the very same sample rows.
//!    Judge votes and teacher log-probs are cached by content, so data pipelines that share a judge or
//!    the same hints pay for them once.
//! 2. **Train every arm** from the same initial weights with the same seed (which also fixes the LoRA
//!    initialisation), batch size and step budget, on its samples in one fixed order — the order of the
//!    interactions (event time, session, turn) — read with SQL (`stages::train`, `TrainSource::Sql`).
//!    The last `heldout_sessions` sessions are held out. Each arm records its config hash, seed and the
//!    ordered sample ids it trained on. With `[shared] seeds` every arm runs once per seed, and the
//!    replicates differ in what a replicate should ([`run::Replicates`]): with `[data.collect]` each
//!    collects its own sessions ([`collect::collect_plans`]: its own draw of training problems, sampling
//!    and student seeds, the same held-out problems), its training sessions come in an order shuffled by
//!    the seed, and the seed sets the LoRA initialisation; the arms of one replicate share its data and
//!    order, so arms are compared on the same interactions.
//! 3. **Evaluate every checkpoint** ([`eval`]): personalization score on held-out GSM8K problems
//!    (greedy), held-out loss components, teacher/student log-prob gap, and judge-vs-outcome agreement on
//!    labelled logs (tau-bench rewards); the hint-conditioned teacher itself is scored on the same
//!    problems once per hint strategy ([`teacher_eval`]): the bound distillation can reach; and two
//!    baselines without training ([`baselines`]: the preferences in the system prompt, and the
//!    accepted hints accumulated as memory) that training has to beat. Every version also scores two
//!    fixed token sets — v0's held-out answers and the arm's trained tokens — by token class, position
//!    and starting advantage sign ([`mass`]), so the report shows which tokens an arm raised or lowered.
//! 4. **Report** ([`report`]): `report.md`, PNG plots and Parquet tables of every number ([`results`]);
//!    with several replicate seeds per arm (`[shared] seeds`), each arm's mean and 95 % interval over
//!    seeds and paired tests between arms on the same problems ([`compare`]).
//!
//! With an `[online]` section the ablation runs the paper's online protocol instead ([`online`]): each
//! arm replicate serves the simulated student live while it trains, and the report adds sessions until
//! the preferences are met in 3 consecutive sessions.
//!
//! Every phase leaves its result on disk; a killed ablation resumes (see [`run`]). Runs are
//! deterministic: seeded sampling, synthetic event times, fixed batch compositions, one scoring pass per
//! teacher row — the same configuration gives the same numbers (`tests/e2e/ablate.rs`).

pub mod baselines;
pub mod collect;
pub mod compare;
pub mod config;
pub mod eval;
mod gather;
pub mod hints;
mod layout;
pub mod mass;
pub mod online;
mod plan;
pub mod replay;
pub mod report;
pub mod results;
pub mod run;
pub mod teacher_eval;

#[cfg(test)]
pub(crate) mod fixtures;

pub use config::{AblationConfig, ResolvedArm};
pub use replay::{replay, ReplayOptions, ReplayReport, ReplayTarget};
pub use report::AblationSummary;
pub use run::{run_ablation, AblateOptions};
