//! One test per row of the docs/method.md §5 table, the §4 value checks, and the at-most-one-sample
//! property.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::schema::{HintCandidate, Vote};

const IID: &str = "turn-1";

fn interaction(turn_type: TurnType) -> Interaction {
    Interaction {
        interaction_id: IID.into(),
        turn_type,
        policy_version: Some(9),
        finish_reason: Some("stop".into()),
        prompt_token_ids: Some(vec![1, 2]),
        response_token_ids: Some(vec![10, 11, 12]),
        rollout_logprobs: Some(vec![-0.5, -1.0, -0.25]),
        source_format: "proxy".into(),
        ingest_time: 2_000,
        ..Interaction::new("s1", 4, "[]", "abc", 1_000)
    }
}

/// `i` as the teacher stage receives it: read from the `interactions` topic at partition 2, offset 77
/// by the signals stage's pairer, which hands the row on with its signal (the row's own next state
/// completes the signal at once).
fn read_by_signals_stage(i: Interaction) -> Interaction {
    assert_eq!((i.source_topic.as_deref(), i.source_partition, i.source_offset), (None, None, None), "the lake's row has no Kafka position");
    let row = Interaction { next_state: Some(r#"[{"role":"user","content":"thanks"}]"#.into()), ..i };
    let lineage = crate::schema::Lineage { source_topic: Some("interactions".into()), source_partition: Some(2), source_offset: Some(77), ..Default::default() };
    let mut out = crate::signals::PartitionedPairer::new(crate::signals::SignalConfig::default()).push(row, lineage);
    assert_eq!(out.len(), 1, "one signal for the turn");
    let (signal, turn) = out.remove(0);
    assert_eq!((signal.source_partition, signal.source_offset), (Some(2), Some(77)));
    turn.expect("the pairer hands on the turn's row")
}

fn judgment(score: i32) -> Judgment {
    Judgment {
        schema_version: 1,
        judgment_id: "j1".into(),
        pipeline: "p".into(),
        interaction_id: IID.into(),
        session_id: "s1".into(),
        tenant: None,
        turn_index: 4,
        policy_version: Some(9),
        votes: vec![Vote { index: 0, raw: format!("\\boxed{{{score}}}"), value: Some(score), error: None, cached: false }],
        m: 1,
        valid_votes: 1,
        tie: false,
        score,
        judge_backend: "rules".into(),
        judge_model: "rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        temperature: 0.6,
        max_tokens: 16,
        cache_hits: 0,
        event_time: 1_000,
        processed_time: 3_000,
    }
}

fn hint(accepted: bool) -> HintRecord {
    let h = "Use the v2 endpoint.".to_string();
    HintRecord {
        schema_version: 1,
        hint_id: "h1".into(),
        pipeline: "p".into(),
        interaction_id: IID.into(),
        session_id: "s1".into(),
        tenant: None,
        turn_index: 4,
        candidates: vec![HintCandidate {
            index: 0,
            raw: String::new(),
            score: Some(if accepted { 1 } else { -1 }),
            hint: accepted.then(|| h.clone()),
            error: None,
            cached: false,
        }],
        strategy: "longest".into(),
        chosen_hint: accepted.then_some(h),
        chosen_index: accepted.then_some(0),
        reason: String::new(),
        hint_backend: "rules".into(),
        hint_model: "hint-rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        teacher_messages: None,
        teacher_prompt_text: None,
        cache_hits: 0,
        event_time: 1_000,
        processed_time: 3_000,
    }
}

fn teacher(lps: Vec<f32>) -> TeacherLogprobs {
    TeacherLogprobs {
        schema_version: 1,
        teacher_id: "t1".into(),
        pipeline: "p".into(),
        interaction_id: IID.into(),
        session_id: "s1".into(),
        tenant: None,
        turn_index: 4,
        teacher_model: "m".into(),
        teacher_version: 0,
        teacher_prompt_token_ids: vec![1, 2, 99],
        response_token_ids: vec![10, 11, 12],
        teacher_logprobs: lps,
        topk_ids: None,
        topk_logprobs: None,
        student_topk_ids: None,
        logprobs_at_student_topk: None,
        event_time: 1_000,
        processed_time: 3_000,
    }
}

const PROMPT: [i32; 2] = [1, 2];
const RESP: [i32; 3] = [10, 11, 12];
const ROLL: [f32; 3] = [-0.5, -1.0, -0.25];
const TEACH: [f32; 3] = [-0.1, -2.0, -0.3];

fn run(method: Method, j: Option<&Judgment>, h: Option<&HintRecord>, t: Option<&TeacherLogprobs>) -> Result<SampleOutcome> {
    assemble(method, &SampleConfig::default(), &read_by_signals_stage(interaction(TurnType::Main)), j, h, t, &PROMPT, &RESP, &ROLL, "demo")
}

fn sample(o: Result<SampleOutcome>) -> Sample {
    match o {
        Ok(SampleOutcome::Sample(s)) => s,
        other => panic!("expected a sample, got {other:?}"),
    }
}

fn none(o: Result<SampleOutcome>) -> NoSampleReason {
    match o {
        Ok(SampleOutcome::NoSample { reason }) => reason,
        other => panic!("expected no sample, got {other:?}"),
    }
}

#[test]
fn binary_with_score_pm1_is_a_sample_with_r_score() {
    for score in [1, -1] {
        let s = sample(run(Method::Binary, Some(&judgment(score)), Some(&hint(true)), Some(&teacher(TEACH.to_vec()))));
        assert_eq!(s.sample_type, SampleType::Binary);
        assert_eq!(s.reward, score as f32);
        assert_eq!(s.method, "binary");
        assert_eq!(s.teacher_logprobs, None);
        assert_eq!((s.judgment_id.as_deref(), s.hint_id.as_deref(), s.teacher_id.as_deref()), (Some("j1"), None, None));
        assert_eq!(s.prompt_token_ids, PROMPT);
        assert_eq!(s.response_token_ids, RESP);
        assert_eq!(s.loss_mask, [1, 1, 1]);
        assert_eq!(s.rollout_logprobs, ROLL);
        assert!(!s.rollout_logprobs_recomputed);
        assert_eq!(s.policy_version, Some(9));
        assert_eq!((s.session_id.as_str(), s.turn_index), ("s1", 4));
        assert_eq!((s.source_topic.as_deref(), s.source_partition, s.source_offset), (Some("interactions"), Some(2), Some(77)));
        assert_eq!(s.event_time, 1_000);
        assert_eq!(s.sample_id, sample_id(IID, "demo", Method::Binary, &SampleConfig::default()));
    }
}

#[test]
fn binary_with_score_0_or_no_judgment_is_no_sample() {
    assert_eq!(none(run(Method::Binary, Some(&judgment(0)), None, None)), NoSampleReason::ZeroScore);
    assert_eq!(none(run(Method::Binary, None, Some(&hint(true)), None)), NoSampleReason::NoJudgment);
}

#[test]
fn opd_with_accepted_hint_uses_teacher_logprobs() {
    let s = sample(run(Method::Opd, Some(&judgment(-1)), Some(&hint(true)), Some(&teacher(TEACH.to_vec()))));
    assert_eq!(s.sample_type, SampleType::Opd);
    assert_eq!(s.reward, 0.0);
    assert_eq!(s.teacher_logprobs.as_deref(), Some(&TEACH[..]));
    assert_eq!((s.judgment_id.as_deref(), s.hint_id.as_deref(), s.teacher_id.as_deref()), (None, Some("h1"), Some("t1")));
}

#[test]
fn opd_without_accepted_hint_is_no_sample() {
    assert_eq!(none(run(Method::Opd, Some(&judgment(1)), Some(&hint(false)), None)), NoSampleReason::NoHint);
    assert_eq!(none(run(Method::Opd, Some(&judgment(1)), None, None)), NoSampleReason::NoHint);
}

#[test]
fn combined_hint_and_score() {
    let s = sample(run(Method::Combined, Some(&judgment(-1)), Some(&hint(true)), Some(&teacher(TEACH.to_vec()))));
    assert_eq!(s.sample_type, SampleType::CombinedBoth);
    assert_eq!(s.reward, -1.0);
    assert_eq!(s.teacher_logprobs.as_deref(), Some(&TEACH[..]));
    assert_eq!((s.judgment_id.as_deref(), s.hint_id.as_deref(), s.teacher_id.as_deref()), (Some("j1"), Some("h1"), Some("t1")));
}

#[test]
fn combined_hint_only_has_r_0() {
    for j in [Some(judgment(0)), None] {
        let s = sample(run(Method::Combined, j.as_ref(), Some(&hint(true)), Some(&teacher(TEACH.to_vec()))));
        assert_eq!(s.sample_type, SampleType::CombinedHintOnly);
        assert_eq!(s.reward, 0.0);
        assert_eq!(s.teacher_logprobs.as_deref(), Some(&TEACH[..]));
    }
}

#[test]
fn combined_score_only_uses_rollout_as_teacher() {
    let s = sample(run(Method::Combined, Some(&judgment(1)), Some(&hint(false)), None));
    assert_eq!(s.sample_type, SampleType::CombinedScoreOnly);
    assert_eq!(s.reward, 1.0);
    assert_eq!(s.teacher_logprobs.as_deref(), Some(&ROLL[..]));
    assert_eq!((s.teacher_id, s.topk_ids), (None, None));
    assert_eq!(s.hint_id.as_deref(), Some("h1"));
    // A teacher row given anyway is ignored (no accepted hint).
    let s = sample(run(Method::Combined, Some(&judgment(1)), None, Some(&teacher(TEACH.to_vec()))));
    assert_eq!(s.teacher_logprobs.as_deref(), Some(&ROLL[..]));
}

#[test]
fn combined_neither_is_no_sample() {
    assert_eq!(none(run(Method::Combined, Some(&judgment(0)), Some(&hint(false)), None)), NoSampleReason::NoSignal);
    assert_eq!(none(run(Method::Combined, None, None, None)), NoSampleReason::NoSignal);
}

#[test]
fn side_turns_empty_and_truncated_responses() {
    let side = interaction(TurnType::Side);
    let o = assemble(Method::Binary, &SampleConfig::default(), &side, Some(&judgment(1)), None, None, &PROMPT, &RESP, &ROLL, "p");
    assert_eq!(none(o), NoSampleReason::SideTurn);
    let main = interaction(TurnType::Main);
    let o = assemble(Method::Binary, &SampleConfig::default(), &main, Some(&judgment(1)), None, None, &PROMPT, &[], &[], "p");
    assert_eq!(none(o), NoSampleReason::EmptyResponse);
    let mut cut = interaction(TurnType::Main);
    cut.truncated = true;
    let skip = SampleConfig { skip_truncated: true, ..SampleConfig::default() };
    let o = assemble(Method::Binary, &skip, &cut, Some(&judgment(1)), None, None, &PROMPT, &RESP, &ROLL, "p");
    assert_eq!(none(o), NoSampleReason::Truncated);
    // Without skip_truncated the sample is made and says it was cut (the trainer's quarantine reads it).
    let o = assemble(Method::Binary, &SampleConfig::default(), &cut, Some(&judgment(1)), None, None, &PROMPT, &RESP, &ROLL, "p");
    let s = sample(o);
    assert_eq!((s.reward, s.truncated), (1.0, Some(true)));
    let o = assemble(Method::Binary, &SampleConfig::default(), &main, Some(&judgment(1)), None, None, &PROMPT, &RESP, &ROLL, "p");
    assert_eq!(sample(o).truncated, Some(false));
}

#[test]
fn one_token_response() {
    let mut i = interaction(TurnType::Main);
    i.response_token_ids = Some(vec![42]);
    i.rollout_logprobs = None;
    let mut t = teacher(vec![-0.7]);
    t.response_token_ids = vec![42];
    let o = assemble(Method::Combined, &SampleConfig::default(), &i, Some(&judgment(1)), Some(&hint(true)), Some(&t), &PROMPT, &[42], &[-0.3], "p");
    let s = sample(o);
    assert_eq!((s.response_token_ids, s.loss_mask, s.rollout_logprobs), (vec![42], vec![1], vec![-0.3]));
    assert_eq!(s.teacher_logprobs, Some(vec![-0.7]));
    assert!(s.rollout_logprobs_recomputed);
}

#[test]
fn length_mismatches_are_typed_errors() {
    let i = interaction(TurnType::Main);
    let cfg = SampleConfig::default();
    let e = assemble(Method::Binary, &cfg, &i, Some(&judgment(1)), None, None, &PROMPT, &RESP, &ROLL[..2], "p").unwrap_err();
    assert!(matches!(e, Error::LogprobLenMismatch { expected: 3, got: 2 }), "{e}");
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&teacher(vec![-0.1, -0.2, -0.3, -0.4]))).unwrap_err();
    assert!(matches!(e, Error::LogprobLenMismatch { expected: 3, got: 4 }), "{e}");
    assert_eq!(e.domain(), crate::error::Domain::User);
    // The teacher scored other tokens.
    let mut t = teacher(TEACH.to_vec());
    t.response_token_ids = vec![10, 13, 12];
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&t)).unwrap_err();
    assert_eq!(e.to_string(), "invalid input: teacher row t1 response_token_ids: token 1 is 13, the response's is 11");
    // The resolved response ids differ from the interaction's own.
    let e = assemble(Method::Binary, &cfg, &i, Some(&judgment(1)), None, None, &PROMPT, &[10, 11], &ROLL[..2], "p").unwrap_err();
    assert_eq!(e.to_string(), "invalid input: interaction turn-1 response_token_ids: 3 tokens, the response has 2");
}

