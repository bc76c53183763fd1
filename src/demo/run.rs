//! `nextstate demo`: the main job. A simulated student uses the agent for homework while the whole
//! pipeline runs in this process on the embedded defaults (mock Kafka, lake, rule-based judge and hint
//! extractor, SmolLM2 as policy and teacher): the student's requests go through the capture proxy to the
//! policy server; the pipeline pairs each answer with the student's reply, judges it, extracts hints,
//! computes teacher log-probs, trains and publishes checkpoints, and the server loads each one while the
//! student keeps working. After the run, the personalization score on held-out problems (greedy) is
//! measured for the initial weights and for the first, middle and last checkpoints the server loaded
//! ([`versions_to_evaluate`]), with each version's drift from the initial weights, then printed, written
//! to the lake (`eval_scores`) and to `report.md` with a plot.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::Mutex;

use super::sessions::{SessionOutcome, SessionsSummary};
use super::{eval_rows, load_gsm8k, split_problems, write_report, CheckpointEval, DemoReport, Preferences, Problem, Score, Student};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::runtime::Stop;
use crate::stages::run::{start_pipeline, RunOptions, RunReport, Stage};

/// Settings of a demo run (flags of `nextstate demo`).
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The pipeline (normally `pipelines/demo.toml`); its lake is replaced by `<out>/lake`.
    pub pipeline: PipelineConfig,
    /// Output folder: `lake/`, `checkpoints/`, `report.md`, `personalization.png`.
    pub out: PathBuf,
    /// GSM8K problems file.
    pub gsm8k: PathBuf,
    /// Student turns answered by the agent (main turns) before the students stop.
    pub interactions: usize,
    /// The students keep working past `interactions` until their requests were answered by at least this
    /// many policy versions (2: at least one checkpoint reached them), so a demo on a slow machine still
    /// shows the weights changing under live traffic. 0 or 1: stop at `interactions`.
    pub min_versions_served: usize,
    /// Hard limit on student turns whatever `min_versions_served` says (at least `interactions`).
    pub max_interactions: usize,
    /// Students working at once (concurrent sessions).
    pub students: usize,
    /// Most agent turns per homework session.
    pub max_turns: u32,
    /// Held-out problems the personalization score is measured on.
    pub eval_problems: usize,
    /// Which problems those are: the held-out test problems (the demo) or a validation split for
    /// choosing a recipe ([`super::EvalSplit`], [`super::Split::evaluated_on`]).
    pub eval_split: super::EvalSplit,
    /// Response length limit, tokens.
    pub max_tokens: usize,
    /// Sampling temperature of the student's sessions (evaluation is greedy).
    pub temperature: f32,
    /// Seed (student phrasing, sampling; and the problem split unless `split_seed` is set).
    pub seed: u64,
    /// Seed of the held-out/training problem split; `None` = `seed`. The online ablation sets it, so
    /// every replicate is evaluated on the same held-out prompts; when it differs from `seed`, the
    /// held-out prompts are phrased by the student of `split_seed` (not `seed`) and the training
    /// problems come in an order shuffled by `seed`.
    pub split_seed: Option<u64>,
    /// The student's hidden preferences.
    pub preferences: Preferences,
    /// Evaluate only v0 and the last version the server loaded (the online ablation's `[eval] versions =
    /// "last"`), not also the first and middle ones ([`versions_to_evaluate`]).
    pub eval_last_only: bool,
    /// The system prompt the agent puts before every student session ([`AgentContext::None`] in the
    /// demo; the online ablation's baselines without training set it).
    pub context: AgentContext,
    /// Run the teacher and trainer (the demo); `false` runs only serving, signals, judge, hint and the
    /// lake sinks, so the weights never change (the online ablation's baselines).
    pub train: bool,
    /// Tenants of a fleet demo (`demo --tenants 2`, [`super::fleet`]): each a student with its own
    /// preferences who sends its tenant id in `X-Agent-Id`; student worker `w` works for tenant
    /// `w mod n`. Empty: one student (`preferences`) and no tenant header (the demo). A fleet run
    /// evaluates nothing itself: [`super::fleet::run_fleet_demo`] evaluates every tenant after both modes.
    pub fleet: Vec<(String, Preferences)>,
    /// A JSON file keeping v0's greedy held-out answers between runs
    /// ([`super::heldout::greedy_generations_kept`]: reused when the model, the answer length and every
    /// held-out prompt match, else generated and written). `None` (the demo): v0 is always generated.
    /// The online ablation passes one file for all its replicates, since they share v0 and the prompts.
    pub v0_kept: Option<PathBuf>,
}

