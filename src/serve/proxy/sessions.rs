//! The capture proxy's per-process session bookkeeping: session inference for requests without a
//! session id, turn counters and captured turn indices for sessions with one, and (Responses API)
//! the captured responses a later `previous_response_id` chains on. Pure code, unit-tested below.

use lru::LruCache;

use super::request::TurnMeta;
use crate::ingest::sessions::{lru_cache, SessionInferrer};
use crate::schema::Message;

/// Per-process session bookkeeping: inference for requests without a session id, turn counters
/// for sessions with one, and (Responses API) the responses later requests may chain on.
#[derive(Debug)]
pub struct Sessions {
    inferrer: SessionInferrer,
    counters: LruCache<String, i32>,
    /// Turn indices captured per session, as sorted disjoint half-open ranges (a session whose turns
    /// are numbered 0, 1, 2, ... holds one range).
    recorded: LruCache<String, Vec<(i32, i32)>>,
    /// Captured responses by response id: what each turn added to the conversation (its new input and
    /// its response) and the response it continued, so a chain is rebuilt by walking back.
    responses: LruCache<String, ResponseLink>,
}

/// One captured response of a `previous_response_id` chain.
#[derive(Debug, Clone)]
struct ResponseLink {
    /// The tenant whose request produced it: only its own requests chain on it.
    tenant: String,
    previous: Option<String>,
    added: Vec<Message>,
    session: String,
    inferred: bool,
    turn: i32,
}

/// The conversation a `previous_response_id` continues, rebuilt from the captured responses.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    /// The earlier turns' messages (instructions left out: they are not carried over a chain), each
    /// response included, oldest first.
    pub history: Vec<Message>,
    /// Session of the previous response.
    pub session: String,
    /// The previous response's session was inferred.
    pub inferred: bool,
    /// Turn index of the previous response.
    pub turn: i32,
    /// Where the chain's start is no longer known (forgotten, or never seen by this process): the id
    /// of the first missing response.
    pub missing: Option<String>,
    /// Where the walk back met a response it had already visited (an upstream that reused a response
    /// id): that id. The history holds the responses before it.
    pub cycle: Option<String>,
}

/// Most responses remembered for `previous_response_id` chains (each holds what its turn added to the
/// conversation; a request with `store: false` is not remembered: it cannot be chained on).
pub const MAX_CHAINED_RESPONSES: usize = 10_000;

/// The bookkeeping key of `tenant`'s session `session`: the id itself for the default tenant, else
/// the two joined by U+001F, so two tenants' sessions of one id count and record their turns apart.
fn scoped(tenant: &str, session: &str) -> String {
    crate::schema::tenant_session_key(Some(tenant), session)
}

/// Adds `turn` to sorted disjoint half-open `ranges`; false when it was already there.
fn insert_turn(ranges: &mut Vec<(i32, i32)>, turn: i32) -> bool {
    let i = ranges.partition_point(|&(_, end)| end < turn);
    if let Some(&(start, end)) = ranges.get(i) {
        if start <= turn && turn < end {
            return false;
        }
    }
    let end = turn.saturating_add(1);
    let joins_left = i < ranges.len() && ranges[i].1 == turn;
    if joins_left {
        ranges[i].1 = end;
        if i + 1 < ranges.len() && ranges[i + 1].0 == end {
            ranges[i].1 = ranges[i + 1].1;
            ranges.remove(i + 1);
        }
    } else if i < ranges.len() && ranges[i].0 == end {
        ranges[i].0 = turn;
    } else {
        ranges.insert(i, (turn, end));
    }
    true
}

impl Sessions {
    /// Remembers at most `capacity` turns for inference, `capacity` session counters and captured
    /// turn ranges, and at most min(`capacity`, [`MAX_CHAINED_RESPONSES`]) responses for chains (LRU).
    pub fn new(capacity: usize) -> Sessions {
        Sessions {
            inferrer: SessionInferrer::new(capacity),
            counters: lru_cache(capacity),
            recorded: lru_cache(capacity),
            responses: lru_cache(capacity.min(MAX_CHAINED_RESPONSES)),
        }
    }

