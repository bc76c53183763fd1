//! A finished turn as the capture proxy records it: the request side kept until the response is
//! known ([`TurnRequest`]) and what the pair becomes ([`Captured`]): the [`Interaction`] row
//! (docs/method.md §1), with session and turn index from [`Sessions`] and validated tokens, or a dead
//! letter. Pure code, unit-tested below.

use serde_json::{json, Value};

use super::request::TurnMeta;
use super::response::Completed;
use super::sessions::{Chain, Sessions};
use super::tokens::{validate_tokens, TokenCapture};
use crate::schema::{now_ms, DeadLetter, Interaction, Lineage, Message, Table};

/// The request side of a turn, kept until its response is known.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    /// Turn metadata.
    pub meta: TurnMeta,
    /// The conversation, normalised (for a chained Responses request: the chain's history, then
    /// this request's instructions and input).
    pub messages: Vec<Message>,
    /// What normalisation noticed.
    pub notes: Vec<String>,
    /// The conversation as the client sent it (chat: `messages`; the other APIs: the whole body), for
    /// dead letters.
    pub raw_messages: Value,
    /// Remember the response for `previous_response_id` chains (Responses requests without `store:
    /// false`).
    pub remember: bool,
    /// Responses API: the response this request continues, and the chain rebuilt from it (None when
    /// this process did not capture it).
    pub previous: Option<(String, Option<Chain>)>,
    /// Index in [`TurnRequest::messages`] where this request's own input starts (after the chained
    /// history and the instructions).
    pub input_start: usize,
    /// Tool definitions.
    pub tools: Option<Value>,
    /// Requested model.
    pub model: Option<String>,
    /// When the request arrived (ms since epoch): the row's `event_time`.
    pub received_ms: i64,
}

/// What a finished turn becomes.
#[derive(Debug, Clone)]
pub enum Captured {
    /// The turn's row, and what its tokens looked like.
    Turn(Box<Interaction>, TokenCapture),
    /// The turn could not be recorded as an interaction (e.g. an unknown message role): its dead letter.
    Dead(Box<DeadLetter>),
}

fn dead(reason_code: &str, reason: String, req: &TurnRequest, resp: &Completed) -> Captured {
    let payload = json!({"messages": req.raw_messages, "response": resp.message, "session_id": req.meta.session_id}).to_string();
    let d = DeadLetter::new("proxy", reason_code, reason, payload.as_bytes(), Lineage::default())
        .with_keys(req.meta.session_id.as_deref().unwrap_or(""), None)
        .with_tenant(Some(&req.meta.tenant));
    Captured::Dead(Box::new(d))
}

/// The dead letter of a turn whose upstream response could not be recorded (stage `proxy`): the
/// request's messages and the first 64 KiB of the response (lossy UTF-8) as its payload.
pub fn dead_response(reason_code: &str, reason: String, req: &TurnRequest, response: &[u8]) -> DeadLetter {
    let head = String::from_utf8_lossy(&response[..response.len().min(64 << 10)]);
    let payload = json!({"messages": req.raw_messages, "response_head": head, "response_bytes": response.len(), "session_id": req.meta.session_id}).to_string();
    DeadLetter::new("proxy", reason_code, reason, payload.as_bytes(), Lineage::default())
        .with_keys(req.meta.session_id.as_deref().unwrap_or(""), None)
        .with_tenant(Some(&req.meta.tenant))
}

