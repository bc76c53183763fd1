//! PRM accuracy against the truth (`nextstate prm-eval`): how often a judge's votes on the simulated
//! student's turns are usable, and how well they agree with what the student actually wanted.
//!
//! The truth of a turn is the student's own checker ([`check`]): +1 when the response meets every
//! enabled preference, −1 otherwise — the same verdict the student's reply was written from (docs/method.md
//! §7). A judge only sees what a deployed judge sees: the request, the response and the student's reply
//! (the next state), through the pipeline's own prompt ([`crate::judge::JUDGE_TEMPLATE`]), parser and
//! majority ([`judge_turn`]).
//!
//! Turns come from demo lakes (`nextstate demo`, or the online ablation's replicates): every main turn
//! whose signal has a user next state, in (session, turn) order. Its problem is found by the GSM8K
//! question its first user message contains.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::{check, Preferences, Problem};
use crate::hint::{candidate_hints, hint_turn, HintConfig, Hinter};
use crate::judge::{judge_turn, Judge, JudgeConfig, TurnContext};
use crate::lake::Lake;
use crate::schema::{HintRecord, Interaction, Judgment, NextStateKind, Signal, TurnType};
use crate::stats::{wilson_95, Proportion};
use crate::Result;

/// A turn with its truth.
#[derive(Debug, Clone)]
pub struct LabelledTurn {
    /// What the judge reads.
    pub turn: TurnContext,
    /// +1: the response met every enabled preference; −1: it did not.
    pub truth: i32,
    /// The GSM8K problem of the session (`Problem::id`).
    pub problem_id: usize,
}

/// Reads the labelled turns of `lakes` (in order, each in (session id, turn index) order), at most
/// `limit`. Returns them and the turns left out, counted by reason (`not a main turn`, `no signal`,
/// `next state is not the user's`, `no known problem in the first user message`, `bad row: ...`).
///
/// # Errors
/// The lake's read errors.
pub fn labelled_turns(lakes: &[Lake], problems: &[Problem], prefs: &Preferences, limit: usize) -> Result<(Vec<LabelledTurn>, BTreeMap<String, u64>)> {
    let mut out = vec![];
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    let mut skip = |why: &str| *skipped.entry(why.to_string()).or_default() += 1;
    for lake in lakes {
        let mut interactions: Vec<Interaction> = lake.read_table()?;
        interactions.sort_by(|a, b| (&a.session_id, a.turn_index).cmp(&(&b.session_id, b.turn_index)));
        let signals: HashMap<String, Signal> = lake.read_table::<Signal>()?.into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
        for i in &interactions {
            if out.len() >= limit {
                return Ok((out, skipped));
            }
            if i.turn_type != TurnType::Main {
                skip("not a main turn");
                continue;
            }
            let Some(s) = signals.get(&i.interaction_id) else {
                skip("no signal");
                continue;
            };
            if s.kind != NextStateKind::User {
                skip("next state is not the user's");
                continue;
            }
            let turn = match TurnContext::from_rows(i, s) {
                Ok(t) => t,
                Err(e) => {
                    skip(&format!("bad row: {e}"));
                    continue;
                }
            };
            let first_user = turn.request.iter().find(|m| m.role == "user").map(|m| m.content.as_str()).unwrap_or("");
            let Some(problem) = problems.iter().find(|p| !p.question.trim().is_empty() && first_user.contains(p.question.trim())) else {
                skip("no known problem in the first user message");
                continue;
            };
            let truth = if check(&i.response_text, problem, prefs).satisfied { 1 } else { -1 };
            out.push(LabelledTurn { turn, truth, problem_id: problem.id });
        }
    }
    Ok((out, skipped))
}

/// One vote that could not be used: the turn, the model's raw answer and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unusable {
    /// The turn.
    pub interaction_id: String,
    /// The vote's raw text (empty when the request failed).
    pub raw: String,
    /// The parser's or the transport's error.
    pub error: String,
}