/// What the agent writes as the system prompt of each student session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AgentContext {
    /// No system prompt (the demo).
    #[default]
    None,
    /// This text in every session (the `prompted` baseline).
    System(String),
    /// The hints the pipeline accepted so far, read from the lake's `hints` table when a session starts
    /// (at most every [`MEMORY_REFRESH`]) and written by [`super::memory::memory_system`] with at most
    /// `cap_tokens` policy tokens, newest first; no system prompt before the first accepted hint (the
    /// `memory` baseline). A hint reaches the lake a few seconds after its session ended (the sinks roll
    /// files every `roll_ms`), so sessions running at once do not see each other's hints.
    Memory {
        /// Token cap of the remembered hints.
        cap_tokens: usize,
    },
}

/// How often a session start re-reads the lake's accepted hints for [`AgentContext::Memory`].
pub const MEMORY_REFRESH: Duration = Duration::from_secs(2);

/// The tasks of a run without training (serving, signals, judge, hint, sinks).
const SERVE_ONLY: &[&str] = &["serve", "proxy", Stage::Signals.name(), Stage::Judge.name(), Stage::Hint.name(), "sinks"];

/// The accepted hints of `lake`'s `hints` table, oldest first (by processing time, then turn id).
///
/// # Errors
/// Lake errors.
pub fn accepted_hints(lake: &crate::lake::Lake) -> Result<Vec<String>> {
    Ok(accepted_texts(&lake.read_table::<crate::schema::HintRecord>()?))
}

/// The accepted hints of hint rows `rows`, oldest first (by processing time, then turn id).
pub fn accepted_texts(rows: &[crate::schema::HintRecord]) -> Vec<String> {
    let mut rows: Vec<(i64, &str, &str)> = rows.iter().filter_map(|h| Some((h.processed_time, h.interaction_id.as_str(), h.chosen_hint.as_deref()?))).collect();
    rows.sort();
    rows.into_iter().map(|(_, _, h)| h.to_string()).collect()
}

/// The agent's memory ([`AgentContext::Memory`]): the system prompt of the last refresh.
struct Memory {
    cap_tokens: usize,
    tokenizer: Arc<crate::model::TextTokenizer>,
    lake: PathBuf,
    /// When last read, and the prompt then.
    last: Mutex<Option<(Instant, Option<String>)>>,
}

impl Memory {
    /// The system prompt now: the cached one when read within [`MEMORY_REFRESH`], else re-read.
    async fn system(&self) -> Result<Option<String>> {
        let mut last = self.last.lock().await;
        if let Some((t, s)) = last.as_ref() {
            if t.elapsed() < MEMORY_REFRESH {
                return Ok(s.clone());
            }
        }
        let (lake, tok, cap) = (self.lake.clone(), self.tokenizer.clone(), self.cap_tokens);
        let s = tokio::task::spawn_blocking(move || -> Result<Option<String>> {
            let lake = crate::lake::Lake::open(&lake)?;
            let hints = accepted_hints(&lake)?;
            Ok(super::memory::memory_system(&hints, cap, |t| tok.encode(t).map(|ids| ids.len()).unwrap_or(usize::MAX)))
        })
        .await
        .map_err(|e| Error::Internal(format!("memory task: {e}")))??;
        *last = Some((Instant::now(), s.clone()));
        Ok(s)
    }
}

/// What a demo run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoSummary {
    /// Score of the initial weights.
    pub before: Score,
    /// Score of the last evaluated version.
    pub after: Score,
    /// Every evaluation, in version order.
    pub evaluations: Vec<CheckpointEval>,
    /// Student turns answered.
    pub interactions: u64,
    /// Sessions run.
    pub sessions: u64,
    /// Requests that failed (should be 0, reloads included).
    pub failed_requests: u64,
    /// Policy versions that answered the students' requests (more than one: the server swapped weights
    /// while the students were working).
    pub versions_seen: Vec<i64>,
    /// The student's sessions, in the order they ended.
    pub sessions_log: Vec<SessionOutcome>,
    /// Their summary: sessions until the preferences were met in 3 consecutive sessions, and more.
    pub sessions_summary: SessionsSummary,
    /// The one-line result: scores before and after with 95 % intervals and the exact McNemar test
    /// ([`DemoReport::result_line`]).
    pub result_line: String,
    /// `report.md`.
    pub report: PathBuf,
    /// Pipeline counts.
    pub run: RunReport,
    /// Wall time, seconds.
    pub seconds: f64,
}

struct Shared {
    client: reqwest::Client,
    proxy: String,
    /// The students, with the tenant each sends (None: no tenant header).
    students: Vec<(Option<String>, Student)>,
    problems: Mutex<std::vec::IntoIter<Problem>>,
    answered: AtomicU64,
    sessions: AtomicU64,
    failed: AtomicU64,
    versions: std::sync::Mutex<std::collections::BTreeSet<i64>>,
    next_session: AtomicUsize,
    /// Sessions that ended, in the order they ended.
    outcomes: std::sync::Mutex<Vec<SessionOutcome>>,
    /// The agent's memory, for [`AgentContext::Memory`].
    memory: Option<Memory>,
    opts: DemoOptions,
}

