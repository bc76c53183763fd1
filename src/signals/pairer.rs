//! [`SignalPairer`]: the pairing transform of the module doc of [`crate::signals`], its
//! [`SignalConfig`] and [`SignalCounters`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::features::{self, classify, render};
use crate::ingest::canonical::{chain, message_key, prefix_keys, Key, EMPTY_PREFIX};
use crate::schema::{Interaction, Lineage, Message, NextStateKind, Signal, Table, TurnType};

/// Configuration of the pairing stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalConfig {
    /// A session is closed when a row pushed after its newest row is more than this much newer (event
    /// time, ms); its unpaired turns are excluded. Default 30 minutes (the OpenClaw client never sends
    /// a done flag). A partition that receives no more rows keeps its sessions open (held, not
    /// committed) until one arrives.
    #[serde(default = "default_idle_gap_ms")]
    pub idle_gap_ms: i64,
}

fn default_idle_gap_ms() -> i64 {
    30 * 60 * 1000
}

impl Default for SignalConfig {
    fn default() -> Self {
        SignalConfig { idle_gap_ms: default_idle_gap_ms() }
    }
}

/// Counters of the pairing stage (cumulative).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SignalCounters {
    /// Rows pushed.
    pub rows: u64,
    /// Main turns seen (each gets exactly one signal).
    pub main_turns: u64,
    /// Side turns seen (stored, never paired).
    pub side_turns: u64,
    /// Rows ignored because their interaction id was already seen in the open session.
    pub duplicates: u64,
    /// Signals whose next state came from the log itself.
    pub paired_from_log: u64,
    /// Signals whose next state came from a successor request.
    pub paired_by_prefix: u64,
    /// Paired signals by kind (`user`, `tool`, `environment`).
    pub paired_by_kind: BTreeMap<String, u64>,
    /// Excluded signals by reason code (`session_done`, `session_idle`, `invalid_row`).
    pub excluded_by_reason: BTreeMap<String, u64>,
    /// Requests that continue a turn already paired (retries, branches).
    pub extra_continuations: u64,
    /// Requests that continue a turn whose next state the log already gave.
    pub successors_of_logged_next_state: u64,
    /// Requests that continue a side turn.
    pub successors_of_side_turns: u64,
    /// Requests whose predecessor turn was written after them (event time), so not paired.
    pub successor_before_turn: u64,
    /// Requests that continue a turn that never arrived before their session closed.
    pub unmatched_successors: u64,
    /// Paired tool next states with fewer tool results than the turn made calls.
    pub missing_tool_results: u64,
    /// Sessions closed by their done flag.
    pub sessions_done: u64,
    /// Sessions closed by the idle gap.
    pub sessions_idle: u64,
}

/// A request waiting for the turn it continues.
#[derive(Debug, Clone)]
struct Successor {
    interaction_id: String,
    event_time: i64,
    next_state: Vec<Message>,
}

/// A main turn waiting for its next state.
#[derive(Debug, Clone)]
struct Pending {
    row: Interaction,
    lineage: Lineage,
    tool_call_ids: Vec<Option<String>>,
}

#[derive(Debug, Default)]
struct Session {
    last_event_time: i64,
    done_turn: Option<i32>,
    turn_indices: HashSet<i32>,
    seen_ids: HashSet<String>,
    waiting: HashMap<Key, Vec<Pending>>,
    /// Turns already paired (or with a log next state): key → event time of the successor used.
    resolved: HashMap<Key, Resolution>,
    side_keys: HashSet<Key>,
    orphans: HashMap<Key, Vec<Successor>>,
    /// Per partition, (first, last) offset of the rows of this incarnation (duplicates included).
    spans: BTreeMap<i32, (i64, i64)>,
}

#[derive(Debug, Clone, Copy)]
enum Resolution {
    Paired,
    FromLog,
}

/// The pairing transform (see the module doc).
pub struct SignalPairer {
    cfg: SignalConfig,
    clock: Box<dyn Fn() -> i64 + Send>,
    sessions: HashMap<String, Session>,
    /// (last event time, session id) of every open session, for the idle scan.
    by_activity: BTreeSet<(i64, String)>,
    /// Per partition, (first, last) offsets of closed incarnations that may still span a future
    /// safe commit offset (pruned by [`SignalPairer::safe_commit_offsets`]).
    closed_spans: HashMap<i32, Vec<(i64, i64)>>,
    counters: SignalCounters,
}

