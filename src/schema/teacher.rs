//! `teacher_logprobs`: the teacher's log-probs of the student's own response tokens (docs/method.md §4).

use arrow::datatypes::{DataType, Field};
use serde::{Deserialize, Serialize};

use super::fields::{i32f, i64f, list_of, list_of_lists, schema_version_field, ts, utf8};
use super::table::Table;

/// Teacher log-probs for one turn under its hint-enhanced context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherLogprobs {
    /// Schema version.
    pub schema_version: i32,
    /// Key: hash of interaction id, teacher context and teacher model.
    pub teacher_id: String,
    /// Pipeline name.
    pub pipeline: String,
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
    /// Teacher model id: the model directory's name, or `<run id>/<version>` when the teacher is a
    /// trainer checkpoint, or the served model id of a remote teacher (`[teacher] backend = "sglang" |
    /// "vllm"`, whose rows have `teacher_version` 0).
    pub teacher_model: String,
    /// Version of the weights that scored the row: the checkpoint manifest's version when the teacher
    /// is a trainer checkpoint, 0 for any other model directory (the weights as imported; by default
    /// the policy's initial weights). The teacher stage does not follow new checkpoints.
    pub teacher_version: i64,
    /// Token ids of the enhanced prompt.
    pub teacher_prompt_token_ids: Vec<i32>,
    /// The student's response token ids, unchanged; length T.
    pub response_token_ids: Vec<i32>,
    /// `teacher_logprobs[i]` = log π_teacher(response_i | enhanced prompt, response_<i) (nats); length T.
    pub teacher_logprobs: Vec<f32>,
    /// Top-K teacher token ids per position, shape [T, K] (null when K = 0).
    pub topk_ids: Option<Vec<Vec<i32>>>,
    /// Top-K teacher log-probs per position, shape [T, K], sorted descending.
    pub topk_logprobs: Option<Vec<Vec<f32>>>,
    /// Multi-candidate hints (docs/method.md §3b): the student's (the policy's initial weights on the
    /// original prompt) top-K token ids per position, shape [T, K]; null otherwise (and in rows written
    /// before the column existed).
    #[serde(default)]
    pub student_topk_ids: Option<Vec<Vec<i32>>>,
    /// Multi-candidate hints: the teacher's log-probs (nats) at `student_topk_ids`, shape [T, K].
    #[serde(default)]
    pub logprobs_at_student_topk: Option<Vec<Vec<f32>>>,
    /// Event time of the turn (ms).
    pub event_time: i64,
    /// When computed (ms).
    pub processed_time: i64,
}

impl Table for TeacherLogprobs {
    const NAME: &'static str = "teacher_logprobs";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "teacher_id";
    const DOC: &'static str = "Teacher log-probs of the student's own response tokens under the \
        hint-enhanced context, aligned so that teacher_logprobs[i] scores response_token_ids[i], with \
        optional top-K ids and log-probs per position (docs/method.md §4).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("teacher_id", false, "Hash of interaction id, teacher context and teacher model."),
            utf8("pipeline", false, "Pipeline name."),
            utf8("interaction_id", false, "The turn."),
            utf8("session_id", false, "Session id."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            i32f("turn_index", false, "Turn index."),
            utf8("teacher_model", false, "Teacher model id: model directory name, or <run id>/<version> for a trainer checkpoint."),
            i64f("teacher_version", false, "Version of the weights that scored the row: the checkpoint's version, 0 for a model as imported (default: the initial policy)."),
            list_of("teacher_prompt_token_ids", DataType::Int32, false, "Enhanced prompt token ids."),
            list_of("response_token_ids", DataType::Int32, false, "Student response token ids [T]."),
            list_of("teacher_logprobs", DataType::Float32, false, "Teacher log-prob of response_token_ids[i] (nats) [T]."),
            list_of_lists("topk_ids", DataType::Int32, true, "Teacher top-K token ids per position [T, K]."),
            list_of_lists("topk_logprobs", DataType::Float32, true, "Teacher top-K log-probs per position [T, K]."),
            list_of_lists("student_topk_ids", DataType::Int32, true, "Multi-candidate hints: the student's top-K ids per position [T, K]."),
            list_of_lists("logprobs_at_student_topk", DataType::Float32, true, "Multi-candidate hints: teacher log-probs at student_topk_ids [T, K]."),
            ts("event_time", false, "Event time of the turn (UTC)."),
            ts("processed_time", false, "When computed (UTC)."),
        ]
    }
    table_accessors!(teacher_id, session_id, event_time);
}
