//! The online protocol (the paper's; an ablation file with an `[online]` section): every arm replicate
//! runs the demo's live loop ([`crate::demo::run::run_demo`]) — the policy serves the simulated student
//! while the pipeline pairs each answer with the student's reply, judges it, extracts hints, computes
//! teacher log-probs, trains and publishes checkpoints, and the server loads each one while the student
//! keeps working — from the same initial weights, with the arm's method and settings.
//!
//! # Replicates
//!
//! Replicate seed s (`[shared] seeds`) sets the policy's sampling seed and the student's phrasing, the
//! order of the training problems (a permutation by s of the split's training problems; the split's own
//! order when s is the split's seed) and the LoRA
//! initialisation (`trainer.seed`). Every arm of a replicate gets the same seed, so arms are compared
//! on the same student; the held-out prompts are the same for every replicate (the problems split and
//! the prompts phrased by `[student] seed`), so v0's answers are too. Unlike the offline mode, the online loop is not bit-reproducible: how many
//! samples a checkpoint holds depends on how fast the trainer runs beside the server.
//!
//! # Measures
//!
//! - **Sessions until stable** ([`crate::demo::sessions`]): sessions until the student's preferences
//!   were met, by the first answer, in 3 consecutive sessions (the paper's v2 Table 3; lower is better),
//!   per replicate; `None` when not reached within the run.
//! - **Final held-out score**: the last checkpoint the server loaded, greedy on the held-out problems,
//!   beside v0 (`[eval] versions = "all"`: also the first and middle checkpoints it loaded, as the demo
//!   does; `"last"`: v0 and the last only), with the statistics of the offline mode
//!   ([`super::compare`]: mean and 95 % t interval over replicates, paired t-tests over problems against
//!   v0 and between arms, Holm-corrected together). v0's answers are generated once, by the first
//!   replicate, and kept in `work/online/v0-answers.json` ([`V0_KEPT`]) for the others (greedy, same
//!   prompts, same weights: the answers a new generation would give); each replicate still scores them.
//!
//! # Baselines
//!
//! An arm with `baseline = "prompted"` or `"memory"` ([`Baseline`]) runs the same loop without the
//! teacher and trainer: the initial weights serve every session with the baseline's system prompt (the
//! student's preferences; or the hints the pipeline accepted so far, [`crate::demo::run::AgentContext`]).
//! So that its count of sessions is never cut shorter than a trained arm's, it runs
//! `[online] max_interactions` student turns (the most a trained arm may run). Its final evaluation
//! is the initial weights answering the held-out problems with the system prompt at the end of the run,
//! recorded as version [`BASELINE_END`] of the arm (no weights changed).
//!
//! # The teacher and the preferences
//!
//! The report opens with the hint-conditioned teacher's own score per hint strategy
//! ([`super::teacher_eval`], from v0's held-out answers, the same held-out prompts; computed once and
//! kept in `work/online/teacher.json`) beside v0, and the share of the teacher − v0 difference each arm
//! transferred; then each preference's rate at v0 and at each arm's final version (mean over
//! replicates), so a user sees which preferences an arm changed.
//!
//! # Resume
//!
//! Each finished arm replicate leaves `work/online/<arm>/run.json` ([`OnlineRun`]); a re-run skips those
//! (one recorded under another arm configuration or [`protocol_fingerprint`] is refused) and restarts
//! an unfinished one from the initial weights. A stop during a replicate's evaluation lets it finish
//! and keeps it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::baselines::{answers_with_system, memory_system, prompted_system, Baseline, MEMORY_TOKENS};
use super::compare::{self, PairRow};
use super::hints::{HintCounts, HintSource, TOP_TEXTS};
use super::config::{AblationConfig, OnlineSettings, ResolvedArm};
use super::layout::{read_marker, write_marker, Layout};
use super::report::AblationSummary;
use super::results::{ArmRow, CheckpointRow, ResponseRow};
use crate::demo::run::{accepted_texts, run_demo, AgentContext, DemoOptions};
use crate::demo::sessions::{chance_of_stable, SessionOutcome, SessionsSummary, STABLE_RUN};
use crate::error::{Error, Result};
use crate::runtime::Stop;
use crate::schema::EvalScore;
use crate::stats::p_text;
use crate::config_err;

/// One arm replicate's online run (`work/online/<arm>/run.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OnlineRun {
    /// Arm name (`<group>.seed=<s>` with several seeds).
    pub arm: String,
    /// The arm as the file names it.
    pub group: String,
    /// Replicate seed.
    pub seed: u64,
    /// Hash of the arm's resolved configuration ([`ResolvedArm::config_hash`]).
    pub config_hash: String,
    /// [`protocol_fingerprint`] of the run: the `[online]`, `[student]` and held-out settings and the
    /// protocol's version (empty in files written before it was recorded: refused on resume).
    #[serde(default)]
    pub protocol: String,
    /// The student's sessions, in the order they ended.
    pub sessions: Vec<SessionOutcome>,
    /// Their summary (sessions until stable, first-answer rate per quarter).
    pub summary: SessionsSummary,
    /// One row per evaluated version (v0, then the first, middle and last checkpoints the server
    /// loaded, or only the last with `[eval] versions = "last"`); only the score columns are filled
    /// (`heldout_*`, gap: `None`).
    pub checkpoints: Vec<CheckpointRow>,
    /// Per evaluated version and held-out problem, the greedy answer and its verdict.
    pub responses: Vec<ResponseRow>,
    /// Student turns answered.
    pub interactions: u64,
    /// Requests that failed (0 expected, reloads included).
    pub failed_requests: u64,
    /// Policy versions that answered the students.
    pub versions_seen: Vec<i64>,
    /// Optimizer steps the trainer took.
    pub train_steps: i64,
    /// Wall time of the run and its evaluation, seconds.
    pub seconds: f64,
    /// The baseline the arm is ([`Baseline`]; module docs), `None` for a trained arm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
    /// A baseline's system prompt at the end of the run, the one its final evaluation used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Accepted hints in the run (the memory's source; counted for every arm that extracts hints).
    #[serde(default)]
    pub accepted_hints: u64,
    /// The run's hint rows and accepted hint texts, counted (empty in files written before they were
    /// recorded).
    #[serde(default)]
    pub hint_counts: HintCounts,
}

