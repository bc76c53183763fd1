//! Every number an ablation measured, as Parquet tables under `<out>/results/<table>/part-0.parquet`
//! (one folder per table, so `nextstate sql --lake <out>/results "SELECT ..."` queries them with
//! DataFusion and the same comparison can be re-plotted with SQL). Row types below; schemas are traced
//! from the types by `serde_arrow` (`Option` columns are nullable, `Vec<String>` is `list<utf8>`).
//!
//! Every table except `timings` is a pure function of the configuration and the seeds: two runs of the
//! same ablation write identical values (the determinism test compares them).

use std::path::Path;

use arrow::datatypes::FieldRef;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_arrow::schema::{SchemaLike, TracingOptions};

use crate::error::{Error, Result};

/// Result table names, in report order.
pub const TABLES: &[&str] = &[
    "arms",
    "arm_summary",
    "arm_comparisons",
    "checkpoint_metrics",
    "preference_rates",
    "heldout_losses",
    "teacher_gaps",
    "token_mass",
    "steps",
    "advantages",
    "responses",
    "judge_agreement",
    "judge_sessions",
    "stage_counts",
    "hint_texts",
    "timings",
];

/// One arm: what it is and exactly what it trained on (`arms`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArmRow {
    /// Arm name (a replicate of a multi-seed run: `<group>.seed=<seed>`).
    pub arm: String,
    /// The arm as the ablation file names it; the replicates of one group differ only in `seed`.
    #[serde(default)]
    pub group: String,
    /// Method.
    pub method: String,
    /// The keys the arm sets itself (JSON object: dotted key → TOML value).
    pub overrides: String,
    /// Data pipeline whose samples it trains on.
    pub data_pipeline: String,
    /// Hash of the stage configuration that built those samples.
    pub data_hash: String,
    /// Hash of the arm's whole resolved configuration (and step count).
    pub config_hash: String,
    /// Trainer configuration hash (as in its checkpoint manifests).
    pub trainer_hash: String,
    /// Trainer seed.
    pub seed: i64,
    /// Initial weights (model folder).
    pub initial_weights: String,
    /// Samples per step.
    pub batch_size: i64,
    /// Learning rate.
    pub lr: f64,
    /// LoRA on.
    pub lora: bool,
    /// Combined-advantage weights.
    pub w_rl: f64,
    /// Combined-advantage weights.
    pub w_opd: f64,
    /// `ppo`, `topk` or `both`.
    pub opd_loss: String,
    /// Teacher top-K kept.
    pub top_k: i64,
    /// Hint selection strategy.
    pub hint_strategy: String,
    /// Judge votes per turn.
    pub judge_m: i64,
    /// Hint votes per turn.
    pub hint_m: i64,
    /// Optimizer steps taken.
    pub steps: i64,
    /// The query the trainer read its samples with.
    pub train_sql: String,
    /// Sample ids in training order.
    pub sample_ids: Vec<String>,
    /// Their interaction ids, same order.
    pub interaction_ids: Vec<String>,
    /// Their sample types, same order.
    pub sample_types: Vec<String>,
}

impl ArmRow {
    /// The row of `arm` (its resolved configuration) after `steps` optimizer steps on the samples
    /// `train_sql` read (`sample_ids`, `interaction_ids`, `sample_types` in training order; empty
    /// where not recorded, as in the online mode).
    ///
    /// # Errors
    /// JSON errors of the overrides (not expected).
    pub fn of(arm: &super::config::ResolvedArm, steps: i64, train_sql: String, sample_ids: Vec<String>, interaction_ids: Vec<String>, sample_types: Vec<String>) -> Result<ArmRow> {
        let p = &arm.pipeline;
        Ok(ArmRow {
            arm: arm.name.clone(),
            group: arm.group.clone(),
            method: p.method.as_str().into(),
            overrides: serde_json::to_string(&arm.overrides)?,
            data_pipeline: arm.data_pipeline.clone(),
            data_hash: arm.data_hash.clone(),
            config_hash: arm.config_hash.clone(),
            trainer_hash: arm.trainer_hash.clone(),
            seed: p.trainer.seed as i64,
            initial_weights: p.policy.model.display().to_string(),
            batch_size: p.trainer.batch_size as i64,
            lr: p.trainer.lr,
            lora: p.trainer.lora.enabled,
            w_rl: p.trainer.w_rl,
            w_opd: p.trainer.w_opd,
            opd_loss: p.trainer.opd_loss.as_str().into(),
            top_k: p.teacher.top_k as i64,
            hint_strategy: p.hint.strategy.as_str().into(),
            judge_m: i64::from(p.judge.m),
            hint_m: i64::from(p.hint.m),
            steps,
            train_sql,
            sample_ids,
            interaction_ids,
            sample_types,
        })
    }
}

