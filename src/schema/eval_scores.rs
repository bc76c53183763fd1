//! `eval_scores`: one row per (run, arm, policy version, held-out problem) of the personal-agent demo's
//! evaluation (docs/method.md §7; the student and the score are in `crate::demo`).

use arrow::datatypes::{DataType, Field};
use serde::{Deserialize, Serialize};

use super::fields::{boolf, i64f, list_of, schema_version_field, ts, utf8};
use super::hash::content_hash;
use super::table::Table;

/// The simulated student's verdict on one held-out response of one policy version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalScore {
    /// Schema version.
    pub schema_version: i32,
    /// Key: [`EvalScore::id_for`] of (run id, arm, policy version, problem id).
    pub eval_id: String,
    /// Demo run id.
    pub run_id: String,
    /// Tenant whose preferences scored the answers (a demo student); null when the run has one student.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Arm of an ablation (`combined`, `binary`, `opd`, ...); the method name in a single-arm demo.
    pub arm: String,
    /// Policy version evaluated (0 = the initial weights).
    pub policy_version: i64,
    /// Student interactions (agent turns) the pipeline had seen when this version was published.
    pub interactions_seen: i64,
    /// Problem id: 0-based index in `data/gsm8k_test.json`.
    pub problem_id: i64,
    /// The policy's response (visible text as returned by the policy server).
    pub response_text: String,
    /// Every enabled preference met (the personalization score counts these).
    pub satisfied: bool,
    /// Violations, each `<preference>: <what>: <evidence>` (e.g. ``no_markdown: bold text: `**Step 1**` ``).
    pub violations: Vec<String>,
    /// The last number in the response equals the answer.
    pub correct: bool,
    /// When the response was scored (ms since the Unix epoch). Also the event time.
    pub eval_time: i64,
}

impl EvalScore {
    /// The primary key: [`content_hash`] of (run id, arm, policy version as decimal text, problem id as
    /// decimal text), 32 hex characters.
    pub fn id_for(run_id: &str, arm: &str, policy_version: i64, problem_id: i64) -> String {
        content_hash(&[
            run_id.as_bytes(),
            arm.as_bytes(),
            policy_version.to_string().as_bytes(),
            problem_id.to_string().as_bytes(),
        ])
    }
}

impl Table for EvalScore {
    const NAME: &'static str = "eval_scores";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "eval_id";
    const DOC: &'static str = "Personal-agent demo evaluation (docs/method.md §7): one row per run, arm, policy \
        version and held-out GSM8K problem: the response, whether the simulated student's hidden preferences \
        are all met, the violations with evidence, and whether the final number is correct.";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("eval_id", false, "sha256-128 hex of (run_id, arm, policy_version, problem_id)."),
            utf8("run_id", false, "Demo run id."),
            utf8("tenant", true, "Tenant whose preferences scored the answers (a demo student); null when the run has one student."),
            utf8("arm", false, "Ablation arm (the method name in a single-arm demo)."),
            i64f("policy_version", false, "Policy version evaluated (0 = initial weights)."),
            i64f("interactions_seen", false, "Student interactions (agent turns) seen when this version was published."),
            i64f("problem_id", false, "0-based index of the problem in data/gsm8k_test.json."),
            utf8("response_text", false, "The policy's response (visible text)."),
            boolf("satisfied", false, "Every enabled preference of the student met."),
            list_of("violations", DataType::Utf8, false, "Violations as '<preference>: <what>: <evidence>'."),
            boolf("correct", false, "The last number in the response equals the answer."),
            ts("eval_time", false, "When the response was scored (UTC)."),
        ]
    }
    table_accessors!(eval_id, run_id, eval_time);
}
