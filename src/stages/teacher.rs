//! Teacher stage wiring: the last stage before training. For each turn it resolves the student's own
//! tokens, the rollout log-probs, and (when a hint was accepted) the teacher's log-probs of those same
//! tokens under the hint-enhanced context (METHOD.md §4), then assembles the sample (§5) and publishes
//! `teacher_logprobs` and `samples`.
//!
//! Tokens: the interaction's own prompt/response token ids when the policy server logged them;
//! otherwise they are made once with the policy's tokenizer and chat template: the prompt is the
//! request rendered with the generation prompt, the response is what rendering the full conversation
//! adds after it, cut after the first end-of-turn token; `tokenize(prompt + response)` must start with
//! the prompt ids (METHOD.md §1), else the turn is dead-lettered. Rollout log-probs: the logged ones,
//! else recomputed by scoring the response under the policy's initial weights (marked
//! `rollout_logprobs_recomputed`). Model work runs on a blocking thread, a few turns per forward pass.
//!
//! Teacher cache: a teacher row is content-addressed (`teacher_id` = hash of the interaction, the teacher
//! model's name, the teacher prompt's token ids and K), so a turn whose key already has a row in the lake
//! (`teacher_logprobs`, or the replay cache `_state/teacher_cache/`, see [`TeacherCache`]) is not scored
//! again: replays and ablation arms that build the same hints pay model time only for what changed
//! (counted as `teacher_cache_hit`).
//!
//! Teacher backend (`[teacher] backend`): `local` (default) scores in-process with tch; `sglang` and
//! `vllm` ask an inference server holding the teacher model ([`remote`]), with the same alignment
//! contract. Tokens, template and the rollout recompute stay local either way.

pub mod remote;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{Input, Output, StageCounts, StageLogic};
use crate::config::{Method, PipelineConfig};
use crate::error::{Error, Result};
use crate::model::{LanguageModel, LoadOptions};
use crate::hint::{candidate_hints, teacher_messages};
use crate::samples::{assemble, attach_candidates, decide, Decision, SampleConfig, SampleOutcome};
use crate::schema::{content_hash, now_ms, DeadLetter, HintRecord, Interaction, Judgment, Message, Table, TeacherLogprobs};

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

    fn is_local(&self) -> bool {
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
    /// Turns scored per forward pass (local); requests in flight at once (remote).
    pub batch: usize,
    /// Hint candidates per turn, C (1 = the hint stage's chosen hint only, the default). With C > 1
    /// (multi-candidate hints, METHOD.md §3b) every accepted hint vote of a turn, deduplicated and
    /// shortest first, up to C, gets its own teacher context and scoring pass, and one more pass scores
    /// the student (the policy's initial weights on the original prompt) for its top-K ids; each
    /// candidate's row also holds the teacher's log-probs at those ids, and the sample carries them all
    /// (`samples.candidates`) for the trainer's overlap-guided selection (`trainer.opd_loss = overlap`).
    /// Needs `top_k` ≥ 1 (the reference uses K = 4) and a hint stage with `m` ≥ C votes to have C
    /// candidates. Left out of the serialised form when 1, so older pipeline hashes are unchanged.
    #[serde(skip_serializing_if = "is_one")]
    pub candidates: usize,
}

