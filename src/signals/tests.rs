use super::*;
use crate::schema::ToolCall;
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
    assert_eq!(p.min_open_offset(), HashMap::from([(3, 41)]));
    assert!(p.advance_watermark(T0 + 30 * 60 * 1000).is_empty(), "not idle yet at exactly the gap");
    let sigs = p.advance_watermark(T0 + 30 * 60 * 1000 + 1);
    assert_eq!(sigs.len(), 1);
    assert_eq!(sigs[0].excluded_reason.as_deref(), Some("session idle for 1800 s without next state"));
    assert!(p.min_open_offset().is_empty());
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
fn min_open_offset_tracks_waiting_turns_and_orphan_successors() {
    let conv = conversation("s", &[0, 0, 0], false, false, false, false, &[]);
    let mut p = pairer();
    // Turn 2 arrives first (offset 10 on partition 1): it waits as a turn and as a successor.
    p.push(conv.rows[2].clone(), lin(1, 10));
    assert_eq!(p.min_open_offset(), HashMap::from([(1, 10)]));
    assert_eq!(p.held_rows(), 2, "waiting as a turn and as a successor");
    p.push(conv.rows[0].clone(), lin(1, 11));
    assert_eq!(p.min_open_offset(), HashMap::from([(1, 10)]));
    // Turn 1 pairs turn 0 and is paired by turn 2: only turn 2 (waiting) remains.
    let sigs = p.push(conv.rows[1].clone(), lin(2, 5));
    assert_eq!(sigs.len(), 2);
    assert_eq!(p.min_open_offset(), HashMap::from([(1, 10)]));
    assert_eq!(p.held_rows(), 1);
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
