//! `train_steps`: one row per optimizer step (issue "trainer").

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::fields::{f64f, i64f, schema_version_field, ts, utf8};
use super::table::Table;

/// Metrics of one optimizer step. Losses are the mean over the step's samples of each sample's mean over its
/// trained tokens (docs/method.md §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainStep {
    /// Schema version.
    pub schema_version: i32,
    /// Key: `<run id>/<step>`.
    pub step_id: String,
    /// Training run id.
    pub run_id: String,
    /// Tenant whose adapter the step trained (per-tenant training); null for the shared policy.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Step number (1-based).
    pub step: i64,
    /// Policy version being trained (the next checkpoint's version).
    pub version: i64,
    /// Method.
    pub method: String,
    /// Total loss.
    pub loss: f64,
    /// PPO clipped policy-gradient loss.
    pub pg_loss: f64,
    /// Fraction of masked tokens where the clipped term was taken.
    pub clip_fraction: f64,
    /// Mean (old − new) log-prob over masked tokens.
    pub ppo_kl: f64,
    /// Mean k3 KL to the reference policy (0 when disabled).
    pub kl: f64,
    /// Mean entropy of the policy over masked tokens (nats).
    pub entropy: f64,
    /// Top-K reverse-KL distillation loss (0 when disabled).
    pub topk_kl: f64,
    /// Mean |rollout − recomputed| log-prob over masked tokens.
    pub rollout_logprob_abs_diff: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean advantage by sample type (JSON object).
    pub advantage_by_type: String,
    /// Samples in the batch.
    pub samples: i64,
    /// Masked response tokens in the batch.
    pub tokens: i64,
    /// Wall time of the step (seconds).
    pub seconds: f64,
    /// When the step finished (ms).
    pub created_time: i64,
    /// Mean reward r (docs/method.md §5) over the step's trained samples. Null in rows of schema version 1.
    #[serde(default)]
    pub reward_mean: Option<f64>,
    /// Population standard deviation of r over the step's trained samples (divides by n). Null in
    /// rows of schema version 1.
    #[serde(default)]
    pub reward_std: Option<f64>,
    /// Learning rate AdamW used for this step (the configured `lr`; the trainer has no warm-up or
    /// schedule). Null in rows of schema version 1.
    #[serde(default)]
    pub learning_rate: Option<f64>,
    /// Mean response length of the trained samples (tokens; every response token, masked or not). Null
    /// in rows of schema version 1.
    #[serde(default)]
    pub response_length_mean: Option<f64>,
    /// Longest response of the trained samples (tokens). Null in rows of schema version 1.
    #[serde(default)]
    pub response_length_max: Option<i64>,
    /// Masked response tokens over the step's wall time (tokens/s). Null in rows of schema version 1.
    #[serde(default)]
    pub tokens_per_second: Option<f64>,
    /// Mean staleness of the trained samples (policy versions behind: the trainer's checkpoint
    /// version minus the sample's `policy_version`, at least 0). Null when no trained sample has a
    /// policy version, and in rows of schema version 1.
    #[serde(default)]
    pub staleness_mean: Option<f64>,
    /// Largest staleness of the trained samples (policy versions). Null as `staleness_mean`.
    #[serde(default)]
    pub staleness_max: Option<i64>,
    /// Fraction of the step's masked tokens whose advantage `A_t` is > 0. Null in rows of schema
    /// version 1.
    #[serde(default)]
    pub positive_advantage_fraction: Option<f64>,
    /// Fraction of the step's masked tokens whose advantage `A_t` is < 0. Null in rows of schema
    /// version 1.
    #[serde(default)]
    pub negative_advantage_fraction: Option<f64>,
    /// The same two fractions per sample type, over that type's masked tokens: a JSON object
    /// `{"<type>": {"positive": f, "negative": f}}`. Null in rows of schema version 1.
    #[serde(default)]
    pub advantage_sign_by_type: Option<String>,
    /// Mean over the step's masked tokens of |the reward part of `A_t`|: `|r|` (binary), `|w_rl·r|`
    /// (combined), 0 (OPD) (docs/method.md §6; `trainer::AdvantageParts`). Beside
    /// `advantage_teacher_abs_mean` it says which signal moved the policy. Null before schema version 3.
    #[serde(default)]
    pub advantage_reward_abs_mean: Option<f64>,
    /// Mean over the step's masked tokens of |the teacher part of `A_t`|: `|teacher_t − student_t|`
    /// (OPD), `|w_opd·(teacher_t − student_t)|` (combined), 0 (binary, score-only rows, and the top-K /
    /// overlap losses, whose teacher term is not in `A_t`) (nats). Null before schema version 3.
    #[serde(default)]
    pub advantage_teacher_abs_mean: Option<f64>,
    /// Fraction of the step's masked tokens whose teacher part is > 0 (the teacher rates the sampled
    /// token above the current policy: the step raises it). Null before schema version 3.
    #[serde(default)]
    pub teacher_term_positive_fraction: Option<f64>,
    /// Fraction of the step's masked tokens whose teacher part is < 0 (the step lowers it). Null before
    /// schema version 3.
    #[serde(default)]
    pub teacher_term_negative_fraction: Option<f64>,
}

