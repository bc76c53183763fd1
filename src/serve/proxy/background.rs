//! Background responses of the OpenAI Responses API (`background: true`): the upstream answers the
//! create call at once with a response whose `status` is `queued` or `in_progress`, and the client
//! fetches the finished response later (`GET /v1/responses/{id}`, plain or `?stream=true`). The
//! proxy keeps the request side of each such turn here, by response id, until a fetch or a cancel
//! (`POST /v1/responses/{id}/cancel`) returns a finished response: then the turn is recorded as any
//! other ([`super::state::capture`]). Pure bookkeeping, unit-tested below.
//!
//! Bounded: at most [`MAX_BACKGROUND_RESPONSES`] pending turns (least recently held or polled first
//! out); a pending turn pushed out is counted (`turns_total{outcome="background_forgotten"}`), and a
//! later fetch of it is passed through unrecorded. A proxy restart forgets every pending turn.

use lru::LruCache;

use super::capture::TurnRequest;
use crate::ingest::sessions::lru_cache;
use crate::serve::reload::ServerVersion;

/// Most background turns waiting for their response (each holds its request's conversation).
pub const MAX_BACKGROUND_RESPONSES: usize = 1_000;

/// The request side of a background turn, kept until its response is finished.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The turn's request, as for a turn answered at once.
    pub req: TurnRequest,
    /// The reloader's record of the upstream when the create call was sent
    /// ([`super::ProxyOptions::upstream_versions`]).
    pub reloads_before: Option<ServerVersion>,
}

/// The background turns of one proxy process, by upstream response id.
#[derive(Debug)]
pub struct Background {
    pending: LruCache<String, Pending>,
}

/// Whether a Responses API response object is a background response still running: `status` is
/// `queued` or `in_progress` and it has a string `id`, which is returned.
pub fn running_id(v: &serde_json::Value) -> Option<&str> {
    let running = matches!(v.get("status").and_then(serde_json::Value::as_str), Some("queued" | "in_progress"));
    running.then(|| v.get("id").and_then(serde_json::Value::as_str)).flatten().filter(|id| !id.is_empty())
}

/// The response id of a stored-response path: `/v1/responses/{id}` → (`id`, false) and
/// `/v1/responses/{id}/cancel` → (`id`, true); None for any other path (`input_items` included).
pub fn fetched_id(path: &str) -> Option<(&str, bool)> {
    let rest = path.strip_prefix("/v1/responses/")?;
    match rest.split_once('/') {
        None if !rest.is_empty() => Some((rest, false)),
        Some((id, "cancel")) if !id.is_empty() => Some((id, true)),
        _ => None,
    }
}

impl Background {
    /// Holds at most min(`capacity`, [`MAX_BACKGROUND_RESPONSES`]) pending turns (at least 1).
    pub fn new(capacity: usize) -> Background {
        Background { pending: lru_cache(capacity.clamp(1, MAX_BACKGROUND_RESPONSES)) }
    }

    /// Holds `p` until response `id` is finished. Returns the id of the pending turn pushed out to make
    /// room (the least recently used), if one was; holding an id again replaces its turn and pushes
    /// nothing out.
    pub fn hold(&mut self, id: &str, p: Pending) -> Option<String> {
        match self.pending.push(id.to_string(), p) {
            Some((old, _)) if old != id => Some(old),
            _ => None,
        }
    }

    /// Whether response `id` is a pending turn (marks it recently used).
    pub fn is_pending(&mut self, id: &str) -> bool {
        self.pending.get(id).is_some()
    }

    /// Takes response `id`'s pending turn: only one fetch records it.
    pub fn take(&mut self, id: &str) -> Option<Pending> {
        self.pending.pop(id)
    }

    /// Number of pending turns.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// No pending turn.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::serve::proxy::request::TurnMeta;

    fn pending(model: &str) -> Pending {
        let req = TurnRequest {
            meta: TurnMeta { session_id: None, turn_type: crate::schema::TurnType::Main, session_done: false, turn_index: None, tenant: "default".into() },
            messages: vec![],
            notes: vec![],
            raw_messages: serde_json::Value::Null,
            remember: true,
            previous: None,
            input_start: 0,
            tools: None,
            model: Some(model.into()),
            received_ms: 0,
        };
        Pending { req, reloads_before: None }
    }

    #[test]
    fn running_responses_and_fetch_paths() {
        assert_eq!(running_id(&json!({"id": "resp_1", "status": "queued", "background": true})), Some("resp_1"));
        assert_eq!(running_id(&json!({"id": "resp_1", "status": "in_progress"})), Some("resp_1"));
        for done in ["completed", "incomplete", "failed", "cancelled"] {
            assert_eq!(running_id(&json!({"id": "resp_1", "status": done})), None, "{done}");
        }
        assert_eq!(running_id(&json!({"status": "queued"})), None, "no id: nothing to fetch later");
        assert_eq!(running_id(&json!({"id": "", "status": "queued"})), None);
        assert_eq!(fetched_id("/v1/responses/resp_1"), Some(("resp_1", false)));
        assert_eq!(fetched_id("/v1/responses/resp_1/cancel"), Some(("resp_1", true)));
        assert_eq!(fetched_id("/v1/responses/resp_1/input_items"), None);
        assert_eq!(fetched_id("/v1/responses/"), None);
        assert_eq!(fetched_id("/v1/messages/count_tokens"), None);
    }

    #[test]
    fn holds_takes_once_and_pushes_out_the_least_recently_used() {
        let mut b = Background::new(2);
        assert_eq!(b.hold("a", pending("m1")), None);
        assert_eq!(b.hold("b", pending("m2")), None);
        assert_eq!(b.hold("b", pending("m3")), None, "the same id again replaces, pushes nothing out");
        assert!(b.is_pending("a"), "a polled: now the most recent");
        assert_eq!(b.hold("c", pending("m4")), Some("b".to_string()));
        assert_eq!(b.len(), 2);
        assert_eq!(b.take("a").and_then(|p| p.req.model), Some("m1".to_string()));
        assert!(b.take("a").is_none(), "taken once");
        assert!(!b.is_pending("b"));
        assert_eq!(Background::new(0).hold("x", pending("m")), None, "capacity 0 still holds one");
        assert_eq!(Background::new(usize::MAX).pending.cap().get(), MAX_BACKGROUND_RESPONSES);
    }
}