/// The version a baseline arm's final evaluation is recorded under (module docs): the end of its run,
/// the initial weights with the baseline's system prompt.
pub const BASELINE_END: i64 = 1;

/// Version of the online protocol's code, part of [`protocol_fingerprint`]: 2 = the held-out prompts are
/// phrased by the student of the split's seed (1 phrased them per replicate).
const PROTOCOL_VERSION: u32 = 2;

/// The file under `work/online/` that keeps v0's greedy held-out answers for every replicate
/// ([`crate::demo::heldout::greedy_generations_kept`]): generated by the first replicate, reused by the
/// others (module docs).
pub const V0_KEPT: &str = "v0-answers.json";

/// Hash of what makes two online runs comparable beyond the arm's own configuration: `[online]`,
/// `[student]`, the held-out problems (`[eval] problems`, and `[eval] split` when it is not the default
/// `test`) and [`PROTOCOL_VERSION`]. A run recorded under another fingerprint is refused, not mixed.
///
/// # Errors
/// JSON errors (not expected).
pub fn protocol_fingerprint(cfg: &AblationConfig) -> Result<String> {
    let mut v = serde_json::json!({"protocol": PROTOCOL_VERSION, "online": cfg.online, "student": cfg.student, "eval_problems": cfg.eval.problems});
    if !cfg.eval.split.is_test() {
        v["eval_split"] = serde_json::json!(cfg.eval.split);
    }
    Ok(crate::schema::content_hash(&[serde_json::to_string(&v)?.as_bytes()]))
}

/// The online settings, or a configuration error naming the file's section.
fn settings(cfg: &AblationConfig) -> Result<&OnlineSettings> {
    cfg.online.as_ref().ok_or_else(|| config_err!("ablation {:?} has no [online] section", cfg.name))
}

/// Runs one arm replicate (module docs) with its demo folder under `dir`.
async fn run_arm(cfg: &AblationConfig, arm: &ResolvedArm, dir: &Path, stop: &Stop) -> Result<OnlineRun> {
    let on = settings(cfg)?;
    let mut pipeline = arm.pipeline.clone();
    pipeline.proxy.spool_dir = dir.join("spool");
    let out = dir.join("demo");
    let prefs = cfg.student.preferences();
    let context = match arm.baseline {
        None => AgentContext::None,
        Some(Baseline::Prompted) => AgentContext::System(prompted_system(&prefs)),
        Some(Baseline::Memory) => AgentContext::Memory { cap_tokens: MEMORY_TOKENS },
    };
    let opts = DemoOptions {
        pipeline,
        out: out.clone(),
        gsm8k: cfg.student.gsm8k.clone(),
        // A baseline runs as many turns as a trained arm may (module docs).
        interactions: if arm.baseline.is_some() { on.max_interactions.max(on.interactions) } else { on.interactions },
        min_versions_served: if arm.baseline.is_some() { 0 } else { on.min_versions_served },
        max_interactions: on.max_interactions.max(on.interactions),
        students: on.students,
        max_turns: cfg.student.max_turns,
        eval_problems: cfg.eval.problems,
        eval_split: cfg.eval.split,
        max_tokens: on.max_tokens,
        temperature: on.temperature,
        seed: arm.seed,
        split_seed: Some(cfg.student.seed),
        preferences: prefs.clone(),
        eval_last_only: cfg.eval.versions == super::config::EvalVersions::Last,
        context,
        train: arm.baseline.is_none(),
        fleet: vec![],
        // Every replicate answers the same held-out prompts with the same initial weights (module docs).
        v0_kept: Some(dir.parent().unwrap_or(dir).join(V0_KEPT)),
    };
    let started = Instant::now();
    // The demo ends with a stop request of its own: a child stop, so the ablation goes on.
    let s = run_demo(opts, stop.child()).await?;
    // Stopped before the evaluation: nothing to keep. Stopped during it (it cannot be interrupted): the
    // replicate is complete and is kept; the caller stops after recording it.
    if stop.requested() && s.evaluations.is_empty() {
        return Err(Error::Cancelled);
    }
    let every = arm.pipeline.trainer.checkpoint_every.max(1) as i64;
    let mut checkpoints: Vec<CheckpointRow> = s
        .evaluations
        .iter()
        .map(|e| CheckpointRow::score_only(&arm.name, e.version, e.version * every, e.interactions as i64, e.score.fraction_all_satisfied, e.score.accuracy, e.score.n as i64))
        .collect();
    let lake = crate::lake::Lake::open(out.join("lake"))?;
    // One read of the hints table for both: the memory's texts and the report's counts.
    let hint_rows: Vec<crate::schema::HintRecord> = lake.read_table()?;
    let hints = accepted_texts(&hint_rows);
    let hint_counts = HintCounts::of(&hint_rows, None);
    let rows: Vec<EvalScore> = lake.read_table()?;
    let mut responses: Vec<ResponseRow> = rows
        .into_iter()
        .map(|r| ResponseRow { arm: arm.name.clone(), version: r.policy_version, problem_id: r.problem_id, satisfied: r.satisfied, correct: r.correct, violations: r.violations, response_text: r.response_text })
        .collect();
    let mut system_prompt = None;
    if let Some(b) = arm.baseline {
        let end = baseline_end(cfg, arm, b, &hints).await?;
        if let Some((system, score, rows)) = end {
            checkpoints.push(CheckpointRow::score_only(&arm.name, BASELINE_END, 0, s.interactions as i64, score.fraction_all_satisfied, score.accuracy, score.n as i64));
            responses.extend(rows);
            system_prompt = Some(system);
        }
    }
    responses.sort_by_key(|r| (r.version, r.problem_id));
    Ok(OnlineRun {
        arm: arm.name.clone(),
        group: arm.group.clone(),
        seed: arm.seed,
        config_hash: arm.config_hash.clone(),
        protocol: protocol_fingerprint(cfg)?,
        sessions: s.sessions_log,
        summary: s.sessions_summary,
        checkpoints,
        responses,
        interactions: s.interactions,
        failed_requests: s.failed_requests,
        versions_seen: s.versions_seen,
        train_steps: s.run.train.as_ref().map(|t| t.steps).unwrap_or(0),
        seconds: started.elapsed().as_secs_f64(),
        baseline: arm.baseline,
        system_prompt,
        accepted_hints: hints.len() as u64,
        hint_counts,
    })
}