#[test]
fn non_finite_values_are_rejected_not_zeroed() {
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&teacher(vec![-0.1, f32::NAN, -0.3]))).unwrap_err();
    assert!(matches!(e, Error::NonFinite { what: "teacher log-prob", position: 1 }), "{e}");
    assert_eq!(e.to_string(), "non-finite teacher log-prob at position 1");
    let e = run(Method::Combined, Some(&judgment(1)), Some(&hint(true)), Some(&teacher(vec![-0.1, -0.2, f32::NEG_INFINITY]))).unwrap_err();
    assert!(matches!(e, Error::NonFinite { what: "teacher log-prob", position: 2 }), "{e}");
    let i = interaction(TurnType::Main);
    let e = assemble(Method::Binary, &SampleConfig::default(), &i, Some(&judgment(1)), None, None, &PROMPT, &RESP, &[f32::INFINITY, -1.0, -0.2], "p")
        .unwrap_err();
    assert!(matches!(e, Error::NonFinite { what: "rollout log-prob", position: 0 }), "{e}");
}

#[test]
fn topk_is_carried_and_checked() {
    let mut t = teacher(TEACH.to_vec());
    t.topk_ids = Some(vec![vec![10, 5], vec![11, 6], vec![12, 7]]);
    t.topk_logprobs = Some(vec![vec![-0.1, -3.0], vec![-2.0, -0.2], vec![-0.3, -1.5]]);
    let s = sample(run(Method::Opd, None, Some(&hint(true)), Some(&t)));
    assert_eq!(s.topk_ids, t.topk_ids);
    assert_eq!(s.topk_logprobs, t.topk_logprobs);
    let drop = SampleConfig { keep_topk: false, ..SampleConfig::default() };
    let o = assemble(Method::Opd, &drop, &interaction(TurnType::Main), None, Some(&hint(true)), Some(&t), &PROMPT, &RESP, &ROLL, "p");
    assert_eq!(sample(o).topk_ids, None);
    assert_ne!(sample_id(IID, "p", Method::Opd, &drop), sample_id(IID, "p", Method::Opd, &SampleConfig::default()));

    let mut bad = t.clone();
    bad.topk_logprobs = Some(vec![vec![-0.1, -3.0], vec![-2.0, f32::NAN], vec![-0.3, -1.5]]);
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&bad)).unwrap_err();
    assert!(matches!(e, Error::NonFinite { what: "teacher top-K log-prob", position: 1 }), "{e}");
    let mut bad = t.clone();
    bad.topk_ids = Some(vec![vec![10, 5], vec![11]]);
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&bad)).unwrap_err();
    assert!(matches!(e, Error::LogprobLenMismatch { expected: 3, got: 2 }), "{e}");
    let mut bad = t.clone();
    bad.topk_ids = Some(vec![vec![10, 5], vec![11], vec![12, 7]]);
    let e = run(Method::Opd, None, Some(&hint(true)), Some(&bad)).unwrap_err();
    assert_eq!(e.to_string(), "invalid input: top-K row 1 has 1 ids and 2 log-probs, expected K = 2");
    let mut bad = t;
    bad.topk_logprobs = None;
    assert!(run(Method::Opd, None, Some(&hint(true)), Some(&bad)).is_err());
}

