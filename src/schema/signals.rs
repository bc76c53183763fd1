//! `signals`: each main assistant turn paired with its next state (docs/method.md §1).

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::fields::{boolf, i32f, i64f, schema_version_field, ts, utf8};
use super::lineage::Lineage;
use super::table::Table;

/// What kind of feedback the next state is, classified by role and content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NextStateKind {
    /// A person's reply.
    User,
    /// One or more tool results (all of them, in call order).
    Tool,
    /// Environment feedback: program output, test results, observations (including tool output sent
    /// back with role `user`, as mini-swe-agent and SWE-agent do).
    Environment,
    /// No next state: the session ended first. Such rows have `excluded_reason` set.
    None,
}

impl NextStateKind {
    /// Lower-case name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            NextStateKind::User => "user",
            NextStateKind::Tool => "tool",
            NextStateKind::Environment => "environment",
            NextStateKind::None => "none",
        }
    }
}

/// One main turn with its next state and cheap features of that next state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signal {
    /// Schema version.
    pub schema_version: i32,
    /// The turn's interaction id (also this table's key: one signal per turn).
    pub interaction_id: String,
    /// Session id.
    pub session_id: String,
    /// Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only
    /// in rows written before the column existed, read as `default` ([`super::validate_tenant`] says which
    /// ids are valid).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Turn index within the session.
    pub turn_index: i32,
    /// Policy version that produced the response.
    pub policy_version: Option<i64>,
    /// Kind of next state; `none` for excluded turns.
    pub kind: NextStateKind,
    /// The next-state messages (JSON array of [`Message`](super::Message)); empty array when excluded.
    pub next_state: String,
    /// The next state rendered as plain text (what the judge reads).
    pub next_state_text: String,
    /// Interaction id of the request that carried the next state (null when it came from the log
    /// itself or the turn was excluded).
    pub next_interaction_id: Option<String>,
    /// Why this turn has no training signal (null when paired).
    pub excluded_reason: Option<String>,
    /// An error message or traceback appears in the next state.
    pub has_error: bool,
    /// Exit code reported in the next state, if any.
    pub exit_code: Option<i32>,
    /// An explicit correction / redo cue from the user.
    pub correction_cue: bool,
    /// An explicit thanks / approval cue from the user.
    pub thanks_cue: bool,
    /// A success cue from the environment (tests passed, exit code 0, "success").
    pub success_cue: bool,
    /// Kafka topic of the `interactions` record of the turn, as the signals stage read it.
    pub source_topic: Option<String>,
    /// Kafka partition of that record.
    pub source_partition: Option<i32>,
    /// Kafka offset of that record.
    pub source_offset: Option<i64>,
    /// Event time of the turn (ms).
    pub event_time: i64,
    /// When the signal was produced (ms).
    pub processed_time: i64,
}

impl Table for Signal {
    const NAME: &'static str = "signals";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "interaction_id";
    const DOC: &'static str = "One row per main assistant turn: its next state (user reply, all tool \
        results in call order, or environment observation), the next state's kind, cheap features for \
        the judge, or the reason the turn has no next state (docs/method.md §1).";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("interaction_id", false, "The turn (interactions.interaction_id); one signal per turn."),
            utf8("session_id", false, "Session id."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            i32f("turn_index", false, "Turn index within the session."),
            i64f("policy_version", true, "Policy version that produced the response."),
            utf8("kind", false, "user | tool | environment | none (excluded)."),
            utf8("next_state", false, "Next-state messages, JSON array."),
            utf8("next_state_text", false, "Next state as plain text (what the judge reads)."),
            utf8("next_interaction_id", true, "Interaction whose request carried the next state."),
            utf8("excluded_reason", true, "Why the turn has no next state (null when paired)."),
            boolf("has_error", false, "Error message or traceback in the next state."),
            i32f("exit_code", true, "Exit code reported in the next state."),
            boolf("correction_cue", false, "Explicit correction/redo cue."),
            boolf("thanks_cue", false, "Explicit thanks/approval cue."),
            boolf("success_cue", false, "Success cue (tests pass, exit 0, success)."),
            utf8("source_topic", true, "Kafka topic of the turn's interactions record, as the signals stage read it."),
            i32f("source_partition", true, "Kafka partition of that interactions record."),
            i64f("source_offset", true, "Kafka offset of that interactions record."),
            ts("event_time", false, "Event time of the turn (UTC)."),
            ts("processed_time", false, "When the signal was produced (UTC)."),
        ]
    }
    table_accessors!(interaction_id, session_id, event_time);
}

impl Signal {
    /// The Kafka position of the turn's `interactions` record (`source_topic/partition/offset`), for
    /// re-attaching it to the turn's row read back from the lake ([`Interaction::read_at`](super::Interaction::read_at)).
    pub fn read_position(&self) -> Lineage {
        Lineage {
            source_topic: self.source_topic.clone(),
            source_partition: self.source_partition,
            source_offset: self.source_offset,
            ..Lineage::default()
        }
    }
}