/// A baseline's final evaluation (module docs): the initial weights answer the held-out problems
/// greedily with the baseline's system prompt at the end of the run (`hints`: the run's accepted hints,
/// oldest first). `None` for a memory that accepted no hint (it never had a system prompt).
///
/// # Errors
/// Data and model errors.
async fn baseline_end(cfg: &AblationConfig, arm: &ResolvedArm, b: Baseline, hints: &[String]) -> Result<Option<(String, crate::demo::Score, Vec<ResponseRow>)>> {
    let on = settings(cfg)?;
    let (pcfg, name, hints, prefs) = (arm.pipeline.clone(), arm.name.clone(), hints.to_vec(), cfg.student.preferences());
    let (max_tokens, batch) = (on.max_tokens, cfg.eval.batch);
    // The held-out problems and prompts of the demo's evaluation (`DemoOptions.split_seed`).
    let held = Held::of(cfg)?;
    tokio::task::spawn_blocking(move || -> Result<Option<(String, crate::demo::Score, Vec<ResponseRow>)>> {
        let lm = crate::demo::heldout::load_policy(&pcfg, None)?;
        let system = match b {
            Baseline::Prompted => Some(prompted_system(&prefs)),
            Baseline::Memory => memory_system(&hints, MEMORY_TOKENS, |t| lm.encode(t).map(|ids| ids.len()).unwrap_or(usize::MAX)),
        };
        let Some(system) = system else { return Ok(None) };
        let answers = answers_with_system(&lm, &held.problems, &held.student, &system, max_tokens, batch)?;
        let (score, rows) = super::eval::score_answers(&name, BASELINE_END, &answers, &prefs);
        eprintln!("[ablate] online baseline {name}: the initial weights with its system prompt score {:.3} on the held-out problems", score.fraction_all_satisfied);
        Ok(Some((system, score, rows)))
    })
    .await
    .map_err(|e| Error::Internal(format!("baseline evaluation task: {e}")))?
}

/// The arm's `run.json`.
fn marker(lay: &Layout, arm: &str) -> PathBuf {
    lay.work.join("online").join(arm).join("run.json")
}