#[test]
fn inconsistent_inputs_are_rejected() {
    let e = run(Method::Opd, None, Some(&hint(true)), None).unwrap_err();
    assert_eq!(e.to_string(), "invalid input: hint h1 was accepted for interaction turn-1 but no teacher log-probs were given");
    let mut j = judgment(1);
    j.interaction_id = "other".into();
    let e = run(Method::Binary, Some(&j), None, None).unwrap_err();
    assert_eq!(e.to_string(), "invalid input: judgment is for interaction other, not turn-1");
    let e = run(Method::Binary, Some(&judgment(2)), None, None).unwrap_err();
    assert_eq!(e.to_string(), "invalid input: judgment j1 has score 2, not one of -1, 0, 1");
}

#[test]
fn sample_ids_differ_by_method_and_pipeline() {
    let c = SampleConfig::default();
    let ids: HashSet<String> = [
        sample_id(IID, "a", Method::Binary, &c),
        sample_id(IID, "a", Method::Opd, &c),
        sample_id(IID, "a", Method::Combined, &c),
        sample_id(IID, "b", Method::Binary, &c),
        sample_id("turn-2", "a", Method::Binary, &c),
    ]
    .into_iter()
    .collect();
    assert_eq!(ids.len(), 5);
}

#[test]
fn config_table() {
    let c: SampleConfig = toml::from_str("skip_truncated = true").unwrap();
    assert_eq!(c, SampleConfig { keep_topk: true, skip_truncated: true });
    assert!(toml::from_str::<SampleConfig>("topk = false").is_err());
    let m: HashMap<String, Method> = toml::from_str("method = \"combined\"").unwrap();
    assert_eq!(m["method"], Method::Combined);
}

