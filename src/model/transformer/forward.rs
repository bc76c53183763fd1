//! The forward pass of a [`Transformer`]: embeddings, RoPE tables, decoder layers (attention with an
//! optional KV cache, SwiGLU MLP), final norm and output logits.

use tch::{Kind, Tensor};

use super::layers::{rms_norm, rotate_half};
use super::{AttnMask, KvCache, Transformer};
use crate::{Error, Result};

impl Transformer {
    /// RoPE cos and sin for positions `[B, L]` (int64): each `[B, 1, L, d]` in the model's kind.
    fn rope(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let freqs = positions.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        Ok((emb.f_cos()?.f_to_kind(self.dtype)?, emb.f_sin()?.f_to_kind(self.dtype)?))
    }

    /// Runs the decoder on `input_ids` `[B, L]` (int64) at `positions` `[B, L]` (int64, the RoPE
    /// position of each token) and returns the final-normed hidden states `[B, L, H]` in the model's
    /// kind. With a cache, keys/values of the new tokens are written at cache positions
    /// `[len, len + L)` and attention covers `[0, len + L)`; the mask must then be
    /// [`AttnMask::Explicit`] unless the cache was empty and there is no left padding.
    ///
    /// # Errors
    /// [`Error::Model`] when the cache is too small; [`Error::Torch`] on shape or device mismatches.
    pub fn forward_hidden(&self, input_ids: &Tensor, positions: &Tensor, mask: AttnMask<'_>, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let size = input_ids.size();
        let l = match size.as_slice() {
            [_, l] => *l,
            other => return Err(Error::Model(format!("input_ids must be [B, L], got {other:?}"))),
        };
        let start = cache.as_ref().map(|k| k.len).unwrap_or(0) as i64;
        if let Some(k) = cache.as_ref() {
            if start + l > k.capacity as i64 {
                return Err(Error::Model(format!("KV cache holds {} positions, {} needed", k.capacity, start + l)));
            }
        }
        let (cos, sin) = self.rope(positions)?;
        let mut x = self.embed_tokens(input_ids)?;
        for i in 0..self.layers.len() {
            x = self.decoder_layer(i, &x, &cos, &sin, mask, cache.as_deref_mut(), start)?;
        }
        if let Some(kv) = cache {
            kv.len = (start + l) as usize;
        }
        self.final_norm(&x)
    }

    /// Token embeddings `[B, L, H]` (model kind) of `input_ids` `[B, L]` int64: the input of layer 0.
    ///
    /// # Errors
    /// [`Error::Torch`] for an id outside the vocabulary or a device mismatch.
    pub fn embed_tokens(&self, input_ids: &Tensor) -> Result<Tensor> {
        Ok(Tensor::f_embedding(&self.embed, input_ids, -1, false, false)?)
    }