async fn chat(client: &reqwest::Client, url: &str, body: serde_json::Value, headers: &[(&str, String)]) -> Result<(String, i64)> {
    let mut req = client.post(format!("{url}/v1/chat/completions")).json(&body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.send().await.map_err(|e| Error::Http(e.to_string()))?;
    let status = resp.status();
    let v: serde_json::Value = resp.json().await.map_err(|e| Error::Http(format!("{status}: {e}")))?;
    if !status.is_success() {
        return Err(Error::Http(format!("{status}: {v}")));
    }
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let version = v["policy_version"].as_i64().unwrap_or(-1);
    Ok((text, version))
}

impl Shared {
    /// Whether the students stop: the interaction budget is used and enough policy versions answered
    /// them (`min_versions_served`), or the hard limit `max_interactions` is reached.
    fn budget_used(&self) -> bool {
        let answered = self.answered.load(Ordering::SeqCst);
        if answered >= self.opts.max_interactions.max(self.opts.interactions) as u64 {
            return true;
        }
        let versions = self.versions.lock().map(|v| v.len()).unwrap_or(usize::MAX);
        answered >= self.opts.interactions as u64 && versions >= self.opts.min_versions_served
    }
}

/// One student's work: sessions on training problems until the demo's interaction budget is used
/// ([`Shared::budget_used`]).
async fn student_loop(sh: Arc<Shared>, worker: usize) -> Result<()> {
    let (tenant, student) = &sh.students[worker % sh.students.len()];
    let tenant_header: Vec<(&str, String)> = tenant.iter().map(|t| ("X-Agent-Id", t.clone())).collect();
    loop {
        if sh.budget_used() {
            return Ok(());
        }
        let Some(problem) = sh.problems.lock().await.next() else { return Ok(()) };
        let session = format!("student-{}-{}", sh.next_session.fetch_add(1, Ordering::SeqCst), problem.id);
        sh.sessions.fetch_add(1, Ordering::SeqCst);
        let system = match &sh.opts.context {
            AgentContext::None => None,
            AgentContext::System(s) => Some(s.clone()),
            AgentContext::Memory { .. } => match &sh.memory {
                Some(m) => m.system().await?,
                None => None,
            },
        };
        let mut messages = vec![];
        if let Some(s) = system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": student.first_message(&problem)}));
        let (mut first_answer_satisfied, mut first_version) = (false, -1);
        for turn in 1..=sh.opts.max_turns {
            let body = json!({
                "model": "policy",
                "messages": messages,
                "max_tokens": sh.opts.max_tokens,
                "temperature": sh.opts.temperature,
                "seed": sh.opts.seed.wrapping_add(worker as u64 * 1000 + turn as u64 + problem.id as u64 * 7),
            });
            let mut headers = vec![("X-Session-Id", session.clone()), ("X-Turn-Type", "main".to_string())];
            headers.extend(tenant_header.iter().cloned());
            let (text, version) = match chat(&sh.client, &sh.proxy, body, &headers).await {
                Ok(r) => r,
                Err(e) => {
                    sh.failed.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(session, error = %e, "student request failed");
                    // The session ends here; it counts as not meeting the preferences.
                    if let Ok(mut o) = sh.outcomes.lock() {
                        let ended = o.len() + 1;
                        o.push(SessionOutcome { session: session.clone(), problem_id: problem.id, ended, turns: turn - 1, first_answer_satisfied, satisfied_at_end: false, first_version, failed: true });
                    }
                    break;
                }
            };
            sh.answered.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut v) = sh.versions.lock() {
                v.insert(version);
            }
            let reply = student.reply_at(&text, &problem, turn);
            if turn == 1 {
                (first_answer_satisfied, first_version) = (reply.satisfied, version);
            }
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(json!({"role": "user", "content": reply.text}));
            let last = reply.session_done || turn == sh.opts.max_turns || sh.budget_used();
            if last {
                if let Ok(mut o) = sh.outcomes.lock() {
                    let ended = o.len() + 1;
                    o.push(SessionOutcome { session: session.clone(), problem_id: problem.id, ended, turns: turn, first_answer_satisfied, satisfied_at_end: reply.satisfied, first_version, failed: false });
                }
                // The student's last reply is the next state of the last answer: it reaches the pipeline
                // in a closing side turn (not trained; one token) that also marks the session done.
                let body = json!({"model": "policy", "messages": messages, "max_tokens": 1, "temperature": 0.0});
                let mut headers = vec![("X-Session-Id", session.clone()), ("X-Turn-Type", "side".to_string()), ("X-Session-Done", "true".to_string())];
                headers.extend(tenant_header.iter().cloned());
                if let Err(e) = chat(&sh.client, &sh.proxy, body, &headers).await {
                    sh.failed.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(session, error = %e, "closing request failed");
                }
                break;
            }
        }
    }
}

