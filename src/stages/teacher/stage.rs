//! Teacher stage wiring: the last stage before training. For each turn it resolves the student's own
//! tokens, the rollout log-probs, and (when a hint was accepted) the teacher's log-probs of those same
//! tokens under the hint-enhanced context (docs/method.md §4), then assembles the sample (§5) and publishes
//! `teacher_logprobs` and `samples`.
//!
//! Tokens ([`crate::teacher::tokens`]): the interaction's own prompt/response token ids when the
//! policy server logged them, else made once with the policy's tokenizer and chat template (a turn
//! whose ids cannot be made consistently is dead-lettered). Rollout log-probs: the logged ones,
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
//! `vllm` ask an inference server holding the teacher model ([`crate::teacher::remote`]), with the
//! same alignment contract. Tokens, template and the rollout recompute stay local either way. The
//! teacher's configuration and the pure helpers this wiring uses live in [`crate::teacher`].

use std::sync::{Arc, Mutex};

use crate::bus::Bus;
use crate::lake::Lake;
use crate::runtime::TaskCtl;
use crate::stages::{run_stage, Input, Output, StageCounts, StageLogic, StageRun, StageTask};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::method::Method;
use crate::model::{LanguageModel, LoadOptions};
use crate::samples::{assemble, attach_candidates, decide, Decision, SampleConfig, SampleOutcome};
use crate::schema::{now_ms, DeadLetter, HintRecord, Interaction, Judgment, Table, TeacherLogprobs};
use crate::teacher::remote;
use crate::teacher::tokens::{teacher_contexts, turn_tokens};
use crate::teacher::{teacher_row_id, weights_identity, TeacherConfig};

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

    /// The remote teacher's start-up probe ([`remote::RemoteTeacher::probe`]) on the first two tokens of
    /// "The answer is" in the policy's tokenizer; nothing for a local teacher.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the setting to check; tokenizer errors.
    pub async fn probe(&self) -> Result<()> {
        let TeacherScorer::Remote(client) = &self.teacher else { return Ok(()) };
        let ids = lock(&self.policy).encode("The answer is")?;
        if ids.len() < 2 {
            return Err(crate::Error::Internal(format!("the probe text encodes to {} token(s)", ids.len())));
        }
        client.probe(&ids[..1], &ids[1..2]).await
    }

    /// What computes the teacher passes.
    pub fn scorer(&self) -> &TeacherScorer {
        &self.teacher
    }
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

    /// The teacher's name in row ids: its weights' name, with the scoring temperature when it is not 1
    /// (rows scored at another temperature are other rows).
    fn teacher_key(&self) -> String {
        if self.cfg.temperature == 1.0 {
            self.models.teacher_id.clone()
        } else {
            format!("{}@temperature={}", self.models.teacher_id, self.cfg.temperature)
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

/// Teacher rows already computed, by `teacher_id` (see the module docs): an index of where each row is
/// (file and position; a few dozen bytes a row), the rows themselves read on demand. A lake row wins over
/// a replay-cache row with the same `teacher_id`, and within either a later file over an earlier one.
#[derive(Clone, Default, Debug)]
pub struct TeacherCache {
    index: Arc<CacheIndex>,
}

#[derive(Default, Debug)]
struct CacheIndex {
    /// The replay cache's lake and the lake itself (each file is read through its own lake).
    lakes: Vec<crate::lake::Lake>,
    /// (index in `lakes`, path) of every file indexed.
    files: Vec<(usize, std::path::PathBuf)>,
    /// `teacher_id` → (index in `files`, position in that file).
    rows: std::collections::HashMap<String, (usize, usize)>,
}

impl TeacherCache {
    /// Indexes the `teacher_id`s of the lake's `teacher_logprobs` rows and of its replay cache
    /// (`_state/teacher_cache/`), reading only that column.
    ///
    /// # Errors
    /// Lake read errors.
    pub fn load(lake: &crate::lake::Lake) -> Result<TeacherCache> {
        let cache = crate::lake::Lake::open(lake.state_dir(TEACHER_CACHE_DIR)?)?;
        let mut index = CacheIndex { lakes: vec![cache, lake.clone()], ..Default::default() };
        // the replay cache first, so that the lake's rows replace its rows of the same id
        for li in 0..index.lakes.len() {
            let l = index.lakes[li].clone();
            for f in l.files(TeacherLogprobs::NAME)? {
                let fi = index.files.len();
                for (row, id) in l.file_strings(&f.path, TeacherLogprobs::KEY)?.into_iter().enumerate() {
                    if let Some(id) = id {
                        index.rows.insert(id, (fi, row));
                    }
                }
                index.files.push((li, f.path));
            }
        }
        Ok(TeacherCache { index: Arc::new(index) })
    }

    /// Rows indexed (distinct `teacher_id`s).
    pub fn len(&self) -> usize {
        self.index.rows.len()
    }

    /// Whether it indexes no row.
    pub fn is_empty(&self) -> bool {
        self.index.rows.is_empty()
    }

    /// The row of `teacher_id` when its teacher prompt and response token ids are exactly these.
    ///
    /// # Errors
    /// Lake read errors (e.g. its file was deleted since [`TeacherCache::load`]).
    pub fn get(&self, teacher_id: &str, teacher_prompt: &[i32], response: &[i32]) -> Result<Option<TeacherLogprobs>> {
        Ok(self.get_many(&[(teacher_id, teacher_prompt, response)])?.pop().flatten())
    }

    /// [`TeacherCache::get`] for each (teacher_id, teacher prompt ids, response ids) of `wanted`, in that
    /// order, reading each file involved once.
    ///
    /// # Errors
    /// As [`TeacherCache::get`].
    pub fn get_many(&self, wanted: &[(&str, &[i32], &[i32])]) -> Result<Vec<Option<TeacherLogprobs>>> {
        let mut by_file: std::collections::BTreeMap<usize, Vec<usize>> = std::collections::BTreeMap::new();
        for (id, _, _) in wanted {
            if let Some(&(fi, row)) = self.index.rows.get(*id) {
                by_file.entry(fi).or_default().push(row);
            }
        }
        let mut fetched: std::collections::HashMap<String, TeacherLogprobs> = std::collections::HashMap::new();
        for (fi, rows) in by_file {
            let (li, path) = &self.index.files[fi];
            // only indexed positions are read: each row read is the one its id stands for
            for r in self.index.lakes[*li].read_rows_at::<TeacherLogprobs>(path, &rows)? {
                fetched.insert(r.teacher_id.clone(), r);
            }
        }
        Ok(wanted
            .iter()
            .map(|(id, prompt, response)| {
                fetched.get(*id).filter(|r| r.teacher_prompt_token_ids == *prompt && r.response_token_ids == *response).cloned()
            })
            .collect())
    }
}

/// One teacher context of a turn: the hint's vote index, the teacher prompt ids, its row id and the cached
/// row, if any.
struct TeacherPrompt {
    hint_index: i32,
    prompt: Vec<u32>,
    /// The row's `teacher_id` ([`teacher_row_id`]).
    id: String,
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

impl<I> TeacherStage<I> {
    /// Sets each teacher context's cached row (the batch's rows read from the cache together), counted
    /// as `teacher_cache_hit`. A multi-candidate row must carry the student's top-K. The cache only saves
    /// model time: when it cannot be read, the contexts are scored instead.
    fn fill_cached(&self, jobs: &mut [Job], multi: bool, counts: &mut StageCounts) {
        if self.cache.is_empty() {
            return;
        }
        let tokens: Vec<(Vec<i32>, Vec<i32>)> =
            jobs.iter().flat_map(|j| j.teachers.iter().map(|t| (to_i32(&t.prompt), to_i32(&j.response_ids)))).collect();
        let wanted: Vec<(&str, &[i32], &[i32])> = jobs
            .iter()
            .flat_map(|j| j.teachers.iter())
            .zip(&tokens)
            .map(|(t, (prompt, response))| (t.id.as_str(), prompt.as_slice(), response.as_slice()))
            .collect();
        let rows = match self.cache.get_many(&wanted) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "teacher cache unreadable: scoring these turns instead");
                return;
            }
        };
        let mut rows = rows.into_iter();
        let mut hits = 0;
        for t in jobs.iter_mut().flat_map(|j| j.teachers.iter_mut()) {
            t.cached = rows.next().flatten().filter(|r| !multi || (r.student_topk_ids.is_some() && r.logprobs_at_student_topk.is_some()));
            hits += u64::from(t.cached.is_some());
        }
        if hits > 0 {
            counts.add("teacher_cache_hit", hits);
        }
    }
}