/// One judge's figures over the same turns.
#[derive(Debug, Clone, Serialize)]
pub struct JudgeFigures {
    /// The judge's label (`rules`, or the configuration file's name).
    pub name: String,
    /// Backend and model as recorded in the judgments.
    pub backend: String,
    /// Model id.
    pub model: String,
    /// Votes per turn, m.
    pub m: u32,
    /// Turns judged.
    pub turns: usize,
    /// Usable votes (a parsed grade: 1, 0 or −1, boxed or bare, [`crate::judge::parse_vote`]) of m × turns.
    pub usable: Proportion,
    /// Turns whose majority score equals the truth (a tie or no usable vote is a miss).
    pub agreement: Proportion,
    /// Turns without a decision: majority score 0 (a tie, a majority of `\boxed{0}` "can't tell", or no usable vote).
    pub ties: Proportion,
    /// Of the usable −1 votes, those on turns whose truth is −1.
    pub minus_precision: Proportion,
    /// Of the usable votes on turns whose truth is −1, those that are −1.
    pub minus_recall: Proportion,
    /// Unusable votes by error, first 120 characters of the error.
    pub unusable_by_reason: BTreeMap<String, u64>,
    /// Up to 20 unusable votes, for parser fixtures.
    pub unusable_examples: Vec<Unusable>,
    /// Wall time of all the judge's requests (s).
    pub wall_s: f64,
    /// `wall_s` / (m × turns): throughput at the configured concurrency, not one vote's latency.
    pub seconds_per_vote: f64,
}

/// The figures of `judgments` (one per turn, same order as `turns`) judged in `wall_s` seconds.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the lengths differ.
pub fn figures(name: &str, turns: &[LabelledTurn], judgments: &[Judgment], wall_s: f64) -> Result<JudgeFigures> {
    if turns.len() != judgments.len() {
        return Err(crate::input_err!("{} judgments for {} turns", judgments.len(), turns.len()));
    }
    let (mut usable, mut votes, mut agree, mut ties) = (0u64, 0u64, 0u64, 0u64);
    let (mut minus_votes, mut minus_true, mut on_bad, mut minus_on_bad) = (0u64, 0u64, 0u64, 0u64);
    let mut by_reason: BTreeMap<String, u64> = BTreeMap::new();
    let mut examples = vec![];
    for (t, j) in turns.iter().zip(judgments) {
        if j.score == t.truth {
            agree += 1;
        }
        if j.score == 0 {
            ties += 1;
        }
        for v in &j.votes {
            votes += 1;
            match v.value {
                Some(x) => {
                    usable += 1;
                    if x == -1 {
                        minus_votes += 1;
                        if t.truth == -1 {
                            minus_true += 1;
                        }
                    }
                    if t.truth == -1 {
                        on_bad += 1;
                        if x == -1 {
                            minus_on_bad += 1;
                        }
                    }
                }
                None => {
                    let why: String = v.error.as_deref().unwrap_or("no value").chars().take(120).collect();
                    *by_reason.entry(why.clone()).or_default() += 1;
                    if examples.len() < 20 {
                        examples.push(Unusable { interaction_id: j.interaction_id.clone(), raw: v.raw.clone(), error: why });
                    }
                }
            }
        }
    }
    let first = judgments.first();
    let m = first.map_or(0, |j| j.m.max(0) as u32);
    let n = turns.len() as u64;
    Ok(JudgeFigures {
        name: name.to_string(),
        backend: first.map(|j| j.judge_backend.clone()).unwrap_or_default(),
        model: first.map(|j| j.judge_model.clone()).unwrap_or_default(),
        m,
        turns: turns.len(),
        usable: wilson_95(usable, votes)?,
        agreement: wilson_95(agree, n)?,
        ties: wilson_95(ties, n)?,
        minus_precision: wilson_95(minus_true, minus_votes)?,
        minus_recall: wilson_95(minus_on_bad, on_bad)?,
        unusable_by_reason: by_reason,
        unusable_examples: examples,
        wall_s,
        seconds_per_vote: if votes > 0 { wall_s / votes as f64 } else { 0.0 },
    })
}

/// Judges every turn with `cfg` (m votes each, at most `cfg.concurrency` requests at a time) and
/// returns the judgments in turn order and the wall time (s). Never fails on a bad answer: an
/// unusable vote is recorded with its error.
///
/// # Errors
/// [`crate::Error::Config`] for an invalid judge configuration or a wrong endpoint (the stage's
/// start-up probe, [`Judge::probe`]).
pub async fn run_judge(cfg: JudgeConfig, turns: &[LabelledTurn]) -> Result<(Vec<Judgment>, f64)> {
    let judge = Arc::new(Judge::new(cfg)?);
    judge.probe().await?;
    for_each_turn(judge, turns, |judge, turn| async move { judge_turn(&judge, "prm-eval", &turn).await }).await
}

