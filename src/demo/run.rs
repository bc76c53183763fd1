//! `nextstate demo`: the main job. A simulated student uses the agent for homework while the whole
//! pipeline runs in this process on the embedded defaults (mock Kafka, lake, rule-based judge and hint
//! extractor, SmolLM2 as policy and teacher): the student's requests go through the capture proxy to the
//! policy server; the pipeline pairs each answer with the student's reply, judges it, extracts hints,
//! computes teacher log-probs, trains and publishes checkpoints, and the server loads each one while the
//! student keeps working. The personalization score on held-out problems is measured for the initial
//! weights and for every checkpoint the server loaded, then printed, written to the lake
//! (`eval_scores`) and to `report.md` with a plot.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::Mutex;

use super::{eval_rows, load_gsm8k, split_problems, write_report, CheckpointEval, DemoReport, Preferences, Problem, Score, Student};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::runtime::Stop;
use crate::stages::run::{start_pipeline, RunOptions, RunReport};

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
    /// Response length limit, tokens.
    pub max_tokens: usize,
    /// Sampling temperature of the student's sessions (evaluation is greedy).
    pub temperature: f32,
    /// Seed (problem split, student phrasing, sampling).
    pub seed: u64,
    /// The student's hidden preferences.
    pub preferences: Preferences,
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
    student: Student,
    problems: Mutex<std::vec::IntoIter<Problem>>,
    answered: AtomicU64,
    sessions: AtomicU64,
    failed: AtomicU64,
    versions: std::sync::Mutex<std::collections::BTreeSet<i64>>,
    next_session: AtomicUsize,
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
    loop {
        if sh.budget_used() {
            return Ok(());
        }
        let Some(problem) = sh.problems.lock().await.next() else { return Ok(()) };
        let session = format!("student-{}-{}", sh.next_session.fetch_add(1, Ordering::SeqCst), problem.id);
        sh.sessions.fetch_add(1, Ordering::SeqCst);
        let mut messages = vec![json!({"role": "user", "content": sh.student.first_message(&problem)})];
        for turn in 1..=sh.opts.max_turns {
            let body = json!({
                "model": "policy",
                "messages": messages,
                "max_tokens": sh.opts.max_tokens,
                "temperature": sh.opts.temperature,
                "seed": sh.opts.seed.wrapping_add(worker as u64 * 1000 + turn as u64 + problem.id as u64 * 7),
            });
            let headers = [("X-Session-Id", session.clone()), ("X-Turn-Type", "main".to_string())];
            let (text, version) = match chat(&sh.client, &sh.proxy, body, &headers).await {
                Ok(r) => r,
                Err(e) => {
                    sh.failed.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(session, error = %e, "student request failed");
                    break;
                }
            };
            sh.answered.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut v) = sh.versions.lock() {
                v.insert(version);
            }
            let reply = sh.student.reply_at(&text, &problem, turn);
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(json!({"role": "user", "content": reply.text}));
            let last = reply.session_done || turn == sh.opts.max_turns || sh.budget_used();
            if last {
                // The student's last reply is the next state of the last answer: it reaches the pipeline
                // in a closing side turn (not trained; one token) that also marks the session done.
                let body = json!({"model": "policy", "messages": messages, "max_tokens": 1, "temperature": 0.0});
                let headers = [("X-Session-Id", session.clone()), ("X-Turn-Type", "side".to_string()), ("X-Session-Done", "true".to_string())];
                if let Err(e) = chat(&sh.client, &sh.proxy, body, &headers).await {
                    sh.failed.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(session, error = %e, "closing request failed");
                }
                break;
            }
        }
    }
}