/// One generated turn: its type, judgment score (None: no judgment), hint state (None: no record).
#[derive(Debug, Clone)]
struct Case {
    id: usize,
    main: bool,
    score: Option<i32>,
    hint: Option<bool>,
    t: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (0usize..6, any::<bool>(), proptest::option::of(-1i32..=1), proptest::option::of(any::<bool>()), 1usize..5)
        .prop_map(|(id, main, score, hint, t)| Case { id, main, score, hint, t })
}

fn assemble_case(method: Method, c: &Case) -> Result<SampleOutcome> {
    let iid = format!("turn-{}", c.id);
    let mut i = interaction(if c.main { TurnType::Main } else { TurnType::Side });
    i.interaction_id = iid.clone();
    let resp: Vec<i32> = (0..c.t as i32).map(|x| 100 + x).collect();
    let roll: Vec<f32> = (0..c.t).map(|x| -0.1 * (x as f32 + 1.0)).collect();
    i.response_token_ids = Some(resp.clone());
    let j = c.score.map(|s| Judgment { interaction_id: iid.clone(), ..judgment(s) });
    let h = c.hint.map(|a| HintRecord { interaction_id: iid.clone(), ..hint(a) });
    let t = TeacherLogprobs {
        interaction_id: iid.clone(),
        response_token_ids: resp.clone(),
        teacher_logprobs: roll.iter().map(|v| v - 0.5).collect(),
        ..teacher(vec![])
    };
    assemble(method, &SampleConfig::default(), &i, j.as_ref(), h.as_ref(), Some(&t), &PROMPT, &resp, &roll, "prop")
}