/// The stage's name: its metrics label, its dead letters' `stage`, its consumer group's suffix and its
/// `--only` task name.
pub const NAME: &str = "teacher";

/// The teacher stage's task for `cfg`, reading `input` (`judgments` for binary, `hints` for OPD and
/// combined) with `run`'s consumer group until `ctl` ends it. Reading hints it loads the teacher cache
/// from `lake` and probes the teacher endpoint once first. The registry,
/// `crate::stages::run::Stage::build`, calls this.
///
/// # Errors
/// [`Error::Config`] for a bad teacher configuration or an input table other than those two; model and
/// cache loading errors.
pub fn build(cfg: &PipelineConfig, input: &str, bus: &Bus, lake: &Lake, run: StageRun, ctl: TaskCtl) -> Result<StageTask> {
    let models = TeacherModels::load(cfg)?;
    let bus = bus.clone();
    if input == Judgment::NAME {
        let stage = TeacherStage::<Judgment>::new(cfg, models);
        Ok(Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await }))
    } else if input == HintRecord::NAME {
        let cache = TeacherCache::load(lake)?;
        tracing::info!(rows = cache.len(), "teacher cache loaded");
        let probe = models.clone();
        let stage = TeacherStage::<HintRecord>::new(cfg, models).with_cache(cache);
        Ok(Box::pin(async move {
            probe.probe().await?;
            run_stage(&bus, &run, stage, &ctl).await
        }))
    } else {
        Err(Error::Config(format!("the teacher stage reads `{}` or `{}`, not `{input}`", Judgment::NAME, HintRecord::NAME)))
    }
}

