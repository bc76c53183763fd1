//! `judgments`: m PRM votes per turn and their majority (docs/method.md §2).

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::fields::{boolf, f32f, i32f, i64f, list_of_struct, schema_version_field, ts, utf8};
use super::table::Table;

/// One judge vote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vote {
    /// 0-based vote index (part of the cache key).
    pub index: i32,
    /// The judge's raw text (empty when the call failed).
    pub raw: String,
    /// Parsed value in {1, 0, −1}; null when the vote is invalid.
    pub value: Option<i32>,
    /// Why the vote is invalid (request failure, no `\boxed{}`, value out of range), if it is.
    pub error: Option<String>,
    /// True when the raw text came from the vote cache.
    pub cached: bool,
}

pub(crate) fn vote_fields() -> Vec<Field> {
    vec![
        i32f("index", false, "Vote index."),
        utf8("raw", false, "Raw judge text."),
        i32f("value", true, "Parsed value in {1,0,-1}; null when invalid."),
        utf8("error", true, "Why the vote is invalid."),
        boolf("cached", false, "Raw text came from the vote cache."),
    ]
}

/// The judge's verdict on one turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Judgment {
    /// Schema version.
    pub schema_version: i32,
    /// Key: hash of interaction id and the judge configuration (template hash, model, sampling, m).
    pub judgment_id: String,
    /// Pipeline name that produced it.
    pub pipeline: String,
    /// The judged turn.
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
    /// Policy version of the judged response.
    pub policy_version: Option<i64>,
    /// Every vote, in index order.
    pub votes: Vec<Vote>,
    /// Number of votes asked for (m).
    pub m: i32,
    /// Number of valid votes.
    pub valid_votes: i32,
    /// True when the top count was tied between values (score forced to 0).
    pub tie: bool,
    /// Majority score in {1, 0, −1} (docs/method.md §2).
    pub score: i32,
    /// Judge backend: `rules`, `openai`, `sglang`.
    pub judge_backend: String,
    /// Judge model id (`rules-v1` for the rule-based baseline).
    pub judge_model: String,
    /// Prompt template id.
    pub template_id: String,
    /// sha256 (truncated) of the template text.
    pub template_hash: String,
    /// Sampling temperature of the votes.
    pub temperature: f32,
    /// Max tokens per vote.
    pub max_tokens: i32,
    /// Votes served from the cache.
    pub cache_hits: i32,
    /// Event time of the turn (ms).
    pub event_time: i64,
    /// When judged (ms).
    pub processed_time: i64,
}

impl Table for Judgment {
    const NAME: &'static str = "judgments";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "judgment_id";
    const DOC: &'static str = "The evaluative signal: m PRM votes per main turn with a next state, each \
        vote's raw text and parsed value, the majority score, the number of valid votes and a tie flag, \
        and the judge's identity (docs/method.md §2).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("judgment_id", false, "Hash of interaction id and judge configuration."),
            utf8("pipeline", false, "Pipeline name."),
            utf8("interaction_id", false, "Judged turn."),
            utf8("session_id", false, "Session id."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            i32f("turn_index", false, "Turn index."),
            i64f("policy_version", true, "Policy version of the response."),
            list_of_struct("votes", vote_fields(), false, "Every vote: index, raw text, parsed value, error, cached."),
            i32f("m", false, "Votes asked for."),
            i32f("valid_votes", false, "Valid votes."),
            boolf("tie", false, "Top count tied (score forced to 0)."),
            i32f("score", false, "Majority score in {1,0,-1}."),
            utf8("judge_backend", false, "rules | openai | sglang."),
            utf8("judge_model", false, "Judge model id."),
            utf8("template_id", false, "Prompt template id."),
            utf8("template_hash", false, "Hash of the prompt template text."),
            f32f("temperature", false, "Sampling temperature."),
            i32f("max_tokens", false, "Max tokens per vote."),
            i32f("cache_hits", false, "Votes served from the cache."),
            ts("event_time", false, "Event time of the turn (UTC)."),
            ts("processed_time", false, "When judged (UTC)."),
        ]
    }
    table_accessors!(judgment_id, session_id, event_time);
}
