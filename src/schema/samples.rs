//! `samples`: what the trainer receives (docs/method.md §5).

use arrow::datatypes::{DataType, Field};
use serde::{Deserialize, Serialize};

use super::fields::{boolf, f32f, i32f, i64f, list_of, list_of_lists, list_of_struct, schema_version_field, ts, utf8};
use super::table::Table;

/// Which row of the docs/method.md §5 table produced a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SampleType {
    /// Binary RL: PRM score ±1, r = score.
    Binary,
    /// OPD: accepted hint, teacher log-probs.
    Opd,
    /// Combined, hint and score ±1.
    CombinedBoth,
    /// Combined, hint only: r = 0.
    CombinedHintOnly,
    /// Combined, score only: teacher log-probs := rollout log-probs.
    CombinedScoreOnly,
}

impl SampleType {
    /// Kebab-case name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            SampleType::Binary => "binary",
            SampleType::Opd => "opd",
            SampleType::CombinedBoth => "combined-both",
            SampleType::CombinedHintOnly => "combined-hint-only",
            SampleType::CombinedScoreOnly => "combined-score-only",
        }
    }
    /// Whether the type has an accepted hint (and so teacher log-probs from a hint-enhanced context):
    /// `opd`, `combined-both` and `combined-hint-only`.
    pub fn has_hint(self) -> bool {
        matches!(self, SampleType::Opd | SampleType::CombinedBoth | SampleType::CombinedHintOnly)
    }
    /// The method that produces this type: `binary`, `opd` or `combined` (docs/method.md §5).
    pub fn method(self) -> &'static str {
        match self {
            SampleType::Binary => "binary",
            SampleType::Opd => "opd",
            SampleType::CombinedBoth | SampleType::CombinedHintOnly | SampleType::CombinedScoreOnly => "combined",
        }
    }
}

/// One hint candidate's teacher data over a sample's response (docs/method.md §3b), shapes [T, K].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherCandidate {
    /// The `teacher_logprobs` row of this candidate.
    pub teacher_id: String,
    /// Index of the hint vote the candidate's hint came from.
    pub hint_index: i32,
    /// The candidate teacher's top-K ids per position P_{t,k}, [T, K].
    pub topk_ids: Vec<Vec<i32>>,
    /// Its top-K log-probs (nats, descending), [T, K].
    pub topk_logprobs: Vec<Vec<f32>>,
    /// Its log-probs at the student's top-K ids ([`Sample::student_topk_ids`]), [T, K].
    pub logprobs_at_student_topk: Vec<Vec<f32>>,
}

fn teacher_candidate_fields() -> Vec<Field> {
    vec![
        utf8("teacher_id", false, "The candidate's teacher_logprobs row."),
        i32f("hint_index", false, "Index of the hint vote the hint came from."),
        list_of_lists("topk_ids", DataType::Int32, false, "Candidate teacher top-K ids [T, K]."),
        list_of_lists("topk_logprobs", DataType::Float32, false, "Candidate teacher top-K log-probs [T, K]."),
        list_of_lists("logprobs_at_student_topk", DataType::Float32, false, "Candidate teacher log-probs at the student's top-K ids [T, K]."),
    ]
}

