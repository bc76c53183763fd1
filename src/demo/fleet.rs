//! `nextstate demo --tenants 2`: two students with conflicting preferences use one agent through one
//! capture proxy, each sending its own tenant id (`X-Agent-Id`), and the demo's loop runs twice from
//! the same initial weights, students and seeds: once training one **shared** policy on both tenants'
//! samples, once training **per-tenant** adapters (`[trainer.tenants] mode = "per_tenant"`,
//! docs/tenants.md). Afterwards every tenant's held-out score is measured with its own checker for the
//! initial weights (v0), the shared policy's last checkpoint, and its own adapter's last checkpoint.
//!
//! The students are `alice`, who wants the default preferences (short plain sentences, the number at
//! the end: [`Preferences::default`]), and `bob`, who wants worked steps (`Step 1:` … lines, the number at
//! the end: [`Preferences::worked_steps`]); no answer can satisfy both on style. Both profiles are the
//! environment's, fixed before any result was seen. The held-out prompts are the same problems phrased
//! the same way for both (a student's phrasing depends on the seed, not on the preferences), so one
//! greedy pass per policy serves both checkers.
//!
//! Statistics: each score with its 95 % Wilson interval over the held-out problems, and per tenant the
//! exact McNemar tests of per-tenant vs v0, shared vs v0 and per-tenant vs shared (paired by problem),
//! Holm-corrected across all of them. The hypothesis — per-tenant satisfies both, shared neither well —
//! is a hypothesis; the report says what was measured.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::run::{run_demo, DemoOptions};
use super::{check, load_gsm8k, split_problems, Preferences, Score, Student};
use crate::error::{Error, Result};
use crate::runtime::Stop;
use crate::stats::{holm, mcnemar_exact, p_text, wilson_95};
use crate::trainer::TrainingMode;

/// The fleet demo's two tenants and their preferences (`word_limit` for alice's `concise`;
/// `require_correct` for both).
pub fn two_tenants(word_limit: usize, require_correct: bool) -> Vec<(String, Preferences)> {
    let alice = Preferences { max_words: word_limit, correct_answer: require_correct, ..Preferences::default() };
    let bob = Preferences { correct_answer: require_correct, ..Preferences::worked_steps() };
    vec![("alice".into(), alice), ("bob".into(), bob)]
}

/// One policy's held-out result for one tenant.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyResult {
    /// `v0`, `shared` or `per_tenant`.
    pub policy: String,
    /// Checkpoint version evaluated (0: the initial weights).
    pub version: i64,
    /// Scores under the tenant's own preferences.
    pub score: Score,
    /// Per held-out problem: every preference met.
    pub satisfied: Vec<bool>,
    /// 95 % Wilson interval of `score.fraction_all_satisfied` (low, high).
    pub interval: (f64, f64),
}

/// One tenant's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TenantResult {
    /// The tenant id.
    pub tenant: String,
    /// Its preferences.
    pub preferences: Preferences,
    /// v0, shared, per-tenant (in this order).
    pub policies: Vec<PolicyResult>,
}

/// One paired comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Comparison {
    /// The tenant.
    pub tenant: String,
    /// Policy A and B (`a − b` is reported).
    pub a: String,
    /// Policy B.
    pub b: String,
    /// Score of A minus score of B (fraction of problems).
    pub difference: f64,
    /// Problems only A satisfied / only B satisfied.
    pub only_a: u64,
    /// Problems only B satisfied.
    pub only_b: u64,
    /// Exact McNemar p (two-sided).
    pub p: f64,
    /// Holm-adjusted across every comparison of the report.
    pub p_holm: f64,
}

/// One mode's run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeRun {
    /// `shared` or `per_tenant`.
    pub mode: String,
    /// Student turns answered.
    pub interactions: u64,
    /// Failed requests.
    pub failed_requests: u64,
    /// Optimizer steps taken (all adapters).
    pub steps: i64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Its demo folder.
    pub out: PathBuf,
}

/// What `demo --tenants 2` measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FleetSummary {
    /// Both modes' runs.
    pub runs: Vec<ModeRun>,
    /// Per tenant, the three policies.
    pub tenants: Vec<TenantResult>,
    /// Every paired comparison.
    pub comparisons: Vec<Comparison>,
    /// Held-out problems.
    pub problems: usize,
    /// Evaluation wall time, seconds.
    pub eval_seconds: f64,
    /// Total wall time, seconds.
    pub seconds: f64,
    /// `report.md`.
    pub report: PathBuf,
}

