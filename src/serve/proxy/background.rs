//! Background responses of the OpenAI Responses API (`background: true`): the upstream answers the
//! create call at once with a response whose `status` is `queued` or `in_progress`, and the client
//! fetches the finished response later (`GET /v1/responses/{id}`, plain or `?stream=true`). The
//! proxy keeps the request side of each such turn here, by response id, until a fetch or a cancel
//! (`POST /v1/responses/{id}/cancel`) returns a finished response: then the turn is recorded as any
//! other ([`super::state::capture`]). Pure bookkeeping, unit-tested below.
//!
//! Bounded: at most [`MAX_BACKGROUND_RESPONSES`] pending turns and [`MAX_BACKGROUND_BYTES`] of their
//! request bodies (least recently held or polled first out); a pending turn pushed out is counted
//! (`turns_total{outcome="background_forgotten"}`), and a later fetch of it is passed through
//! unrecorded. A proxy shutdown counts the turns still pending the same way; a restart forgets them.

use lru::LruCache;

use super::capture::TurnRequest;
use crate::ingest::sessions::lru_cache;
use crate::serve::reload::ServerVersion;

/// Most background turns waiting for their response (each holds its request's conversation).
pub const MAX_BACKGROUND_RESPONSES: usize = 1_000;

/// Most bytes of request bodies ([`Pending::bytes`]) held by pending background turns: 256 MiB.
pub const MAX_BACKGROUND_BYTES: usize = 256 << 20;

/// The request side of a background turn, kept until its response is finished.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The turn's request, as for a turn answered at once.
    pub req: TurnRequest,
    /// The reloader's record of the upstream when the create call was sent
    /// ([`super::ProxyOptions::upstream_versions`]).
    pub reloads_before: Option<ServerVersion>,
    /// The create call's `X-Policy-Version` header, if any: the turn's version when the fetch's header
    /// agrees or has none ([`version_of`]).
    pub header_version: Option<i64>,
    /// Size of the request's body (bytes), counted against [`MAX_BACKGROUND_BYTES`].
    pub bytes: usize,
}

/// The policy version header of a background turn from its create call's (`created`) and its fetch's
/// (`fetched`) `X-Policy-Version`: the create call's when the fetch's agrees or is absent; none when
/// they differ (the upstream reloaded in between, so which version generated the response is not known)
/// or the create call had none (a fetch's header says only what serves now).
pub fn version_of(created: Option<i64>, fetched: Option<i64>) -> Option<i64> {
    match (created, fetched) {
        (Some(a), Some(b)) => (a == b).then_some(a),
        (a, None) => a,
        (None, Some(_)) => None,
    }
}

/// The background turns of one proxy process, by upstream response id.
#[derive(Debug)]
pub struct Background {
    pending: LruCache<String, Pending>,
    /// Sum of the pending turns' [`Pending::bytes`].
    bytes: usize,
    max_bytes: usize,
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
    /// Holds at most min(`capacity`, [`MAX_BACKGROUND_RESPONSES`]) pending turns (at least 1) and
    /// [`MAX_BACKGROUND_BYTES`] of their bodies.
    pub fn new(capacity: usize) -> Background {
        Background::with_bytes(capacity, MAX_BACKGROUND_BYTES)
    }

    /// [`Background::new`] with a budget of `max_bytes` of request bodies (the newest turn is always
    /// held, whatever its size).
    pub fn with_bytes(capacity: usize, max_bytes: usize) -> Background {
        Background { pending: lru_cache(capacity.clamp(1, MAX_BACKGROUND_RESPONSES)), bytes: 0, max_bytes }
    }

    /// Holds `p` until response `id` is finished. Returns the ids of the pending turns pushed out to make
    /// room (least recently used first), by count or by bytes; holding an id again replaces its turn.
    pub fn hold(&mut self, id: &str, p: Pending) -> Vec<String> {
        self.bytes += p.bytes;
        let mut out = vec![];
        if let Some((old, replaced)) = self.pending.push(id.to_string(), p) {
            self.bytes -= replaced.bytes;
            if old != id {
                out.push(old);
            }
        }
        while self.bytes > self.max_bytes && self.pending.len() > 1 {
            let Some((old, p)) = self.pending.pop_lru() else { break };
            self.bytes -= p.bytes;
            out.push(old);
        }
        out
    }

    /// Whether response `id` is a pending turn (marks it recently used).
    pub fn is_pending(&mut self, id: &str) -> bool {
        self.pending.get(id).is_some()
    }

    /// Takes response `id`'s pending turn: only one fetch records it.
    pub fn take(&mut self, id: &str) -> Option<Pending> {
        let p = self.pending.pop(id)?;
        self.bytes -= p.bytes;
        Some(p)
    }

    /// Takes every pending turn's id (at shutdown: they are counted as forgotten).
    pub fn drain(&mut self) -> Vec<String> {
        self.bytes = 0;
        std::iter::from_fn(|| self.pending.pop_lru().map(|(id, _)| id)).collect()
    }

    /// Bytes of request bodies the pending turns hold.
    pub fn bytes(&self) -> usize {
        self.bytes
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
        sized(model, 10)
    }

    fn sized(model: &str, bytes: usize) -> Pending {
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
        Pending { req, reloads_before: None, header_version: None, bytes }
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
        let none: Vec<String> = vec![];
        let mut b = Background::new(2);
        assert_eq!(b.hold("a", pending("m1")), none);
        assert_eq!(b.hold("b", pending("m2")), none);
        assert_eq!(b.hold("b", pending("m3")), none, "the same id again replaces, pushes nothing out");
        assert_eq!(b.bytes(), 20);
        assert!(b.is_pending("a"), "a polled: now the most recent");
        assert_eq!(b.hold("c", pending("m4")), ["b"]);
        assert_eq!((b.len(), b.bytes()), (2, 20));
        assert_eq!(b.take("a").and_then(|p| p.req.model), Some("m1".to_string()));
        assert!(b.take("a").is_none(), "taken once");
        assert!(!b.is_pending("b"));
        assert_eq!((b.drain(), b.len(), b.bytes()), (vec!["c".to_string()], 0, 0));
        assert_eq!(Background::new(0).hold("x", pending("m")), none, "capacity 0 still holds one");
        assert_eq!(Background::new(usize::MAX).pending.cap().get(), MAX_BACKGROUND_RESPONSES);
    }

    #[test]
    fn the_byte_budget_pushes_out_the_oldest_but_keeps_the_newest() {
        let mut b = Background::with_bytes(10, 100);
        assert!(b.hold("a", sized("m", 40)).is_empty());
        assert!(b.hold("b", sized("m", 40)).is_empty());
        assert_eq!(b.hold("c", sized("m", 40)), ["a"], "120 > 100: the oldest goes");
        assert_eq!(b.bytes(), 80);
        assert_eq!(b.hold("d", sized("m", 500)), ["b", "c"], "a turn over the whole budget is still held, alone");
        assert_eq!((b.len(), b.bytes()), (1, 500));
    }

    #[test]
    fn the_version_is_known_only_when_create_and_fetch_agree() {
        assert_eq!(version_of(Some(3), Some(3)), Some(3));
        assert_eq!(version_of(Some(3), Some(4)), None, "reloaded in between");
        assert_eq!((version_of(Some(3), None), version_of(None, Some(4)), version_of(None, None)), (Some(3), None, None));
    }
}