    /// The conversation response `previous` ends, when this process captured it (None otherwise):
    /// the chain is walked back through [`Sessions::remember_response`]'s links until a response that
    /// continued none, one no longer remembered ([`Chain::missing`]) or one already visited (an
    /// upstream that reused an id: [`Chain::cycle`]). A response of another tenant than `tenant` is
    /// never chained on (None, as for a response this process did not capture): one tenant's
    /// conversation never enters another's request or session.
    pub fn chain(&mut self, previous: &str, tenant: &str) -> Option<Chain> {
        let first = self.responses.get(&previous.to_string()).filter(|l| l.tenant == tenant)?.clone();
        let mut parts = vec![first.added.clone()];
        let (mut missing, mut cycle) = (None, None);
        let mut seen: std::collections::HashSet<String> = std::iter::once(previous.to_string()).collect();
        let mut at = first.previous.clone();
        while let Some(id) = at {
            if !seen.insert(id.clone()) {
                cycle = Some(id);
                break;
            }
            match self.responses.get(&id) {
                Some(link) => {
                    parts.push(link.added.clone());
                    at = link.previous.clone();
                }
                None => {
                    missing = Some(id);
                    break;
                }
            }
        }
        let history = parts.into_iter().rev().flatten().collect();
        Some(Chain { history, session: first.session, inferred: first.inferred, turn: first.turn, missing, cycle })
    }

    /// Remembers a captured response `id` for requests that chain on it: the response it continued,
    /// what its turn added (input after the chained history, without instructions, then the
    /// response), and where it was placed.
    /// A response that names itself as its previous one is not remembered. `tenant`: the request's.
    #[allow(clippy::too_many_arguments)]
    pub fn remember_response(&mut self, tenant: &str, id: &str, previous: Option<String>, added: Vec<Message>, session: &str, inferred: bool, turn: i32) {
        if previous.as_deref() == Some(id) {
            return;
        }
        self.responses.put(id.to_string(), ResponseLink { tenant: tenant.to_string(), previous, added, session: session.to_string(), inferred, turn });
    }

    /// True when turn `turn` of `tenant`'s `session` was already captured (recorded with
    /// [`Sessions::record`]) by this process (forgotten once the session falls out of the LRU or the
    /// proxy restarts).
    pub fn is_recorded(&mut self, tenant: &str, session: &str, turn: i32) -> bool {
        let key = scoped(tenant, session);
        self.recorded.get(&key).is_some_and(|r| r.iter().any(|&(a, b)| a <= turn && turn < b))
    }

    /// Marks turn `turn` of `tenant`'s `session` captured; false when it already was (a duplicate turn).
    pub fn record(&mut self, tenant: &str, session: &str, turn: i32) -> bool {
        let key = scoped(tenant, session);
        let mut ranges = self.recorded.get(&key).cloned().unwrap_or_default();
        let fresh = insert_turn(&mut ranges, turn);
        if fresh {
            self.recorded.put(key, ranges);
        }
        fresh
    }

    /// Session id, inferred flag and turn index of a finished turn. Explicit sessions: the explicit
    /// turn index, else the count of turns (main and side) this process has seen in the session;
    /// inferred sessions: the inferrer's index (assistant messages in the request).
    pub fn assign(&mut self, meta: &TurnMeta, request: &[Message], response: &Message) -> (String, bool, i32) {
        self.assign_chained(meta, None, request, response)
    }

