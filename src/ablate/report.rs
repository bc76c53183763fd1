//! The ablation report: `report.md` (a comparison table, a table per arm, the data and judge-agreement
//! tables, timings) and PNG plots drawn with [`crate::report::line_chart`] / [`crate::report::histogram`]:
//! `score_vs_interactions.png` (every arm on one chart), `teacher_gap.png`, `train_loss.png` and one
//! `advantages_<arm>.png` per arm (by sample type), and `score_by_arm.png` (each arm group's final score,
//! mean over seeds with its 95 % interval, and the per-seed scores). Plus the Parquet results
//! ([`super::results`]), including the across-seeds tables of [`super::compare`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::compare::{adjust_holm, ordering, summarize, versus_baselines, versus_initial, GroupRow, PairRow, ALPHA};
use super::layout::BaselineEval;
use super::teacher_eval::TeacherEval;
use super::results::ResponseRow;
use super::teacher_eval::HintStrategy;
use super::config::{config_diff, AblationConfig, EvalVersions, ResolvedArm};
use super::results::{write_table, CheckpointRow, TimingRow, TABLES};
use super::gather::{gather, write_results, Gathered};
use super::layout::Layout;
use super::plan::Replicates;
use crate::demo::Score;
use crate::report::{cell, interval_chart, line_chart, opt3, IntervalItem};
use crate::stats::p_text;
use crate::error::{Error, Result};

/// File-name-safe form of an arm name.
fn file_safe(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
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

/// Gathers the finished arms, writes `results/`, the plots and `report.md`.
///
/// # Errors
/// I/O, Parquet and plotting errors.
pub(crate) async fn write_all(
    cfg: &AblationConfig,
    arms: &[ResolvedArm],
    replicates: &Replicates,
    lay: &Layout,
    base: &Score,
    teachers: &[TeacherEval],
    baselines: &[BaselineEval],
    problems: usize,
) -> Result<AblationSummary> {
    let g = gather(cfg, arms, replicates, lay, problems).await?;
    write_results(&g, &lay.results())?;
    let (groups, mut pairs) = summarize(&g.arms, &g.checkpoints, &g.responses)?;
    let mut versus_v0 = versus_initial(&g.arms, &g.checkpoints, &g.responses)?;
    let baseline_rows: Vec<ResponseRow> = baselines.iter().flat_map(|b| b.responses.iter().cloned()).collect();
    let names: Vec<String> = baselines.iter().map(|b| b.name.clone()).collect();
    let mut versus_base = versus_baselines(&g.arms, &g.checkpoints, &g.responses, &baseline_rows, &names)?;
    adjust_holm(&mut [&mut pairs, &mut versus_v0, &mut versus_base]);
    write_table(&lay.results(), "arm_summary", &groups)?;
    write_table(&lay.results(), "arm_comparisons", &pairs)?;
    write_table(&lay.results(), "arm_vs_v0", &versus_v0)?;
    write_table(&lay.results(), "arm_vs_baselines", &versus_base)?;
    let mut plots = write_plots(&g, &lay.out)?;
    if !groups.is_empty() {
        let items: Vec<IntervalItem> = groups
            .iter()
            .map(|r| IntervalItem { label: r.group.clone(), estimate: r.mean, interval: r.low.zip(r.high), values: r.final_scores.clone() })
            .collect();
        interval_chart(lay.out.join("score_by_arm.png"), "Final personalization score per arm (mean over seeds, 95 % interval)", "responses meeting every preference (fraction)", &items, (0.0, 1.0))?;
        plots.files.insert(0, ("score_by_arm.png".into(), "final personalization score per arm: mean over seeds with its 95 % interval and each seed's score".into()));
    }
    let order = ordering(&g.arms, &pairs);
    let across = Across { groups: &groups, pairs: &pairs, versus_v0: &versus_v0, versus_baselines: &versus_base, baselines, ordering: order.as_deref(), replicate_differs: replicate_differs(replicates) };
    let md = render(cfg, arms, replicates, &g, base, teachers, &plots, &across, &lay.out);
    let report = lay.out.join("report.md");
    crate::lake::write_atomic(&report, md.as_bytes())?;
    Ok(AblationSummary {
        report,
        results: lay.results(),
        checkpoints: g.checkpoints.clone(),
        reported: g.arms.iter().map(|a| a.arm.clone()).collect(),
        missing: g.missing.clone(),
        groups,
        versus_v0,
        ordering: order,
        seconds: 0.0,
    })
}

/// The plots written (file name, alt text).
struct Plots {
    files: Vec<(String, String)>,
    advantages: BTreeMap<String, String>,
}

fn write_plots(g: &Gathered, dir: &Path) -> Result<Plots> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let mut files = vec![];
    let by_arm = |f: &dyn Fn(&CheckpointRow) -> Option<(f64, f64)>| -> Vec<(String, Vec<(f64, f64)>)> {
        g.arms
            .iter()
            .map(|a| (a.arm.clone(), g.checkpoints.iter().filter(|c| c.arm == a.arm).filter_map(f).collect::<Vec<_>>()))
            .filter(|(_, pts)| !pts.is_empty())
            .collect()
    };
    let score = by_arm(&|c| Some((c.interactions_seen as f64, c.score)));
    if !score.is_empty() {
        line_chart(
            dir.join("score_vs_interactions.png"),
            "Personalization score on held-out problems",
            "interactions of the stream trained on (count)",
            "responses meeting every preference (fraction)",
            &score,
        )?;
        files.push(("score_vs_interactions.png".into(), "personalization score against interactions, one line per arm".into()));
    }
    let gap = by_arm(&|c| c.teacher_gap.map(|v| (c.interactions_seen as f64, v)));
    if !gap.is_empty() {
        line_chart(
            dir.join("teacher_gap.png"),
            "Teacher − student log-prob gap on hinted held-out samples",
            "interactions of the stream trained on (count)",
            "mean teacher − student log-prob (nats per token)",
            &gap,
        )?;
        files.push(("teacher_gap.png".into(), "teacher minus student log-prob gap against interactions, one line per arm".into()));
    }
    let loss: Vec<(String, Vec<(f64, f64)>)> = g
        .arms
        .iter()
        .map(|a| (a.arm.clone(), g.steps.iter().filter(|s| s.arm == a.arm).map(|s| (s.step as f64, s.loss)).collect::<Vec<_>>()))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if !loss.is_empty() {
        line_chart(dir.join("train_loss.png"), "Training loss per optimizer step", "optimizer step", "loss (mean of sample means)", &loss)?;
        files.push(("train_loss.png".into(), "training loss per step, one line per arm".into()));
    }
    let heldout = by_arm(&|c| c.heldout_loss.map(|v| (c.interactions_seen as f64, v)));
    if !heldout.is_empty() {
        line_chart(
            dir.join("heldout_loss.png"),
            "Held-out loss (each arm's own loss on its held-out samples)",
            "interactions of the stream trained on (count)",
            "mean per-sample loss",
            &heldout,
        )?;
        files.push(("heldout_loss.png".into(), "held-out loss against interactions, one line per arm".into()));
    }
    let mut advantages = BTreeMap::new();
    for a in &g.arms {
        let mut by_type: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in g.advantages.iter().filter(|r| r.arm == a.arm) {
            by_type.entry(r.sample_type.clone()).or_default().push(r.advantage);
        }
        if by_type.is_empty() {
            continue;
        }
        let name = format!("advantages_{}.png", file_safe(&a.arm));
        let series: Vec<(String, Vec<f64>)> = by_type.into_iter().map(|(k, v)| (format!("{k} ({})", v.len()), v)).collect();
        crate::report::histogram(dir.join(&name), &format!("Per-sample mean advantage, arm {}", a.arm), "mean advantage over trained tokens", &series, 20)?;
        advantages.insert(a.arm.clone(), name);
    }
    Ok(Plots { files, advantages })
}