/// Runs (or resumes) an online ablation (module docs) and writes `report.md` and `results/online.json`.
///
/// # Errors
/// A configuration error without `[online]`, with an arm that trains on teacher generations (offline
/// only), for an unknown `--arms` name, or when an arm changed since its run was recorded; the demo's
/// errors; [`Error::Cancelled`] on a stop request (finished arm replicates are kept).
///
/// The arguments are the fields of `AblateOptions` (`config`, `out`, `arms`, and
/// `metrics_jsonl`, which must be `None` here); `run_ablation` passes them.
pub async fn run_online(cfg: &AblationConfig, out: &Path, arms_selected: Option<&[String]>, metrics_jsonl: Option<&Path>, stop: Stop) -> Result<AblationSummary> {
    let started = Instant::now();
    settings(cfg)?;
    if metrics_jsonl.is_some() {
        return Err(config_err!("--metrics-jsonl is for the offline mode; an online replicate's train_steps are in work/online/<arm>/demo/lake"));
    }
    let lay = Layout::new(out);
    std::fs::create_dir_all(&lay.work).map_err(|e| Error::io("create", &lay.work, e))?;
    crate::lake::write_atomic(&lay.out.join(".gitignore"), b"# bulky run files (lakes, checkpoints); the report and results/ stay\nwork/\n")?;
    let arms = cfg.resolve(&lay.lake())?;
    if let Some(sel) = arms_selected {
        for s in sel {
            if !arms.iter().any(|a| &a.name == s || &a.group == s) {
                return Err(config_err!("--arms: no arm named {s:?} (arms: {})", arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")));
            }
        }
    }
    let protocol = protocol_fingerprint(cfg)?;
    for arm in &arms {
        if !super::plan::selected(arms_selected, arm) {
            continue;
        }
        let path = marker(&lay, &arm.name);
        match read_marker::<OnlineRun>(&path)? {
            Some(r) if r.config_hash == arm.config_hash && r.protocol == protocol => {
                eprintln!("[ablate] online arm {}: recorded ({} sessions, {:.0} s), skipped", arm.name, r.sessions.len(), r.seconds);
                continue;
            }
            Some(r) => {
                return Err(config_err!(
                    "online arm {}: {} changed since {} was written (protocol {:?} recorded, {:?} now); use another --out or delete that file",
                    arm.name,
                    if r.config_hash != arm.config_hash { "its configuration" } else { "the [online], [student] or held-out settings or the protocol's version" },
                    path.display(),
                    r.protocol,
                    protocol
                ))
            }
            None => {}
        }
        if stop.requested() {
            return Err(Error::Cancelled);
        }
        match arm.baseline {
            Some(b) => eprintln!("[ablate] online arm {} (baseline {}, no training): the demo's loop", arm.name, b.as_str()),
            None => eprintln!("[ablate] online arm {} (method {}): the demo's loop", arm.name, arm.pipeline.method.as_str()),
        }
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| lay.work.clone());
        // An unfinished replicate restarts from nothing (its spooled events included).
        super::layout::remove_dir(&dir)?;
        let run = run_arm(cfg, arm, &dir, &stop).await?;
        eprintln!("[ablate] online arm {}: {}; score {} ({:.0} s)", arm.name, run.summary.until_stable_text(), run.checkpoints.iter().map(|c| format!("v{} {:.3}", c.version, c.score)).collect::<Vec<_>>().join(" → "), run.seconds);
        write_marker(&path, &run)?;
        if stop.requested() {
            return Err(Error::Cancelled);
        }
    }
    let mut runs = vec![];
    let mut missing = vec![];
    for arm in &arms {
        match read_marker::<OnlineRun>(&marker(&lay, &arm.name))? {
            // A replicate whose server never loaded a checkpoint has no final version: it is reported
            // apart, not scored as if v0 were its trained weights.
            Some(r) if r.config_hash == arm.config_hash && r.protocol == protocol && !r.checkpoints.iter().any(|c| c.version > 0) => missing.push(match r.baseline {
                Some(_) => format!("{} (no accepted hint in {} student turns, so no memory to evaluate)", arm.name, r.interactions),
                None => format!("{} (no checkpoint reached the server in {} student turns)", arm.name, r.interactions),
            }),
            Some(r) if r.config_hash == arm.config_hash && r.protocol == protocol => runs.push((arm, r)),
            Some(_) => missing.push(format!("{} (recorded under other settings)", arm.name)),
            None => missing.push(arm.name.clone()),
        }
    }
    let arm_rows: Vec<ArmRow> = runs
        .iter()
        .map(|(a, r)| {
            let mut row = ArmRow::of(a, r.train_steps, String::new(), vec![], vec![], vec![])?;
            // A baseline is not its pipeline's method (and never one of the plain arms the ordering
            // sentence compares).
            if let Some(b) = a.baseline {
                row.method = b.as_str().into();
            }
            Ok(row)
        })
        .collect::<Result<_>>()?;
    let checkpoints: Vec<CheckpointRow> = runs.iter().flat_map(|(_, r)| r.checkpoints.clone()).collect();
    let responses: Vec<ResponseRow> = runs.iter().flat_map(|(_, r)| r.responses.clone()).collect();
    let (groups, mut pairs) = compare::summarize(&arm_rows, &checkpoints, &responses)?;
    let mut versus_v0 = compare::versus_initial(&arm_rows, &checkpoints, &responses)?;
    compare::adjust_holm(&mut [&mut versus_v0, &mut pairs]);
    let ordering = compare::ordering(&arm_rows, &pairs);
    let held = Held::of(cfg)?;
    let teacher = match runs.first() {
        Some((a, r)) => Some(teacher(cfg, &lay, a, r, &held, &protocol, &stop).await?),
        None => None,
    };
    let results = lay.results();
    std::fs::create_dir_all(&results).map_err(|e| Error::io("create", &results, e))?;
    let all: Vec<&OnlineRun> = runs.iter().map(|(_, r)| r).collect();
    write_marker(&results.join("online.json"), &serde_json::json!({ "runs": all, "groups": groups, "pairs": pairs, "versus_v0": versus_v0 }))?;
    let report = lay.out.join("report.md");
    let seconds = started.elapsed().as_secs_f64();
    let run_list: Vec<OnlineRun> = runs.iter().map(|(_, r)| r.clone()).collect();
    let prefs_table = preference_rates(&run_list, &held);
    let md = render(cfg, &run_list, &groups, &versus_v0, &pairs, ordering.as_deref(), &missing, seconds, peak_rss_bytes(), teacher.as_ref(), &prefs_table);
    crate::lake::write_atomic(&report, md.as_bytes())?;
    Ok(AblationSummary { report, results, reported: runs.iter().map(|(a, _)| a.name.clone()).collect(), checkpoints, missing, groups, versus_v0, ordering, seconds })
}

/// The held-out problems and the student who phrases them (the demo's evaluation with
/// `split_seed = [student] seed`).
struct Held {
    problems: Vec<crate::demo::Problem>,
    student: crate::demo::Student,
}

impl Held {
    fn of(cfg: &AblationConfig) -> Result<Held> {
        let split = crate::demo::split_problems(&crate::demo::load_gsm8k(&cfg.student.gsm8k)?, cfg.eval.problems, cfg.student.seed)?.evaluated_on(cfg.eval.split)?;
        Ok(Held { problems: split.eval, student: crate::demo::Student::new(cfg.student.seed, cfg.student.preferences(), cfg.student.max_turns)? })
    }

    /// `(problem, answer)` of `rows` (one version of one replicate), in problem order; rows of unknown
    /// problems are left out.
    fn answers(&self, rows: &[&ResponseRow]) -> Vec<(crate::demo::Problem, String)> {
        self.problems.iter().filter_map(|p| rows.iter().find(|r| r.problem_id == p.id as i64).map(|r| (p.clone(), r.response_text.clone()))).collect()
    }
}

/// `work/online/teacher.json`: the teacher's evaluation, once per protocol and model.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TeacherMarker {
    key: String,
    v0: crate::demo::Score,
    teachers: Vec<super::teacher_eval::TeacherEval>,
}