impl std::fmt::Debug for SignalPairer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalPairer").field("cfg", &self.cfg).field("open_sessions", &self.sessions.len()).field("counters", &self.counters).finish()
    }
}

impl SignalPairer {
    /// A pairer whose signals carry the wall-clock time as `processed_time`.
    pub fn new(cfg: SignalConfig) -> SignalPairer {
        SignalPairer::with_clock(cfg, Box::new(crate::schema::now_ms))
    }

    /// A pairer with an explicit clock for `processed_time` (ms since the epoch), for tests.
    pub fn with_clock(cfg: SignalConfig, clock: Box<dyn Fn() -> i64 + Send>) -> SignalPairer {
        SignalPairer { cfg, clock, sessions: HashMap::new(), by_activity: BTreeSet::new(), closed_spans: HashMap::new(), counters: SignalCounters::default() }
    }

    /// Counters so far.
    pub fn counters(&self) -> &SignalCounters {
        &self.counters
    }

    /// Number of open sessions.
    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Rows held in state: turns waiting for a next state plus requests waiting for their
    /// predecessor (a row that is both counts twice).
    pub fn held_rows(&self) -> usize {
        self.sessions.values().map(|s| s.waiting.values().map(Vec::len).sum::<usize>() + s.orphans.values().map(Vec::len).sum::<usize>()).sum()
    }

    /// Feeds one interaction (any order); `lineage` is the Kafka position of the row. Returns the
    /// signals completed by it (this turn's, and/or the turn it is the successor of, and/or a whole
    /// session's when it completes a done session), then those of every other session whose newest
    /// row is more than `idle_gap_ms` older than this row ([`SignalPairer::advance_watermark`] at
    /// this row's event time). For restart determinism feed one partition per pairer, in offset order
    /// (see the module doc; [`PartitionedPairer`](super::PartitionedPairer) does it).
    pub fn push(&mut self, row: Interaction, lineage: Lineage) -> Vec<Signal> {
        let now = row.event_time;
        let mut out = self.push_row(row, lineage);
        out.extend(self.advance_watermark(now));
        out
    }

