//! GGUF → Hugging Face directory import (`nextstate model import`).
//!
//! Writes `config.json`, `generation_config.json`, `model.safetensors` (HF tensor names, dequantised to
//! f32 or f16), `tokenizer.json` (loadable by the `tokenizers` crate and HF `transformers`) and
//! `tokenizer_config.json` (chat template and special tokens). Supported architectures: `llama`,
//! `qwen2`, `qwen3` with a byte-level BPE (`gpt2`) tokenizer. See `../shared/docs/MODELS.md`.
//!
//! llama.cpp's converter permutes the rows of the Q and K projections of `llama`-arch models so that its
//! RoPE can rotate adjacent pairs; [`unpermute_rows`] undoes it so the HF rotate-half RoPE applies.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::f16;
use serde_json::{json, Value};

use super::gguf::{GgufFile, MetadataValue, TensorInfo};
use crate::{Error, Result};

/// Element type of the written `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportDtype {
    /// 4-byte floats: exact values of the dequantised weights (the default).
    F32,
    /// IEEE half: half the size; rounds the dequantised weights.
    F16,
}

impl ImportDtype {
    /// Parses `f32` / `f16` (also `float32`, `float16`).
    ///
    /// # Errors
    /// [`Error::Config`] for any other name.
    pub fn parse(s: &str) -> Result<ImportDtype> {
        match s {
            "f32" | "float32" => Ok(ImportDtype::F32),
            "f16" | "float16" => Ok(ImportDtype::F16),
            other => Err(crate::config_err!("unknown import dtype {other:?} (f32 or f16)")),
        }
    }
    fn torch_name(self) -> &'static str {
        match self {
            ImportDtype::F32 => "float32",
            ImportDtype::F16 => "float16",
        }
    }
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportSummary {
    /// The output directory.
    pub out_dir: PathBuf,
    /// GGUF `general.architecture`.
    pub architecture: String,
    /// Number of tensors written.
    pub tensors: usize,
    /// Number of parameters written (elements).
    pub parameters: u64,
    /// Vocabulary size (tokens).
    pub vocab_size: usize,
    /// Number of BPE merges.
    pub merges: usize,
    /// Whether the output head is tied to the input embedding.
    pub tied_embeddings: bool,
}

/// Hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
struct Hparams {
    arch: String,
    n_layers: usize,
    hidden: usize,
    ffn: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rms_eps: f64,
    rope_theta: f64,
    context: usize,
}

/// A float read from f32 metadata, rounded to the shortest decimal that gives back the same f32
/// (so 1e-5 is written as 1e-5, not 9.99999974e-6).
fn tidy_f32(v: f64) -> f64 {
    let f = v as f32;
    f.to_string().parse::<f64>().unwrap_or(v)
}

impl Hparams {
    fn read(g: &GgufFile) -> Result<Hparams> {
        let arch = g.get_str("general.architecture")?.to_string();
        if !matches!(arch.as_str(), "llama" | "qwen2" | "qwen3") {
            return Err(Error::Model(format!("gguf: architecture {arch:?} is not supported (llama, qwen2, qwen3)")));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = g.get_u64(&k("embedding_length"))? as usize;
        let n_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = g.get(&k("attention.head_count_kv")).and_then(|v| v.as_u64()).map(|v| v as usize).unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(Error::Model(format!("gguf: {n_heads} attention heads is not a multiple of {n_kv_heads} key/value heads")));
        }
        let head_dim = match g.get(&k("attention.key_length")).and_then(|v| v.as_u64()) {
            Some(d) => d as usize,
            None if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            None => return Err(Error::Model(format!("gguf: hidden size {hidden} is not a multiple of {n_heads} heads"))),
        };
        if let Some(t) = g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
            if t != "none" {
                return Err(Error::Model(format!("gguf: RoPE scaling {t:?} is not supported by the importer")));
            }
        }
        Ok(Hparams {
            n_layers: g.get_u64(&k("block_count"))? as usize,
            hidden,
            ffn: g.get_u64(&k("feed_forward_length"))? as usize,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: tidy_f32(g.get_f64(&k("attention.layer_norm_rms_epsilon"))?),
            rope_theta: g.get(&k("rope.freq_base")).and_then(|v| v.as_f64()).map(tidy_f32).unwrap_or(10_000.0),
            context: g.get(&k("context_length")).and_then(|v| v.as_u64()).unwrap_or(4096) as usize,
            arch,
        })
    }
}

