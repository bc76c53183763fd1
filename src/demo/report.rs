//! The demo report: `report.md` (score per checkpoint, pipeline counts) and `personalization.png`
//! (personalization score and per-preference rates against the student interactions the pipeline had seen),
//! drawn with [`crate::report::draw_panels`]. Without the plot font the plot has no text and
//! [`write_report`] says so in the report.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::score::Score;
use super::student::Preferences;
use crate::report::{cell, check_finite, draw_panels, font_loaded, NamedSeries, Panel, FONT_PATHS};
use crate::{Error, Result};

/// The evaluation of one policy version on the held-out problems.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointEval {
    /// Policy version (0 = the initial weights).
    pub version: i64,
    /// Student interactions (agent turns) the pipeline had seen when this version was published.
    pub interactions: u64,
    /// The score on the held-out problems.
    pub score: Score,
    /// Per held-out problem, in evaluation order (the same problems in the same order for every
    /// version): whether the response met every preference. Empty when not recorded; then no paired
    /// test is made.
    #[serde(default)]
    pub satisfied: Vec<bool>,
    /// Mean word count of the held-out responses ([`super::student::count_words`], the `concise`
    /// preference's count); `None` when not recorded.
    #[serde(default)]
    pub mean_words: Option<f64>,
    /// Held-out drift from the initial weights, nats/token: the mean over every token of the initial
    /// policy's greedy held-out responses of `log π_0(y_t) − log π_v(y_t)` (a Monte Carlo estimate of
    /// KL(π_0 ‖ π_v) on those prompts; 0 for v0, larger = further moved). `None` when not measured.
    #[serde(default)]
    pub drift_nats_per_token: Option<f64>,
}

impl CheckpointEval {
    /// The personalization score as a proportion with its 95 % Wilson interval
    /// ([`crate::stats::wilson_95`]); successes are counted from [`CheckpointEval::satisfied`] when
    /// recorded, else recovered from the score's fraction and `n`.
    pub fn interval(&self) -> crate::stats::Proportion {
        let n = self.score.n as u64;
        let k = if self.satisfied.len() as u64 == n { self.satisfied.iter().filter(|s| **s).count() as u64 } else { (self.score.fraction_all_satisfied * n as f64).round() as u64 };
        crate::stats::wilson_95(k.min(n), n).unwrap_or(crate::stats::Proportion { successes: 0, n, estimate: 0.0, low: 0.0, high: 1.0 })
    }
}

pub use crate::stats::p_text;

impl DemoReport {
    /// The exact McNemar test of the first evaluated version against the last on the same held-out
    /// problems ([`crate::stats::mcnemar_exact`]); `None` with fewer than two versions or when either
    /// lacks per-problem outcomes or they differ in count.
    pub fn first_vs_last(&self) -> Option<crate::stats::McNemar> {
        let (a, b) = (self.checkpoints.first()?, self.checkpoints.last()?);
        if self.checkpoints.len() < 2 || a.satisfied.is_empty() || a.satisfied.len() != b.satisfied.len() {
            return None;
        }
        crate::stats::mcnemar_exact(&a.satisfied, &b.satisfied).ok()
    }

    /// One line: the score before and after with 95 % intervals, and the paired test (what `nextstate
    /// demo` prints at the end). Empty results give a line saying so.
    pub fn result_line(&self) -> String {
        let (Some(a), Some(b)) = (self.checkpoints.first(), self.checkpoints.last()) else {
            return "no evaluation results were recorded".into();
        };
        let (ia, ib) = (a.interval(), b.interval());
        let mut line = format!(
            "personalization score v{} {:.3} [95% CI {:.3}-{:.3}] -> v{} {:.3} [{:.3}-{:.3}] on {} held-out problems",
            a.version, ia.estimate, ia.low, ia.high, b.version, ib.estimate, ib.low, ib.high, b.score.n
        );
        match self.first_vs_last() {
            Some(m) => line.push_str(&format!(
                "; exact McNemar: {} gained, {} lost, p = {}: {}",
                m.gained,
                m.lost,
                p_text(m.p_value),
                if m.significant(0.05) { "significant at 0.05" } else { "not significant at 0.05" }
            )),
            None => line.push_str("; no paired test (one version, or per-problem outcomes not recorded)"),
        }
        line
    }
}

