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

use std::collections::HashMap;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::config::ModelConfig;
use crate::{Error, Result};

/// A LoRA target: one of the seven projections of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl LoraTarget {
    /// All seven projections (the METHOD.md §6 default).
    pub const ALL: [LoraTarget; 7] = [LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O, LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down];

    /// The HF module name (`q_proj`, ..., `down_proj`).
    pub fn module_name(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// Parses `q`/`q_proj`, ..., `down`/`down_proj`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other name.
    pub fn parse(s: &str) -> Result<LoraTarget> {
        let s = s.trim();
        let base = s.strip_suffix("_proj").unwrap_or(s);
        Ok(match base {
            "q" => LoraTarget::Q,
            "k" => LoraTarget::K,
            "v" => LoraTarget::V,
            "o" => LoraTarget::O,
            "gate" => LoraTarget::Gate,
            "up" => LoraTarget::Up,
            "down" => LoraTarget::Down,
            _ => return Err(Error::Config(format!("unknown LoRA target module {s:?} (q, k, v, o, gate, up, down)"))),
        })
    }
}

/// LoRA hyper-parameters (written as `adapter_config.json` in PEFT's field names).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank r (> 0).
    pub rank: usize,
    /// Scale numerator α; the update is scaled by α / r.
    pub alpha: f64,
    /// Projections that get an adapter.
    pub targets: Vec<LoraTarget>,
}

impl LoraConfig {
    /// α / r.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The complete `adapter_config.json` of PEFT's `LoraConfig` for these adapters (see
    /// [`super::peft`]): `peft_type` `LORA`, `task_type` `CAUSAL_LM`, `r`, `lora_alpha` (an integer when
    /// whole), `target_modules`, no dropout (the trainer uses none), `bias` `none`, `fan_in_fan_out`
    /// false (A is `[r, in]`, B `[out, r]`), `use_rslora` false (our scale is α / r, which PEFT and
    /// vLLM then compute), no DoRA, no `modules_to_save`, every layer adapted, `inference_mode` true.
    pub fn to_json(&self, base_model: Option<&str>) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "revision": null,
            "inference_mode": true,
            "r": self.rank,
            "lora_alpha": super::peft::alpha_json(self.alpha),
            "lora_dropout": 0.0,
            "target_modules": self.targets.iter().map(|t| t.module_name()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "init_lora_weights": true,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "auto_mapping": null,
        })
    }

    /// Parses an `adapter_config.json` value (PEFT's, or one of an older nextstate checkpoint).
    /// `lora_alpha` defaults to r; `target_modules` may be a list of projection names or
    /// `"all-linear"` (absent: all seven). Under `use_rslora` PEFT scales by α / sqrt(r): the returned
    /// α is then `lora_alpha · sqrt(r)`, so [`LoraConfig::scale`] is the update PEFT applies.
    ///
    /// # Errors
    /// [`Error::Config`] when `r` is missing or zero, a target module is unknown, or the config asks for
    /// what these adapters cannot express: another `peft_type`, `bias` other than `none`,
    /// `fan_in_fan_out`, DoRA, `modules_to_save`, a subset of layers, or per-module rank/alpha patterns.
    pub fn from_json(v: &serde_json::Value) -> Result<LoraConfig> {
        let unsupported = |what: &str| Error::Config(format!("adapter_config.json: {what} is not supported by nextstate's LoRA"));
        if let Some(t) = v.get("peft_type").and_then(|t| t.as_str()) {
            if t != "LORA" {
                return Err(unsupported(&format!("peft_type {t:?}")));
            }
        }
        if let Some(b) = v.get("bias").and_then(|b| b.as_str()) {
            if b != "none" {
                return Err(unsupported(&format!("bias {b:?}")));
            }
        }
        let is_true = |k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
        for flag in ["fan_in_fan_out", "use_dora"] {
            if is_true(flag) {
                return Err(unsupported(&format!("{flag} = true")));
            }
        }
        let non_empty = |k: &str| match v.get(k) {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(serde_json::Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
        };
        for field in ["modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"] {
            if non_empty(field) {
                return Err(unsupported(field));
            }
        }
        let rank = v.get("r").and_then(|r| r.as_u64()).filter(|&r| r > 0).ok_or_else(|| Error::Config("adapter_config.json: missing positive r".into()))? as usize;
        let mut alpha = v.get("lora_alpha").and_then(|a| a.as_f64()).unwrap_or(rank as f64);
        if is_true("use_rslora") {
            alpha *= (rank as f64).sqrt();
        }
        let targets = match v.get("target_modules") {
            Some(serde_json::Value::Array(a)) => a.iter().map(|t| LoraTarget::parse(t.as_str().unwrap_or(""))).collect::<Result<Vec<_>>>()?,
            Some(serde_json::Value::String(s)) => super::peft::targets_of_string(s)?,
            _ => LoraTarget::ALL.to_vec(),
        };
        Ok(LoraConfig { rank, alpha, targets })
    }
}

