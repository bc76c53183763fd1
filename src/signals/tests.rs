use std::collections::HashMap;

use super::pairer::order_tool_results;
use super::*;
use crate::schema::{Interaction, Lineage, Message, NextStateKind, Signal, ToolCall, TurnType};
use proptest::prelude::*;

const T0: i64 = 1_772_323_200_000;

fn msg(role: &str, c: &str) -> Message {
    Message::text(role, c)
}

fn call(id: &str, name: &str, arg: i64) -> ToolCall {
    ToolCall { id: Some(id.into()), name: name.into(), arguments: serde_json::json!({ "x": arg }), arguments_raw: None }
}

fn row(session: &str, turn: i32, request: &[Message], response: &Message, t: i64) -> Interaction {
    let req = serde_json::to_string(request).unwrap();
    let tc = if response.tool_calls.is_empty() { None } else { Some(serde_json::to_string(&response.tool_calls).unwrap()) };
    Interaction {
        interaction_id: Interaction::compute_id(session, turn, &req, &response.content, tc.as_deref()),
        policy_version: Some(7),
        reasoning_text: response.reasoning.clone(),
        tool_calls: tc,
        source_format: "test".into(),
        ..Interaction::new(session, turn, &req, &response.content, t)
    }
}

fn lin(partition: i32, offset: i64) -> Lineage {
    Lineage { source_topic: Some("interactions".into()), source_partition: Some(partition), source_offset: Some(offset), ..Lineage::default() }
}

fn pairer() -> SignalPairer {
    SignalPairer::with_clock(SignalConfig::default(), Box::new(|| T0 + 99))
}

fn ns_of(s: &Signal) -> Vec<Message> {
    serde_json::from_str(&s.next_state).unwrap()
}

/// A session: system, user, then per turn an assistant response and its next state.
struct Conv {
    rows: Vec<Interaction>,
    /// Expected next state per main turn index (None = no successor in the log).
    expected: Vec<Option<Vec<Message>>>,
    side_ids: Vec<String>,
}

/// Builds a conversation. `kinds[i]`: 0 = the user replies, k in 1..=3 = k parallel tool calls.
fn conversation(session: &str, kinds: &[u8], repetitive: bool, same_ids: bool, done: bool, log_last: bool, sides: &[u8]) -> Conv {
    let text = |s: &str, i: usize| if repetitive { s.to_string() } else { format!("{s} {i}") };
    let mut msgs = vec![msg("system", "sys"), msg("user", &text("task", 0))];
    let mut rows = vec![];
    let mut expected = vec![];
    let n = kinds.len();
    for (i, &k) in kinds.iter().enumerate() {
        let mut resp = msg("assistant", &text("answer", i));
        let mut after = vec![];
        if k == 0 {
            after.push(msg("user", &text("ok", i)));
        } else {
            for j in 0..k as usize {
                let id = if same_ids { "call_1".to_string() } else { format!("call_{i}_{j}") };
                resp.tool_calls.push(call(&id, "f", j as i64));
                after.push(Message { tool_call_id: Some(id), ..msg("tool", &text("result", i * 10 + j)) });
            }
        }
        let mut r = row(session, i as i32, &msgs, &resp, T0 + 1000 * i as i64);
        msgs.push(resp);
        let last = i + 1 == n;
        if last {
            r.session_done = done;
            if log_last {
                r.next_state = Some(serde_json::to_string(&after).unwrap());
            }
            expected.push(if log_last { Some(after.clone()) } else { None });
        } else {
            expected.push(Some(after.clone()));
        }
        msgs.extend(after);
        rows.push(r);
    }
    // Side turns: unrelated heartbeat requests in the same session, between main turns.
    let mut side_ids = vec![];
    for (j, &pos) in sides.iter().enumerate() {
        let at = (pos as usize) % (n + 1);
        let req = vec![msg("user", "HEARTBEAT")];
        let mut r = row(session, (n + j) as i32, &req, &msg("assistant", &format!("HEARTBEAT_OK {j}")), T0 + 1000 * at as i64 + 500);
        r.turn_type = TurnType::Side;
        side_ids.push(r.interaction_id.clone());
        rows.push(r);
    }
    Conv { rows, expected, side_ids }
}

