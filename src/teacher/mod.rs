//! The teacher of on-policy distillation (docs/method.md §4), apart from the stage that runs it: its
//! configuration (`[teacher]`: [`TeacherConfig`], [`TeacherBackend`]), the identity of its rows
//! ([`teacher_row_id`], [`weights_identity`]), the token ids it scores ([`tokens`]) and the client of a
//! remote teacher server ([`remote`]). Nothing here touches the bus; the Kafka wiring is
//! [`crate::stages::teacher`].

pub mod remote;
pub mod tokens;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::schema::content_hash;

/// Where the teacher's log-probs are computed (`[teacher] backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TeacherBackend {
    /// In-process with tch (the default).
    #[default]
    Local,
    /// An SGLang server's native `POST /generate` (input log-probs of a prefill; see [`remote`]).
    Sglang,
    /// A vLLM server's `POST /v1/completions` with `prompt_logprobs` (also `nextstate serve`).
    Vllm,
}

impl TeacherBackend {
    /// `local`, `sglang` or `vllm`.
    pub fn as_str(self) -> &'static str {
        match self {
            TeacherBackend::Local => "local",
            TeacherBackend::Sglang => "sglang",
            TeacherBackend::Vllm => "vllm",
        }
    }

    /// Whether this is the in-process backend (`local`).
    pub(crate) fn is_local(&self) -> bool {
        *self == TeacherBackend::Local
    }
}

