//! The tenant a log names (issue 41): a logged request's `X-Agent-Id` / `X-User-Id` header, else the
//! body's OpenAI `user` / `safety_identifier` or Anthropic `metadata.user_id`; `--tenant` replaces it;
//! a turn whose log names an invalid tenant is an `invalid_tenant` dead letter and the rest is read.

use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::schema::{DeadLetter, Interaction};

use super::common::INGEST_MS;

/// Reads `lines` written to a temporary `.jsonl` file as `format`, with `--tenant` = `tenant`.
fn read(format: Format, lines: &[serde_json::Value], tenant: Option<&str>) -> (Vec<Interaction>, Vec<DeadLetter>) {
    let f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    std::fs::write(f.path(), lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let mut opts = IngestOptions::new(INGEST_MS);
    opts.tenant = tenant.map(str::to_string);
    let (mut rows, mut dead) = (vec![], vec![]);
    read_file(f.path(), format, &opts, &mut |_| {}, &mut |item| {
        match item {
            IngestItem::Interaction(i) => rows.push(*i),
            IngestItem::DeadLetter(d) => dead.push(*d),
        }
        Ok(())
    })
    .unwrap();
    (rows, dead)
}

fn chat(session: &str, headers: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut request = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("question of {session}")}]});
    request.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let mut h = serde_json::json!({"X-Session-Id": session});
    h.as_object_mut().unwrap().extend(headers.as_object().unwrap().clone());
    serde_json::json!({"headers": h, "request": request,
        "response": {"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "an answer"}, "finish_reason": "stop"}]}})
}

fn tenants(rows: &[Interaction]) -> Vec<(String, String)> {
    rows.iter().map(|r| (r.session_id.clone(), r.tenant.clone().unwrap_or_default())).collect()
}

#[test]
fn the_tenant_the_log_names_is_read_and_an_invalid_one_is_a_dead_letter() {
    let lines = [
        chat("s1", serde_json::json!({"X-Agent-Id": "agent-7", "x-user-id": "bob"}), serde_json::json!({"user": "ann@example.com"})),
        chat("s2", serde_json::json!({"x-user-id": "bob"}), serde_json::json!({"user": "ann@example.com"})),
        chat("s3", serde_json::json!({}), serde_json::json!({"user": "  ", "safety_identifier": "hash-9f2"})),
        chat("s4", serde_json::json!({}), serde_json::json!({"user": "ann@example.com"})),
        chat("s5", serde_json::json!({}), serde_json::json!({"user": "Ann Smith"})),
        chat("s6", serde_json::json!({}), serde_json::json!({})),
        chat("s7", serde_json::json!({"X-Agent-Id": "agent 7"}), serde_json::json!({"user": "ann@example.com"})),
    ];
    let (rows, dead) = read(Format::OpenAiChat, &lines, None);
    // A body field that is not a tenant id (s5) leaves the turn to the default tenant, with a note.
    let want = [("s1", "agent-7"), ("s2", "bob"), ("s3", "hash-9f2"), ("s4", "ann@example.com"), ("s5", "default"), ("s6", "default")];
    assert_eq!(tenants(&rows), want.map(|(s, t)| (s.to_string(), t.to_string())).to_vec(), "headers first, then user, then safety_identifier");
    assert!(rows[4].notes.contains(&"the request's user is not a tenant: tenant id \"Ann Smith\" has the character ' ' at byte 3; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit".to_string()), "{:?}", rows[4].notes);
    // A header naming an invalid tenant is refused, as the proxy refuses it.
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].reason_code.as_str(), dead[0].session_id.as_str(), dead[0].source_line), ("invalid_tenant", "s7", Some(7)));
    assert_eq!(
        dead[0].reason,
        "turn 0 of session \"s7\": the log's tenant id \"agent 7\" has the character ' ' at byte 5; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit; `ingest --tenant NAME` sets the tenant of every turn instead"
    );
    // `--tenant` replaces whatever the log names, the invalid one included.
    let (rows, dead) = read(Format::OpenAiChat, &lines, Some("team-a"));
    assert_eq!((rows.len(), dead.len()), (7, 0));
    assert!(rows.iter().all(|r| r.tenant.as_deref() == Some("team-a")));
}

