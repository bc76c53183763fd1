//! The signal stage's pure transform: pair each main turn with its next state (docs/method.md §1).
//!
//! Input: [`Interaction`] rows in any order (with the Kafka position of each row). Output: exactly
//! one [`Signal`] per main turn — paired with its next state, or excluded with a reason — and
//! counters for everything else. No I/O; the wiring feeds it from Kafka and writes the signals.
//!
//! **Next state of main turn t**, in order of preference:
//! 1. the interaction's own `next_state`, when the log gave it;
//! 2. the messages appended after t's response in a later request R' of the same session: R'
//!    continues t iff R' starts with t's request messages followed by t's response **and** t's
//!    response is the last assistant message of R' (so R' is t's immediate successor, not a later
//!    turn's request); the next state is everything after it — a user reply, all tool results (put in
//!    call order when every result names a distinct call id, otherwise kept in logged order: a result
//!    is joined to its call by position, ids repeat in real logs), or an environment observation.
//!    Messages are compared on the canonical form of [`crate::ingest::canonical`] (role, trimmed
//!    visible text, tool-call names + canonical arguments; no reasoning, no ids), via one 128-bit key
//!    per prefix, so pairing is by content — concurrent branches of one session pair correctly
//!    whatever the arrival order. Each request has exactly one candidate predecessor (the key of its
//!    messages up to its last assistant message) and each turn one continuation key (request +
//!    response), so both directions are a hash lookup.
//!
//! If several requests continue the same turn (a retry or a branch), the earliest by event time
//! among those present when the turn is paired wins (ties: smallest interaction id); later ones are
//! counted in [`SignalCounters::extra_continuations`]. A successor whose event time is before the
//! turn's is never paired with it ([`SignalCounters::successor_before_turn`]), so no signal pairs a
//! response with a message written before it.
//!
//! **Session end**: a session ends when the turn marked `session_done` and every turn index before
//! it have arrived, or when a row pushed later is more than [`SignalConfig::idle_gap_ms`] of event
//! time newer than the session's newest row ([`SignalPairer::push`] closes such sessions after each
//! row; [`SignalPairer::advance_watermark`] does it for an explicit time). The clock is the event time
//! of the row just pushed, not the largest seen: a log of an older date read after a newer one pairs
//! as it would alone, and the decision depends only on the rows in their order, never on how they were
//! batched. Its unpaired main turns then become excluded signals (kind
//! `none`, `excluded_reason` "session done without next state" or "session idle for N s without next
//! state"); the `session_done` turn itself, without a next state, is excluded as soon as it arrives.
//! Side turns are never paired (counted). A row whose interaction id was already seen in its open
//! session is a duplicate (counted, ignored); after a session closes, a repeated row opens it again —
//! the signals table's key (`interaction_id`) makes such a repeat idempotent downstream.
//!
//! **Restarts**: an *incarnation* is a session from the row that opened it to its close. Given one
//! partition's rows in offset order, the signals are a function of that sequence, and
//! [`SignalPairer::safe_commit_offsets`] names, per partition, an offset no incarnation spans (none has
//! rows both below and at or above it) and no open incarnation starts below. A pairer fed the same
//! partition from that offset emits, for every row it reads, exactly the signals the first pairer
//! emitted for it (`processed_time` aside): every incarnation it sees is whole. [`PartitionedPairer`]
//! keeps one pairer per partition, so partitions never close each other's sessions, and rebuilds a
//! partition's state when its offsets go back (a rebalance or restart re-reading from the commit).
//!
//! [`Interaction`]: crate::schema::Interaction
//! [`Signal`]: crate::schema::Signal

pub mod features;
mod pairer;
mod partitioned;

pub use features::{classify, features as next_state_features, render, Features};
pub use pairer::{SignalConfig, SignalCounters, SignalPairer};
pub use partitioned::PartitionedPairer;

#[cfg(test)]
mod tests;