/// The across-seeds results ([`super::compare`]) the report renders.
struct Across<'a> {
    groups: &'a [GroupRow],
    pairs: &'a [PairRow],
    /// Each group against the initial weights ([`versus_initial`]).
    versus_v0: &'a [PairRow],
    /// Each group against each baseline without training ([`versus_baselines`]).
    versus_baselines: &'a [PairRow],
    /// The baselines without training.
    baselines: &'a [BaselineEval],
    /// [`ordering`]'s sentence.
    ordering: Option<&'a str>,
    /// What differs between an arm's replicates, one sentence.
    replicate_differs: &'static str,
}

/// The "Arms over seeds" section: per group, per pair, and the paper's ordering.
/// A table of paired comparisons; `b` heads the second arm's column.
fn pair_table(s: &mut String, pairs: &[PairRow], b: &str) {
    let _ = writeln!(s, "| A | {b} | seeds | problems | A − {b} | 95 % CI | p | Holm p | only A / only {b} met all |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---|---:|---:|---|");
    for p in pairs {
        let ci = match (p.low, p.high) {
            (Some(l), Some(h)) => format!("{l:+.3} – {h:+.3}"),
            _ => "–".into(),
        };
        let ph = if p.significant(ALPHA) { format!("**{}**", p_text(p.p_holm)) } else { p_text(p.p_holm) };
        let _ = writeln!(s, "| {} | {} | {} | {} | {:+.3} | {} | {} | {} | {} / {} |", cell(&p.a), cell(&p.b), p.seeds.len(), p.problems, p.mean_diff, ci, p_text(p.p_value), ph, p.a_only, p.b_only);
    }
    s.push('\n');
}

