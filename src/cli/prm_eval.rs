//! `nextstate prm-eval`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::common::outln;

/// `nextstate prm-eval`'s arguments.
#[derive(Args)]
pub struct PrmEvalArgs {
    /// Demo lake to read turns from (repeat for more; `nextstate demo` or an online ablation arm).
    #[arg(long, required = true)]
    lake: Vec<PathBuf>,
    /// A judge: `rules` or a TOML file with a [judge] table (repeat; each judges the same turns).
    #[arg(long)]
    judge: Vec<String>,
    /// A hint extractor: `rules` or a TOML file with a [hint] table (repeat; each reads the same turns).
    #[arg(long)]
    hint: Vec<String>,
    /// Most turns.
    #[arg(long, default_value_t = 120)]
    limit: usize,
    /// GSM8K file the demo's problems came from (default: the shipped data/gsm8k_test.json).
    #[arg(long)]
    gsm8k: Option<PathBuf>,
    /// The student's word limit (as the demo's --max-words).
    #[arg(long, default_value_t = 80)]
    max_words: usize,
    /// The student also requires the right answer (as the demo's --require-correct).
    #[arg(long)]
    require_correct: bool,
    /// Output folder.
    #[arg(long, default_value = "prm-eval")]
    out: PathBuf,
}

pub async fn run(args: PrmEvalArgs) -> Result<()> {
    let PrmEvalArgs { lake, judge, hint, limit, gsm8k, max_words, require_correct, out } = args;
    let judges = judge.iter().map(|j| nextstate::demo::prm_eval::JudgeSpec::parse(j)).collect::<nextstate::Result<Vec<_>>>()?;
    let hints = hint.iter().map(|h| nextstate::demo::prm_eval::HintSpec::parse(h)).collect::<nextstate::Result<Vec<_>>>()?;
    let opts = nextstate::demo::prm_eval::PrmEvalOptions {
        lakes: lake,
        judges,
        hints,
        limit,
        gsm8k: gsm8k.unwrap_or_else(nextstate::demo::default_gsm8k_path),
        preferences: nextstate::demo::Preferences { max_words, correct_answer: require_correct, ..Default::default() },
        out: out.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    let r = nextstate::demo::prm_eval::prm_eval_command(&opts).await?;
    for f in &r.judges {
        outln!(
            "prm-eval {}: turns={} usable={:.3} agreement={:.3} [{:.3}-{:.3}] ties={:.3} minus_precision={:.3} minus_recall={:.3} s_per_vote={:.2}",
            f.name, f.turns, f.usable.estimate, f.agreement.estimate, f.agreement.low, f.agreement.high, f.ties.estimate, f.minus_precision.estimate, f.minus_recall.estimate, f.seconds_per_vote
        );
    }
    for f in &r.hints {
        outln!(
            "prm-eval hint {}: usable={:.3} chosen_when_due={:.3} chosen_when_not_due={:.3} distinct_candidates={:.2} words={:.1} s_per_vote={:.2}",
            f.name, f.usable.estimate, f.accepted_when_due.estimate, f.accepted_when_not_due.estimate, f.distinct_candidates_mean, f.hint_words_mean, f.seconds_per_vote
        );
    }
    outln!("report: {}", out.join("report.md").display());
    Ok(())
}