/// Which parameters require gradients.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Trainable {
    /// Inference only: nothing requires gradients.
    #[default]
    Frozen,
    /// Full fine-tuning: every weight is a trainable variable.
    Full,
    /// Base weights frozen, LoRA adapters (created at load) trainable.
    Lora(LoraConfig),
}

/// Where and how to load a model.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Device for all weights.
    pub device: Device,
    /// Floating kind of the weights (Float, Half or BFloat16); activations follow it, norms and
    /// softmaxes are computed in f32.
    pub dtype: Kind,
    /// What is trainable.
    pub trainable: Trainable,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { device: Device::Cpu, dtype: Kind::Float, trainable: Trainable::Frozen }
    }
}

impl LoadOptions {
    /// Parses a device name: `cpu`, `cuda`, `cuda:N`, or `auto` (CUDA 0 when available, else CPU).
    ///
    /// # Errors
    /// [`Error::Config`] for anything else, or CUDA requested but not available.
    pub fn parse_device(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(Device::cuda_if_available()),
            "cuda" | "gpu" => {
                if tch::Cuda::is_available() {
                    Ok(Device::Cuda(0))
                } else {
                    Err(Error::Config("device cuda requested but CUDA is not available".into()))
                }
            }
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
                Some(n) if (n as i64) < tch::Cuda::device_count() => Ok(Device::Cuda(n)),
                Some(n) => Err(Error::Config(format!("cuda:{n} requested, {} CUDA devices available", tch::Cuda::device_count()))),
                None => Err(Error::Config(format!("unknown device {other:?} (cpu, cuda, cuda:N, auto)"))),
            },
        }
    }

    /// Parses a dtype name: `f32`/`float32`, `f16`/`float16`, `bf16`/`bfloat16`, or `auto` (f32 on
    /// CPU, bf16 on CUDA).
    ///
    /// # Errors
    /// [`Error::Config`] for anything else.
    pub fn parse_dtype(s: &str, device: Device) -> Result<Kind> {
        Ok(match s {
            "f32" | "float32" | "float" => Kind::Float,
            "f16" | "float16" | "half" => Kind::Half,
            "bf16" | "bfloat16" => Kind::BFloat16,
            "auto" => {
                if device.is_cuda() {
                    Kind::BFloat16
                } else {
                    Kind::Float
                }
            }
            other => return Err(Error::Config(format!("unknown dtype {other:?} (f32, f16, bf16, auto)"))),
        })
    }
}

struct LoraPair {
    /// `[r, in]`.
    a: Tensor,
    /// `[out, r]`.
    b: Tensor,
    scale: f64,
}

