//! Flow control for the embedded mock cluster.
//!
//! librdkafka's mock cluster keeps only the newest 5 MiB (or 100,000 messages) of each partition
//! (`rdkafka_mock.c`: `mpart->max_size = 1024 * 1024 * 5`) and silently drops older records — a producer
//! running ahead of a consumer would lose data. In embedded mode every producer and consumer lives in
//! this process, so we bound the backlog instead: consumers register per (group, topic) and report how
//! far they have read; a producer waits before a send while any partition of the topic holds more
//! than [`Flow::limit`] bytes that some registered consumer has not read yet (counting sends still in
//! flight). A real cluster has retention measured in days and is not throttled.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// Backlog bound per partition, bytes of payload (half the mock's 5 MiB, leaving room for record
/// overhead and for sends already in flight).
pub const EMBEDDED_BACKLOG_LIMIT: u64 = 2 << 20;

/// Largest record the embedded bus carries, bytes (2 MiB). The mock cluster evicts the oldest message
/// sets of a partition once it holds more than 5 MiB, and when an append has to evict *every* older
/// message set it moves the partition's start offset past the new one too (`rdkafka_mock.c`,
/// `rd_kafka_mock_msgset_destroy` on the last message set): the new record is lost to consumers.
/// With records and the unread backlog ([`EMBEDDED_BACKLOG_LIMIT`]) both at most 2 MiB, an append
/// never needs more than 5 MiB, so eviction stops at already-read message sets and always keeps one.
/// Larger records are refused with [`crate::Error::RecordTooLarge`] (use a real cluster for them).
pub const EMBEDDED_MAX_RECORD_BYTES: u64 = 2 << 20;

#[derive(Default)]
struct PartLog {
    /// (offset, cumulative payload bytes up to and including this offset), ascending.
    ring: VecDeque<(i64, u64)>,
    /// Cumulative bytes before the first ring entry.
    base: u64,
    head: u64,
}

impl PartLog {
    fn bytes_from(&self, offset: i64) -> u64 {
        // bytes of records with offset >= `offset`
        let before = match self.ring.iter().rev().find(|(o, _)| *o < offset) {
            Some((_, cum)) => *cum,
            None => self.base,
        };
        self.head.saturating_sub(before)
    }
    fn prune_below(&mut self, offset: i64) {
        while let Some((o, cum)) = self.ring.front().copied() {
            if o < offset {
                self.base = cum;
                self.ring.pop_front();
            } else {
                break;
            }
        }
    }
}

#[derive(Default)]
struct State {
    parts: HashMap<(String, i32), PartLog>,
    /// (group, topic) → partition → next offset to read.
    consumers: HashMap<(String, String), HashMap<i32, i64>>,
    inflight: HashMap<String, u64>,
}

/// The embedded bus's backlog bookkeeping (see module docs).
pub struct Flow {
    state: Mutex<State>,
    notify: tokio::sync::Notify,
    /// Max unread bytes per partition before producers wait.
    pub limit: u64,
}

impl Default for Flow {
    fn default() -> Self {
        Flow { state: Mutex::new(State::default()), notify: tokio::sync::Notify::new(), limit: EMBEDDED_BACKLOG_LIMIT }
    }
}

impl Flow {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers consumer group `group` on `topic` (reading from offset 0 until it reports otherwise).
    pub fn register(&self, group: &str, topic: &str) {
        self.lock().consumers.entry((group.to_string(), topic.to_string())).or_default();
    }

    /// Removes a consumer (its task ended); producers no longer wait for it.
    pub fn unregister(&self, group: &str, topic: &str) {
        self.lock().consumers.remove(&(group.to_string(), topic.to_string()));
        self.notify.notify_waiters();
    }

    /// A consumer has read `partition` of `topic` up to `next` (exclusive).
    pub fn consumed(&self, group: &str, topic: &str, partition: i32, next: i64) {
        let mut st = self.lock();
        if let Some(m) = st.consumers.get_mut(&(group.to_string(), topic.to_string())) {
            let e = m.entry(partition).or_insert(0);
            *e = (*e).max(next);
        }
        let min = st
            .consumers
            .iter()
            .filter(|((_, t), _)| t == topic)
            .map(|(_, m)| m.get(&partition).copied().unwrap_or(0))
            .min();
        if let (Some(min), Some(log)) = (min, st.parts.get_mut(&(topic.to_string(), partition))) {
            log.prune_below(min);
        }
        drop(st);
        self.notify.notify_waiters();
    }

    /// `bytes` are about to be sent to `topic`.
    pub fn sending(&self, topic: &str, bytes: u64) {
        *self.lock().inflight.entry(topic.to_string()).or_default() += bytes;
    }

    /// A send of `bytes` to `topic` ended (acknowledged at `partition`/`offset`, or failed: `None`).
    pub fn sent(&self, topic: &str, bytes: u64, at: Option<(i32, i64)>) {
        let mut st = self.lock();
        if let Some(f) = st.inflight.get_mut(topic) {
            *f = f.saturating_sub(bytes);
        }
        tracing::debug!(topic, bytes, ?at, "flow: sent");
        if let Some((p, o)) = at {
            let log = st.parts.entry((topic.to_string(), p)).or_default();
            log.head += bytes;
            let head = log.head;
            log.ring.push_back((o, head));
        }
    }

    /// The largest unread backlog of any partition of `topic` plus the bytes in flight to it.
    pub fn backlog(&self, topic: &str) -> u64 {
        let st = self.lock();
        let groups: Vec<&HashMap<i32, i64>> = st.consumers.iter().filter(|((_, t), _)| t == topic).map(|(_, m)| m).collect();
        if groups.is_empty() {
            return 0;
        }
        let mut worst = 0;
        for ((t, p), log) in &st.parts {
            if t != topic {
                continue;
            }
            let min = groups.iter().map(|m| m.get(p).copied().unwrap_or(0)).min().unwrap_or(0);
            worst = worst.max(log.bytes_from(min));
        }
        worst + st.inflight.get(topic).copied().unwrap_or(0)
    }

    /// Waits until `topic` has room for `bytes` more (always lets a single record through when the
    /// backlog is empty, however large it is).
    pub async fn wait_room(&self, topic: &str, bytes: u64) {
        loop {
            let b = self.backlog(topic);
            if b == 0 || b + bytes <= self.limit {
                tracing::debug!(topic, backlog = b, bytes, "flow: send");
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), self.notify.notified()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlog_counts_unread_bytes_of_the_slowest_group() {
        let f = Flow::default();
        f.register("a", "t");
        f.register("b", "t");
        for o in 0..4 {
            f.sending("t", 100);
            f.sent("t", 100, Some((0, o)));
        }
        assert_eq!(f.backlog("t"), 400);
        f.consumed("a", "t", 0, 3);
        assert_eq!(f.backlog("t"), 400, "group b has read nothing");
        f.consumed("b", "t", 0, 2);
        assert_eq!(f.backlog("t"), 200, "offsets 2 and 3 unread by b");
        f.sending("t", 50);
        assert_eq!(f.backlog("t"), 250, "in-flight bytes count");
        f.unregister("b", "t");
        assert_eq!(f.backlog("t"), 100 + 50, "only a remains (offset 3 unread)");
        f.unregister("a", "t");
        assert_eq!(f.backlog("t"), 0, "no consumer: no backlog to bound");
    }
}
