//! `nextstate ablate`: the orchestration (see the module docs of [`crate::ablate`] for the design).
//!
//! Phases, each leaving its result on disk so a killed ablation resumes where it stopped:
//!
//! | phase | output | done when |
//! |---|---|---|
//! | collect (with `[data.collect]`; one collection per replicate with its own data) | `work/source/` lake | `work/state/collect-<k>.json` per collection, then `work/state/collect.json` |
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::collect::{collect, collect_plans, CollectReport};
use super::config::{AblationConfig, ResolvedArm};
use super::eval::{gap_rows, heldout_rows, judge_agreement, score_answers, token_advantages, VersionEval};
use super::mass::{
    aggregate, by_teacher_rows, mass_rows, teacher_choices, token_classes, Direction, MassItem, MassRow, BY_TEACHER_ANSWERS as MASS_BY_TEACHER_ANSWERS, BY_TEACHER_SETS,
    BY_TEACHER_V0_ANSWERS as MASS_BY_TEACHER_V0, CHOICE_SETS, HELDOUT as MASS_HELDOUT, TEACHER_ANSWERS as MASS_TEACHER_ANSWERS, TRAINED as MASS_TRAINED,
};
use crate::demo::heldout::{greedy_answers, greedy_generations, load_policy};
use super::baselines::{answers_with_system, memory_system, prompted_system, MEMORY_TOKENS};
use super::layout::{read_marker, remove_dir, write_marker, AgreementMarker, BaseEval, BaselineEval, EvalMarker, ReplayMarker, StagesMarker, TrainMarker};
use super::teacher_eval::{self, HintStrategy, TeacherEval};
use super::plan::{evaluated_versions, judge_groups, needed_data_pipelines, selected};
use super::replay::{replay, run_stages, ReplayOptions, ReplayTarget};
use super::results::{GapRow, ResponseRow};
use crate::demo::{load_gsm8k, split_problems, Problem, Student};
use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::method::Method;
use crate::runtime::Stop;
use crate::schema::{content_hash, Interaction, Judgment, Sample, TurnType};
use crate::stages::run::Stage;
use crate::stages::train::{query_samples, train_command, TrainOptions, TrainSource};
use crate::{config_err, input_err};

pub use super::layout::Layout;
pub use super::plan::{heldout_sql, stream, train_sql, Replicates, Stream};
pub use super::report::AblationSummary;