/// What the demo report shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DemoReport {
    /// Report title (first heading).
    pub title: String,
    /// Demo run id.
    pub run_id: String,
    /// Arm / method (`combined`, ...).
    pub arm: String,
    /// The student's hidden preferences.
    pub preferences: Preferences,
    /// One evaluation per policy version, in publication order.
    pub checkpoints: Vec<CheckpointEval>,
    /// Per pipeline stage, its counters (rows in/out, drops by reason, ...), as the orchestration passes them.
    pub pipeline_counts: BTreeMap<String, BTreeMap<String, u64>>,
    /// What the trainer was given (rewards and the two advantage terms); `None` when not measured.
    #[serde(default)]
    pub advantages: Option<AdvantageSummary>,
    /// Per optimizer step, where the advantage came from (the trainer's `train_steps` rows); empty
    /// when not measured.
    #[serde(default)]
    pub steps: Vec<StepAttribution>,
    /// The student's sessions during the run (the online metric); `None` when not recorded.
    #[serde(default)]
    pub sessions: Option<crate::demo::sessions::SessionsSummary>,
    /// Where the run's wall time went; `None` when not measured.
    #[serde(default)]
    pub time: Option<TimeTable>,
    /// Free-form lines added to the report's notes.
    pub notes: Vec<String>,
}

/// Where a run's wall time went: its phases and the busy time of the parts that run concurrently in the
/// pipeline phase (stages, policy server, trainer), each with its share of the whole wall time. Busy
/// times overlap one another (they run side by side on the machine's cores), so shares do not add up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimeTable {
    /// The run's wall time, start to report (seconds).
    pub wall_seconds: f64,
    /// One row per phase or part, in the order shown.
    pub rows: Vec<TimeRow>,
}

/// One row of a [`TimeTable`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimeRow {
    /// What the time was spent on (`pipeline phase`, `stage judge`, `training steps`, ...).
    pub part: String,
    /// Seconds (wall time of that part, summed over its occurrences).
    pub seconds: f64,
    /// How it was measured and how many occurrences (one line).
    pub detail: String,
}

impl TimeTable {
    /// The markdown section `## Where the time went` (empty for a table without rows).
    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        if self.rows.is_empty() {
            return String::new();
        }
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## Where the time went\n\nWall time {:.0} s. While the pipeline runs, the stages, the policy server and the trainer work side by \
             side, so their busy times overlap and the shares do not add up to 100 %.\n",
            self.wall_seconds
        );
        let _ = writeln!(s, "| part | seconds | share of the wall time | measured as |\n|---|---:|---:|---|");
        for r in &self.rows {
            let share = if self.wall_seconds > 0.0 { format!("{:.1} %", 100.0 * r.seconds / self.wall_seconds) } else { "–".into() };
            let _ = writeln!(s, "| {} | {:.1} | {share} | {} |", cell(&r.part), r.seconds, cell(&r.detail));
        }
        s.push('\n');
        s
    }
}

/// One optimizer step's advantage split into its reward and teacher parts, as the trainer measured it
/// with the current policy (`train_steps` columns of schema version 3; `trainer::AdvantageParts`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepAttribution {
    /// Step number (1-based).
    pub step: i64,
    /// Samples trained.
    pub samples: i64,
    /// Mean reward r of the step's samples.
    pub reward_mean: f64,
    /// Mean over masked tokens of the reward part: |w_rl·r| (combined), |r| (binary), 0 (OPD).
    pub reward_abs_mean: f64,
    /// Mean over masked tokens of the teacher part: |w_opd·(teacher_t − student_t)| (combined),
    /// |teacher_t − student_t| (OPD), 0 (binary) (nats).
    pub teacher_abs_mean: f64,
    /// Fractions of the masked tokens whose teacher part is > 0 / < 0.
    pub teacher_positive: f64,
    /// See `teacher_positive`.
    pub teacher_negative: f64,
}

