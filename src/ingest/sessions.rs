//! Session inference for requests that carry no session id (docs/method.md §1, "we differ": the reference
//! files them all under `unknown`).
//!
//! Rule: a request whose messages start with an earlier request's messages followed by that
//! request's response continues that request's session. Messages are compared on their canonical
//! form ([`super::canonical`]), so trivial differences between a logged response and its echo do not
//! break a session. Implementation: after each turn, the key of (request ++ response) is remembered
//! with its session id; a new request looks up the key of each of its prefixes that ends with an
//! assistant message, longest first. If none is known the request starts a new session whose id is
//! deterministic: `inferred-` + 16 hex digits of the hash of its first messages (up to and including
//! the first user message, with an optional salt such as the source file name); a second new
//! conversation with the same opening gets `-1`, `-2`, ... appended, in arrival order.
//!
//! The turn index of an inferred turn is the number of assistant messages in its request (0 for the
//! opening request), which does not depend on arrival order; two requests that continue the same turn
//! (a retry or a branch) get the same index.
//!
//! Bounded memory: both maps (continuation keys, opening counts) are LRU caches of at most `capacity`
//! entries each (about 150 bytes per entry: a 16-byte key, the id string, map overhead), so the default
//! [`DEFAULT_CAPACITY`] of 100,000 costs about 30 MB. A conversation idle for longer than it takes
//! `capacity` other turns to arrive is forgotten: its next request starts a new inferred session
//! (with the same id as before when its opening was forgotten too).

use std::hash::Hash;
use std::num::NonZeroUsize;

use lru::LruCache;

use super::canonical::{chain, continuation_key, message_key, prefix_keys, Key, EMPTY_PREFIX};
use crate::schema::Message;

/// Default capacity of [`SessionInferrer`] (entries per map).
pub const DEFAULT_CAPACITY: usize = 100_000;

/// An empty least-recently-used map holding at most `capacity` entries (at least 1).
pub(crate) fn lru_cache<K: Hash + Eq, V>(capacity: usize) -> LruCache<K, V> {
    LruCache::new(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN))
}

/// The session a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inferred {
    /// Session id (`inferred-…`, or the id of the session it continues).
    pub session_id: String,
    /// 0-based turn index: the number of assistant messages in the request.
    pub turn_index: i32,
    /// True when the request continues a known session.
    pub continued: bool,
}

/// Assigns session ids to requests without one (see the module doc).
#[derive(Debug)]
pub struct SessionInferrer {
    salt: String,
    continuations: LruCache<Key, String>,
    openings: LruCache<String, u32>,
}

impl SessionInferrer {
    /// An inferrer remembering at most `capacity` turns and `capacity` openings.
    pub fn new(capacity: usize) -> SessionInferrer {
        SessionInferrer::with_salt(capacity, "")
    }

    /// Like [`SessionInferrer::new`]; `salt` (e.g. the source file name) enters the hash of new ids,
    /// so identical openings in different sources get different sessions.
    pub fn with_salt(capacity: usize, salt: &str) -> SessionInferrer {
        SessionInferrer { salt: salt.to_string(), continuations: lru_cache(capacity), openings: lru_cache(capacity) }
    }

    /// Number of remembered turns.
    pub fn len(&self) -> usize {
        self.continuations.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.continuations.len() == 0
    }

    /// The session of a request with these (normalised) messages. Does not remember the request:
    /// call [`SessionInferrer::record`] once its response is known.
    pub fn lookup(&mut self, messages: &[Message]) -> Inferred {
        self.lookup_keyed(messages, &prefix_keys(messages), "")
    }

    /// `keys` (continuation keys of a conversation) moved into `scope`'s own key space: conversations
    /// of different scopes (tenants) never continue each other's sessions, even when their messages
    /// are the same. The empty scope leaves the keys as they are.
    fn scoped(keys: Vec<Key>, scope: &str) -> Vec<Key> {
        if scope.is_empty() {
            return keys;
        }
        let s = message_key(&Message::text("scope", scope));
        keys.iter().map(|k| chain(&s, k)).collect()
    }

