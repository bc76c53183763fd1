//! `interactions`: one row per assistant turn (docs/method.md §1).

use arrow::datatypes::{DataType, Field};
use serde::{Deserialize, Serialize};

use super::fields::{boolf, f64f, history, i32f, i64f, list_of, schema_version_field, ts, utf8};
use super::hash::content_hash;
use super::lineage::{lineage_fields, Lineage};
use super::table::Table;

/// Whether a turn is trainable (`main`) or only recorded (`side`: heartbeats, memory flushes,
/// helper calls). docs/method.md §1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnType {
    /// A trainable turn.
    Main,
    /// Recorded, never trained on.
    Side,
}

impl TurnType {
    /// `"main"` or `"side"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TurnType::Main => "main",
            TurnType::Side => "side",
        }
    }
    /// Parses `main`/`side` (case-insensitive).
    pub fn parse(s: &str) -> Option<TurnType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "main" => Some(TurnType::Main),
            "side" => Some(TurnType::Side),
            _ => None,
        }
    }
}

/// One tool call made by the assistant, normalised across formats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id as the log gave it (may repeat within a session in real logs; never join on it alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Function name.
    pub name: String,
    /// Arguments parsed as JSON (null when the raw string is not valid JSON).
    #[serde(default)]
    pub arguments: serde_json::Value,
    /// The arguments exactly as logged (JSON-in-JSON string in OpenAI logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments_raw: Option<String>,
}

/// One chat message, normalised: `developer` → `system`, list content → joined text, reasoning
/// split off the visible text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool` (`function` is mapped to `tool`).
    pub role: String,
    /// Visible text (empty string when the log had null content).
    #[serde(default)]
    pub content: String,
    /// Reasoning text separated from the visible text (`<think>…</think>` or a reasoning field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool calls made by an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the id of the call this result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `tool` messages: the function name, when logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with only a role and text.
    pub fn text(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
            reasoning: None,
            tool_calls: vec![],
            tool_call_id: None,
            name: None,
        }
    }
}

/// One assistant turn: the request the policy saw and the response it gave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interaction {
    /// Schema version ([`Interaction::SCHEMA_VERSION`]).
    pub schema_version: i32,
    /// Content-addressed id: hash of session id, turn index, request and response.
    pub interaction_id: String,
    /// Session (conversation/episode) id.
    pub session_id: String,
    /// Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only
    /// in rows written before the column existed, read as `default` ([`super::validate_tenant`] says which
    /// ids are valid).
    #[serde(default)]
    pub tenant: Option<String>,
    /// True when the session id was inferred by message-prefix matching, not given by the client.
    pub session_inferred: bool,
    /// 0-based index of this assistant turn within its session.
    pub turn_index: i32,
    /// `main` (trainable) or `side`.
    pub turn_type: TurnType,
    /// True when the client marked the session done with this turn.
    pub session_done: bool,
    /// Version of the policy that produced the response (null for ingested logs of other models).
    pub policy_version: Option<i64>,
    /// Model name as logged.
    pub model: Option<String>,
    /// The request messages, JSON array of [`Message`].
    pub request_messages: String,
    /// The tool definitions offered in the request (JSON), if any.
    pub tools: Option<String>,
    /// Visible response text.
    pub response_text: String,
    /// Reasoning text of the response, separated from the visible text.
    pub reasoning_text: Option<String>,
    /// Tool calls of the response, JSON array of [`ToolCall`].
    pub tool_calls: Option<String>,
    /// Finish reason as logged (`stop`, `length`, `tool_calls`, ...).
    pub finish_reason: Option<String>,
    /// True when the response was cut by the token limit (`finish_reason = length`) or the reasoning
    /// block never closed.
    pub truncated: bool,
    /// The rendered prompt text, when logged.
    pub prompt_text: Option<String>,
    /// Prompt token ids as the policy saw them, when logged.
    pub prompt_token_ids: Option<Vec<i32>>,
    /// Response token ids as sampled by the policy, when logged.
    pub response_token_ids: Option<Vec<i32>>,
    /// Per-token log-prob of each response token under the sampling policy (nats); same length as
    /// `response_token_ids`.
    pub rollout_logprobs: Option<Vec<f32>>,
    /// The next state as given by the log itself (JSON array of [`Message`]), e.g. OpenClaw records'
    /// `next_state` or the messages that close a complete trajectory; otherwise the signal stage pairs
    /// this turn with its successor request.
    pub next_state: Option<String>,
    /// An outcome label of the session from the log (e.g. tau-bench reward), for judge agreement.
    pub outcome_reward: Option<f64>,
    /// Normalisation notes ("developer role mapped to system", "dropped 2 non-text content parts").
    pub notes: Vec<String>,
    /// Log format this row came from (`proxy`, `tau-bench`, `openai-chat`, ...).
    pub source_format: String,
    /// Kafka topic of the `interactions` record this row was read from. Null in the `interactions`
    /// table itself (ingest and the proxy build rows from files and HTTP, before they have a Kafka
    /// position); the signals stage sets it on the row it carries downstream
    /// ([`Interaction::read_at`]), which is where `signals`, `samples` and checkpoint lineage take
    /// their `source_*` columns from.
    pub source_topic: Option<String>,
    /// Kafka partition of that record (see `source_topic`).
    pub source_partition: Option<i32>,
    /// Kafka offset of that record (see `source_topic`).
    pub source_offset: Option<i64>,
    /// Input file, for ingested logs (null for proxy rows).
    pub source_file: Option<String>,
    /// 1-based line (JSONL) or record index (JSON arrays) within the file.
    pub source_line: Option<i64>,
    /// When the turn happened (ms since epoch; the log's timestamp, else ingest time).
    pub event_time: i64,
    /// When nextstate recorded the row (ms since epoch).
    pub ingest_time: i64,
}

