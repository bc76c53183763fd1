//! The trainer: docs/method.md §6 losses, one AdamW step per batch of samples, checkpoints with lineage.
//!
//! Layers:
//! - [`loss`]: the loss math on tensors (advantages, PPO clip, k3 KL, entropy, top-K reverse KL, the
//!   mean over the step's samples of sample means); pure and unit-tested with hand-computed values.
//! - [`batch`]: [`Sample`] rows → padded tensors ([`PackedBatch`]), dropping bad rows with reasons.
//! - [`optim`]: AdamW with checkpointable state.
//! - [`checkpoint`]: `checkpoints/<run>/<version>/` folders, manifests, resume, consumed sample ids.
//! - `policy.rs`: the [`Policy`] trait the model runtime implements and the default weight files
//!   ([`WeightsFormat`], [`save_trainable`], [`load_trainable`]).
//! - `accumulate.rs`: one step's forward and backward pass without the update — micro-batches by
//!   length, the chunked head and loss, merged metrics ([`accumulate_gradients`], [`micro_batches`]).
//! - `step.rs`: the [`Trainer`] (one optimizer step per batch, `train_steps` rows, checkpoints every K
//!   steps, resume); `step_figures.rs`: the step's reward, length, staleness, learning-rate, tokens/s and
//!   advantage-sign figures; `outcome.rs`: what a step returns ([`StepOutcome`], [`SkippedStep`]);
//!   `recovery.rs`: a bad batch (non-finite loss or gradient, libtorch error) probed sample by sample,
//!   retried without its offenders or skipped.
//! - [`tenants`]: `[trainer.tenants]` — one shared policy or one LoRA adapter per tenant — and the
//!   per-adapter [`Batcher`] (batches never mix tenants; a tenant below `min_batch` waits; a cap).
//! - `loss_report.rs`: the [`loss_report`] (every loss component per sample, without updating weights).
//!
//! **Memory.** No `[B, T, V]` tensor is built. The trunk gives the hidden states that predict the
//! response tokens (`[B, T, H]`, [`Policy::response_hidden`]); the output head, the log-softmax and
//! every per-token loss term run on chunks of at most `logits_chunk_tokens` positions, each chunk's
//! loss is backpropagated into its own detached slice of the hidden states, and the accumulated
//! `∂loss/∂hidden` then goes through the trunk once ([`HiddenPass::backward`]) — the technique of
//! Liger's fused linear cross-entropy and slime's chunked log-probs. With `recompute_layers` the trunk
//! keeps only each layer's input and reruns one layer at a time in the backward pass. The gradients
//! equal those of the unchunked loss (tested to 1e-5).
//!
//! The wiring (Kafka, SQL, CLI) is not here: it collects `batch_size` samples, skips those in
//! [`checkpoint::consumed_sample_ids`] after a resume, calls [`Trainer::train_step`], writes the
//! returned `TrainStep` row, dead-letters the dropped samples and the skipped ones
//! ([`StepOutcome::skipped`]: non-finite loss or gradient, libtorch error) and publishes the `Checkpoint`
//! row of each checkpoint written.

mod accumulate;
mod advantage_parts;
pub mod alarms;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod loss;
mod loss_report;
pub mod model_policy;
pub mod optim;
mod outcome;
mod policy;
mod recovery;
mod step;
mod step_figures;
pub mod tenants;
#[cfg(test)]
mod test_util;

pub use accumulate::{accumulate_gradients, advantage_parts, micro_batches, Accumulated};
pub use advantage_parts::{AdvantagePartMeans, AdvantageParts};
pub use batch::{pack_samples, DropReason, Dropped, PackOptions, Packed, PackedBatch};
pub use checkpoint::{ancestry, consumed_sample_ids, latest_complete, scan, CheckpointScan, CheckpointWriter, LineageEntry, Manifest, OptimizerRecord, StepRecord};
pub use config::{AdvantageSign, AlarmSettings, CandidateSelection, LoraSettings, OverlapSettings, OverlapSubset, QuarantineSettings, Staleness, TeacherSource, TrainerConfig};
pub use loss::{LossConfig, LossMetrics, OpdLoss};
pub use loss_report::{loss_report, LossReport, SampleLoss};
pub use optim::{AdamW, AdamWConfig};
pub use policy::{load_trainable, save_trainable, Policy, WeightsFormat};
pub use outcome::{SkipReason, SkippedStep, StepOutcome, WrittenCheckpoint};
pub use step::{Resumed, Trainer};
pub use tenants::{adapter_name, AdapterKey, Batcher, OverCap, TenantSettings, TrainingMode};

pub use crate::model::score::{position_chunks, Gradients, HiddenPass, LOGIT_CHUNK_TOKENS};

#[cfg(test)]
mod tests;