/// One evaluated policy version of one arm (`checkpoint_metrics`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRow {
    /// Arm.
    pub arm: String,
    /// Policy version (0 = the shared initial weights).
    pub version: i64,
    /// Optimizer steps behind it.
    pub step: i64,
    /// Position in the ordered interaction stream of the last interaction trained on (0 for v0).
    pub interactions_seen: i64,
    /// Samples trained on.
    pub samples_seen: i64,
    /// Personalization score (fraction of held-out responses meeting every preference).
    pub score: f64,
    /// GSM8K accuracy of the same responses.
    pub accuracy: f64,
    /// Held-out responses scored.
    pub eval_problems: i64,
    /// Held-out samples of the arm's own data pipeline evaluated.
    pub heldout_samples: i64,
    /// Mean over those samples of the arm's loss (pg + weighted terms), nats-scale.
    pub heldout_loss: Option<f64>,
    /// Mean PPO loss.
    pub heldout_pg_loss: Option<f64>,
    /// Mean advantage.
    pub heldout_advantage: Option<f64>,
    /// Mean `old − new` log-prob (how far the policy moved from the rollout policy), nats.
    pub heldout_ppo_kl: Option<f64>,
    /// Mean entropy, nats.
    pub heldout_entropy: Option<f64>,
    /// Mean top-K reverse KL (0 without top-K data).
    pub heldout_topk_kl: Option<f64>,
    /// Hinted held-out samples the gap is measured on.
    pub gap_samples: i64,
    /// Mean over them of mean(teacher − student) response-token log-prob, nats.
    pub teacher_gap: Option<f64>,
    /// Mean over them of mean |teacher − student| response-token log-prob, nats ([`GapRow::abs_gap`]).
    #[serde(default)]
    pub teacher_abs_gap: Option<f64>,
    /// Mean student response-token log-prob on them, nats.
    pub student_logprob: Option<f64>,
}

impl CheckpointRow {
    /// A row with only the score columns filled (held-out loss, gap and log-prob columns `None`, their
    /// sample counts and `samples_seen` 0): an evaluation without held-out samples, as in the online mode.
    pub fn score_only(arm: &str, version: i64, step: i64, interactions_seen: i64, score: f64, accuracy: f64, eval_problems: i64) -> CheckpointRow {
        CheckpointRow {
            arm: arm.into(),
            version,
            step,
            interactions_seen,
            samples_seen: 0,
            score,
            accuracy,
            eval_problems,
            heldout_samples: 0,
            heldout_loss: None,
            heldout_pg_loss: None,
            heldout_advantage: None,
            heldout_ppo_kl: None,
            heldout_entropy: None,
            heldout_topk_kl: None,
            gap_samples: 0,
            teacher_gap: None,
            teacher_abs_gap: None,
            student_logprob: None,
        }
    }
}

/// A preference's satisfaction rate at one version (`preference_rates`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreferenceRow {
    /// Arm.
    pub arm: String,
    /// Version.
    pub version: i64,
    /// Preference name.
    pub preference: String,
    /// Fraction of held-out responses meeting it.
    pub rate: f64,
}

/// One held-out sample's loss terms at one version (`heldout_losses`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldoutRow {
    /// Arm.
    pub arm: String,
    /// Version.
    pub version: i64,
    /// Sample.
    pub sample_id: String,
    /// Sample type.
    pub sample_type: String,
    /// Trained tokens.
    pub tokens: i64,
    /// Reward.
    pub reward: f64,
    /// Mean advantage.
    pub advantage: f64,
    /// Mean PPO loss.
    pub pg_loss: f64,
    /// Clipped fraction.
    pub clip_fraction: f64,
    /// Mean old − new, nats.
    pub ppo_kl: f64,
    /// Mean entropy, nats.
    pub entropy: f64,
    /// Mean top-K reverse KL.
    pub topk_kl: f64,
    /// The sample's loss.
    pub loss: f64,
}

/// One hinted held-out sample's teacher/student gap at one version (`teacher_gaps`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GapRow {
    /// Arm.
    pub arm: String,
    /// Version.
    pub version: i64,
    /// Sample.
    pub sample_id: String,
    /// Response tokens.
    pub tokens: i64,
    /// Mean (teacher − student) log-prob over response tokens, nats.
    pub gap: f64,
    /// Mean |teacher − student| log-prob over response tokens, nats: 0 only where the student matches
    /// the teacher on every token, so a student that went past the teacher reads as far, not as close
    /// (None in results written before it existed).
    #[serde(default)]
    pub abs_gap: Option<f64>,
    /// Mean student log-prob, nats.
    pub student_logprob: f64,
}