fn run(rows: Vec<Interaction>, order: &[usize]) -> (Vec<Signal>, SignalCounters) {
    let mut p = pairer();
    let mut out = vec![];
    for (k, &i) in order.iter().enumerate() {
        out.extend(p.push(rows[i].clone(), lin(0, k as i64)));
    }
    out.extend(p.finish());
    (out, p.counters().clone())
}

fn check(conv: &Conv, sigs: &[Signal], done: bool) {
    let main: Vec<&Interaction> = conv.rows.iter().filter(|r| r.turn_type == TurnType::Main).collect();
    assert_eq!(sigs.len(), main.len(), "one signal per main turn");
    for r in &main {
        let mine: Vec<&Signal> = sigs.iter().filter(|s| s.interaction_id == r.interaction_id).collect();
        assert_eq!(mine.len(), 1, "turn {} has {} signals", r.turn_index, mine.len());
        let s = mine[0];
        match &conv.expected[r.turn_index as usize] {
            Some(exp) => {
                assert_eq!(s.excluded_reason, None, "turn {}", r.turn_index);
                assert_eq!(&ns_of(s), exp, "turn {}: next state must be exactly what followed the response", r.turn_index);
                let want = if exp[0].role == "tool" { NextStateKind::Tool } else { NextStateKind::User };
                assert_eq!(s.kind, want);
            }
            None => {
                assert_eq!(s.kind, NextStateKind::None);
                let reason = s.excluded_reason.as_deref().unwrap();
                if done {
                    assert_eq!(reason, "session done without next state");
                } else {
                    assert!(reason.starts_with("session idle for "), "{reason}");
                }
            }
        }
    }
    for id in &conv.side_ids {
        assert!(sigs.iter().all(|s| &s.interaction_id != id), "side turns never produce signals");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Every main turn gets exactly one signal whatever the arrival order; each paired signal's next
    /// state is exactly the messages appended after that turn's response (never earlier ones); side
    /// turns never produce signals.
    #[test]
    fn one_signal_per_main_turn_in_any_order(
        (kinds, repetitive, same_ids, done, log_last, sides, order) in
            (prop::collection::vec(0u8..4, 1..7), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), prop::collection::vec(any::<u8>(), 0..3))
            .prop_flat_map(|(k, r, s, d, l, sides)| {
                let n = k.len() + sides.len();
                (Just(k), Just(r), Just(s), Just(d), Just(l), Just(sides), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
            })
    ) {
        let conv = conversation("s", &kinds, repetitive, same_ids, done, log_last, &sides);
        let (sigs, c) = run(conv.rows.clone(), &order);
        check(&conv, &sigs, done);
        prop_assert_eq!(c.side_turns, sides.len() as u64);
        prop_assert_eq!(c.main_turns, kinds.len() as u64);
    }

    /// Two sessions interleaved in any order pair independently, even with identical content.
    #[test]
    fn interleaved_sessions_pair_independently(
        (kinds, order) in prop::collection::vec(0u8..3, 1..5).prop_flat_map(|k| {
            let n = 2 * k.len();
            (Just(k), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
        })
    ) {
        let a = conversation("a", &kinds, true, true, true, false, &[]);
        let b = conversation("b", &kinds, true, true, true, false, &[]);
        let mut rows = a.rows.clone();
        rows.extend(b.rows.clone());
        let (sigs, _) = run(rows, &order);
        let (sa, sb): (Vec<Signal>, Vec<Signal>) = sigs.into_iter().partition(|s| s.session_id == "a");
        check(&a, &sa, true);
        check(&b, &sb, true);
    }
}

#[test]
fn prefix_pairing_across_out_of_order_arrival() {
    let conv = conversation("s", &[2, 0, 1], false, false, false, false, &[]);
    // Successors first, then the turns they continue.
    let (sigs, c) = run(conv.rows.clone(), &[2, 1, 0]);
    check(&conv, &sigs, false);
    assert_eq!(c.paired_by_prefix, 2);
    assert_eq!(c.excluded_by_reason.get("session_idle"), Some(&1));
    // Turn 0 made two parallel calls: both results, in call order.
    let s0 = sigs.iter().find(|s| s.turn_index == 0).unwrap();
    assert_eq!(s0.next_state_text, "[tool] result 0\n[tool] result 1");
    assert_eq!(s0.next_interaction_id.as_deref(), Some(conv.rows[1].interaction_id.as_str()));
    assert_eq!(s0.source_offset, Some(2), "lineage of the turn's own row");
    assert_eq!(s0.policy_version, Some(7));
    assert_eq!(s0.processed_time, T0 + 99);
}

#[test]
fn the_row_handed_on_with_a_signal_is_read_at_its_own_kafka_position_and_keeps_its_file_position() {
    // Two user turns of one ingested session, read from partition 3 at offsets 40 and 41: turn 0's
    // signal completes when turn 1 arrives, turn 1's when the session closes.
    let conv = conversation("s", &[0, 0], false, false, true, false, &[]);
    let mut p = PartitionedPairer::with_clock(SignalConfig::default(), || T0 + 99);
    let mut out = vec![];
    for (k, r) in conv.rows.iter().enumerate() {
        let r = Interaction { source_file: Some("logs/tau.json".into()), source_line: Some(5), ..r.clone() };
        assert_eq!(r.source_topic, None, "the lake's row has no Kafka position");
        out.extend(p.push(r, lin(3, 40 + k as i64)));
    }
    let got: Vec<(i32, Option<i64>, Option<String>, Option<i32>, Option<i64>, Option<String>, Option<i64>)> = out
        .into_iter()
        .map(|(s, t)| {
            let t = t.unwrap();
            assert_eq!(t.interaction_id, s.interaction_id);
            (s.turn_index, s.source_offset, t.source_topic, t.source_partition, t.source_offset, t.source_file, t.source_line)
        })
        .collect();
    let file = || Some("logs/tau.json".to_string());
    let topic = || Some("interactions".to_string());
    assert_eq!(got, vec![(0, Some(40), topic(), Some(3), Some(40), file(), Some(5)), (1, Some(41), topic(), Some(3), Some(41), file(), Some(5))]);
}

#[test]
fn tool_results_are_put_in_call_order_when_ids_allow() {
    let req = vec![msg("user", "go")];
    let mut resp = msg("assistant", "");
    resp.tool_calls = vec![call("A", "f", 1), call("B", "f", 2)];
    let t = row("s", 0, &req, &resp, T0);
    let mut next = req.clone();
    next.push(resp.clone());
    next.push(Message { tool_call_id: Some("B".into()), ..msg("tool", "b") });
    next.push(Message { tool_call_id: Some("A".into()), ..msg("tool", "a") });
    let t1 = row("s", 1, &next, &msg("assistant", "done"), T0 + 1);
    let mut p = pairer();
    let mut sigs = p.push(t, lin(0, 0));
    sigs.extend(p.push(t1, lin(0, 1)));
    assert_eq!(sigs.len(), 1);
    assert_eq!(sigs[0].next_state_text, "[tool] a\n[tool] b");
    // With repeated ids the logged (positional) order is kept.
    let mut ns = vec![Message { tool_call_id: Some("X".into()), ..msg("tool", "2") }, Message { tool_call_id: Some("X".into()), ..msg("tool", "1") }];
    order_tool_results(&mut ns, &[Some("X".into()), Some("X".into())]);
    assert_eq!(ns[0].content, "2");
}

#[test]
fn a_branch_pairs_with_the_earliest_successor_and_counts_the_other() {
    let req = vec![msg("user", "book a flight")];
    let resp = msg("assistant", "Which date?");
    let t = row("s", 0, &req, &resp, T0);
    let mut r1 = req.clone();
    r1.push(resp.clone());
    let mut r2 = r1.clone();
    r1.push(msg("user", "Monday"));
    r2.push(msg("user", "No, cancel that."));
    let late = row("s", 1, &r1, &msg("assistant", "Booked Monday."), T0 + 5000);
    let early = row("s", 1, &r2, &msg("assistant", "Cancelled."), T0 + 2000);
    // Both successors arrive before the turn: the earliest by event time wins, whatever the order.
    for order in [[&late, &early], [&early, &late]] {
        let mut p = pairer();
        let mut sigs = vec![];
        for (k, r) in order.iter().enumerate() {
            sigs.extend(p.push((*r).clone(), lin(0, k as i64)));
        }
        sigs.extend(p.push(t.clone(), lin(0, 9)));
        let s = sigs.iter().find(|s| s.interaction_id == t.interaction_id).unwrap();
        assert_eq!(s.next_state_text, "[user] No, cancel that.");
        assert!(s.correction_cue);
        assert_eq!(p.counters().extra_continuations, 1);
    }
}

#[test]
fn a_successor_written_before_the_turn_is_never_paired() {
    let req = vec![msg("user", "hi")];
    let resp = msg("assistant", "hello");
    let t = row("s", 0, &req, &resp, T0 + 10_000);
    let mut r1 = req.clone();
    r1.push(resp.clone());
    r1.push(msg("user", "again"));
    let before = row("s", 1, &r1, &msg("assistant", "x"), T0);
    let mut p = pairer();
    assert!(p.push(before, lin(0, 0)).is_empty());
    assert!(p.push(t.clone(), lin(0, 1)).is_empty());
    assert_eq!(p.counters().successor_before_turn, 1);
    let sigs = p.finish();
    let s = sigs.iter().find(|s| s.interaction_id == t.interaction_id).unwrap();
    assert_eq!(s.kind, NextStateKind::None);
}

#[test]
fn done_and_idle_sessions_exclude_their_unpaired_turns() {
    let req = vec![msg("user", "q")];
    let mut last = row("d", 0, &req, &msg("assistant", "a"), T0);
    last.session_done = true;
    let mut p = pairer();
    let sigs = p.push(last, lin(3, 40));
    assert_eq!(sigs.len(), 1);
    assert_eq!(sigs[0].excluded_reason.as_deref(), Some("session done without next state"));
    assert_eq!(sigs[0].next_state, "[]");
    assert_eq!(p.open_sessions(), 0, "a complete done session is closed at once");

    let idle = row("i", 0, &req, &msg("assistant", "a"), T0);
    assert!(p.push(idle, lin(3, 41)).is_empty());
    assert_eq!(p.safe_commit_offsets(), HashMap::from([(3, 41)]));
    assert!(p.advance_watermark(T0 + 30 * 60 * 1000).is_empty(), "not idle yet at exactly the gap");
    let sigs = p.advance_watermark(T0 + 30 * 60 * 1000 + 1);
    assert_eq!(sigs.len(), 1);
    assert_eq!(sigs[0].excluded_reason.as_deref(), Some("session idle for 1800 s without next state"));
    assert!(p.safe_commit_offsets().is_empty());
    assert_eq!(p.counters().sessions_idle, 1);
    assert_eq!(p.counters().sessions_done, 1);
}

#[test]
fn duplicates_side_turns_and_invalid_rows_are_counted() {
    let req = vec![msg("user", "q")];
    let r = row("s", 0, &req, &msg("assistant", "a"), T0);
    let mut side = row("s", 1, &[msg("user", "HEARTBEAT")], &msg("assistant", "ok"), T0);
    side.turn_type = TurnType::Side;
    let mut bad = row("s", 2, &req, &msg("assistant", "b"), T0);
    bad.request_messages = "{not json".into();
    let mut p = pairer();
    assert!(p.push(r.clone(), lin(0, 0)).is_empty());
    assert!(p.push(r, lin(0, 1)).is_empty());
    assert!(p.push(side, lin(0, 2)).is_empty());
    let s = p.push(bad, lin(0, 3));
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].excluded_reason.as_deref(), Some("request_messages or tool_calls is not valid JSON"));
    let c = p.counters();
    assert_eq!((c.rows, c.duplicates, c.side_turns, c.main_turns), (4, 1, 1, 2));
    assert_eq!(c.excluded_by_reason.get("invalid_row"), Some(&1));
}