/// Maps a GGUF tensor name to its HF name (`None` for tensors HF checkpoints do not have).
///
/// # Errors
/// [`Error::Model`] for a tensor this importer does not know (rather than silently dropping it).
pub fn hf_tensor_name(gguf_name: &str) -> Result<Option<String>> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Ok(Some(f.to_string()));
    }
    if gguf_name == "rope_freqs.weight" {
        return Err(Error::Model("gguf: rope_freqs (Llama-3 RoPE frequency scaling) is not supported by the importer".into()));
    }
    let unknown = || Error::Model(format!("gguf: unknown tensor {gguf_name:?}"));
    let rest = gguf_name.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let (module, suffix) = rest.rsplit_once('.').ok_or_else(unknown)?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return Err(unknown()),
    };
    if suffix != "weight" && suffix != "bias" {
        return Err(unknown());
    }
    Ok(Some(format!("model.layers.{layer}.{hf}.{suffix}")))
}

/// Undoes llama.cpp's row permutation of a Q or K projection (weight `[n_head·head_dim, cols]` or bias
/// `[n_head·head_dim]` with `cols = 1`).
///
/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reshapes the HF rows as
/// `[n_head, 2, head_dim/2]` and swaps the last two axes, so HF row `h·hd + s·hd/2 + j` (half `s`,
/// index `j`) is stored at GGUF row `h·hd + 2j + s`. This is the inverse.
///
/// # Errors
/// [`Error::Model`] when the row count is not `n_head·head_dim` with an even `head_dim`.
pub fn unpermute_rows(data: &[f32], n_head: usize, cols: usize) -> Result<Vec<f32>> {
    let rows = data.len().checked_div(cols).unwrap_or(0);
    if n_head == 0 || cols == 0 || !data.len().is_multiple_of(cols) || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(Error::Model(format!("cannot un-permute {} values as {n_head} heads × even head_dim × {cols} columns", data.len())));
    }
    let hd = rows / n_head;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for j in 0..hd / 2 {
                let hf_row = h * hd + s * (hd / 2) + j;
                let gguf_row = h * hd + 2 * j + s;
                out[hf_row * cols..(hf_row + 1) * cols].copy_from_slice(&data[gguf_row * cols..(gguf_row + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// One output tensor, decoded when the safetensors writer asks for its bytes (so at most one tensor
/// is materialised at a time).
struct LazyTensor<'a> {
    gguf: &'a GgufFile,
    info: &'a TensorInfo,
    shape: Vec<usize>,
    /// Number of heads whose rows must be un-permuted (Q/K of llama), if any.
    unpermute_heads: Option<usize>,
    dtype: ImportDtype,
    /// A decode error met inside the writer (which cannot return one), reported after writing.
    failure: std::cell::RefCell<Option<String>>,
}

impl LazyTensor<'_> {
    fn decode(&self) -> Result<Vec<f32>> {
        let data = self.gguf.tensor_f32(self.info)?;
        match self.unpermute_heads {
            None => Ok(data),
            Some(h) => {
                let cols = if self.shape.len() == 2 { self.shape[1] } else { 1 };
                unpermute_rows(&data, h, cols)
            }
        }
    }
}

impl safetensors::View for &LazyTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            ImportDtype::F32 => safetensors::Dtype::F32,
            ImportDtype::F16 => safetensors::Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // Every failure mode of `decode` (type, size, bounds, head shape) was checked when planning, so
        // an error here is a bug; the writer cannot return it, so it is recorded and reported after.
        let values = self.decode().unwrap_or_else(|e| {
            *self.failure.borrow_mut() = Some(e.to_string());
            vec![0.0; self.shape.iter().product()]
        });
        let bytes: Vec<u8> = match self.dtype {
            ImportDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ImportDtype::F16 => values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        };
        Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        let n: usize = self.shape.iter().product();
        n * match self.dtype {
            ImportDtype::F32 => 4,
            ImportDtype::F16 => 2,
        }
    }
}