/// Greedy answers of the served policy for the evaluation problems (straight to the server, so they
/// never become training data). Returns the version that answered and the responses.
async fn evaluate(client: &reqwest::Client, serve: &str, problems: &[Problem], student: &Student, max_tokens: usize) -> Result<(i64, Vec<(Problem, String)>)> {
    let mut out = vec![];
    let mut versions = std::collections::BTreeSet::new();
    let futs = problems.iter().map(|p| {
        let body = json!({
            "model": "policy",
            "messages": [{"role": "user", "content": student.first_message(p)}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        });
        chat(client, serve, body, &[])
    });
    for (p, r) in problems.iter().zip(futures::future::join_all(futs).await) {
        let (text, v) = r?;
        versions.insert(v);
        out.push((p.clone(), text));
    }
    // a reload between requests would mix versions: report the oldest (the one guaranteed for all)
    Ok((versions.iter().next().copied().unwrap_or(0), out))
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
    let split = split_problems(&problems, opts.eval_problems, opts.seed)?;
    let student = Student::new(opts.seed, opts.preferences.clone(), opts.max_turns)?;
    let run_id = format!("{}-{}", opts.pipeline.name, chrono::Utc::now().format("%Y%m%dT%H%M%S"));
    let run_opts = RunOptions { only: None, until_idle: true, checkpoints_dir: Some(ck_dir.clone()), run_id: Some("demo".into()), resume: false };
    let mut running = start_pipeline(&opts.pipeline, &run_opts, stop.clone()).await?;
    running.keep_serving_when_idle();
    let serve = running.serve_url.clone().ok_or_else(|| Error::Internal("demo pipeline has no server".into()))?;
    let proxy = running.proxy_url.clone().ok_or_else(|| Error::Internal("demo pipeline has no proxy".into()))?;
    let policy = running.policy.clone().ok_or_else(|| Error::Internal("demo pipeline has no server".into()))?;
    let idle = running.idle_flag();
    let lake = running.lake.clone();
    let finish = tokio::spawn(running.finish());
    let client = reqwest::Client::builder().timeout(Duration::from_secs(900)).build().map_err(|e| Error::Http(e.to_string()))?;

    eprintln!("[demo] evaluating the initial policy on {} held-out problems", split.eval.len());
    let prefs = opts.preferences.clone();
    let (v0, responses) = evaluate(&client, &serve, &split.eval, &student, opts.max_tokens).await?;
    let mut evals: Vec<(i64, u64, Vec<(Problem, String)>)> = vec![(v0, 0, responses)];
    let before = super::personalization_score(&evals[0].2, &prefs);
    eprintln!("[demo] version {v0}: personalization score {:.3} (accuracy {:.3})", before.fraction_all_satisfied, before.accuracy);

    let sh = Arc::new(Shared {
        client: client.clone(),
        proxy,
        student,
        problems: Mutex::new(split.train.clone().into_iter()),
        answered: AtomicU64::new(0),
        sessions: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        versions: std::sync::Mutex::new(Default::default()),
        next_session: AtomicUsize::new(0),
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
    // Evaluate every new version the server loads while the students work and the pipeline drains.
    let mut evaluated = v0;
    let mut students_done = false;
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
        if v > evaluated {
            let seen = sh.answered.load(Ordering::SeqCst);
            eprintln!("[demo] the server now serves version {v}; evaluating");
            let (ve, responses) = evaluate(&client, &serve, &split.eval, &sh.student, opts.max_tokens).await?;
            let s = super::personalization_score(&responses, &prefs);
            eprintln!("[demo] version {ve}: personalization score {:.3} (accuracy {:.3})", s.fraction_all_satisfied, s.accuracy);
            evaluated = v.max(ve);
            evals.push((ve, seen, responses));
        }
        if students_done && idle.is_set() && policy.version() == last_checkpoint(&ck_dir.join("demo")) && evaluated >= policy.version() {
            break;
        }
    }
    stop.request();
    let run = finish.await.map_err(|e| Error::Internal(format!("pipeline task: {e}")))??;

    // Outputs: eval_scores in the lake, report.md + plot, and the summary.
    let now = crate::schema::now_ms();
    let mut rows = vec![];
    let mut checkpoints = vec![];
    for (v, seen, responses) in &evals {
        rows.extend(eval_rows(&run_id, &opts.pipeline.name, *v, *seen as i64, responses, &prefs, now));
        let verdicts: Vec<super::Verdict> = responses.iter().map(|(p, r)| super::check(r, p, &prefs)).collect();
        let satisfied = verdicts.iter().map(|v| v.satisfied).collect();
        checkpoints.push(CheckpointEval { version: *v, interactions: *seen, score: Score::from_verdicts(&verdicts, &prefs), satisfied });
    }
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
    let report = DemoReport {
        title: "nextstate demo: a simulated student teaches the agent".into(),
        run_id: run_id.clone(),
        arm: opts.pipeline.method.as_str().into(),
        preferences: prefs.clone(),
        checkpoints: checkpoints.clone(),
        pipeline_counts: counts,
        notes: vec![
            format!(
                "Policy {} on CPU; {} interactions by {} concurrent students, sessions of at most {} turns; responses up to {} tokens at temperature {}; evaluation greedy on {} held-out problems.",
                opts.pipeline.policy.model.display(),
                sh.answered.load(Ordering::SeqCst),
                opts.students,
                opts.max_turns,
                opts.max_tokens,
                opts.temperature,
                split.eval.len()
            ),
            format!(
                "Trainer: method {}, batch {} samples, lr {}, LoRA {}.",
                opts.pipeline.method.as_str(),
                opts.pipeline.trainer.batch_size,
                opts.pipeline.trainer.lr,
                if opts.pipeline.trainer.lora.enabled { format!("rank {} alpha {}", opts.pipeline.trainer.lora.rank, opts.pipeline.trainer.lora.alpha) } else { "off (full fine-tuning)".into() }
            ),
            "Judge and hint extractor are the embedded rule-based baselines (not LLMs).".into(),
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
        result_line,
        report: files.markdown,
        run,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn last_checkpoint(run_dir: &std::path::Path) -> i64 {
    crate::trainer::latest_complete(run_dir).ok().flatten().map(|(_, m)| m.version).unwrap_or(0)
}

/// Handle on a pipeline started with `keep_serving_when_idle`.
pub use crate::stages::run::IdleHandle;
