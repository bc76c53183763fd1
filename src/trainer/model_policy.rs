//! [`Policy`] for the model runtime's [`LanguageModel`]: the trainer's forward pass is the runtime's own
//! `response_hidden` and output head (one implementation and one alignment convention for teacher,
//! trainer and server), and checkpoints are written in the layout `nextstate serve` loads.

use std::path::Path;

use tch::nn::VarStore;
use tch::Tensor;

use super::{Gradients, HiddenPass, PackedBatch, Policy, WeightsFormat};
use crate::error::Result;
use crate::model::{self, LanguageModel};

impl Policy for LanguageModel {
    fn var_store(&self) -> &VarStore {
        self.transformer().var_store()
    }

    fn vocab_size(&self) -> usize {
        self.transformer().config.vocab_size
    }

    fn pad_id(&self) -> i64 {
        self.pad_token_id() as i64
    }

    fn response_hidden(&self, batch: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'_>> {
        let b = model::PackedBatch {
            input_ids: batch.input_ids.shallow_clone(),
            response_ids: batch.response_ids.shallow_clone(),
            response_mask: batch.response_mask.shallow_clone(),
            predict_positions: batch.predict_positions.shallow_clone(),
            prompt_lens: batch.prompt_lens.clone(),
            response_lens: batch.response_lens.clone(),
        };
        model::score::response_hidden(self.transformer(), &b, grad)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.transformer().logits(hidden)
    }

    /// Full: a complete HF directory (`model.safetensors`, config, tokenizer) that `nextstate serve`
    /// and `LanguageModel::load` read as is. LoRA: a PEFT adapter folder (`adapter_model.safetensors` +
    /// `adapter_config.json`, `model::peft`) on top of the base model directory, which vLLM, SGLang and
    /// `peft` load as is. Loading also reads older checkpoints' `adapter.safetensors`.
    fn save_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<Vec<String>> {
        match format {
            WeightsFormat::Full => {
                self.save_full(dir)?;
                Ok(vec!["model.safetensors".into(), "config.json".into()])
            }
            WeightsFormat::Lora => {
                self.save_adapters(dir)?;
                Ok(vec![model::lm::ADAPTER_WEIGHTS.into(), model::lm::ADAPTER_CONFIG.into()])
            }
        }
    }

    fn load_weights(&mut self, dir: &Path, format: WeightsFormat) -> Result<()> {
        match format {
            WeightsFormat::Full => {
                let tensors = model::weights::read_safetensors(&dir.join("model.safetensors"))?;
                self.transformer().copy_weights(tensors, false)?;
                Ok(())
            }
            WeightsFormat::Lora => self.load_adapters(dir),
        }
    }
}