/// "The teacher, the bound": the hint-conditioned teacher's score per hint strategy beside v0, each
/// preference's rate, and per arm group how much of the teacher − v0 difference (instruction hints, the
/// rule backend's default) its final mean score transferred. Nothing when no teacher was evaluated.
pub(super) fn render_teacher(s: &mut String, base: &Score, teachers: &[TeacherEval], groups: &[GroupRow]) {
    if teachers.is_empty() {
        return;
    }
    let _ = writeln!(s, "## The teacher, the bound\n");
    let _ = writeln!(
        s,
        "OPD distils the **teacher** — the initial weights reading a hint appended to the student's message — into the student. Its own greedy answers to the held-out problems, scored like every version (hints from the student's reply to v0's answer on each problem; `oracle` names every preference; `src/ablate/teacher_eval.rs`):\n"
    );
    let prefs: Vec<&String> = base.per_preference_rate.keys().collect();
    let _ = writeln!(s, "| policy | hinted problems | score | {} |", prefs.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(" | "));
    let _ = writeln!(s, "|---|---:|---:|{}", "---:|".repeat(prefs.len()));
    let rates = |sc: &Score| prefs.iter().map(|p| format!("{:.3}", sc.per_preference_rate.get(*p).copied().unwrap_or(0.0))).collect::<Vec<_>>().join(" | ");
    let _ = writeln!(s, "| v0 (no hint) | – | {:.3} | {} |", base.fraction_all_satisfied, rates(base));
    for t in teachers {
        let _ = writeln!(s, "| teacher, {} hints | {} of {} | {:.3} | {} |", t.strategy.as_str(), t.hinted, t.score.n, t.score.fraction_all_satisfied, rates(&t.score));
    }
    s.push('\n');
    if let Some(t) = teachers.iter().find(|t| t.strategy == HintStrategy::Instruction) {
        let room = t.score.fraction_all_satisfied - base.fraction_all_satisfied;
        if room.abs() > 1e-9 && !groups.is_empty() {
            let parts: Vec<String> = groups.iter().map(|g| format!("{} {:+.0} %", g.group, 100.0 * (g.mean - base.fraction_all_satisfied) / room)).collect();
            let _ = writeln!(s, "Share of the teacher − v0 difference ({:+.3}, instruction hints) each arm's final mean score transferred (100 % = the student scores as the teacher does; negative = it moved away): {}.\n", room, parts.join(", "));
        }
    }
    if let Some((h, a)) = teachers.iter().find(|t| t.strategy == HintStrategy::Instruction).and_then(|t| t.examples.first()) {
        let _ = writeln!(s, "An instruction hint and the teacher's answer with it: hint \"{}\" → \"{}\"\n", cell(h), cell(&a.chars().take(300).collect::<String>()));
    }
}