/// One optimizer step of one arm, from its checkpoint manifests (`steps`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// Arm.
    pub arm: String,
    /// Step (1-based).
    pub step: i64,
    /// Loss.
    pub loss: f64,
    /// PPO loss.
    pub pg_loss: f64,
    /// Clipped fraction.
    pub clip_fraction: f64,
    /// Mean old − new.
    pub ppo_kl: f64,
    /// k3 KL.
    pub kl: f64,
    /// Entropy.
    pub entropy: f64,
    /// Top-K reverse KL.
    pub topk_kl: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean advantage by sample type (JSON object).
    pub advantage_by_type: String,
    /// Samples.
    pub samples: i64,
    /// Masked tokens.
    pub tokens: i64,
    /// Mean over the masked tokens of |the reward part of the advantage| (`trainer::AdvantageParts`;
    /// None in results written before it existed, and for checkpoints whose manifest lacks it).
    #[serde(default)]
    pub reward_part: Option<f64>,
    /// Mean over the masked tokens of |the teacher part of the advantage| (nats × w_opd).
    #[serde(default)]
    pub teacher_part: Option<f64>,
    /// Fraction of the masked tokens whose teacher part is > 0 (raised by the step).
    #[serde(default)]
    pub teacher_positive: Option<f64>,
    /// Fraction of the masked tokens whose teacher part is < 0 (lowered by the step).
    #[serde(default)]
    pub teacher_negative: Option<f64>,
}

/// One training sample's mean advantage as the arm's loss sees it (`advantages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdvantageRow {
    /// Arm.
    pub arm: String,
    /// Position in the arm's training order (0-based).
    pub position: i64,
    /// Sample.
    pub sample_id: String,
    /// Its interaction.
    pub interaction_id: String,
    /// Sample type.
    pub sample_type: String,
    /// Reward r.
    pub reward: f64,
    /// Mean advantage over the masked tokens (docs/method.md §6, with the rollout log-probs as old).
    pub advantage: f64,
    /// Masked tokens.
    pub tokens: i64,
}

/// One greedy evaluation answer (`responses`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseRow {
    /// Arm.
    pub arm: String,
    /// Version.
    pub version: i64,
    /// GSM8K problem index.
    pub problem_id: i64,
    /// Meets every preference.
    pub satisfied: bool,
    /// Correct final number.
    pub correct: bool,
    /// Violations (`<preference>: <evidence>`).
    pub violations: Vec<String>,
    /// The answer.
    pub response_text: String,
}

/// Agreement of one judge configuration's turn scores with session outcomes (`judge_agreement`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgreementRow {
    /// Judge (data) pipeline.
    pub judge_pipeline: String,
    /// Arms using it (comma-separated).
    pub arms: String,
    /// Sessions with an outcome label.
    pub sessions: i64,
    /// Of those, sessions with at least one judged turn.
    pub sessions_judged: i64,
    /// Judged sessions where (mean turn score > 0) equals (outcome ≥ threshold).
    pub agree: i64,
    /// Predicted success, outcome success.
    pub true_pos: i64,
    /// Predicted success, outcome failure.
    pub false_pos: i64,
    /// Predicted failure, outcome failure.
    pub true_neg: i64,
    /// Predicted failure, outcome success.
    pub false_neg: i64,
    /// agree / sessions_judged.
    pub accuracy: Option<f64>,
    /// Mean of session mean scores over successful sessions.
    pub mean_score_success: Option<f64>,
    /// Mean of session mean scores over failed sessions.
    pub mean_score_failure: Option<f64>,
    /// Judged turns.
    pub turns_judged: i64,
    /// Turns scored +1, 0, −1.
    pub turns_pos: i64,
    /// Turns scored 0.
    pub turns_zero: i64,
    /// Turns scored −1.
    pub turns_neg: i64,
}

/// One labelled session's judge summary (`judge_sessions`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgeSessionRow {
    /// Judge (data) pipeline.
    pub judge_pipeline: String,
    /// Session.
    pub session_id: String,
    /// Outcome label.
    pub outcome_reward: f64,
    /// Judged turns.
    pub turns_judged: i64,
    /// Mean turn score (null without judged turns).
    pub mean_score: Option<f64>,
}