/// A projection `y = x Wᵀ + b` with an optional LoRA update.
struct Linear {
    /// HF module path, e.g. `model.layers.0.self_attn.q_proj`.
    name: String,
    /// `[out, in]`.
    weight: Tensor,
    /// `[out]`.
    bias: Option<Tensor>,
    lora: Option<LoraPair>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
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
    fn merged_weight(&self) -> Result<Tensor> {
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

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3 per-head RMSNorm weights `[d]`.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    /// `[H]`.
    input_norm: Tensor,
    /// `[H]`.
    post_attention_norm: Tensor,
    attn: Attention,
    mlp: Mlp,
}

impl Layer {
    fn linear(&self, t: LoraTarget) -> &Linear {
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
    fn linear_mut(&mut self, t: LoraTarget) -> &mut Linear {
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

/// The attention mask of one forward call.
#[derive(Debug, Clone, Copy)]
pub enum AttnMask<'a> {
    /// Plain causal attention over exactly the L new tokens (no cache content, no padding before any
    /// real token: right padding is fine).
    Causal,
    /// Boolean `[B, 1, L, S]`, true where a query may attend to a key; S = cache length after this
    /// call.
    Explicit(&'a Tensor),
}

/// Per-layer key/value cache, preallocated for `capacity` positions: keys and values of layer i are
/// `[B, n_kv, capacity, d]`; positions `[0, len)` are filled.
#[derive(Debug)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache for `batch` sequences of up to `capacity` positions.
    ///
    /// # Errors
    /// [`Error::Torch`] when the allocation fails (out of memory).
    pub fn new(config: &ModelConfig, batch: usize, capacity: usize, kind: Kind, device: Device) -> Result<KvCache> {
        let shape = [batch as i64, config.num_key_value_heads as i64, capacity as i64, config.head_dim as i64];
        let mut k = Vec::with_capacity(config.num_hidden_layers);
        let mut v = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            k.push(Tensor::f_zeros(shape, (kind, device))?);
            v.push(Tensor::f_zeros(shape, (kind, device))?);
        }
        Ok(KvCache { k, v, len: 0, capacity })
    }
    /// Filled positions.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Allocated positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Grows the capacity to at least `needed` positions (filled positions are kept).
    ///
    /// # Errors
    /// [`Error::Torch`] when the allocation fails.
    pub fn reserve(&mut self, needed: usize) -> Result<()> {
        if needed <= self.capacity {
            return Ok(());
        }
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut size = t.size();
            size[2] = (needed - self.capacity) as i64;
            let extra = Tensor::f_zeros(&size, (t.kind(), t.device()))?;
            *t = Tensor::f_cat(&[&*t, &extra], 2)?;
        }
        self.capacity = needed;
        Ok(())
    }
    /// Keeps only the batch rows `rows` (int64 `[B']`, on the cache's device), e.g. after some
    /// sequences finished.
    ///
    /// # Errors
    /// [`Error::Torch`] for an out-of-range row.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.f_index_select(0, rows)?;
        }
        Ok(())
    }
}

/// RMSNorm in f32 (HF `LlamaRMSNorm`): `w · (x / sqrt(mean(x², −1) + ε))`, result in x's kind.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let kind = x.kind();
    let xf = x.f_to_kind(Kind::Float)?;
    let var = xf.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
    let normed = xf.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?.f_to_kind(kind)?;
    Ok(normed.f_mul(w)?)
}

/// `[−x2, x1]` for `x = [x1, x2]` split in halves along the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    let x1 = x.f_narrow(-1, 0, d / 2)?;
    let x2 = x.f_narrow(-1, d / 2, d - d / 2)?;
    Ok(Tensor::f_cat(&[x2.f_neg()?, x1], -1)?)
}

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

/// Whether a var-store name is a LoRA adapter tensor (`<module>.lora_A.weight` / `.lora_B.weight`).
fn is_adapter_name(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

/// Adds a tensor to the var store under a dotted HF name.
fn add_var(vs: &VarStore, name: &str, t: Tensor, trainable: bool) -> Tensor {
    let mut parts: Vec<&str> = name.split('.').collect();
    let last = parts.pop().unwrap_or(name);
    let mut path = vs.root();
    for p in parts {
        path = path.sub(p);
    }
    path.add(last, t, trainable)
}

impl Transformer {
    /// Builds the model from a map of HF-named CPU tensors (see [`super::weights::read_checkpoint`]).
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
    /// `[out, r]`, the model's dtype), sorted by name; [`super::peft::write_adapter`] writes them under
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
            let name = super::peft::model_name(&name);
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