#[test]
fn safe_commit_offsets_stay_below_every_open_session_and_every_closed_one_spanning_them() {
    let conv = conversation("s", &[0, 0, 0], false, false, false, false, &[]);
    let mut p = pairer();
    // Turn 2 arrives first (offset 10 on partition 1): it waits as a turn and as a successor.
    p.push(conv.rows[2].clone(), lin(1, 10));
    assert_eq!(p.safe_commit_offsets(), HashMap::from([(1, 10)]));
    assert_eq!(p.held_rows(), 2, "waiting as a turn and as a successor");
    p.push(conv.rows[0].clone(), lin(1, 11));
    // Turn 1 pairs turn 0 and is paired by turn 2: only turn 2 (waiting) is held, but the open
    // session's first row is the restart point on each partition it has rows on.
    let sigs = p.push(conv.rows[1].clone(), lin(2, 5));
    assert_eq!(sigs.len(), 2);
    assert_eq!(p.held_rows(), 1);
    assert_eq!(p.safe_commit_offsets(), HashMap::from([(1, 10), (2, 5)]));

    // Partition 7: session a (offsets 0 and 3) closes; session b opened at 2 stays open; session c
    // (1..=5) closes. Restart at 2 would see a and c without their first rows, so the safe offset is 0.
    let req = vec![msg("user", "q")];
    let mut q = pairer();
    let r = |sid: &str, turn: i32, t: i64| row(sid, turn, &req, &msg("assistant", &format!("{sid}{turn}")), t);
    let done = |sid: &str, turn: i32, t: i64| {
        let mut x = r(sid, turn, t);
        x.session_done = true;
        x
    };
    q.push(r("a", 0, T0), lin(7, 0));
    q.push(r("c", 0, T0), lin(7, 1));
    q.push(r("b", 0, T0), lin(7, 2));
    q.push(done("a", 1, T0), lin(7, 3));
    q.push(done("c", 1, T0), lin(7, 5));
    assert_eq!(q.open_sessions(), 1);
    assert_eq!(q.safe_commit_offsets(), HashMap::from([(7, 0)]));
    // Once b closes, nothing is open: everything read may be committed.
    q.push(done("b", 1, T0), lin(7, 6));
    assert!(q.safe_commit_offsets().is_empty());
}