/// One training sample: a main turn's tokens with its reward and/or teacher log-probs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Schema version.
    pub schema_version: i32,
    /// Key: hash of interaction id and the pipeline's method configuration.
    pub sample_id: String,
    /// Pipeline name.
    pub pipeline: String,
    /// Method: `binary`, `opd` or `combined`.
    pub method: String,
    /// Which docs/method.md §5 case produced it.
    pub sample_type: SampleType,
    /// The turn.
    pub interaction_id: String,
    /// Session id.
    pub session_id: String,
    /// Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only
    /// in rows written before the column existed, read as `default` ([`super::validate_tenant`] says which
    /// ids are valid).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Turn index.
    pub turn_index: i32,
    /// Prompt token ids (the policy's original prompt, not the teacher's).
    pub prompt_token_ids: Vec<i32>,
    /// Response token ids; length T.
    pub response_token_ids: Vec<i32>,
    /// Loss mask over the response, 1 = trained; length T.
    pub loss_mask: Vec<i32>,
    /// Rollout log-probs of the response tokens (nats); length T.
    pub rollout_logprobs: Vec<f32>,
    /// True when rollout log-probs were recomputed by scoring (the log had none).
    pub rollout_logprobs_recomputed: bool,
    /// Scalar reward r (PRM majority score; 0 when absent).
    pub reward: f32,
    /// Teacher log-probs aligned with the response; length T (null for binary samples).
    pub teacher_logprobs: Option<Vec<f32>>,
    /// Top-K teacher ids [T, K] (optional).
    pub topk_ids: Option<Vec<Vec<i32>>>,
    /// Top-K teacher log-probs [T, K] (optional).
    pub topk_logprobs: Option<Vec<Vec<f32>>>,
    /// Token ids of the teacher's (hint-enhanced) prompt, when the sample has teacher log-probs from a
    /// hint (lets the trainer score the teacher with its current weights, `trainer.teacher = current`);
    /// null otherwise and in rows written before the column existed.
    #[serde(default)]
    pub teacher_prompt_token_ids: Option<Vec<i32>>,
    /// Multi-candidate hints (docs/method.md §3b, `teacher.candidates` > 1): the student's top-K ids S_t per
    /// response position, [T, K]; null otherwise.
    #[serde(default)]
    pub student_topk_ids: Option<Vec<Vec<i32>>>,
    /// Multi-candidate hints: each accepted hint's teacher data, shortest hint first (at most
    /// `teacher.candidates`; candidate 0 is also the sample's `teacher_logprobs` / `topk_*`); null
    /// otherwise.
    #[serde(default)]
    pub candidates: Option<Vec<TeacherCandidate>>,
    /// True when the turn's response was cut at the token cap (the interaction's `truncated`:
    /// `finish_reason = length` or an unclosed reasoning block); the trainer quarantines such samples
    /// by default (`trainer.quarantine.truncated`). Null when unknown, as in rows written before the
    /// column existed.
    #[serde(default)]
    pub truncated: Option<bool>,
    /// Policy version that produced the response.
    pub policy_version: Option<i64>,
    /// The judgment used (null when none).
    pub judgment_id: Option<String>,
    /// The hint record used (null when none).
    pub hint_id: Option<String>,
    /// The teacher row used (null when none).
    pub teacher_id: Option<String>,
    /// Kafka topic of the turn's `interactions` record, as the signals stage read it (the same
    /// position as the turn's `signals` row).
    pub source_topic: Option<String>,
    /// Kafka partition of that record.
    pub source_partition: Option<i32>,
    /// Kafka offset of that record.
    pub source_offset: Option<i64>,
    /// Event time of the turn (ms).
    pub event_time: i64,
    /// When assembled (ms).
    pub processed_time: i64,
}

impl Sample {
    /// A sample of `sample_type` (its `method` derived from it) over `prompt_token_ids` [P] and
    /// `response_token_ids` [T] (i32 token ids) with `rollout_logprobs` [T] (f32, nats) and scalar
    /// `reward`: every response token trained (`loss_mask` all 1), no teacher log-probs or top-K,
    /// policy version 0, tenant `default`, ids, pipeline and lineage empty and times 0. Set the other columns with struct
    /// update syntax (`Sample { sample_id, ..Sample::new(..) }`); the samples stage builds its rows in
    /// full (`crate::samples`). Lengths are not checked here: the trainer rejects a misaligned sample.
    pub fn new(sample_type: SampleType, prompt_token_ids: Vec<i32>, response_token_ids: Vec<i32>, rollout_logprobs: Vec<f32>, reward: f32) -> Sample {
        Sample {
            schema_version: Sample::SCHEMA_VERSION,
            sample_id: String::new(),
            pipeline: String::new(),
            method: sample_type.method().into(),
            sample_type,
            interaction_id: String::new(),
            session_id: String::new(),
            tenant: Some(super::tenant::DEFAULT_TENANT.to_string()),
            turn_index: 0,
            loss_mask: vec![1; response_token_ids.len()],
            prompt_token_ids,
            response_token_ids,
            rollout_logprobs,
            rollout_logprobs_recomputed: false,
            reward,
            teacher_logprobs: None,
            topk_ids: None,
            topk_logprobs: None,
            teacher_prompt_token_ids: None,
            student_topk_ids: None,
            candidates: None,
            truncated: None,
            policy_version: Some(0),
            judgment_id: None,
            hint_id: None,
            teacher_id: None,
            source_topic: None,
            source_partition: None,
            source_offset: None,
            event_time: 0,
            processed_time: 0,
        }
    }
    /// Response length T.
    pub fn len(&self) -> usize {
        self.response_token_ids.len()
    }
    /// True when the response is empty.
    pub fn is_empty(&self) -> bool {
        self.response_token_ids.is_empty()
    }
}