    fn lookup_keyed(&mut self, messages: &[Message], keys: &[Key], scope: &str) -> Inferred {
        let turn_index = messages.iter().filter(|m| m.role == "assistant").count() as i32;
        for k in (0..messages.len()).rev() {
            if messages[k].role != "assistant" {
                continue;
            }
            if let Some(id) = self.continuations.get(&keys[k]) {
                return Inferred { session_id: id.clone(), turn_index, continued: true };
            }
        }
        // New session: hash the opening (up to and including the first user message).
        let end = messages.iter().position(|m| m.role == "user").map(|i| i + 1).unwrap_or(messages.len());
        let mut p = chain(&EMPTY_PREFIX, &message_key(&Message::text("salt", self.salt.clone())));
        if !scope.is_empty() {
            p = chain(&p, &message_key(&Message::text("scope", scope)));
        }
        for m in &messages[..end] {
            p = chain(&p, &message_key(m));
        }
        let base = format!("inferred-{}", hex::encode(&p[..8]));
        let n = self.openings.get(&base).copied().unwrap_or(0);
        self.openings.put(base.clone(), n + 1);
        let session_id = if n == 0 { base } else { format!("{base}-{n}") };
        Inferred { session_id, turn_index, continued: false }
    }

    /// Remembers that `messages` followed by `response` belongs to `session_id`, so the next request
    /// of the conversation continues it.
    pub fn record(&mut self, session_id: &str, messages: &[Message], response: &Message) {
        self.record_in("", session_id, messages, response);
    }

    /// [`SessionInferrer::record`] within `scope` (a tenant; `""`: none).
    pub fn record_in(&mut self, scope: &str, session_id: &str, messages: &[Message], response: &Message) {
        let key = Self::scoped(vec![continuation_key(messages, response)], scope).remove(0);
        self.continuations.put(key, session_id.to_string());
    }

    /// [`SessionInferrer::lookup`] then [`SessionInferrer::record`].
    pub fn assign(&mut self, messages: &[Message], response: &Message) -> Inferred {
        self.assign_in("", messages, response)
    }

    /// [`SessionInferrer::assign`] within `scope`: a tenant's conversations continue only sessions of
    /// the same scope, and a new session's id is hashed with the scope too (`""`: no scope, the ids
    /// of [`SessionInferrer::assign`]).
    pub fn assign_in(&mut self, scope: &str, messages: &[Message], response: &Message) -> Inferred {
        let keys = prefix_keys(messages);
        let cont = chain(keys.last().unwrap_or(&EMPTY_PREFIX), &message_key(response));
        let keys = Self::scoped(keys, scope);
        let inf = self.lookup_keyed(messages, &keys, scope);
        let cont = Self::scoped(vec![cont], scope).remove(0);
        self.continuations.put(cont, inf.session_id.clone());
        inf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, c: &str) -> Message {
        Message::text(role, c)
    }

    #[test]
    fn a_continuing_request_joins_the_session() {
        let mut s = SessionInferrer::new(10);
        let r1 = vec![m("system", "sys"), m("user", "hi")];
        let a1 = m("assistant", "hello");
        let i1 = s.assign(&r1, &a1);
        assert!(!i1.continued);
        assert_eq!(i1.turn_index, 0);
        assert!(i1.session_id.starts_with("inferred-") && i1.session_id.len() == "inferred-".len() + 16, "{}", i1.session_id);
        // The echo differs trivially (trailing newline, reasoning): still the same session.
        let mut echoed = m("assistant", "hello\n");
        echoed.reasoning = Some("r".into());
        let r2 = vec![m("system", "sys"), m("user", "hi"), echoed, m("user", "more")];
        let i2 = s.assign(&r2, &m("assistant", "sure"));
        assert_eq!(i2, Inferred { session_id: i1.session_id.clone(), turn_index: 1, continued: true });
    }