/// The `[teacher]` table of a pipeline. The remote-backend keys are left out of the serialised form
/// while at their defaults, so pipelines that do not set them keep their hash.
///
/// ```toml
/// [teacher]
/// backend = "vllm"                 # or "sglang"; default "local"
/// url = "http://10.0.0.5:8000"     # the server's base URL (or the full endpoint path)
/// model = "Qwen/Qwen3-4B"          # the served model id, recorded as teacher_model
/// api_key_env = "TEACHER_API_KEY"  # optional bearer token, read from this variable
/// top_k = 4
/// timeout_s = 120
/// retries = 3
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherConfig {
    /// Where the teacher's log-probs are computed: `local` (default), `sglang` or `vllm`.
    #[serde(skip_serializing_if = "TeacherBackend::is_local")]
    pub backend: TeacherBackend,
    /// Local backend: the teacher model directory; None (default): the policy's initial weights
    /// (`[policy] model`), as in the reference implementation. Remote backends: the model id the
    /// server serves (required; sent to vLLM as `model`, recorded as `teacher_model` and part of the
    /// teacher cache key). The teacher must share the policy's tokenizer either way.
    pub model: Option<PathBuf>,
    /// Remote backends: the server's base URL (e.g. `http://127.0.0.1:30000`) or the full endpoint
    /// (`…/generate` for SGLang, `…/v1/completions` for vLLM). Required for them, refused for `local`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Remote backends: name of the environment variable holding the server's API key (sent as a
    /// bearer token; the key itself is never stored or printed). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Remote backends: limit on one request, seconds (default 120).
    #[serde(skip_serializing_if = "is_default_timeout")]
    pub timeout_s: f64,
    /// Remote backends: retries of a request after a transport error, timeout, 5xx, 408 or 429
    /// (default 3), as the judge's.
    #[serde(skip_serializing_if = "is_default_retries")]
    pub retries: u32,
    /// Remote backends: backoff before retry k = `backoff_base_ms · 2^k` milliseconds, at most 30 s
    /// (default 500).
    #[serde(skip_serializing_if = "is_default_backoff")]
    pub backoff_base_ms: u64,
    /// Keep the teacher's top-K token ids and log-probs per response position (0 = off).
    pub top_k: usize,
    /// Longest prompt + response accepted, in tokens; longer turns are dead-lettered (`too_long`).
    pub max_tokens: usize,
    /// Turns scored per forward pass (local); requests in flight at once (remote). Locally, a pass holds
    /// the turns that have arrived together, padded to one length: the padded shape changes the float
    /// summation order, so the same turn's log-probs may differ in the last bits (below 1e-4 per token)
    /// between runs that batched it differently; 1 gives the same bits every run (the ablations use it).
    pub batch: usize,
    /// Hint candidates per turn, C (1 = the hint stage's chosen hint only, the default). With C > 1
    /// (multi-candidate hints, docs/method.md §3b) every accepted hint vote of a turn, deduplicated and
    /// shortest first, up to C, gets its own teacher context and scoring pass, and one more pass scores
    /// the student (the policy's initial weights on the original prompt) for its top-K ids; each
    /// candidate's row also holds the teacher's log-probs at those ids, and the sample carries them all
    /// (`samples.candidates`) for the trainer's overlap-guided selection (`trainer.opd_loss = overlap`).
    /// Needs `top_k` ≥ 1 (the reference uses K = 4) and a hint stage with `m` ≥ C votes to have C
    /// candidates. Left out of the serialised form when 1, so older pipeline hashes are unchanged.
    #[serde(skip_serializing_if = "is_one")]
    pub candidates: usize,
    /// Temperature of the scored distribution (1): the local teacher's log-probs (and top-K lists) are
    /// the log-softmax of `logits / temperature`. Must equal `trainer.temperature` for methods with a
    /// teacher term, so that `teacher − student` compares one distribution family (checked by the
    /// pipeline); remote backends score at 1 only. Part of the teacher row id when not 1. Left out of
    /// the serialised form when 1.
    #[serde(skip_serializing_if = "is_one_f")]
    pub temperature: f64,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn is_one_f(x: &f64) -> bool {
    *x == 1.0
}

const DEFAULT_TIMEOUT_S: f64 = 120.0;
const DEFAULT_RETRIES: u32 = 3;
const DEFAULT_BACKOFF_MS: u64 = 500;

fn is_default_timeout(x: &f64) -> bool {
    *x == DEFAULT_TIMEOUT_S
}

fn is_default_retries(x: &u32) -> bool {
    *x == DEFAULT_RETRIES
}

fn is_default_backoff(x: &u64) -> bool {
    *x == DEFAULT_BACKOFF_MS
}

/// Most hint candidates per turn (`teacher.candidates`).
pub const MAX_CANDIDATES: usize = 8;

impl Default for TeacherConfig {
    fn default() -> Self {
        TeacherConfig {
            backend: TeacherBackend::Local,
            model: None,
            url: None,
            api_key_env: None,
            timeout_s: DEFAULT_TIMEOUT_S,
            retries: DEFAULT_RETRIES,
            backoff_base_ms: DEFAULT_BACKOFF_MS,
            top_k: 0,
            max_tokens: 8192,
            batch: 4,
            candidates: 1,
            temperature: 1.0,
        }
    }
}

impl TeacherConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key and its value.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_CANDIDATES).contains(&self.candidates) {
            return Err(Error::Config(format!("teacher.candidates = {} must be in 1..={MAX_CANDIDATES}", self.candidates)));
        }
        if self.candidates > 1 && self.top_k == 0 {
            return Err(Error::Config(format!(
                "teacher.candidates = {} needs teacher.top_k >= 1: overlap-guided selection compares top-K ids (the reference uses 4)",
                self.candidates
            )));
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::Config(format!("teacher.temperature = {} must be a positive number", self.temperature)));
        }
        if self.backend.is_local() {
            if let Some(u) = &self.url {
                return Err(Error::Config(format!("teacher.url = {u:?} is only used by a remote teacher.backend (sglang or vllm); backend is \"local\"")));
            }
            return Ok(());
        }
        let backend = self.backend.as_str();
        if self.temperature != 1.0 {
            return Err(Error::Config(format!("teacher.temperature = {} needs teacher.backend = \"local\": the {backend} backend scores at temperature 1", self.temperature)));
        }
        if self.url.as_deref().is_none_or(|u| u.trim().is_empty()) {
            return Err(Error::Config(format!("teacher.backend = \"{backend}\" needs teacher.url (the server's base URL)")));
        }
        if self.remote_model().is_none() {
            return Err(Error::Config(format!("teacher.backend = \"{backend}\" needs teacher.model (the model id the server serves)")));
        }
        if self.candidates > 1 {
            return Err(Error::Config(format!(
                "teacher.candidates = {} needs teacher.backend = \"local\": multi-candidate hints score the teacher at the student's top-K ids, which the {backend} API cannot return for prompt positions",
                self.candidates
            )));
        }
        if !self.timeout_s.is_finite() || self.timeout_s <= 0.0 || self.timeout_s > 86_400.0 {
            return Err(Error::Config(format!("teacher.timeout_s = {}: must be in (0, 86400] seconds", self.timeout_s)));
        }
        Ok(())
    }

    /// The remote teacher's model id (`model` as text), when set and not blank.
    pub fn remote_model(&self) -> Option<String> {
        self.model.as_ref().map(|m| m.to_string_lossy().trim().to_string()).filter(|m| !m.is_empty())
    }

    /// Whether turns get several hint candidates and the student's top-K ids (`candidates` > 1).
    pub fn multi_candidate(&self) -> bool {
        self.candidates > 1
    }
}