/// The versions evaluated after the run: the initial weights, then the first, middle and last of the
/// checkpoint versions the server loaded (each once, in order; fewer when it loaded fewer).
pub fn versions_to_evaluate(loaded: &[i64]) -> Vec<i64> {
    let mut v: Vec<i64> = loaded.iter().copied().filter(|&x| x > 0).collect();
    v.sort_unstable();
    v.dedup();
    let mut out = vec![0];
    if let (Some(&first), Some(&last)) = (v.first(), v.last()) {
        out.extend([first, v[(v.len() - 1) / 2], last]);
    }
    out.dedup();
    out
}

/// How long the demo waits, once the students are done and the pipeline is idle, for the server to load
/// the last checkpoints before it evaluates what was written.
const DRAIN_WAIT: Duration = Duration::from_secs(300);

/// Held-out answers per generation call (all 48 default problems in one batch: a decoding step costs
/// about the same for 16 rows as for 48 on CPU).
const EVAL_BATCH: usize = 48;

/// Answers per scoring call.
const SCORE_BATCH: usize = 16;

/// The drift is measured on the initial weights' answers to the first this many held-out problems
/// (scoring all 48 would cost about half a generation pass per version).
pub const DRIFT_PROBLEMS: usize = 16;

/// Greedy answers of `version` (0 = the initial weights, else checkpoint `<run_dir>/<version>` with its
/// LoRA adapters merged) on the held-out problems, and the summed log-prob and token count of the
/// initial weights' answers `v0` to the first [`DRIFT_PROBLEMS`] problems under this version (for the
/// drift; of its own answers, from the generation, when `v0` is `None`). v0's answers come from the
/// file `v0_kept` when it keeps them ([`DemoOptions::v0_kept`]).
fn evaluate_version(
    cfg: &PipelineConfig,
    run_dir: &std::path::Path,
    version: i64,
    problems: &[Problem],
    student: &Student,
    max_tokens: usize,
    v0: Option<&[super::heldout::HeldoutAnswer]>,
    v0_kept: Option<&std::path::Path>,
) -> Result<(Vec<super::heldout::HeldoutAnswer>, (f64, usize))> {
    let dir = run_dir.join(version.to_string());
    let lm = super::heldout::load_policy(cfg, (version > 0).then_some(dir.as_path()))?;
    let answers = match v0_kept {
        Some(kept) if version == 0 => super::heldout::greedy_generations_kept(cfg, &lm, problems, student, max_tokens, EVAL_BATCH, kept)?,
        _ => super::heldout::greedy_generations(&lm, problems, student, max_tokens, EVAL_BATCH)?,
    };
    let lp = match v0 {
        Some(v0) => super::heldout::response_logprob_sum(&lm, &v0[..v0.len().min(DRIFT_PROBLEMS)], SCORE_BATCH)?,
        None => answers.iter().take(DRIFT_PROBLEMS).flat_map(|a| &a.logprobs).fold((0.0, 0), |(s, n), x| (s + f64::from(*x), n + 1)),
    };
    Ok((answers, lp))
}

/// What the evaluation after the run needs (moved to a blocking thread).
struct EvalPlan {
    cfg: PipelineConfig,
    run_dir: PathBuf,
    /// Versions the server loaded, with the student turns answered by then.
    loaded: Vec<(i64, u64)>,
    problems: Vec<Problem>,
    student: Student,
    max_tokens: usize,
    run_id: String,
    prefs: Preferences,
    last_only: bool,
    v0_kept: Option<PathBuf>,
}

