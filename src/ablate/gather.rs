//! Gathering an ablation's results: every finished arm's markers, checkpoint manifests and
//! evaluations read back into the rows of the results tables ([`super::results`]), and those tables
//! written as Parquet.

use std::path::Path;

use super::collect::CollectReport;
use super::config::{AblationConfig, ResolvedArm};
use super::eval::{sample_advantages, VersionEval};
use super::hints::{text_rows, HintCounts, HintSource, HintTextRow};
use super::mass::MassRow;
use super::layout::{read_marker, AgreementMarker, BaseEval, EvalMarker, Layout, ReplayMarker, StagesMarker, TrainMarker};
use super::plan::{data_pipelines, evaluated_versions, judge_groups, Replicates};
use super::results::*;
use crate::error::Result;
use crate::lake::Lake;
use crate::stages::train::query_samples;

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
        // only when every row has it (rows of a resumed older run do not)
        teacher_abs_gap: e.gaps.iter().map(|g| g.abs_gap).collect::<Option<Vec<f64>>>().and_then(|v| mean(v.into_iter())),
        student_logprob: mean(e.gaps.iter().map(|g| g.student_logprob)),
    }
}

/// Gathers every finished arm's files into results rows (used by the report).
pub(crate) struct Gathered {
    pub arms: Vec<ArmRow>,
    pub checkpoints: Vec<CheckpointRow>,
    pub preferences: Vec<PreferenceRow>,
    pub heldout: Vec<HeldoutRow>,
    pub gaps: Vec<GapRow>,
    /// Log-prob sums of the fixed token sets ([`super::mass`]).
    pub mass: Vec<MassRow>,
    pub steps: Vec<StepRow>,
    pub advantages: Vec<AdvantageRow>,
    pub responses: Vec<ResponseRow>,
    pub agreement: Vec<AgreementRow>,
    pub judge_sessions: Vec<JudgeSessionRow>,
    pub stage_counts: Vec<StageCountRow>,
    /// The accepted hint texts of every data pipeline that extracts hints.
    pub hints: Vec<HintSource>,
    pub timings: Vec<TimingRow>,
    pub missing: Vec<String>,
    pub collect: Option<CollectReport>,
    pub replayed: u64,
}

pub(crate) async fn gather(cfg: &AblationConfig, arms: &[ResolvedArm], replicates: &Replicates, lay: &Layout, problems: usize) -> Result<Gathered> {
    let state = lay.state();
    let lake = Lake::open(lay.lake())?;
    let mut g = Gathered {
        arms: vec![],
        checkpoints: vec![],
        preferences: vec![],
        heldout: vec![],
        gaps: vec![],
        mass: vec![],
        steps: vec![],
        advantages: vec![],
        responses: vec![],
        agreement: vec![],
        judge_sessions: vec![],
        stage_counts: vec![],
        hints: vec![],
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
    let hinting: Vec<&ResolvedArm> = data_pipelines(arms).into_iter().filter(|a| a.pipeline.method.uses_hints()).collect();
    if !hinting.is_empty() {
        let rows: Vec<crate::schema::HintRecord> = lake.read_table()?;
        for d in hinting {
            let users: Vec<&str> = arms.iter().filter(|a| a.data_pipeline == d.data_pipeline).map(|a| a.name.as_str()).collect();
            g.hints.push(HintSource { source: d.data_pipeline.clone(), arms: users.join(", "), counts: HintCounts::of(&rows, Some(&d.data_pipeline)) });
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
        let vs = evaluated_versions(cfg, lay, &arm.name, &replicates.of(arm.seed).rank)?;
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
        g.arms.push(ArmRow::of(arm, t.steps, t.train_sql.clone(), t.sample_ids.clone(), t.interaction_ids.clone(), t.sample_types.clone())?);
        // steps from the manifests
        for (_, m) in crate::trainer::scan(&lay.checkpoints(&arm.name).join(&arm.name))?.complete {
            for s in m.metrics {
                let means = s.advantage_parts.and_then(|p| p.means());
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
                    reward_part: means.map(|m| m.reward),
                    teacher_part: means.map(|m| m.teacher),
                    teacher_positive: means.map(|m| m.teacher_positive),
                    teacher_negative: means.map(|m| m.teacher_negative),
                });
            }
        }
        // advantages of the training samples, in training order; from the samples' rollout log-probs,
        // which are v0's at temperature 1 only: an arm trained at another temperature gets none here
        // (its steps' advantage metrics are in train_steps)
        let samples = if p.trainer.temperature == 1.0 { query_samples(&lake, &t.train_sql).await? } else { vec![] };
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
            g.mass.extend(e.mass);
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
    write_table(dir, "token_mass", &g.mass)?;
    write_table(dir, "steps", &g.steps)?;
    write_table(dir, "advantages", &g.advantages)?;
    write_table(dir, "responses", &g.responses)?;
    write_table(dir, "judge_agreement", &g.agreement)?;
    write_table(dir, "judge_sessions", &g.judge_sessions)?;
    write_table(dir, "stage_counts", &g.stage_counts)?;
    write_table(dir, "hint_texts", &g.hints.iter().flat_map(text_rows).collect::<Vec<HintTextRow>>())?;
    write_table(dir, "timings", &g.timings)?;
    Ok(())
}