    /// [`Sessions::assign`] for a request that continues response `chain` (Responses API): without
    /// an explicit session it joins the chain's session (keeping its inferred flag) as its next turn
    /// — the count of that session's turns seen, at least the previous response's index + 1.
    ///
    /// Inference is scoped by tenant: a conversation of one tenant never continues another tenant's
    /// inferred session, however alike their messages (the `default` tenant's ids are those of an
    /// unscoped inferrer). Explicit session ids are taken as given, whatever the tenant.
    pub fn assign_chained(&mut self, meta: &TurnMeta, chain: Option<&Chain>, request: &[Message], response: &Message) -> (String, bool, i32) {
        let scope = if meta.tenant == crate::schema::DEFAULT_TENANT { "" } else { meta.tenant.as_str() };
        if let (None, Some(c)) = (&meta.session_id, chain) {
            let key = scoped(&meta.tenant, &c.session);
            let seen = self.counters.get(&key).copied().unwrap_or(0).max(c.turn.saturating_add(1));
            let index = meta.turn_index.unwrap_or(seen);
            self.counters.put(key, seen.max(index.saturating_add(1)));
            self.inferrer.record_in(scope, &c.session, request, response);
            return (c.session.clone(), c.inferred, index);
        }
        match &meta.session_id {
            Some(id) => {
                let key = scoped(&meta.tenant, id);
                let seen = self.counters.get(&key).copied().unwrap_or(0);
                let index = meta.turn_index.unwrap_or(seen);
                self.counters.put(key, seen.max(index.saturating_add(1)));
                // A later request of this conversation without the header still finds the session.
                self.inferrer.record_in(scope, id, request, response);
                (id.clone(), false, index)
            }
            None => {
                let inf = self.inferrer.assign_in(scope, request, response);
                let index = meta.turn_index.unwrap_or(inf.turn_index);
                let key = scoped(&meta.tenant, &inf.session_id);
                let seen = self.counters.get(&key).copied().unwrap_or(0);
                self.counters.put(key, seen.max(index.saturating_add(1)));
                (inf.session_id, true, index)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::TurnType;

    fn m(role: &str, c: &str) -> Message {
        Message::text(role, c)
    }

    #[test]
    fn recorded_turns_are_kept_as_merged_ranges() {
        let mut r = vec![];
        for (turn, fresh, want) in [
            (0, true, vec![(0, 1)]),
            (1, true, vec![(0, 2)]),
            (1, false, vec![(0, 2)]),
            (5, true, vec![(0, 2), (5, 6)]),
            (3, true, vec![(0, 2), (3, 4), (5, 6)]),
            (4, true, vec![(0, 2), (3, 6)]),
            (2, true, vec![(0, 6)]),
            (5, false, vec![(0, 6)]),
            (9, true, vec![(0, 6), (9, 10)]),
            (8, true, vec![(0, 6), (8, 10)]),
        ] {
            assert_eq!(insert_turn(&mut r, turn), fresh, "turn {turn}");
            assert_eq!(r, want, "after turn {turn}");
        }
        let mut s = Sessions::new(2);
        assert!(s.record("default", "a", 0) && !s.record("default", "a", 0) && s.is_recorded("default", "a", 0) && !s.is_recorded("default", "a", 1) && !s.is_recorded("default", "b", 0));
        assert!(!s.is_recorded("alice", "a", 0) && s.record("alice", "a", 0), "another tenant's session of the same id");
    }

    #[test]
    fn explicit_sessions_count_turns_and_honour_explicit_indices() {
        let mut s = Sessions::new(100);
        let meta = |idx| TurnMeta { session_id: Some("s".into()), turn_type: TurnType::Main, session_done: false, turn_index: idx, tenant: "default".into() };
        let r = vec![m("user", "a")];
        assert_eq!(s.assign(&meta(None), &r, &m("assistant", "b")), ("s".into(), false, 0));
        assert_eq!(s.assign(&meta(None), &r, &m("assistant", "b")), ("s".into(), false, 1));
        assert_eq!(s.assign(&meta(Some(7)), &r, &m("assistant", "b")), ("s".into(), false, 7));
        assert_eq!(s.assign(&meta(None), &r, &m("assistant", "b")), ("s".into(), false, 8));
        // A continuation without the header joins the explicit session.
        let none = TurnMeta { session_id: None, ..meta(None) };
        let r2 = vec![m("user", "a"), m("assistant", "b"), m("user", "c")];
        assert_eq!(s.assign(&none, &r2, &m("assistant", "d")), ("s".into(), true, 1));
    }

    /// Issue 41: two tenants whose conversations are alike (greedy answers to the same opener) get two
    /// inferred sessions, and each continuation joins its own tenant's; the `default` tenant's ids
    /// are those of an unscoped inferrer.
    #[test]
    fn inference_never_joins_two_tenants_conversations() {
        let mut s = Sessions::new(100);
        let as_tenant = |t: &str| TurnMeta { session_id: None, turn_type: TurnType::Main, session_done: false, turn_index: None, tenant: t.into() };
        let (r1, a1) = (vec![m("user", "hi")], m("assistant", "hello"));
        let (alice, _, _) = s.assign(&as_tenant("alice"), &r1, &a1);
        let (bob, _, _) = s.assign(&as_tenant("bob"), &r1, &a1);
        let (default, _, _) = s.assign(&as_tenant("default"), &r1, &a1);
        assert_ne!(alice, bob);
        assert_eq!(default, crate::ingest::sessions::SessionInferrer::new(10).assign(&r1, &a1).session_id);
        let r2 = vec![m("user", "hi"), m("assistant", "hello"), m("user", "more")];
        assert_eq!(s.assign(&as_tenant("bob"), &r2, &m("assistant", "x")), (bob, true, 1));
        assert_eq!(s.assign(&as_tenant("alice"), &r2, &m("assistant", "x")), (alice, true, 1));
        assert_eq!(s.assign(&as_tenant("default"), &r2, &m("assistant", "x")), (default, true, 1));
    }

    #[test]
    fn response_chains_are_rebuilt_and_continue_their_session() {
        let mut s = Sessions::new(100);
        s.remember_response("default", "r1", None, vec![m("user", "a"), m("assistant", "b")], "inferred-x", true, 0);
        s.remember_response("default", "r2", Some("r1".into()), vec![m("user", "c"), m("assistant", "d")], "inferred-x", true, 1);
        assert!(s.chain("r2", "bob").is_none(), "another tenant's response is never chained on");
        let c = s.chain("r2", "default").unwrap();
        let texts: Vec<&str> = c.history.iter().map(|x| x.content.as_str()).collect();
        assert_eq!(texts, ["a", "b", "c", "d"]);
        assert_eq!((c.session.as_str(), c.inferred, c.turn, c.missing.as_deref()), ("inferred-x", true, 1, None));
        // Without a session header the chained request is the session's next turn, inferred as before.
        let none = TurnMeta { session_id: None, turn_type: TurnType::Main, session_done: false, turn_index: None, tenant: "default".into() };
        assert_eq!(s.assign_chained(&none, Some(&c), &[m("user", "e")], &m("assistant", "f")), ("inferred-x".into(), true, 2));
        // A branch from the same response is a further turn, not the same one.
        assert_eq!(s.assign_chained(&none, Some(&c), &[m("user", "e2")], &m("assistant", "f2")), ("inferred-x".into(), true, 3));
        // A link this process never saw: the history starts after it.
        s.remember_response("default", "r9", Some("r-gone".into()), vec![m("user", "x"), m("assistant", "y")], "s", false, 4);
        let c = s.chain("r9", "default").unwrap();
        assert_eq!((c.history.len(), c.missing.as_deref()), (2, Some("r-gone")));
        assert!(s.chain("r-unknown", "default").is_none());
        // Reused ids: a self-reference is not remembered, a loop ends the walk with a note's worth.
        s.remember_response("default", "r5", Some("r5".into()), vec![m("user", "z")], "s", false, 0);
        assert!(s.chain("r5", "default").is_none());
        s.remember_response("default", "ra", Some("rb".into()), vec![m("user", "a")], "s", false, 1);
        s.remember_response("default", "rb", Some("ra".into()), vec![m("user", "b")], "s", false, 0);
        let c = s.chain("ra", "default").unwrap();
        assert_eq!((c.history.len(), c.cycle.as_deref(), c.missing.as_deref()), (2, Some("ra"), None));
    }
}
