//! `nextstate ablate`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;

use super::common::outln;

/// `nextstate ablate`'s arguments.
#[derive(Args)]
pub struct AblateArgs {
    /// Ablation file (ablations/<name>.toml).
    #[arg(long)]
    config: PathBuf,
    /// Output folder (default: ablation-out/<name>); re-running resumes it.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Only these arms in this process (run others in parallel processes with the same --out); an
    /// arm's name selects all its replicate seeds.
    #[arg(long, value_delimiter = ',')]
    arms: Option<Vec<String>>,
    /// Append one JSON object per optimizer step of every arm trained here (the `train_steps` row
    /// plus `arm`, `group` and `seed`) to FILE, flushed per line.
    #[arg(long, value_name = "FILE")]
    metrics_jsonl: Option<PathBuf>,
}

pub async fn run(args: AblateArgs) -> Result<()> {
    let AblateArgs { config, out, arms, metrics_jsonl } = args;
    let config = nextstate::ablate::AblationConfig::load(&config)?;
    let out = out.unwrap_or_else(|| PathBuf::from("ablation-out").join(&config.name));
    let stop = Stop::default();
    stop.on_signals();
    let opts = nextstate::ablate::AblateOptions { config, out, arms, metrics_jsonl };
    let s = nextstate::ablate::run_ablation(&opts, stop).await.context("ablation failed")?;
    outln!("\nnextstate ablate — {:.0} s; personalization score per version (interactions trained on):", s.seconds);
    for arm in &s.reported {
        let line: Vec<String> = s.checkpoints.iter().filter(|c| &c.arm == arm).map(|c| format!("v{}@{}: {:.3}", c.version, c.interactions_seen, c.score)).collect();
        outln!("  {arm:<24} {}", line.join("  "));
    }
    if !s.missing.is_empty() {
        outln!("not finished: {}", s.missing.join(", "));
    }
    outln!("final score per arm (mean over seeds, 95% CI):");
    for g in &s.groups {
        let ci = g.low.zip(g.high).map(|(l, h)| format!("[{l:.3}-{h:.3}]")).unwrap_or_else(|| "(one seed)".into());
        let v0 = s.versus_v0.iter().find(|p| p.a == g.group).map(|p| format!("; vs v0 {:+.3}, p = {}", p.mean_diff, nextstate::stats::p_text(p.p_value))).unwrap_or_default();
        outln!("  {:<24} {:.3} {ci} over {} seed(s){v0}", g.group, g.mean, g.seeds.len());
    }
    if let Some(o) = &s.ordering {
        outln!("{}", o.replace("**", ""));
    }
    outln!("report: {}\nresults: {}", s.report.display(), s.results.display());
    Ok(())
}