/// The content-addressed id of a teacher row: hash of the interaction id, the teacher model's name, the
/// teacher prompt token ids (JSON) and K; for a multi-candidate row (which also holds the teacher's
/// log-probs at the student's top-K ids) also the student's weights name, `student`.
pub fn teacher_row_id(interaction_id: &str, teacher_model: &str, teacher_prompt: &[u32], top_k: usize, student: Option<&str>) -> String {
    let prompt = serde_json::to_vec(teacher_prompt).unwrap_or_default();
    let parts: [&[u8]; 4] = [interaction_id.as_bytes(), teacher_model.as_bytes(), &prompt, &top_k.to_le_bytes()];
    match student {
        None => content_hash(&parts),
        Some(s) => content_hash(&[parts[0], parts[1], parts[2], parts[3], b"student_topk", s.as_bytes()]),
    }
}

/// The name and version of the weights in model directory `dir`, as `teacher_logprobs` records them.
/// A trainer checkpoint (a folder with the trainer's `manifest.json`) is `<run id>/<version>` at its
/// manifest's version; any other model directory is its folder name at version 0 (the weights as
/// imported). The teacher stage loads its weights once and never follows later checkpoints, so this
/// is the version of every row it writes.
///
/// # Errors
/// [`Error::Io`] / [`Error::Json`] when the folder has a `manifest.json` that cannot be read.
pub fn weights_identity(dir: &std::path::Path) -> Result<(String, i64)> {
    use crate::trainer::checkpoint::{Manifest, MANIFEST_FILE};
    if dir.join(MANIFEST_FILE).is_file() {
        let m = Manifest::read(dir)?;
        return Ok((format!("{}/{}", m.run_id, m.version), m.version));
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
    Ok((name, 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::checkpoint::{Manifest, OptimizerRecord, MANIFEST_FILE, MANIFEST_FORMAT};

    #[test]
    fn weights_identity_is_the_checkpoint_version_or_0_for_an_imported_model() {
        let dir = tempfile::tempdir().unwrap();
        let imported = dir.path().join("smollm2-135m-instruct");
        std::fs::create_dir(&imported).unwrap();
        assert_eq!(weights_identity(&imported).unwrap(), ("smollm2-135m-instruct".to_string(), 0));

        let ckpt = dir.path().join("demo").join("3");
        std::fs::create_dir_all(&ckpt).unwrap();
        let m = Manifest {
            format: MANIFEST_FORMAT,
            run_id: "demo".into(),
            tenant: None,
            version: 3,
            parent_version: 2,
            step: 12,
            method: "combined".into(),
            config_hash: "h".into(),
            weights_format: "full".into(),
            weight_files: vec!["model.safetensors".into()],
            optimizer: OptimizerRecord { kind: "adamw".into(), step: 12, lr: 1e-5, betas: (0.9, 0.98), eps: 1e-8, weight_decay: 0.1, file: "optimizer.safetensors".into() },
            metrics: vec![],
            lineage: vec![],
            created_time: 0,
        };
        std::fs::write(ckpt.join(MANIFEST_FILE), serde_json::to_vec(&m).unwrap()).unwrap();
        assert_eq!(weights_identity(&ckpt).unwrap(), ("demo/3".to_string(), 3));

        std::fs::write(ckpt.join(MANIFEST_FILE), b"{not json").unwrap();
        assert!(matches!(weights_identity(&ckpt), Err(Error::Json(_))), "an unreadable manifest is an error, not version 0");
    }
}