/// Runs `f(stage, turn)` for every turn at once (the stage's own semaphore bounds the requests) and
/// returns the results in turn order with the wall time (s).
async fn for_each_turn<S, T, F, Fut>(stage: Arc<S>, turns: &[LabelledTurn], f: F) -> Result<(Vec<T>, f64)>
where
    S: Send + Sync + 'static,
    T: Send + 'static,
    F: Fn(Arc<S>, TurnContext) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (k, t) in turns.iter().enumerate() {
        let fut = f(stage.clone(), t.turn.clone());
        tasks.spawn(async move { (k, fut.await) });
    }
    let mut out: Vec<Option<T>> = (0..turns.len()).map(|_| None).collect();
    while let Some(r) = tasks.join_next().await {
        let (k, x) = r.map_err(|e| crate::Error::Internal(format!("prm-eval task: {e}")))?;
        out[k] = Some(x);
    }
    Ok((out.into_iter().flatten().collect(), started.elapsed().as_secs_f64()))
}

fn pct(p: &Proportion) -> String {
    if p.n == 0 {
        return "–".to_string();
    }
    format!("{:.3} [{:.3}–{:.3}] ({}/{})", p.estimate, p.low, p.high, p.successes, p.n)
}

/// The report's judge table (markdown): one row per judge, every proportion with its 95 % Wilson
/// interval and counts.
pub fn judge_table(figs: &[JudgeFigures]) -> String {
    let mut s = String::from(
        "| judge | backend / model | m | turns | usable votes | agreement with the truth | no decision (score 0) | precision of −1 | recall of −1 | s per vote |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for f in figs {
        s.push_str(&format!(
            "| {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {:.2} |\n",
            f.name,
            f.backend,
            f.model,
            f.m,
            f.turns,
            pct(&f.usable),
            pct(&f.agreement),
            pct(&f.ties),
            pct(&f.minus_precision),
            pct(&f.minus_recall),
            f.seconds_per_vote
        ));
    }
    s
}

/// A judge to evaluate: a label and its `[judge]` configuration.
#[derive(Debug, Clone)]
pub struct JudgeSpec {
    /// Label in the report (`rules`, or the file stem).
    pub name: String,
    /// The configuration.
    pub config: JudgeConfig,
}

/// `rules` → (`rules`, the table's defaults); a path → (the file stem, its `[table]`).
fn table_from(spec: &str, table: &str) -> Result<(String, Option<toml::Value>)> {
    if spec == "rules" {
        return Ok(("rules".into(), None));
    }
    let path = std::path::Path::new(spec);
    let text = std::fs::read_to_string(path).map_err(|e| crate::config_err!("--{table} {spec}: cannot read it: {e} (give `rules` or a TOML file with a [{table}] table)"))?;
    let mut doc: toml::Table = toml::from_str(&text).map_err(|e| crate::config_err!("--{table} {spec}: not TOML: {e}"))?;
    let value = doc.remove(table).ok_or_else(|| crate::config_err!("--{table} {spec}: the file has no [{table}] table"))?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| spec.to_string());
    Ok((name, Some(value)))
}

impl JudgeSpec {
    /// `rules` (the embedded rule judge, m = 3 as the default `[judge]`) or the path of a TOML file
    /// with a `[judge]` table (a pipeline file, or a file holding only that table).
    ///
    /// # Errors
    /// [`crate::Error::Config`] when the file cannot be read, has no `[judge]` table or the table is
    /// invalid.
    pub fn parse(spec: &str) -> Result<JudgeSpec> {
        let (name, value) = table_from(spec, "judge")?;
        let config: JudgeConfig = match value {
            Some(v) => v.try_into().map_err(|e| crate::config_err!("--judge {spec}: [judge]: {e}"))?,
            None => JudgeConfig::default(),
        };
        config.validate()?;
        Ok(JudgeSpec { name, config })
    }
}

/// A hint extractor to evaluate: a label and its `[hint]` configuration.
#[derive(Debug, Clone)]
pub struct HintSpec {
    /// Label in the report (`rules`, or the file stem).
    pub name: String,
    /// The configuration.
    pub config: HintConfig,
}