impl StepAttribution {
    /// The attribution of each `train_steps` row that has the columns (schema version 3), by step.
    pub fn of(rows: &[crate::schema::TrainStep]) -> Vec<StepAttribution> {
        let mut out: Vec<StepAttribution> = rows
            .iter()
            .filter_map(|r| {
                Some(StepAttribution {
                    step: r.step,
                    samples: r.samples,
                    reward_mean: r.reward_mean.unwrap_or(0.0),
                    reward_abs_mean: r.advantage_reward_abs_mean?,
                    teacher_abs_mean: r.advantage_teacher_abs_mean?,
                    teacher_positive: r.teacher_term_positive_fraction?,
                    teacher_negative: r.teacher_term_negative_fraction?,
                })
            })
            .collect();
        out.sort_by_key(|s| s.step);
        out
    }

    /// The teacher part's share of the advantage's magnitude, `teacher / (reward + teacher)` (0 when
    /// both are 0).
    pub fn teacher_share(&self) -> f64 {
        let all = self.reward_abs_mean + self.teacher_abs_mean;
        if all > 0.0 {
            self.teacher_abs_mean / all
        } else {
            0.0
        }
    }
}

/// The trained samples' rewards and the size of the two terms of the combined advantage (docs/method.md §6:
/// `A_t = w_rl · r + w_opd · (teacher_t − student_t)`), over the tokens the loss trains (loss mask 1).
/// `student` here is the policy that sampled the response (its rollout log-probs): the trainer's target
/// uses the current policy at the step, which is that policy when the sample is trained without
/// staleness, so this is the advantage as the trainer first saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdvantageSummary {
    /// Samples.
    pub samples: usize,
    /// Samples with reward > 0 / < 0 (the rest have reward 0).
    pub positive: usize,
    /// See `positive`.
    pub negative: usize,
    /// Samples whose advantage has the teacher term: teacher log-probs of the response's length on a
    /// type other than `binary` and `combined-score-only` (an accepted hint).
    pub hinted: usize,
    /// Trained tokens over all samples / over the hinted samples.
    pub tokens: usize,
    /// See `tokens`.
    pub hinted_tokens: usize,
    /// The weights used (trainer config).
    pub w_rl: f64,
    /// See `w_rl`.
    pub w_opd: f64,
    /// Mean over all trained tokens of `|w_rl · r|` (the binary term, per token).
    pub mean_abs_rl: f64,
    /// Mean over the hinted samples' trained tokens of `|w_opd · (teacher_t − student_t)|`, and of the signed
    /// value (nats scaled by `w_opd`); 0 without hinted samples.
    pub mean_abs_opd: f64,
    /// See `mean_abs_opd`.
    pub mean_opd: f64,
}

impl AdvantageSummary {
    /// Computes the summary of `samples` with the trainer weights `w_rl` and `w_opd`. A sample whose
    /// teacher log-probs differ in length from its response, or whose type has no teacher term, is
    /// counted as not hinted.
    pub fn of(samples: &[crate::schema::Sample], w_rl: f64, w_opd: f64) -> AdvantageSummary {
        let mut a = AdvantageSummary { samples: samples.len(), positive: 0, negative: 0, hinted: 0, tokens: 0, hinted_tokens: 0, w_rl, w_opd, mean_abs_rl: 0.0, mean_abs_opd: 0.0, mean_opd: 0.0 };
        let (mut rl, mut opd_abs, mut opd) = (0.0, 0.0, 0.0);
        for s in samples {
            let r = f64::from(s.reward);
            a.positive += usize::from(r > 0.0);
            a.negative += usize::from(r < 0.0);
            let n = s.loss_mask.iter().filter(|m| **m != 0).count();
            a.tokens += n;
            rl += (w_rl * r).abs() * n as f64;
            // The teacher term applies to every type but binary and combined-score-only (docs/method.md §5–6).
            let teacher_term = !matches!(s.sample_type, crate::schema::SampleType::Binary | crate::schema::SampleType::CombinedScoreOnly);
            let Some(t) = s.teacher_logprobs.as_deref().filter(|t| teacher_term && t.len() == s.loss_mask.len() && t.len() == s.rollout_logprobs.len()) else { continue };
            a.hinted += 1;
            a.hinted_tokens += n;
            for ((t, o), m) in t.iter().zip(&s.rollout_logprobs).zip(&s.loss_mask) {
                if *m != 0 {
                    let d = w_opd * (f64::from(*t) - f64::from(*o));
                    opd += d;
                    opd_abs += d.abs();
                }
            }
        }
        let mean = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
        a.mean_abs_rl = mean(rl, a.tokens);
        a.mean_abs_opd = mean(opd_abs, a.hinted_tokens);
        a.mean_opd = mean(opd, a.hinted_tokens);
        a
    }
}

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    /// `report.md`.
    pub markdown: PathBuf,
    /// `personalization.png`.
    pub plot: PathBuf,
    /// Whether the plot has text (the font was found).
    pub plot_has_text: bool,
}