/// The regex of the pre-tokenizer that splits text before byte-level BPE, by llama.cpp's
/// `tokenizer.ggml.pre` name (`llama-vocab.cpp`), as a `tokenizers` pre-tokenizer JSON.
fn pre_tokenizer_json(pre: &str) -> Result<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Ok(match pre {
        // SmolLM / StarCoder: every digit on its own, then GPT-2's byte-level regex.
        "smollm" | "starcoder" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "gpt-2" | "gpt2" | "default" => byte_level(true),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2), byte_level(false)]}),
        "llama-bpe" | "llama3" | "smaug-bpe" => json!({"type": "Sequence", "pretokenizers": [split(LLAMA3), byte_level(false)]}),
        other => {
            return Err(Error::Model(format!(
                "gguf: pre-tokenizer {other:?} is not supported (smollm, starcoder, gpt-2, qwen2, llama-bpe)"
            )))
        }
    })
}

/// Token types of `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Special-token ids and strings needed by the config files.
#[derive(Debug, Clone, Default)]
struct SpecialTokens {
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    pad: Option<(u32, String)>,
    unk: Option<(u32, String)>,
}

/// Builds `tokenizer.json` (as JSON) from the GGUF vocabulary, merges, token types and pre-tokenizer.
fn tokenizer_json(g: &GgufFile) -> Result<(Value, SpecialTokens, usize, usize)> {
    let model = g.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::Model(format!("gguf: tokenizer model {model:?} is not supported (only byte-level BPE \"gpt2\")")));
    }
    let tokens: Vec<&str> = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .ok_or_else(|| Error::Model("gguf: missing tokenizer.ggml.tokens".into()))?
        .iter()
        .enumerate()
        .map(|(i, v)| v.as_str().ok_or_else(|| Error::Model(format!("gguf: token {i} is not a string"))))
        .collect::<Result<_>>()?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(Error::Model(format!("gguf: {} token types for {} tokens", types.len(), tokens.len())));
    }
    let merges: Vec<Value> = g
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .ok_or_else(|| Error::Model("gguf: missing tokenizer.ggml.merges".into()))?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let s = v.as_str().ok_or_else(|| Error::Model(format!("gguf: merge {i} is not a string")))?;
            let (a, b) = s.split_once(' ').ok_or_else(|| Error::Model(format!("gguf: merge {i} {s:?} has no space")))?;
            Ok(json!([a, b]))
        })
        .collect::<Result<_>>()?;
    let pre = g.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(tok.to_string(), json!(id));
        if *ty == TOKEN_CONTROL || *ty == TOKEN_USER_DEFINED {
            added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": *ty == TOKEN_CONTROL}));
        }
    }
    if vocab.len() != tokens.len() {
        return Err(Error::Model(format!("gguf: vocabulary has duplicate tokens ({} unique of {})", vocab.len(), tokens.len())));
    }
    let special = |key: &str| -> Option<(u32, String)> {
        let id = g.get(key).and_then(MetadataValue::as_u64)? as usize;
        tokens.get(id).map(|t| (id as u32, t.to_string()))
    };
    let sp = SpecialTokens {
        bos: special("tokenizer.ggml.bos_token_id"),
        eos: special("tokenizer.ggml.eos_token_id"),
        pad: special("tokenizer.ggml.padding_token_id"),
        unk: special("tokenizer.ggml.unknown_token_id"),
    };
    let n_merges = merges.len();
    let tj = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer_json(pre)?,
        // No post-processor: no BOS/EOS is added automatically (the chat template adds what it needs).
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges}
    });
    Ok((tj, sp, tokens.len(), n_merges))
}

fn write_json(dir: &Path, name: &str, v: &Value) -> Result<()> {
    let p = dir.join(name);
    let s = serde_json::to_string_pretty(v)?;
    std::fs::write(&p, s).map_err(|e| Error::io("write", p, e))
}

