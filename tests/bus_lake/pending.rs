//! Bounded catch-up and teacher cache: the embedded default's re-publishing of each stage's pending
//! input ([`nextstate::stages::pending`]) on small hand-built lakes (done, dead-lettered, other-pipeline,
//! duplicate and orphan rows over several files), the narrow lake reads it uses, and the teacher cache
//! (lake rows over replay-cache rows, token checks).

use std::time::Duration;

use nextstate::bus::{Bus, BusConfig, Carry, Envelope};
use nextstate::lake::Lake;
use nextstate::runtime::InputLoop;
use nextstate::schema::{
    field_refs, schema_of, DeadLetter, HintRecord, Interaction, Judgment, Lineage, NextStateKind, Sample, SampleType, Signal, Table, TeacherLogprobs,
    TurnType,
};
use nextstate::stages::{hint, judge, signals, teacher};
use nextstate::stages::teacher::{TeacherCache, TEACHER_CACHE_DIR};
use serde::Deserialize;

/// 2025-11-24 12:00 UTC, ms.
const T0: i64 = 1_764_000_000_000;

fn turn(session: &str, index: i32, turn_type: TurnType, at: i64) -> Interaction {
    let req = format!(r#"[{{"role":"user","content":"{session} question {index}"}}]"#);
    Interaction { turn_type, ..Interaction::new(session, index, &req, &format!("{session} answer {index}"), T0 + at) }
}

fn signal(i: &Interaction, kind: NextStateKind) -> Signal {
    Signal {
        schema_version: Signal::SCHEMA_VERSION,
        interaction_id: i.interaction_id.clone(),
        session_id: i.session_id.clone(),
        tenant: None,
        turn_index: i.turn_index,
        policy_version: None,
        kind,
        next_state: "[]".into(),
        next_state_text: String::new(),
        next_interaction_id: None,
        excluded_reason: (kind == NextStateKind::None).then(|| "session ended".into()),
        has_error: false,
        exit_code: None,
        correction_cue: false,
        thanks_cue: false,
        success_cue: false,
        // where the signals stage read the turn: the carried interaction takes this position
        source_topic: Some("interactions".into()),
        source_partition: Some(2),
        source_offset: Some(40 + i.turn_index as i64),
        event_time: i.event_time,
        processed_time: i.event_time,
    }
}

fn judgment(i: &Interaction, pipeline: &str, score: i32) -> Judgment {
    Judgment {
        schema_version: Judgment::SCHEMA_VERSION,
        judgment_id: format!("j-{pipeline}-{}-{score}", i.interaction_id),
        pipeline: pipeline.into(),
        interaction_id: i.interaction_id.clone(),
        session_id: i.session_id.clone(),
        tenant: None,
        turn_index: i.turn_index,
        policy_version: None,
        votes: vec![],
        m: 1,
        valid_votes: 1,
        tie: false,
        score,
        judge_backend: "rules".into(),
        judge_model: "rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        temperature: 0.0,
        max_tokens: 16,
        cache_hits: 0,
        event_time: i.event_time,
        processed_time: i.event_time,
    }
}

fn hint(i: &Interaction, pipeline: &str) -> HintRecord {
    HintRecord {
        schema_version: HintRecord::SCHEMA_VERSION,
        hint_id: format!("h-{pipeline}-{}", i.interaction_id),
        pipeline: pipeline.into(),
        interaction_id: i.interaction_id.clone(),
        session_id: i.session_id.clone(),
        tenant: None,
        turn_index: i.turn_index,
        candidates: vec![],
        strategy: "longest".into(),
        chosen_hint: Some("check the sign".into()),
        chosen_index: Some(0),
        reason: "test".into(),
        hint_backend: "rules".into(),
        hint_model: "rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        teacher_messages: None,
        teacher_prompt_text: None,
        cache_hits: 0,
        event_time: i.event_time,
        processed_time: i.event_time,
    }
}

fn sample(i: &Interaction, pipeline: &str) -> Sample {
    Sample {
        sample_id: format!("s-{pipeline}-{}", i.interaction_id),
        pipeline: pipeline.into(),
        interaction_id: i.interaction_id.clone(),
        session_id: i.session_id.clone(),
        turn_index: i.turn_index,
        event_time: i.event_time,
        ..Sample::new(SampleType::Binary, vec![1, 2], vec![3], vec![-0.5], 1.0)
    }
}

fn dead(stage: &str, i: &Interaction) -> DeadLetter {
    let mut d = DeadLetter::new(stage, "test", "test", b"{}", Lineage::default()).with_keys(&i.session_id, Some(&i.interaction_id));
    d.created_time = i.event_time;
    d
}

/// Writes each group as its own file (sequence 1, 2, …: path order = group order).
fn write<T: Table>(lake: &Lake, groups: &[Vec<T>]) {
    for (seq, rows) in groups.iter().enumerate() {
        lake.write_rows(rows, "test", seq as u64 + 1).unwrap();
    }
}

/// An embedded bus with one partition per topic (so the consumed order is the published order).
async fn bus() -> Bus {
    let bus = Bus::connect(BusConfig { partitions: 1, ..Default::default() }).await.unwrap();
    bus.ensure_topics(&["interactions", "signals", "judgments", "hints"]).await.unwrap();
    bus
}

/// The `n` records of table `T` on `bus`, in order.
async fn consume<T: Table>(bus: &Bus, n: usize) -> Vec<Envelope<T>> {
    let mut input = InputLoop::new(bus, &format!("read-{}", T::NAME), &bus.topic(T::NAME)).unwrap();
    let mut got = vec![];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while got.len() < n && tokio::time::Instant::now() < deadline {
        got.extend(input.next_batch(100, Duration::from_millis(300)).await.unwrap());
    }
    // nothing more than the count said
    got.extend(input.next_batch(100, Duration::from_millis(300)).await.unwrap());
    got.iter().map(|m| serde_json::from_slice(&m.payload).unwrap()).collect()
}

fn ids_of(c: &Carry) -> (Option<String>, Option<String>, Option<String>, Option<String>) {
    (
        c.interaction.as_ref().map(|i| i.interaction_id.clone()),
        c.signal.as_ref().map(|s| s.interaction_id.clone()),
        c.judgment.as_ref().map(|j| j.judgment_id.clone()),
        c.hint.as_ref().map(|h| h.hint_id.clone()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_republish_whole_open_sessions_in_session_and_turn_order() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    // b: turn 0 signalled, turn 1 not (open), plus a side turn at the same index and time as turn 1
    let (b0, b1) = (turn("b", 0, TurnType::Main, 0), turn("b", 1, TurnType::Main, 10));
    let b1_side = Interaction { interaction_id: "b1-side".into(), ..turn("b", 1, TurnType::Side, 10) };
    // a: every main turn signalled (closed), an unsignalled side turn does not open it
    let (a0, a1) = (turn("a", 0, TurnType::Main, 0), turn("a", 1, TurnType::Side, 5));
    // c: its only main turn was dead-lettered by the signals stage (handled)
    let c0 = turn("c", 0, TurnType::Main, 0);
    // d: dead-lettered by another stage only: still open; turn 1 also written twice (both published)
    let (d0, d1) = (turn("d", 0, TurnType::Main, 20), turn("d", 1, TurnType::Main, 30));
    write(&lake, &[vec![b1.clone(), d1.clone(), a0.clone(), c0.clone()], vec![b1_side.clone(), b0.clone(), d0.clone(), a1.clone()], vec![d1.clone()]]);
    write(&lake, &[vec![signal(&a0, NextStateKind::User), signal(&b0, NextStateKind::User)]]);
    write(&lake, &[vec![dead("signals", &c0), dead("judge", &d0)]]);

    let bus = bus().await;
    let n = signals::publish_pending(&lake, &bus.producer().unwrap()).await.unwrap();
    assert_eq!(n, 6);
    let got = consume::<Interaction>(&bus, 6).await;
    let order: Vec<(String, i32, TurnType)> = got.iter().map(|e| (e.row.session_id.clone(), e.row.turn_index, e.row.turn_type)).collect();
    let want = vec![
        ("b".to_string(), 0, TurnType::Main),
        // b's two index-1 rows tie on (session, turn, time): lake order, the first file's main turn first
        ("b".to_string(), 1, TurnType::Main),
        ("b".to_string(), 1, TurnType::Side),
        ("d".to_string(), 0, TurnType::Main),
        ("d".to_string(), 1, TurnType::Main),
        ("d".to_string(), 1, TurnType::Main),
    ];
    assert_eq!(order, want);
    assert_eq!(got[0].row, b0, "whole rows");
    assert!(got.iter().all(|e| e.carry.is_none()));

    // nothing pending: nothing published
    write(&lake, &[vec![], vec![], vec![], vec![signal(&b1, NextStateKind::User), signal(&d0, NextStateKind::User), signal(&d1, NextStateKind::Tool)]]);
    let bus = self::bus().await;
    assert_eq!(signals::publish_pending(&lake, &bus.producer().unwrap()).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_republishes_paired_unjudged_signals_with_their_interaction() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let t: Vec<Interaction> = (0..8).map(|k| turn(&format!("s{k}"), k, TurnType::Main, k as i64)).collect();
    // t0 pending; t1 judged by p; t2 judged by another pipeline only (pending); t3 unpaired; t4 judge
    // dead letter; t5 has no interaction in the lake; t6 dead-lettered by the hint stage (pending);
    // t7 pending, its signal written twice (both published)
    write(&lake, &[t.iter().filter(|i| i.turn_index != 5).cloned().collect()]);
    let s = |k: usize, kind| signal(&t[k], kind);
    use NextStateKind::{Environment, Tool, User};
    write(&lake, &[vec![s(7, User), s(6, Tool), s(5, User), s(4, User)], vec![s(3, NextStateKind::None), s(2, Environment), s(1, User), s(0, User), s(7, User)]]);
    write(&lake, &[vec![judgment(&t[1], "p", 1), judgment(&t[2], "q", 1)]]);
    write(&lake, &[vec![dead("judge", &t[4]), dead("hint", &t[6])]]);

    let bus = bus().await;
    assert_eq!(judge::publish_pending(&lake, &bus.producer().unwrap(), "p").await.unwrap(), 5);
    let got = consume::<Signal>(&bus, 5).await;
    let keys: Vec<String> = got.iter().map(|e| e.row.interaction_id.clone()).collect();
    let id = |k: usize| t[k].interaction_id.clone();
    assert_eq!(keys, vec![id(7), id(6), id(2), id(0), id(7)]);
    for e in &got {
        let c = e.carry.as_ref().unwrap();
        assert_eq!(ids_of(c), (Some(e.row.interaction_id.clone()), Some(e.row.interaction_id.clone()), None, None));
        let i = c.interaction.as_ref().unwrap();
        // read at the signal's position, everything else the lake's row
        assert_eq!((i.source_topic.as_deref(), i.source_partition, i.source_offset), (Some("interactions"), Some(2), Some(40 + i.turn_index as i64)));
        assert_eq!(i.request_messages, t[i.turn_index as usize].request_messages);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hint_republishes_unhinted_judgments_or_signals_with_their_carry() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let t: Vec<Interaction> = (0..7).map(|k| turn(&format!("s{k}"), k, TurnType::Main, k as i64)).collect();
    write(&lake, &[t[..3].to_vec(), t[3..].to_vec()]);
    use NextStateKind::{Tool, User};
    let s = |k: usize, kind| signal(&t[k], kind);
    // t4: first paired, then unpaired (the last row counts: not published by OPD);
    // t5: first unpaired, then paired (published once, from its last row); t6 has no signal
    write(&lake, &[vec![s(0, User), s(1, User), s(2, User), s(4, Tool), s(5, NextStateKind::None)], vec![s(3, User), s(4, NextStateKind::None), s(5, Tool)]]);
    // combined: t0 pending; t1 hinted by p; t2 judged by q only; t3 hinted by q only (pending);
    // t5 hint dead letter; t6 judged but without a signal
    write(&lake, &[vec![judgment(&t[3], "p", 1), judgment(&t[0], "p", -1), judgment(&t[1], "p", 1), judgment(&t[2], "q", 1)], vec![judgment(&t[5], "p", 1), judgment(&t[6], "p", 1)]]);
    write(&lake, &[vec![hint(&t[1], "p"), hint(&t[3], "q")]]);
    write(&lake, &[vec![dead("hint", &t[5])]]);

    let bus = bus().await;
    assert_eq!(hint::publish_pending(&lake, &bus.producer().unwrap(), "p", true).await.unwrap(), 2);
    let got = consume::<Judgment>(&bus, 2).await;
    let id = |k: usize| t[k].interaction_id.clone();
    let carries: Vec<_> = got.iter().map(|e| (e.row.judgment_id.clone(), ids_of(e.carry.as_ref().unwrap()))).collect();
    let want = |k: usize, score: i32| {
        let j = format!("j-p-{}-{score}", id(k));
        (j.clone(), (Some(id(k)), Some(id(k)), Some(j), None))
    };
    assert_eq!(carries, vec![want(3, 1), want(0, -1)]);
    assert_eq!(got[0].carry.as_ref().unwrap().signal.as_ref().unwrap().kind, User);

    // OPD over signals: t0 and t2 (hinted by q only) and t3 pending, t1 hinted by p, t4 unpaired at
    // last, t5 dead-lettered; published in lake order of each turn's last row
    let bus = self::bus().await;
    write(&lake, &[vec![], vec![hint(&t[2], "q")]]);
    assert_eq!(hint::publish_pending(&lake, &bus.producer().unwrap(), "p", false).await.unwrap(), 3);
    let got = consume::<Signal>(&bus, 3).await;
    let keys: Vec<_> = got.iter().map(|e| (e.row.interaction_id.clone(), ids_of(e.carry.as_ref().unwrap()))).collect();
    let want = |k: usize| (id(k), (Some(id(k)), Some(id(k)), None, None));
    assert_eq!(keys, vec![want(0), want(2), want(3)]);

    // without the dead letter, t5 is published from its paired last row (and t4 not, unpaired at last)
    let lake2_dir = tempfile::tempdir().unwrap();
    let lake2 = Lake::open(lake2_dir.path()).unwrap();
    write(&lake2, std::slice::from_ref(&t));
    write(&lake2, &[vec![s(5, NextStateKind::None)], vec![s(5, Tool)], vec![s(4, Tool)], vec![s(4, NextStateKind::None)]]);
    let bus = self::bus().await;
    assert_eq!(hint::publish_pending(&lake2, &bus.producer().unwrap(), "p", false).await.unwrap(), 1);
    let got = consume::<Signal>(&bus, 1).await;
    assert_eq!((got.len(), got[0].row.interaction_id.clone(), got[0].row.kind), (1, id(5), Tool));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teacher_republishes_unsampled_hints_or_judgments_with_their_carry() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let t: Vec<Interaction> = (0..7).map(|k| turn(&format!("s{k}"), k, TurnType::Main, k as i64)).collect();
    // t6 is not in the lake
    write(&lake, &[t[..6].to_vec()]);
    write(&lake, &[vec![signal(&t[0], NextStateKind::User), signal(&t[2], NextStateKind::User)]]);
    // t0: judged by p; t4: judged by q only (carries no judgment under p)
    write(&lake, &[vec![judgment(&t[0], "p", 1), judgment(&t[4], "q", 1)]]);
    // hints: t0 pending; t1 sampled by p; t2 of q; t3 pending (no signal, no judgment); t4 sampled by q
    // only (pending); t5 teacher dead letter; t6 without interaction
    write(&lake, &[vec![hint(&t[0], "p"), hint(&t[1], "p"), hint(&t[2], "q")], vec![hint(&t[4], "p"), hint(&t[3], "p"), hint(&t[5], "p"), hint(&t[6], "p")]]);
    write(&lake, &[vec![sample(&t[1], "p"), sample(&t[4], "q")]]);
    write(&lake, &[vec![dead("teacher", &t[5]), dead("judge", &t[3])]]);

    let bus = bus().await;
    assert_eq!(teacher::publish_pending(&lake, &bus.producer().unwrap(), "p", true).await.unwrap(), 3);
    let got = consume::<HintRecord>(&bus, 3).await;
    let id = |k: usize| t[k].interaction_id.clone();
    let keys: Vec<_> = got.iter().map(|e| (e.row.hint_id.clone(), ids_of(e.carry.as_ref().unwrap()))).collect();
    let h = |k: usize| format!("h-p-{}", id(k));
    assert_eq!(
        keys,
        vec![
            (h(0), (Some(id(0)), Some(id(0)), Some(format!("j-p-{}-1", id(0))), Some(h(0)))),
            (h(4), (Some(id(4)), None, None, Some(h(4)))),
            (h(3), (Some(id(3)), None, None, Some(h(3)))),
        ]
    );
    // without a signal the interaction is carried as the lake has it
    let i3 = got[2].carry.as_ref().unwrap().interaction.as_ref().unwrap();
    assert_eq!((i3.source_topic.clone(), i3.source_offset), (None, None));
    assert_eq!(got[0].carry.as_ref().unwrap().interaction.as_ref().unwrap().source_offset, Some(40));

    // binary over judgments of p: t0 (twice: published once, from its last row) and t2 pending, t1
    // sampled, t3 judged by q only, t5 dead-lettered
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    write(&lake, &[t[..6].to_vec()]);
    write(&lake, &[vec![signal(&t[2], NextStateKind::User)]]);
    write(&lake, &[vec![judgment(&t[0], "p", 0), judgment(&t[1], "p", 1), judgment(&t[3], "q", 1)], vec![judgment(&t[2], "p", -1), judgment(&t[0], "p", 1), judgment(&t[5], "p", 1)]]);
    write(&lake, &[vec![sample(&t[1], "p")]]);
    write(&lake, &[vec![dead("teacher", &t[5])]]);
    let bus = self::bus().await;
    assert_eq!(teacher::publish_pending(&lake, &bus.producer().unwrap(), "p", false).await.unwrap(), 2);
    let got = consume::<Judgment>(&bus, 2).await;
    let keys: Vec<_> = got.iter().map(|e| (e.row.judgment_id.clone(), ids_of(e.carry.as_ref().unwrap()))).collect();
    let (j2, j0) = (format!("j-p-{}--1", id(2)), format!("j-p-{}-1", id(0)));
    assert_eq!(keys, vec![(j2.clone(), (Some(id(2)), Some(id(2)), Some(j2), None)), (j0.clone(), (Some(id(0)), None, Some(j0), None))]);
}

fn teacher_row(id: &str, prompt: Vec<i32>, response: Vec<i32>, logprob: f32) -> TeacherLogprobs {
    TeacherLogprobs {
        schema_version: TeacherLogprobs::SCHEMA_VERSION,
        teacher_id: id.into(),
        pipeline: "p".into(),
        interaction_id: format!("i-{id}"),
        session_id: "s".into(),
        tenant: None,
        turn_index: 0,
        teacher_model: "m".into(),
        teacher_version: 0,
        teacher_prompt_token_ids: prompt,
        teacher_logprobs: vec![logprob; response.len()],
        response_token_ids: response,
        topk_ids: None,
        topk_logprobs: None,
        student_topk_ids: None,
        logprobs_at_student_topk: None,
        event_time: T0,
        processed_time: T0,
    }
}

#[test]
fn teacher_cache_prefers_lake_rows_and_checks_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let cache = Lake::open(dir.path().join("_state").join(TEACHER_CACHE_DIR)).unwrap();
    // replay cache: a, b (b also in the lake, with other tokens), c twice (the later file wins)
    write(&cache, &[vec![teacher_row("a", vec![1, 2], vec![3], -1.0), teacher_row("b", vec![1], vec![4], -2.0), teacher_row("c", vec![5], vec![6], -3.0)], vec![teacher_row("c", vec![5], vec![6], -3.5)]]);
    write(&lake, &[vec![teacher_row("d", vec![7], vec![8, 9], -4.0)], vec![teacher_row("b", vec![1, 1], vec![4], -2.5)]]);
    let tc = TeacherCache::load(&lake).unwrap();
    assert_eq!(tc.len(), 4);
    let lp = |r: Option<TeacherLogprobs>| r.map(|r| r.teacher_logprobs);
    assert_eq!(lp(tc.get("a", &[1, 2], &[3]).unwrap()), Some(vec![-1.0]));
    assert_eq!(lp(tc.get("a", &[1, 2], &[4]).unwrap()), None, "response tokens differ");
    assert_eq!(lp(tc.get("a", &[1], &[3]).unwrap()), None, "teacher prompt differs");
    // the lake's row of b replaces the cache's, even where the cache's tokens would match
    assert_eq!(lp(tc.get("b", &[1, 1], &[4]).unwrap()), Some(vec![-2.5]));
    assert_eq!(lp(tc.get("b", &[1], &[4]).unwrap()), None);
    assert_eq!(lp(tc.get("c", &[5], &[6]).unwrap()), Some(vec![-3.5]));
    assert_eq!(lp(tc.get("x", &[5], &[6]).unwrap()), None);
    let many = tc.get_many(&[("d", &[7], &[8, 9]), ("x", &[1], &[1]), ("a", &[1, 2], &[3]), ("d", &[7], &[8])]).unwrap();
    assert_eq!(many.into_iter().map(lp).collect::<Vec<_>>(), vec![Some(vec![-4.0, -4.0]), None, Some(vec![-1.0]), None]);
    assert!(TeacherCache::load(&Lake::open(dir.path().join("empty")).unwrap()).unwrap().is_empty());
}

#[test]
fn replay_copies_teacher_rows_file_by_file_lake_rows_first() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (src, dst) = (Lake::open(src_dir.path()).unwrap(), Lake::open(dst_dir.path()).unwrap());
    write(&src, &[vec![teacher_row("a", vec![1], vec![2], -1.0)], vec![teacher_row("b", vec![1], vec![2], -2.0)]]);
    let old = Lake::open(src_dir.path().join("_state").join(TEACHER_CACHE_DIR)).unwrap();
    write(&old, &[vec![teacher_row("b", vec![1], vec![2], -9.0), teacher_row("c", vec![1], vec![2], -3.0)]]);
    let (_, n) = nextstate::ablate::replay::copy_caches(&src, &dst).unwrap();
    assert_eq!(n, 3);
    let tc = TeacherCache::load(&dst).unwrap();
    let lp = |id: &str| tc.get(id, &[1], &[2]).unwrap().map(|r| r.teacher_logprobs[0]);
    assert_eq!((lp("a"), lp("b"), lp("c")), (Some(-1.0), Some(-2.0), Some(-3.0)));
}

#[derive(Debug, Deserialize, PartialEq)]
struct StageKey {
    stage: String,
    input_key: Option<String>,
}

#[test]
fn narrow_reads_pick_columns_and_rows_across_row_groups_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let t: Vec<Interaction> = (0..7).map(|k| turn("s", k, TurnType::Main, 0)).collect();
    let rows: Vec<DeadLetter> = t.iter().enumerate().map(|(k, i)| dead(&format!("stage{k}"), i)).collect();
    // a dead_letters file by hand: row groups of 2 rows, pages of 1 row (the lake writes one row group)
    let batch = serde_arrow::to_record_batch(&field_refs::<DeadLetter>(), &rows).unwrap().with_schema(schema_of::<DeadLetter>()).unwrap();
    let folder = dir.path().join("dead_letters").join("date=2025-11-24");
    std::fs::create_dir_all(&folder).unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_max_row_group_row_count(Some(2))
        .set_data_page_row_count_limit(1)
        .set_write_batch_size(1)
        .build();
    let path = folder.join("w~hand~000001.parquet");
    let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    assert_eq!(lake.files("dead_letters").unwrap().len(), 1);

    let keys: Vec<StageKey> = lake.file_columns(&path, &["input_key", "stage"]).unwrap();
    assert_eq!(keys.len(), 7);
    assert_eq!(keys[5], StageKey { stage: "stage5".into(), input_key: Some(t[5].interaction_id.clone()) });
    assert!(lake.file_columns::<StageKey>(&path, &["stage", "nope"]).is_err());

    // unsorted and repeated positions come back once each, ascending: rows of groups 0, 1 and 3
    let got: Vec<DeadLetter> = lake.read_rows_at(&path, &[6, 0, 3, 3, 2]).unwrap();
    assert_eq!(got, vec![rows[0].clone(), rows[2].clone(), rows[3].clone(), rows[6].clone()]);
    assert_eq!(lake.read_rows_at::<DeadLetter>(&path, &[5]).unwrap(), vec![rows[5].clone()]);
    assert!(lake.read_rows_at::<DeadLetter>(&path, &[7]).is_err());
    assert!(lake.read_rows_at::<DeadLetter>(&path, &[]).unwrap().is_empty());
}
