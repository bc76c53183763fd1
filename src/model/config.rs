//! `config.json` of an HF causal LM (Llama, Qwen2, Qwen3) as the runtime needs it.

use std::path::Path;

use serde::Deserialize;

use crate::{Error, Result};

/// The decoder families the runtime implements. They differ only in biases and norms:
/// Llama (optional `attention_bias` on q, k, v, o), Qwen2 (bias on q, k, v, never on o), Qwen3
/// (RMSNorm over each head of q and k before RoPE, optional `attention_bias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (also Mistral-style checkpoints without sliding window).
    Llama,
    /// `Qwen2ForCausalLM`.
    Qwen2,
    /// `Qwen3ForCausalLM`.
    Qwen3,
}

/// RoPE frequency scaling (`rope_scaling` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `{"rope_type": "linear", "factor": f}`: positions divided by `factor`.
    Linear {
        /// Divisor of positions.
        factor: f64,
    },
    /// `{"rope_type": "llama3", ...}` (Llama 3.1+): low frequencies divided by `factor`, high ones kept,
    /// smooth interpolation between (HF `_compute_llama3_parameters`).
    Llama3 {
        /// Divisor of low frequencies.
        factor: f64,
        /// Wavelength bound, low side.
        low_freq_factor: f64,
        /// Wavelength bound, high side.
        high_freq_factor: f64,
        /// Context length the model was trained with before scaling.
        original_max_position_embeddings: f64,
    },
}

/// The hyper-parameters of a decoder-only transformer, read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Family (decides biases and QK-norm).
    pub architecture: Architecture,
    /// Model width H.
    pub hidden_size: usize,
    /// SwiGLU inner width F.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads n_h.
    pub num_attention_heads: usize,
    /// Key/value heads n_kv (GQA; divides n_h).
    pub num_key_value_heads: usize,
    /// Per-head width d (config `head_dim`, else H / n_h).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Vocabulary size V (rows of the embedding).
    pub vocab_size: usize,
    /// Longest sequence the model supports (tokens).
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the input embedding matrix.
    pub tie_word_embeddings: bool,
    /// Bias on the q, k, v projections.
    pub qkv_bias: bool,
    /// Bias on the o projection.
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm over each q and k head (Qwen3).
    pub qk_norm: bool,
    /// BOS id, if the config names one.
    pub bos_token_id: Option<u32>,
    /// EOS ids (config `eos_token_id` may be one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// Padding id, if the config names one.
    pub pad_token_id: Option<u32>,
    /// `torch_dtype` as written (`float32`, `bfloat16`, ...), if any.
    pub torch_dtype: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    bos_token_id: Option<OneOrMany>,
    eos_token_id: Option<OneOrMany>,
    pad_token_id: Option<OneOrMany>,
    torch_dtype: Option<String>,
    use_sliding_window: Option<bool>,
}