#[test]
fn idle_closes_use_each_rows_own_event_time_so_an_older_log_read_later_still_pairs() {
    // A 2026 session left open, then a whole 2025 session read after it on the same partition.
    let new = conversation("new", &[0, 0], false, false, false, false, &[]);
    let mut old = conversation("old", &[0, 0, 0], false, false, false, false, &[]);
    for r in &mut old.rows {
        r.event_time -= 365 * 24 * 3600 * 1000;
    }
    let mut p = pairer();
    let mut sigs = vec![];
    for (k, r) in new.rows.iter().take(1).chain(old.rows.iter()).enumerate() {
        sigs.extend(p.push(r.clone(), lin(0, k as i64)));
    }
    assert_eq!(sigs.len(), 2, "old turns 0 and 1 pair; nothing of the newer session is closed by older rows");
    assert!(sigs.iter().all(|s| s.session_id == "old" && s.excluded_reason.is_none()));
    // The newer session's next row still pairs its turn; it closes the older one, idle for a year.
    sigs = p.push(new.rows[1].clone(), lin(0, 9));
    let ids: Vec<(&str, i32, bool)> = sigs.iter().map(|s| (s.session_id.as_str(), s.turn_index, s.excluded_reason.is_some())).collect();
    assert_eq!(ids, vec![("new", 0, false), ("old", 2, true)]);
}

