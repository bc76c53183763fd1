//! LoRA on a loaded [`Transformer`]: attaching fresh adapters, merging them into the base weights,
//! exporting full or adapter-only state and copying weights in by name.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use super::layers::{Linear, LoraPair};
use super::load::add_var;
use super::{LoraConfig, Transformer};
use crate::{Error, Result};

/// Whether a var-store name is a LoRA adapter tensor (`<module>.lora_A.weight` / `.lora_B.weight`).
fn is_adapter_name(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

impl Transformer {
    fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        self.layers.iter_mut().flat_map(|l| [&mut l.attn.q, &mut l.attn.k, &mut l.attn.v, &mut l.attn.o, &mut l.mlp.gate, &mut l.mlp.up, &mut l.mlp.down])
    }

    /// Adds fresh trainable LoRA adapters (A uniform ±1/sqrt(in), B zero) to the target projections
    /// and freezes the base weights.
    ///
    /// # Errors
    /// [`Error::Config`] when adapters are already attached or the rank is 0.
    pub fn attach_lora(&mut self, cfg: &LoraConfig) -> Result<()> {
        if self.lora.is_some() {
            return Err(Error::Config("LoRA adapters are already attached".into()));
        }
        if cfg.rank == 0 {
            return Err(Error::Config("LoRA rank must be positive".into()));
        }
        for mut t in self.vs.trainable_variables() {
            let _ = t.f_requires_grad_(false)?;
        }
        if let Ok(mut vars) = self.vs.variables_.lock() {
            vars.trainable_variables.clear();
        }
        let (dtype, device) = (self.dtype, self.device);
        let r = cfg.rank as i64;
        for li in 0..self.layers.len() {
            for &target in &cfg.targets {
                let lin = self.layers[li].linear(target);
                let size = lin.weight.size();
                let (out_f, in_f) = (size[0], size[1]);
                let bound = 1.0 / (in_f as f64).sqrt();
                let a = Tensor::f_rand([r, in_f], (Kind::Float, device))?.f_mul_scalar(2.0 * bound)?.f_sub_scalar(bound)?.f_to_kind(dtype)?;
                let b = Tensor::f_zeros([out_f, r], (dtype, device))?;
                let a = add_var(&self.vs, &format!("{}.lora_A.weight", lin.name), a, true);
                let b = add_var(&self.vs, &format!("{}.lora_B.weight", lin.name), b, true);
                self.layers[li].linear_mut(target).lora = Some(LoraPair { a, b, scale: cfg.scale() });
            }
        }
        self.lora = Some(cfg.clone());
        Ok(())
    }

    /// Folds the adapters into the base weights (`W ← W + (α/r)·B·A`) and removes them; the model then
    /// runs at base speed with the same outputs (up to rounding). Each merged weight is a new tensor
    /// that replaces the old one (in the model and its var store): a base shared with other models
    /// ([`Transformer::shares_base`]) is never written, so this model then owns the merged projections.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn merge_lora(&mut self) -> Result<()> {
        if self.lora.is_none() {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        let mut merged = Vec::new();
        for lin in self.linears_mut() {
            if lin.lora.is_some() {
                lin.weight = lin.merged_weight()?;
                lin.lora = None;
                merged.push((format!("{}.weight", lin.name), lin.weight.shallow_clone()));
            }
        }
        if let Ok(mut vars) = self.vs.variables_.lock() {
            vars.named_variables.retain(|k, _| !is_adapter_name(k));
            vars.named_variables.extend(merged);
            vars.trainable_variables.clear();
        }
        self.lora = None;
        Ok(())
    }

    /// The full weights under HF names, adapters merged in (`lm_head.weight` only when untied).
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn full_state(&mut self) -> Result<Vec<(String, Tensor)>> {
        let _guard = tch::no_grad_guard();
        let mut merged: HashMap<String, Tensor> = HashMap::new();
        for lin in self.linears_mut() {
            if lin.lora.is_some() {
                merged.insert(format!("{}.weight", lin.name), lin.merged_weight()?);
            }
        }
        let mut out: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(k, _)| !is_adapter_name(k))
            .map(|(k, t)| {
                let t = merged.remove(&k).unwrap_or(t);
                (k, t)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// The adapter weights only (`<module>.lora_A.weight` `[r, in]`, `<module>.lora_B.weight`
    /// `[out, r]`, the model's dtype), sorted by name; [`crate::model::peft::write_adapter`] writes them under
    /// PEFT's keys.
    pub fn adapter_state(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> =
            self.vs.variables().into_iter().filter(|(k, _)| is_adapter_name(k)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Copies values into existing variables by name (shapes must match; names may carry PEFT's
    /// `base_model.model.` prefix). Returns the number of tensors copied.
    ///
    /// # Errors
    /// [`Error::Model`] when a name is not a variable of this model or a shape differs, when it names a
    /// base weight of a model whose base is shared ([`Transformer::shares_base`]), or (with
    /// `require_all`) when a variable received no value.
    pub fn copy_weights(&self, tensors: Vec<(String, Tensor)>, require_all_adapters: bool) -> Result<usize> {
        let _guard = tch::no_grad_guard();
        let vars = self.vs.variables();
        let mut seen = std::collections::HashSet::new();
        for (name, t) in tensors {
            let name = crate::model::peft::model_name(&name);
            let mut var = vars.get(&name).map(Tensor::shallow_clone).ok_or_else(|| Error::Model(format!("tensor {name} is not a parameter of this model")))?;
            if self.shared_base.is_some() && !is_adapter_name(&name) {
                return Err(Error::Model(format!("tensor {name} is a frozen base weight shared with other models of this process; load the model with full training to change it")));
            }
            if var.size() != t.size() {
                return Err(Error::Model(format!("tensor {name}: shape {:?}, model has {:?}", t.size(), var.size())));
            }
            var.f_copy_(&t.f_to_kind(var.kind())?.f_to_device(var.device())?)?;
            seen.insert(name);
        }
        if require_all_adapters {
            let missing: Vec<&String> = vars.keys().filter(|k| is_adapter_name(k) && !seen.contains(*k)).collect();
            if !missing.is_empty() {
                return Err(Error::Model(format!("adapter file lacks {} adapter tensors, e.g. {}", missing.len(), missing[0])));
            }
        }
        Ok(seen.len())
    }
}