fn is_one(n: &usize) -> bool {
    *n == 1
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
        if self.backend.is_local() {
            if let Some(u) = &self.url {
                return Err(Error::Config(format!("teacher.url = {u:?} is only used by a remote teacher.backend (sglang or vllm); backend is \"local\"")));
            }
            return Ok(());
        }
        let backend = self.backend.as_str();
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

/// What computes the teacher passes.
#[derive(Clone)]
pub enum TeacherScorer {
    /// In-process with tch ([`LanguageModel::score`] / [`LanguageModel::score_at`]).
    Local(Arc<Mutex<LanguageModel>>),
    /// An inference server ([`remote::RemoteTeacher`]); one request per teacher context.
    Remote(Arc<remote::RemoteTeacher>),
}

/// The models the stage uses: the policy's initial weights (tokenizer, template, rollout recompute) and
/// the teacher (the same instance unless configured otherwise, or a remote server). The teacher scores
/// the student's own token ids, so it must share the policy's tokenizer; its prompt is rendered with
/// the policy's template.
#[derive(Clone)]
pub struct TeacherModels {
    policy: Arc<Mutex<LanguageModel>>,
    teacher: TeacherScorer,
    teacher_id: String,
    teacher_version: i64,
    /// Name of the policy's initial weights (the student of multi-candidate rows).
    policy_id: String,
}

impl TeacherModels {
    /// Loads the policy (and a separate teacher when configured), frozen; for a remote backend, the
    /// policy and a client for the server (whose rows record the served model id at version 0).
    ///
    /// # Errors
    /// Model loading errors; remote client errors ([`remote::RemoteTeacher::new`]).
    pub fn load(cfg: &PipelineConfig) -> Result<TeacherModels> {
        let device = LoadOptions::parse_device(&cfg.policy.device)?;
        let opts = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, ..Default::default() };
        let policy = Arc::new(Mutex::new(LanguageModel::load(&cfg.policy.model, &opts)?));
        let (policy_id, _) = weights_identity(&cfg.policy.model)?;
        if !cfg.teacher.backend.is_local() {
            let client = remote::RemoteTeacher::new(&cfg.teacher)?;
            let teacher_id = client.model().to_string();
            return Ok(TeacherModels { policy, teacher: TeacherScorer::Remote(Arc::new(client)), teacher_id, teacher_version: 0, policy_id });
        }
        let (teacher, path) = match &cfg.teacher.model {
            Some(p) if p != &cfg.policy.model => (Arc::new(Mutex::new(LanguageModel::load(p, &opts)?)), p.clone()),
            _ => (policy.clone(), cfg.policy.model.clone()),
        };
        let (teacher_id, teacher_version) = weights_identity(&path)?;
        Ok(TeacherModels { policy, teacher: TeacherScorer::Local(teacher), teacher_id, teacher_version, policy_id })
    }

    /// What computes the teacher passes.
    pub fn scorer(&self) -> &TeacherScorer {
        &self.teacher
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

fn lock(m: &Mutex<LanguageModel>) -> std::sync::MutexGuard<'_, LanguageModel> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The teacher stage over input rows of table `I` (hint records for OPD/combined, judgments for binary).
pub struct TeacherStage<I> {
    models: TeacherModels,
    method: Method,
    pipeline: String,
    cfg: TeacherConfig,
    samples: SampleConfig,
    cache: TeacherCache,
    /// `hint.min_hint_chars`: the length a hint candidate must exceed (multi-candidate hints).
    min_hint_chars: usize,
    /// libtorch threads of the scoring passes (`policy.threads`; 0 = default), set on the blocking
    /// thread that runs them.
    threads: usize,
    _in: std::marker::PhantomData<fn() -> I>,
}

impl<I> TeacherStage<I> {
    /// A teacher stage for `cfg`.
    pub fn new(cfg: &PipelineConfig, models: TeacherModels) -> TeacherStage<I> {
        TeacherStage {
            models,
            method: cfg.method,
            pipeline: cfg.name.clone(),
            cfg: cfg.teacher.clone(),
            samples: cfg.samples.clone(),
            cache: TeacherCache::default(),
            min_hint_chars: cfg.hint.min_hint_chars,
            threads: cfg.policy.threads,
            _in: std::marker::PhantomData,
        }
    }

    /// Uses `cache` for teacher rows already computed (see the module docs).
    pub fn with_cache(mut self, cache: TeacherCache) -> TeacherStage<I> {
        self.cache = cache;
        self
    }
}

/// Folder (under the lake's `_state/`) of the replay teacher cache: a lake holding only
/// `teacher_logprobs` rows copied from another lake by `nextstate replay`.
pub const TEACHER_CACHE_DIR: &str = "teacher_cache";

/// Teacher rows already computed, by `teacher_id` (see the module docs).
#[derive(Clone, Default, Debug)]
pub struct TeacherCache {
    rows: Arc<std::collections::HashMap<String, TeacherLogprobs>>,
}

impl TeacherCache {
    /// Loads the lake's `teacher_logprobs` rows and those of its replay cache (`_state/teacher_cache/`).
    ///
    /// # Errors
    /// Lake read errors.
    pub fn load(lake: &crate::lake::Lake) -> Result<TeacherCache> {
        let mut rows = std::collections::HashMap::new();
        let cache_dir = lake.root().join("_state").join(TEACHER_CACHE_DIR);
        if cache_dir.is_dir() {
            for r in crate::lake::Lake::open(&cache_dir)?.read_table::<TeacherLogprobs>()? {
                rows.insert(r.teacher_id.clone(), r);
            }
        }
        for r in lake.read_table::<TeacherLogprobs>()? {
            rows.insert(r.teacher_id.clone(), r);
        }
        Ok(TeacherCache { rows: Arc::new(rows) })
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The row of `teacher_id` when its teacher prompt and response token ids are exactly these.
    pub fn get(&self, teacher_id: &str, teacher_prompt: &[i32], response: &[i32]) -> Option<&TeacherLogprobs> {
        self.rows.get(teacher_id).filter(|r| r.teacher_prompt_token_ids == teacher_prompt && r.response_token_ids == response)
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

/// One teacher context of a turn: the hint's vote index, the teacher prompt ids and the cached row, if any.
struct TeacherPrompt {
    hint_index: i32,
    prompt: Vec<u32>,
    /// The teacher row from the cache (no model work for it).
    cached: Option<TeacherLogprobs>,
}

/// One turn's model work.
struct Job {
    interaction: Interaction,
    judgment: Option<Judgment>,
    hint: Option<HintRecord>,
    prompt_ids: Vec<u32>,
    response_ids: Vec<u32>,
    rollout: Option<Vec<f32>>,
    /// The teacher contexts: none without a hint, one per hint candidate (shortest first) otherwise.
    teachers: Vec<TeacherPrompt>,
    lineage: crate::schema::Lineage,
}

impl Job {
    /// Whether the turn needs the student's top-K ids scored (multi-candidate and not all cached).
    fn needs_student(&self, multi: bool) -> bool {
        multi && self.teachers.iter().any(|t| t.cached.is_none())
    }

    /// The student's top-K ids from any cached candidate row of the turn (every candidate row of a turn
    /// carries the same).
    fn cached_student_ids(&self) -> Option<&Vec<Vec<i32>>> {
        self.teachers.iter().find_map(|t| t.cached.as_ref()?.student_topk_ids.as_ref())
    }
}

/// Resolves the prompt and response token ids of a turn (see module docs).
///
/// # Errors
/// [`Error::InvalidInput`] when the ids cannot be made consistently (the reason is the dead letter's).
pub fn turn_tokens(lm: &LanguageModel, i: &Interaction) -> Result<(Vec<u32>, Vec<u32>)> {
    if let (Some(p), Some(r)) = (&i.prompt_token_ids, &i.response_token_ids) {
        if !p.is_empty() && !r.is_empty() {
            let to_u32 = |v: &Vec<i32>| v.iter().map(|&x| u32::try_from(x).map_err(|_| Error::InvalidInput(format!("negative token id {x}")))).collect::<Result<Vec<u32>>>();
            return Ok((to_u32(p)?, to_u32(r)?));
        }
    }
    let messages = i.messages()?;
    let tools: Option<serde_json::Value> = match &i.tools {
        Some(t) => Some(serde_json::from_str(t)?),
        None => None,
    };
    let prompt_text = lm.render_chat(&messages, tools.as_ref(), true)?;
    let mut full = messages.clone();
    full.push(i.response_message()?);
    let full_text = lm.render_chat(&full, tools.as_ref(), false)?;
    let added = full_text
        .strip_prefix(&prompt_text)
        .ok_or_else(|| Error::InvalidInput("the chat template does not render the response as a continuation of the prompt".into()))?;
    let prompt_ids = lm.encode(&prompt_text)?;
    let joint = lm.encode(&format!("{prompt_text}{added}"))?;
    if !joint.starts_with(&prompt_ids) {
        return Err(Error::InvalidInput("tokenize(prompt + response) does not start with tokenize(prompt): unstable token boundary".into()));
    }
    let mut response_ids = joint[prompt_ids.len()..].to_vec();
    if let Some(pos) = response_ids.iter().position(|t| lm.eos_token_ids().contains(t)) {
        response_ids.truncate(pos + 1);
    }
    Ok((prompt_ids, response_ids))
}

/// The teacher contexts of a turn whose hint was accepted, as `(vote index, messages)`: with
/// `candidates = 1` the hint stage's own context (`hints.teacher_messages`); with more, one per
/// [`candidate_hints`] entry (METHOD.md §3b), built from the turn's request with [`teacher_messages`]
/// (the same construction as the hint stage's), the chosen hint alone when no vote qualifies.
///
/// # Errors
/// [`Error::InvalidInput`] for an accepted hint without a teacher context; JSON errors for a context or
/// request that is not a message list.
fn teacher_contexts(hint: Option<&HintRecord>, interaction: &Interaction, candidates: usize, min_hint_chars: usize) -> Result<Vec<(i32, Vec<Message>)>> {
    let h = hint.ok_or_else(|| Error::InvalidInput("accepted hint without a hint record".into()))?;
    if candidates > 1 {
        let mut hints = candidate_hints(&h.candidates, min_hint_chars, candidates);
        if hints.is_empty() {
            if let Some(chosen) = &h.chosen_hint {
                hints.push((h.chosen_index.unwrap_or(0), chosen.clone()));
            }
        }
        if !hints.is_empty() {
            let request = interaction.messages()?;
            return Ok(hints.into_iter().map(|(i, text)| (i, teacher_messages(&request, &text))).collect());
        }
    }
    let ctx = h.teacher_messages.as_ref().ok_or_else(|| Error::InvalidInput("accepted hint without teacher context".into()))?;
    Ok(vec![(h.chosen_index.unwrap_or(0), serde_json::from_str(ctx)?)])
}

fn to_i32(v: &[u32]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

fn to_i32_rows(rows: &[Vec<u32>]) -> Vec<Vec<i32>> {
    rows.iter().map(|r| to_i32(r)).collect()
}

/// One teacher pass's outcome: the scores, or why this turn gets none (dead-letter reason and error;
/// remote teachers only, see [`remote::RemoteFailure`]).
type TeacherPass = std::result::Result<crate::model::ScoredResponse, (&'static str, Error)>;

/// What the scoring passes return for one job: recomputed rollout log-probs, the student's top-K
/// (multi-candidate), and one teacher pass per uncached teacher context, in order.
type Scored = (Option<Vec<f32>>, Option<crate::model::ScoredResponse>, Vec<TeacherPass>);

/// The policy's passes of a batch (rollout recompute, student top-K) per job, the teacher items, and
/// the local teacher's scores of them (`None` for a remote teacher, which scores them afterwards).
type PolicyPasses = (Vec<(Option<Vec<f32>>, Option<crate::model::ScoredResponse>)>, Vec<(Vec<u32>, Vec<u32>)>, Option<Vec<crate::model::ScoredResponse>>);

impl<I: Table> StageLogic for TeacherStage<I> {
    type In = I;
    fn name(&self) -> &'static str {
        "teacher"
    }
    async fn handle(&mut self, batch: Vec<Input<I>>, out: &Output, counts: &mut StageCounts) -> Result<()> {
        // 1. decide and tokenise (cheap), 2. score in one blocking call, 3. assemble and publish.
        let multi = self.cfg.multi_candidate();
        let student_name = multi.then(|| self.models.policy_id.clone());
        let mut jobs: Vec<Job> = vec![];
        for input in batch {
            let Some(interaction) = input.carry.interaction.clone() else {
                counts.add("dead_letter: missing_context", 1);
                let payload = serde_json::to_vec(&input.row).unwrap_or_default();
                out.dead(DeadLetter::new("teacher", "missing_context", "record carries no interaction", &payload, input.lineage.clone())).await?;
                continue;
            };
            let judgment = input.carry.judgment.clone();
            let hint = input.carry.hint.clone();
            let uses_teacher = match decide(self.method, &self.samples, &interaction, judgment.as_ref(), hint.as_ref()) {
                Decision::NoSample(reason) => {
                    counts.add(&format!("no_sample: {}", reason.as_str()), 1);
                    continue;
                }
                Decision::Emit { uses_teacher, .. } => uses_teacher,
            };
            let dead = |code: &str, why: String| {
                DeadLetter::new("teacher", code, why, &serde_json::to_vec(&interaction).unwrap_or_default(), input.lineage.clone())
                    .with_keys(&interaction.session_id, Some(&interaction.interaction_id))
            };
            let prepared = {
                let lm = lock(&self.models.policy);
                turn_tokens(&lm, &interaction).and_then(|(p, r)| {
                    let mut prompts = vec![];
                    if uses_teacher {
                        let tools: Option<serde_json::Value> = match &interaction.tools {
                            Some(t) => Some(serde_json::from_str(t)?),
                            None => None,
                        };
                        for (index, msgs) in teacher_contexts(hint.as_ref(), &interaction, self.cfg.candidates, self.min_hint_chars)? {
                            prompts.push((index, lm.chat_prompt_ids(&msgs, tools.as_ref(), true)?));
                        }
                    }
                    Ok((p, r, prompts))
                })
            };
            let (prompt_ids, response_ids, prompts) = match prepared {
                Ok(x) => x,
                Err(e) => {
                    counts.add("dead_letter: tokenization", 1);
                    out.dead(dead("tokenization", e.to_string())).await?;
                    continue;
                }
            };
            let longest = prompts.iter().map(|(_, p)| p.len()).max().unwrap_or(0).max(prompt_ids.len()) + response_ids.len();
            if longest > self.cfg.max_tokens {
                counts.add("dead_letter: too_long", 1);
                out.dead(dead("too_long", format!("{longest} tokens exceed teacher.max_tokens = {}", self.cfg.max_tokens))).await?;
                continue;
            }
            let rollout = interaction.rollout_logprobs.clone().filter(|r| r.len() == response_ids.len());
            let teachers: Vec<TeacherPrompt> = prompts
                .into_iter()
                .map(|(hint_index, tp)| {
                    let id = teacher_row_id(&interaction.interaction_id, &self.models.teacher_id, &tp, self.cfg.top_k, student_name.as_deref());
                    let cached = self
                        .cache
                        .get(&id, &to_i32(&tp), &to_i32(&response_ids))
                        .filter(|r| !multi || (r.student_topk_ids.is_some() && r.logprobs_at_student_topk.is_some()))
                        .cloned();
                    TeacherPrompt { hint_index, prompt: tp, cached }
                })
                .collect();
            let hits = teachers.iter().filter(|t| t.cached.is_some()).count();
            if hits > 0 {
                counts.add("teacher_cache_hit", hits as u64);
            }
            jobs.push(Job { interaction, judgment, hint, prompt_ids, response_ids, rollout, teachers, lineage: input.lineage });
        }
        if jobs.is_empty() {
            return Ok(());
        }
        // Model work on a blocking thread.
        let models = self.models.clone();
        let (top_k, per_pass) = (self.cfg.top_k, self.cfg.batch.max(1));
        struct Work {
            rollout: Option<(Vec<u32>, Vec<u32>)>,
            student: Option<(Vec<u32>, Vec<u32>)>,
            /// The student's ids from a cached row (all candidates of the turn share them).
            cached_student: Option<Vec<Vec<u32>>>,
            teachers: Vec<(Vec<u32>, Vec<u32>)>,
        }
        let work: Vec<Work> = jobs
            .iter()
            .map(|j| {
                let pair = |p: &Vec<u32>| (p.clone(), j.response_ids.clone());
                let cached_student = j.cached_student_ids().map(|rows| rows.iter().map(|r| r.iter().map(|&x| x as u32).collect()).collect());
                Work {
                    rollout: j.rollout.is_none().then(|| pair(&j.prompt_ids)),
                    student: (j.needs_student(multi) && cached_student.is_none()).then(|| pair(&j.prompt_ids)),
                    cached_student,
                    teachers: j.teachers.iter().filter(|t| t.cached.is_none()).map(|t| pair(&t.prompt)).collect(),
                }
            })
            .collect();
        let threads = self.threads;
        let teacher_counts: Vec<usize> = work.iter().map(|w| w.teachers.len()).collect();
        let (per_job, teacher_items, local_out) = tokio::task::spawn_blocking(move || -> Result<PolicyPasses> {
            if threads > 0 {
                crate::model::set_threads(threads as i32)?;
            }
            let rollout_items: Vec<(Vec<u32>, Vec<u32>)> = work.iter().filter_map(|w| w.rollout.clone()).collect();
            let student_items: Vec<(Vec<u32>, Vec<u32>)> = work.iter().filter_map(|w| w.student.clone()).collect();
            let mut rollout_out = vec![];
            for chunk in rollout_items.chunks(per_pass) {
                rollout_out.extend(lock(&models.policy).score(chunk, 0)?.into_iter().map(|s| s.logprobs));
            }
            let mut student_out = vec![];
            for chunk in student_items.chunks(per_pass) {
                student_out.extend(lock(&models.policy).score(chunk, top_k)?);
            }
            let (mut ri, mut si) = (rollout_out.into_iter(), student_out.into_iter());
            let per_job: Vec<(Option<Vec<f32>>, Option<crate::model::ScoredResponse>)> =
                work.iter().map(|w| (w.rollout.as_ref().and_then(|_| ri.next()), w.student.as_ref().and_then(|_| si.next()))).collect();
            // Teacher passes: at the student's ids when the turn has them (multi-candidate).
            let mut teacher_items = vec![];
            let mut at = vec![];
            for (w, (_, student)) in work.iter().zip(&per_job) {
                let ids = student.as_ref().and_then(|s| s.topk_ids.clone()).or_else(|| w.cached_student.clone());
                for item in &w.teachers {
                    teacher_items.push(item.clone());
                    at.push(ids.clone());
                }
            }
            let TeacherScorer::Local(teacher) = &models.teacher else {
                return Ok((per_job, teacher_items, None));
            };
            let mut teacher_out = vec![];
            let mut start = 0;
            for chunk in teacher_items.chunks(per_pass) {
                let ids: Vec<Vec<Vec<u32>>> = at[start..start + chunk.len()].iter().map(|a| a.clone().unwrap_or_default()).collect();
                start += chunk.len();
                let lm = lock(teacher);
                teacher_out.extend(if at[start - chunk.len()..start].iter().all(Option::is_some) { lm.score_at(chunk, top_k, &ids)? } else { lm.score(chunk, top_k)? });
            }
            Ok((per_job, teacher_items, Some(teacher_out)))
        })
        .await
        .map_err(|e| Error::Internal(format!("teacher worker: {e}")))??;
        let teacher_out: Vec<TeacherPass> = match (local_out, &self.models.teacher) {
            (Some(scores), _) => scores.into_iter().map(Ok).collect(),
            (None, TeacherScorer::Remote(client)) => {
                let mut passes = Vec::with_capacity(teacher_items.len());
                for r in client.score_all(&teacher_items).await {
                    passes.push(match r {
                        Ok(s) => Ok(s),
                        Err(remote::RemoteFailure::Turn { code, error }) => Err((code, error)),
                        // The teacher is down or refuses us: stop before committing this batch.
                        Err(remote::RemoteFailure::Unavailable(e)) => return Err(e),
                    });
                }
                passes
            }
            (None, TeacherScorer::Local(_)) => return Err(Error::Internal("the local teacher pass returned no scores".into())),
        };
        let mut ti = teacher_out.into_iter();
        let scored: Vec<Scored> = teacher_counts.iter().zip(per_job).map(|(&n, (r, st))| (r, st, ti.by_ref().take(n).collect())).collect();

        for (job, (recomputed, student, teacher_passes)) in jobs.into_iter().zip(scored) {
            let teacher_scores = match teacher_passes.into_iter().collect::<std::result::Result<Vec<_>, _>>() {
                Ok(v) => v,
                Err((code, e)) => {
                    counts.add(&format!("dead_letter: {code}"), 1);
                    let d = DeadLetter::new("teacher", code, e.to_string(), &serde_json::to_vec(&job.interaction).unwrap_or_default(), job.lineage.clone())
                        .with_keys(&job.interaction.session_id, Some(&job.interaction.interaction_id));
                    out.dead(d).await?;
                    continue;
                }
            };
            let cached_ids = job.cached_student_ids().cloned();
            let Job { interaction, judgment, hint, prompt_ids, response_ids, rollout, lineage, teachers } = job;
            let was_recomputed = recomputed.is_some();
            let rollout = rollout.or(recomputed).unwrap_or_default();
            // The student's ids: scored now, or from a cached candidate row (the scoring pass is skipped then).
            let student_ids: Option<Vec<Vec<i32>>> = student.and_then(|s| s.topk_ids).map(|rows| to_i32_rows(&rows)).or(cached_ids);
            let mut scores = teacher_scores.into_iter();
            let mut rows: Vec<TeacherLogprobs> = vec![];
            let mut hint_indices = vec![];
            for tp in teachers {
                hint_indices.push(tp.hint_index);
                if let Some(mut row) = tp.cached {
                    row.pipeline = self.pipeline.clone();
                    row.processed_time = now_ms();
                    rows.push(row);
                    continue;
                }
                let Some(t) = scores.next() else { break };
                rows.push(TeacherLogprobs {
                    schema_version: TeacherLogprobs::SCHEMA_VERSION,
                    teacher_id: teacher_row_id(&interaction.interaction_id, &self.models.teacher_id, &tp.prompt, top_k, student_name.as_deref()),
                    pipeline: self.pipeline.clone(),
                    interaction_id: interaction.interaction_id.clone(),
                    session_id: interaction.session_id.clone(),
                    turn_index: interaction.turn_index,
                    teacher_model: self.models.teacher_id.clone(),
                    teacher_version: self.models.teacher_version,
                    teacher_prompt_token_ids: to_i32(&tp.prompt),
                    response_token_ids: to_i32(&response_ids),
                    teacher_logprobs: t.logprobs,
                    topk_ids: t.topk_ids.map(|rows| to_i32_rows(&rows)),
                    topk_logprobs: t.topk_logprobs,
                    student_topk_ids: if multi { student_ids.clone() } else { None },
                    logprobs_at_student_topk: if multi { t.at_logprobs } else { None },
                    event_time: interaction.event_time,
                    processed_time: now_ms(),
                });
            }
            let outcome = assemble(
                self.method,
                &self.samples,
                &interaction,
                judgment.as_ref(),
                hint.as_ref(),
                rows.first(),
                &to_i32(&prompt_ids),
                &to_i32(&response_ids),
                &rollout,
                &self.pipeline,
            )
            .and_then(|o| match o {
                SampleOutcome::Sample(mut s) if multi && !rows.is_empty() => {
                    attach_candidates(&mut s, &rows, &hint_indices)?;
                    Ok(SampleOutcome::Sample(s))
                }
                o => Ok(o),
            });
            match outcome {
                Ok(SampleOutcome::Sample(mut s)) => {
                    s.rollout_logprobs_recomputed = was_recomputed;
                    for t in &rows {
                        out.emit(t, None).await?;
                    }
                    if !rows.is_empty() {
                        counts.add("teacher_logprobs", rows.len() as u64);
                    }
                    if rows.len() > 1 {
                        counts.add(&format!("hint_candidates: {}", rows.len()), 1);
                    }
                    counts.add(&format!("sample: {}", s.sample_type.as_str()), 1);
                    out.emit(&s, None).await?;
                }
                Ok(SampleOutcome::NoSample { reason }) => counts.add(&format!("no_sample: {}", reason.as_str()), 1),
                Err(e) => {
                    let code = match &e {
                        Error::NonFinite { .. } => "non_finite_logprob",
                        Error::LogprobLenMismatch { .. } => "logprob_length_mismatch",
                        _ => "invalid_sample",
                    };
                    counts.add(&format!("dead_letter: {code}"), 1);
                    let d = DeadLetter::new("teacher", code, e.to_string(), &serde_json::to_vec(&interaction).unwrap_or_default(), lineage)
                        .with_keys(&interaction.session_id, Some(&interaction.interaction_id));
                    out.dead(d).await?;
                }
            }
        }
        Ok(())
    }
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
