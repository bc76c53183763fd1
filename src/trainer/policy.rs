//! The [`Policy`] trait: what the trainer needs from the model runtime (the trunk's hidden states, the
//! output head, saving and loading the trainable weights), and the default safetensors weight files.

use std::path::Path;

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::batch::PackedBatch;
use super::optim;
use crate::model::score::{position_chunks, tempered, Gradients, HiddenPass, LOGIT_CHUNK_TOKENS};
use crate::{Error, Result};

/// How the trainable weights are checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightsFormat {
    /// All trainable weights (`model.safetensors`).
    Full,
    /// Only the LoRA adapter tensors (the model runtime's policy: PEFT's `adapter_model.safetensors` +
    /// `adapter_config.json`; the default [`Policy::save_weights`]: `adapter.safetensors`).
    Lora,
}

impl WeightsFormat {
    /// `full` or `lora` (the `checkpoints.weights_format` column).
    pub fn as_str(self) -> &'static str {
        match self {
            WeightsFormat::Full => "full",
            WeightsFormat::Lora => "lora",
        }
    }
    /// File written by the default [`Policy::save_weights`]: `model.safetensors` or `adapter.safetensors`.
    pub fn file_name(self) -> &'static str {
        match self {
            WeightsFormat::Full => "model.safetensors",
            WeightsFormat::Lora => "adapter.safetensors",
        }
    }
}

/// A trainable policy: what the trainer needs from the model runtime. Kept minimal; the real
/// transformer implements it with its trunk (`response_hidden`) and output head and, for checkpoints a
/// server can load directly, its own `save_weights`/`load_weights`.
pub trait Policy {
    /// The parameters. The trainer optimizes the tensors with `requires_grad` (all weights, or only the
    /// LoRA adapters when the base is frozen).
    fn var_store(&self) -> &VarStore;

    /// Vocabulary size V (token ids must be below it).
    fn vocab_size(&self) -> usize;

    /// Id used to right-pad `input_ids` (0 by default; never attended to under a causal mask).
    fn pad_id(&self) -> i64 {
        0
    }

    /// Runs the trunk over `batch`: the hidden states `[B, T, H]` that predict each response token, at
    /// the alignment of [`PackedBatch::predict_positions`], with the backward path `grad` asks for
    /// ([`Gradients::None`] for scoring; a policy without recomputation may treat
    /// [`Gradients::Recomputed`] as [`Gradients::Stored`]).
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure, or any error of the model.
    fn response_hidden(&self, batch: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>>;

    /// The output head: hidden states `[.., H]` → logits `[.., V]` (any float kind; the trainer takes
    /// the log-softmax in f32). Differentiable in `hidden` and the head's trainable weights.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;

    /// Per-token log-probs `[B, T]` f32 of the response tokens of `batch` under the current weights,
    /// without gradients (any value on padding), the head applied in chunks of
    /// [`LOGIT_CHUNK_TOKENS`] positions.
    ///
    /// # Errors
    /// As [`Policy::response_hidden`] and [`Policy::logits`].
    fn response_logprobs(&self, batch: &PackedBatch) -> Result<Tensor> {
        self.response_logprobs_at(batch, 1.0)
    }

    /// [`Policy::response_logprobs`] of the distribution at `temperature`: the log-softmax of
    /// `logits / temperature` (the trainer's `trainer.temperature`, docs/method.md §6). 1 gives the plain
    /// log-softmax.
    ///
    /// # Errors
    /// As [`Policy::response_logprobs`].
    fn response_logprobs_at(&self, batch: &PackedBatch, temperature: f64) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let pass = self.response_hidden(batch, Gradients::None)?;
        let (b, t) = (batch.batch_size() as i64, batch.max_response_len() as i64);
        let mut parts = Vec::new();
        for (t0, n) in position_chunks(b, t, LOGIT_CHUNK_TOKENS) {
            let lsm = tempered(&self.logits(&pass.hidden.f_narrow(1, t0, n)?)?, temperature)?.f_log_softmax(-1, Kind::Float)?;
            parts.push(lsm.f_gather(2, &batch.response_ids.f_narrow(1, t0, n)?.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?);
        }
        if parts.is_empty() {
            return Ok(Tensor::f_zeros([b, 0], (Kind::Float, self.var_store().device()))?);
        }
        Ok(Tensor::f_cat(&parts, 1)?)
    }

    /// Writes the trainable weights into `dir` and returns the names of the files written. Default: the
    /// trainable tensors of [`Policy::var_store`] under their names, in `format`'s file (safetensors).
    ///
    /// # Errors
    /// [`Error::Torch`] when the file cannot be written.
    fn save_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<Vec<String>> {
        save_trainable(self.var_store(), dir, format)
    }

    /// Loads weights written by [`Policy::save_weights`] from `dir` into the trainable tensors.
    ///
    /// # Errors
    /// [`Error::Model`] when a tensor is missing, extra or of another shape; [`Error::Torch`] when the
    /// file cannot be read.
    fn load_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<()> {
        load_trainable(self.var_store(), dir, format)
    }
}

/// Writes the trainable tensors of `vs` (by name, on the CPU) to `dir/<format's file>`; returns the
/// file name.
///
/// # Errors
/// [`Error::Torch`] when the file cannot be written.
pub fn save_trainable(vs: &VarStore, dir: &Path, format: WeightsFormat) -> Result<Vec<String>> {
    let named = optim::trainable_named(vs)
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_detach()?.f_to_device(tch::Device::Cpu)?)))
        .collect::<Result<Vec<_>>>()?;
    Tensor::write_safetensors(&named, dir.join(format.file_name()))?;
    Ok(vec![format.file_name().to_string()])
}

/// Copies `dir/<format's file>` into the trainable tensors of `vs`; every trainable tensor must be in the
/// file with its shape, and the file must hold nothing else.
///
/// # Errors
/// [`Error::Model`] naming the missing, extra or mis-shaped tensor; [`Error::Torch`] on read failure.
pub fn load_trainable(vs: &VarStore, dir: &Path, format: WeightsFormat) -> Result<()> {
    let path = dir.join(format.file_name());
    let mut file: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)?.into_iter().collect();
    let _guard = tch::no_grad_guard();
    for (name, mut t) in optim::trainable_named(vs) {
        let src = file.remove(&name).ok_or_else(|| Error::Model(format!("{}: no tensor {name}", path.display())))?;
        if src.size() != t.size() {
            return Err(Error::Model(format!("{}: {name} has shape {:?}, the model's is {:?}", path.display(), src.size(), t.size())));
        }
        t.f_copy_(&src)?;
    }
    if let Some(extra) = file.keys().next() {
        return Err(Error::Model(format!("{}: tensor {extra} is not a trainable tensor of the model", path.display())));
    }
    Ok(())
}