/// v0's score and the hint-conditioned teacher's per hint strategy (module docs), from `first`'s v0
/// answers; read from `work/online/teacher.json` when computed for this protocol and model.
async fn teacher(cfg: &AblationConfig, lay: &Layout, arm: &ResolvedArm, first: &OnlineRun, held: &Held, protocol: &str, stop: &Stop) -> Result<TeacherMarker> {
    let path = lay.work.join("online").join("teacher.json");
    let on = settings(cfg)?;
    let key = crate::schema::content_hash(&[protocol.as_bytes(), arm.pipeline.policy.model.display().to_string().as_bytes(), &(on.max_tokens as u64).to_le_bytes()]);
    if let Some(m) = read_marker::<TeacherMarker>(&path)? {
        if m.key == key {
            return Ok(m);
        }
    }
    let v0 = held.answers(&first.responses.iter().filter(|r| r.version == 0).collect::<Vec<_>>());
    let v0_score = crate::demo::personalization_score(&v0, &cfg.student.preferences());
    let (pcfg, student, stop) = (arm.pipeline.clone(), held.student.clone(), stop.clone());
    let (max_tokens, batch) = (on.max_tokens, cfg.eval.batch);
    let teachers = tokio::task::spawn_blocking(move || {
        let lm = crate::demo::heldout::load_policy(&pcfg, None)?;
        super::teacher_eval::evaluate(&lm, &v0, &student, max_tokens, batch, None, &stop)
    })
    .await
    .map_err(|e| Error::Internal(format!("teacher evaluation task: {e}")))??;
    let m = TeacherMarker { key, v0: v0_score, teachers };
    write_marker(&path, &m)?;
    Ok(m)
}

/// Per preference, its rate at v0 and at each arm group's final version (mean over replicates):
/// `(row label, preference → rate)`, v0 first, then groups in run order.
fn preference_rates(runs: &[OnlineRun], held: &Held) -> Vec<(String, BTreeMap<String, f64>)> {
    let prefs = held.student.preferences();
    let score = |r: &OnlineRun, v: i64| crate::demo::personalization_score(&held.answers(&r.responses.iter().filter(|x| x.version == v).collect::<Vec<_>>()), prefs);
    let mut out: Vec<(String, BTreeMap<String, f64>)> = vec![];
    if let Some(r) = runs.first() {
        out.push(("v0".into(), score(r, 0).per_preference_rate));
    }
    let mut groups: Vec<&str> = vec![];
    for r in runs {
        if !groups.contains(&r.group.as_str()) {
            groups.push(&r.group);
        }
    }
    for g in groups {
        let finals: Vec<BTreeMap<String, f64>> = runs
            .iter()
            .filter(|r| r.group == g)
            .filter_map(|r| r.checkpoints.iter().map(|c| c.version).filter(|v| *v > 0).max().map(|v| score(r, v).per_preference_rate))
            .collect();
        if finals.is_empty() {
            continue;
        }
        let mut mean = BTreeMap::new();
        for k in finals[0].keys() {
            mean.insert(k.clone(), finals.iter().map(|f| f.get(k).copied().unwrap_or(0.0)).sum::<f64>() / finals.len() as f64);
        }
        out.push((g.to_string(), mean));
    }
    out
}

/// This process's peak resident set size (`VmHWM` of `/proc/self/status`), bytes; `None` where it
/// cannot be read (not Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// "12", or ">40" when not reached within 40 sessions.
fn until_stable_cell(s: &SessionsSummary) -> String {
    match s.until_stable {
        Some(k) => k.to_string(),
        None => format!(">{}", s.sessions),
    }
}