/// File name of the plot next to `report.md`.
pub const PLOT_FILE: &str = "personalization.png";

/// Column names of the per-preference rates: the enabled preferences in check order, then any other name
/// found in the scores.
fn preference_columns(r: &DemoReport) -> Vec<String> {
    let mut cols: Vec<String> = r.preferences.enabled().iter().map(|p| p.name().to_string()).collect();
    let extra: BTreeSet<&String> = r.checkpoints.iter().flat_map(|c| c.score.per_preference_rate.keys()).filter(|k| !cols.contains(k)).collect();
    cols.extend(extra.into_iter().cloned());
    cols
}

/// The series of the two panels: (score, per-preference rates and accuracy unless `correct_answer` is a
/// rate already), x = interactions seen.
fn plot_series(r: &DemoReport) -> (Vec<NamedSeries>, Vec<NamedSeries>) {
    let x = |c: &CheckpointEval| c.interactions as f64;
    let score = vec![(
        "all preferences met (personalization score)".to_string(),
        r.checkpoints.iter().map(|c| (x(c), c.score.fraction_all_satisfied)).collect(),
    )];
    let mut rates: Vec<NamedSeries> = preference_columns(r)
        .into_iter()
        .map(|name| {
            let pts = r.checkpoints.iter().filter_map(|c| c.score.per_preference_rate.get(&name).map(|v| (x(c), *v))).collect();
            (name, pts)
        })
        .collect();
    // With `correct_answer` among the rates, accuracy is the same line.
    if !rates.iter().any(|(name, _)| name == "correct_answer") {
        rates.push(("correct final number (accuracy)".to_string(), r.checkpoints.iter().map(|c| (x(c), c.score.accuracy)).collect()));
    }
    (score, rates)
}