/// Runs both modes (`<out>/shared`, `<out>/per_tenant`), evaluates, writes `<out>/report.md` and
/// `<out>/fleet.json`. `opts.fleet` names the tenants (at least 2); `opts.pipeline` must train LoRA.
///
/// # Errors
/// [`Error::Config`] for fewer than 2 tenants, a number of students that is not a multiple of the
/// tenants', or a pipeline without LoRA; the errors of
/// [`run_demo`]; model and file errors of the evaluation; [`Error::Cancelled`] when stopped.
pub async fn run_fleet_demo(opts: DemoOptions, stop: Stop) -> Result<FleetSummary> {
    let started = Instant::now();
    if opts.fleet.len() < 2 {
        return Err(crate::config_err!("a fleet demo needs at least 2 tenants, got {}", opts.fleet.len()));
    }
    if opts.students < opts.fleet.len() || !opts.students.is_multiple_of(opts.fleet.len()) {
        return Err(crate::config_err!("a fleet demo of {} tenants needs a multiple of {} students (student w works for tenant w mod {}), got {}", opts.fleet.len(), opts.fleet.len(), opts.fleet.len(), opts.students));
    }
    if !opts.pipeline.trainer.lora.enabled {
        return Err(crate::config_err!("a fleet demo trains per-tenant LoRA adapters: the pipeline needs [trainer.lora] enabled = true"));
    }
    let mut runs = vec![];
    for mode in [TrainingMode::Shared, TrainingMode::PerTenant] {
        let mut o = opts.clone();
        o.out = opts.out.join(mode.as_str());
        o.pipeline.trainer.tenants.mode = mode;
        eprintln!("[demo] fleet: mode {} ({} tenants)", mode.as_str(), opts.fleet.len());
        // run_demo stops its own pipeline through the stop it is given: a child, so the next mode runs.
        let s = run_demo(o.clone(), stop.child()).await?;
        if stop.requested() {
            return Err(Error::Cancelled);
        }
        runs.push(ModeRun { mode: mode.as_str().into(), interactions: s.interactions, failed_requests: s.failed_requests, steps: s.run.train.as_ref().map_or(0, |t| t.steps), seconds: s.seconds, out: o.out });
    }
    let t = Instant::now();
    let (o2, runs2) = (opts.clone(), runs.clone());
    let tenants = tokio::task::spawn_blocking(move || evaluate(&o2, &runs2)).await.map_err(|e| Error::Internal(format!("evaluation task: {e}")))??;
    let eval_seconds = t.elapsed().as_secs_f64();
    let comparisons = compare(&tenants)?;
    let problems = tenants.first().and_then(|t| t.policies.first()).map_or(0, |p| p.satisfied.len());
    let report = opts.out.join("report.md");
    let mut summary = FleetSummary { runs, tenants, comparisons, problems, eval_seconds, seconds: 0.0, report: report.clone() };
    summary.seconds = started.elapsed().as_secs_f64();
    std::fs::write(&report, render(&summary, &opts)).map_err(|e| Error::io("write", &report, e))?;
    let json = opts.out.join("fleet.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&summary)?).map_err(|e| Error::io("write", &json, e))?;
    Ok(summary)
}

/// The newest checkpoint folder under `run_dir` (None: no checkpoint).
fn newest(run_dir: &Path) -> Result<Option<(PathBuf, i64)>> {
    Ok(crate::trainer::latest_complete(run_dir)?.map(|(p, m)| (p, m.version)))
}

/// Greedy held-out answers of the policy at `checkpoint` (None: v0).
fn answers(opts: &DemoOptions, problems: &[super::Problem], student: &Student, checkpoint: Option<&Path>) -> Result<Vec<(super::Problem, String)>> {
    let lm = super::heldout::load_policy(&opts.pipeline, checkpoint)?;
    Ok(super::heldout::greedy_generations(&lm, problems, student, opts.max_tokens, 48)?.into_iter().map(|a| (a.problem, a.text)).collect())
}

fn result(policy: &str, version: i64, responses: &[(super::Problem, String)], prefs: &Preferences) -> Result<PolicyResult> {
    let verdicts: Vec<super::Verdict> = responses.iter().map(|(p, r)| check(r, p, prefs)).collect();
    let satisfied: Vec<bool> = verdicts.iter().map(|v| v.satisfied).collect();
    let w = wilson_95(satisfied.iter().filter(|s| **s).count() as u64, satisfied.len() as u64)?;
    Ok(PolicyResult { policy: policy.into(), version, score: Score::from_verdicts(&verdicts, prefs), satisfied, interval: (w.low, w.high) })
}

/// Evaluates v0, the shared policy's last checkpoint and each tenant's own last adapter on the held-out
/// problems, each tenant with its own checker.
fn evaluate(opts: &DemoOptions, runs: &[ModeRun]) -> Result<Vec<TenantResult>> {
    crate::model::set_threads(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as i32)?;
    let problems = load_gsm8k(&opts.gsm8k)?;
    let split = split_problems(&problems, opts.eval_problems, opts.split_seed.unwrap_or(opts.seed))?.evaluated_on(opts.eval_split)?;
    let students: Vec<Student> = opts.fleet.iter().map(|(_, p)| Student::new(opts.split_seed.unwrap_or(opts.seed), p.clone(), opts.max_turns)).collect::<Result<_>>()?;
    // One greedy pass per policy serves every tenant: their held-out prompts are the same.
    for s in &students[1..] {
        if split.eval.iter().any(|p| s.first_message(p) != students[0].first_message(p)) {
            return Err(Error::Internal("the tenants' held-out prompts differ; the fleet evaluation assumes one phrasing".into()));
        }
    }
    let run_dir = |mode: &str| runs.iter().find(|r| r.mode == mode).map(|r| r.out.join("checkpoints").join("demo")).unwrap_or_default();
    eprintln!("[demo] fleet: evaluating v0");
    let v0 = answers(opts, &split.eval, &students[0], None)?;
    let shared = newest(&run_dir("shared"))?;
    eprintln!("[demo] fleet: evaluating the shared policy's v{}", shared.as_ref().map_or(0, |s| s.1));
    let shared_answers = match &shared {
        Some((p, _)) => answers(opts, &split.eval, &students[0], Some(p))?,
        None => v0.clone(),
    };
    let mut out = vec![];
    for (t, prefs) in &opts.fleet {
        let own = newest(&run_dir("per_tenant").join(t))?;
        eprintln!("[demo] fleet: evaluating {t}'s adapter v{}", own.as_ref().map_or(0, |s| s.1));
        let own_answers = match &own {
            Some((p, _)) => answers(opts, &split.eval, &students[0], Some(p))?,
            None => v0.clone(),
        };
        out.push(TenantResult {
            tenant: t.clone(),
            preferences: prefs.clone(),
            policies: vec![
                result("v0", 0, &v0, prefs)?,
                result("shared", shared.as_ref().map_or(0, |s| s.1), &shared_answers, prefs)?,
                result("per_tenant", own.as_ref().map_or(0, |s| s.1), &own_answers, prefs)?,
            ],
        });
    }
    Ok(out)
}

/// Per tenant: per-tenant vs v0, shared vs v0, per-tenant vs shared; Holm across all.
fn compare(tenants: &[TenantResult]) -> Result<Vec<Comparison>> {
    let mut out = vec![];
    for t in tenants {
        let by = |name: &str| t.policies.iter().find(|p| p.policy == name);
        for (a, b) in [("per_tenant", "v0"), ("shared", "v0"), ("per_tenant", "shared")] {
            let (Some(pa), Some(pb)) = (by(a), by(b)) else { continue };
            let m = mcnemar_exact(&pb.satisfied, &pa.satisfied)?;
            out.push(Comparison {
                tenant: t.tenant.clone(),
                a: a.into(),
                b: b.into(),
                difference: pa.score.fraction_all_satisfied - pb.score.fraction_all_satisfied,
                only_a: m.gained,
                only_b: m.lost,
                p: m.p_value,
                p_holm: 1.0,
            });
        }
    }
    let adjusted = holm(&out.iter().map(|c| c.p).collect::<Vec<_>>());
    for (c, p) in out.iter_mut().zip(adjusted) {
        c.p_holm = p;
    }
    Ok(out)
}

/// `report.md`.
fn render(s: &FleetSummary, opts: &DemoOptions) -> String {
    let mut md = String::from("# nextstate demo: two tenants, shared policy vs per-tenant adapters\n\n");
    md.push_str(&format!(
        "Two simulated students with conflicting preferences use one agent through one capture proxy, each with its own tenant id (`X-Agent-Id`). The demo's loop ran twice from the same initial weights ({}), students and seeds: once training one shared policy on both tenants' samples, once one LoRA adapter per tenant (`[trainer.tenants] mode = \"per_tenant\"`). Then each tenant's checker scored greedy answers to the same {} held-out problems from v0, the shared policy's last checkpoint and the tenant's own adapter's last checkpoint.\n\n",
        opts.pipeline.policy.model.display(),
        s.problems
    ));
    md.push_str("Preferences (the environment's, fixed before the runs):\n\n");
    for t in &s.tenants {
        md.push_str(&format!("- **{}**: {}\n", t.tenant, t.preferences.describe().join("; ")));
    }
    md.push_str("\n## Score per tenant (every preference met; 95 % Wilson interval over the problems)\n\n| tenant | v0 | shared (last) | per-tenant adapter (last) |\n|---|---|---|---|\n");
    for t in &s.tenants {
        let cell = |p: &PolicyResult| format!("{:.3} [{:.3}, {:.3}] (v{})", p.score.fraction_all_satisfied, p.interval.0, p.interval.1, p.version);
        md.push_str(&format!("| {} | {} |\n", t.tenant, t.policies.iter().map(cell).collect::<Vec<_>>().join(" | ")));
    }
    md.push_str("\n## Per preference (rate of held-out answers meeting it)\n\n| tenant | preference | v0 | shared | per-tenant |\n|---|---|---:|---:|---:|\n");
    for t in &s.tenants {
        for name in t.preferences.enabled().iter().map(|p| p.name()) {
            let r = |i: usize| t.policies.get(i).and_then(|p| p.score.per_preference_rate.get(name)).map_or("–".into(), |x| format!("{x:.3}"));
            md.push_str(&format!("| {} | {name} | {} | {} | {} |\n", t.tenant, r(0), r(1), r(2)));
        }
    }
    md.push_str("\n## Paired tests (exact McNemar over the same problems; Holm across all rows)\n\n| tenant | A | B | A − B | only A | only B | p | Holm p |\n|---|---|---|---:|---:|---:|---:|---:|\n");
    for c in &s.comparisons {
        md.push_str(&format!("| {} | {} | {} | {:+.3} | {} | {} | {} | {} |\n", c.tenant, c.a, c.b, c.difference, c.only_a, c.only_b, p_text(c.p), p_text(c.p_holm)));
    }
    md.push_str("\n## Runs\n\n| mode | student turns | optimizer steps | failed requests | wall |\n|---|---:|---:|---:|---:|\n");
    for r in &s.runs {
        md.push_str(&format!("| {} | {} | {} | {} | {:.0} s |\n", r.mode, r.interactions, r.steps, r.failed_requests, r.seconds));
    }
    md.push_str(&format!(
        "\nEvaluation {:.0} s; total {:.0} s. Each mode's pipeline counts and training figures are in its own report (`shared/report.md`, `per_tenant/report.md`); every score is also in `fleet.json`.\n",
        s.eval_seconds, s.seconds
    ));
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, sat: &[bool]) -> PolicyResult {
        let k = sat.iter().filter(|s| **s).count();
        PolicyResult {
            policy: name.into(),
            version: 1,
            score: Score { n: sat.len(), fraction_all_satisfied: k as f64 / sat.len() as f64, per_preference_rate: Default::default(), accuracy: 0.0 },
            satisfied: sat.to_vec(),
            interval: (0.0, 1.0),
        }
    }

    #[test]
    fn comparisons_are_paired_by_problem_and_holm_corrected() {
        // 10 problems: v0 meets 2, shared 3, per-tenant 9 (it gains 7 of v0's misses and loses none).
        let v0 = [true, true, false, false, false, false, false, false, false, false];
        let shared = [true, true, true, false, false, false, false, false, false, false];
        let own = [true, true, true, true, true, true, true, true, true, false];
        let t = TenantResult { tenant: "alice".into(), preferences: Preferences::default(), policies: vec![policy("v0", &v0), policy("shared", &shared), policy("per_tenant", &own)] };
        let c = compare(&[t]).unwrap();
        assert_eq!(c.iter().map(|c| (c.a.as_str(), c.b.as_str(), c.only_a, c.only_b)).collect::<Vec<_>>(), vec![("per_tenant", "v0", 7, 0), ("shared", "v0", 1, 0), ("per_tenant", "shared", 6, 0)]);
        // exact McNemar: 7 discordant all one way → p = 2 · 0.5^7 = 0.015625; 1 → 1; 6 → 2 · 0.5^6 = 0.03125
        assert!((c[0].p - 0.015625).abs() < 1e-12 && (c[1].p - 1.0).abs() < 1e-12 && (c[2].p - 0.03125).abs() < 1e-12);
        // Holm over (0.015625, 1, 0.03125): 3·0.015625 = 0.046875, then max(0.046875, 2·0.03125) = 0.0625, then 1
        assert!((c[0].p_holm - 0.046875).abs() < 1e-12 && (c[2].p_holm - 0.0625).abs() < 1e-12 && (c[1].p_holm - 1.0).abs() < 1e-12);
        assert!((c[0].difference - 0.7).abs() < 1e-12);
    }

    #[test]
    fn the_two_tenants_conflict_on_style() {
        let t = two_tenants(80, false);
        assert_eq!(t.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["alice", "bob"]);
        assert!(t[0].1.plain_sentences && !t[0].1.labeled_steps);
        assert!(t[1].1.labeled_steps && !t[1].1.plain_sentences && !t[1].1.correct_answer);
    }
}