impl EvalPlan {
    /// Evaluates [`versions_to_evaluate`] in order: one [`CheckpointEval`] and its `eval_scores` rows each.
    fn run(self) -> Result<(Vec<CheckpointEval>, Vec<crate::schema::EvalScore>)> {
        // The pipeline has stopped: evaluation has every core.
        crate::model::set_threads(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as i32)?;
        let loaded_versions: Vec<i64> = self.loaded.iter().map(|l| l.0).collect();
        let now = crate::schema::now_ms();
        let (mut checkpoints, mut rows) = (vec![], vec![]);
        let mut v0: Option<(Vec<super::heldout::HeldoutAnswer>, f64, usize)> = None;
        let mut versions = versions_to_evaluate(&loaded_versions);
        if self.last_only && versions.len() > 2 {
            versions = vec![versions[0], versions[versions.len() - 1]];
        }
        for version in versions {
            let t = Instant::now();
            let (answers, (lp, n)) = evaluate_version(&self.cfg, &self.run_dir, version, &self.problems, &self.student, self.max_tokens, v0.as_ref().map(|a| a.0.as_slice()), self.v0_kept.as_deref())?;
            let drift = match &v0 {
                None => Some(0.0),
                Some((_, lp0, n0)) if *n0 == n && n > 0 => Some((lp0 - lp) / n as f64),
                Some(_) => None,
            };
            let responses: Vec<(Problem, String)> = answers.iter().map(|a| (a.problem.clone(), a.text.clone())).collect();
            let seen = self.loaded.iter().find(|l| l.0 == version).map(|l| l.1).unwrap_or(0);
            rows.extend(eval_rows(&self.run_id, &self.cfg.name, version, seen as i64, &responses, &self.prefs, now));
            let verdicts: Vec<super::Verdict> = responses.iter().map(|(p, r)| super::check(r, p, &self.prefs)).collect();
            let satisfied = verdicts.iter().map(|v| v.satisfied).collect();
            let words = responses.iter().map(|(_, r)| super::student::count_words(r) as f64).sum::<f64>() / responses.len().max(1) as f64;
            let score = Score::from_verdicts(&verdicts, &self.prefs);
            eprintln!(
                "[demo] version {version}: personalization score {:.3} (accuracy {:.3}, {words:.1} words, drift {} nats/token; {:.0} s)",
                score.fraction_all_satisfied,
                score.accuracy,
                drift.map(|d| format!("{d:.4}")).unwrap_or_else(|| "–".into()),
                t.elapsed().as_secs_f64()
            );
            checkpoints.push(CheckpointEval { version, interactions: seen, score, satisfied, mean_words: Some(words), drift_nats_per_token: drift });
            if v0.is_none() {
                v0 = Some((answers, lp, n));
            }
        }
        Ok((checkpoints, rows))
    }
}