proptest! {
    /// Replaying any stream of turn records (with duplicates, in any order) through `assemble` yields
    /// at most one distinct sample per main turn and none for side turns; every sample matches the
    /// §5 table and has one mask/log-prob entry per response token.
    #[test]
    fn at_most_one_sample_per_main_turn(cases in proptest::collection::vec(case(), 1..30), m in 0usize..3) {
        let method = [Method::Binary, Method::Opd, Method::Combined][m];
        // The first record seen for an id fixes that turn's content (replays repeat it).
        let mut turns: HashMap<usize, Case> = HashMap::new();
        let mut per_turn: HashMap<usize, HashSet<String>> = HashMap::new();
        for c in &cases {
            let c = turns.entry(c.id).or_insert_with(|| c.clone()).clone();
            let out = assemble_case(method, &c).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let SampleOutcome::Sample(s) = out else { continue };
            prop_assert!(c.main);
            let t = c.t;
            prop_assert_eq!(s.loss_mask.len(), t);
            prop_assert_eq!(s.rollout_logprobs.len(), t);
            prop_assert!(s.loss_mask.iter().all(|&x| x == 1));
            let hint_ok = c.hint == Some(true);
            let scored = matches!(c.score, Some(1 | -1));
            let r = c.score.unwrap_or(0) as f32;
            let (ty, reward) = match (method, hint_ok, scored) {
                (Method::Binary, _, true) => (SampleType::Binary, r),
                (Method::Opd, true, _) => (SampleType::Opd, 0.0),
                (Method::Combined, true, true) => (SampleType::CombinedBoth, r),
                (Method::Combined, true, false) => (SampleType::CombinedHintOnly, 0.0),
                (Method::Combined, false, true) => (SampleType::CombinedScoreOnly, r),
                other => return Err(TestCaseError::fail(format!("a sample where the table says none: {other:?}"))),
            };
            prop_assert_eq!(s.sample_type, ty);
            prop_assert_eq!(s.reward, reward);
            prop_assert_eq!(s.teacher_logprobs.as_ref().map(Vec::len), (method != Method::Binary).then_some(t));
            per_turn.entry(c.id).or_default().insert(s.sample_id);
        }
        for (id, ids) in &per_turn {
            prop_assert!(ids.len() <= 1, "turn {} yielded {} distinct samples", id, ids.len());
        }
    }
}