/// `report.md` of an online ablation.
#[allow(clippy::too_many_arguments)]
fn render(
    cfg: &AblationConfig,
    runs: &[OnlineRun],
    groups: &[compare::GroupRow],
    versus_v0: &[PairRow],
    pairs: &[PairRow],
    ordering: Option<&str>,
    missing: &[String],
    seconds: f64,
    peak_rss: Option<u64>,
    teacher: Option<&TeacherMarker>,
    pref_rates: &[(String, BTreeMap<String, f64>)],
) -> String {
    let on = cfg.online.clone().unwrap_or_default();
    let mut s = String::new();
    let _ = writeln!(s, "# Online ablation `{}`\n", cfg.name);
    if !cfg.description.trim().is_empty() {
        let _ = writeln!(s, "{}\n", cfg.description.trim());
    }
    let _ = writeln!(
        s,
        "Made by `nextstate ablate` with an `[online]` section (`src/ablate/online.rs`): this invocation took {:.0} s wall (the arm replicates' own runs: {:.0} s in all), peak RSS {}.\n",
        seconds,
        runs.iter().map(|r| r.seconds).sum::<f64>(),
        peak_rss.map(|b| format!("{:.2} GB", b as f64 / 1e9)).unwrap_or_else(|| "not measured".into())
    );
    let _ = writeln!(
        s,
        "Protocol: each arm replicate runs the demo's loop from the same initial weights: {} students at once, {} student turns (more until {} policy versions answered them, at most {}), sessions of at most {} turns, answers up to {} tokens at temperature {}; then {} answer {} held-out problems greedily (the same prompts in every replicate). Replicate seed s sets the sampling and the student's phrasing, the order of the training problems and the LoRA initialisation; all arms of a replicate share s.\n",
        on.students,
        on.interactions,
        on.min_versions_served,
        on.max_interactions.max(on.interactions),
        cfg.student.max_turns,
        on.max_tokens,
        on.temperature,
        if cfg.eval.versions == super::config::EvalVersions::Last { "v0 and the last checkpoint the server loaded" } else { "v0 and the first, middle and last checkpoints the server loaded" },
        cfg.eval.problems
    );
    let _ = writeln!(
        s,
        "**Sessions until stable** (the paper's v2 Table 3; lower is better): the sessions, in the order they ended, until the agent's first answer met every preference in {STABLE_RUN} consecutive sessions; `>N`: not reached within the run's N sessions.\n"
    );
    if let Some(t) = teacher {
        super::report::render_teacher(&mut s, &t.v0, &t.teachers, groups);
    }
    let v0 = versus_v0.first().map(|p| p.b.clone());
    let _ = writeln!(s, "## Result per arm\n");
    let _ = writeln!(s, "| arm | method | replicates | final score, mean [95 % CI over replicates] | final − v0 | Holm p vs v0 | sessions until stable, per replicate | first answers met, by quarter (mean over replicates) | interactions (mean) | failed requests |");
    let _ = writeln!(s, "|---|---|---:|---|---:|---:|---|---|---:|---:|");
    for g in groups {
        let reps: Vec<&OnlineRun> = runs.iter().filter(|r| r.group == g.group).collect();
        let ci = g.low.zip(g.high).map(|(l, h)| format!(" [{l:.3}–{h:.3}]")).unwrap_or_else(|| " (one replicate)".into());
        let vs = versus_v0.iter().find(|p| p.a == g.group);
        let q = mean_quarters(&reps);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3}{ci} | {} | {} | {} | {} | {:.0} | {} |",
            g.group,
            g.method,
            reps.len(),
            g.mean,
            vs.map(|p| format!("{:+.3}", p.mean_diff)).unwrap_or_else(|| "–".into()),
            vs.map(|p| p_text(p.p_holm)).unwrap_or_else(|| "–".into()),
            reps.iter().map(|r| until_stable_cell(&r.summary)).collect::<Vec<_>>().join(", "),
            q.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" → "),
            reps.iter().map(|r| r.interactions as f64).sum::<f64>() / reps.len().max(1) as f64,
            reps.iter().map(|r| r.failed_requests).sum::<u64>()
        );
    }
    if let Some(first) = runs.first() {
        if let Some(c) = first.checkpoints.iter().find(|c| c.version == 0) {
            let _ = writeln!(s, "\nThe initial weights (v0) score {:.3} on the {} held-out problems{}{}.\n", c.score, c.eval_problems, cfg.eval.split.report_note(), v0.map(|_| "; \"final − v0\" and its p come from paired t-tests over those problems, Holm-corrected with every comparison below").unwrap_or(""));
            let n = runs.iter().map(|r| r.summary.sessions).max().unwrap_or(0);
            let _ = writeln!(
                s,
                "Sessions until stable without any learning: a policy whose first answers met the preferences at v0's held-out rate ({:.3}) would have {} consecutive met sessions within 10 sessions with probability {:.2} and within {n} with probability {:.2} (`demo::sessions::chance_of_stable`; v0's greedy held-out rate stands in for its sampled first answers), so a small count is weak evidence of learning here.\n",
                c.score,
                STABLE_RUN,
                chance_of_stable(c.score, STABLE_RUN, 10),
                chance_of_stable(c.score, STABLE_RUN, n)
            );
        }
    }
    if !pairs.is_empty() {
        let _ = writeln!(s, "## Between arms\n");
        let _ = writeln!(s, "| A | B | replicates | A − B [95 % CI] | p | Holm p |");
        let _ = writeln!(s, "|---|---|---:|---|---:|---:|");
        for p in pairs {
            let ci = p.low.zip(p.high).map(|(l, h)| format!(" [{l:+.3}, {h:+.3}]")).unwrap_or_default();
            let _ = writeln!(s, "| {} | {} | {} | {:+.3}{ci} | {} | {} |", p.a, p.b, p.seeds.len(), p.mean_diff, p_text(p.p_value), p_text(p.p_holm));
        }
        s.push('\n');
    }
    if let Some(o) = ordering {
        let _ = writeln!(s, "{o}\n");
    }
    render_preference_rates(&mut s, pref_rates);
    super::hints::render(&mut s, &hint_sources(runs), TOP_TEXTS);
    let _ = writeln!(s, "## Every evaluated version\n");
    let _ = writeln!(s, "| arm | version | student turns answered by then | score | accuracy | optimizer steps in the run |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
    for r in runs {
        for c in &r.checkpoints {
            let version = match r.baseline {
                Some(_) if c.version == BASELINE_END => "end: v0 with its system prompt".to_string(),
                _ => c.version.to_string(),
            };
            let _ = writeln!(s, "| {} | {version} | {} | {:.3} | {:.3} | {} |", r.arm, c.interactions_seen, c.score, c.accuracy, r.train_steps);
        }
    }
    s.push('\n');
    baselines_section(&mut s, runs, groups, pairs);
    if !missing.is_empty() {
        let _ = writeln!(s, "Not in the statistics: {}.\n", missing.join(", "));
    }
    let _ = writeln!(
        s,
        "Not in the online mode yet: context distillation (offline only, `docs/ablation-student`); held-out loss, the teacher gap and the advantage signs per arm (offline only; each replicate's samples are in its `work/online/<arm>/demo/lake`). Unused here: `[data]`, `[eval] max_tokens` and `judge_agreement` (the held-out answers use `[online] max_tokens`; `[eval] batch` is the baselines' generation batch).\n"
    );
    s
}

/// Each arm's hints pooled over its replicates, arms in the order of their first replicate; arms that
/// extracted no hint (binary) are left out.
fn hint_sources(runs: &[OnlineRun]) -> Vec<HintSource> {
    let mut out: Vec<HintSource> = vec![];
    for r in runs.iter().filter(|r| r.hint_counts.hint_rows > 0) {
        match out.iter_mut().find(|s| s.source == r.group) {
            Some(s) => {
                s.counts.merge(&r.hint_counts);
                s.arms = format!("{}, {}", s.arms, r.arm);
            }
            None => out.push(HintSource { source: r.group.clone(), arms: r.arm.clone(), counts: r.hint_counts.clone() }),
        }
    }
    out
}