    fn push_row(&mut self, row: Interaction, lineage: Lineage) -> Vec<Signal> {
        self.counters.rows += 1;
        let mut out = Vec::new();
        // Sessions are a tenant's own: two tenants sending the same session id are two sessions, and one
        // tenant's turn never takes another's as its next state. The default tenant's key is the id.
        let sid = crate::schema::tenant_session_key(row.tenant.as_deref(), &row.session_id);
        let (was_active, prev_time) = match self.sessions.get(&sid) {
            Some(s) => (true, s.last_event_time),
            None => (false, i64::MIN),
        };
        {
            let s = self.sessions.entry(sid.clone()).or_default();
            if let (Some(p), Some(o)) = (lineage.source_partition, lineage.source_offset) {
                let e = s.spans.entry(p).or_insert((o, o));
                *e = (e.0.min(o), e.1.max(o));
            }
            if !s.seen_ids.insert(row.interaction_id.clone()) {
                self.counters.duplicates += 1;
                return out;
            }
            s.turn_indices.insert(row.turn_index);
            if row.session_done {
                s.done_turn = Some(s.done_turn.map_or(row.turn_index, |d| d.max(row.turn_index)));
            }
            s.last_event_time = s.last_event_time.max(row.event_time);
        }
        self.touch(&sid, was_active, prev_time);

        let messages: Option<Vec<Message>> = serde_json::from_str(&row.request_messages).ok();
        let response = row.response_message().ok();
        // Prefix keys of the request, computed once: the last-assistant prefix is this row's
        // predecessor key, the whole request + response its continuation key.
        let keys: Vec<Key> = messages.as_deref().map(prefix_keys).unwrap_or_default();
        let cont_key = |resp: &Message| chain(keys.last().unwrap_or(&EMPTY_PREFIX), &message_key(resp));

        // 1. This row as the successor of an earlier turn.
        if let Some(msgs) = &messages {
            if let Some(last_a) = msgs.iter().rposition(|m| m.role == "assistant") {
                let suffix = &msgs[last_a + 1..];
                if !suffix.is_empty() && suffix.iter().all(|m| m.role != "assistant") {
                    if let Some(&pred) = keys.get(last_a) {
                        let succ = Successor {
                            interaction_id: row.interaction_id.clone(),
                            event_time: row.event_time,
                            next_state: suffix.to_vec(),
                        };
                        self.offer_successor(&sid, pred, succ, &mut out);
                    }
                }
            }
        }

        // 2. This row as a turn.
        match (row.turn_type, &messages, &response) {
            (TurnType::Side, Some(_), Some(resp)) => {
                self.counters.side_turns += 1;
                let key = cont_key(resp);
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.side_keys.insert(key);
                    if let Some(orph) = s.orphans.remove(&key) {
                        self.counters.successors_of_side_turns += orph.len() as u64;
                    }
                }
            }
            (TurnType::Side, _, _) => self.counters.side_turns += 1,
            (TurnType::Main, Some(_), Some(resp)) => {
                self.counters.main_turns += 1;
                let key = cont_key(resp);
                let log_next: Option<Vec<Message>> = row.next_state.as_deref().and_then(|s| serde_json::from_str(s).ok());
                let tool_call_ids: Vec<Option<String>> = resp.tool_calls.iter().map(|c| c.id.clone()).collect();
                match log_next {
                    Some(ns) if !ns.is_empty() => {
                        let sig = self.signal(&row, &lineage, ns, None, &tool_call_ids);
                        out.push(sig);
                        if let Some(s) = self.sessions.get_mut(&sid) {
                            s.resolved.insert(key, Resolution::FromLog);
                            if let Some(orph) = s.orphans.remove(&key) {
                                self.counters.successors_of_logged_next_state += orph.len() as u64;
                            }
                        }
                    }
                    _ => {
                        let pending = Pending { row, lineage, tool_call_ids };
                        self.offer_turn(&sid, key, pending, &mut out);
                    }
                }
            }
            (TurnType::Main, _, _) => {
                self.counters.main_turns += 1;
                let reason = "request_messages or tool_calls is not valid JSON";
                out.push(self.excluded(&row, &lineage, "invalid_row", reason.to_string()));
            }
        }
        self.maybe_close_done(&sid, &mut out);
        out
    }

    /// Advances the event-time watermark: sessions whose last row is older than `event_time_ms -
    /// idle_gap_ms` are closed and their unpaired main turns returned as excluded signals.
    pub fn advance_watermark(&mut self, event_time_ms: i64) -> Vec<Signal> {
        let mut out = Vec::new();
        let cutoff = event_time_ms.saturating_sub(self.cfg.idle_gap_ms);
        let idle: Vec<(i64, String)> = self.by_activity.range(..(cutoff, String::new())).cloned().collect();
        for (t, sid) in idle {
            self.by_activity.remove(&(t, sid.clone()));
            if let Some(s) = self.sessions.remove(&sid) {
                let done = s.done_turn.is_some();
                let secs = (event_time_ms - s.last_event_time) / 1000;
                let reason =
                    if done { "session done without next state".to_string() } else { format!("session idle for {secs} s without next state") };
                self.close(s, if done { "session_done" } else { "session_idle" }, &reason, &mut out);
                if done {
                    self.counters.sessions_done += 1;
                } else {
                    self.counters.sessions_idle += 1;
                }
            }
        }
        out
    }

    /// Closes every open session now (end of a bounded input, e.g. a file): unpaired main turns are
    /// excluded as by [`SignalPairer::advance_watermark`] with an infinite watermark.
    pub fn finish(&mut self) -> Vec<Signal> {
        let latest = self.by_activity.iter().next_back().map(|(t, _)| *t).unwrap_or(0);
        self.advance_watermark(latest.saturating_add(self.cfg.idle_gap_ms).saturating_add(1))
    }

    /// Per partition, the offset the wiring may commit (the next record to read after a restart):
    /// the largest offset no incarnation spans (see the module doc) that is at or below the first row
    /// of every open incarnation. A partition with no open incarnation is absent: everything read
    /// from it may be committed. Every row still held (a turn waiting for its next state, a request
    /// waiting for its predecessor) lies at or above it. Prunes the closed incarnations that can no
    /// longer matter, so call it after each batch. Cost: one pass over the open sessions and over the
    /// incarnations closed since the offset was last this low.
    pub fn safe_commit_offsets(&mut self) -> HashMap<i32, i64> {
        let mut safe: HashMap<i32, i64> = HashMap::new();
        for s in self.sessions.values() {
            for (&p, &(first, _)) in &s.spans {
                let e = safe.entry(p).or_insert(first);
                *e = (*e).min(first);
            }
        }
        // A partition with nothing open commits past every row read: its closed spans lie below.
        self.closed_spans.retain(|p, _| safe.contains_key(p));
        for (p, x) in safe.iter_mut() {
            if let Some(spans) = self.closed_spans.get_mut(p) {
                while let Some(first) = spans.iter().filter(|&&(f, l)| f < *x && *x <= l).map(|&(f, _)| f).min() {
                    *x = first;
                }
                // The safe offset never goes down again; spans ending below it can never span it.
                spans.retain(|&(_, l)| l >= *x);
            }
        }
        safe
    }

    // ---- internals ----

    fn touch(&mut self, sid: &str, was_active: bool, prev_time: i64) {
        if was_active {
            self.by_activity.remove(&(prev_time, sid.to_string()));
        }
        if let Some(s) = self.sessions.get(sid) {
            self.by_activity.insert((s.last_event_time, sid.to_string()));
        }
    }

    fn offer_successor(&mut self, sid: &str, pred: Key, succ: Successor, out: &mut Vec<Signal>) {
        let Some(s) = self.sessions.get_mut(sid) else { return };
        if let Some(pendings) = s.waiting.remove(&pred) {
            // Pair only turns written before (or at) this request.
            let (ready, keep): (Vec<Pending>, Vec<Pending>) = pendings.into_iter().partition(|p| p.row.event_time <= succ.event_time);
            self.counters.successor_before_turn += keep.len() as u64;
            if !keep.is_empty() {
                s.waiting.insert(pred, keep);
            }
            if ready.is_empty() {
                s.orphans.entry(pred).or_default().push(succ);
                return;
            }
            s.resolved.insert(pred, Resolution::Paired);
            for p in ready {
                let sig = self.signal(&p.row, &p.lineage, succ.next_state.clone(), Some(succ.interaction_id.clone()), &p.tool_call_ids);
                out.push(sig);
            }
            return;
        }
        match s.resolved.get(&pred) {
            Some(Resolution::Paired) => self.counters.extra_continuations += 1,
            Some(Resolution::FromLog) => self.counters.successors_of_logged_next_state += 1,
            None if s.side_keys.contains(&pred) => self.counters.successors_of_side_turns += 1,
            None => s.orphans.entry(pred).or_default().push(succ),
        }
    }

    fn offer_turn(&mut self, sid: &str, key: Key, p: Pending, out: &mut Vec<Signal>) {
        let Some(s) = self.sessions.get_mut(sid) else { return };
        if let Some(cands) = s.orphans.remove(&key) {
            let (mut valid, before): (Vec<Successor>, Vec<Successor>) = cands.into_iter().partition(|c| c.event_time >= p.row.event_time);
            self.counters.successor_before_turn += before.len() as u64;
            if !before.is_empty() {
                // Written before this turn: they may still continue another turn with the same content.
                s.orphans.insert(key, before);
            }
            valid.sort_by(|a, b| a.event_time.cmp(&b.event_time).then_with(|| a.interaction_id.cmp(&b.interaction_id)));
            let mut valid = valid.into_iter();
            if let Some(first) = valid.next() {
                self.counters.extra_continuations += valid.len() as u64;
                s.resolved.insert(key, Resolution::Paired);
                let sig = self.signal(&p.row, &p.lineage, first.next_state, Some(first.interaction_id), &p.tool_call_ids);
                out.push(sig);
                return;
            }
        }
        if p.row.session_done {
            // Nothing can follow the last turn of a finished session.
            let sig = self.excluded(&p.row, &p.lineage, "session_done", "session done without next state".into());
            out.push(sig);
            return;
        }
        if let Some(s) = self.sessions.get_mut(sid) {
            s.waiting.entry(key).or_default().push(p);
        }
    }

    /// Closes a done session once all its turns up to the done turn have arrived.
    fn maybe_close_done(&mut self, sid: &str, out: &mut Vec<Signal>) {
        let complete = match self.sessions.get(sid) {
            Some(s) => match s.done_turn {
                Some(d) => d >= 0 && (0..=d).all(|i| s.turn_indices.contains(&i)),
                None => false,
            },
            None => false,
        };
        if !complete {
            return;
        }
        if let Some(s) = self.sessions.remove(sid) {
            self.by_activity.remove(&(s.last_event_time, sid.to_string()));
            self.close(s, "session_done", "session done without next state", out);
            self.counters.sessions_done += 1;
        }
    }

    fn close(&mut self, s: Session, code: &str, reason: &str, out: &mut Vec<Signal>) {
        for (p, (first, last)) in &s.spans {
            if first < last {
                self.closed_spans.entry(*p).or_default().push((*first, *last));
            }
        }
        self.counters.unmatched_successors += s.orphans.values().map(|v| v.len() as u64).sum::<u64>();
        let mut pend: Vec<Pending> = s.waiting.into_values().flatten().collect();
        pend.sort_by_key(|p| p.row.turn_index);
        for p in pend {
            let sig = self.excluded(&p.row, &p.lineage, code, reason.to_string());
            out.push(sig);
        }
    }

    fn excluded(&mut self, row: &Interaction, lineage: &Lineage, code: &str, reason: String) -> Signal {
        *self.counters.excluded_by_reason.entry(code.to_string()).or_insert(0) += 1;
        let mut sig = self.base(row, lineage);
        sig.kind = NextStateKind::None;
        sig.next_state = "[]".into();
        sig.excluded_reason = Some(reason);
        sig
    }

    /// A paired signal: `ns` = next-state messages, `next_id` = successor interaction id (None when
    /// the log gave the next state).
    fn signal(&mut self, row: &Interaction, lineage: &Lineage, mut ns: Vec<Message>, next_id: Option<String>, tool_call_ids: &[Option<String>]) -> Signal {
        order_tool_results(&mut ns, tool_call_ids);
        let kind = classify(&ns);
        if kind == NextStateKind::Tool && ns.iter().filter(|m| m.role == "tool").count() < tool_call_ids.len() {
            self.counters.missing_tool_results += 1;
        }
        let f = features::features(&ns);
        if next_id.is_some() {
            self.counters.paired_by_prefix += 1;
        } else {
            self.counters.paired_from_log += 1;
        }
        *self.counters.paired_by_kind.entry(kind.as_str().to_string()).or_insert(0) += 1;
        let mut sig = self.base(row, lineage);
        sig.kind = kind;
        sig.next_state = serde_json::to_string(&ns).unwrap_or_else(|_| "[]".into());
        sig.next_state_text = render(&ns);
        sig.next_interaction_id = next_id;
        sig.has_error = f.has_error;
        sig.exit_code = f.exit_code;
        sig.correction_cue = f.correction_cue;
        sig.thanks_cue = f.thanks_cue;
        sig.success_cue = f.success_cue;
        sig
    }

    fn base(&self, row: &Interaction, lineage: &Lineage) -> Signal {
        Signal {
            schema_version: Signal::SCHEMA_VERSION,
            interaction_id: row.interaction_id.clone(),
            session_id: row.session_id.clone(),
            tenant: row.tenant.clone(),
            turn_index: row.turn_index,
            policy_version: row.policy_version,
            kind: NextStateKind::None,
            next_state: "[]".into(),
            next_state_text: String::new(),
            next_interaction_id: None,
            excluded_reason: None,
            has_error: false,
            exit_code: None,
            correction_cue: false,
            thanks_cue: false,
            success_cue: false,
            source_topic: lineage.source_topic.clone(),
            source_partition: lineage.source_partition,
            source_offset: lineage.source_offset,
            event_time: row.event_time,
            processed_time: (self.clock)(),
        }
    }
}

/// Puts leading tool results in the order of the turn's calls when every result names a distinct
/// call id of the turn; otherwise leaves the logged (positional) order.
pub(super) fn order_tool_results(ns: &mut [Message], call_ids: &[Option<String>]) {
    let n = ns.iter().take_while(|m| m.role == "tool").count();
    if n < 2 || call_ids.iter().any(Option::is_none) {
        return;
    }
    let ids: Vec<&str> = call_ids.iter().flatten().map(String::as_str).collect();
    let distinct: HashSet<&str> = ids.iter().copied().collect();
    if distinct.len() != ids.len() {
        return;
    }
    let pos = |m: &Message| m.tool_call_id.as_deref().and_then(|id| ids.iter().position(|x| *x == id));
    let positions: Vec<Option<usize>> = ns[..n].iter().map(pos).collect();
    let unique: HashSet<usize> = positions.iter().flatten().copied().collect();
    if positions.iter().any(Option::is_none) || unique.len() != n {
        return;
    }
    ns[..n].sort_by_key(|m| pos(m).unwrap_or(usize::MAX));
}