/// Rows of several sessions spread over partitions: each session on one partition, with random start
/// times (some a year older, some more than the idle gap apart), a pause longer than the idle gap
/// inside some sessions, done flags, duplicate rows, any order within a partition.
fn partitioned_rows() -> impl Strategy<Value = Vec<Vec<Interaction>>> {
    let session = (prop::collection::vec(0u8..3, 1..5), any::<bool>(), 0u8..4, 0usize..6, 0u8..3, any::<bool>());
    (prop::collection::vec(session, 1..6), 1usize..4)
        .prop_map(|(sessions, n_parts)| {
            let mut parts: Vec<Vec<Interaction>> = vec![vec![]; n_parts];
            for (i, (kinds, done, start, pause_at, dup, repetitive)) in sessions.into_iter().enumerate() {
                let conv = conversation(&format!("s{i}"), &kinds, repetitive, false, done, false, &[]);
                let shift = [0, -365 * 24 * 3600 * 1000, 40 * 60 * 1000, 3600 * 1000][start as usize];
                let mut rows: Vec<Interaction> = conv.rows;
                for (t, r) in rows.iter_mut().enumerate() {
                    r.event_time += shift + if t >= pause_at { 45 * 60 * 1000 } else { 0 };
                }
                if dup > 0 {
                    let d = rows[dup as usize % rows.len()].clone();
                    rows.push(d);
                }
                parts[i % n_parts].extend(rows);
            }
            parts
        })
        .prop_flat_map(|parts| parts.into_iter().map(|p| Just(p).prop_shuffle()).collect::<Vec<_>>())
}