impl TrainStep {
    /// A row of the current schema version for step `step` of run `run_id` (key `<run id>/<step>`,
    /// version = `step`) with every measure 0, empty JSON objects, `created_time` 0 and every nullable
    /// column null: the base a test or a tool fills in (`TrainStep { loss: 0.5, ..TrainStep::new(..) }`).
    pub fn new(run_id: &str, step: i64, method: &str) -> TrainStep {
        TrainStep {
            schema_version: Self::SCHEMA_VERSION,
            step_id: format!("{run_id}/{step}"),
            run_id: run_id.to_string(),
            tenant: None,
            step,
            version: step,
            method: method.to_string(),
            loss: 0.0,
            pg_loss: 0.0,
            clip_fraction: 0.0,
            ppo_kl: 0.0,
            kl: 0.0,
            entropy: 0.0,
            topk_kl: 0.0,
            rollout_logprob_abs_diff: 0.0,
            grad_norm: 0.0,
            advantage_by_type: "{}".into(),
            samples: 0,
            tokens: 0,
            seconds: 0.0,
            created_time: 0,
            reward_mean: None,
            reward_std: None,
            learning_rate: None,
            response_length_mean: None,
            response_length_max: None,
            tokens_per_second: None,
            staleness_mean: None,
            staleness_max: None,
            positive_advantage_fraction: None,
            negative_advantage_fraction: None,
            advantage_sign_by_type: None,
            advantage_reward_abs_mean: None,
            advantage_teacher_abs_mean: None,
            teacher_term_positive_fraction: None,
            teacher_term_negative_fraction: None,
        }
    }
}

impl Table for TrainStep {
    const NAME: &'static str = "train_steps";
    const SCHEMA_VERSION: i32 = 3;
    const KEY: &'static str = "step_id";
    const DOC: &'static str = "Per optimizer step: loss components (docs/method.md §6), clip fraction, \
        PPO KL, KL to the reference, entropy, advantages by sample type, tokens and seconds; since \
        version 2 also reward mean/std, learning rate, response lengths, tokens/s, staleness and the \
        positive/negative advantage token fractions (nullable: null in version-1 files); since version 3 \
        the advantage's reward and teacher parts and the teacher part's sign fractions (null before).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("step_id", false, "<run id>/<step>."),
            utf8("run_id", false, "Training run id."),
            utf8("tenant", true, "Tenant whose adapter the step trained (per-tenant training); null for the shared policy."),
            i64f("step", false, "Step number (1-based)."),
            i64f("version", false, "Policy version being trained."),
            utf8("method", false, "Method."),
            f64f("loss", false, "Total loss."),
            f64f("pg_loss", false, "PPO clipped policy-gradient loss."),
            f64f("clip_fraction", false, "Fraction of tokens where the clipped term was taken."),
            f64f("ppo_kl", false, "Mean (old - new) log-prob."),
            f64f("kl", false, "Mean k3 KL to the reference policy."),
            f64f("entropy", false, "Mean policy entropy (nats)."),
            f64f("topk_kl", false, "Top-K reverse-KL distillation loss."),
            f64f("rollout_logprob_abs_diff", false, "Mean |rollout - recomputed| log-prob."),
            f64f("grad_norm", false, "Gradient norm before clipping."),
            utf8("advantage_by_type", false, "Mean advantage by sample type (JSON)."),
            i64f("samples", false, "Samples in the batch."),
            i64f("tokens", false, "Masked response tokens."),
            f64f("seconds", false, "Wall time of the step (s)."),
            ts("created_time", false, "When the step finished (UTC)."),
            f64f("reward_mean", true, "Mean reward r over the trained samples (null before schema version 2)."),
            f64f("reward_std", true, "Population std of r over the trained samples."),
            f64f("learning_rate", true, "Learning rate used for this step."),
            f64f("response_length_mean", true, "Mean response length of the trained samples (tokens)."),
            i64f("response_length_max", true, "Longest response of the trained samples (tokens)."),
            f64f("tokens_per_second", true, "Masked response tokens over the step's wall time (tokens/s)."),
            f64f("staleness_mean", true, "Mean trainer version minus sample policy_version (versions; null without versions)."),
            i64f("staleness_max", true, "Largest trainer version minus sample policy_version (versions)."),
            f64f("positive_advantage_fraction", true, "Fraction of masked tokens with advantage > 0."),
            f64f("negative_advantage_fraction", true, "Fraction of masked tokens with advantage < 0."),
            utf8("advantage_sign_by_type", true, "Positive/negative advantage token fractions by sample type (JSON)."),
            f64f("advantage_reward_abs_mean", true, "Mean |reward part of the advantage| over masked tokens (null before schema version 3)."),
            f64f("advantage_teacher_abs_mean", true, "Mean |teacher part of the advantage| over masked tokens (nats; null before version 3)."),
            f64f("teacher_term_positive_fraction", true, "Fraction of masked tokens whose teacher part is > 0 (null before version 3)."),
            f64f("teacher_term_negative_fraction", true, "Fraction of masked tokens whose teacher part is < 0 (null before version 3)."),
        ]
    }
    fn key(&self) -> &str {
        &self.step_id
    }
    fn session_id(&self) -> &str {
        &self.run_id
    }
    fn event_time_ms(&self) -> i64 {
        self.created_time
    }
}