/// Imports a GGUF file into an HF-style directory `out` (written to a sibling temp dir, then renamed).
///
/// `out` must not exist or be an empty directory. `progress` is called after each tensor with
/// (tensors done, tensors total).
///
/// # Errors
/// [`Error::Model`] for an unsupported architecture, tokenizer, tensor type or tensor name;
/// [`Error::Config`] when `out` exists and is not empty; [`Error::Io`] for file-system failures.
pub fn import_gguf(gguf_path: &Path, out: &Path, dtype: ImportDtype, progress: &mut dyn FnMut(usize, usize)) -> Result<ImportSummary> {
    if out.exists() {
        let empty = std::fs::read_dir(out).map_err(|e| Error::io("read_dir", out, e))?.next().is_none();
        if !empty {
            return Err(crate::config_err!("output directory {} exists and is not empty", out.display()));
        }
    }
    let g = GgufFile::open(gguf_path)?;
    let hp = Hparams::read(&g)?;
    let (tok_json, sp, vocab_size, n_merges) = tokenizer_json(&g)?;

    // Plan every tensor first so all errors surface before anything is written.
    let mut planned = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let Some(name) = hf_tensor_name(&t.name)? else { continue };
        let shape = t.torch_shape();
        let unpermute_heads = if hp.arch == "llama" {
            if name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.q_proj.bias") {
                Some(hp.n_heads)
            } else if name.ends_with("self_attn.k_proj.weight") || name.ends_with("self_attn.k_proj.bias") {
                Some(hp.n_kv_heads)
            } else {
                None
            }
        } else {
            None
        };
        if let Some(h) = unpermute_heads {
            let rows = shape.first().copied().unwrap_or(0);
            if rows != h * hp.head_dim || hp.head_dim % 2 != 0 {
                return Err(Error::Model(format!("gguf: {} has {rows} rows, expected {h} heads × {}", t.name, hp.head_dim)));
            }
        }
        g.tensor_bytes(t)?;
        planned.push((name, LazyTensor { gguf: &g, info: t, shape, unpermute_heads, dtype, failure: Default::default() }));
    }
    let tied = !planned.iter().any(|(n, _)| n == "lm_head.weight");
    if !planned.iter().any(|(n, _)| n == "model.embed_tokens.weight") {
        return Err(Error::Model("gguf: no token_embd.weight tensor".into()));
    }
    let expect_layers = planned.iter().filter(|(n, _)| n.ends_with("input_layernorm.weight")).count();
    if expect_layers != hp.n_layers {
        return Err(Error::Model(format!("gguf: block_count {} but {expect_layers} layers of tensors", hp.n_layers)));
    }
    let has_qkv_bias = planned.iter().any(|(n, _)| n.ends_with("q_proj.bias"));
    let parameters: u64 = planned.iter().map(|(_, t)| t.info.n_elements()).sum();
    let n_tensors = planned.len();

    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io("create_dir_all", parent, e))?;
    let file_name = out.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    let tmp = parent.join(format!(".{file_name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io("remove_dir_all", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("create_dir", &tmp, e))?;
    let result = (|| -> Result<()> {
        // Weights, one tensor decoded at a time.
        let mut done = 0usize;
        let views = planned.iter().map(|(n, t)| {
            done += 1;
            progress(done, n_tensors);
            (n.clone(), t)
        });
        let st = tmp.join("model.safetensors");
        let mut info = HashMap::new();
        info.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(info), &st).map_err(|e| Error::Model(format!("safetensors write {}: {e}", st.display())))?;
        // The writer creates the file owner-only; a model directory is meant to be shared.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&st, std::fs::Permissions::from_mode(0o644)).map_err(|e| Error::io("chmod", &st, e))?;
        }

        let (model_type, class) = match hp.arch.as_str() {
            "qwen2" => ("qwen2", "Qwen2ForCausalLM"),
            "qwen3" => ("qwen3", "Qwen3ForCausalLM"),
            _ => ("llama", "LlamaForCausalLM"),
        };
        let id = |t: &Option<(u32, String)>| t.as_ref().map(|(i, _)| json!(i)).unwrap_or(Value::Null);
        let text = |t: &Option<(u32, String)>| t.as_ref().map(|(_, s)| json!(s)).unwrap_or(Value::Null);
        let pad = if sp.pad.is_some() { &sp.pad } else { &sp.eos };
        let mut config = json!({
            "architectures": [class],
            "model_type": model_type,
            "hidden_size": hp.hidden,
            "intermediate_size": hp.ffn,
            "num_hidden_layers": hp.n_layers,
            "num_attention_heads": hp.n_heads,
            "num_key_value_heads": hp.n_kv_heads,
            "head_dim": hp.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": hp.rms_eps,
            "rope_theta": hp.rope_theta,
            "rope_scaling": null,
            "vocab_size": vocab_size,
            "max_position_embeddings": hp.context,
            "tie_word_embeddings": tied,
            "bos_token_id": id(&sp.bos),
            "eos_token_id": id(&sp.eos),
            "pad_token_id": id(pad),
            "torch_dtype": dtype.torch_name(),
            "initializer_range": 0.02,
            "use_cache": true,
            "attention_dropout": 0.0,
        });
        if let Some(m) = config.as_object_mut() {
            match hp.arch.as_str() {
                "llama" => {
                    m.insert("attention_bias".into(), json!(has_qkv_bias));
                    m.insert("mlp_bias".into(), json!(false));
                }
                "qwen2" => {
                    m.insert("use_sliding_window".into(), json!(false));
                    m.insert("sliding_window".into(), json!(hp.context));
                    m.insert("max_window_layers".into(), json!(hp.n_layers));
                }
                _ => {
                    m.insert("attention_bias".into(), json!(has_qkv_bias));
                    m.insert("use_sliding_window".into(), json!(false));
                }
            }
        }
        write_json(&tmp, "config.json", &config)?;
        write_json(&tmp, "generation_config.json", &json!({"bos_token_id": id(&sp.bos), "eos_token_id": id(&sp.eos), "pad_token_id": id(pad)}))?;
        write_json(&tmp, "tokenizer.json", &tok_json)?;
        let chat_template = g.get("tokenizer.chat_template").and_then(|v| v.as_str());
        write_json(
            &tmp,
            "tokenizer_config.json",
            &json!({
                "tokenizer_class": "GPT2Tokenizer",
                "add_bos_token": false,
                "add_eos_token": false,
                "add_prefix_space": false,
                "clean_up_tokenization_spaces": false,
                "model_max_length": hp.context,
                "bos_token": text(&sp.bos),
                "eos_token": text(&sp.eos),
                "pad_token": text(pad),
                "unk_token": text(&sp.unk),
                "chat_template": chat_template,
            }),
        )?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // A decode failure that the lazy writer could only record (see `LazyTensor::data`).
    if let Some((name, msg)) = planned.iter().find_map(|(n, t)| t.failure.borrow().clone().map(|m| (n.clone(), m))) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(Error::Internal(format!("tensor {name} failed to decode after planning: {msg}")));
    }
    if out.exists() {
        std::fs::remove_dir(out).map_err(|e| Error::io("remove_dir", out, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| Error::io("rename", &tmp, e))?;
    Ok(ImportSummary {
        out_dir: out.to_path_buf(),
        architecture: hp.arch,
        tensors: n_tensors,
        parameters,
        vocab_size,
        merges: n_merges,
        tied_embeddings: tied,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // 2 heads, head_dim 4, 1 column. HF rows [0..8); llama.cpp stores head h as rows
        // h·4 + [0, 2, 1, 3] (pairs (j, j + hd/2) interleaved): GGUF = [0, 2, 1, 3, 4, 6, 5, 7].
        let gguf = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        let hf = unpermute_rows(&gguf, 2, 1).unwrap();
        assert_eq!(hf, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        // With 2 columns the rows move as units.
        let gguf2: Vec<f32> = [0.0, 2.0, 1.0, 3.0].iter().flat_map(|&r| [r * 10.0, r * 10.0 + 1.0]).collect();
        assert_eq!(unpermute_rows(&gguf2, 1, 2).unwrap(), vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]);
        assert!(unpermute_rows(&[0.0; 6], 2, 1).is_err()); // head_dim 3 is odd
    }

    #[test]
    fn tensor_names_map_to_hf() {
        assert_eq!(hf_tensor_name("token_embd.weight").unwrap().as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_tensor_name("blk.12.attn_q.bias").unwrap().as_deref(), Some("model.layers.12.self_attn.q_proj.bias"));
        assert_eq!(hf_tensor_name("blk.0.ffn_down.weight").unwrap().as_deref(), Some("model.layers.0.mlp.down_proj.weight"));
        assert_eq!(hf_tensor_name("blk.3.attn_k_norm.weight").unwrap().as_deref(), Some("model.layers.3.self_attn.k_norm.weight"));
        assert!(hf_tensor_name("blk.x.attn_q.weight").is_err());
        assert!(hf_tensor_name("blk.0.mystery.weight").is_err());
        assert!(hf_tensor_name("rope_freqs.weight").is_err());
    }

    #[test]
    fn smollm_pre_tokenizer_splits_digits() {
        let pre = pre_tokenizer_json("smollm").unwrap();
        assert_eq!(pre["pretokenizers"][0]["type"], "Digits");
        assert_eq!(pre["pretokenizers"][0]["individual_digits"], true);
        assert!(pre_tokenizer_json("mystery").is_err());
    }

    #[test]
    fn tidies_f32_metadata() {
        assert_eq!(tidy_f32(1e-5f32 as f64), 1e-5);
        assert_eq!(tidy_f32(100000.0), 100000.0);
    }
}