impl HintSpec {
    /// `rules` or the path of a TOML file with a `[hint]` table, as [`JudgeSpec::parse`].
    ///
    /// # Errors
    /// As [`JudgeSpec::parse`], for `[hint]`.
    pub fn parse(spec: &str) -> Result<HintSpec> {
        let (name, value) = table_from(spec, "hint")?;
        let config: HintConfig = match value {
            Some(v) => v.try_into().map_err(|e| crate::config_err!("--hint {spec}: [hint]: {e}"))?,
            None => HintConfig::default(),
        };
        config.validate()?;
        Ok(HintSpec { name, config })
    }
}

/// One hint extractor's figures over the same turns.
#[derive(Debug, Clone, Serialize)]
pub struct HintFigures {
    /// Label.
    pub name: String,
    /// Model id as recorded.
    pub model: String,
    /// Votes per turn, m.
    pub m: u32,
    /// Usable votes (a parsed score) of m × turns.
    pub usable: Proportion,
    /// Turns whose truth is −1 with a hint chosen (the response missed a preference: a hint is due).
    pub accepted_when_due: Proportion,
    /// Turns whose truth is +1 with a hint chosen (nothing to fix: a spurious hint).
    pub accepted_when_not_due: Proportion,
    /// Mean number of distinct accepted candidates (score 1, longer than `min_hint_chars`) per turn
    /// with a chosen hint.
    pub distinct_candidates_mean: f64,
    /// Mean words of the chosen hints.
    pub hint_words_mean: f64,
    /// Up to 8 chosen hints on truth −1 turns, with the student's reply they came from.
    pub examples: Vec<(String, String)>,
    /// Wall time (s).
    pub wall_s: f64,
    /// `wall_s` / (m × turns).
    pub seconds_per_vote: f64,
}

/// The figures of `records` (one per turn, in `turns` order) made in `wall_s` seconds.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the lengths differ.
pub fn hint_figures(name: &str, cfg: &HintConfig, turns: &[LabelledTurn], records: &[HintRecord], wall_s: f64) -> Result<HintFigures> {
    if turns.len() != records.len() {
        return Err(crate::input_err!("{} hint records for {} turns", records.len(), turns.len()));
    }
    let (mut usable, mut votes) = (0u64, 0u64);
    let (mut due, mut due_hit, mut not_due, mut not_due_hit) = (0u64, 0u64, 0u64, 0u64);
    let (mut distinct, mut with_hint, mut words) = (0usize, 0usize, 0usize);
    let mut examples = vec![];
    for (t, r) in turns.iter().zip(records) {
        votes += r.candidates.len() as u64;
        usable += r.candidates.iter().filter(|c| c.score.is_some()).count() as u64;
        let chosen = r.chosen_hint.is_some();
        if t.truth == -1 {
            due += 1;
            due_hit += chosen as u64;
        } else {
            not_due += 1;
            not_due_hit += chosen as u64;
        }
        if let Some(h) = &r.chosen_hint {
            with_hint += 1;
            distinct += candidate_hints(&r.candidates, cfg.min_hint_chars, usize::MAX).len();
            words += h.split_whitespace().count();
            if t.truth == -1 && examples.len() < 8 {
                examples.push((t.turn.next_state_text.clone(), h.clone()));
            }
        }
    }
    let mean = |a: usize| if with_hint > 0 { a as f64 / with_hint as f64 } else { 0.0 };
    Ok(HintFigures {
        name: name.to_string(),
        model: records.first().map(|r| r.hint_model.clone()).unwrap_or_default(),
        m: cfg.m,
        usable: wilson_95(usable, votes)?,
        accepted_when_due: wilson_95(due_hit, due)?,
        accepted_when_not_due: wilson_95(not_due_hit, not_due)?,
        distinct_candidates_mean: mean(distinct),
        hint_words_mean: mean(words),
        examples,
        wall_s,
        seconds_per_vote: if votes > 0 { wall_s / votes as f64 } else { 0.0 },
    })
}

/// Extracts the hint of every turn with `cfg`; returns the records in turn order and the wall time (s).
///
/// # Errors
/// [`crate::Error::Config`] for an invalid configuration.
pub async fn run_hint(cfg: HintConfig, turns: &[LabelledTurn]) -> Result<(Vec<HintRecord>, f64)> {
    let hinter = Arc::new(Hinter::new(cfg)?);
    hinter.probe().await?;
    for_each_turn(hinter, turns, |hinter, turn| async move { hint_turn(&hinter, "prm-eval", &turn).await }).await
}