/// Builds the `interactions` row of a finished turn (docs/method.md §1): normalised request messages, the
/// response's text, reasoning and tool calls, validated token ids and log-probs, session and turn
/// index from `sessions`, `source_format = "proxy"`. `header_version` is the upstream's
/// `X-Policy-Version` header (used when the body has no `policy_version`).
pub fn build_interaction(req: &TurnRequest, resp: &Completed, header_version: Option<i64>, sessions: &std::sync::Mutex<Sessions>) -> Captured {
    let messages = &req.messages;
    let mut notes: Vec<String> = req.notes.clone();
    if let Some((p, chain)) = &req.previous {
        match chain {
            None => notes.push(format!("previous response {p:?} was not captured by this proxy process: the conversation starts at this request's input")),
            Some(Chain { missing: Some(m), .. }) => notes.push(format!("the chain of previous responses is known back to {m:?} only: the conversation starts there")),
            Some(Chain { cycle: Some(m), .. }) => notes.push(format!("the chain of previous responses loops at {m:?} (a reused response id): the conversation starts there")),
            Some(_) => {}
        }
    }
    notes.extend(resp.notes.iter().cloned());
    if resp.n_choices > 1 {
        notes.push(format!("{} choices returned; recorded choice 0", resp.n_choices));
    }
    let tokens = validate_tokens(resp.prompt_token_ids.as_ref(), resp.token_ids.as_ref(), resp.logprobs.as_deref());
    notes.extend(tokens.notes.iter().cloned());
    let msg = &resp.message;
    let (session_id, session_inferred, turn_index, fresh) = {
        let mut s = sessions.lock().unwrap_or_else(|p| p.into_inner());
        let chain = req.previous.as_ref().and_then(|(_, c)| c.as_ref());
        let (id, inferred, turn) = s.assign_chained(&req.meta, chain, messages, msg);
        let fresh = s.record(&req.meta.tenant, &id, turn);
        if let (true, true, Some(rid)) = (fresh, req.remember, &resp.response_id) {
            let mut added: Vec<Message> = messages[req.input_start.min(messages.len())..].to_vec();
            added.push(msg.clone());
            s.remember_response(&req.meta.tenant, rid, req.previous.as_ref().map(|(p, _)| p.clone()), added, &id, inferred, turn);
        }
        (id, inferred, turn, fresh)
    };
    if !fresh {
        let reason = format!("turn {turn_index} of session {session_id:?} was already captured by this proxy; the client got its answer, this copy is not recorded");
        return dead("duplicate_turn", reason, req, resp);
    }
    let request_messages = serde_json::to_string(messages).unwrap_or_else(|_| "[]".into());
    let tool_calls = if msg.tool_calls.is_empty() { None } else { serde_json::to_string(&msg.tool_calls).ok() };
    let interaction_id = Interaction::compute_id_for(&req.meta.tenant, &session_id, turn_index, &request_messages, &msg.content, tool_calls.as_deref());
    let now = now_ms();
    let row = Interaction {
        schema_version: Interaction::SCHEMA_VERSION,
        interaction_id,
        session_id,
        tenant: Some(req.meta.tenant.clone()),
        session_inferred,
        turn_index,
        turn_type: req.meta.turn_type,
        session_done: req.meta.session_done,
        policy_version: resp.policy_version.or(header_version),
        model: resp.model.clone().or_else(|| req.model.clone()),
        request_messages,
        tools: req.tools.as_ref().map(Value::to_string),
        response_text: msg.content.clone(),
        reasoning_text: msg.reasoning.clone(),
        tool_calls,
        truncated: resp.truncated || resp.finish_reason.as_deref() == Some("length"),
        finish_reason: resp.finish_reason.clone(),
        prompt_text: None,
        prompt_token_ids: tokens.prompt_ids.clone(),
        response_token_ids: tokens.response_ids.clone(),
        rollout_logprobs: tokens.logprobs.clone(),
        next_state: None,
        outcome_reward: None,
        notes,
        source_format: "proxy".into(),
        source_topic: None,
        source_partition: None,
        source_offset: None,
        source_file: None,
        source_line: None,
        event_time: req.received_ms,
        ingest_time: now,
    };
    Captured::Turn(Box::new(row), tokens)
}


#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};
    use crate::schema::TurnType;
    use crate::serve::proxy::apis::Api;
    use crate::serve::proxy::request::{prepare_request, RewriteOptions};

    fn opts() -> RewriteOptions {
        RewriteOptions::new(TurnType::Main)
    }

    fn lp(x: f64) -> Value {
        json!({"token": "t", "logprob": x})
    }

    #[test]
    fn builds_an_interaction_from_a_response() {
        let sessions = std::sync::Mutex::new(Sessions::new(100));
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_static("sess"));
        h.insert("x-turn-type", HeaderValue::from_static("side"));
        h.insert("x-session-done", HeaderValue::from_static("1"));
        let body = json!({"model": "req-model", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]});
        let p = prepare_request(Api::ChatCompletions, &h, body.to_string().as_bytes(), &opts()).unwrap();
        let req = TurnRequest {
            meta: p.meta,
            messages: p.messages,
            notes: p.notes,
            raw_messages: p.raw_messages,
            remember: false,
            previous: None,
            input_start: 0,
            tools: p.tools,
            model: p.model,
            received_ms: 0,
        };
        let resp = Completed::from_response(&json!({
            "model": "m", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "<think>r</think>hello"},
                "finish_reason": "length", "token_ids": [9, 8], "logprobs": {"content": [lp(-0.5), lp(-0.25)]}}]
        }))
        .unwrap();
        let Captured::Turn(row, tokens) = build_interaction(&req, &resp, Some(4), &sessions) else { panic!("dead letter") };
        assert_eq!(tokens.kind(), "ids_and_logprobs");
        assert_eq!((row.session_id.as_str(), row.session_inferred, row.turn_index), ("sess", false, 0));
        assert_eq!((row.turn_type, row.session_done, row.policy_version), (TurnType::Side, true, Some(4)));
        assert_eq!(row.model.as_deref(), Some("m"));
        assert_eq!(row.response_text, "hello");
        assert_eq!(row.reasoning_text.as_deref(), Some("r"));
        assert!(row.truncated);
        assert_eq!(row.prompt_token_ids, Some(vec![1, 2]));
        assert_eq!(row.response_token_ids, Some(vec![9, 8]));
        assert_eq!(row.rollout_logprobs, Some(vec![-0.5, -0.25]));
        assert_eq!(row.notes, vec!["developer role mapped to system".to_string()]);
        assert_eq!(row.source_format, "proxy");
        assert_eq!(serde_json::from_str::<Value>(row.tools.as_deref().unwrap()).unwrap(), json!([{"type": "function", "function": {"name": "f"}}]));
        let msgs = row.messages().unwrap();
        assert_eq!((msgs[0].role.as_str(), msgs[1].content.as_str()), ("system", "hi"));
        assert_eq!(row.interaction_id, Interaction::compute_id("sess", 0, &row.request_messages, "hello", None));

        // The same turn again (an explicit session and index already captured): a duplicate.
        let again = TurnRequest { meta: TurnMeta { turn_index: Some(0), ..req.meta.clone() }, ..req };
        let Captured::Dead(d) = build_interaction(&again, &resp, None, &sessions) else { panic!("expected a dead letter") };
        assert_eq!((d.stage.as_str(), d.reason_code.as_str(), d.session_id.as_str()), ("proxy", "duplicate_turn", "sess"));
    }
}