/// The baselines' part of the report: whether each trained arm beats each baseline (the paired
/// comparisons above, Holm-corrected), and each baseline replicate's system prompt at the end.
fn baselines_section(s: &mut String, runs: &[OnlineRun], groups: &[compare::GroupRow], pairs: &[PairRow]) {
    let is_baseline = |g: &str| runs.iter().any(|r| r.group == g && r.baseline.is_some());
    let bases: Vec<&compare::GroupRow> = groups.iter().filter(|g| is_baseline(&g.group)).collect();
    if bases.is_empty() {
        return;
    }
    let _ = writeln!(s, "## Does training beat the baselines without training?\n");
    for b in &bases {
        let mut beat = vec![];
        let mut not = vec![];
        for g in groups.iter().filter(|g| !is_baseline(&g.group)) {
            let found = pairs.iter().find_map(|p| {
                if p.a == g.group && p.b == b.group {
                    Some((p.mean_diff, p.p_holm))
                } else if p.b == g.group && p.a == b.group {
                    Some((-p.mean_diff, p.p_holm))
                } else {
                    None
                }
            });
            match found {
                Some((d, p)) if d > 0.0 && p < compare::ALPHA => beat.push(format!("{} ({d:+.3}, Holm p {})", g.group, p_text(p))),
                Some((d, p)) => not.push(format!("{} ({d:+.3}, Holm p {})", g.group, p_text(p))),
                None => not.push(format!("{} (no paired replicates)", g.group)),
            }
        }
        let verdict = match (beat.is_empty(), not.is_empty()) {
            (true, true) => "no trained arm in this report".to_string(),
            (false, true) => format!("every trained arm beats it: {}", beat.join(", ")),
            (true, false) => format!("no trained arm beats it at Holm p < 0.05: {}", not.join(", ")),
            (false, false) => format!("beaten by {}; not beaten by {}", beat.join(", "), not.join(", ")),
        };
        let _ = writeln!(s, "- **{}** ({:.3}): {verdict}.", b.group, b.mean);
    }
    let _ = writeln!(s, "\nThe baselines' system prompts at the end of each replicate (the memory's accepted hints, newest kept within {MEMORY_TOKENS} tokens):\n");
    for r in runs.iter().filter(|r| r.baseline.is_some()) {
        let text = r.system_prompt.as_deref().unwrap_or("(none: no hint was accepted)");
        let _ = writeln!(s, "- `{}` ({} accepted hints in the run):\n\n  > {}\n", r.arm, r.accepted_hints, text.replace('\n', "\n  > "));
    }
}

/// "Which preferences moved": each preference's rate at v0 and at each arm's final version.
fn render_preference_rates(s: &mut String, rows: &[(String, BTreeMap<String, f64>)]) {
    let Some((_, first)) = rows.first() else { return };
    let names: Vec<&String> = first.keys().collect();
    let _ = writeln!(s, "## Which preferences moved\n");
    let _ = writeln!(s, "Each preference's rate on the held-out problems at v0 and at each arm's final version (mean over its replicates; a baseline's final version is v0 with its system prompt):\n");
    let _ = writeln!(s, "| version | {} |", names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(" | "));
    let _ = writeln!(s, "|---|{}", "---:|".repeat(names.len()));
    for (label, rates) in rows {
        let base = |n: &String| first.get(n).copied().unwrap_or(0.0);
        let cells: Vec<String> = names
            .iter()
            .map(|n| {
                let r = rates.get(*n).copied().unwrap_or(0.0);
                if label == "v0" {
                    format!("{r:.3}")
                } else {
                    format!("{r:.3} ({:+.3})", r - base(n))
                }
            })
            .collect();
        let _ = writeln!(s, "| {label} | {} |", cells.join(" | "));
    }
    s.push('\n');
}