/// The report's hint table (markdown).
pub fn hint_table(figs: &[HintFigures]) -> String {
    let mut s = String::from("| hint extractor | model | m | usable votes | hint chosen when due (truth −1) | hint chosen when not due (truth +1) | distinct accepted candidates per hinted turn | words per hint | s per vote |\n|---|---|---|---|---|---|---|---|---|\n");
    for f in figs {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.2} |\n",
            f.name,
            f.model,
            f.m,
            pct(&f.usable),
            pct(&f.accepted_when_due),
            pct(&f.accepted_when_not_due),
            f.distinct_candidates_mean,
            f.hint_words_mean,
            f.seconds_per_vote
        ));
    }
    s
}

/// What `nextstate prm-eval` was asked.
#[derive(Debug, Clone)]
pub struct PrmEvalOptions {
    /// Demo lakes to read turns from, in order.
    pub lakes: Vec<std::path::PathBuf>,
    /// The judges, each over the same turns.
    pub judges: Vec<JudgeSpec>,
    /// The hint extractors, each over the same turns.
    pub hints: Vec<HintSpec>,
    /// Most turns.
    pub limit: usize,
    /// GSM8K file the demo's problems came from.
    pub gsm8k: std::path::PathBuf,
    /// The student's preferences (the truth).
    pub preferences: Preferences,
    /// Output folder: `report.md`, `results.json`, `judgments/<judge>.jsonl`.
    pub out: std::path::PathBuf,
    /// The command line, for the report.
    pub command: String,
}

/// Everything `nextstate prm-eval` measured (`results.json`).
#[derive(Debug, Clone, Serialize)]
pub struct PrmEvalResults {
    /// Turns judged.
    pub turns: usize,
    /// Turns whose truth is +1.
    pub truth_positive: usize,
    /// Turns left out, by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Per judge.
    pub judges: Vec<JudgeFigures>,
    /// Per hint extractor.
    pub hints: Vec<HintFigures>,
}

