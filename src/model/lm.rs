//! [`LanguageModel`]: a transformer with its tokenizer and chat template, loaded from an HF directory
//! (imported from GGUF or a real checkpoint) or from a trainer checkpoint.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::ModelConfig;
use super::generate::{self, Generation, GenerationRequest, SamplingParams, TokenEvent};
use super::peft;
use super::score::{self, PackedBatch, ResponseLogits, ScoredResponse};
use super::tokenizer::{ChatTemplate, TextTokenizer};
use super::transformer::{LoadOptions, Trainable, Transformer};
use super::weights;
use crate::schema::Message;
use crate::{Error, Result};

/// Files of an HF model directory besides the weights, copied into saved checkpoints.
const SIDE_FILES: [&str; 5] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "special_tokens_map.json"];
/// Adapter weights file of a LoRA checkpoint: PEFT's `adapter_model.safetensors` (see [`peft`]).
pub const ADAPTER_WEIGHTS: &str = peft::WEIGHTS_FILE;
/// Adapter configuration file of a LoRA checkpoint: PEFT's `adapter_config.json`.
pub const ADAPTER_CONFIG: &str = peft::CONFIG_FILE;

/// A causal LM ready for generation, scoring and training.
pub struct LanguageModel {
    transformer: Transformer,
    /// Shared with the other models of the process loaded from the same files
    /// ([`TextTokenizer::shared_from_dir`]).
    tokenizer: std::sync::Arc<TextTokenizer>,
    chat: Option<ChatTemplate>,
    /// Directory holding config.json and the tokenizer files.
    dir: PathBuf,
    eos_ids: Vec<u32>,
    pad_id: u32,
}

impl std::fmt::Debug for LanguageModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LanguageModel").field("dir", &self.dir).field("transformer", &self.transformer).field("eos_ids", &self.eos_ids).finish()
    }
}

/// EOS ids from config.json, generation_config.json and tokenizer_config.json's `eos_token`.
fn collect_eos(dir: &Path, config: &ModelConfig, tok: &TextTokenizer) -> Vec<u32> {
    let mut ids = config.eos_token_ids.clone();
    let read = |name: &str| -> Option<Value> { serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok() };
    if let Some(g) = read("generation_config.json") {
        match g.get("eos_token_id") {
            Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
            Some(Value::Array(a)) => ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
            _ => {}
        }
    }
    if let Some(t) = read("tokenizer_config.json") {
        let s = match t.get("eos_token") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
            _ => None,
        };
        ids.extend(s.and_then(|s| tok.token_to_id(&s)));
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|i| seen.insert(*i));
    ids
}