impl<I: Table> StageLogic for TeacherStage<I> {
    type In = I;
    fn name(&self) -> &'static str {
        NAME
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
                out.dead(DeadLetter::new(NAME, "missing_context", "record carries no interaction", &payload, input.lineage.clone())).await?;
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
                DeadLetter::new(NAME, code, why, &serde_json::to_vec(&interaction).unwrap_or_default(), input.lineage.clone())
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
                    let id = teacher_row_id(&interaction.interaction_id, &self.teacher_key(), &tp, self.cfg.top_k, student_name.as_deref());
                    TeacherPrompt { hint_index, prompt: tp, id, cached: None }
                })
                .collect();
            jobs.push(Job { interaction, judgment, hint, prompt_ids, response_ids, rollout, teachers, lineage: input.lineage });
        }
        if jobs.is_empty() {
            return Ok(());
        }
        self.fill_cached(&mut jobs, multi, counts);
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
        let temperature = self.cfg.temperature;
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
                let ids = if at[start - chunk.len()..start].iter().all(Option::is_some) { ids } else { vec![] };
                teacher_out.extend(lm.score_at_temperature(chunk, top_k, &ids, temperature)?);
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
                    let d = DeadLetter::new(NAME, code, e.to_string(), &serde_json::to_vec(&job.interaction).unwrap_or_default(), job.lineage.clone())
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
                    row.tenant = interaction.tenant.clone();
                    row.processed_time = now_ms();
                    rows.push(row);
                    continue;
                }
                let Some(t) = scores.next() else { break };
                rows.push(TeacherLogprobs {
                    schema_version: TeacherLogprobs::SCHEMA_VERSION,
                    teacher_id: tp.id.clone(),
                    pipeline: self.pipeline.clone(),
                    interaction_id: interaction.interaction_id.clone(),
                    session_id: interaction.session_id.clone(),
                    tenant: interaction.tenant.clone(),
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
                    let d = DeadLetter::new(NAME, code, e.to_string(), &serde_json::to_vec(&interaction).unwrap_or_default(), lineage)
                        .with_keys(&interaction.session_id, Some(&interaction.interaction_id));
                    out.dead(d).await?;
                }
            }
        }
        Ok(())
    }
}