impl Interaction {
    /// A main turn of `session_id` at `turn_index`: `request_messages` (a JSON array of messages, not
    /// checked here) answered by `response_text`, at `event_time_ms` (ms since epoch; also the ingest
    /// time), of the `default` tenant. Its `interaction_id` is [`Interaction::compute_id`] of those; every optional column is
    /// empty (no tokens, log-probs, next state or lineage), `source_format` is `manual`. Set the other
    /// columns with struct update syntax (`Interaction { policy_version: Some(3), ..Interaction::new(..) }`).
    pub fn new(session_id: &str, turn_index: i32, request_messages: &str, response_text: &str, event_time_ms: i64) -> Interaction {
        Interaction {
            schema_version: Interaction::SCHEMA_VERSION,
            interaction_id: Interaction::compute_id(session_id, turn_index, request_messages, response_text, None),
            session_id: session_id.into(),
            tenant: Some(super::tenant::DEFAULT_TENANT.to_string()),
            session_inferred: false,
            turn_index,
            turn_type: TurnType::Main,
            session_done: false,
            policy_version: None,
            model: None,
            request_messages: request_messages.into(),
            tools: None,
            response_text: response_text.into(),
            reasoning_text: None,
            tool_calls: None,
            finish_reason: None,
            truncated: false,
            prompt_text: None,
            prompt_token_ids: None,
            response_token_ids: None,
            rollout_logprobs: None,
            next_state: None,
            outcome_reward: None,
            notes: vec![],
            source_format: "manual".into(),
            source_topic: None,
            source_partition: None,
            source_offset: None,
            source_file: None,
            source_line: None,
            event_time: event_time_ms,
            ingest_time: event_time_ms,
        }
    }
    /// This row as read from the Kafka position in `lineage`: `source_topic`, `source_partition` and
    /// `source_offset` become the lineage's (the file position, `source_file`/`source_line`, stays).
    /// A lineage without a topic (a row not read from Kafka) leaves the row unchanged.
    pub fn read_at(mut self, lineage: &Lineage) -> Interaction {
        if lineage.source_topic.is_some() {
            self.source_topic = lineage.source_topic.clone();
            self.source_partition = lineage.source_partition;
            self.source_offset = lineage.source_offset;
        }
        self
    }
    /// Parses `request_messages`.
    ///
    /// # Errors
    /// [`crate::Error::Json`] when the column does not hold a JSON array of messages.
    pub fn messages(&self) -> crate::Result<Vec<Message>> {
        Ok(serde_json::from_str(&self.request_messages)?)
    }
    /// Parses `tool_calls` (empty when null).
    ///
    /// # Errors
    /// [`crate::Error::Json`] when the column is not a JSON array of tool calls.
    pub fn parsed_tool_calls(&self) -> crate::Result<Vec<ToolCall>> {
        match &self.tool_calls {
            None => Ok(vec![]),
            Some(s) => Ok(serde_json::from_str(s)?),
        }
    }
    /// The response as an assistant [`Message`] (text, reasoning and tool calls).
    pub fn response_message(&self) -> crate::Result<Message> {
        Ok(Message {
            role: "assistant".into(),
            content: self.response_text.clone(),
            reasoning: self.reasoning_text.clone(),
            tool_calls: self.parsed_tool_calls()?,
            tool_call_id: None,
            name: None,
        })
    }
    /// The content-addressed id for a turn: hash of session id, turn index, request JSON and
    /// response text/tool calls.
    pub fn compute_id(session_id: &str, turn_index: i32, request_messages: &str, response_text: &str, tool_calls: Option<&str>) -> String {
        content_hash(&[
            session_id.as_bytes(),
            &turn_index.to_le_bytes(),
            request_messages.as_bytes(),
            response_text.as_bytes(),
            tool_calls.unwrap_or("").as_bytes(),
        ])
    }