impl LanguageModel {
    /// Loads an HF directory: `config.json`, `model.safetensors` (or sharded with an index),
    /// `tokenizer.json`, and `tokenizer_config.json` for the chat template. Frozen and LoRA loads
    /// share their base weights with every other live model of the process loaded from the same files
    /// with the same kind and device (one copy in memory, [`weights::read_checkpoint_shared`]); full
    /// fine-tuning loads its own copy. Every load shares the tokenizer of the same `tokenizer.json`
    /// ([`TextTokenizer::shared_from_dir`]).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Model`] for missing or invalid files, [`Error::Torch`] for device
    /// failures.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<LanguageModel> {
        Self::load_parts(dir, dir, opts)
    }

    /// Loads weights from `weights_dir` and config/tokenizer from `meta_dir`.
    fn load_parts(weights_dir: &Path, meta_dir: &Path, opts: &LoadOptions) -> Result<LanguageModel> {
        let config = ModelConfig::from_dir(meta_dir)?;
        let tokenizer = TextTokenizer::shared_from_dir(meta_dir)?;
        let chat = ChatTemplate::from_dir(meta_dir)?;
        let eos_ids = collect_eos(meta_dir, &config, &tokenizer);
        let pad_id = config.pad_token_id.or(eos_ids.first().copied()).unwrap_or(0);
        // Frozen and LoRA models never write their base weights: they share one copy per process.
        let transformer = if matches!(opts.trainable, Trainable::Full) {
            Transformer::from_weights(config, weights::read_checkpoint(weights_dir)?, opts)?
        } else {
            let (w, shared) = weights::read_checkpoint_shared(weights_dir, opts.dtype, opts.device)?;
            let mut t = Transformer::from_weights(config, w, opts)?;
            t.share_base(shared);
            t
        };
        Ok(LanguageModel { transformer, tokenizer, chat, dir: meta_dir.to_path_buf(), eos_ids, pad_id })
    }

    /// Loads a checkpoint directory written by [`LanguageModel::save_full`] (full `model.safetensors`)
    /// or [`LanguageModel::save_adapters`] (a LoRA adapter in PEFT's layout, `adapter_model.safetensors`
    /// and `adapter_config.json`, or an older checkpoint's `adapter.safetensors` and the same config,
    /// on top of the base model: `base`, else the adapter config's `base_model_name_or_path`). Files the
    /// checkpoint lacks (config, tokenizer) come from `base`. With [`Trainable::Frozen`] options an
    /// adapter checkpoint keeps its adapters attached (call [`Transformer::merge_lora`] to fold them).
    ///
    /// # Errors
    /// [`Error::Config`] when an adapter checkpoint names no base; else as [`LanguageModel::load`].
    pub fn load_checkpoint(dir: &Path, base: Option<&Path>, opts: &LoadOptions) -> Result<LanguageModel> {
        let adapter_cfg = dir.join(ADAPTER_CONFIG);
        if adapter_cfg.is_file() {
            let (lora, v) = peft::read_adapter_config(dir)?;
            let base_dir: PathBuf = match base {
                Some(b) => b.to_path_buf(),
                None => v
                    .get("base_model_name_or_path")
                    .and_then(|b| b.as_str())
                    .map(PathBuf::from)
                    .ok_or_else(|| crate::config_err!("{}: no base_model_name_or_path and no base model given", adapter_cfg.display()))?,
            };
            let base_opts = LoadOptions { trainable: Trainable::Lora(lora.clone()), ..opts.clone() };
            let mut m = Self::load(&base_dir, &base_opts)?;
            if let Trainable::Lora(want) = &opts.trainable {
                if want != &lora {
                    return Err(crate::config_err!("checkpoint LoRA {lora:?} differs from the requested {want:?}"));
                }
            }
            m.load_adapters(dir)?;
            if opts.trainable == Trainable::Frozen {
                for mut t in m.transformer.trainable_variables() {
                    let _ = t.f_requires_grad_(false)?;
                }
            }
            return Ok(m);
        }
        let meta = if dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file() {
            dir
        } else {
            base.ok_or_else(|| crate::config_err!("{} has no config.json/tokenizer.json and no base model was given", dir.display()))?
        };
        Self::load_parts(dir, meta, opts)
    }

    /// Copies adapter weights from `dir` into the attached adapters: PEFT's `adapter_model.safetensors`
    /// (keys `base_model.model.<module>.lora_{A,B}.weight`), else an older checkpoint's
    /// `adapter.safetensors` (bare module names); see [`peft::read_adapter_weights`].
    ///
    /// # Errors
    /// [`Error::Config`] when no adapters are attached; [`Error::Model`] when `dir` has neither file, or
    /// the file lacks an adapter tensor, has one the model does not, or one of another shape.
    pub fn load_adapters(&mut self, dir: &Path) -> Result<()> {
        if self.transformer.lora().is_none() {
            return Err(crate::config_err!("the model has no LoRA adapters attached"));
        }
        let tensors = peft::read_adapter_weights(dir)?;
        self.transformer.copy_weights(tensors, true)?;
        Ok(())
    }

    /// Writes the adapters in PEFT's layout ([`peft::write_adapter`]): `dir/adapter_model.safetensors`
    /// (A `[r, in]`, B `[out, r]`, the model's dtype) and `dir/adapter_config.json`, whose
    /// `base_model_name_or_path` is this model's directory (canonical path). vLLM, SGLang and
    /// `peft.PeftModel.from_pretrained` load the folder as is.
    ///
    /// # Errors
    /// [`Error::Config`] when no adapters are attached; [`Error::Io`] / [`Error::Model`] on write
    /// failures.
    pub fn save_adapters(&self, dir: &Path) -> Result<()> {
        let lora = self.transformer.lora().ok_or_else(|| crate::config_err!("the model has no LoRA adapters to save"))?;
        let base = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        peft::write_adapter(dir, &self.transformer.adapter_state(), lora, Some(&base.to_string_lossy()))
    }

    /// Writes a complete HF directory: `model.safetensors` (adapters merged in, the model's dtype),
    /// then the tokenizer files and `config.json` (with `torch_dtype` updated) copied from this model's
    /// directory. Each file is written atomically; `config.json` last.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Model`] on write failures.
    pub fn save_full(&mut self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create_dir_all", dir, e))?;
        let state = self.transformer.full_state()?;
        weights::write_safetensors(&dir.join("model.safetensors"), &state)?;
        for f in SIDE_FILES {
            let src = self.dir.join(f);
            if src.is_file() && std::fs::canonicalize(&src).ok() != std::fs::canonicalize(dir.join(f)).ok() {
                let bytes = std::fs::read(&src).map_err(|e| Error::io("read", &src, e))?;
                write_atomic(&dir.join(f), &bytes)?;
            }
        }
        let cfg_path = self.dir.join("config.json");
        let s = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io("read", &cfg_path, e))?;
        let mut cfg: Value = serde_json::from_str(&s)?;
        if let Some(o) = cfg.as_object_mut() {
            let name = match self.transformer.dtype() {
                tch::Kind::Half => "float16",
                tch::Kind::BFloat16 => "bfloat16",
                _ => "float32",
            };
            o.insert("torch_dtype".into(), Value::String(name.into()));
        }
        write_atomic(&dir.join("config.json"), serde_json::to_string_pretty(&cfg)?.as_bytes())
    }

    /// The transformer.
    pub fn transformer(&self) -> &Transformer {
        &self.transformer
    }

    /// The transformer, mutably (attach or merge LoRA).
    pub fn transformer_mut(&mut self) -> &mut Transformer {
        &mut self.transformer
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// The directory config and tokenizer were read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids that end generation by default.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Padding id used when packing batches.
    pub fn pad_token_id(&self) -> u32 {
        self.pad_id
    }

    /// Token ids of plain text (no special tokens added).
    ///
    /// # Errors
    /// [`Error::Model`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text)
    }

    /// Text of token ids (special tokens dropped when `skip_special`).
    ///
    /// # Errors
    /// [`Error::Model`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer.decode(ids, skip_special)
    }

    /// Renders messages with the model's chat template (see [`ChatTemplate::render`]).
    ///
    /// # Errors
    /// [`Error::Model`] when the model has no chat template; [`Error::InvalidInput`] when the template
    /// rejects the messages.
    pub fn render_chat(&self, messages: &[Message], tools: Option<&Value>, add_generation_prompt: bool) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| Error::Model(format!("{} has no chat template", self.dir.display())))?;
        chat.render(messages, tools, add_generation_prompt, None)
    }

    /// Token ids of a rendered chat prompt.
    ///
    /// # Errors
    /// As [`LanguageModel::render_chat`] and [`LanguageModel::encode`].
    pub fn chat_prompt_ids(&self, messages: &[Message], tools: Option<&Value>, add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.encode(&self.render_chat(messages, tools, add_generation_prompt)?)
    }

    /// Generates one continuation per prompt with the same parameters (see [`generate::generate`]).
    ///
    /// # Errors
    /// As [`generate::generate`].
    pub fn generate(&self, prompts: &[Vec<u32>], params: &SamplingParams) -> Result<Vec<Generation>> {
        let reqs: Vec<GenerationRequest> = prompts.iter().map(|p| GenerationRequest { prompt_ids: p.clone(), params: params.clone() }).collect();
        self.generate_stream(&reqs, &mut |_| true)
    }

    /// Generates with per-request parameters, reporting each token to `on_event` (return `false` to
    /// cancel that request).
    ///
    /// # Errors
    /// As [`generate::generate`].
    pub fn generate_stream(&self, requests: &[GenerationRequest], on_event: &mut dyn FnMut(&TokenEvent<'_>) -> bool) -> Result<Vec<Generation>> {
        generate::generate(&self.transformer, &self.tokenizer, &self.eos_ids, requests, on_event)
    }

    /// An empty continuous-batching [`Decoder`] over this model (its EOS ids end requests that set no
    /// stop ids): admit requests between steps.
    pub fn decoder(&self) -> generate::Decoder<'_> {
        generate::Decoder::new(&self.transformer, &self.tokenizer, &self.eos_ids)
    }

    /// Packs (prompt, response) pairs for [`LanguageModel::response_logprobs`].
    ///
    /// # Errors
    /// As [`PackedBatch::new`].
    pub fn pack(&self, items: &[(&[u32], &[u32])]) -> Result<PackedBatch> {
        PackedBatch::new(items, self.pad_id, self.transformer.config.vocab_size, self.transformer.device())
    }

    /// Differentiable per-token response log-probs (see [`score::response_logprobs`]).
    ///
    /// # Errors
    /// As [`score::response_logprobs`].
    pub fn response_logprobs(&self, batch: &PackedBatch) -> Result<ResponseLogits> {
        score::response_logprobs(&self.transformer, batch)
    }

    /// Scores responses without gradients (see [`score::score`]).
    ///
    /// # Errors
    /// As [`score::score`].
    pub fn score(&self, items: &[(Vec<u32>, Vec<u32>)], top_k: usize) -> Result<Vec<ScoredResponse>> {
        score::score(&self.transformer, items, top_k, self.pad_id)
    }

    /// Scores responses and gathers the log-probs at given ids per position (see [`score::score_at`]).
    ///
    /// # Errors
    /// As [`score::score_at`].
    pub fn score_at(&self, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, at: &[Vec<Vec<u32>>]) -> Result<Vec<ScoredResponse>> {
        score::score_at(&self.transformer, items, top_k, at, self.pad_id)
    }

    /// Scores responses at a temperature (see [`score::score_at_temperature`]; `at` may be empty).
    ///
    /// # Errors
    /// As [`score::score_at_temperature`].
    pub fn score_at_temperature(&self, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, at: &[Vec<Vec<u32>>], temperature: f64) -> Result<Vec<ScoredResponse>> {
        score::score_at_temperature(&self.transformer, items, top_k, at, self.pad_id, temperature)
    }

    /// [`LanguageModel::score`] with each response token's whole-vocabulary rank
    /// ([`ScoredResponse::ranks`]).
    ///
    /// # Errors
    /// As [`score::score_ranked`].
    pub fn score_ranked(&self, items: &[(Vec<u32>, Vec<u32>)], top_k: usize) -> Result<Vec<ScoredResponse>> {
        score::score_ranked(&self.transformer, items, top_k, self.pad_id)
    }
}

/// Writes a file through a temp file in the same folder and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let file_name = path.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("rename", &tmp, e))
}