/// `report.md`'s text. `plot_has_text` false adds a note that the plot has no text (font missing).
pub fn render_markdown(r: &DemoReport, plot_file: &str, plot_has_text: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# {}\n", r.title);
    let _ = writeln!(s, "Run `{}`, arm `{}`. A simulated student (`src/demo/student.rs`) does GSM8K homework with the agent and holds these hidden preferences:\n", r.run_id, r.arm);
    for line in r.preferences.describe() {
        let _ = writeln!(s, "- {line}");
    }
    let _ = writeln!(
        s,
        "\nThe **personalization score** is the fraction of responses to held-out problems that meet all of them \
         (docs/method.md §7); the per-preference columns are each preference's own rate, and accuracy is the fraction \
         whose last number is the correct answer. All values are fractions from 0 to 1.\n"
    );
    match (r.checkpoints.first(), r.checkpoints.last()) {
        (Some(a), Some(b)) if r.checkpoints.len() > 1 => {
            let _ = writeln!(
                s,
                "Personalization score: **{:.3} → {:.3}** (policy v{} → v{}, after {} student interactions; {} held-out responses per version).\n",
                a.score.fraction_all_satisfied, b.score.fraction_all_satisfied, a.version, b.version, b.interactions, b.score.n
            );
            let (ia, ib) = (a.interval(), b.interval());
            let _ = writeln!(s, "95 % Wilson intervals: v{} [{:.3}, {:.3}], v{} [{:.3}, {:.3}].", a.version, ia.low, ia.high, b.version, ib.low, ib.high);
            match r.first_vs_last() {
                Some(m) => {
                    let _ = writeln!(
                        s,
                        "Paired test on the same {} problems (exact McNemar, v{} vs v{}): {} problems gained, {} lost, two-sided p = {} — **{}**.\n",
                        m.n,
                        a.version,
                        b.version,
                        m.gained,
                        m.lost,
                        p_text(m.p_value),
                        if m.significant(0.05) { "significant at 0.05" } else { "not significant at 0.05" }
                    );
                }
                None => {
                    let _ = writeln!(s, "No paired test: per-problem outcomes were not recorded.\n");
                }
            }
        }
        (Some(a), _) => {
            let _ = writeln!(s, "Personalization score: **{:.3}** (policy v{}, {} held-out responses; one version only).\n", a.score.fraction_all_satisfied, a.version, a.score.n);
        }
        _ => {
            let _ = writeln!(s, "No evaluation results were recorded.\n");
        }
    }
    let _ = writeln!(s, "## Score per policy version\n");
    let cols = preference_columns(r);
    let _ = write!(s, "| policy version | interactions seen | held-out responses | personalization score | 95 % CI |");
    for c in &cols {
        let _ = write!(s, " {c} |");
    }
    let _ = writeln!(s, " accuracy | mean words | drift from v0 (nats/token) |");
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|{}---:|---:|---:|", "---:|".repeat(cols.len()));
    for c in &r.checkpoints {
        let ci = c.interval();
        let _ = write!(s, "| {} | {} | {} | {:.3} | {:.3}–{:.3} |", c.version, c.interactions, c.score.n, c.score.fraction_all_satisfied, ci.low, ci.high);
        for name in &cols {
            match c.score.per_preference_rate.get(name) {
                Some(v) => {
                    let _ = write!(s, " {v:.3} |");
                }
                None => s.push_str(" – |"),
            }
        }
        let opt = |v: Option<f64>, digits: usize| v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "–".into());
        let _ = writeln!(s, " {:.3} | {} | {} |", c.score.accuracy, opt(c.mean_words, 1), opt(c.drift_nats_per_token, 4));
    }
    let _ = writeln!(s, "\n![personalization score and per-preference rates against student interactions]({plot_file})\n");
    if !plot_has_text {
        let _ = writeln!(
            s,
            "Note: no plot font was found ({}; Debian package `fonts-dejavu-core`), so the plot has no title, tick \
             labels or legend. Left panel: personalization score; right panel: per-preference rates in the table's \
             column order (then accuracy when `correct_answer` is not among them); x = interactions seen, y = 0 to 1.\n",
            FONT_PATHS.join(", ")
        );
    }
    if let Some(a) = &r.advantages {
        let _ = writeln!(s, "## What the trainer was given\n");
        let _ = writeln!(
            s,
            "{} samples ({} trained tokens): reward +1 on {}, −1 on {}, 0 on {}; {} with an accepted hint ({} tokens). \
             Advantage per token (docs/method.md §6; `student` = the sampling policy's log-probs, the current policy's when the \
             sample was trained): mean |w_rl·r| = {:.3} (w_rl = {}); on the hinted \
             tokens mean |w_opd·(teacher − student)| = {:.3}, signed mean {:+.3} (w_opd = {}).\n",
            a.samples,
            a.tokens,
            a.positive,
            a.negative,
            a.samples - a.positive - a.negative,
            a.hinted,
            a.hinted_tokens,
            a.mean_abs_rl,
            a.w_rl,
            a.mean_abs_opd,
            a.mean_opd,
            a.w_opd
        );
    }
    if !r.steps.is_empty() {
        let _ = writeln!(s, "## Where the advantage came from, per step\n");
        let _ = writeln!(
            s,
            "Measured by the trainer with the current policy at each step (`train_steps`): the mean over the step's trained tokens of \
             the advantage's reward part (|w_rl·r| for combined, |r| for binary) and teacher part (|w_opd·(teacher − student)| for \
             combined, |teacher − student| for OPD), the teacher part's share of their sum, and the fractions of tokens the teacher \
             part raises (> 0) and lowers (< 0).\n"
        );
        let _ = writeln!(s, "| step | samples | mean r | reward part | teacher part | teacher share | teacher + / − tokens |");
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---|");
        for a in &r.steps {
            let _ = writeln!(
                s,
                "| {} | {} | {:+.2} | {:.3} | {:.3} | {:.0} % | {:.0} % / {:.0} % |",
                a.step,
                a.samples,
                a.reward_mean,
                a.reward_abs_mean,
                a.teacher_abs_mean,
                100.0 * a.teacher_share(),
                100.0 * a.teacher_positive,
                100.0 * a.teacher_negative
            );
        }
        let (rw, th): (f64, f64) = r.steps.iter().fold((0.0, 0.0), |acc, a| (acc.0 + a.reward_abs_mean, acc.1 + a.teacher_abs_mean));
        let share = if rw + th > 0.0 { th / (rw + th) } else { 0.0 };
        let _ = writeln!(s, "\nOver the {} steps (each weighted equally), the teacher part is {:.0} % of the advantage's magnitude, the reward part {:.0} %.\n", r.steps.len(), 100.0 * share, 100.0 * (1.0 - share));
    }
    if let Some(ss) = &r.sessions {
        let _ = writeln!(s, "## The student's sessions\n");
        let _ = writeln!(
            s,
            "A session meets the preferences when the agent's first answer in it meets every one (the student thanks it \
             without a correction); sessions in the order they ended (`src/demo/sessions.rs`). The paper's online metric \
             (v2 Table 3, lower is better): **{}**.\n",
            ss.until_stable_text()
        );
        let quarters: Vec<String> = ss.first_answer_rate_by_quarter.iter().map(|q| format!("{q:.2}")).collect();
        let _ = writeln!(s, "First answers that met every preference, per quarter of the sessions: {}; {:.2} answers per session.\n", quarters.join(" → "), ss.mean_turns);
    }
    let _ = writeln!(s, "## Pipeline counts\n");
    if r.pipeline_counts.is_empty() {
        let _ = writeln!(s, "No pipeline counts were recorded.\n");
    } else {
        let _ = writeln!(s, "| stage | counter | count |\n|---|---|---:|");
        for (stage, counts) in &r.pipeline_counts {
            for (k, v) in counts {
                let _ = writeln!(s, "| {} | {} | {v} |", cell(stage), cell(k));
            }
        }
        s.push('\n');
    }
    if let Some(t) = &r.time {
        s.push_str(&t.markdown());
    }
    if !r.notes.is_empty() {
        let _ = writeln!(s, "## Notes\n");
        for n in &r.notes {
            let _ = writeln!(s, "- {n}");
        }
        s.push('\n');
    }
    s
}