fn clock() -> i64 {
    T0 + 99
}

/// Rows of partition `p` from `from` on, with their lineage.
fn read(parts: &[Vec<Interaction>], p: usize, from: usize) -> impl Iterator<Item = (Interaction, Lineage)> + '_ {
    parts[p].iter().enumerate().skip(from).map(move |(o, r)| (r.clone(), lin(p as i32, o as i64)))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Whatever the interleaving of partitions, the batch boundaries (where offsets are committed) and
    /// the crashes (a restart from the committed offsets, in a new pairer or by reading the same
    /// partitions again), every signal emitted is the one an uninterrupted run emits for that turn,
    /// and the same turns get one.
    #[test]
    fn signals_do_not_depend_on_batches_interleaving_or_restarts(
        parts in partitioned_rows(),
        schedule in prop::collection::vec((0usize..4, 0u8..10), 1..200),
    ) {
        // Keyed by the turn's row (a duplicate row read after its session closed opens it again and
        // gets its own signal, as the module doc says).
        let key = |s: &Signal| (s.interaction_id.clone(), s.source_partition, s.source_offset);
        let mut reference: HashMap<(String, Option<i32>, Option<i64>), Signal> = HashMap::new();
        let mut whole = PartitionedPairer::with_clock(SignalConfig::default(), clock);
        for p in 0..parts.len() {
            for (r, l) in read(&parts, p, 0) {
                for (s, turn) in whole.push(r, l) {
                    prop_assert_eq!(turn.map(|t| t.interaction_id), Some(s.interaction_id.clone()));
                    prop_assert!(reference.insert(key(&s), s).is_none(), "one signal per row of a turn");
                }
            }
        }

        let mut pairer = PartitionedPairer::with_clock(SignalConfig::default(), clock);
        let mut pos = vec![0usize; parts.len()];
        let mut committed = vec![0usize; parts.len()];
        let mut seen: HashMap<(String, Option<i32>, Option<i64>), Signal> = HashMap::new();
        let (mut step, mut crashes) = (0, 0);
        loop {
            // Read a few rows of one partition; then commit (batch end), sometimes crash.
            let (pick, action) = schedule[step % schedule.len()];
            step += 1;
            let open: Vec<usize> = (0..parts.len()).filter(|&p| pos[p] < parts[p].len()).collect();
            if open.is_empty() {
                break;
            }
            let p = open[pick % open.len()];
            for (r, l) in read(&parts, p, pos[p]).take(1 + action as usize % 3) {
                pos[p] += 1;
                for (s, _) in pairer.push(r, l) {
                    prop_assert_eq!(Some(&s), reference.get(&key(&s)), "a signal the uninterrupted run did not emit");
                    seen.insert(key(&s), s);
                }
            }
            if action < 7 {
                // As the stage runner does: commit the partitions of the batch, up to the hold.
                let hold = pairer.safe_commit_offsets();
                let next = hold.get(&(p as i32)).map_or(pos[p], |&h| (h as usize).min(pos[p]));
                prop_assert!(next >= committed[p], "commits never go back");
                committed[p] = next;
            }
            // At most three crashes, so every run ends.
            match action {
                8 | 9 if crashes < 3 => crashes += 1,
                _ => continue,
            }
            if action == 8 {
                pairer = PartitionedPairer::with_clock(SignalConfig::default(), clock);
            }
            pos.clone_from(&committed);
        }
        let mut want: Vec<_> = reference.keys().collect();
        let mut got: Vec<_> = seen.keys().collect();
        want.sort();
        got.sort();
        prop_assert_eq!(got, want, "the same turns get a signal");
    }
}
#[test]
fn echo_differences_do_not_break_pairing() {
    let req = vec![msg("user", "2+2?")];
    let mut resp = msg("assistant", "4\n");
    resp.reasoning = Some("add".into());
    let t = row("s", 0, &req, &resp, T0);
    let mut next = req.clone();
    next.push(msg("assistant", "4")); // echoed without reasoning or trailing newline
    next.push(msg("user", "thanks, perfect"));
    let t1 = row("s", 1, &next, &msg("assistant", "welcome"), T0 + 1);
    let mut p = pairer();
    p.push(t, lin(0, 0));
    let sigs = p.push(t1, lin(0, 1));
    assert_eq!(sigs.len(), 1);
    assert!(sigs[0].thanks_cue);
    assert_eq!(sigs[0].kind, NextStateKind::User);
}