    /// [`Interaction::compute_id`] of `tenant`'s turn: the same id for the default tenant, and for any
    /// other the tenant hashed in too, so two tenants' identical turns under one session id are two
    /// rows, not one.
    pub fn compute_id_for(tenant: &str, session_id: &str, turn_index: i32, request_messages: &str, response_text: &str, tool_calls: Option<&str>) -> String {
        if tenant == super::tenant::DEFAULT_TENANT {
            return Interaction::compute_id(session_id, turn_index, request_messages, response_text, tool_calls);
        }
        content_hash(&[
            b"tenant",
            tenant.as_bytes(),
            session_id.as_bytes(),
            &turn_index.to_le_bytes(),
            request_messages.as_bytes(),
            response_text.as_bytes(),
            tool_calls.unwrap_or("").as_bytes(),
        ])
    }
}

impl Table for Interaction {
    const NAME: &'static str = "interactions";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "interaction_id";
    const DOC: &'static str = "One row per assistant turn: the request the policy saw, its response \
        (text, reasoning, tool calls, token ids and rollout log-probs when known), the session it \
        belongs to and where the row came from (docs/method.md §1).";
    fn fields() -> Vec<Field> {
        let mut f = vec![
            schema_version_field(),
            utf8("interaction_id", false, "Content-addressed turn id (hash of session, turn index, request, response)."),
            utf8("session_id", false, "Session (conversation/episode) id; the Kafka message key."),
            utf8("tenant", true, "Tenant (agent or user of a fleet) the turn belongs to: `default` when its source named none; null only in rows written before the column existed, read as `default`."),
            boolf("session_inferred", false, "Session id inferred by message-prefix matching (client gave none)."),
            i32f("turn_index", false, "0-based index of this assistant turn within its session."),
            utf8("turn_type", false, "main (trainable) or side (recorded only)."),
            boolf("session_done", false, "The client marked the session done with this turn."),
            i64f("policy_version", true, "Version of the policy that produced the response."),
            utf8("model", true, "Model name as logged."),
            history(utf8("request_messages", false, "Request messages: JSON array of {role, content, reasoning?, tool_calls?, tool_call_id?, name?}.")),
            utf8("tools", true, "Tool definitions offered in the request (JSON)."),
            utf8("response_text", false, "Visible response text."),
            utf8("reasoning_text", true, "Reasoning separated from the visible text."),
            utf8("tool_calls", true, "Response tool calls: JSON array of {id?, name, arguments, arguments_raw?}."),
            utf8("finish_reason", true, "Finish reason as logged."),
            boolf("truncated", false, "Response cut by the token limit or an unclosed reasoning block."),
            history(utf8("prompt_text", true, "Rendered prompt text, when logged.")),
            list_of("prompt_token_ids", DataType::Int32, true, "Prompt token ids as the policy saw them."),
            list_of("response_token_ids", DataType::Int32, true, "Response token ids as sampled."),
            list_of("rollout_logprobs", DataType::Float32, true, "Per-token log-prob (nats) of each response token under the sampling policy; len = len(response_token_ids)."),
            utf8("next_state", true, "Next state given by the log itself (JSON array of messages), if any."),
            f64f("outcome_reward", true, "Session outcome label from the log (e.g. tau-bench reward)."),
            list_of("notes", DataType::Utf8, false, "Normalisation notes."),
            utf8("source_format", false, "Log format the row came from (proxy, tau-bench, openai-chat, ...)."),
        ];
        f.extend(lineage_fields());
        f.push(ts("event_time", false, "When the turn happened (UTC)."));
        f.push(ts("ingest_time", false, "When nextstate recorded the row (UTC)."));
        f
    }
    table_accessors!(interaction_id, session_id, event_time);
}