fn ids(v: Option<OneOrMany>) -> Vec<u32> {
    match v {
        None => vec![],
        Some(OneOrMany::One(i)) => vec![i],
        Some(OneOrMany::Many(v)) => v,
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when missing; [`Error::Json`] when malformed; [`Error::Model`] for an unsupported
    /// architecture, activation, RoPE scaling or inconsistent head counts.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let p = dir.join("config.json");
        let s = std::fs::read_to_string(&p).map_err(|e| Error::io("read", &p, e))?;
        Self::from_json(&s)
    }

    /// Parses the text of a `config.json`.
    ///
    /// # Errors
    /// As [`ModelConfig::from_dir`].
    pub fn from_json(s: &str) -> Result<ModelConfig> {
        let raw: RawConfig = serde_json::from_str(s)?;
        let kind = raw.model_type.clone().unwrap_or_default();
        let arch_name = raw.architectures.first().cloned().unwrap_or_default();
        let architecture = match (kind.as_str(), arch_name.as_str()) {
            ("llama", _) | (_, "LlamaForCausalLM") => Architecture::Llama,
            ("mistral", _) | (_, "MistralForCausalLM") => Architecture::Llama,
            ("qwen2", _) | (_, "Qwen2ForCausalLM") => Architecture::Qwen2,
            ("qwen3", _) | (_, "Qwen3ForCausalLM") => Architecture::Qwen3,
            _ => return Err(Error::Model(format!("unsupported model_type {kind:?} / architecture {arch_name:?} (llama, qwen2, qwen3)"))),
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(Error::Model(format!("unsupported hidden_act {act:?} (silu)")));
            }
        }
        if raw.use_sliding_window == Some(true) {
            tracing::warn!("config asks for sliding-window attention; the runtime attends to the full context");
        }
        let n_h = raw.num_attention_heads;
        let n_kv = raw.num_key_value_heads.unwrap_or(n_h);
        if n_h == 0 || n_kv == 0 || !n_h.is_multiple_of(n_kv) {
            return Err(Error::Model(format!("{n_h} attention heads is not a positive multiple of {n_kv} key/value heads")));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(n_h) => raw.hidden_size / n_h,
            None => return Err(Error::Model(format!("hidden_size {} is not a multiple of {n_h} heads", raw.hidden_size))),
        };
        if head_dim % 2 != 0 {
            return Err(Error::Model(format!("head_dim {head_dim} must be even for RoPE")));
        }
        let rope_scaling = match raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let t = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
                let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
                match t {
                    "default" => None,
                    "linear" => Some(RopeScaling::Linear { factor: f("factor").unwrap_or(1.0) }),
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: f("factor").unwrap_or(8.0),
                        low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                        high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                        original_max_position_embeddings: f("original_max_position_embeddings").unwrap_or(8192.0),
                    }),
                    other => return Err(Error::Model(format!("unsupported rope_scaling type {other:?} (linear, llama3)"))),
                }
            }
        };
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias, qk_norm) = match architecture {
            Architecture::Llama => (attention_bias, attention_bias, false),
            Architecture::Qwen2 => (true, false, false),
            Architecture::Qwen3 => (attention_bias, attention_bias, true),
        };
        Ok(ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: n_h,
            num_key_value_heads: n_kv,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            // HF's LlamaConfig / Qwen2Config default is untied.
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm,
            bos_token_id: ids(raw.bos_token_id).first().copied(),
            eos_token_ids: ids(raw.eos_token_id),
            pad_token_id: ids(raw.pad_token_id).first().copied(),
            torch_dtype: raw.torch_dtype,
        })
    }

    /// RoPE inverse frequencies `θ^(−2i/d)` for i in 0..d/2, with [`RopeScaling`] applied (HF
    /// `_compute_default_rope_parameters`, `_compute_llama3_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d)).collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_smollm2_style_config() {
        let c = ModelConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"rms_norm_eps":1e-5,"rope_theta":100000.0,
            "vocab_size":49152,"max_position_embeddings":8192,"tie_word_embeddings":true,"bos_token_id":1,"eos_token_id":2}"#,
        )
        .unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        // θ^(−2·1/64) = 100000^(−1/32)
        assert!((f[1] - 100000f64.powf(-1.0 / 32.0)).abs() < 1e-15);
    }

    #[test]
    fn qwen_families() {
        let q2 = ModelConfig::from_json(
            r#"{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,
            "num_key_value_heads":2,"vocab_size":151936,"eos_token_id":[151645,151643]}"#,
        )
        .unwrap();
        assert!(q2.qkv_bias && !q2.o_bias && !q2.tie_word_embeddings);
        assert_eq!(q2.eos_token_ids, vec![151645, 151643]);
        let q3 = ModelConfig::from_json(
            r#"{"model_type":"qwen3","hidden_size":1024,"intermediate_size":3072,"num_hidden_layers":28,"num_attention_heads":16,
            "num_key_value_heads":8,"head_dim":128,"vocab_size":151936}"#,
        )
        .unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias);
        assert_eq!(q3.head_dim, 128);
        assert!(ModelConfig::from_json(r#"{"model_type":"gpt2","hidden_size":1,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1}"#).is_err());
        assert!(ModelConfig::from_json(r#"{"model_type":"llama","hidden_size":8,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2,"vocab_size":1}"#).is_err());
    }

    #[test]
    fn llama3_rope_scaling() {
        let c = ModelConfig::from_json(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1,
            "rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        let f = c.rope_inv_freq();
        // The highest frequency (wavelength 2π < 2048) is unchanged; the lowest is divided by 8.
        assert_eq!(f[0], 1.0);
        let lowest = 1.0 / 500000f64.powf(62.0 / 64.0);
        assert!((f[31] - lowest / 8.0).abs() < 1e-18);
    }
}