/// Writes `report.md` and [`PLOT_FILE`] into `dir` (created if missing). The plot has two panels against
/// the student interactions the pipeline had seen: the personalization score per policy version (line with
/// markers, each labelled `v<version>`), and each preference's rate (plus accuracy when `correct_answer` is
/// off).
///
/// # Errors
/// [`Error::Io`] when the folder or the markdown cannot be written; [`Error::InvalidInput`] when a rate
/// is not finite; [`Error::Internal`] when drawing the plot fails.
pub fn write_report(dir: impl AsRef<Path>, report: &DemoReport) -> Result<ReportFiles> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let plot = dir.join(PLOT_FILE);
    let text = font_loaded();
    let (score, rates) = plot_series(report);
    check_finite(&score)?;
    check_finite(&rates)?;
    let labels: Vec<String> = report.checkpoints.iter().map(|c| format!("v{}", c.version)).collect();
    let bars: Vec<(f64, f64)> = report.checkpoints.iter().map(|c| c.interval()).map(|i| (i.low, i.high)).collect();
    let x_label = "student interactions seen by the pipeline (count)";
    let panels = [
        Panel {
            title: "Personalization score by policy version (95 % CI)",
            x_label,
            y_label: "held-out responses meeting all preferences (fraction)",
            series: &score,
            y_range: Some((0.0, 1.05)),
            point_labels: Some(&labels),
            x_integer: true,
            error_bars: Some(&bars),
        },
        Panel {
            title: "Each preference's satisfaction rate",
            x_label,
            y_label: "held-out responses meeting it (fraction)",
            series: &rates,
            y_range: Some((0.0, 1.05)),
            point_labels: None,
            x_integer: true,
            error_bars: None,
        },
    ];
    draw_panels(&plot, (1600, 640), &panels, text)?;
    let markdown = dir.join("report.md");
    let md = render_markdown(report, PLOT_FILE, text);
    std::fs::write(&markdown, md).map_err(|e| Error::io("write", &markdown, e))?;
    Ok(ReportFiles { markdown, plot, plot_has_text: text })
}

#[cfg(test)]
mod tests;