/// One stage counter of one data pipeline's run (`stage_counts`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageCountRow {
    /// Data pipeline.
    pub data_pipeline: String,
    /// Stage.
    pub stage: String,
    /// Outcome name.
    pub outcome: String,
    /// Count.
    pub count: i64,
}

/// Wall time of one phase (`timings`; not deterministic).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingRow {
    /// Phase (`collect`, `stages`, `train`, `eval`, `judge_agreement`, ...).
    pub phase: String,
    /// Arm or data pipeline (empty when global).
    pub name: String,
    /// Seconds.
    pub seconds: f64,
}

/// Writes `rows` as `<dir>/<table>/part-0.parquet` (atomically; replaces an older file). The schema is
/// traced from `T`, so an empty table still has its columns.
///
/// # Errors
/// [`Error::Records`] when `T` cannot be traced or converted; [`Error::Parquet`]/[`Error::Io`] on write.
pub fn write_table<T: Serialize + for<'de> Deserialize<'de>>(dir: &Path, table: &str, rows: &[T]) -> Result<()> {
    let fields = Vec::<FieldRef>::from_type::<T>(TracingOptions::default().allow_null_fields(true))?;
    let batch = serde_arrow::to_record_batch(&fields, &rows)?;
    let folder = dir.join(table);
    std::fs::create_dir_all(&folder).map_err(|e| Error::io("create", &folder, e))?;
    let path = folder.join("part-0.parquet");
    let tmp = folder.join(".part-0.parquet.tmp");
    {
        let file = std::fs::File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        let mut w = ArrowWriter::try_new(file, batch.schema(), None)?;
        w.write(&batch)?;
        w.close()?;
    }
    std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename", &path, e))
}

/// Reads `<dir>/<table>/part-0.parquet` back.
///
/// # Errors
/// [`Error::Io`] when missing; [`Error::Parquet`]/[`Error::Records`] when unreadable or not `T` rows.
pub fn read_table<T: DeserializeOwned>(dir: &Path, table: &str) -> Result<Vec<T>> {
    let path = dir.join(table).join("part-0.parquet");
    let file = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)?.build()?;
    let mut out = vec![];
    for b in reader {
        let rows: Vec<T> = serde_arrow::from_record_batch(&b?)?;
        out.extend(rows);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_and_are_queryable() {
        let dir = tempfile::tempdir().unwrap();
        let rows = vec![
            GapRow { arm: "opd".into(), version: 1, sample_id: "s1".into(), tokens: 3, gap: -0.25, abs_gap: Some(0.75), student_logprob: -1.5 },
            GapRow { arm: "binary".into(), version: 0, sample_id: "s2".into(), tokens: 2, gap: 0.5, abs_gap: None, student_logprob: -2.0 },
        ];
        write_table(dir.path(), "teacher_gaps", &rows).unwrap();
        assert_eq!(read_table::<GapRow>(dir.path(), "teacher_gaps").unwrap(), rows);
        write_table::<TimingRow>(dir.path(), "timings", &[]).unwrap();
        assert!(read_table::<TimingRow>(dir.path(), "timings").unwrap().is_empty());
        let arm = ArmRow {
            arm: "a".into(),
            group: "a".into(),
            method: "opd".into(),
            overrides: "{}".into(),
            data_pipeline: "p".into(),
            data_hash: "h".into(),
            config_hash: "c".into(),
            trainer_hash: "t".into(),
            seed: 1,
            initial_weights: "m".into(),
            batch_size: 2,
            lr: 1e-4,
            lora: true,
            w_rl: 1.0,
            w_opd: 1.0,
            opd_loss: "ppo".into(),
            top_k: 0,
            hint_strategy: "longest".into(),
            judge_m: 1,
            hint_m: 1,
            steps: 2,
            train_sql: "SELECT 1".into(),
            sample_ids: vec!["x".into(), "y".into()],
            interaction_ids: vec!["i".into(), "j".into()],
            sample_types: vec!["opd".into(), "opd".into()],
        };
        write_table(dir.path(), "arms", std::slice::from_ref(&arm)).unwrap();
        assert_eq!(read_table::<ArmRow>(dir.path(), "arms").unwrap(), vec![arm]);
        // DataFusion sees the folders as tables.
        let lake = crate::lake::Lake::open(dir.path()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let n = rt.block_on(crate::sql::scalar_i64(&lake, "SELECT count(*) FROM teacher_gaps WHERE gap < 0")).unwrap();
        assert_eq!(n, 1);
        let k = rt.block_on(crate::sql::scalar_i64(&lake, "SELECT array_length(sample_ids) FROM arms")).unwrap();
        assert_eq!(k, 2);
    }
}
