//! What a training step returns: [`StepOutcome`] (the `train_steps` row, the drops, the checkpoint
//! written, the samples skipped), [`WrittenCheckpoint`], and why a step left the weights unchanged
//! ([`SkipReason`], [`SkippedStep`]).

use std::path::PathBuf;

use super::batch::Dropped;
use super::checkpoint::Manifest;
use super::loss::LossMetrics;
use crate::schema::{Checkpoint, TrainStep};
use crate::Error;

/// A checkpoint the trainer wrote.
#[derive(Debug, Clone)]
pub struct WrittenCheckpoint {
    /// Its folder (`checkpoints/<run>/<version>`).
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The `checkpoints` table row to publish.
    pub row: Checkpoint,
}

/// What one [`Trainer::train_step`](super::Trainer::train_step) did.
#[derive(Debug)]
pub struct StepOutcome {
    /// The `train_steps` row; `None` when every sample was dropped (no optimizer step was taken).
    pub train_step: Option<TrainStep>,
    /// The step's loss metrics (same values as the row).
    pub metrics: Option<LossMetrics>,
    /// Samples left out, with reasons (indices into the input slice).
    pub dropped: Vec<Dropped>,
    /// The checkpoint written after this step (every `checkpoint_every` steps).
    pub checkpoint: Option<WrittenCheckpoint>,
    /// Samples left untrained because their loss or gradient was not finite or libtorch failed on them
    /// (dead-letter each). With `train_step` `None` the whole step was skipped and the weights and the
    /// optimizer state are exactly as before; with `train_step` `Some` the step was retried and taken
    /// without these samples.
    pub skipped: Option<SkippedStep>,
}

/// Why a step left the weights unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The loss of the batch (or of the sample, alone) was NaN or ±inf.
    NonFiniteLoss,
    /// The loss was finite but the global gradient norm was NaN or ±inf.
    NonFiniteGrad,
    /// libtorch failed during the forward or backward pass.
    TorchError,
}

impl SkipReason {
    /// Snake-case name for counters and the dead letters' `reason_code`: `non_finite_loss`,
    /// `non_finite_grad`, `torch_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NonFiniteLoss => "non_finite_loss",
            SkipReason::NonFiniteGrad => "non_finite_grad",
            SkipReason::TorchError => "torch_error",
        }
    }
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step that was not taken (weights unchanged; its samples go to dead_letters).
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedStep {
    /// Why the step failed first.
    pub reason: SkipReason,
    /// The failure with its numbers (the batch's loss components or gradient norm, the libtorch
    /// message), then, per offending sample found by evaluating the samples one at a time, its id, its
    /// own reason and its loss or gradient norm.
    pub detail: String,
    /// indices into the input slice
    pub samples: Vec<usize>,
}

/// Why an attempt at a step (`Trainer::try_step`) failed.
pub(super) enum StepFailure {
    /// The batch's fault — a non-finite loss or gradient norm, or a libtorch error — with the error
    /// that says so: the step can be skipped.
    Skip(SkipReason, Error),
    /// Not the batch's fault (configuration, a policy returning wrongly shaped log-probs): ends the step
    /// with the error.
    Fatal(Error),
}

impl From<Error> for StepFailure {
    fn from(e: Error) -> Self {
        match e {
            Error::Torch(_) => StepFailure::Skip(SkipReason::TorchError, e),
            e => StepFailure::Fatal(e),
        }
    }
}