/// What `nextstate ablate` runs.
#[derive(Debug, Clone)]
pub struct AblateOptions {
    /// The ablation file.
    pub config: AblationConfig,
    /// Output folder (`report.md`, plots, `results/`; bulky work files under `work/`, git-ignored).
    pub out: PathBuf,
    /// Only these arms in this process (None: all).
    pub arms: Option<Vec<String>>,
    /// `--metrics-jsonl FILE`: one JSON object per optimizer step of every arm trained in this process
    /// (the `train_steps` row plus `arm`, `group` and `seed`).
    pub metrics_jsonl: Option<PathBuf>,
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

/// Everything the arms share, prepared once.
struct Prepared {
    arms: Vec<ResolvedArm>,
    /// Each replicate's interaction stream ([`Replicates`]).
    replicates: Replicates,
    eval_problems: Vec<Problem>,
    student: Student,
    /// Hinted held-out samples of every replicate (the gap set), from the first data pipeline that
    /// builds hints.
    gap_samples: Vec<Sample>,
    /// The accepted hints of the first replicate's training interactions, in its order, from the first
    /// data pipeline that builds hints (the `memory` baseline's material).
    memory_hints: Vec<String>,
    eval_fingerprint: String,
}

fn eval_fingerprint(cfg: &AblationConfig) -> Result<String> {
    // Which versions are evaluated does not change any one evaluation's numbers.
    let eval = super::config::EvalSettings { versions: Default::default(), ..cfg.eval.clone() };
    let v = serde_json::json!({"eval": eval, "student": cfg.student, "heldout": cfg.data.heldout_sessions});
    Ok(content_hash(&[serde_json::to_string(&v)?.as_bytes()]))
}

/// Whether each replicate collects its own interactions: `[data.collect]` with two or more seeds.
fn own_data(cfg: &AblationConfig) -> bool {
    cfg.data.collect.is_some() && cfg.shared.replicate_seeds().len() > 1
}

fn data_fingerprint(cfg: &AblationConfig, arms: &[ResolvedArm]) -> Result<String> {
    let model = arms.first().map(|a| a.pipeline.policy.model.clone());
    let mut v = serde_json::json!({"data": cfg.data, "student": cfg.student, "model": model, "eval_problems": cfg.eval.problems});
    if !cfg.eval.split.is_test() {
        // A validation split moves the held-out sessions' and training problems (`Split::evaluated_on`).
        v["eval_split"] = serde_json::json!(cfg.eval.split);
    }
    // Replicates read their own data (with collection) and their own order (always): the seeds shape
    // the data, so a folder made before (or with other seeds) is refused, not mixed.
    if cfg.shared.replicate_seeds().len() > 1 {
        v["replicate_seeds"] = serde_json::json!(cfg.shared.replicate_seeds());
        if !own_data(cfg) {
            v["replicate_scheme"] = serde_json::json!("sessions shuffled");
        }
    }
    Ok(content_hash(&[serde_json::to_string(&v)?.as_bytes()]))
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
                "{}: the [data]/[student] settings, the replicate seeds or the model changed since this folder's data was made (or it was made by an older version whose replicates shared one data set and order); use a new --out (or delete {})",
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
                let problems = load_gsm8k(&cfg.student.gsm8k)?;
                let split = split_problems(&problems, cfg.eval.problems, cfg.student.seed)?.evaluated_on(cfg.eval.split)?;
                let plans = collect_plans(&split.train, c.sessions, cfg.data.heldout_sessions, cfg.student.seed, &cfg.shared.replicate_seeds());
                if !(0..plans.len()).any(|k| state.join(format!("collect-{k}.json")).exists()) {
                    remove_dir(&lay.source())?; // rows of a run killed before any collection's marker
                }
                eprintln!("[ablate] collecting {} student sessions with the frozen initial policy ({} collection(s))", c.sessions * plans.len(), plans.len());
                // One marker per collection, so a killed multi-replicate collection resumes at the
                // collection it was in (each collection's rows are one deterministic file set: a
                // re-write after a kill between the write and its marker leaves the files as they are).
                let mut report = CollectReport::default();
                for (k, plan) in plans.into_iter().enumerate() {
                    let part = state.join(format!("collect-{k}.json"));
                    let done = match read_marker::<CollectReport>(&part)? {
                        Some(r) => r,
                        None => {
                            check_stop(stop)?;
                            let (pcfg, c, prefs, max_turns, stop2) = (base.clone(), c.clone(), cfg.student.preferences(), cfg.student.max_turns, stop.clone());
                            let (rows, r) = blocking(move || {
                                let lm = load_policy(&pcfg, None)?;
                                let student = Student::new(plan.seed, prefs, max_turns)?;
                                collect(&lm, &plan.problems, &student, &c, plan.seed, &plan.target, &stop2)
                            })
                            .await?;
                            Lake::open(lay.source())?.write_rows(&rows, "collect", k as u64 + 1)?;
                            eprintln!("[ablate]   collection {}: {} interactions in {} sessions in {:.0} s", k + 1, r.interactions, r.sessions, r.seconds);
                            write_marker(&part, &r)?;
                            r
                        }
                    };
                    report += &done;
                }
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
    // 3. the stages of each data pipeline the selected arms need (a context-distillation arm: its hint
    //    pipeline's stages, then the teacher's generations)
    for arm in needed_data_pipelines(arms, sel) {
        match &arm.hints_from {
            None => data_stages(&arm.pipeline, lay, stop).await?,
            Some(h) => {
                data_stages(h, lay, stop).await?;
                teacher_generations(cfg, arm, h, lay, stop).await?;
            }
        }
    }
    // 4. judge agreement on labelled logs
    if let Some(ag) = &cfg.eval.judge_agreement {
        agreement_phase(ag, arms, lay, stop).await?;
    }
    Ok(())
}

/// Runs the stages of data pipeline `p` (named `p.name`) over the ablation lake, once
/// (`work/state/data-<pipeline>.json`).
async fn data_stages(p: &crate::config::PipelineConfig, lay: &Layout, stop: &Stop) -> Result<()> {
    let marker = lay.state().join(format!("data-{}.json", p.name));
    if read_marker::<StagesMarker>(&marker)?.is_some() {
        return Ok(());
    }
    check_stop(stop)?;
    let t = Instant::now();
    let stages: Vec<String> = Stage::chain(p.method).into_iter().map(|s| s.name().to_string()).collect();
    eprintln!("[ablate] data pipeline {} ({}): stages {}", p.name, p.method.as_str(), stages.join(", "));
    let r = run_stages(p, &stages, stop.clone()).await?;
    check_stop(stop)?;
    let counts: BTreeMap<String, BTreeMap<String, u64>> = r.stages.iter().map(|(k, v)| (k.clone(), v.outcomes.clone())).collect();
    for (s, c) in &counts {
        eprintln!("[ablate]   {s}: {}", c.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    }
    write_marker(&marker, &StagesMarker { pipeline: p.name.clone(), counts, seconds: t.elapsed().as_secs_f64() })
}

/// The samples of a context-distillation arm ([`super::config::ArmSamples::TeacherGenerations`]), once
/// (`work/state/data-<its data pipeline>.json`): for every hinted sample of the hint pipeline `hints`
/// (one with the teacher's prompt), the initial weights' greedy answer to the teacher prompt (at most
/// `[data.collect] max_tokens` tokens, else `[eval] max_tokens`), as a `binary` sample with reward +1
/// after the original prompt, its rollout log-probs the initial weights' on that prompt, under the
/// arm's data pipeline name; answers without a token are counted, not kept.
async fn teacher_generations(cfg: &AblationConfig, arm: &ResolvedArm, hints: &crate::config::PipelineConfig, lay: &Layout, stop: &Stop) -> Result<()> {
    let marker = lay.state().join(format!("data-{}.json", arm.data_pipeline));
    if read_marker::<StagesMarker>(&marker)?.is_some() {
        return Ok(());
    }
    check_stop(stop)?;
    let t = Instant::now();
    let lake = Lake::open(lay.lake())?;
    let mut hinted: Vec<Sample> = lake.read_table::<Sample>()?.into_iter().filter(|s| s.pipeline == hints.name && s.teacher_prompt_token_ids.is_some()).collect();
    hinted.sort_by(|a, b| (a.event_time, &a.sample_id).cmp(&(b.event_time, &b.sample_id)));
    let max_tokens = cfg.data.collect.as_ref().map(|c| c.max_tokens).unwrap_or(cfg.eval.max_tokens);
    let (pcfg, name, batch, n) = (arm.pipeline.clone(), arm.data_pipeline.clone(), cfg.eval.batch, hinted.len());
    eprintln!("[ablate] data pipeline {name} (teacher generations): {n} hinted turns of {}", hints.name);
    let (rows, empty, tokens) = blocking(move || {
        let lm = load_policy(&pcfg, None)?;
        let to_u32 = |v: &[i32]| v.iter().map(|&x| x as u32).collect::<Vec<u32>>();
        let prompts: Vec<Vec<u32>> = hinted.iter().map(|s| to_u32(s.teacher_prompt_token_ids.as_deref().unwrap_or_default())).collect();
        let gens = crate::demo::heldout::greedy_ids(&lm, &prompts, max_tokens, batch)?;
        let kept: Vec<(&Sample, Vec<u32>)> = hinted.iter().zip(gens).filter(|(_, g)| !g.token_ids.is_empty()).map(|(s, g)| (s, g.token_ids)).collect();
        let empty = (n - kept.len()) as u64;
        let items: Vec<(Vec<u32>, Vec<u32>)> = kept.iter().map(|(s, r)| (to_u32(&s.prompt_token_ids), r.clone())).collect();
        let scored = lm.score(&items, 0)?;
        let mut tokens = 0u64;
        let rows: Vec<Sample> = kept
            .into_iter()
            .zip(scored)
            .map(|((s, response), sc)| {
                tokens += response.len() as u64;
                Sample {
                    sample_id: content_hash(&[s.sample_id.as_bytes(), name.as_bytes()]),
                    pipeline: name.clone(),
                    rollout_logprobs_recomputed: true,
                    interaction_id: s.interaction_id.clone(),
                    session_id: s.session_id.clone(),
                    turn_index: s.turn_index,
                    hint_id: s.hint_id.clone(),
                    source_topic: s.source_topic.clone(),
                    source_partition: s.source_partition,
                    source_offset: s.source_offset,
                    event_time: s.event_time,
                    processed_time: s.processed_time,
                    ..Sample::new(crate::schema::SampleType::Binary, s.prompt_token_ids.clone(), response.iter().map(|&x| x as i32).collect(), sc.logprobs, 1.0)
                }
            })
            .collect();
        Ok((rows, empty, tokens))
    })
    .await?;
    check_stop(stop)?;
    lake.write_rows(&rows, &format!("teacher-generations-{}", arm.data_pipeline), 1)?;
    let counts = BTreeMap::from([(
        "teacher-generations".to_string(),
        BTreeMap::from([("hinted_turns".to_string(), n as u64), ("samples".to_string(), rows.len() as u64), ("empty_generation".to_string(), empty), ("tokens".to_string(), tokens)]),
    )]);
    eprintln!("[ablate]   teacher-generations: {} samples ({} tokens; {empty} empty answers left out) in {:.0} s", rows.len(), tokens, t.elapsed().as_secs_f64());
    write_marker(&marker, &StagesMarker { pipeline: arm.data_pipeline.clone(), counts, seconds: t.elapsed().as_secs_f64() })
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
        let args = crate::stages::source::IngestArgs { files: ag.files.clone(), format, default_turn_type: TurnType::Main, sink: true, progress: false, tenant: None };
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
    let replicates = Replicates::new(&lake.read_table::<Interaction>()?, cfg.data.heldout_sessions, &cfg.shared.replicate_seeds(), own_data(cfg));
    let problems = load_gsm8k(&cfg.student.gsm8k)?;
    let split = split_problems(&problems, cfg.eval.problems, cfg.student.seed)?.evaluated_on(cfg.eval.split)?;
    let student = Student::new(cfg.student.seed, cfg.student.preferences(), cfg.student.max_turns)?;
    let gap_samples = match arms.iter().find(|a| a.pipeline.method.uses_hints()).and_then(|a| heldout_sql(&a.data_pipeline, &replicates.heldout_all())) {
        Some(q) => query_samples(&lake, &q).await?.into_iter().filter(|s| s.hint_id.is_some() && s.teacher_logprobs.is_some()).collect(),
        None => vec![],
    };
    let memory_hints = match arms.iter().find(|a| a.pipeline.method.uses_hints()) {
        Some(a) => {
            let first = &replicates.streams[0].1;
            let mut rows: Vec<(i64, String)> = lake
                .read_table::<crate::schema::HintRecord>()?
                .into_iter()
                .filter(|h| h.pipeline == a.data_pipeline)
                .filter_map(|h| Some((*first.rank.get(&h.interaction_id)?, h.chosen_hint?)))
                .collect();
            rows.sort();
            rows.into_iter().map(|(_, h)| h).collect()
        }
        None => vec![],
    };
    Ok(Prepared { arms, replicates, eval_problems: split.eval, student, gap_samples, memory_hints, eval_fingerprint: eval_fingerprint(cfg)? })
}

async fn base_eval(cfg: &AblationConfig, p: &Prepared, lay: &Layout, stop: &Stop) -> Result<BaseEval> {
    let path = lay.state().join("base-eval.json");
    if let Some(mut b) = read_marker::<BaseEval>(&path)? {
        if b.fingerprint == p.eval_fingerprint {
            if b.answer_ids.is_empty() && !b.responses.is_empty() {
                check_stop(stop)?;
                let (pcfg, problems, student) = (p.arms[0].pipeline.clone(), p.eval_problems.clone(), p.student.clone());
                let (max_tokens, batch) = (cfg.eval.max_tokens, cfg.eval.batch);
                let generated = blocking(move || greedy_generations(&load_policy(&pcfg, None)?, &problems, &student, max_tokens, batch)).await?;
                let differ = generated.iter().filter(|a| !b.responses.iter().any(|r| r.problem_id == a.problem.id as i64 && r.response_text == a.text)).count();
                if differ > 0 {
                    eprintln!("[ablate] warning: {differ} of v0's regenerated held-out answers differ from the saved ones; the token mass scores the regenerated ones");
                }
                b.answer_ids = answer_ids(&generated);
                write_marker(&path, &b)?;
            }
            // written before the teacher's answers were kept as ids: the teacher is evaluated again
            let no_ids = b.teachers.iter().any(|t| t.strategy == HintStrategy::Instruction && !t.answers_kept);
            if b.teachers.is_empty() || no_ids {
                b.teachers = teacher_evals(cfg, p, &b.responses, &b.answer_ids, stop).await?;
                write_marker(&path, &b)?;
            }
            if b.baselines.is_empty() {
                b.baselines = baseline_evals(cfg, p, stop).await?;
                write_marker(&path, &b)?;
            }
            if b.v0_mass.is_none() {
                b.v0_mass = Some(base_mass(p, &b, stop).await?);
                write_marker(&path, &b)?;
            }
            return Ok(b);
        }
    }
    check_stop(stop)?;
    eprintln!("[ablate] evaluating the initial weights on {} held-out problems", p.eval_problems.len());
    let t = Instant::now();
    let (pcfg, problems, student, gap_set) = (p.arms[0].pipeline.clone(), p.eval_problems.clone(), p.student.clone(), p.gap_samples.clone());
    let (max_tokens, batch, prefs) = (cfg.eval.max_tokens, cfg.eval.batch, cfg.student.preferences());
    let (score, responses, gaps, answer_ids) = blocking(move || {
        let lm = load_policy(&pcfg, None)?;
        let generated = greedy_generations(&lm, &problems, &student, max_tokens, batch)?;
        let ids = answer_ids(&generated);
        let answers: Vec<(Problem, String)> = generated.into_iter().map(|a| (a.problem, a.text)).collect();
        let (score, responses) = score_answers("", 0, &answers, &prefs);
        let gaps = gap_rows(&lm, "", 0, &gap_set, pcfg.trainer.batch_size, pcfg.trainer.temperature)?;
        Ok((score, responses, gaps, ids))
    })
    .await?;
    let seconds = t.elapsed().as_secs_f64();
    eprintln!("[ablate] initial weights: personalization score {:.3} (accuracy {:.3})", score.fraction_all_satisfied, score.accuracy);
    let teachers = teacher_evals(cfg, p, &responses, &answer_ids, stop).await?;
    let baselines = baseline_evals(cfg, p, stop).await?;
    let mut b = BaseEval { fingerprint: p.eval_fingerprint.clone(), score, responses, gaps, seconds, teachers, baselines, answer_ids, v0_mass: None };
    write_marker(&path, &b)?;
    b.v0_mass = Some(base_mass(p, &b, stop).await?);
    write_marker(&path, &b)?;
    Ok(b)
}

/// [`BaseEval::v0_mass`]: v0's rows of the token sets every arm shares, scored once (the teacher's sets
/// only when some arm trains on hints).
async fn base_mass(p: &Prepared, b: &BaseEval, stop: &Stop) -> Result<Vec<MassRow>> {
    check_stop(stop)?;
    let (pcfg, ids, teachers) = (p.arms[0].pipeline.clone(), b.answer_ids.clone(), b.teachers.clone());
    let teacher = p.arms.iter().any(|a| a.pipeline.method.uses_hints());
    blocking(move || shared_v0_mass(&load_policy(&pcfg, None)?, &ids, &teachers, teacher, pcfg.trainer.batch_size)).await
}

/// v0's greedy answers as the (problem id, prompt ids, response ids) of [`BaseEval::answer_ids`].
fn answer_ids(generated: &[crate::demo::heldout::HeldoutAnswer]) -> Vec<(i64, Vec<u32>, Vec<u32>)> {
    generated.iter().map(|a| (a.problem.id as i64, a.prompt_ids.clone(), a.response_ids.clone())).collect()
}

/// The token sets of [`super::mass`] for one arm.
#[derive(Debug, Clone, Default)]
struct MassInputs {
    /// v0's held-out answers (every token counted, no direction).
    heldout: Vec<MassItem>,
    /// The arm's training samples: their trained tokens, with the sign of their starting advantage and
    /// of `teacher − rollout` where the sample has teacher log-probs (neither when the arm trains at a
    /// temperature other than 1, where the rollout log-probs are not v0's at the trainer's temperature),
    /// and their teacher choices once [`teacher_choices`] filled them.
    trained: Vec<MassItem>,
    /// Whether the trained samples have teacher prompts (their teacher choices are scored).
    choices: bool,
    /// The instruction-hint teacher's greedy answers to the hinted held-out problems, under the
    /// student's prompt.
    teacher_answers: Vec<MassItem>,
    /// Version 0's fixed rows: (set, items under the teacher's prompt, the teacher's log-probs).
    by_teacher: Vec<(&'static str, Vec<MassItem>, Vec<Vec<f32>>)>,
}

/// A held-out item: every response token counted, no direction.
fn plain_item(prompt_ids: &[u32], response_ids: &[u32]) -> MassItem {
    let n = response_ids.len();
    MassItem { prompt_ids: prompt_ids.to_vec(), response_ids: response_ids.to_vec(), counted: vec![true; n], signs: vec![Direction::None; n], teacher: vec![Direction::None; n], choice: None }
}

/// The [`MassInputs`] every arm shares (no trained samples): v0's held-out answers and, with
/// `teacher`, the instruction-hint teacher's answers and the teacher's own log-probs of them and of
/// v0's answers to the same problems.
fn shared_mass_items(answer_ids: &[(i64, Vec<u32>, Vec<u32>)], teachers: &[TeacherEval], teacher: bool) -> MassInputs {
    let mut inputs = MassInputs { heldout: answer_ids.iter().filter(|(_, _, r)| !r.is_empty()).map(|(_, p, r)| plain_item(p, r)).collect(), ..MassInputs::default() };
    // Only arms trained on a teacher get the teacher's answers (a binary arm's movement toward them is
    // not what it was trained for; scoring them for it would only add time).
    if let Some(t) = teachers.iter().find(|t| t.strategy == HintStrategy::Instruction).filter(|_| teacher) {
        let (mut own, mut own_lp, mut v0s, mut v0_lp) = (vec![], vec![], vec![], vec![]);
        for (a, v0_teacher) in t.answers.iter().zip(t.v0_logprobs.iter().map(Some).chain(std::iter::repeat(None))) {
            let Some((_, prompt, v0_answer)) = answer_ids.iter().find(|(id, ..)| *id == a.problem_id) else { continue };
            if a.response_ids.is_empty() {
                continue;
            }
            inputs.teacher_answers.push(plain_item(prompt, &a.response_ids));
            own.push(plain_item(&a.prompt_ids, &a.response_ids));
            own_lp.push(a.logprobs.clone());
            if let Some(lp) = v0_teacher {
                v0s.push(plain_item(&a.prompt_ids, v0_answer));
                v0_lp.push(lp.clone());
            }
        }
        inputs.by_teacher = vec![(MASS_BY_TEACHER_ANSWERS, own, own_lp), (MASS_BY_TEACHER_V0, v0s, v0_lp)];
    }
    inputs
}

/// The sets of [`shared_mass_items`] (every arm's v0 rows of them are the same).
fn shared_set(set: &str) -> bool {
    [MASS_HELDOUT, MASS_TEACHER_ANSWERS, MASS_BY_TEACHER_ANSWERS, MASS_BY_TEACHER_V0].contains(&set)
}

/// The [`MassInputs`] of one arm from the base evaluation and the arm's training samples.
fn mass_items(base: &BaseEval, arm: &ResolvedArm, trained: &[Sample]) -> Result<MassInputs> {
    let t1 = arm.pipeline.trainer.temperature == 1.0;
    let mut items = vec![];
    for s in trained {
        let n = s.response_token_ids.len();
        let signs = if t1 { token_advantages(arm.pipeline.method, &arm.pipeline.trainer, s)?.into_iter().map(Direction::of).collect() } else { vec![Direction::None; n] };
        let teacher = match (&s.teacher_logprobs, t1) {
            (Some(t), true) if t.len() == n && s.rollout_logprobs.len() == n => t.iter().zip(&s.rollout_logprobs).map(|(t, r)| Direction::of(t - r)).collect(),
            _ => vec![Direction::None; n],
        };
        items.push(MassItem {
            prompt_ids: s.prompt_token_ids.iter().map(|&x| x as u32).collect(),
            response_ids: s.response_token_ids.iter().map(|&x| x as u32).collect(),
            counted: s.loss_mask.iter().map(|m| *m != 0).collect(),
            signs,
            teacher,
            choice: None,
        });
    }
    // The teacher measured here is the initial weights reading the hint (temperature 1): an arm whose
    // pipeline names another teacher model gets no teacher sets rather than the wrong teacher's.
    let choices = arm.pipeline.teacher.model.is_none() && trained.iter().any(|s| s.teacher_prompt_token_ids.is_some());
    if arm.pipeline.teacher.model.is_some() {
        eprintln!("[ablate] arm {}: its teacher is another model; the token mass measures no teacher choices for it", arm.name);
    }
    Ok(MassInputs { trained: items, choices, ..shared_mass_items(&base.answer_ids, &base.teachers, choices) })
}

/// The token sets [`version_mass`] scores at `version` for these inputs.
fn mass_sets(version: i64, m: &MassInputs) -> Vec<String> {
    let mut sets = vec![];
    if !m.heldout.is_empty() {
        sets.push(MASS_HELDOUT.to_string());
    }
    if !m.trained.is_empty() {
        sets.push(MASS_TRAINED.to_string());
        if m.choices {
            sets.extend(CHOICE_SETS.iter().map(|s| s.to_string()));
            if version == 0 {
                sets.extend(BY_TEACHER_SETS.iter().map(|s| s.to_string()));
            }
        }
    }
    if !m.teacher_answers.is_empty() {
        sets.push(MASS_TEACHER_ANSWERS.to_string());
        if version == 0 {
            sets.extend(m.by_teacher.iter().map(|(s, ..)| s.to_string()));
        }
    }
    sets
}

/// The token mass rows of one version: the sets of [`MassInputs`] scored by `lm` (with the teacher
/// choices of the trained items where they have them; at version 0 also the teacher's own log-probs).
/// Returns the rows and the sets scored.
/// With `shared` (v0's rows of the shared sets, [`BaseEval::v0_mass`]) version 0 copies those rows
/// instead of scoring them again.
fn version_mass(lm: &crate::model::LanguageModel, arm: &str, version: i64, m: &MassInputs, batch: usize, shared: Option<&[MassRow]>) -> Result<(Vec<MassRow>, Vec<String>)> {
    let sets = mass_sets(version, m);
    let mut mass = vec![];
    let copied = match shared.filter(|_| version == 0) {
        Some(rows) => {
            mass.extend(rows.iter().filter(|r| sets.contains(&r.set)).map(|r| MassRow { arm: arm.to_string(), ..r.clone() }));
            true
        }
        None => false,
    };
    if !copied {
        mass.extend(mass_rows(lm, arm, version, MASS_HELDOUT, &m.heldout, batch)?);
        mass.extend(mass_rows(lm, arm, version, MASS_TEACHER_ANSWERS, &m.teacher_answers, batch)?);
    }
    mass.extend(mass_rows(lm, arm, version, MASS_TRAINED, &m.trained, batch)?);
    if version == 0 {
        let mut all: Vec<MassItem> = m.trained.clone();
        if !copied {
            all.extend(m.by_teacher.iter().flat_map(|(_, items, _)| items.iter().cloned()));
        }
        let classes = token_classes(lm, &all)?;
        let class_of = |id: u32| classes.get(&id).copied().unwrap_or(super::mass::TokenClass::Word);
        if m.trained.iter().any(|i| i.choice.is_some()) {
            mass.extend(by_teacher_rows(arm, &m.trained, class_of)?);
        }
        if !copied && !m.teacher_answers.is_empty() {
            for (set, items, values) in &m.by_teacher {
                mass.extend(aggregate(arm, 0, set, items, values, class_of)?);
            }
        }
    }
    Ok((mass, sets))
}

/// v0's rows of the shared sets ([`BaseEval::v0_mass`]), scored by `lm` (the initial weights).
///
/// # Errors
/// Model errors; those of [`version_mass`].
fn shared_v0_mass(lm: &crate::model::LanguageModel, answer_ids: &[(i64, Vec<u32>, Vec<u32>)], teachers: &[TeacherEval], teacher: bool, batch: usize) -> Result<Vec<MassRow>> {
    let (rows, _) = version_mass(lm, "", 0, &shared_mass_items(answer_ids, teachers, teacher), batch, None)?;
    Ok(rows.into_iter().filter(|r| shared_set(&r.set)).collect())
}

/// The hint-conditioned teacher (the initial weights reading a hint) on the held-out problems, once per
/// hint strategy ([`super::teacher_eval`]), from v0's answers `v0` (the base evaluation's responses);
/// `v0_ids` are those answers as token ids ([`BaseEval::answer_ids`]): for the instruction strategy the
/// teacher also scores v0's answer to each hinted problem, and its own answers are kept as ids
/// ([`TeacherEval::answers`]).
async fn teacher_evals(cfg: &AblationConfig, p: &Prepared, v0: &[ResponseRow], v0_ids: &teacher_eval::V0Ids, stop: &Stop) -> Result<Vec<TeacherEval>> {
    let answers: Vec<(Problem, String)> = p
        .eval_problems
        .iter()
        .filter_map(|pr| v0.iter().find(|r| r.problem_id == pr.id as i64).map(|r| (pr.clone(), r.response_text.clone())))
        .collect();
    let (pcfg, student, v0_ids, stop) = (p.arms[0].pipeline.clone(), p.student.clone(), v0_ids.to_vec(), stop.clone());
    let (max_tokens, batch) = (cfg.eval.max_tokens, cfg.eval.batch);
    blocking(move || {
        let lm = load_policy(&pcfg, None)?;
        teacher_eval::evaluate(&lm, &answers, &student, max_tokens, batch, Some((&v0_ids, pcfg.trainer.batch_size)), &stop)
    })
    .await
}

/// The baselines without training on the held-out problems ([`super::baselines`]): `prompted`, and
/// `memory` when the training interactions have accepted hints.
async fn baseline_evals(cfg: &AblationConfig, p: &Prepared, stop: &Stop) -> Result<Vec<BaselineEval>> {
    let mut out = vec![];
    for name in ["prompted", "memory"] {
        check_stop(stop)?;
        let t = Instant::now();
        let (pcfg, student, problems, hints) = (p.arms[0].pipeline.clone(), p.student.clone(), p.eval_problems.clone(), p.memory_hints.clone());
        let (max_tokens, batch, prefs) = (cfg.eval.max_tokens, cfg.eval.batch, cfg.student.preferences());
        let name_s = name.to_string();
        let done = blocking(move || {
            let lm = load_policy(&pcfg, None)?;
            let system = match name_s.as_str() {
                "prompted" => Some(prompted_system(&prefs)),
                _ => memory_system(&hints, MEMORY_TOKENS, |s| lm.encode(s).map(|ids| ids.len()).unwrap_or(usize::MAX)),
            };
            let Some(system) = system else { return Ok(None) };
            let answers = answers_with_system(&lm, &problems, &student, &system, max_tokens, batch)?;
            let (score, responses) = score_answers(&name_s, 0, &answers, &prefs);
            Ok(Some((system, score, responses)))
        })
        .await?;
        let Some((system, score, responses)) = done else {
            eprintln!("[ablate] baseline {name}: no accepted hint in the training interactions, not evaluated");
            continue;
        };
        let e = BaselineEval { name: name.into(), system, score, responses, seconds: t.elapsed().as_secs_f64() };
        eprintln!("[ablate] baseline {name} (no training): personalization score {:.3} ({:.0} s)", e.score.fraction_all_satisfied, e.seconds);
        out.push(e);
    }
    Ok(out)
}

/// The ids of data pipeline `pipeline`'s first `limit` samples in the stream's order `rank`
/// ([`super::plan::first_samples`]), reading only the key columns of the lake's samples.
fn training_samples(lake: &Lake, pipeline: &str, rank: &std::collections::HashMap<String, i64>, limit: usize) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Key {
        sample_id: String,
        pipeline: String,
        interaction_id: String,
    }
    let mut keys = vec![];
    for f in lake.files(<Sample as crate::schema::Table>::NAME)? {
        keys.extend(lake.file_columns::<Key>(&f.path, &["sample_id", "pipeline", "interaction_id"])?.into_iter().filter(|k| k.pipeline == pipeline).map(|k| (k.sample_id, k.interaction_id)));
    }
    Ok(super::plan::first_samples(&keys, rank, limit))
}

async fn train_arm(cfg: &AblationConfig, arm: &ResolvedArm, p: &Prepared, lay: &Layout, stop: &Stop, metrics_jsonl: Option<&std::path::Path>) -> Result<TrainMarker> {
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
    let lake = Lake::open(lay.lake())?;
    let sql = train_sql(&arm.data_pipeline, &training_samples(&lake, &arm.data_pipeline, &p.replicates.of(arm.seed).rank, cfg.shared.steps * cfg.shared.batch_size)?);
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
            metrics_jsonl: metrics_jsonl.map(|p| p.to_path_buf()),
            metrics_jsonl_extra: vec![("arm".into(), arm.name.clone().into()), ("group".into(), arm.group.clone().into()), ("seed".into(), arm.seed.into())],
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

async fn eval_arm(cfg: &AblationConfig, arm: &ResolvedArm, p: &Prepared, base: &BaseEval, lay: &Layout, stop: &Stop) -> Result<Vec<VersionEval>> {
    let lake = Lake::open(lay.lake())?;
    let stream = p.replicates.of(arm.seed);
    let heldout: Vec<Sample> = match heldout_sql(&arm.data_pipeline, &stream.heldout) {
        Some(q) => query_samples(&lake, &q).await?,
        None => vec![],
    };
    let trained = match read_marker::<TrainMarker>(&lay.arm(&arm.name).join("train.json"))? {
        Some(t) if !t.sample_ids.is_empty() => query_samples(&lake, &t.train_sql).await?,
        _ => vec![],
    };
    let mut inputs = mass_items(base, arm, &trained)?;
    let dir = lay.arm(&arm.name).join("eval");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
    let versions = evaluated_versions(cfg, lay, &arm.name, &stream.rank)?;
    // A version is done when its marker is of this evaluation and scored every token set; one written
    // before a set existed gets only its token mass again.
    let mut markers = vec![];
    for (version, ..) in &versions {
        let m = read_marker::<EvalMarker>(&dir.join(format!("v{version}.json")))?.filter(|m| m.fingerprint == p.eval_fingerprint);
        let complete = m.as_ref().is_some_and(|m| {
            let have = m.eval.scored_sets();
            mass_sets(*version, &inputs).iter().all(|s| have.contains(s))
        });
        markers.push((m, complete));
    }
    if inputs.choices && markers.iter().any(|(_, complete)| !complete) {
        check_stop(stop)?;
        let (pcfg, items) = (arm.pipeline.clone(), trained.clone());
        let choices = blocking(move || {
            let pairs: Vec<Option<(Vec<u32>, Vec<u32>)>> = items
                .iter()
                .map(|s| s.teacher_prompt_token_ids.as_ref().map(|t| (t.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect())))
                .collect();
            teacher_choices(&load_policy(&pcfg, None)?, &pairs, pcfg.trainer.batch_size)
        })
        .await?;
        for (item, c) in inputs.trained.iter_mut().zip(choices) {
            item.choice = c;
        }
    }
    let shared_v0: Option<Vec<MassRow>> = base.v0_mass.clone();
    let mut out = vec![];
    for ((version, step, seen, samples_seen, ck), (marker, complete)) in versions.into_iter().zip(markers) {
        let path = dir.join(format!("v{version}.json"));
        if let Some(mut m) = marker {
            if !complete {
                // written before one of the token sets existed: score only the token mass again
                check_stop(stop)?;
                let (pcfg, name, ck) = (arm.pipeline.clone(), arm.name.clone(), ck.clone());
                let (inputs, shared) = (inputs.clone(), shared_v0.clone());
                (m.eval.mass, m.eval.mass_sets) = blocking(move || {
                    let lm = load_policy(&pcfg, ck.as_deref())?;
                    version_mass(&lm, &name, version, &inputs, pcfg.trainer.batch_size, shared.as_deref())
                })
                .await?;
                write_marker(&path, &m)?;
            }
            out.push(m.eval);
            continue;
        }
        check_stop(stop)?;
        let t = Instant::now();
        let name = arm.name.clone();
        let (pcfg, problems, student, gap_set, held) = (arm.pipeline.clone(), p.eval_problems.clone(), p.student.clone(), p.gap_samples.clone(), heldout.clone());
        let (inputs, shared) = (inputs.clone(), shared_v0.clone());
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
                    (score, responses, gap_rows(&lm, &name, version, &gap_set, pcfg.trainer.batch_size, pcfg.trainer.temperature)?)
                }
            };
            let heldout = heldout_rows(&lm, &name, version, pcfg.method, &pcfg.trainer, &held)?;
            let (mass, mass_sets) = version_mass(&lm, &name, version, &inputs, pcfg.trainer.batch_size, shared.as_deref())?;
            Ok(VersionEval { version, step, interactions_seen: seen, samples_seen, score, responses, heldout, gaps, mass, mass_sets })
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

/// Runs (or resumes) an ablation and writes its report (see the module docs); with an `[online]` section,
/// the online protocol ([`super::online::run_online`]).
///
/// # Errors
/// Configuration errors (an arm or the data changed since this folder was made), data, model, pipeline
/// and I/O errors; [`Error::Cancelled`] on a stop request (everything finished so far is kept).
pub async fn run_ablation(opts: &AblateOptions, stop: Stop) -> Result<AblationSummary> {
    if opts.config.online.is_some() {
        return super::online::run_online(&opts.config, &opts.out, opts.arms.as_deref(), opts.metrics_jsonl.as_deref(), stop).await;
    }
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
        train_arm(cfg, arm, &p, &lay, &stop, opts.metrics_jsonl.as_deref()).await?;
        eval_arm(cfg, arm, &p, &base, &lay, &stop).await?;
    }
    let summary = super::report::write_all(cfg, &p.arms, &p.replicates, &lay, &base.score, &base.teachers, &base.baselines, p.eval_problems.len()).await?;
    Ok(AblationSummary { seconds: started.elapsed().as_secs_f64(), ..summary })
}
