//! The building blocks of a decoder layer: projections with optional LoRA ([`Linear`]), attention
//! and MLP weights, and the RMSNorm and rotate-half helpers of the forward pass.

use tch::{Kind, Tensor};

use crate::model::peft::LoraTarget;
use crate::Result;

/// The adapter of one projection: `y += scale · (x Aᵀ) Bᵀ`.
pub(super) struct LoraPair {
    /// `[r, in]`.
    pub(super) a: Tensor,
    /// `[out, r]`.
    pub(super) b: Tensor,
    /// α / r.
    pub(super) scale: f64,
}

/// A projection `y = x Wᵀ + b` with an optional LoRA update.
pub(super) struct Linear {
    /// HF module path, e.g. `model.layers.0.self_attn.q_proj`.
    pub(super) name: String,
    /// `[out, in]`.
    pub(super) weight: Tensor,
    /// `[out]`.
    pub(super) bias: Option<Tensor>,
    pub(super) lora: Option<LoraPair>,
}

impl Linear {
    /// `x [.., in]` → `[.., out]`: `x Wᵀ + b`, plus the LoRA update when attached.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.f_linear(&self.weight, self.bias.as_ref())?;
        match &self.lora {
            None => Ok(y),
            Some(l) => {
                let delta = x.f_linear::<Tensor>(&l.a, None)?.f_linear::<Tensor>(&l.b, None)?;
                Ok(y.f_add(&delta.f_mul_scalar(l.scale)?)?)
            }
        }
    }

    /// `W + (α/r)·B·A` (or W itself without LoRA), detached.
    pub(super) fn merged_weight(&self) -> Result<Tensor> {
        let w = self.weight.f_detach()?;
        match &self.lora {
            None => Ok(w),
            Some(l) => {
                let ba = l.b.f_detach()?.f_to_kind(Kind::Float)?.f_matmul(&l.a.f_detach()?.f_to_kind(Kind::Float)?)?;
                Ok(w.f_to_kind(Kind::Float)?.f_add(&ba.f_mul_scalar(l.scale)?)?.f_to_kind(w.kind())?)
            }
        }
    }
}

/// The self-attention projections of one layer.
pub(super) struct Attention {
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    /// Qwen3 per-head RMSNorm weights `[d]`.
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
}

/// The SwiGLU MLP projections of one layer.
pub(super) struct Mlp {
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

/// One decoder layer's weights.
pub(super) struct Layer {
    /// `[H]`.
    pub(super) input_norm: Tensor,
    /// `[H]`.
    pub(super) post_attention_norm: Tensor,
    pub(super) attn: Attention,
    pub(super) mlp: Mlp,
}

impl Layer {
    /// The projection a LoRA target names.
    pub(super) fn linear(&self, t: LoraTarget) -> &Linear {
        match t {
            LoraTarget::Q => &self.attn.q,
            LoraTarget::K => &self.attn.k,
            LoraTarget::V => &self.attn.v,
            LoraTarget::O => &self.attn.o,
            LoraTarget::Gate => &self.mlp.gate,
            LoraTarget::Up => &self.mlp.up,
            LoraTarget::Down => &self.mlp.down,
        }
    }
    /// The projection a LoRA target names, mutably.
    pub(super) fn linear_mut(&mut self, t: LoraTarget) -> &mut Linear {
        match t {
            LoraTarget::Q => &mut self.attn.q,
            LoraTarget::K => &mut self.attn.k,
            LoraTarget::V => &mut self.attn.v,
            LoraTarget::O => &mut self.attn.o,
            LoraTarget::Gate => &mut self.mlp.gate,
            LoraTarget::Up => &mut self.mlp.up,
            LoraTarget::Down => &mut self.mlp.down,
        }
    }
}

/// RMSNorm in f32 (HF `LlamaRMSNorm`): `w · (x / sqrt(mean(x², −1) + ε))`, result in x's kind.
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let kind = x.kind();
    let xf = x.f_to_kind(Kind::Float)?;
    let var = xf.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
    let normed = xf.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?.f_to_kind(kind)?;
    Ok(normed.f_mul(w)?)
}

/// `[−x2, x1]` for `x = [x1, x2]` split in halves along the last dimension.
pub(super) fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    let x1 = x.f_narrow(-1, 0, d / 2)?;
    let x2 = x.f_narrow(-1, d / 2, d - d / 2)?;
    Ok(Tensor::f_cat(&[x2.f_neg()?, x1], -1)?)
}