#[test]
fn config_defaults_and_rejects_unknown_fields() {
    assert_eq!(SignalConfig::default().idle_gap_ms, 1_800_000);
    let c: SignalConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(c, SignalConfig::default());
    assert!(serde_json::from_str::<SignalConfig>(r#"{"idle_gap": 1}"#).is_err());
}

/// Issue 41: two tenants that send the same session id are two sessions: each turn's next state is its
/// own tenant's reply, never the other tenant's request that follows it in the stream.
#[test]
fn two_tenants_with_one_session_id_are_paired_apart() {
    let mut p = pairer();
    let q = msg("user", "hi");
    let of = |tenant: &str, turn: i32, req: &[Message], resp: &str, t: i64| Interaction { tenant: Some(tenant.into()), ..row("s", turn, req, &msg("assistant", resp), t) };
    let mut out = vec![];
    out.extend(p.push(of("alice", 0, &[q.clone()], "hello alice", T0), lin(0, 0)));
    out.extend(p.push(of("bob", 0, &[q.clone()], "hello bob", T0 + 1), lin(0, 1)));
    out.extend(p.push(of("bob", 1, &[q.clone(), msg("assistant", "hello bob"), msg("user", "thanks, bob here")], "welcome", T0 + 2), lin(0, 2)));
    out.extend(p.push(of("alice", 1, &[q.clone(), msg("assistant", "hello alice"), msg("user", "no, wrong")], "sorry", T0 + 3), lin(0, 3)));
    let turn0: Vec<(String, String)> = out.iter().filter(|s| s.turn_index == 0).map(|s| (s.tenant.clone().unwrap(), s.next_state_text.clone())).collect();
    assert_eq!(turn0, vec![("bob".to_string(), "[user] thanks, bob here".to_string()), ("alice".to_string(), "[user] no, wrong".to_string())]);
}
