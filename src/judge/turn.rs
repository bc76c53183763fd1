//! [`TurnContext`]: what the judge and the hint judge look at for one main turn (docs/method.md §2, §3).

use serde::{Deserialize, Serialize};

use crate::schema::{content_hash, Interaction, Message, NextStateKind, Signal};
use crate::{input_err, Result};

/// One main turn joined with its next state: the request messages, the response, the next state and
/// the cheap next-state features the signal stage computed. Built from an [`Interaction`] row and its
/// [`Signal`] row with [`TurnContext::from_rows`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnContext {
    /// The turn (`interactions.interaction_id`).
    pub interaction_id: String,
    /// Session id.
    pub session_id: String,
    /// The turn's tenant (`interactions.tenant`; null in rows written before the column existed).
    #[serde(default)]
    pub tenant: Option<String>,
    /// 0-based turn index in the session.
    pub turn_index: i32,
    /// Policy version that produced the response.
    pub policy_version: Option<i64>,
    /// Event time of the turn (ms since the Unix epoch).
    pub event_time: i64,
    /// The request messages the policy saw.
    pub request: Vec<Message>,
    /// The response as an assistant message (visible text, reasoning, tool calls).
    pub response: Message,
    /// The next-state messages (user reply, all tool results in call order, or observation).
    pub next_state: Vec<Message>,
    /// Kind of next state.
    pub next_state_kind: NextStateKind,
    /// The next state as plain text (what the judge reads).
    pub next_state_text: String,
    /// An error message or traceback appears in the next state.
    pub has_error: bool,
    /// Exit code reported in the next state.
    pub exit_code: Option<i32>,
    /// An explicit correction / redo cue from the user.
    pub correction_cue: bool,
    /// An explicit thanks / approval cue from the user.
    pub thanks_cue: bool,
    /// A success cue from the environment (tests pass, exit code 0, "success").
    pub success_cue: bool,
}

impl TurnContext {
    /// The fixed turn of the judge's and hint judge's start-up probe: "What is 2 + 2?" → "4." → the
    /// user's "thanks!".
    pub fn probe() -> TurnContext {
        TurnContext {
            interaction_id: "startup-probe".into(),
            session_id: "startup-probe".into(),
            tenant: None,
            turn_index: 0,
            policy_version: None,
            event_time: 0,
            request: vec![Message::text("user", "What is 2 + 2?")],
            response: Message::text("assistant", "4."),
            next_state: vec![Message::text("user", "thanks!")],
            next_state_kind: NextStateKind::User,
            next_state_text: "[user] thanks!".into(),
            has_error: false,
            exit_code: None,
            correction_cue: false,
            thanks_cue: true,
            success_cue: false,
        }
    }