/// Claude Code puts a 120-character account-and-session id in `metadata.user_id`: not a tenant (it would
/// make every session a tenant of its own), so the turn is the default tenant's, with a note.
#[test]
fn a_client_librarys_long_user_id_is_not_a_tenant() {
    let id = format!("user_{}_account__session_{}", "a".repeat(64), "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0");
    let line = serde_json::json!({
        "request": {"model": "claude", "max_tokens": 64, "metadata": {"user_id": id}, "messages": [{"role": "user", "content": "hello"}]},
        "response": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn"}
    });
    let (rows, dead) = read(Format::AnthropicMessages, &[line], None);
    assert_eq!((rows.len(), dead.len()), (1, 0));
    assert_eq!(rows[0].tenant.as_deref(), Some("default"));
    assert!(rows[0].notes.iter().any(|n| n == "the request's metadata.user_id is not a tenant: tenant id is 123 bytes long; at most 64 are allowed"), "{:?}", rows[0].notes);
}

#[test]
fn anthropic_metadata_user_id_and_responses_user_name_the_tenant() {
    let messages = serde_json::json!({
        "request": {"model": "claude", "max_tokens": 64, "metadata": {"user_id": "u-42"}, "messages": [{"role": "user", "content": "hello"}]},
        "response": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn"}
    });
    let (rows, dead) = read(Format::AnthropicMessages, &[messages], None);
    assert_eq!((rows.len(), dead.len()), (1, 0), "{dead:?}");
    assert_eq!(rows[0].tenant.as_deref(), Some("u-42"));
    let responses = serde_json::json!({
        "request": {"model": "m", "user": "agent.blue", "input": "hello"},
        "response": {"id": "resp_1", "object": "response", "model": "m", "status": "completed",
            "output": [{"type": "message", "id": "m1", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}]}
    });
    let (rows, dead) = read(Format::OpenAiResponses, &[responses], None);
    assert_eq!((rows.len(), dead.len()), (1, 0), "{dead:?}");
    assert_eq!(rows[0].tenant.as_deref(), Some("agent.blue"));
}

/// Two users of one log whose conversations are alike (the same opener, the same greedy answer) get
/// two inferred sessions; each user's next request continues their own (issue 41).
#[test]
fn inferred_sessions_never_join_two_tenants() {
    let turn = |user: &str, messages: serde_json::Value, answer: &str| {
        serde_json::json!({"request": {"model": "m", "user": user, "messages": messages},
            "response": {"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}})
    };
    let first = serde_json::json!([{"role": "user", "content": "hi"}]);
    let second = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]);
    let lines = [turn("alice", first.clone(), "hello"), turn("bob", first, "hello"), turn("bob", second.clone(), "b2"), turn("alice", second, "a2")];
    let (rows, dead) = read(Format::OpenAiChat, &lines, None);
    assert!(dead.is_empty(), "{dead:?}");
    let got: Vec<(String, String, i32)> = rows.iter().map(|r| (r.tenant.clone().unwrap(), r.session_id.clone(), r.turn_index)).collect();
    let (a, b) = (&got[0].1, &got[1].1);
    assert_ne!(a, b, "alike openings of two users are two sessions");
    assert_eq!(got, vec![("alice".into(), a.clone(), 0), ("bob".into(), b.clone(), 0), ("bob".into(), b.clone(), 1), ("alice".into(), a.clone(), 1)]);
}

/// Two users of one log sending the same explicit session id have two sessions: each starts at turn 0,
/// neither turn is a duplicate of the other, and their ids differ even for the same words.
#[test]
fn one_session_id_of_two_tenants_is_two_sessions() {
    let lines = [chat("s", serde_json::json!({"X-Agent-Id": "alice"}), serde_json::json!({})), chat("s", serde_json::json!({"X-Agent-Id": "bob"}), serde_json::json!({}))];
    let (rows, dead) = read(Format::OpenAiChat, &lines, None);
    assert!(dead.is_empty(), "{dead:?}");
    let got: Vec<(String, i32)> = rows.iter().map(|r| (r.tenant.clone().unwrap(), r.turn_index)).collect();
    assert_eq!(got, vec![("alice".to_string(), 0), ("bob".to_string(), 0)]);
    assert_ne!(rows[0].interaction_id, rows[1].interaction_id, "the same words of two tenants are two rows");
    assert_eq!(rows[0].request_messages, rows[1].request_messages);
}
