//! Loading a [`Transformer`]: where and how ([`LoadOptions`], [`Trainable`]) and building the model
//! from a map of HF-named checkpoint tensors ([`Transformer::from_weights`]).

use std::collections::HashMap;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::layers::{Attention, Layer, Linear, Mlp};
use super::load_options::{LoadOptions, Trainable};
use super::Transformer;
use crate::model::config::ModelConfig;
use crate::{Error, Result};

/// Pulls named weights out of a loaded checkpoint into the var store.
struct Builder<'a> {
    weights: HashMap<String, Tensor>,
    vs: &'a VarStore,
    dtype: Kind,
    device: Device,
    train_base: bool,
}

impl Builder<'_> {
    /// Moves `name` (shape checked) into the var store under the same name.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.weights.remove(name).ok_or_else(|| Error::Model(format!("checkpoint has no tensor {name}")))?;
        let got: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        if got != shape {
            return Err(Error::Model(format!("tensor {name}: shape {got:?}, expected {shape:?}")));
        }
        let t = t.f_to_kind(self.dtype)?.f_to_device(self.device)?;
        Ok(add_var(self.vs, name, t, self.train_base))
    }
    fn linear(&mut self, prefix: &str, out_f: usize, in_f: usize, bias: bool) -> Result<Linear> {
        let weight = self.take(&format!("{prefix}.weight"), &[out_f, in_f])?;
        let bias = if bias { Some(self.take(&format!("{prefix}.bias"), &[out_f])?) } else { None };
        Ok(Linear { name: prefix.to_string(), weight, bias, lora: None })
    }
}

/// Adds a tensor to the var store under a dotted HF name.
pub(super) fn add_var(vs: &VarStore, name: &str, t: Tensor, trainable: bool) -> Tensor {
    let mut parts: Vec<&str> = name.split('.').collect();
    let last = parts.pop().unwrap_or(name);
    let mut path = vs.root();
    for p in parts {
        path = path.sub(p);
    }
    path.add(last, t, trainable)
}

impl Transformer {
    /// Builds the model from a map of HF-named CPU tensors (see [`crate::model::weights::read_checkpoint`]).
    /// Extra tensors are ignored with a warning naming them; `lm_head.weight` is ignored when the
    /// embeddings are tied.
    ///
    /// # Errors
    /// [`Error::Model`] for a missing tensor or a shape mismatch; [`Error::Torch`] for device/dtype
    /// conversion failures.
    pub fn from_weights(config: ModelConfig, weights: HashMap<String, Tensor>, opts: &LoadOptions) -> Result<Transformer> {
        if !matches!(opts.dtype, Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double) {
            return Err(Error::Config(format!("dtype {:?} is not a floating kind", opts.dtype)));
        }
        let vs = VarStore::new(opts.device);
        let train_base = matches!(opts.trainable, Trainable::Full);
        let c = &config;
        let (h, f, v, d) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let mut b = Builder { weights, vs: &vs, dtype: opts.dtype, device: opts.device, train_base };
        let embed = b.take("model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = Attention {
                q: b.linear(&format!("{p}.self_attn.q_proj"), nh * d, h, c.qkv_bias)?,
                k: b.linear(&format!("{p}.self_attn.k_proj"), nkv * d, h, c.qkv_bias)?,
                v: b.linear(&format!("{p}.self_attn.v_proj"), nkv * d, h, c.qkv_bias)?,
                o: b.linear(&format!("{p}.self_attn.o_proj"), h, nh * d, c.o_bias)?,
                q_norm: if c.qk_norm { Some(b.take(&format!("{p}.self_attn.q_norm.weight"), &[d])?) } else { None },
                k_norm: if c.qk_norm { Some(b.take(&format!("{p}.self_attn.k_norm.weight"), &[d])?) } else { None },
            };
            let mlp = Mlp {
                gate: b.linear(&format!("{p}.mlp.gate_proj"), f, h, c.mlp_bias)?,
                up: b.linear(&format!("{p}.mlp.up_proj"), f, h, c.mlp_bias)?,
                down: b.linear(&format!("{p}.mlp.down_proj"), h, f, c.mlp_bias)?,
            };
            layers.push(Layer {
                input_norm: b.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_attention_norm: b.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                attn,
                mlp,
            });
        }
        let norm = b.take("model.norm.weight", &[h])?;
        let lm_head = if c.tie_word_embeddings {
            b.weights.remove("lm_head.weight");
            None
        } else {
            Some(b.take("lm_head.weight", &[v, h])?)
        };
        if !b.weights.is_empty() {
            let mut extra: Vec<&String> = b.weights.keys().collect();
            extra.sort();
            tracing::warn!("ignored {} checkpoint tensors the model does not use: {:?}", extra.len(), extra);
        }
        let inv: Vec<f32> = config.rope_inv_freq().iter().map(|&x| x as f32).collect();
        let inv_freq = Tensor::f_from_slice(&inv)?.f_to_device(opts.device)?;
        let mut t = Transformer { config, vs, embed, layers, norm, lm_head, inv_freq, dtype: opts.dtype, device: opts.device, lora: None, shared_base: None };
        if let Trainable::Lora(cfg) = &opts.trainable {
            t.attach_lora(cfg)?;
        }
        Ok(t)
    }
}