/// "Against the baselines without training": each baseline's score and system prompt, the paired tests of
/// every arm group against it, and whether any arm beats it (Holm-adjusted).
fn render_baselines(s: &mut String, a: &Across<'_>) {
    if a.baselines.is_empty() {
        return;
    }
    let _ = writeln!(s, "### Against the baselines without training
");
    let _ = writeln!(s, "The initial weights with a system prompt and no weight update (`src/ablate/baselines.rs`): training is worth running only where it beats these.
");
    for b in a.baselines {
        let beats: Vec<&str> = a.versus_baselines.iter().filter(|p| p.b == b.name && p.mean_diff > 0.0 && p.significant(ALPHA)).map(|p| p.a.as_str()).collect();
        let verdict = if beats.is_empty() { "no arm beats it significantly".to_string() } else { format!("beaten significantly by {}", beats.join(", ")) };
        let _ = writeln!(s, "- `{}`: personalization score **{:.3}**; {verdict}. System prompt: \"{}\"", b.name, b.score.fraction_all_satisfied, cell(&b.system.replace('\n', " ")));
    }
    s.push('\n');
    if !a.versus_baselines.is_empty() {
        pair_table(s, a.versus_baselines, "baseline");
    }
}

/// One arm's teacher − student gap from `x` (v0) to `y` (last checkpoint), read as a distance: `|x| → |y|`,
/// and "overshoot" when the sign changed (the student passed the teacher), not "moved toward" it.
fn gap_change(arm: &str, x: f64, y: f64) -> String {
    let verdict = if x != 0.0 && y != 0.0 && x.signum() != y.signum() {
        "overshoot: the sign changed"
    } else if y.abs() < x.abs() {
        "closer"
    } else if y.abs() > x.abs() {
        "farther"
    } else {
        "unchanged"
    };
    format!("{arm} |{x:+.4}| → |{y:+.4}| ({verdict})")
}

/// What differs between the replicates of an arm ([`Replicates`]).
fn replicate_differs(r: &Replicates) -> &'static str {
    match (r.streams.len() > 1, r.own_data) {
        (false, _) => "One seed: one replicate.",
        (true, true) => "A replicate differs from its siblings in its data (its own collected sessions), its sample order (sessions shuffled by the seed) and its LoRA initialisation (and the control's signs); LoRA B starts at 0, so every replicate starts from the same v0.",
        (true, false) => "A replicate differs from its siblings in its sample order (sessions shuffled by the seed) and its LoRA initialisation (and the control's signs); the interactions are the same (read from a lake); LoRA B starts at 0, so every replicate starts from the same v0.",
    }
}

fn render_groups(s: &mut String, a: &Across<'_>) {
    let (groups, pairs) = (a.groups, a.pairs);
    let _ = writeln!(s, "## Arms over seeds\n");
    let _ = writeln!(
        s,
        "Each arm's final checkpoint, one replicate per seed. {} Mean over seeds with its 95 % Student-t interval (n = the seeds); the pooled Wilson interval counts all replicates' held-out responses together (problem noise only).\n",
        a.replicate_differs
    );
    let _ = writeln!(s, "| arm | method | seeds | final score per seed | mean | 95 % CI (seeds) | pooled 95 % CI (responses) | accuracy |");
    let _ = writeln!(s, "|---|---|---|---|---:|---|---|---:|");
    for r in groups {
        let ci = match (r.low, r.high) {
            (Some(l), Some(h)) => format!("{l:.3} – {h:.3}"),
            _ => "– (one seed)".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | **{:.3}** | {} | {:.3} – {:.3} ({}/{}) | {:.3} |",
            cell(&r.group),
            r.method,
            r.seeds.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "),
            r.final_scores.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", "),
            r.mean,
            ci,
            r.pooled_low,
            r.pooled_high,
            r.satisfied,
            r.responses,
            r.mean_accuracy
        );
    }
    s.push('\n');
    if !a.versus_v0.is_empty() {
        let _ = writeln!(
            s,
            "Each arm against the initial weights (v0), on the same held-out problems: per problem the arm's outcome averaged over seeds minus v0's, then a paired t-test over problems. Significant at {ALPHA} in bold.\n"
        );
        pair_table(s, a.versus_v0, "v0");
    }
    render_baselines(s, a);
    if !pairs.is_empty() {
        let _ = writeln!(
            s,
            "Pairwise, on the same held-out problems and the same seeds: per problem the difference of the two arms' outcomes averaged over seeds, then a paired t-test over problems (`src/ablate/compare.rs`). Significant at {ALPHA} in bold.\n"
        );
        pair_table(s, pairs, "B");
    }
    match a.ordering {
        Some(o) => {
            let _ = writeln!(s, "The paper's ordering: {o}\n");
        }
        None => {
            let _ = writeln!(s, "The paper's ordering (combined > OPD > binary) needs plain `binary`, `opd` and `combined` arms on shared seeds; this ablation lacks one.\n");
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn render(cfg: &AblationConfig, arms: &[ResolvedArm], replicates: &Replicates, g: &Gathered, base: &Score, teachers: &[TeacherEval], plots: &Plots, across: &Across<'_>, out: &Path) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Ablation `{}`\n", cfg.name);
    if !cfg.description.trim().is_empty() {
        let _ = writeln!(s, "{}\n", cfg.description.trim());
    }
    render_teacher(&mut s, base, teachers, across.groups);
    let first = arms.first().map(|a| &a.pipeline);
    let _ = writeln!(s, "## Setup\n");
    let phases: f64 = g.timings.iter().map(|t| t.seconds).sum();
    let _ = writeln!(
        s,
        "- **Command**: `nextstate ablate --config ablations/{}.toml --out {}` (re-running it resumes); its phases took {:.1} minutes in all (\"Timings\" below).",
        cfg.name,
        out.display(),
        phases / 60.0
    );
    if let Some(c) = &g.collect {
        let _ = writeln!(
            s,
            "- **Data**: {} interactions in {} homework sessions, collected by the simulated student (`src/demo/student.rs`) with the frozen initial policy ({} of them met every preference; {} response tokens), then replayed into the ablation lake ({} rows). {}",
            c.interactions,
            c.sessions,
            c.satisfied,
            c.tokens,
            g.replayed,
            if replicates.own_data {
                "Each replicate collected its own sessions (its own draw of training problems, sampling and student seeds; the same held-out problems); every arm of a replicate replays that replicate's interactions."
            } else {
                "Every arm replays these same interactions."
            }
        );
    } else {
        let _ = writeln!(s, "- **Data**: {} interactions replayed from `{}` with `{}`. Every arm replays these same interactions.", g.replayed, cfg.data.lake.as_ref().map(|p| p.display().to_string()).unwrap_or_default(), cell(&cfg.data.sql));
    }
    for (seed, stream) in &replicates.streams {
        let whose = if replicates.streams.len() > 1 { format!("replicate {seed}: ") } else { String::new() };
        let order = if replicates.streams.len() > 1 { "its sessions in an order shuffled by the seed (each session's turns in order)" } else { "ordered by event time" };
        let _ = writeln!(
            s,
            "- **Split** ({whose}{} sessions, {} main turns): the last {} sessions ({}) are held out of training: their samples measure the held-out loss and the teacher/student gap. The training stream has {} interactions, {order}.",
            stream.sessions,
            stream.main_turns,
            stream.heldout.len(),
            stream.heldout.join(", "),
            stream.order.len()
        );
    }
    if let Some(p) = first {
        let _ = writeln!(
            s,
            "- **Shared**: initial weights `{}`; trainer seed(s) {}; batch {} samples; at most {} steps (the first {} samples of each arm's ordered sample stream); lr {}; LoRA {}; a checkpoint every {} step(s). Judge `{}` (m = {}), hint extractor `{}` (m = {}) unless an arm says otherwise.",
            p.policy.model.display(),
            cfg.shared.replicate_seeds().iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "),
            cfg.shared.batch_size,
            cfg.shared.steps,
            cfg.shared.steps * cfg.shared.batch_size,
            p.trainer.lr,
            if p.trainer.lora.enabled { format!("rank {} alpha {}", p.trainer.lora.rank, p.trainer.lora.alpha) } else { "off".into() },
            cfg.shared.checkpoint_every,
            p.judge.backend.as_str(),
            p.judge.m,
            p.hint.backend.as_str(),
            p.hint.m
        );
    }
    let _ = writeln!(
        s,
        "- **Evaluation** at {}: (a) personalization score = fraction of greedy answers (≤ {} tokens) to {} held-out GSM8K problems{} meeting every preference of the student (one problem = {:.3}); (b) held-out loss components (each arm's own method and settings on its held-out samples) and the mean teacher − student log-prob gap on the hinted held-out samples (nats/token; nearer 0 = the student agrees more with the hint-conditioned teacher); (c) judge vs outcome on labelled logs{}.",
        match cfg.eval.versions {
            EvalVersions::All => "every checkpoint",
            EvalVersions::Last => "the initial weights and each arm's last checkpoint (`[eval] versions = \"last\"`)",
        },
        cfg.eval.max_tokens,
        cfg.eval.problems,
        cfg.eval.split.report_note(),
        1.0 / cfg.eval.problems.max(1) as f64,
        if cfg.eval.judge_agreement.is_some() { "" } else { " (not configured)" }
    );
    let _ = writeln!(s, "- Initial weights: personalization score **{:.3}**, accuracy {:.3}.\n", base.fraction_all_satisfied, base.accuracy);
    if !g.missing.is_empty() {
        let _ = writeln!(s, "**Not finished yet** (not in the tables): {}.\n", g.missing.join(", "));
    }

    render_groups(&mut s, across);

    // Comparison
    let _ = writeln!(s, "## Comparison\n");
    let _ = writeln!(s, "| arm | differs from the first arm by | samples trained (types) | steps | score v0 → last (best) | accuracy last | held-out loss v0 → last | t − s gap v0 → last (\\|t − s\\|) | judge agreement |");
    let _ = writeln!(s, "|---|---|---|---:|---|---:|---|---|---|");
    let first_arm = arms.first();
    for a in &g.arms {
        let Some(ra) = arms.iter().find(|r| r.name == a.arm) else { continue };
        let diff = match first_arm {
            Some(f) if f.name != ra.name => {
                let d = config_diff(&f.pipeline, &ra.pipeline);
                if d.is_empty() {
                    "nothing".to_string()
                } else {
                    d.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
                }
            }
            _ => "(reference)".into(),
        };
        let rows: Vec<&CheckpointRow> = g.checkpoints.iter().filter(|c| c.arm == a.arm).collect();
        let (Some(v0), Some(last)) = (rows.first(), rows.last()) else { continue };
        let best = rows.iter().map(|c| c.score).fold(f64::NEG_INFINITY, f64::max);
        let mut types: BTreeMap<&str, usize> = BTreeMap::new();
        for t in &a.sample_types {
            *types.entry(t.as_str()).or_default() += 1;
        }
        let types = types.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ");
        let agree = g
            .agreement
            .iter()
            .find(|r| r.arms.split(',').any(|x| x == a.arm))
            .map(|r| format!("{}/{} ({})", r.agree, r.sessions_judged, opt3(r.accuracy)))
            .unwrap_or_else(|| "– (no judge)".into());
        let _ = writeln!(
            s,
            "| {} | {} | {} ({}) | {} | {:.3} → **{:.3}** ({:.3}) | {:.3} | {} → {} | {} → {} ({} → {}) | {} |",
            cell(&a.arm),
            diff,
            a.sample_ids.len(),
            types,
            a.steps,
            v0.score,
            last.score,
            best,
            last.accuracy,
            opt3(v0.heldout_loss),
            opt3(last.heldout_loss),
            opt3(v0.teacher_gap),
            opt3(last.teacher_gap),
            opt3(v0.teacher_abs_gap),
            opt3(last.teacher_abs_gap),
            agree
        );
    }
    s.push('\n');
    for (file, alt) in &plots.files {
        let _ = writeln!(s, "![{alt}]({file})\n");
    }
    let _ = writeln!(s, "## Reading the numbers\n");
    let mut finals: Vec<(&str, f64)> = g.arms.iter().filter_map(|a| g.checkpoints.iter().rfind(|c| c.arm == a.arm).map(|c| (a.arm.as_str(), c.score))).collect();
    finals.sort_by(|x, y| y.1.total_cmp(&x.1));
    if !finals.is_empty() {
        let _ = writeln!(
            s,
            "- Final personalization scores, best first: {}. The score moves in steps of {:.3} (one of {} problems); differences of one or two problems are within noise for a single seed.",
            finals.iter().map(|(a, v)| format!("{a} {v:.3}")).collect::<Vec<_>>().join(", "),
            1.0 / cfg.eval.problems.max(1) as f64,
            cfg.eval.problems
        );
    }
    let gaps: Vec<String> = g
        .arms
        .iter()
        .filter_map(|a| {
            let rows: Vec<&CheckpointRow> = g.checkpoints.iter().filter(|c| c.arm == a.arm).collect();
            match (rows.first().and_then(|c| c.teacher_gap), rows.last().and_then(|c| c.teacher_gap)) {
                (Some(x), Some(y)) => Some(gap_change(&a.arm, x, y)),
                _ => None,
            }
        })
        .collect();
    if !gaps.is_empty() {
        let _ = writeln!(s, "- The teacher − student gap (mean over the held-out samples' tokens of the hint-conditioned teacher's log-prob minus the student's) from v0 to the last checkpoint, as |gap|: smaller = closer to the teacher; a gap that changed sign went past the teacher (overshoot): {}.", gaps.join(", "));
    }
    let _ = writeln!(
        s,
        "- The paper's claim is combined > OPD > binary; \"Arms over seeds\" above says whether it holds in this run, with this model, data size and budget.\n"
    );

    let pairs: Vec<(&str, &str)> = g.arms.iter().map(|a| (a.arm.as_str(), a.group.as_str())).collect();
    super::mass::render(&mut s, &pairs, &g.mass, &|arm| g.checkpoints.iter().filter(|c| c.arm == arm).map(|c| c.version).max());

    // Per arm
    let _ = writeln!(s, "## Per arm\n");
    let prefs: Vec<String> = cfg.student.preferences().enabled().iter().map(|p| p.name().to_string()).collect();
    for a in &g.arms {
        let _ = writeln!(s, "### {}\n", a.arm);
        let over: BTreeMap<String, String> = serde_json::from_str(&a.overrides).unwrap_or_default();
        let _ = writeln!(
            s,
            "Method `{}`; sets {}; data pipeline `{}` (data hash `{}`); config hash `{}`; trainer hash `{}`; seed {}; {} samples in training order (ids in `results/arms`).\n",
            a.method,
            if over.is_empty() { "nothing".to_string() } else { over.iter().map(|(k, v)| format!("`{k} = {}`", cell(v))).collect::<Vec<_>>().join(", ") },
            a.data_pipeline,
            &a.data_hash[..a.data_hash.len().min(12)],
            &a.config_hash[..a.config_hash.len().min(12)],
            &a.trainer_hash[..a.trainer_hash.len().min(12)],
            a.seed,
            a.sample_ids.len()
        );
        let _ = write!(s, "| version | step | interactions seen | samples seen | score | accuracy |");
        for p in &prefs {
            let _ = write!(s, " {p} |");
        }
        let _ = writeln!(s, " held-out loss | held-out pg loss | held-out old − new | t − s gap | \\|t − s\\| | gap samples |");
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|{}---:|---:|---:|---:|---:|---:|", "---:|".repeat(prefs.len()));
        for c in g.checkpoints.iter().filter(|c| c.arm == a.arm) {
            let _ = write!(s, "| {} | {} | {} | {} | {:.3} | {:.3} |", c.version, c.step, c.interactions_seen, c.samples_seen, c.score, c.accuracy);
            for p in &prefs {
                let r = g.preferences.iter().find(|r| r.arm == a.arm && r.version == c.version && &r.preference == p).map(|r| r.rate);
                let _ = write!(s, " {} |", opt3(r));
            }
            let _ = writeln!(
                s,
                " {} | {} | {} | {} | {} | {} |",
                opt3(c.heldout_loss),
                opt3(c.heldout_pg_loss),
                c.heldout_ppo_kl.map(|v| format!("{v:.2e}")).unwrap_or_else(|| "–".into()),
                opt3(c.teacher_gap),
                opt3(c.teacher_abs_gap),
                c.gap_samples
            );
        }
        s.push('\n');
        let steps: Vec<_> = g.steps.iter().filter(|x| x.arm == a.arm).collect();
        if !steps.is_empty() {
            let _ = writeln!(s, "| step | loss | pg loss | clip fraction | old − new | top-K KL | grad norm | samples | tokens | reward part | teacher part | teacher + / − tokens | mean advantage by type |");
            let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|");
            for x in &steps {
                let signs = match (x.teacher_positive, x.teacher_negative) {
                    (Some(p), Some(n)) => format!("{:.0} % / {:.0} %", 100.0 * p, 100.0 * n),
                    _ => "–".into(),
                };
                let _ = writeln!(
                    s,
                    "| {} | {:.4} | {:.4} | {:.3} | {:.2e} | {:.4} | {:.3} | {} | {} | {} | {} | {} | {} |",
                    x.step,
                    x.loss,
                    x.pg_loss,
                    x.clip_fraction,
                    x.ppo_kl,
                    x.topk_kl,
                    x.grad_norm,
                    x.samples,
                    x.tokens,
                    opt3(x.reward_part),
                    opt3(x.teacher_part),
                    signs,
                    cell(&x.advantage_by_type)
                );
            }
            let _ = writeln!(
                s,
                "\nReward part and teacher part: the mean over the step's trained tokens of the advantage's two parts, |r| (binary) or |w_rl·r| (combined) and |teacher − student| (OPD) or |w_opd·(teacher − student)| (combined), measured with the current policy (a top-K or overlap loss carries the teacher outside the advantage: its part here is 0); teacher + / −: the tokens the teacher part raises / lowers."
            );
            s.push('\n');
        }
        if let Some(f) = plots.advantages.get(&a.arm) {
            let _ = writeln!(s, "![advantage histogram of arm {} by sample type]({f})\n", a.arm);
        }
    }

    // Data
    let _ = writeln!(s, "## Data pipelines\n");
    let _ = writeln!(s, "Each distinct stage configuration ran once over the replayed interactions (arms that differ only in the trainer share one). Judge and hint votes and teacher rows whose key matched came from the caches (`votes_cached`, `teacher_cache_hit`).\n");
    let _ = writeln!(s, "| data pipeline | stage | outcome | count |\n|---|---|---|---:|");
    for r in &g.stage_counts {
        let _ = writeln!(s, "| {} | {} | {} | {} |", cell(&r.data_pipeline), cell(&r.stage), cell(&r.outcome), r.count);
    }
    s.push('\n');
    super::hints::render(&mut s, &g.hints, super::hints::TOP_TEXTS);
    if let Some(ag) = &cfg.eval.judge_agreement {
        let _ = writeln!(s, "## Judge vs outcome\n");
        let _ = writeln!(
            s,
            "Logs: {}. Per labelled session, the mean PRM score of its judged turns; predicted success = mean > 0, success = outcome reward ≥ {}.\n",
            ag.files.iter().map(|f| format!("`{}`", f.display())).collect::<Vec<_>>().join(", "),
            ag.success_threshold
        );
        let _ = writeln!(s, "| judge pipeline | arms | sessions | judged | agree | accuracy | TP | FP | TN | FN | mean score (success) | mean score (failure) | turns +1 / 0 / −1 |");
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
        for r in &g.agreement {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |",
                cell(&r.judge_pipeline),
                cell(&r.arms),
                r.sessions,
                r.sessions_judged,
                r.agree,
                opt3(r.accuracy),
                r.true_pos,
                r.false_pos,
                r.true_neg,
                r.false_neg,
                opt3(r.mean_score_success),
                opt3(r.mean_score_failure),
                r.turns_pos,
                r.turns_zero,
                r.turns_neg
            );
        }
        s.push('\n');
    }
    let _ = writeln!(s, "## Results as tables\n");
    let _ = writeln!(
        s,
        "Every number above is in `results/<table>/part-0.parquet` ({}). For example:\n\n```\nnextstate sql --lake results \"SELECT arm, version, interactions_seen, score, teacher_gap FROM checkpoint_metrics ORDER BY arm, version\"\n```\n",
        TABLES.iter().map(|t| format!("`{t}`")).collect::<Vec<_>>().join(", ")
    );
    s.push_str(&timings_table(&g.timings));
    s
}

/// The report's `## Timings`: each phase's wall seconds and share of their sum (the phases of an
/// offline ablation run one after another).
fn timings_table(timings: &[TimingRow]) -> String {
    let total: f64 = timings.iter().map(|t| t.seconds).sum();
    let mut s = String::from("## Timings\n\n| phase | name | seconds | share of the sum |\n|---|---|---:|---:|\n");
    for t in timings {
        let share = if total > 0.0 { format!("{:.1} %", 100.0 * t.seconds / total) } else { "–".into() };
        let _ = writeln!(s, "| {} | {} | {:.0} | {share} |", t.phase, cell(&t.name), t.seconds);
    }
    let _ = writeln!(s, "| **sum of phases** | | **{total:.0}** | 100 % |\n");
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn timings_have_their_share_of_the_sum() {
        use super::TimingRow;
        let rows = [("collect", "", 30.0), ("train", "opd", 90.0), ("eval", "opd v4", 80.0)]
            .map(|(phase, name, seconds)| TimingRow { phase: phase.into(), name: name.into(), seconds });
        assert_eq!(
            super::timings_table(&rows),
            "## Timings\n\n| phase | name | seconds | share of the sum |\n|---|---|---:|---:|\n| collect |  | 30 | 15.0 % |\n| train | opd | 90 | 45.0 % |\n\
             | eval | opd v4 | 80 | 40.0 % |\n| **sum of phases** | | **200** | 100 % |\n\n"
        );
    }

    #[test]
    fn a_gap_that_crosses_zero_is_an_overshoot() {
        assert_eq!(super::gap_change("opd", -0.129, 0.132), "opd |-0.1290| → |+0.1320| (overshoot: the sign changed)");
        assert_eq!(super::gap_change("opd", -0.129, -0.025), "opd |-0.1290| → |-0.0250| (closer)");
        assert_eq!(super::gap_change("b", -0.1, -0.2), "b |-0.1000| → |-0.2000| (farther)");
    }

    #[test]
    fn the_teacher_section_states_scores_rates_and_the_share_transferred() {
        use super::{GroupRow, HintStrategy, Score, TeacherEval};
        let score = |all: f64, concise: f64| Score { n: 48, fraction_all_satisfied: all, per_preference_rate: [("concise".to_string(), concise)].into_iter().collect(), accuracy: 0.0 };
        let base = score(0.25, 0.5);
        let t = |strategy, all, concise, hinted| TeacherEval { strategy, score: score(all, concise), hinted, examples: vec![("Keep it short.".into(), "It is 36.".into())], seconds: 1.0, answers: vec![], answers_kept: false, v0_logprobs: vec![] };
        let teachers = vec![t(HintStrategy::Verbatim, 0.5, 0.75, 36), t(HintStrategy::Instruction, 0.75, 1.0, 36), t(HintStrategy::Oracle, 1.0, 1.0, 48)];
        let group = |name: &str, mean: f64| GroupRow {
            group: name.into(),
            method: "opd".into(),
            seeds: vec![1],
            arms: vec![name.into()],
            final_versions: vec![4],
            final_scores: vec![mean],
            mean,
            sd: 0.0,
            low: None,
            high: None,
            responses: 48,
            satisfied: 0,
            pooled_low: 0.0,
            pooled_high: 1.0,
            mean_accuracy: 0.0,
        };
        let mut s = String::new();
        super::render_teacher(&mut s, &base, &teachers, &[group("opd", 0.5), group("binary", 0.125)]);
        assert!(s.contains("| policy | hinted problems | score | concise |"), "{s}");
        assert!(s.contains("| v0 (no hint) | – | 0.250 | 0.500 |"), "{s}");
        assert!(s.contains("| teacher, instruction hints | 36 of 48 | 0.750 | 1.000 |"), "{s}");
        assert!(s.contains("| teacher, oracle hints | 48 of 48 | 1.000 | 1.000 |"), "{s}");
        // (0.5 − 0.25)/(0.75 − 0.25) = 50 %; (0.125 − 0.25)/0.5 = −25 %.
        assert!(s.contains("(+0.500, instruction hints)") && s.contains("opd +50 %, binary -25 %"), "{s}");
        assert!(s.contains("hint \"Keep it short.\" → \"It is 36.\""), "{s}");
        let mut none = String::new();
        super::render_teacher(&mut none, &base, &[], &[]);
        assert!(none.is_empty());
    }
}