/// Mean over runs of their first-answer rate per quarter (runs with fewer quarters are left out of the
/// quarters they lack).
fn mean_quarters(runs: &[&OnlineRun]) -> Vec<f64> {
    let n = runs.iter().map(|r| r.summary.first_answer_rate_by_quarter.len()).max().unwrap_or(0);
    (0..n)
        .map(|q| {
            let xs: Vec<f64> = runs.iter().filter_map(|r| r.summary.first_answer_rate_by_quarter.get(q).copied()).collect();
            xs.iter().sum::<f64>() / xs.len().max(1) as f64
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(group: &str, seed: u64, quarters: Vec<f64>, until: Option<usize>, sessions: usize) -> OnlineRun {
        OnlineRun {
            arm: format!("{group}.seed={seed}"),
            group: group.into(),
            seed,
            config_hash: "h".into(),
            protocol: "p".into(),
            sessions: vec![],
            summary: SessionsSummary { sessions, until_stable: until, first_answer_rate_by_quarter: quarters, mean_turns: 1.0 },
            checkpoints: vec![],
            responses: vec![],
            interactions: 10,
            failed_requests: 0,
            versions_seen: vec![0, 1],
            train_steps: 2,
            seconds: 1.0,
            baseline: None,
            system_prompt: None,
            accepted_hints: 0,
            hint_counts: HintCounts::default(),
        }
    }

    #[test]
    fn hints_pool_over_an_arms_replicates_and_binary_is_left_out() {
        let counts = |texts: &[(&str, u64)], rows: u64| HintCounts { hint_rows: rows, texts: texts.iter().map(|(t, n)| (t.to_string(), *n)).collect() };
        let mut a = run("combined", 1, vec![], None, 1);
        a.hint_counts = counts(&[("Keep it short.", 2)], 3);
        let mut b = run("combined", 2, vec![], None, 1);
        b.hint_counts = counts(&[("Keep it short.", 1), ("No markdown.", 1)], 2);
        let c = run("binary", 1, vec![], None, 1);
        let got = hint_sources(&[a, c, b]);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].source.as_str(), got[0].arms.as_str()), ("combined", "combined.seed=1, combined.seed=2"));
        assert_eq!(got[0].counts, counts(&[("Keep it short.", 3), ("No markdown.", 1)], 5));
    }

    #[test]
    fn quarters_average_over_replicates_and_unreached_reads_as_more_than_the_run() {
        let a = run("opd", 1, vec![0.0, 0.5, 1.0, 1.0], Some(9), 12);
        let b = run("opd", 2, vec![0.5, 0.5, 0.0], None, 3);
        assert_eq!(mean_quarters(&[&a, &b]), vec![0.25, 0.5, 0.5, 1.0]);
        assert_eq!(until_stable_cell(&a.summary), "9");
        assert_eq!(until_stable_cell(&b.summary), ">3");
    }

    #[test]
    fn the_protocol_fingerprint_sees_the_settings_that_make_runs_comparable() {
        let cfg = AblationConfig::load(Path::new("ablations/tiny-online.toml")).unwrap();
        let fp = protocol_fingerprint(&cfg).unwrap();
        let changed = |f: &dyn Fn(&mut AblationConfig)| {
            let mut c = cfg.clone();
            f(&mut c);
            protocol_fingerprint(&c).unwrap()
        };
        assert_ne!(changed(&|c| c.online.as_mut().unwrap().interactions += 1), fp);
        assert_ne!(changed(&|c| c.student.seed += 1), fp);
        assert_ne!(changed(&|c| c.eval.problems += 1), fp);
        assert_ne!(changed(&|c| c.eval.split = crate::demo::EvalSplit::Validation), fp);
        // Which versions are evaluated and which arms exist do not change one run's numbers.
        assert_eq!(changed(&|c| c.eval.versions = super::super::config::EvalVersions::All), fp);
        assert_eq!(changed(&|c| c.arms.truncate(1)), fp);
    }

    fn group(name: &str, mean: f64) -> compare::GroupRow {
        compare::GroupRow { group: name.into(), method: name.into(), seeds: vec![1, 2], mean, ..Default::default() }
    }

    fn pair(a: &str, b: &str, d: f64, p_holm: f64) -> PairRow {
        PairRow { a: a.into(), b: b.into(), seeds: vec![1, 2], problems: 4, mean_diff: d, low: None, high: None, p_value: p_holm, p_holm, a_only: 0, b_only: 0 }
    }

    #[test]
    fn the_report_says_which_trained_arm_beats_which_baseline() {
        let mut memory = run("memory", 1, vec![], None, 4);
        (memory.baseline, memory.system_prompt, memory.accepted_hints) = (Some(Baseline::Memory), Some("Notes from earlier conversations with this user:\n- Keep it short.".into()), 3);
        let mut prompted = run("prompted", 1, vec![], None, 4);
        prompted.baseline = Some(Baseline::Prompted);
        let runs = vec![run("binary", 1, vec![], None, 4), run("opd", 1, vec![], None, 4), prompted, memory];
        let groups = vec![group("binary", 0.7), group("opd", 0.5), group("prompted", 0.6), group("memory", 0.25)];
        // Pairs in file order (A before B); against a baseline listed first, the sign flips.
        let pairs = vec![pair("binary", "opd", 0.2, 0.3), pair("binary", "prompted", 0.1, 0.5), pair("binary", "memory", 0.45, 0.001), pair("opd", "prompted", -0.1, 0.6), pair("opd", "memory", 0.25, 0.04), pair("prompted", "memory", 0.35, 0.01)];
        let mut s = String::new();
        baselines_section(&mut s, &runs, &groups, &pairs);
        assert!(s.contains("- **prompted** (0.600): no trained arm beats it at Holm p < 0.05: binary (+0.100, Holm p 0.500), opd (-0.100, Holm p 0.600).\n"), "{s}");
        assert!(s.contains("- **memory** (0.250): every trained arm beats it: binary (+0.450, Holm p 0.001), opd (+0.250, Holm p 0.040).\n"), "{s}");
        assert!(s.contains("- `memory.seed=1` (3 accepted hints in the run):\n\n  > Notes from earlier conversations with this user:\n  > - Keep it short.\n"), "{s}");
        assert!(s.contains("- `prompted.seed=1` (0 accepted hints in the run):\n\n  > (none: no hint was accepted)\n"), "{s}");
        // Without a baseline arm, nothing.
        let mut none = String::new();
        baselines_section(&mut none, &runs[..2], &groups[..2], &pairs[..1]);
        assert_eq!(none, "");
    }

    #[test]
    fn preference_rates_read_against_v0() {
        let rates = |a: f64, b: f64| BTreeMap::from([("concise".to_string(), a), ("no_markdown".to_string(), b)]);
        let mut s = String::new();
        render_preference_rates(&mut s, &[("v0".into(), rates(0.5, 1.0)), ("binary".into(), rates(0.75, 0.875))]);
        assert!(s.contains("| version | concise | no_markdown |\n|---|---:|---:|\n| v0 | 0.500 | 1.000 |\n| binary | 0.750 (+0.250) | 0.875 (-0.125) |\n"), "{s}");
        let mut none = String::new();
        render_preference_rates(&mut none, &[]);
        assert_eq!(none, "");
    }

    #[test]
    fn peak_rss_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().is_some_and(|b| b > 1_000_000));
        }
    }
}