/// Runs the demo (see module docs) and writes its outputs under `opts.out`.
///
/// # Errors
/// Pipeline start-up errors (model, ports), data errors, and the first pipeline task error.
pub async fn run_demo(mut opts: DemoOptions, stop: Stop) -> Result<DemoSummary> {
    let started = Instant::now();
    // A fresh lake and checkpoint folder for every demo run, so runs never mix.
    let lake_dir = opts.out.join("lake");
    let ck_dir = opts.out.join("checkpoints");
    for d in [&lake_dir, &ck_dir] {
        if d.exists() {
            std::fs::remove_dir_all(d).map_err(|e| Error::io("remove", d, e))?;
        }
    }
    opts.pipeline.lake = lake_dir;
    let problems = load_gsm8k(&opts.gsm8k)?;
    let mut split = split_problems(&problems, opts.eval_problems, opts.split_seed.unwrap_or(opts.seed))?.evaluated_on(opts.eval_split)?;
    if opts.split_seed.is_some_and(|s| s != opts.seed) {
        // A replicate of a shared split: its own order of the training problems.
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        split.train.shuffle(&mut rand::rngs::StdRng::seed_from_u64(opts.seed));
    }
    let students: Vec<(Option<String>, Student)> = if opts.fleet.is_empty() {
        vec![(None, Student::new(opts.seed, opts.preferences.clone(), opts.max_turns)?)]
    } else {
        opts.fleet.iter().map(|(t, p)| Ok((Some(t.clone()), Student::new(opts.seed, p.clone(), opts.max_turns)?))).collect::<Result<_>>()?
    };
    let eval_student = heldout_student(&opts)?;
    let run_id = format!("{}-{}", opts.pipeline.name, chrono::Utc::now().format("%Y%m%dT%H%M%S"));
    let only = (!opts.train).then(|| SERVE_ONLY.iter().map(|s| s.to_string()).collect());
    let run_opts = RunOptions { only, until_idle: true, checkpoints_dir: Some(ck_dir.clone()), run_id: Some("demo".into()), resume: false };
    let mut running = start_pipeline(&opts.pipeline, &run_opts, stop.clone()).await?;
    running.keep_serving_when_idle();
    let proxy = running.proxy_url.clone().ok_or_else(|| Error::Internal("demo pipeline has no proxy".into()))?;
    let policy = running.policy.clone().ok_or_else(|| Error::Internal("demo pipeline has no server".into()))?;
    let idle = running.idle_flag();
    let lake = running.lake.clone();
    let finish = tokio::spawn(running.finish());
    let client = crate::net::http_client(Some(Duration::from_secs(900)))?;

    let prefs = opts.preferences.clone();

    let sh = Arc::new(Shared {
        client: client.clone(),
        proxy,
        students,
        problems: Mutex::new(split.train.clone().into_iter()),
        answered: AtomicU64::new(0),
        sessions: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        versions: std::sync::Mutex::new(Default::default()),
        next_session: AtomicUsize::new(0),
        outcomes: std::sync::Mutex::new(vec![]),
        memory: match &opts.context {
            AgentContext::Memory { cap_tokens } => Some(Memory {
                cap_tokens: *cap_tokens,
                tokenizer: Arc::new(crate::model::TextTokenizer::from_dir(&opts.pipeline.policy.model)?),
                lake: lake.root().to_path_buf(),
                last: Mutex::new(None),
            }),
            _ => None,
        },
        opts: opts.clone(),
    });
    eprintln!(
        "[demo] {} students start their homework ({} interactions, more until {} policy versions answered them, at most {})",
        opts.students, opts.interactions, opts.min_versions_served, opts.max_interactions.max(opts.interactions)
    );
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..opts.students.max(1) {
        let sh = sh.clone();
        workers.spawn(student_loop(sh, w));
    }
    // Record every version the server loads while the students work and the pipeline drains, with the
    // student turns answered by then; they are evaluated after the run, when the CPU is free.
    let mut loaded: Vec<(i64, u64)> = vec![];
    let mut students_done = false;
    let mut drained_at: Option<Instant> = None;
    loop {
        if stop.requested() {
            break;
        }
        if !students_done {
            tokio::select! {
                r = workers.join_next() => match r {
                    Some(Ok(Ok(()))) => {}
                    Some(Ok(Err(e))) => tracing::error!(error = %e, "student task failed"),
                    Some(Err(e)) => tracing::error!(error = %e, "student task panicked"),
                    None => {
                        students_done = true;
                        eprintln!("[demo] students done after {} interactions; the pipeline drains", sh.answered.load(Ordering::SeqCst));
                        idle.close_sources();
                    }
                },
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        } else {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let v = policy.version();
        if v > loaded.last().map(|l| l.0).unwrap_or(0) {
            let seen = sh.answered.load(Ordering::SeqCst);
            eprintln!("[demo] the server now serves version {v} ({seen} student turns answered)");
            loaded.push((v, seen));
        }
        if students_done && idle.is_set() && policy.version() == last_checkpoint(&ck_dir.join("demo")) && tenants_caught_up(policy.tenant_versions(), &ck_dir.join("demo")) {
            break;
        }
        // A checkpoint the server failed to load (the reload hook only logs it) must not hang the demo.
        if students_done && idle.is_set() {
            let since = *drained_at.get_or_insert_with(Instant::now);
            if since.elapsed() > DRAIN_WAIT {
                tracing::warn!(served = policy.version(), "the server did not load every last checkpoint within {} s of the pipeline going idle; evaluating what was written", DRAIN_WAIT.as_secs());
                break;
            }
        }
    }
    let interrupted = stop.requested();
    stop.request();
    let run = finish.await.map_err(|e| Error::Internal(format!("pipeline task: {e}")))??;
    let pipeline_seconds = started.elapsed().as_secs_f64();
    let server_time = {
        let t = policy.time_spent();
        ServerBusy {
            chat_seconds: t.chat_seconds,
            completions_seconds: t.completions_seconds,
            reloads: t.reloads,
            reload_load_seconds: t.reload_load_seconds,
            reload_swap_wait_seconds: t.reload_swap_wait_seconds,
        }
    };
    drop(policy);

    // Evaluation: v0 and the first, middle and last versions the server loaded, greedy on the held-out
    // problems, plus each version's drift on v0's answers (skipped when the user interrupted the demo).
    let (checkpoints, rows) = if interrupted || !opts.fleet.is_empty() {
        (vec![], vec![])
    } else {
        let eval = EvalPlan {
            cfg: opts.pipeline.clone(),
            run_dir: ck_dir.join("demo"),
            loaded: loaded.clone(),
            problems: split.eval.clone(),
            student: eval_student,
            max_tokens: opts.max_tokens,
            run_id: run_id.clone(),
            prefs: prefs.clone(),
            last_only: opts.eval_last_only,
            v0_kept: opts.v0_kept.clone(),
        };
        tokio::task::spawn_blocking(move || eval.run()).await.map_err(|e| Error::Internal(format!("evaluation task: {e}")))??
    };
    let eval_seconds = started.elapsed().as_secs_f64() - pipeline_seconds;
    let before = checkpoints.first().map(|c| c.score.clone()).unwrap_or_else(|| Score::from_verdicts(&[], &prefs));
    let samples: Vec<crate::schema::Sample> = crate::lake::Lake::open(lake.root())?.read_table()?;
    let advantages = super::report::AdvantageSummary::of(&samples, opts.pipeline.trainer.w_rl, opts.pipeline.trainer.w_opd);
    let step_rows = crate::lake::Lake::open(lake.root())?.read_table::<crate::schema::TrainStep>()?;
    let steps = super::report::StepAttribution::of(&step_rows);
    crate::lake::Lake::open(lake.root())?.write_rows(&rows, &format!("demo-{run_id}"), 1)?;
    let mut counts: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for (stage, c) in &run.stages {
        counts.insert(stage.clone(), c.outcomes.clone());
    }
    for (table, s) in &run.sinks {
        counts.entry("lake (rows written)".into()).or_default().insert(table.clone(), s.rows_written);
    }
    if let Some(t) = &run.train {
        let e = counts.entry("train".into()).or_default();
        e.insert("steps".into(), t.steps as u64);
        e.insert("samples_trained".into(), t.samples_trained);
        e.insert("checkpoints".into(), t.checkpoints.len() as u64);
    }
    let e = counts.entry("students".into()).or_default();
    e.insert("interactions".into(), sh.answered.load(Ordering::SeqCst));
    e.insert("sessions".into(), sh.sessions.load(Ordering::SeqCst));
    e.insert("failed_requests".into(), sh.failed.load(Ordering::SeqCst));
    let after = checkpoints.last().map(|c| c.score.clone()).unwrap_or_else(|| before.clone());
    let sessions_log = sh.outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    let sessions_summary = SessionsSummary::of(&sessions_log);
    let report = DemoReport {
        title: "nextstate demo: a simulated student teaches the agent".into(),
        run_id: run_id.clone(),
        arm: opts.pipeline.method.as_str().into(),
        preferences: prefs.clone(),
        checkpoints: checkpoints.clone(),
        pipeline_counts: counts,
        advantages: Some(advantages),
        steps,
        sessions: Some(sessions_summary.clone()),
        time: Some(time_table(&PhaseTimes {
            wall_seconds: started.elapsed().as_secs_f64(),
            pipeline_seconds,
            eval_seconds,
            evaluated: checkpoints.len(),
            eval_problems: split.eval.len(),
            server: server_time,
            run: &run,
            steps: &step_rows,
        })),
        notes: vec![
            format!(
                "Policy {} on CPU; {} interactions by {} concurrent students, sessions of at most {} turns; responses up to {} tokens at temperature {}; evaluation greedy on {} held-out problems{}.",
                opts.pipeline.policy.model.display(),
                sh.answered.load(Ordering::SeqCst),
                opts.students,
                opts.max_turns,
                opts.max_tokens,
                opts.temperature,
                split.eval.len(),
                opts.eval_split.report_note()
            ),
            format!(
                "Trainer: method {}, batch {} samples, lr {}, w_rl {}, w_opd {}, LoRA {}.",
                opts.pipeline.method.as_str(),
                opts.pipeline.trainer.batch_size,
                opts.pipeline.trainer.lr,
                opts.pipeline.trainer.w_rl,
                opts.pipeline.trainer.w_opd,
                if opts.pipeline.trainer.lora.enabled { format!("rank {} alpha {}", opts.pipeline.trainer.lora.rank, opts.pipeline.trainer.lora.alpha) } else { "off (full fine-tuning)".into() }
            ),
            "Judge and hint extractor are the embedded rule-based baselines (not LLMs).".into(),
            format!(
                "Evaluated after the run: v0 and the first, middle and last of the {} versions the server loaded ({:?}); drift on v0's answers to the first {} held-out problems.",
                loaded.len(),
                loaded.iter().map(|l| l.0).collect::<Vec<_>>(),
                DRIFT_PROBLEMS.min(split.eval.len())
            ),
        ],
    };
    let files = write_report(&opts.out, &report)?;
    let result_line = report.result_line();
    Ok(DemoSummary {
        before,
        after,
        evaluations: checkpoints,
        interactions: sh.answered.load(Ordering::SeqCst),
        sessions: sh.sessions.load(Ordering::SeqCst),
        failed_requests: sh.failed.load(Ordering::SeqCst),
        versions_seen: sh.versions.lock().map(|v| v.iter().copied().collect()).unwrap_or_default(),
        sessions_log,
        sessions_summary,
        result_line,
        report: files.markdown,
        run,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The policy server's time as the time table uses it (the server's own `ServerTime`, copied field by
/// field: the demo reaches the server only through the pipeline).
#[derive(Default)]
struct ServerBusy {
    chat_seconds: f64,
    completions_seconds: f64,
    reloads: u64,
    reload_load_seconds: f64,
    reload_swap_wait_seconds: f64,
}

/// What [`time_table`] is made from.
struct PhaseTimes<'a> {
    wall_seconds: f64,
    /// Start to the pipeline's stop (model loading, the students' interactions, the drain).
    pipeline_seconds: f64,
    /// The evaluation after it.
    eval_seconds: f64,
    /// Versions evaluated, on `eval_problems` held-out problems each.
    evaluated: usize,
    eval_problems: usize,
    server: ServerBusy,
    run: &'a RunReport,
    steps: &'a [crate::schema::TrainStep],
}

/// The demo report's "Where the time went": the two phases, then the busy time of each part of the
/// pipeline phase (zero rows left out).
fn time_table(t: &PhaseTimes<'_>) -> super::report::TimeTable {
    use super::report::TimeRow;
    let row = |part: &str, seconds: f64, detail: String| TimeRow { part: part.to_string(), seconds, detail };
    let mut rows = vec![row(
        "pipeline phase",
        t.pipeline_seconds,
        "wall time from the start (models loaded, broker and server up) through the students' interactions to the pipeline's stop".into(),
    )];
    if t.server.chat_seconds > 0.0 {
        rows.push(row("policy server: chat generation", t.server.chat_seconds, "inference worker busy on chat batches (the students' turns)".into()));
    }
    if t.server.completions_seconds > 0.0 {
        rows.push(row("policy server: /v1/completions", t.server.completions_seconds, "inference worker busy on completion batches".into()));
    }
    for (stage, c) in &t.run.stages {
        if c.busy_seconds > 0.0 {
            rows.push(row(&format!("stage {stage}"), c.busy_seconds, "wall time in the stage's batch handler (its model and HTTP calls, its emits)".into()));
        }
    }
    if !t.steps.is_empty() {
        let secs = t.steps.iter().map(|s| s.seconds).sum();
        rows.push(row("training steps", secs, format!("{} optimizer steps (`train_steps.seconds`)", t.steps.len())));
    }
    if t.server.reloads > 0 {
        let n = t.server.reloads;
        rows.push(row("shared-policy reloads: checkpoint load", t.server.reload_load_seconds, format!("{n} reloads of the shared policy, loaded beside serving")));
        rows.push(row("shared-policy reloads: wait for the swap", t.server.reload_swap_wait_seconds, format!("{n} reloads; the worker finishes the batch it is decoding first")));
    }
    if t.evaluated > 0 {
        rows.push(row(
            "evaluation phase",
            t.eval_seconds,
            format!("wall time after the pipeline: {} versions greedy on {} held-out problems, every core", t.evaluated, t.eval_problems),
        ));
    }
    super::report::TimeTable { wall_seconds: t.wall_seconds, rows }
}

/// The student whose first messages are the held-out prompts: the student of `split_seed` when set, so
/// runs that share a split (the online ablation's replicates) are evaluated on the very same prompts;
/// else the run's own student (of `seed`).
///
/// # Errors
/// [`Student::new`]'s (preferences that enable nothing).
pub fn heldout_student(opts: &DemoOptions) -> Result<Student> {
    Student::new(opts.split_seed.unwrap_or(opts.seed), opts.preferences.clone(), opts.max_turns)
}

/// Whether `served` (tenant → adapter version the server serves) holds every tenant's newest checkpoint
/// under `run_dir` (per-tenant training: `<run_dir>/<tenant>/<version>`; true when there are none).
fn tenants_caught_up(served: BTreeMap<String, i64>, run_dir: &std::path::Path) -> bool {
    crate::trainer::tenants::tenant_folders(run_dir).unwrap_or_default().iter().all(|t| served.get(t).copied().unwrap_or(0) == last_checkpoint(&run_dir.join(t)))
}

fn last_checkpoint(run_dir: &std::path::Path) -> i64 {
    crate::trainer::latest_complete(run_dir).ok().flatten().map(|(_, m)| m.version).unwrap_or(0)
}

/// Handle on a pipeline started with `keep_serving_when_idle`.
pub use crate::stages::run::IdleHandle;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_table_has_both_phases_and_each_busy_part_and_leaves_out_idle_ones() {
        let mut run = RunReport::default();
        run.stages.insert("judge".into(), crate::stages::StageCounts { busy_seconds: 4.5, ..Default::default() });
        run.stages.insert("reload".into(), crate::stages::StageCounts::default());
        let steps: Vec<crate::schema::TrainStep> = [2.0, 3.5]
            .iter()
            .enumerate()
            .map(|(i, &s)| crate::schema::TrainStep { seconds: s, ..crate::schema::TrainStep::new("r", i as i64 + 1, "combined") })
            .collect();
        let server = ServerBusy { chat_seconds: 90.0, reloads: 2, reload_load_seconds: 0.25, reload_swap_wait_seconds: 3.0, ..Default::default() };
        let t = time_table(&PhaseTimes { wall_seconds: 300.0, pipeline_seconds: 240.0, eval_seconds: 60.0, evaluated: 4, eval_problems: 48, server, run: &run, steps: &steps });
        let got: Vec<(&str, f64)> = t.rows.iter().map(|r| (r.part.as_str(), r.seconds)).collect();
        assert_eq!(
            got,
            vec![
                ("pipeline phase", 240.0),
                ("policy server: chat generation", 90.0),
                ("stage judge", 4.5),
                ("training steps", 5.5),
                ("shared-policy reloads: checkpoint load", 0.25),
                ("shared-policy reloads: wait for the swap", 3.0),
                ("evaluation phase", 60.0),
            ]
        );
        assert_eq!(t.wall_seconds, 300.0);
        assert!(t.rows[3].detail.starts_with("2 optimizer steps"), "{}", t.rows[3].detail);
        assert!(t.rows[6].detail.contains("4 versions greedy on 48 held-out problems"), "{}", t.rows[6].detail);
    }
}
