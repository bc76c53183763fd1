//! `nextstate ablate`: the orchestration (see the module docs of [`crate::ablate`] for the design).
//!
//! Phases, each leaving its result on disk so a killed ablation resumes where it stopped:
//!
//! | phase | output | done when |
//! |---|---|---|
//! | collect (with `[data.collect]`) | `work/source/` lake | `work/state/collect.json` |
//! | replay `[data] sql` into the ablation lake | `work/lake/` | `work/state/replay.json` |
//! | stages per data pipeline | its signals, judgments, hints, teacher rows, samples | `work/state/data-<pipeline>.json` |
//! | judge agreement (with `[eval.judge_agreement]`) | `work/tau/` lake | `work/state/agreement-<pipeline>.json` |
//! | initial-weights evaluation | — | `work/state/base-eval.json` |
//! | train each arm | `work/arms/<arm>/checkpoints/<arm>/<version>/` | `work/arms/<arm>/train.json` (a killed run resumes from its newest checkpoint) |
//! | evaluate each checkpoint | — | `work/arms/<arm>/eval/v<version>.json` |
//! | report | `report.md`, `*.png`, `results/` | written every run from the files above |
//!
//! The data phases hold `work/state/data.lock`, so several processes may run different arms (`--arms`)
//! of the same ablation at once; the others wait for the data.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::collect::{collect, CollectReport};
use super::config::{AblationConfig, ResolvedArm};
use super::eval::{gap_rows, greedy_answers, heldout_rows, judge_agreement, load_policy, sample_advantages, score_answers, VersionEval};
use super::replay::{replay, run_stages, ReplayOptions, ReplayTarget};
use super::results::*;
use crate::config::Method;
use crate::demo::{load_gsm8k, split_problems, Problem, Score, Student};
use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::runtime::Stop;
use crate::schema::{content_hash, Interaction, Judgment, Sample, TurnType};
use crate::stages::run::chain;
use crate::stages::train::{query_samples, train_command, TrainOptions, TrainSource};
use crate::{config_err, input_err};

/// What `nextstate ablate` runs.
#[derive(Debug, Clone)]
pub struct AblateOptions {
    /// The ablation file.
    pub config: AblationConfig,
    /// Output folder (`report.md`, plots, `results/`; bulky work files under `work/`, git-ignored).
    pub out: PathBuf,
    /// Only these arms in this process (None: all).
    pub arms: Option<Vec<String>>,
}

/// What an ablation run produced.
#[derive(Debug, Clone)]
pub struct AblationSummary {
    /// `report.md`.
    pub report: PathBuf,
    /// The results folder (Parquet tables).
    pub results: PathBuf,
    /// One row per evaluated version of each reported arm.
    pub checkpoints: Vec<CheckpointRow>,
    /// Arms reported (complete).
    pub reported: Vec<String>,
    /// Arms not reported yet (not trained or not evaluated by any process).
    pub missing: Vec<String>,
    /// Each arm group's final score over its seeds ([`super::compare`]).
    pub groups: Vec<super::compare::GroupRow>,
    /// Each arm group against the initial weights ([`super::compare::versus_initial`]).
    pub versus_v0: Vec<super::compare::PairRow>,
    /// The sentence on combined > OPD > binary ([`super::compare::ordering`]), when the ablation has
    /// the three plain arms.
    pub ordering: Option<String>,
    /// Wall time of this process, seconds.
    pub seconds: f64,
}

/// The folders of an ablation's output.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `<out>`.
    pub out: PathBuf,
    /// `<out>/work`.
    pub work: PathBuf,
}

impl Layout {
    /// The layout under `out`.
    pub fn new(out: &Path) -> Layout {
        Layout { out: out.to_path_buf(), work: out.join("work") }
    }
    /// Collected source lake.
    pub fn source(&self) -> PathBuf {
        self.work.join("source")
    }
    /// The ablation lake.
    pub fn lake(&self) -> PathBuf {
        self.work.join("lake")
    }
    /// The judge-agreement lake.
    pub fn agreement_lake(&self) -> PathBuf {
        self.work.join("agreement")
    }
    /// Phase markers.
    pub fn state(&self) -> PathBuf {
        self.work.join("state")
    }
    /// An arm's folder.
    pub fn arm(&self, arm: &str) -> PathBuf {
        self.work.join("arms").join(arm)
    }
    /// An arm's checkpoints folder (the run folder is `<this>/<arm>`).
    pub fn checkpoints(&self, arm: &str) -> PathBuf {
        self.arm(arm).join("checkpoints")
    }
    /// `<out>/results`.
    pub fn results(&self) -> PathBuf {
        self.out.join("results")
    }
}

fn read_marker<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(serde_json::from_str(&s).map_err(|e| input_err!("{}: {e} (delete it to redo that phase)", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

fn write_marker<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    crate::lake::write_atomic(path, serde_json::to_string_pretty(value)?.as_bytes())
}

fn remove_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    Ok(())
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::Internal(format!("worker thread: {e}")))?
}

fn check_stop(stop: &Stop) -> Result<()> {
    if stop.requested() {
        return Err(Error::Cancelled);
    }
    Ok(())
}

/// SQL string literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `work/state/data.lock`: held by the process running the data phases.
struct DataLock(PathBuf);

