//! The decoder-only transformer (Llama / Qwen2 / Qwen3) in tch, with optional LoRA adapters.
//!
//! Notation for shapes: B batch, L new tokens in this call, S attended key length (cache + new),
//! H hidden size, n_h query heads, n_kv key/value heads, d head dim, F MLP width, V vocabulary.
//!
//! Per layer (HF `LlamaDecoderLayer`): `h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))`,
//! `y = h + down(silu(gate(n2(h))) · up(n2(h)))`, with RMSNorm `n(x) = w · x / sqrt(mean(x²) + ε)`
//! computed in f32. RoPE is rotate-half: `x·cos + rotate_half(x)·sin` with
//! `rotate_half([x1, x2]) = [−x2, x1]` (RoFormer, Su et al. 2021, as in HF `apply_rotary_pos_emb`).
//! LoRA (Hu et al. 2021): `y = x Wᵀ + b + (α/r)·(x Aᵀ) Bᵀ`, A `[r, in]` uniform(±1/sqrt(in)) as in
//! PEFT, B `[out, r]` zeros, so a fresh adapter leaves the model unchanged.
//!
//! The code is split by what a reader looks for: `load_options` (where and how to load, what is
//! trainable), `load` (building the model from HF-named weights), `layers` (projections, attention,
//! MLP, RMSNorm, RoPE helpers), `kv_cache` (attention mask and KV cache), `forward` (the forward pass)
//! and `lora` (attaching, merging and exporting LoRA adapters). The LoRA hyper-parameters
//! ([`LoraConfig`], [`LoraTarget`]) live in [`super::peft`], whose `adapter_config.json` they are.

mod forward;
mod kv_cache;
mod layers;
mod load;
mod load_options;
mod lora;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

pub use super::peft::{LoraConfig, LoraTarget};
use super::config::ModelConfig;
pub use kv_cache::{AttnMask, KvCache};
use layers::Layer;
pub use load_options::{LoadOptions, Trainable};

/// The transformer: weights in a [`VarStore`] under their HF names, plus the forward pass.
pub struct Transformer {
    /// Hyper-parameters.
    pub config: ModelConfig,
    vs: VarStore,
    /// `[V, H]`.
    embed: Tensor,
    layers: Vec<Layer>,
    /// `[H]`.
    norm: Tensor,
    /// `[V, H]` when untied.
    lm_head: Option<Tensor>,
    /// RoPE inverse frequencies `[d/2]`, f32.
    inv_freq: Tensor,
    dtype: Kind,
    device: Device,
    lora: Option<LoraConfig>,
    /// The frozen base weights this model aliases, shared with other models of the process
    /// ([`super::weights::read_checkpoint_shared`]); `None` when the model owns its weights.
    shared_base: Option<std::sync::Arc<super::weights::SharedWeights>>,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("architecture", &self.config.architecture)
            .field("layers", &self.layers.len())
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .field("lora", &self.lora)
            .finish()
    }
}

impl Transformer {
    /// Marks this model's base weights as the shared frozen weights `shared` (which they alias): they
    /// are then never written in place ([`Transformer::copy_weights`] refuses base names,
    /// [`Transformer::merge_lora`] replaces weights rather than writing into them).
    pub(crate) fn share_base(&mut self, shared: std::sync::Arc<super::weights::SharedWeights>) {
        self.shared_base = Some(shared);
    }

    /// Whether the base weights are shared with other models of this process (loaded frozen or with
    /// LoRA from the same files, kind and device; see [`super::weights::read_checkpoint_shared`]).
    pub fn shares_base(&self) -> bool {
        self.shared_base.is_some()
    }

    /// The var store holding every parameter under its HF name (LoRA: `<module>.lora_A.weight`
    /// `[r, in]` and `<module>.lora_B.weight` `[out, r]`).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The tensors that require gradients (empty when frozen).
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    /// Device of the weights.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Floating kind of the weights.
    pub fn dtype(&self) -> Kind {
        self.dtype
    }

    /// The LoRA configuration, when adapters are attached.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Number of parameters (elements) in the var store, adapters included.
    pub fn num_parameters(&self) -> usize {
        self.vs.variables().values().map(|t| t.numel()).sum()
    }
}
