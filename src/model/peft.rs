//! LoRA adapters in Hugging Face PEFT's on-disk layout, the one vLLM (`--enable-lora`, `lora_path`),
//! SGLang and `peft.PeftModel.from_pretrained` load:
//!
//! ```text
//! <dir>/
//!   adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in_features]
//!                              base_model.model.<module>.lora_B.weight  [out_features, r]
//!                              (<module> as in the base model, e.g. model.layers.0.self_attn.q_proj;
//!                              the model's dtype; `{"format": "pt"}` metadata)
//!   adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules, ...
//! ```
//!
//! PEFT's `get_peft_model_state_dict` (used by `save_pretrained`) names a tensor by its path in a
//! `PeftModelForCausalLM` (`base_model` = the `LoraModel`, whose `model` is the HF causal LM) with the
//! adapter name (`.default`) removed; the update is `scale · B·A` with `scale = lora_alpha / r`, or
//! `lora_alpha / sqrt(r)` under `use_rslora` (PEFT `LoraLayer.update_layer`, vLLM `PEFTHelper`).
//!
//! Older nextstate checkpoints hold `adapter.safetensors` with the bare module names
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`) beside the same `adapter_config.json`;
//! [`read_adapter_weights`] reads both layouts.
//!
//! The LoRA hyper-parameters themselves ([`LoraConfig`], the projections a [`LoraTarget`] names) are
//! defined here, as the content of `adapter_config.json`; the transformer attaches adapters by them.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::Tensor;

use super::weights;
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
    /// All seven projections (the docs/method.md §6 default).
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
    /// the module docs): `peft_type` `LORA`, `task_type` `CAUSAL_LM`, `r`, `lora_alpha` (an integer when
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
            "lora_alpha": alpha_json(self.alpha),
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
            Some(serde_json::Value::String(s)) => targets_of_string(s)?,
            _ => LoraTarget::ALL.to_vec(),
        };
        Ok(LoraConfig { rank, alpha, targets })
    }
}

/// PEFT's adapter weights file (`peft.utils.SAFETENSORS_WEIGHTS_NAME`).
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The adapter weights file of checkpoints written before the PEFT layout (bare module names).
pub const LEGACY_WEIGHTS_FILE: &str = "adapter.safetensors";
/// PEFT's adapter configuration file (`peft.utils.CONFIG_NAME`).
pub const CONFIG_FILE: &str = "adapter_config.json";
/// Prefix of every key in PEFT's weights file: the path of the HF model inside a `PeftModel`.
pub const KEY_PREFIX: &str = "base_model.model.";

/// Which adapter layout a folder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterLayout {
    /// [`WEIGHTS_FILE`] with [`KEY_PREFIX`]ed keys.
    Peft,
    /// [`LEGACY_WEIGHTS_FILE`] with bare module names.
    Legacy,
}

/// The PEFT key of a model tensor name: `model.layers.0.self_attn.q_proj.lora_A.weight` →
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
pub fn peft_key(name: &str) -> String {
    format!("{KEY_PREFIX}{name}")
}

/// The model tensor name of a key of either layout: drops [`KEY_PREFIX`] and an adapter name
/// `default` (`lora_A.default.weight`, as in a PEFT model's own `state_dict`).
pub fn model_name(key: &str) -> String {
    let name = key.strip_prefix(KEY_PREFIX).unwrap_or(key);
    name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
}

/// The adapter weights file in `dir` and its layout: [`WEIGHTS_FILE`] when present, else
/// [`LEGACY_WEIGHTS_FILE`].
///
/// # Errors
/// [`Error::Model`] when `dir` holds neither.
pub fn adapter_weights_file(dir: &Path) -> Result<(PathBuf, AdapterLayout)> {
    let peft = dir.join(WEIGHTS_FILE);
    if peft.is_file() {
        return Ok((peft, AdapterLayout::Peft));
    }
    let legacy = dir.join(LEGACY_WEIGHTS_FILE);
    if legacy.is_file() {
        return Ok((legacy, AdapterLayout::Legacy));
    }
    Err(Error::Model(format!("{}: no adapter weights ({WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE})", dir.display())))
}

/// Reads the adapter tensors of `dir` (either layout) onto the CPU in the file's dtype, under the
/// model's tensor names ([`model_name`]), sorted by name.
///
/// # Errors
/// As [`adapter_weights_file`] and [`weights::read_safetensors`].
pub fn read_adapter_weights(dir: &Path) -> Result<Vec<(String, Tensor)>> {
    let (file, _) = adapter_weights_file(dir)?;
    let mut out: Vec<(String, Tensor)> = weights::read_safetensors(&file)?.into_iter().map(|(k, t)| (model_name(&k), t)).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Reads and parses `dir/adapter_config.json` (see [`LoraConfig::from_json`]); also returns the raw
/// JSON (for `base_model_name_or_path`).
///
/// # Errors
/// [`Error::Io`] when unreadable, [`Error::Json`] when malformed, [`Error::Config`] as
/// [`LoraConfig::from_json`].
pub fn read_adapter_config(dir: &Path) -> Result<(LoraConfig, Value)> {
    let path = dir.join(CONFIG_FILE);
    let s = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
    let v: Value = serde_json::from_str(&s)?;
    let cfg = LoraConfig::from_json(&v).map_err(|e| crate::config_err!("{}: {e}", path.display()))?;
    Ok((cfg, v))
}

/// Writes `dir/adapter_model.safetensors` (each `(name, tensor)` of `adapters` under [`peft_key`],
/// dtype as given) and then `dir/adapter_config.json` ([`LoraConfig::to_json`] with `base_model`),
/// each atomically; the config last, since its presence marks an adapter folder.
///
/// # Errors
/// [`Error::Model`] when a name is not a LoRA tensor (`<module>.lora_A.weight` / `.lora_B.weight`) or
/// on a writer failure; [`Error::Io`] on a file-system failure.
pub fn write_adapter(dir: &Path, adapters: &[(String, Tensor)], cfg: &LoraConfig, base_model: Option<&str>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create_dir_all", dir, e))?;
    let mut keyed = Vec::with_capacity(adapters.len());
    for (name, t) in adapters {
        if !(name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")) {
            return Err(Error::Model(format!("{name} is not a LoRA adapter tensor (<module>.lora_A.weight or .lora_B.weight)")));
        }
        keyed.push((peft_key(name), t.shallow_clone()));
    }
    weights::write_safetensors(&dir.join(WEIGHTS_FILE), &keyed)?;
    let path = dir.join(CONFIG_FILE);
    let tmp = dir.join(format!(".{CONFIG_FILE}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string_pretty(&cfg.to_json(base_model))?).map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename", &tmp, e))
}

/// `lora_alpha` as PEFT writes it: an integer when α is whole (PEFT and vLLM type it `int`).
fn alpha_json(alpha: f64) -> Value {
    if alpha.fract() == 0.0 && alpha.abs() < 9.0e15 {
        Value::from(alpha as i64)
    } else {
        Value::from(alpha)
    }
}

/// The seven projections a `target_modules` string names: PEFT's `all-linear` (every linear layer but
/// the output head, i.e. all seven here) or one module name.
fn targets_of_string(s: &str) -> Result<Vec<LoraTarget>> {
    if s == "all-linear" {
        return Ok(LoraTarget::ALL.to_vec());
    }
    LoraTarget::parse(s).map(|t| vec![t]).map_err(|_| crate::config_err!("target_modules {s:?}: only a list of projection names or \"all-linear\" is supported (no regular expressions)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn cfg() -> LoraConfig {
        LoraConfig { rank: 2, alpha: 6.0, targets: vec![LoraTarget::Q, LoraTarget::Down] }
    }

    #[test]
    fn keys_follow_peft_in_both_directions() {
        let name = "model.layers.3.mlp.down_proj.lora_B.weight";
        assert_eq!(peft_key(name), "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight");
        assert_eq!(model_name(&peft_key(name)), name);
        assert_eq!(model_name(name), name, "legacy names pass through");
        assert_eq!(model_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"), "model.layers.0.self_attn.q_proj.lora_A.weight");
    }

    #[test]
    fn config_round_trips_and_foreign_peft_configs_are_read_or_refused() {
        let json = cfg().to_json(None);
        assert_eq!(LoraConfig::from_json(&json).unwrap(), cfg());
        assert_eq!((json["lora_alpha"].clone(), json["use_rslora"].clone()), (serde_json::json!(6), serde_json::json!(false)));
        assert_eq!(LoraConfig { alpha: 2.5, ..cfg() }.to_json(None)["lora_alpha"], serde_json::json!(2.5));
        let with = |k: &str, v: Value| {
            let mut j = json.clone();
            j[k] = v;
            LoraConfig::from_json(&j)
        };
        // rsLoRA: PEFT scales by α / sqrt(r); folded into α so that α / r is that scale.
        let rs = with("use_rslora", Value::Bool(true)).unwrap();
        assert!((rs.scale() - 6.0 / 2f64.sqrt()).abs() < 1e-12, "{}", rs.scale());
        assert_eq!(with("target_modules", serde_json::json!("all-linear")).unwrap().targets, LoraTarget::ALL.to_vec());
        assert_eq!(with("target_modules", serde_json::json!("q_proj")).unwrap().targets, vec![LoraTarget::Q]);
        for (k, v) in [
            ("target_modules", serde_json::json!(".*attn.*")),
            ("bias", serde_json::json!("lora_only")),
            ("use_dora", Value::Bool(true)),
            ("fan_in_fan_out", Value::Bool(true)),
            ("modules_to_save", serde_json::json!(["lm_head"])),
            ("layers_to_transform", serde_json::json!([0, 1])),
            ("rank_pattern", serde_json::json!({"q_proj": 4})),
            ("peft_type", serde_json::json!("IA3")),
            ("r", serde_json::json!(0)),
        ] {
            assert!(matches!(with(k, v.clone()), Err(Error::Config(_))), "{k} = {v} must be refused");
        }
    }

    #[test]
    fn writes_peft_layout_and_reads_both_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]).to_kind(Kind::BFloat16);
        let b = Tensor::from_slice(&[0.5f32, -0.5, 0.25, -0.25]).view([2, 2]).to_kind(Kind::BFloat16);
        let adapters = vec![("model.layers.0.self_attn.q_proj.lora_A.weight".to_string(), a.shallow_clone()), ("model.layers.0.self_attn.q_proj.lora_B.weight".to_string(), b.shallow_clone())];
        write_adapter(dir.path(), &adapters, &cfg(), Some("/models/base")).unwrap();
        assert_eq!(adapter_weights_file(dir.path()).unwrap(), (dir.path().join(WEIGHTS_FILE), AdapterLayout::Peft));
        let raw = Tensor::read_safetensors(dir.path().join(WEIGHTS_FILE)).unwrap();
        let mut keys: Vec<(String, Vec<i64>, Kind)> = raw.iter().map(|(k, t)| (k.clone(), t.size(), t.kind())).collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            keys,
            vec![
                ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string(), vec![2, 3], Kind::BFloat16),
                ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight".to_string(), vec![2, 2], Kind::BFloat16),
            ]
        );
        let (read_cfg, raw_cfg) = read_adapter_config(dir.path()).unwrap();
        assert_eq!(read_cfg, cfg());
        assert_eq!(raw_cfg["base_model_name_or_path"], "/models/base");
        assert_eq!(raw_cfg["lora_alpha"], serde_json::json!(6));
        let back = read_adapter_weights(dir.path()).unwrap();
        assert_eq!(back.len(), 2);
        for ((n1, t1), (n2, t2)) in adapters.iter().zip(&back) {
            assert_eq!(n1, n2);
            assert!(t1.equal(t2), "{n1} differs after the round trip");
        }
        // The legacy layout: bare names in adapter.safetensors.
        let old = tempfile::tempdir().unwrap();
        weights::write_safetensors(&old.path().join(LEGACY_WEIGHTS_FILE), &adapters).unwrap();
        assert_eq!(adapter_weights_file(old.path()).unwrap().1, AdapterLayout::Legacy);
        let legacy = read_adapter_weights(old.path()).unwrap();
        assert!(legacy.iter().zip(&back).all(|((n1, t1), (n2, t2))| n1 == n2 && t1.equal(t2)));
        // Neither file: an error naming both.
        let empty = tempfile::tempdir().unwrap();
        let e = read_adapter_weights(empty.path()).unwrap_err().to_string();
        assert!(e.contains(WEIGHTS_FILE) && e.contains(LEGACY_WEIGHTS_FILE), "{e}");
        // Only adapter tensors are written.
        assert!(write_adapter(empty.path(), &[("model.norm.weight".into(), a)], &cfg(), None).is_err());
    }
}