    /// Joins an interaction row with its signal row. Call it for main turns whose signal has no
    /// `excluded_reason` (excluded turns have no next state to judge; the wiring counts them).
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] when the two rows are for different turns, or when
    /// `request_messages`, `tool_calls` or `next_state` is not the JSON the schema promises (the
    /// message names the column and the interaction id).
    pub fn from_rows(interaction: &Interaction, signal: &Signal) -> Result<TurnContext> {
        if interaction.interaction_id != signal.interaction_id {
            return Err(input_err!(
                "signal {} paired with interaction {}",
                signal.interaction_id,
                interaction.interaction_id
            ));
        }
        let id = &interaction.interaction_id;
        let request = interaction
            .messages()
            .map_err(|e| input_err!("request_messages of interaction {id} is not a JSON array of messages: {e}"))?;
        let response = interaction
            .response_message()
            .map_err(|e| input_err!("tool_calls of interaction {id} is not a JSON array of tool calls: {e}"))?;
        let next_state: Vec<Message> = if signal.next_state.trim().is_empty() {
            vec![]
        } else {
            serde_json::from_str(&signal.next_state)
                .map_err(|e| input_err!("next_state of signal {id} is not a JSON array of messages: {e}"))?
        };
        Ok(TurnContext {
            interaction_id: id.clone(),
            session_id: interaction.session_id.clone(),
            tenant: interaction.tenant.clone(),
            turn_index: interaction.turn_index,
            policy_version: interaction.policy_version,
            event_time: interaction.event_time,
            request,
            response,
            next_state,
            next_state_kind: signal.kind,
            next_state_text: signal.next_state_text.clone(),
            has_error: signal.has_error,
            exit_code: signal.exit_code,
            correction_cue: signal.correction_cue,
            thanks_cue: signal.thanks_cue,
            success_cue: signal.success_cue,
        })
    }

    /// Content hash of everything a judge prompt or a rule can see (request, response, next state,
    /// its kind and features), excluding ids and times: the turn part of a vote-cache key. 32 hex
    /// characters ([`content_hash`]).
    pub fn content_hash(&self) -> String {
        // serde_json of our own types is deterministic (struct field order, sorted JSON object keys).
        let request = serde_json::to_string(&self.request).unwrap_or_default();
        let response = serde_json::to_string(&self.response).unwrap_or_default();
        let next_state = serde_json::to_string(&self.next_state).unwrap_or_default();
        let features = format!(
            "kind={};has_error={};exit_code={:?};correction={};thanks={};success={}",
            self.next_state_kind.as_str(),
            self.has_error,
            self.exit_code,
            self.correction_cue,
            self.thanks_cue,
            self.success_cue
        );
        content_hash(&[
            request.as_bytes(),
            response.as_bytes(),
            next_state.as_bytes(),
            self.next_state_text.as_bytes(),
            features.as_bytes(),
        ])
    }

    /// Index of the last request message with role `user`, if any.
    pub fn last_user_index(&self) -> Option<usize> {
        self.request.iter().rposition(|m| m.role == "user")
    }

    /// Text of the last user message of the request, if any.
    pub fn last_user_request(&self) -> Option<&str> {
        self.last_user_index().map(|i| self.request[i].content.as_str())
    }

    /// The text of the next-state messages with role `user`, joined by a blank line (empty when
    /// there are none). Falls back to `next_state_text` when the next state is a user reply given only
    /// as text.
    pub fn next_user_text(&self) -> String {
        let parts: Vec<&str> = self
            .next_state
            .iter()
            .filter(|m| m.role == "user")
            .map(|m| m.content.trim())
            .filter(|s| !s.is_empty())
            .collect();
        if parts.is_empty() && self.next_state_kind == NextStateKind::User {
            return self.next_state_text.trim().to_string();
        }
        parts.join("\n\n")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::schema::ToolCall;

    /// The messages of the mini-swe-agent log in `tests/fixtures/agent-logs` (a real claude-sonnet-4
    /// run: system, task, then assistant commands and the shell's answers as role `user`), as text.
    pub(crate) fn mini_swe_agent_messages() -> Vec<Message> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/agent-logs/mini-swe-agent__claude-sonnet-4__test_output.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let log: serde_json::Value = serde_json::from_str(&text).unwrap();
        log["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::text(m["role"].as_str().unwrap(), m["content"].as_str().unwrap_or("")))
            .collect()
    }

    /// A turn with the given request, response text, next-state kind/text and no features set.
    pub(crate) fn turn(request: Vec<Message>, response: &str, kind: NextStateKind, next: &str) -> TurnContext {
        let role = match kind {
            NextStateKind::Tool => "tool",
            _ => "user",
        };
        TurnContext {
            interaction_id: "i1".into(),
            session_id: "s1".into(),
            tenant: None,
            turn_index: 0,
            policy_version: Some(3),
            event_time: 1_700_000_000_000,
            request,
            response: Message::text("assistant", response),
            next_state: if kind == NextStateKind::None { vec![] } else { vec![Message::text(role, next)] },
            next_state_kind: kind,
            next_state_text: next.into(),
            has_error: false,
            exit_code: None,
            correction_cue: false,
            thanks_cue: false,
            success_cue: false,
        }
    }

    pub(crate) fn interaction(id: &str, request: &[Message]) -> Interaction {
        let call = ToolCall { id: Some("c1".into()), name: "bash".into(), arguments: serde_json::json!({"cmd": "ls"}), arguments_raw: None };
        Interaction {
            interaction_id: id.into(),
            policy_version: Some(7),
            tool_calls: Some(serde_json::to_string(&vec![call]).unwrap()),
            finish_reason: Some("tool_calls".into()),
            prompt_token_ids: Some(vec![1, 2, 3]),
            response_token_ids: Some(vec![4, 5]),
            rollout_logprobs: Some(vec![-0.5, -0.25]),
            source_format: "proxy".into(),
            source_topic: Some("interactions".into()),
            source_partition: Some(1),
            source_offset: Some(42),
            ingest_time: 1_700_000_000_500,
            ..Interaction::new("s1", 2, &serde_json::to_string(request).unwrap(), "ls", 1_700_000_000_000)
        }
    }

    pub(crate) fn signal(id: &str, next_state: &str) -> Signal {
        Signal {
            schema_version: 1,
            interaction_id: id.into(),
            session_id: "s1".into(),
            tenant: None,
            turn_index: 2,
            policy_version: Some(7),
            kind: NextStateKind::Tool,
            next_state: next_state.into(),
            next_state_text: "file.txt".into(),
            next_interaction_id: None,
            excluded_reason: None,
            has_error: false,
            exit_code: Some(0),
            correction_cue: false,
            thanks_cue: false,
            success_cue: true,
            source_topic: None,
            source_partition: None,
            source_offset: None,
            event_time: 1_700_000_000_000,
            processed_time: 1_700_000_001_000,
        }
    }

    #[test]
    fn from_rows_joins_and_parses() {
        let req = vec![Message::text("system", "be brief"), Message::text("user", "list files")];
        let ns = serde_json::to_string(&vec![Message::text("tool", "file.txt")]).unwrap();
        let t = TurnContext::from_rows(&interaction("a", &req), &signal("a", &ns)).unwrap();
        assert_eq!(t.request, req);
        assert_eq!(t.response.tool_calls.len(), 1);
        assert_eq!(t.response.tool_calls[0].name, "bash");
        assert_eq!(t.next_state, vec![Message::text("tool", "file.txt")]);
        assert_eq!(t.turn_index, 2);
        assert_eq!(t.policy_version, Some(7));
        assert_eq!(t.exit_code, Some(0));
        assert!(t.success_cue);
        assert_eq!(t.last_user_request(), Some("list files"));
        assert_eq!(t.last_user_index(), Some(1));
    }

    #[test]
    fn from_rows_rejects_mismatch_and_bad_json() {
        let req = vec![Message::text("user", "x")];
        let e = TurnContext::from_rows(&interaction("a", &req), &signal("b", "[]")).unwrap_err();
        assert!(e.to_string().contains("signal b paired with interaction a"), "{e}");
        let e = TurnContext::from_rows(&interaction("a", &req), &signal("a", "{not json")).unwrap_err();
        assert!(e.to_string().contains("next_state of signal a"), "{e}");
        let mut bad = interaction("a", &req);
        bad.request_messages = "{}".into();
        let e = TurnContext::from_rows(&bad, &signal("a", "[]")).unwrap_err();
        assert!(e.to_string().contains("request_messages of interaction a"), "{e}");
        // An empty next_state string is an empty message list, not an error.
        assert!(TurnContext::from_rows(&interaction("a", &req), &signal("a", "")).unwrap().next_state.is_empty());
    }

    #[test]
    fn content_hash_ignores_ids_but_not_content() {
        let a = turn(vec![Message::text("user", "q")], "r", NextStateKind::User, "thanks");
        let mut b = a.clone();
        b.interaction_id = "other".into();
        b.event_time = 5;
        assert_eq!(a.content_hash(), b.content_hash());
        b.next_state_text = "thanks!".into();
        assert_ne!(a.content_hash(), b.content_hash());
        let mut c = a.clone();
        c.has_error = true;
        assert_ne!(a.content_hash(), c.content_hash());
        assert_eq!(a.content_hash().len(), 32);
    }

    #[test]
    fn next_user_text_joins_user_messages() {
        let mut t = turn(vec![], "r", NextStateKind::User, "  fix the test  ");
        assert_eq!(t.next_user_text(), "fix the test");
        t.next_state.push(Message::text("tool", "ignored"));
        t.next_state.push(Message::text("user", "and lint"));
        assert_eq!(t.next_user_text(), "fix the test\n\nand lint");
        t.next_state.clear();
        assert_eq!(t.next_user_text(), "  fix the test  ".trim());
    }
}