impl DataLock {
    async fn acquire(path: PathBuf, stop: &Stop) -> Result<DataLock> {
        let me = std::process::id();
        loop {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    use std::io::Write;
                    let _ = writeln!(f, "{me}");
                    return Ok(DataLock(path));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder: Option<u32> = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok());
                    let alive = holder.is_some_and(|p| p != me && Path::new(&format!("/proc/{p}")).exists());
                    if !alive {
                        let _ = std::fs::remove_file(&path);
                        continue;
                    }
                    eprintln!("[ablate] another process ({}) is preparing the data; waiting", holder.unwrap_or(0));
                    check_stop(stop)?;
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                Err(e) => return Err(Error::io("create lock", &path, e)),
            }
        }
    }
}

impl Drop for DataLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ReplayMarker {
    rows: u64,
    vote_cache_files: u64,
    teacher_cache_rows: u64,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StagesMarker {
    pipeline: String,
    counts: BTreeMap<String, BTreeMap<String, u64>>,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct AgreementMarker {
    row: AgreementRow,
    sessions: Vec<JudgeSessionRow>,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct BaseEval {
    fingerprint: String,
    score: Score,
    responses: Vec<ResponseRow>,
    gaps: Vec<GapRow>,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainMarker {
    config_hash: String,
    train_sql: String,
    sample_ids: Vec<String>,
    interaction_ids: Vec<String>,
    sample_types: Vec<String>,
    steps: i64,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct EvalMarker {
    fingerprint: String,
    eval: VersionEval,
    seconds: f64,
}

/// The interactions of the ablation lake in replay order, and the held-out sessions.
#[derive(Debug, Clone)]
pub struct Stream {
    /// Training main turns in order (event time, session, turn index, id).
    pub order: Vec<String>,
    /// 1-based position of each training main turn.
    pub rank: HashMap<String, i64>,
    /// Held-out sessions (the last `heldout_sessions` by first event time).
    pub heldout: Vec<String>,
    /// Sessions in the data.
    pub sessions: usize,
    /// Main turns in the data.
    pub main_turns: usize,
}

/// Orders `rows` and splits off the last `heldout` sessions (by first event time, then session id).
pub fn stream(rows: &[Interaction], heldout: usize) -> Stream {
    let mut main: Vec<&Interaction> = rows.iter().filter(|i| i.turn_type == TurnType::Main).collect();
    main.sort_by(|a, b| (a.event_time, &a.session_id, a.turn_index, &a.interaction_id).cmp(&(b.event_time, &b.session_id, b.turn_index, &b.interaction_id)));
    let mut first: Vec<(i64, String)> = vec![];
    let mut seen = HashSet::new();
    for i in &main {
        if seen.insert(i.session_id.clone()) {
            first.push((i.event_time, i.session_id.clone()));
        }
    }
    first.sort();
    let cut = first.len().saturating_sub(heldout);
    let held: Vec<String> = first[cut..].iter().map(|(_, s)| s.clone()).collect();
    let held_set: HashSet<&String> = held.iter().collect();
    let order: Vec<String> = main.iter().filter(|i| !held_set.contains(&i.session_id)).map(|i| i.interaction_id.clone()).collect();
    let rank = order.iter().enumerate().map(|(k, id)| (id.clone(), k as i64 + 1)).collect();
    Stream { order, rank, heldout: held, sessions: first.len(), main_turns: main.len() }
}

/// The query an arm's trainer reads: its data pipeline's samples outside the held-out sessions, in
/// interaction order, at most `limit`.
pub fn train_sql(pipeline: &str, heldout: &[String], limit: usize) -> String {
    let not_in = if heldout.is_empty() { String::new() } else { format!(" AND s.session_id NOT IN ({})", heldout.iter().map(|s| lit(s)).collect::<Vec<_>>().join(", ")) };
    format!(
        "SELECT s.* FROM samples s JOIN interactions i ON s.interaction_id = i.interaction_id \
         WHERE s.pipeline = {}{not_in} ORDER BY i.event_time, i.session_id, i.turn_index, s.sample_id LIMIT {limit}",
        lit(pipeline)
    )
}

/// The held-out samples of a data pipeline, in interaction order.
pub fn heldout_sql(pipeline: &str, heldout: &[String]) -> Option<String> {
    if heldout.is_empty() {
        return None;
    }
    Some(format!(
        "SELECT s.* FROM samples s JOIN interactions i ON s.interaction_id = i.interaction_id \
         WHERE s.pipeline = {} AND s.session_id IN ({}) ORDER BY i.event_time, i.session_id, i.turn_index, s.sample_id",
        lit(pipeline),
        heldout.iter().map(|s| lit(s)).collect::<Vec<_>>().join(", ")
    ))
}

/// Everything the arms share, prepared once.
struct Prepared {
    arms: Vec<ResolvedArm>,
    stream: Stream,
    eval_problems: Vec<Problem>,
    student: Student,
    /// Hinted held-out samples (the gap set), from the first data pipeline that builds hints.
    gap_samples: Vec<Sample>,
    eval_fingerprint: String,
}

fn eval_fingerprint(cfg: &AblationConfig) -> Result<String> {
    // Which versions are evaluated does not change any one evaluation's numbers.
    let eval = super::config::EvalSettings { versions: Default::default(), ..cfg.eval.clone() };
    let v = serde_json::json!({"eval": eval, "student": cfg.student, "heldout": cfg.data.heldout_sessions});
    Ok(content_hash(&[serde_json::to_string(&v)?.as_bytes()]))
}

fn data_fingerprint(cfg: &AblationConfig, arms: &[ResolvedArm]) -> Result<String> {
    let model = arms.first().map(|a| a.pipeline.policy.model.clone());
    let v = serde_json::json!({"data": cfg.data, "student": cfg.student, "model": model, "eval_problems": cfg.eval.problems});
    Ok(content_hash(&[serde_json::to_string(&v)?.as_bytes()]))
}

/// Distinct data pipelines in arm order: (pipeline name, the first arm using it).
fn data_pipelines(arms: &[ResolvedArm]) -> Vec<&ResolvedArm> {
    let mut seen = HashSet::new();
    arms.iter().filter(|a| seen.insert(a.data_pipeline.clone())).collect()
}

/// Whether `arm` is among `--arms` (by name or group); everything is selected without `--arms`.
fn selected(sel: Option<&[String]>, arm: &ResolvedArm) -> bool {
    sel.is_none_or(|sel| sel.contains(&arm.name) || sel.contains(&arm.group))
}

/// `data_pipelines` that a run of the `--arms` selection needs: those of the selected arms, and the
/// first one that builds hints (the held-out gap set every arm is evaluated on comes from it).
fn needed_data_pipelines<'a>(arms: &'a [ResolvedArm], sel: Option<&[String]>) -> Vec<&'a ResolvedArm> {
    let gap_source = arms.iter().find(|a| a.pipeline.method.uses_hints()).map(|a| a.data_pipeline.clone());
    data_pipelines(arms)
        .into_iter()
        .filter(|d| Some(&d.data_pipeline) == gap_source.as_ref() || arms.iter().any(|a| a.data_pipeline == d.data_pipeline && selected(sel, a)))
        .collect()
}

async fn prepare_data(cfg: &AblationConfig, arms: &[ResolvedArm], sel: Option<&[String]>, lay: &Layout, stop: &Stop) -> Result<()> {
    let state = lay.state();
    std::fs::create_dir_all(&state).map_err(|e| Error::io("create", &state, e))?;
    let _lock = DataLock::acquire(state.join("data.lock"), stop).await?;
    let fp = data_fingerprint(cfg, arms)?;
    let fp_path = state.join("data-fingerprint.json");
    match read_marker::<String>(&fp_path)? {
        Some(old) if old != fp => {
            return Err(config_err!(
                "{}: the [data]/[student] settings or the model changed since this folder's data was made; use a new --out (or delete {})",
                lay.out.display(),
                lay.work.display()
            ))
        }
        Some(_) => {}
        None => write_marker(&fp_path, &fp)?,
    }
    let base = &arms[0].pipeline;
    // 1. collect
    let source = match (&cfg.data.collect, &cfg.data.lake) {
        (Some(c), _) => {
            let marker = state.join("collect.json");
            if read_marker::<CollectReport>(&marker)?.is_none() {
                check_stop(stop)?;
                remove_dir(&lay.source())?;
                let problems = load_gsm8k(&cfg.student.gsm8k)?;
                let split = split_problems(&problems, cfg.eval.problems, cfg.student.seed)?;
                let student = Student::new(cfg.student.seed, cfg.student.preferences(), cfg.student.max_turns)?;
                eprintln!("[ablate] collecting {} student sessions with the frozen initial policy", c.sessions);
                let (pcfg, c, seed) = (base.clone(), c.clone(), cfg.student.seed);
                let (rows, report) = blocking(move || {
                    let lm = load_policy(&pcfg, None)?;
                    collect(&lm, &split.train, &student, &c, seed)
                })
                .await?;
                Lake::open(lay.source())?.write_rows(&rows, "collect", 1)?;
                eprintln!(
                    "[ablate] collected {} interactions in {} sessions ({} satisfied, {} tokens) in {:.0} s",
                    report.interactions, report.sessions, report.satisfied, report.tokens, report.seconds
                );
                write_marker(&marker, &report)?;
            }
            lay.source()
        }
        (None, Some(l)) => l.clone(),
        (None, None) => return Err(config_err!("[data] needs a lake or [data.collect]")),
    };
    // 2. replay into the ablation lake
    let marker = state.join("replay.json");
    if read_marker::<ReplayMarker>(&marker)?.is_none() {
        check_stop(stop)?;
        remove_dir(&lay.lake())?;
        let t = Instant::now();
        let opts = ReplayOptions {
            source_lake: source.clone(),
            sql: cfg.data.sql.clone(),
            table: "interactions".into(),
            target: ReplayTarget::Lake { dir: lay.lake(), pipeline: base.clone(), stages: Some(vec![]) },
        };
        let r = replay(&opts, stop.clone()).await?;
        if r.rows == 0 {
            return Err(input_err!("[data] sql returned no interactions from {}", source.display()));
        }
        eprintln!("[ablate] replayed {} interactions into {}", r.rows, lay.lake().display());
        write_marker(
            &marker,
            &ReplayMarker { rows: r.rows, vote_cache_files: r.vote_cache_files, teacher_cache_rows: r.teacher_cache_rows, seconds: t.elapsed().as_secs_f64() },
        )?;
    }
    // 3. the stages of each data pipeline the selected arms need
    for arm in needed_data_pipelines(arms, sel) {
        let marker = state.join(format!("data-{}.json", arm.data_pipeline));
        if read_marker::<StagesMarker>(&marker)?.is_some() {
            continue;
        }
        check_stop(stop)?;
        let t = Instant::now();
        let stages: Vec<String> = chain(arm.pipeline.method).into_iter().map(String::from).collect();
        eprintln!("[ablate] data pipeline {} ({}): stages {}", arm.data_pipeline, arm.pipeline.method.as_str(), stages.join(", "));
        let r = run_stages(&arm.pipeline, &stages, stop.clone()).await?;
        check_stop(stop)?;
        let counts: BTreeMap<String, BTreeMap<String, u64>> = r.stages.iter().map(|(k, v)| (k.clone(), v.outcomes.clone())).collect();
        for (s, c) in &counts {
            eprintln!("[ablate]   {s}: {}", c.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
        }
        write_marker(&marker, &StagesMarker { pipeline: arm.data_pipeline.clone(), counts, seconds: t.elapsed().as_secs_f64() })?;
    }
    // 4. judge agreement on labelled logs
    if let Some(ag) = &cfg.eval.judge_agreement {
        agreement_phase(ag, arms, lay, stop).await?;
    }
    Ok(())
}

/// The judge configurations of the arms that use the judge: (key, first data pipeline, arm names).
fn judge_groups(arms: &[ResolvedArm]) -> Result<Vec<(String, ResolvedArm, Vec<String>)>> {
    let mut groups: Vec<(String, ResolvedArm, Vec<String>)> = vec![];
    for a in arms.iter().filter(|a| a.pipeline.method.uses_judge()) {
        let key = content_hash(&[serde_json::to_string(&(&a.pipeline.judge, &a.pipeline.signals))?.as_bytes()]);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.2.push(a.name.clone()),
            None => groups.push((key, a.clone(), vec![a.name.clone()])),
        }
    }
    Ok(groups)
}

async fn agreement_phase(ag: &super::config::AgreementSettings, arms: &[ResolvedArm], lay: &Layout, stop: &Stop) -> Result<()> {
    let state = lay.state();
    let groups = judge_groups(arms)?;
    if groups.is_empty() {
        return Ok(());
    }
    let ingest_marker = state.join("agreement-ingest.json");
    if read_marker::<serde_json::Value>(&ingest_marker)?.is_none() {
        check_stop(stop)?;
        remove_dir(&lay.agreement_lake())?;
        let t = Instant::now();
        let mut icfg = arms[0].pipeline.clone();
        icfg.lake = lay.agreement_lake();
        let format = match ag.format.parse::<crate::ingest::FormatChoice>()? {
            crate::ingest::FormatChoice::Auto => None,
            crate::ingest::FormatChoice::Fixed(f) => Some(f),
        };
        let args = crate::stages::source::IngestArgs { files: ag.files.clone(), format, default_turn_type: TurnType::Main, sink: true, progress: false };
        let r = crate::stages::source::ingest(&icfg, &args, stop.clone()).await?;
        eprintln!("[ablate] judge agreement: ingested {} interactions from {} file(s)", r.interactions, ag.files.len());
        write_marker(&ingest_marker, &serde_json::json!({"interactions": r.interactions, "dead_letters": r.dead_letters, "seconds": t.elapsed().as_secs_f64()}))?;
    }
    for (_, arm, names) in groups {
        let marker = state.join(format!("agreement-{}.json", arm.data_pipeline));
        if read_marker::<AgreementMarker>(&marker)?.is_some() {
            continue;
        }
        check_stop(stop)?;
        let t = Instant::now();
        let mut jcfg = arm.pipeline.clone();
        jcfg.lake = lay.agreement_lake();
        jcfg.method = Method::Binary;
        run_stages(&jcfg, &["signals".to_string(), "judge".to_string()], stop.clone()).await?;
        check_stop(stop)?;
        let lake = Lake::open(lay.agreement_lake())?;
        let interactions = lake.read_table::<Interaction>()?;
        let judgments = lake.read_table::<Judgment>()?;
        let (row, sessions) = judge_agreement(&arm.data_pipeline, &names.join(","), &interactions, &judgments, ag.success_threshold);
        eprintln!(
            "[ablate] judge agreement ({}): {}/{} sessions agree with the outcome (TP {} FP {} TN {} FN {})",
            arm.data_pipeline, row.agree, row.sessions_judged, row.true_pos, row.false_pos, row.true_neg, row.false_neg
        );
        write_marker(&marker, &AgreementMarker { row, sessions, seconds: t.elapsed().as_secs_f64() })?;
    }
    Ok(())
}

async fn prepared(cfg: &AblationConfig, arms: Vec<ResolvedArm>, lay: &Layout) -> Result<Prepared> {
    let lake = Lake::open(lay.lake())?;
    let stream = stream(&lake.read_table::<Interaction>()?, cfg.data.heldout_sessions);
    let problems = load_gsm8k(&cfg.student.gsm8k)?;
    let split = split_problems(&problems, cfg.eval.problems, cfg.student.seed)?;
    let student = Student::new(cfg.student.seed, cfg.student.preferences(), cfg.student.max_turns)?;
    let gap_samples = match arms.iter().find(|a| a.pipeline.method.uses_hints()).and_then(|a| heldout_sql(&a.data_pipeline, &stream.heldout)) {
        Some(q) => query_samples(&lake, &q).await?.into_iter().filter(|s| s.hint_id.is_some() && s.teacher_logprobs.is_some()).collect(),
        None => vec![],
    };
    Ok(Prepared { arms, stream, eval_problems: split.eval, student, gap_samples, eval_fingerprint: eval_fingerprint(cfg)? })
}

async fn base_eval(cfg: &AblationConfig, p: &Prepared, lay: &Layout, stop: &Stop) -> Result<BaseEval> {
    let path = lay.state().join("base-eval.json");
    if let Some(b) = read_marker::<BaseEval>(&path)? {
        if b.fingerprint == p.eval_fingerprint {
            return Ok(b);
        }
    }
    check_stop(stop)?;
    eprintln!("[ablate] evaluating the initial weights on {} held-out problems", p.eval_problems.len());
    let t = Instant::now();
    let (pcfg, problems, student, gap_set) = (p.arms[0].pipeline.clone(), p.eval_problems.clone(), p.student.clone(), p.gap_samples.clone());
    let (max_tokens, batch, prefs) = (cfg.eval.max_tokens, cfg.eval.batch, cfg.student.preferences());
    let (score, responses, gaps) = blocking(move || {
        let lm = load_policy(&pcfg, None)?;
        let answers = greedy_answers(&lm, &problems, &student, max_tokens, batch)?;
        let (score, responses) = score_answers("", 0, &answers, &prefs);
        let gaps = gap_rows(&lm, "", 0, &gap_set, pcfg.trainer.batch_size)?;
        Ok((score, responses, gaps))
    })
    .await?;
    let b = BaseEval { fingerprint: p.eval_fingerprint.clone(), score, responses, gaps, seconds: t.elapsed().as_secs_f64() };
    eprintln!("[ablate] initial weights: personalization score {:.3} (accuracy {:.3})", b.score.fraction_all_satisfied, b.score.accuracy);
    write_marker(&path, &b)?;
    Ok(b)
}

async fn train_arm(cfg: &AblationConfig, arm: &ResolvedArm, p: &Prepared, lay: &Layout, stop: &Stop) -> Result<TrainMarker> {
    let dir = lay.arm(&arm.name);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
    let path = dir.join("train.json");
    if let Some(m) = read_marker::<TrainMarker>(&path)? {
        if m.config_hash != arm.config_hash {
            return Err(config_err!("arm {} changed since it was trained in {} (delete that folder, or give the changed arm a new name)", arm.name, dir.display()));
        }
        return Ok(m);
    }
    // An interrupted run of the same arm resumes; a run of a changed arm must not.
    let started = dir.join("arm.json");
    match read_marker::<String>(&started)? {
        Some(h) if h != arm.config_hash => {
            return Err(config_err!("arm {} changed since its training started in {} (delete that folder, or rename the arm)", arm.name, dir.display()))
        }
        _ => write_marker(&started, &arm.config_hash)?,
    }
    check_stop(stop)?;
    let t = Instant::now();
    let sql = train_sql(&arm.data_pipeline, &p.stream.heldout, cfg.shared.steps * cfg.shared.batch_size);
    let lake = Lake::open(lay.lake())?;
    let samples = query_samples(&lake, &sql).await?;
    if samples.is_empty() {
        // Reported with its initial weights only (e.g. OPD on data where no hint was accepted).
        eprintln!("[ablate] arm {}: no training samples in data pipeline {}; only v0 is evaluated", arm.name, arm.data_pipeline);
    } else {
        eprintln!("[ablate] arm {}: training on {} samples (batch {}, method {})", arm.name, samples.len(), cfg.shared.batch_size, arm.pipeline.method.as_str());
        let opts = TrainOptions {
            source: TrainSource::Sql(sql.clone()),
            resume: true,
            run_id: Some(arm.name.clone()),
            checkpoints_dir: lay.checkpoints(&arm.name),
            max_steps: None,
        };
        let report = train_command(&arm.pipeline, &opts, true, stop.clone()).await?;
        check_stop(stop)?;
        eprintln!("[ablate] arm {}: {} steps this run, last loss {:?}", arm.name, report.steps, report.last_loss);
    }
    let steps = crate::trainer::latest_complete(&lay.checkpoints(&arm.name).join(&arm.name))?.map(|(_, m)| m.step).unwrap_or(0);
    let m = TrainMarker {
        config_hash: arm.config_hash.clone(),
        train_sql: sql,
        sample_ids: samples.iter().map(|s| s.sample_id.clone()).collect(),
        interaction_ids: samples.iter().map(|s| s.interaction_id.clone()).collect(),
        sample_types: samples.iter().map(|s| s.sample_type.as_str().to_string()).collect(),
        steps,
        seconds: t.elapsed().as_secs_f64(),
    };
    write_marker(&path, &m)?;
    Ok(m)
}

/// (version, step, interactions seen, samples seen, checkpoint folder) of one version of an arm.
type VersionRow = (i64, i64, i64, i64, Option<PathBuf>);

/// Every version of an arm ([`VersionRow`]), v0 first.
fn versions(lay: &Layout, arm: &str, rank: &HashMap<String, i64>) -> Result<Vec<VersionRow>> {
    let scan = crate::trainer::scan(&lay.checkpoints(arm).join(arm))?;
    let mut out = vec![(0, 0, 0, 0, None)];
    let (mut seen, mut samples, mut last) = (0i64, 0i64, 0i64);
    for (path, m) in scan.complete {
        for l in m.lineage.iter().filter(|l| l.trained) {
            samples += 1;
            seen = seen.max(rank.get(&l.interaction_id).copied().unwrap_or(0));
        }
        last = last.max(m.step);
        out.push((m.version, last, seen, samples, Some(path)));
    }
    Ok(out)
}

/// The versions of `arm` that `[eval] versions` asks for ([`versions`], then
/// [`super::config::EvalVersions::select`]).
fn evaluated_versions(cfg: &AblationConfig, lay: &Layout, arm: &str, rank: &HashMap<String, i64>) -> Result<Vec<VersionRow>> {
    Ok(cfg.eval.versions.select(&versions(lay, arm, rank)?))
}

async fn eval_arm(cfg: &AblationConfig, arm: &ResolvedArm, p: &Prepared, base: &BaseEval, lay: &Layout, stop: &Stop) -> Result<Vec<VersionEval>> {
    let lake = Lake::open(lay.lake())?;
    let heldout: Vec<Sample> = match heldout_sql(&arm.data_pipeline, &p.stream.heldout) {
        Some(q) => query_samples(&lake, &q).await?,
        None => vec![],
    };
    let dir = lay.arm(&arm.name).join("eval");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
    let mut out = vec![];
    for (version, step, seen, samples_seen, ck) in evaluated_versions(cfg, lay, &arm.name, &p.stream.rank)? {
        let path = dir.join(format!("v{version}.json"));
        if let Some(m) = read_marker::<EvalMarker>(&path)? {
            if m.fingerprint == p.eval_fingerprint {
                out.push(m.eval);
                continue;
            }
        }
        check_stop(stop)?;
        let t = Instant::now();
        let name = arm.name.clone();
        let (pcfg, problems, student, gap_set, held) = (arm.pipeline.clone(), p.eval_problems.clone(), p.student.clone(), p.gap_samples.clone(), heldout.clone());
        let (max_tokens, batch, prefs) = (cfg.eval.max_tokens, cfg.eval.batch, cfg.student.preferences());
        let base_part = (version == 0).then(|| (base.score.clone(), base.responses.clone(), base.gaps.clone()));
        let eval = blocking(move || {
            let lm = load_policy(&pcfg, ck.as_deref())?;
            let (score, responses, gaps) = match base_part {
                Some((score, responses, gaps)) => {
                    let responses = responses.into_iter().map(|r| ResponseRow { arm: name.clone(), ..r }).collect();
                    let gaps = gaps.into_iter().map(|g| GapRow { arm: name.clone(), ..g }).collect();
                    (score, responses, gaps)
                }
                None => {
                    let answers = greedy_answers(&lm, &problems, &student, max_tokens, batch)?;
                    let (score, responses) = score_answers(&name, version, &answers, &prefs);
                    (score, responses, gap_rows(&lm, &name, version, &gap_set, pcfg.trainer.batch_size)?)
                }
            };
            let heldout = heldout_rows(&lm, &name, version, pcfg.method, &pcfg.trainer, &held)?;
            Ok(VersionEval { version, step, interactions_seen: seen, samples_seen, score, responses, heldout, gaps })
        })
        .await?;
        let seconds = t.elapsed().as_secs_f64();
        eprintln!(
            "[ablate] arm {} v{version} (step {step}, {seen} interactions): personalization score {:.3}, accuracy {:.3} ({seconds:.0} s)",
            arm.name, eval.score.fraction_all_satisfied, eval.score.accuracy
        );
        write_marker(&path, &EvalMarker { fingerprint: p.eval_fingerprint.clone(), eval: eval.clone(), seconds })?;
        out.push(eval);
    }
    Ok(out)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (mut s, mut n) = (0.0, 0usize);
    for x in v {
        s += x;
        n += 1;
    }
    (n > 0).then(|| s / n as f64)
}

/// The `checkpoint_metrics` row of one evaluated version.
fn checkpoint_row(arm: &str, e: &VersionEval, problems: usize) -> CheckpointRow {
    let h = &e.heldout;
    let hm = |f: fn(&HeldoutRow) -> f64| mean(h.iter().map(f));
    CheckpointRow {
        arm: arm.into(),
        version: e.version,
        step: e.step,
        interactions_seen: e.interactions_seen,
        samples_seen: e.samples_seen,
        score: e.score.fraction_all_satisfied,
        accuracy: e.score.accuracy,
        eval_problems: problems as i64,
        heldout_samples: h.len() as i64,
        heldout_loss: hm(|r| r.loss),
        heldout_pg_loss: hm(|r| r.pg_loss),
        heldout_advantage: hm(|r| r.advantage),
        heldout_ppo_kl: hm(|r| r.ppo_kl),
        heldout_entropy: hm(|r| r.entropy),
        heldout_topk_kl: hm(|r| r.topk_kl),
        gap_samples: e.gaps.len() as i64,
        teacher_gap: mean(e.gaps.iter().map(|g| g.gap)),
        student_logprob: mean(e.gaps.iter().map(|g| g.student_logprob)),
    }
}

/// Runs (or resumes) an ablation and writes its report (see the module docs).
///
/// # Errors
/// Configuration errors (an arm or the data changed since this folder was made), data, model, pipeline
/// and I/O errors; [`Error::Cancelled`] on a stop request (everything finished so far is kept).
pub async fn run_ablation(opts: &AblateOptions, stop: Stop) -> Result<AblationSummary> {
    let started = Instant::now();
    let cfg = &opts.config;
    let lay = Layout::new(&opts.out);
    std::fs::create_dir_all(&lay.work).map_err(|e| Error::io("create", &lay.work, e))?;
    crate::lake::write_atomic(&lay.out.join(".gitignore"), b"# bulky run files (lakes, checkpoints); the report, plots and results/ stay\nwork/\n")?;
    let arms = cfg.resolve(&lay.lake())?;
    if let Some(sel) = &opts.arms {
        for s in sel {
            if !arms.iter().any(|a| &a.name == s || &a.group == s) {
                return Err(config_err!("--arms: no arm named {s:?} (arms: {})", arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")));
            }
        }
    }
    if cfg.shared.threads > 0 {
        crate::model::set_threads(cfg.shared.threads as i32)?;
    }
    let sel = opts.arms.as_deref();
    prepare_data(cfg, &arms, sel, &lay, &stop).await?;
    let p = prepared(cfg, arms, &lay).await?;
    let base = base_eval(cfg, &p, &lay, &stop).await?;
    for arm in &p.arms {
        if !selected(sel, arm) {
            continue;
        }
        train_arm(cfg, arm, &p, &lay, &stop).await?;
        eval_arm(cfg, arm, &p, &base, &lay, &stop).await?;
    }
    let summary = super::report::write_all(cfg, &p.arms, &p.stream, &lay, &base.score, p.eval_problems.len()).await?;
    Ok(AblationSummary { seconds: started.elapsed().as_secs_f64(), ..summary })
}

/// Gathers every finished arm's files into results rows (used by the report).
pub(crate) struct Gathered {
    pub arms: Vec<ArmRow>,
    pub checkpoints: Vec<CheckpointRow>,
    pub preferences: Vec<PreferenceRow>,
    pub heldout: Vec<HeldoutRow>,
    pub gaps: Vec<GapRow>,
    pub steps: Vec<StepRow>,
    pub advantages: Vec<AdvantageRow>,
    pub responses: Vec<ResponseRow>,
    pub agreement: Vec<AgreementRow>,
    pub judge_sessions: Vec<JudgeSessionRow>,
    pub stage_counts: Vec<StageCountRow>,
    pub timings: Vec<TimingRow>,
    pub missing: Vec<String>,
    pub collect: Option<CollectReport>,
    pub replayed: u64,
}

pub(crate) async fn gather(cfg: &AblationConfig, arms: &[ResolvedArm], stream: &Stream, lay: &Layout, problems: usize) -> Result<Gathered> {
    let state = lay.state();
    let lake = Lake::open(lay.lake())?;
    let mut g = Gathered {
        arms: vec![],
        checkpoints: vec![],
        preferences: vec![],
        heldout: vec![],
        gaps: vec![],
        steps: vec![],
        advantages: vec![],
        responses: vec![],
        agreement: vec![],
        judge_sessions: vec![],
        stage_counts: vec![],
        timings: vec![],
        missing: vec![],
        collect: read_marker::<CollectReport>(&state.join("collect.json"))?,
        replayed: read_marker::<ReplayMarker>(&state.join("replay.json"))?.map_or(0, |r| r.rows),
    };
    if let Some(c) = &g.collect {
        g.timings.push(TimingRow { phase: "collect".into(), name: String::new(), seconds: c.seconds });
    }
    if let Some(r) = read_marker::<ReplayMarker>(&state.join("replay.json"))? {
        g.timings.push(TimingRow { phase: "replay".into(), name: String::new(), seconds: r.seconds });
    }
    for arm in data_pipelines(arms) {
        if let Some(m) = read_marker::<StagesMarker>(&state.join(format!("data-{}.json", arm.data_pipeline)))? {
            for (stage, c) in &m.counts {
                for (outcome, n) in c {
                    g.stage_counts.push(StageCountRow { data_pipeline: m.pipeline.clone(), stage: stage.clone(), outcome: outcome.clone(), count: *n as i64 });
                }
            }
            g.timings.push(TimingRow { phase: "stages".into(), name: m.pipeline.clone(), seconds: m.seconds });
        }
    }
    if let Some(v) = read_marker::<serde_json::Value>(&state.join("agreement-ingest.json"))? {
        g.timings.push(TimingRow { phase: "agreement_ingest".into(), name: String::new(), seconds: v["seconds"].as_f64().unwrap_or(0.0) });
    }
    for (_, arm, _) in judge_groups(arms)? {
        if let Some(m) = read_marker::<AgreementMarker>(&state.join(format!("agreement-{}.json", arm.data_pipeline)))? {
            g.timings.push(TimingRow { phase: "agreement".into(), name: arm.data_pipeline.clone(), seconds: m.seconds });
            g.agreement.push(m.row);
            g.judge_sessions.extend(m.sessions);
        }
    }
    if let Some(b) = read_marker::<BaseEval>(&state.join("base-eval.json"))? {
        g.timings.push(TimingRow { phase: "eval".into(), name: "v0 (shared)".into(), seconds: b.seconds });
    }
    for arm in arms {
        let dir = lay.arm(&arm.name);
        let Some(t) = read_marker::<TrainMarker>(&dir.join("train.json"))? else {
            g.missing.push(arm.name.clone());
            continue;
        };
        let vs = evaluated_versions(cfg, lay, &arm.name, &stream.rank)?;
        let mut evals = vec![];
        let mut eval_times = vec![];
        for (version, ..) in &vs {
            match read_marker::<EvalMarker>(&dir.join("eval").join(format!("v{version}.json")))? {
                Some(m) => {
                    eval_times.push(TimingRow { phase: "eval".into(), name: format!("{} v{version}", arm.name), seconds: m.seconds });
                    evals.push(m.eval);
                }
                None => break,
            }
        }
        if evals.len() != vs.len() {
            g.missing.push(arm.name.clone());
            continue;
        }
        g.timings.push(TimingRow { phase: "train".into(), name: arm.name.clone(), seconds: t.seconds });
        g.timings.extend(eval_times);
        let p = &arm.pipeline;
        g.arms.push(ArmRow {
            arm: arm.name.clone(),
            group: arm.group.clone(),
            method: p.method.as_str().into(),
            overrides: serde_json::to_string(&arm.overrides)?,
            data_pipeline: arm.data_pipeline.clone(),
            data_hash: arm.data_hash.clone(),
            config_hash: arm.config_hash.clone(),
            trainer_hash: arm.trainer_hash.clone(),
            seed: p.trainer.seed as i64,
            initial_weights: p.policy.model.display().to_string(),
            batch_size: p.trainer.batch_size as i64,
            lr: p.trainer.lr,
            lora: p.trainer.lora.enabled,
            w_rl: p.trainer.w_rl,
            w_opd: p.trainer.w_opd,
            opd_loss: p.trainer.opd_loss.as_str().into(),
            top_k: p.teacher.top_k as i64,
            hint_strategy: p.hint.strategy.as_str().into(),
            judge_m: i64::from(p.judge.m),
            hint_m: i64::from(p.hint.m),
            steps: t.steps,
            train_sql: t.train_sql.clone(),
            sample_ids: t.sample_ids.clone(),
            interaction_ids: t.interaction_ids.clone(),
            sample_types: t.sample_types.clone(),
        });
        // steps from the manifests
        for (_, m) in crate::trainer::scan(&lay.checkpoints(&arm.name).join(&arm.name))?.complete {
            for s in m.metrics {
                g.steps.push(StepRow {
                    arm: arm.name.clone(),
                    step: s.step,
                    loss: s.metrics.loss,
                    pg_loss: s.metrics.pg_loss,
                    clip_fraction: s.metrics.clip_fraction,
                    ppo_kl: s.metrics.ppo_kl,
                    kl: s.metrics.kl,
                    entropy: s.metrics.entropy,
                    topk_kl: s.metrics.topk_kl,
                    grad_norm: s.grad_norm,
                    advantage_by_type: serde_json::to_string(&s.metrics.advantage_by_type)?,
                    samples: s.metrics.samples,
                    tokens: s.metrics.tokens,
                });
            }
        }
        // advantages of the training samples, in training order
        let samples = query_samples(&lake, &t.train_sql).await?;
        let adv = sample_advantages(p.method, &p.trainer, &samples)?;
        for (k, (s, a)) in samples.iter().zip(adv).enumerate() {
            g.advantages.push(AdvantageRow {
                arm: arm.name.clone(),
                position: k as i64,
                sample_id: s.sample_id.clone(),
                interaction_id: s.interaction_id.clone(),
                sample_type: s.sample_type.as_str().into(),
                reward: f64::from(s.reward),
                advantage: a,
                tokens: s.loss_mask.iter().filter(|m| **m != 0).count() as i64,
            });
        }
        for e in evals {
            g.checkpoints.push(checkpoint_row(&arm.name, &e, problems));
            for (pref, rate) in &e.score.per_preference_rate {
                g.preferences.push(PreferenceRow { arm: arm.name.clone(), version: e.version, preference: pref.clone(), rate: *rate });
            }
            g.heldout.extend(e.heldout);
            g.gaps.extend(e.gaps);
            g.responses.extend(e.responses);
        }
    }
    Ok(g)
}

/// Writes every results table.
pub(crate) fn write_results(g: &Gathered, dir: &Path) -> Result<()> {
    write_table(dir, "arms", &g.arms)?;
    write_table(dir, "checkpoint_metrics", &g.checkpoints)?;
    write_table(dir, "preference_rates", &g.preferences)?;
    write_table(dir, "heldout_losses", &g.heldout)?;
    write_table(dir, "teacher_gaps", &g.gaps)?;
    write_table(dir, "steps", &g.steps)?;
    write_table(dir, "advantages", &g.advantages)?;
    write_table(dir, "responses", &g.responses)?;
    write_table(dir, "judge_agreement", &g.agreement)?;
    write_table(dir, "judge_sessions", &g.judge_sessions)?;
    write_table(dir, "stage_counts", &g.stage_counts)?;
    write_table(dir, "timings", &g.timings)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ablate::fixtures::interaction;

    #[test]
    fn stream_orders_and_holds_out_the_last_sessions() {
        let mut rows = vec![];
        // session b starts first, a second, c last; a has two turns interleaved with b's
        for (sid, turn, t) in [("b", 0, 10), ("a", 0, 20), ("b", 1, 30), ("a", 1, 40), ("c", 0, 50)] {
            let mut i = interaction(sid, turn);
            i.event_time = t;
            rows.push(i);
        }
        let mut side = interaction("a", 2);
        side.turn_type = TurnType::Side;
        rows.push(side);
        let s = stream(&rows, 1);
        assert_eq!(s.heldout, vec!["c"]);
        assert_eq!(s.order, vec!["b-0", "a-0", "b-1", "a-1"]);
        assert_eq!(s.rank["a-1"], 4);
        assert_eq!((s.sessions, s.main_turns), (3, 5));
        let s0 = stream(&rows, 0);
        assert!(s0.heldout.is_empty());
        assert_eq!(s0.order.len(), 5);
        let all = stream(&rows, 9);
        assert_eq!(all.heldout.len(), 3);
        assert!(all.order.is_empty());
    }

    #[test]
    fn queries_quote_and_exclude() {
        let q = train_sql("p'x", &["s1".into(), "o'k".into()], 16);
        assert!(q.contains("s.pipeline = 'p''x'"), "{q}");
        assert!(q.contains("NOT IN ('s1', 'o''k')"), "{q}");
        assert!(q.ends_with("LIMIT 16"));
        assert!(!train_sql("p", &[], 4).contains("NOT IN"));
        assert_eq!(heldout_sql("p", &[]), None);
        assert!(heldout_sql("p", &["s".into()]).unwrap().contains("s.session_id IN ('s')"));
    }
}
