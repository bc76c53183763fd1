//! `hints`: m hint-judge votes per turn and the hint chosen for the teacher (docs/method.md §3).

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::fields::{boolf, i32f, list_of_struct, schema_version_field, ts, utf8};
use super::table::Table;

/// One hint-judge vote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HintCandidate {
    /// 0-based vote index.
    pub index: i32,
    /// Raw judge text.
    pub raw: String,
    /// Parsed score in {1, −1}; null when invalid.
    pub score: Option<i32>,
    /// The hint between `[HINT_START]` and `[HINT_END]` (last block, trimmed), if any.
    pub hint: Option<String>,
    /// Why the vote is invalid, if it is.
    pub error: Option<String>,
    /// True when served from the cache.
    pub cached: bool,
}

fn candidate_fields() -> Vec<Field> {
    vec![
        i32f("index", false, "Vote index."),
        utf8("raw", false, "Raw judge text."),
        i32f("score", true, "Parsed score in {1,-1}; null when invalid."),
        utf8("hint", true, "Hint text (last [HINT_START]..[HINT_END] block, trimmed)."),
        utf8("error", true, "Why the vote is invalid."),
        boolf("cached", false, "Served from the cache."),
    ]
}

/// The directive signal of one turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HintRecord {
    /// Schema version.
    pub schema_version: i32,
    /// Key: hash of interaction id and the hint configuration.
    pub hint_id: String,
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
    /// Every vote.
    pub candidates: Vec<HintCandidate>,
    /// Selection strategy (`longest`, `shortest`, `majority-gated`).
    pub strategy: String,
    /// The chosen hint; null when none was accepted.
    pub chosen_hint: Option<String>,
    /// Index of the chosen vote.
    pub chosen_index: Option<i32>,
    /// Why this hint (or why none) was chosen.
    pub reason: String,
    /// Hint backend (`rules`, `openai`, `sglang`).
    pub hint_backend: String,
    /// Hint-judge model id.
    pub hint_model: String,
    /// Prompt template id.
    pub template_id: String,
    /// Hash of the template text.
    pub template_hash: String,
    /// The teacher context (JSON messages: the turn's request with the hint appended to the last user
    /// message, docs/method.md §3), when a hint was chosen.
    pub teacher_messages: Option<String>,
    /// `teacher_messages` rendered with the policy's chat template and generation prompt.
    pub teacher_prompt_text: Option<String>,
    /// Votes served from the cache.
    pub cache_hits: i32,
    /// Event time of the turn (ms).
    pub event_time: i64,
    /// When processed (ms).
    pub processed_time: i64,
}

impl Table for HintRecord {
    const NAME: &'static str = "hints";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "hint_id";
    const DOC: &'static str = "The directive signal: m hint-judge votes per turn (score and hint), the \
        selection strategy, the chosen hint and why, and the teacher context built from it (docs/method.md §3).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("hint_id", false, "Hash of interaction id and hint configuration."),
            utf8("pipeline", false, "Pipeline name."),
            utf8("interaction_id", false, "The turn."),
            utf8("session_id", false, "Session id."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            i32f("turn_index", false, "Turn index."),
            list_of_struct("candidates", candidate_fields(), false, "Every vote: index, raw, score, hint, error, cached."),
            utf8("strategy", false, "longest | shortest | majority-gated."),
            utf8("chosen_hint", true, "Chosen hint (null: none accepted)."),
            i32f("chosen_index", true, "Index of the chosen vote."),
            utf8("reason", false, "Why this hint, or why none."),
            utf8("hint_backend", false, "rules | openai | sglang."),
            utf8("hint_model", false, "Hint-judge model id."),
            utf8("template_id", false, "Prompt template id."),
            utf8("template_hash", false, "Hash of the template text."),
            utf8("teacher_messages", true, "Teacher context messages (JSON), hint appended to the last user message."),
            utf8("teacher_prompt_text", true, "Teacher context rendered with the policy's chat template."),
            i32f("cache_hits", false, "Votes served from the cache."),
            ts("event_time", false, "Event time of the turn (UTC)."),
            ts("processed_time", false, "When processed (UTC)."),
        ]
    }
    table_accessors!(hint_id, session_id, event_time);
}
