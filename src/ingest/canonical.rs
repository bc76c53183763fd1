//! Canonical form of chat messages for content comparison (session inference, next-state pairing).
//!
//! A logged response and the same assistant message echoed back in the next request differ
//! trivially in real logs, so messages are compared on a canonical form that keeps only what the
//! conversation *is*:
//! - the role (already normalised: `developer` → `system`, `function` → `tool`);
//! - the visible content with leading and trailing whitespace trimmed (null and `""` are equal;
//!   clients often strip the trailing newline of an echoed answer);
//! - for each tool call, in order: its name and its arguments — the parsed JSON value serialised with
//!   sorted object keys (so `{"a":1,"b":2}` equals `{ "b": 2, "a": 1 }`), or the raw string when the
//!   arguments did not parse.
//!
//! Left out on purpose: reasoning (servers strip it from the echoed message), tool-call ids and
//! `tool_call_id` (clients regenerate them; tau-bench repeats them), the tool `name` on tool messages
//! (not always echoed).
//!
//! Each message hashes to 16 bytes (sha256, truncated); a list of messages hashes as a chain
//! `P_k = sha256(P_{k-1} ‖ h(m_k))`, so every prefix of a request has its own key, computed in one pass.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::schema::Message;

/// A 128-bit content key (truncated sha256).
pub type Key = [u8; 16];

/// Writes `v` as JSON with object keys sorted (recursively), independent of serde_json's map order.
pub fn canonical_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                if let Some(x) = m.get(*k) {
                    canonical_json(x, out);
                }
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The 16-byte canonical hash of one message (see the module doc for what it covers).
pub fn message_key(m: &Message) -> Key {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(m.role.as_bytes());
    field(m.content.trim().as_bytes());
    field(&(m.tool_calls.len() as u64).to_le_bytes());
    let mut buf = String::new();
    for tc in &m.tool_calls {
        field(tc.name.as_bytes());
        buf.clear();
        match (&tc.arguments, &tc.arguments_raw) {
            (Value::Null, Some(raw)) => {
                buf.push_str("raw:");
                buf.push_str(raw);
            }
            (v, _) => canonical_json(v, &mut buf),
        }
        field(buf.as_bytes());
    }
    truncate(h.finalize().as_slice())
}

fn truncate(d: &[u8]) -> Key {
    let mut k = [0u8; 16];
    k.copy_from_slice(&d[..16]);
    k
}

/// Chains a prefix key with the next message key.
pub fn chain(prefix: &Key, next: &Key) -> Key {
    let mut h = Sha256::new();
    h.update(prefix);
    h.update(next);
    truncate(h.finalize().as_slice())
}

/// The key of the empty prefix.
pub const EMPTY_PREFIX: Key = [0u8; 16];

/// Prefix keys of `messages`: element `k` is the key of `messages[..=k]` (so the result has one key
/// per message; the empty prefix is [`EMPTY_PREFIX`]).
pub fn prefix_keys(messages: &[Message]) -> Vec<Key> {
    let mut out = Vec::with_capacity(messages.len());
    let mut p = EMPTY_PREFIX;
    for m in messages {
        p = chain(&p, &message_key(m));
        out.push(p);
    }
    out
}

/// Key of `messages` followed by `last` (a request plus its response).
pub fn continuation_key(messages: &[Message], last: &Message) -> Key {
    let p = prefix_keys(messages).last().copied().unwrap_or(EMPTY_PREFIX);
    chain(&p, &message_key(last))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::ToolCall;
    use serde_json::json;

    fn call(args: Value, raw: Option<&str>, id: &str) -> ToolCall {
        ToolCall { id: Some(id.into()), name: "f".into(), arguments: args, arguments_raw: raw.map(str::to_string) }
    }

    #[test]
    fn trivial_differences_do_not_change_the_key() {
        let logged = Message {
            reasoning: Some("thinking".into()),
            tool_calls: vec![call(json!({"a": 1, "b": [1, {"y": 2, "x": 1}]}), Some("{\"a\":1,\"b\":[1,{\"y\":2,\"x\":1}]}"), "call_1")],
            ..Message::text("assistant", "Sure.\n")
        };
        let echoed = Message {
            tool_calls: vec![call(json!({"b": [1, {"x": 1, "y": 2}], "a": 1}), None, "call_9")],
            ..Message::text("assistant", "Sure.")
        };
        assert_eq!(message_key(&logged), message_key(&echoed));
    }

    #[test]
    fn real_differences_change_the_key() {
        let a = Message::text("assistant", "yes");
        assert_ne!(message_key(&a), message_key(&Message::text("assistant", "no")));
        assert_ne!(message_key(&a), message_key(&Message::text("user", "yes")));
        let with_call = Message { tool_calls: vec![call(json!({"a": 1}), None, "x")], ..a.clone() };
        assert_ne!(message_key(&a), message_key(&with_call));
        let other_args = Message { tool_calls: vec![call(json!({"a": 2}), None, "x")], ..a.clone() };
        assert_ne!(message_key(&with_call), message_key(&other_args));
    }

    #[test]
    fn null_and_empty_content_are_equal() {
        let a: Message = serde_json::from_value(json!({"role": "assistant", "content": ""})).unwrap();
        let b: Message = serde_json::from_value(json!({"role": "assistant"})).unwrap();
        assert_eq!(message_key(&a), message_key(&b));
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let mut s = String::new();
        canonical_json(&json!({"b": 1, "a": {"d": null, "c": "x\"y"}}), &mut s);
        assert_eq!(s, r#"{"a":{"c":"x\"y","d":null},"b":1}"#);
    }

    #[test]
    fn prefix_keys_chain() {
        let ms = vec![Message::text("user", "a"), Message::text("assistant", "b"), Message::text("user", "c")];
        let p = prefix_keys(&ms);
        assert_eq!(p.len(), 3);
        assert_eq!(p[1], continuation_key(&ms[..1], &ms[1]));
        assert_eq!(prefix_keys(&ms[..2])[..], p[..2]);
        assert_ne!(p[0], p[1]);
    }
}