impl Table for Sample {
    const NAME: &'static str = "samples";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "sample_id";
    const DOC: &'static str = "Training samples, at most one per main turn per pipeline: prompt and \
        response token ids, loss mask, rollout log-probs, reward, teacher log-probs (and top-K), the \
        policy version and lineage (docs/method.md §5).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("sample_id", false, "Hash of interaction id and method configuration."),
            utf8("pipeline", false, "Pipeline name."),
            utf8("method", false, "binary | opd | combined."),
            utf8("sample_type", false, "binary | opd | combined-both | combined-hint-only | combined-score-only."),
            utf8("interaction_id", false, "The turn."),
            utf8("session_id", false, "Session id."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            i32f("turn_index", false, "Turn index."),
            list_of("prompt_token_ids", DataType::Int32, false, "Prompt token ids."),
            list_of("response_token_ids", DataType::Int32, false, "Response token ids [T]."),
            list_of("loss_mask", DataType::Int32, false, "Loss mask [T], 1 = trained."),
            list_of("rollout_logprobs", DataType::Float32, false, "Rollout log-probs (nats) [T]."),
            boolf("rollout_logprobs_recomputed", false, "Rollout log-probs recomputed by scoring."),
            f32f("reward", false, "Scalar reward r."),
            list_of("teacher_logprobs", DataType::Float32, true, "Teacher log-probs [T]."),
            list_of_lists("topk_ids", DataType::Int32, true, "Teacher top-K ids [T, K]."),
            list_of_lists("topk_logprobs", DataType::Float32, true, "Teacher top-K log-probs [T, K]."),
            list_of("teacher_prompt_token_ids", DataType::Int32, true, "Teacher (hint-enhanced) prompt token ids, when the sample has a hint's teacher log-probs."),
            list_of_lists("student_topk_ids", DataType::Int32, true, "Multi-candidate hints: the student's top-K ids [T, K]."),
            list_of_struct("candidates", teacher_candidate_fields(), true, "Multi-candidate hints: per accepted hint (shortest first) its teacher_id, hint_index, top-K ids and log-probs [T, K] and log-probs at the student's top-K ids [T, K]."),
            boolf("truncated", true, "Response cut at the token cap (the turn's finish_reason = length); null when unknown."),
            i64f("policy_version", true, "Policy version that produced the response."),
            utf8("judgment_id", true, "Judgment used."),
            utf8("hint_id", true, "Hint record used."),
            utf8("teacher_id", true, "Teacher row used."),
            utf8("source_topic", true, "Kafka topic of the turn's interactions record, as the signals stage read it (same as its signal's)."),
            i32f("source_partition", true, "Kafka partition of that interactions record."),
            i64f("source_offset", true, "Kafka offset of that interactions record."),
            ts("event_time", false, "Event time of the turn (UTC)."),
            ts("processed_time", false, "When assembled (UTC)."),
        ]
    }
    table_accessors!(sample_id, session_id, event_time);
    /// The tenant ([`super::tenant_or_default`]): per-tenant training needs one tenant's samples in one
    /// partition (docs/tenants.md).
    fn message_key(&self) -> &str {
        super::tenant::tenant_or_default(self.tenant.as_deref())
    }
}
