//! `nextstate demo`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;

use super::common::{DataArgs, load_pipeline, outln};

/// `nextstate demo`'s arguments.
#[derive(Args)]
pub struct DemoArgs {
    /// Pipeline file (default: pipelines/demo.toml when present, else built-in defaults).
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Output folder (lake, checkpoints, report.md, personalization.png); its lake and checkpoints
    /// are replaced.
    #[arg(long, default_value = "demo-out")]
    out: PathBuf,
    /// GSM8K problems.
    #[arg(long, default_value = "data/gsm8k_test.json")]
    gsm8k: PathBuf,
    /// Student turns answered by the agent before the students stop.
    #[arg(long, default_value_t = 88)]
    interactions: usize,
    /// The students keep working past --interactions until this many policy versions answered them
    /// (2: at least one trained checkpoint reached live traffic); 1 stops at --interactions.
    #[arg(long, default_value_t = 2)]
    min_versions_served: usize,
    /// Hard limit on student turns (default: 3 × --interactions).
    #[arg(long)]
    max_interactions: Option<usize>,
    /// Students working at once.
    #[arg(long, default_value_t = 8)]
    students: usize,
    /// Most agent turns per homework session (1: every trained prompt is a first request, like the
    /// held-out evaluation's; the student's reply is the next state).
    #[arg(long, default_value_t = 1)]
    max_turns: u32,
    /// Held-out problems the personalization score is measured on.
    #[arg(long, default_value_t = 48)]
    eval_problems: usize,
    /// Which problems are evaluated: `test` (the held-out problems, the reported result) or
    /// `validation` (as many training problems set aside, for choosing a recipe without looking at the
    /// test problems; training then starts after them).
    #[arg(long, value_enum, default_value_t = nextstate::demo::EvalSplit::Test)]
    eval_split: nextstate::demo::EvalSplit,
    /// Response length limit, tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature of the students' sessions (evaluation is greedy).
    #[arg(long, default_value_t = 0.6)]
    temperature: f32,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The student's word limit.
    #[arg(long, default_value_t = 80)]
    max_words: usize,
    /// The student also requires the right answer (SmolLM2-135M almost never has it).
    #[arg(long)]
    require_correct: bool,
    /// 2: the fleet demo — two students with conflicting preferences (alice: short plain sentences;
    /// bob: `Step 1:` lines), each its own tenant, run once with a shared policy and once with
    /// per-tenant adapters; each tenant scored by its own checker (docs/tenants.md). 1: one student.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    tenants: u8,
    #[command(flatten)]
    data: DataArgs,
}

pub async fn run(args: DemoArgs) -> Result<()> {
    let DemoArgs { pipeline, out, gsm8k, interactions, min_versions_served, max_interactions, students, max_turns, eval_problems, eval_split, max_tokens, temperature, seed, max_words, require_correct, tenants, data } = args;
    let pipeline = pipeline.or_else(|| Some(PathBuf::from("pipelines/demo.toml")).filter(|p| p.exists()));
    let cfg = load_pipeline(&pipeline, &data)?;
    let prefs = nextstate::demo::Preferences { max_words, correct_answer: require_correct, ..Default::default() };
    let opts = nextstate::demo::run::DemoOptions {
        pipeline: cfg,
        out: out.clone(),
        gsm8k,
        interactions,
        min_versions_served,
        max_interactions: max_interactions.unwrap_or(interactions.saturating_mul(3)),
        students,
        max_turns,
        eval_problems,
        eval_split,
        max_tokens,
        temperature,
        seed,
        split_seed: None,
        preferences: prefs,
        eval_last_only: false,
        context: nextstate::demo::run::AgentContext::None,
        train: true,
        fleet: if tenants == 2 { nextstate::demo::fleet::two_tenants(max_words, require_correct) } else { vec![] },
        v0_kept: None,
    };
    let stop = Stop::default();
    stop.on_signals();
    if !opts.fleet.is_empty() {
        let s = nextstate::demo::fleet::run_fleet_demo(opts, stop).await.context("fleet demo failed")?;
        outln!("\nnextstate demo --tenants 2 — {:.0} s ({} held-out problems per tenant)", s.seconds, s.problems);
        for t in &s.tenants {
            let cells: Vec<String> = t.policies.iter().map(|p| format!("{} v{} {:.3} [{:.3}, {:.3}]", p.policy, p.version, p.score.fraction_all_satisfied, p.interval.0, p.interval.1)).collect();
            outln!("  {}: {}", t.tenant, cells.join("   "));
        }
        for c in &s.comparisons {
            outln!("  {}: {} − {} = {:+.3} (p {:.4}, Holm {:.4})", c.tenant, c.a, c.b, c.difference, c.p, c.p_holm);
        }
        outln!("report: {}", s.report.display());
        return Ok(());
    }
    let s = nextstate::demo::run::run_demo(opts, stop).await.context("demo failed")?;
    outln!("\nnextstate demo — {} interactions in {} sessions, {:.0} s, {} failed requests", s.interactions, s.sessions, s.seconds, s.failed_requests);
    outln!("personalization score (held-out problems, all preferences met):");
    for e in &s.evaluations {
        outln!("  version {:>2} after {:>3} interactions: {:.3}   (accuracy {:.3})", e.version, e.interactions, e.score.fraction_all_satisfied, e.score.accuracy);
    }
    outln!("before {:.3} → after {:.3}", s.before.fraction_all_satisfied, s.after.fraction_all_satisfied);
    outln!("result: {}", s.result_line);
    let q: Vec<String> = s.sessions_summary.first_answer_rate_by_quarter.iter().map(|q| format!("{q:.2}")).collect();
    outln!("sessions: {}; first answers meeting every preference, per quarter: {}", s.sessions_summary.until_stable_text(), q.join(" → "));
    for (n, c) in &s.run.stages {
        outln!("stage {n}: {}", c.line());
    }
    if let Some(t) = &s.run.train {
        outln!("train: steps={} samples_trained={} checkpoints={} reloads by the server={:?}", t.steps, t.samples_trained, t.checkpoints.len(), s.run.reloads);
    }
    outln!("report: {}", s.report.display());
    Ok(())
}