/// Runs every judge over the labelled turns of the lakes and writes the report. Returns the results.
///
/// # Errors
/// [`crate::Error::Config`] without a turn or for an invalid judge; read and write errors.
pub async fn prm_eval_command(o: &PrmEvalOptions) -> Result<PrmEvalResults> {
    let lakes = o.lakes.iter().map(Lake::open_existing).collect::<Result<Vec<_>>>()?;
    let problems = super::load_gsm8k(&o.gsm8k)?;
    let (turns, skipped) = labelled_turns(&lakes, &problems, &o.preferences, o.limit)?;
    if turns.is_empty() {
        return Err(crate::config_err!("no labelled turn in {:?} (left out: {skipped:?}): give lakes written by `nextstate demo` or `nextstate ablate` online arms", o.lakes));
    }
    let dir = o.out.join("judgments");
    std::fs::create_dir_all(&dir).map_err(|e| crate::Error::io("create folder", &dir, e))?;
    let mut figs = vec![];
    for spec in &o.judges {
        tracing::info!(judge = %spec.name, turns = turns.len(), m = spec.config.m, "judging");
        let (judgments, wall) = run_judge(spec.config.clone(), &turns).await?;
        write_rows(&dir.join(format!("{}.jsonl", spec.name)), &turns, "judgment", &judgments)?;
        figs.push(figures(&spec.name, &turns, &judgments, wall)?);
    }
    let mut hint_figs = vec![];
    for spec in &o.hints {
        tracing::info!(hint = %spec.name, turns = turns.len(), m = spec.config.m, "extracting hints");
        let (records, wall) = run_hint(spec.config.clone(), &turns).await?;
        write_rows(&dir.join(format!("hint-{}.jsonl", spec.name)), &turns, "hint", &records)?;
        hint_figs.push(hint_figures(&spec.name, &spec.config, &turns, &records, wall)?);
    }
    let results = PrmEvalResults { turns: turns.len(), truth_positive: turns.iter().filter(|t| t.truth == 1).count(), skipped, judges: figs, hints: hint_figs };
    let path = o.out.join("results.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&results)?).map_err(|e| crate::Error::io("write", &path, e))?;
    let path = o.out.join("report.md");
    std::fs::write(&path, render(o, &results)).map_err(|e| crate::Error::io("write", &path, e))?;
    Ok(results)
}

/// Writes one JSON line per turn, `{"truth", "problem_id", <key>: row}`, to `path`.
fn write_rows<T: Serialize>(path: &std::path::Path, turns: &[LabelledTurn], key: &str, rows: &[T]) -> Result<()> {
    let mut lines = String::new();
    for (t, r) in turns.iter().zip(rows) {
        lines.push_str(&serde_json::to_string(&serde_json::json!({"truth": t.truth, "problem_id": t.problem_id, key: r}))?);
        lines.push('\n');
    }
    std::fs::write(path, lines).map_err(|e| crate::Error::io("write", path, e))
}

/// The report: what was measured, the judge table, and each judge's unusable votes.
pub fn render(o: &PrmEvalOptions, r: &PrmEvalResults) -> String {
    let mut s = String::from("# PRM accuracy against the student's truth\n\n");
    s.push_str(&format!("Command: `{}`\n\n", o.command));
    s.push_str(&format!(
        "{} student turns from {} lake(s); the truth is the student's checker (every enabled preference met: +1, else −1; preferences: {}): {} of them +1. Turns left out: {:?}.\n\n",
        r.turns,
        o.lakes.len(),
        o.preferences.describe().join("; "),
        r.truth_positive,
        r.skipped
    ));
    if r.turns > 0 {
        let neg = (r.turns - r.truth_positive) as f64 / r.turns as f64;
        s.push_str(&format!(
            "Baselines: a judge that always votes −1 agrees on {neg:.3} of these turns, one that always votes +1 on {:.3}. Seconds per vote are wall time over votes at the configured concurrency.\n\n",
            1.0 - neg
        ));
    }
    s.push_str("Each judge reads the request, the response and the student's reply through the pipeline's judge prompt, parser and majority. Agreement: the majority score equals the truth (a tie or no usable vote is a miss). Precision and recall of −1 are over usable votes. Intervals are 95 % Wilson.\n\n");
    s.push_str(&judge_table(&r.judges));
    if !r.hints.is_empty() {
        s.push_str("\n## Hints\n\nEvery turn goes to each hint extractor; a hint is due where the response missed a preference (truth −1).\n\n");
        s.push_str(&hint_table(&r.hints));
        for f in &r.hints {
            s.push_str(&format!("\nChosen hints of `{}` (the student's reply → the hint):\n\n", f.name));
            for (reply, hint) in &f.examples {
                let reply: String = reply.chars().take(160).collect();
                let hint: String = hint.chars().take(240).collect();
                s.push_str(&format!("- {reply:?} → {hint:?}\n"));
            }
        }
    }
    for f in &r.judges {
        if f.unusable_by_reason.is_empty() {
            continue;
        }
        s.push_str(&format!("\n## Unusable votes of `{}`\n\n| error | votes |\n|---|---|\n", f.name));
        for (why, n) in &f.unusable_by_reason {
            s.push_str(&format!("| {} | {n} |\n", crate::report::cell(why)));
        }
        s.push_str("\nExamples (raw answers, first 300 characters):\n\n");
        for u in f.unusable_examples.iter().take(5) {
            let raw: String = u.raw.chars().take(300).collect();
            s.push_str(&format!("- `{}`: {:?}\n", u.error, raw));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Vote;

    fn labelled(truth: i32) -> LabelledTurn {
        let turn = crate::judge::turn_for_tests(vec![], "r", NextStateKind::User, "ok");
        LabelledTurn { turn, truth, problem_id: 0 }
    }

    fn judgment(values: &[Option<i32>], score: i32, tie: bool) -> Judgment {
        let votes: Vec<Vote> = values
            .iter()
            .enumerate()
            .map(|(k, v)| Vote { index: k as i32, raw: if v.is_some() { "\\boxed{1}".into() } else { "I think so".into() }, value: *v, error: v.is_none().then(|| "no \\boxed{} in the answer".to_string()), cached: false })
            .collect();
        Judgment {
            schema_version: 1,
            judgment_id: "j".into(),
            pipeline: "p".into(),
            interaction_id: "i".into(),
            session_id: "s".into(),
            tenant: None,
            turn_index: 0,
            policy_version: None,
            m: values.len() as i32,
            valid_votes: values.iter().filter(|v| v.is_some()).count() as i32,
            votes,
            tie,
            score,
            judge_backend: "openai".into(),
            judge_model: "q".into(),
            template_id: "t".into(),
            template_hash: "h".into(),
            temperature: 0.6,
            max_tokens: 64,
            cache_hits: 0,
            event_time: 0,
            processed_time: 0,
        }
    }

    #[test]
    fn figures_by_hand() {
        // Truths +1, −1, −1, +1; votes (m = 3):
        //   t0 (+1): 1, 1, none → score +1 (agree)
        //   t1 (−1): −1, −1, 1 → −1 (agree)
        //   t2 (−1): 1, −1, none → tie (miss, tie)
        //   t3 (+1): −1, −1, −1 → −1 (miss)
        let turns: Vec<LabelledTurn> = [1, -1, -1, 1].into_iter().map(labelled).collect();
        let js = vec![
            judgment(&[Some(1), Some(1), None], 1, false),
            judgment(&[Some(-1), Some(-1), Some(1)], -1, false),
            judgment(&[Some(1), Some(-1), None], 0, true),
            judgment(&[Some(-1), Some(-1), Some(-1)], -1, false),
        ];
        let f = figures("llm", &turns, &js, 24.0).unwrap();
        assert_eq!((f.usable.successes, f.usable.n), (10, 12));
        assert_eq!((f.agreement.successes, f.agreement.n), (2, 4));
        assert_eq!((f.ties.successes, f.ties.n), (1, 4));
        // −1 votes: t1 ×2, t2 ×1, t3 ×3 = 6, of which on truth −1 turns: 3.
        assert_eq!((f.minus_precision.successes, f.minus_precision.n), (3, 6));
        // Usable votes on truth −1 turns: t1 ×3, t2 ×2 = 5, of which −1: 3.
        assert_eq!((f.minus_recall.successes, f.minus_recall.n), (3, 5));
        assert_eq!(f.unusable_by_reason.get("no \\boxed{} in the answer"), Some(&2));
        assert_eq!((f.m, f.turns, f.seconds_per_vote), (3, 4, 2.0));
        assert!(judge_table(&[f]).contains("| llm | openai / q | 3 | 4 | 0.833 ["));
        assert!(figures("x", &turns, &js[..3], 1.0).is_err());
    }

    fn record(cands: &[(Option<i32>, Option<&str>)], chosen: Option<&str>) -> HintRecord {
        let candidates = cands
            .iter()
            .enumerate()
            .map(|(k, (score, hint))| crate::schema::HintCandidate { index: k as i32, raw: String::new(), score: *score, hint: hint.map(str::to_string), error: None, cached: false })
            .collect();
        HintRecord {
            schema_version: 1,
            hint_id: "h".into(),
            pipeline: "p".into(),
            interaction_id: "i".into(),
            session_id: "s".into(),
            tenant: None,
            turn_index: 0,
            candidates,
            strategy: "longest".into(),
            chosen_hint: chosen.map(str::to_string),
            chosen_index: None,
            reason: String::new(),
            hint_backend: "openai".into(),
            hint_model: "q".into(),
            template_id: "t".into(),
            template_hash: "h".into(),
            teacher_messages: None,
            teacher_prompt_text: None,
            cache_hits: 0,
            event_time: 0,
            processed_time: 0,
        }
    }

    #[test]
    fn hint_figures_by_hand() {
        // t0 (−1): two distinct accepted hints, one duplicate, chosen "Keep it short please." (4 words)
        // t1 (−1): no usable vote, nothing chosen
        // t2 (+1): a spurious hint "Use plain sentences now." (4 words), one candidate
        let turns: Vec<LabelledTurn> = [-1, -1, 1].into_iter().map(labelled).collect();
        let rs = vec![
            record(&[(Some(1), Some("Keep it short please.")), (Some(1), Some("Give the final number last.")), (Some(1), Some("Keep it short please."))], Some("Keep it short please.")),
            record(&[(None, None), (None, None), (None, None)], None),
            record(&[(Some(1), Some("Use plain sentences now.")), (Some(-1), None), (None, None)], Some("Use plain sentences now.")),
        ];
        let f = hint_figures("llm", &HintConfig::default(), &turns, &rs, 9.0).unwrap();
        assert_eq!((f.usable.successes, f.usable.n), (5, 9));
        assert_eq!((f.accepted_when_due.successes, f.accepted_when_due.n), (1, 2));
        assert_eq!((f.accepted_when_not_due.successes, f.accepted_when_not_due.n), (1, 1));
        assert_eq!((f.distinct_candidates_mean, f.hint_words_mean, f.seconds_per_vote), (1.5, 4.0, 1.0));
        assert_eq!(f.examples.len(), 1);
        assert!(hint_table(&[f]).contains("| llm | q | 3 | 0.556 ["));
    }
}