    /// Whether the token embedding matrix `[V, H]` is trained (full fine-tuning; false with LoRA or
    /// frozen weights).
    pub fn embeddings_trainable(&self) -> bool {
        self.embed.requires_grad()
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// RoPE cos and sin for positions `[B, L]` int64: each `[B, 1, L, d]` in the model's kind (the
    /// inputs of [`Transformer::decoder_layer`]).
    ///
    /// # Errors
    /// [`Error::Torch`] on a device mismatch.
    pub fn rope_tables(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        self.rope(positions)
    }

    /// The final RMSNorm: residual stream `[.., H]` → hidden states `[.., H]` (model kind).
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.norm, self.config.rms_norm_eps)
    }

    /// Decoder layer `i` on the residual stream `x` `[B, L, H]` (pre-norm attention with RoPE from
    /// `cos`/`sin` of [`Transformer::rope_tables`], then the SwiGLU MLP, HF Llama/Qwen layout) →
    /// `[B, L, H]`. With a cache, the layer's keys/values of these L tokens are written at cache
    /// positions `[start, start + L)` (the caller advances the cache length once after the last layer).
    /// Differentiable in `x` and the trainable weights outside `no_grad`; the per-layer activation
    /// recomputation of [`crate::model::score::response_hidden`] calls it once per layer again.
    ///
    /// # Errors
    /// [`Error::Model`] for a layer index out of range; [`Error::Torch`] on shape or device mismatches.
    pub fn decoder_layer(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: AttnMask<'_>, cache: Option<&mut KvCache>, start: i64) -> Result<Tensor> {
        let layer = self.layers.get(i).ok_or_else(|| Error::Model(format!("layer {i} of {}", self.layers.len())))?;
        let (b, l) = match x.size().as_slice() {
            [b, l, _] => (*b, *l),
            other => return Err(Error::Model(format!("residual stream must be [B, L, H], got {other:?}"))),
        };
        let c = &self.config;
        let (nh, nkv, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let hn = rms_norm(x, &layer.input_norm, c.rms_norm_eps)?;
        let a = &layer.attn;
        let mut q = a.q.forward(&hn)?.f_view([b, l, nh, d])?;
        let mut k = a.k.forward(&hn)?.f_view([b, l, nkv, d])?;
        let v = a.v.forward(&hn)?.f_view([b, l, nkv, d])?.f_transpose(1, 2)?;
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            q = rms_norm(&q, qn, c.rms_norm_eps)?;
            k = rms_norm(&k, kn, c.rms_norm_eps)?;
        }
        let q = q.f_transpose(1, 2)?;
        let k = k.f_transpose(1, 2)?;
        let q = q.f_mul(cos)?.f_add(&rotate_half(&q)?.f_mul(sin)?)?;
        let k = k.f_mul(cos)?.f_add(&rotate_half(&k)?.f_mul(sin)?)?;
        // [B, n_kv, S, d]
        let (k_all, v_all) = match cache {
            None => (k, v),
            Some(kv) => {
                kv.k[i].f_narrow(2, start, l)?.f_copy_(&k)?;
                kv.v[i].f_narrow(2, start, l)?.f_copy_(&v)?;
                (kv.k[i].f_narrow(2, 0, start + l)?, kv.v[i].f_narrow(2, 0, start + l)?)
            }
        };
        // GQA: each key/value head serves n_h / n_kv consecutive query heads (HF `repeat_kv`);
        // SDPA's enable_gqa does that without materialising the repeated keys/values.
        let gqa = nh != nkv;
        let attn = match mask {
            AttnMask::Causal => Tensor::f_scaled_dot_product_attention::<Tensor>(&q, &k_all, &v_all, None, 0.0, l > 1, None, gqa)?,
            AttnMask::Explicit(m) => Tensor::f_scaled_dot_product_attention(&q, &k_all, &v_all, Some(m), 0.0, false, None, gqa)?,
        };
        let attn = attn.f_transpose(1, 2)?.f_reshape([b, l, nh * d])?;
        let x = x.f_add(&a.o.forward(&attn)?)?;
        let hn = rms_norm(&x, &layer.post_attention_norm, c.rms_norm_eps)?;
        let m = &layer.mlp;
        let act = m.gate.forward(&hn)?.f_silu()?.f_mul(&m.up.forward(&hn)?)?;
        Ok(x.f_add(&m.down.forward(&act)?)?)
    }

    /// Output logits `[.., V]` in the model's kind for hidden states `[.., H]`.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(hidden.f_linear::<Tensor>(self.lm_head.as_ref().unwrap_or(&self.embed), None)?)
    }

    /// One plain causal forward pass without cache: `input_ids` `[B, L]` (int64, right padding
    /// allowed) → logits `[B, L, V]` in f32, positions 0..L.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn forward_logits(&self, input_ids: &Tensor) -> Result<Tensor> {
        let size = input_ids.size();
        let pos = Tensor::f_arange(size.get(1).copied().unwrap_or(0), (Kind::Int64, self.device))?.f_unsqueeze(0)?.f_expand(&size, false)?;
        let h = self.forward_hidden(input_ids, &pos, AttnMask::Causal, None)?;
        Ok(self.logits(&h)?.f_to_kind(Kind::Float)?)
    }
}