    #[test]
    fn scopes_keep_alike_conversations_apart() {
        let (r1, a1) = (vec![m("user", "hi")], m("assistant", "hello"));
        let r2 = vec![m("user", "hi"), m("assistant", "hello"), m("user", "more")];
        let mut s = SessionInferrer::new(10);
        let unscoped = SessionInferrer::new(10).assign(&r1, &a1);
        assert_eq!(s.assign_in("", &r1, &a1), unscoped, "the empty scope is no scope");
        let alice = s.assign_in("alice", &r1, &a1);
        assert!(!alice.continued && alice.session_id != unscoped.session_id, "{alice:?}");
        assert_eq!(s.assign_in("alice", &r2, &m("assistant", "x")), Inferred { session_id: alice.session_id.clone(), turn_index: 1, continued: true });
        assert_eq!(s.assign_in("", &r2, &m("assistant", "x")), Inferred { session_id: unscoped.session_id, turn_index: 1, continued: true });
        // A recorded explicit session is found in its scope only.
        s.record_in("bob", "s-bob", &r1, &a1);
        assert_eq!(s.assign_in("bob", &r2, &m("assistant", "y")).session_id, "s-bob");
        assert_ne!(s.assign_in("carol", &r2, &m("assistant", "y")).session_id, "s-bob");
    }

    #[test]
    fn a_different_response_is_a_different_session() {
        let mut s = SessionInferrer::new(10);
        let r1 = vec![m("user", "hi")];
        let i1 = s.assign(&r1, &m("assistant", "hello"));
        let r2 = vec![m("user", "hi"), m("assistant", "goodbye"), m("user", "?")];
        let i2 = s.assign(&r2, &m("assistant", "x"));
        assert!(!i2.continued);
        // Same opening message → same base id, disambiguated by a counter.
        assert_eq!(i2.session_id, format!("{}-1", i1.session_id));
        assert_eq!(i2.turn_index, 1);
    }

    #[test]
    fn ids_are_deterministic_and_salted() {
        let r = vec![m("user", "hi")];
        let a = SessionInferrer::new(10).lookup(&r);
        let b = SessionInferrer::new(10).lookup(&r);
        assert_eq!(a, b);
        let c = SessionInferrer::with_salt(10, "file.jsonl").lookup(&r);
        assert_ne!(a.session_id, c.session_id);
    }

    #[test]
    fn memory_is_bounded_by_capacity() {
        let mut s = SessionInferrer::new(3);
        let mut first = None;
        for i in 0..10 {
            let r = vec![m("user", &format!("q{i}"))];
            let inf = s.assign(&r, &m("assistant", "a"));
            first.get_or_insert(inf.session_id);
        }
        assert_eq!(s.len(), 3);
        // The first conversation was evicted: its continuation is not recognised; since its opening
        // was forgotten too, the new id is the same deterministic one.
        let r = vec![m("user", "q0"), m("assistant", "a"), m("user", "again")];
        let inf = s.lookup(&r);
        assert!(!inf.continued);
        assert_eq!(Some(inf.session_id), first);
        // A recent conversation is still continued.
        let r9 = vec![m("user", "q9"), m("assistant", "a"), m("user", "again")];
        assert!(s.lookup(&r9).continued);
    }

    #[test]
    fn the_longest_known_prefix_wins() {
        let mut s = SessionInferrer::new(10);
        let r1 = vec![m("user", "a")];
        let i1 = s.assign(&r1, &m("assistant", "b"));
        let r2 = vec![m("user", "a"), m("assistant", "b"), m("user", "c")];
        let i2 = s.assign(&r2, &m("assistant", "d"));
        assert_eq!(i2.session_id, i1.session_id);
        // Register a different session under the longer prefix: it must win.
        s.record("other", &r2, &m("assistant", "d"));
        let r3 = vec![m("user", "a"), m("assistant", "b"), m("user", "c"), m("assistant", "d"), m("user", "e")];
        assert_eq!(s.lookup(&r3).session_id, "other");
    }
}
