use super::*;

fn interaction() -> Interaction {
    Interaction {
        interaction_id: "i1".into(),
        policy_version: Some(3),
        finish_reason: Some("stop".into()),
        prompt_token_ids: Some(vec![1, 2, 3]),
        response_token_ids: Some(vec![4, 5]),
        rollout_logprobs: Some(vec![-0.5, -1.25]),
        notes: vec!["developer role mapped to system".into()],
        source_format: "proxy".into(),
        source_topic: Some("interactions".into()),
        source_partition: Some(2),
        source_offset: Some(17),
        ingest_time: 1_700_000_000_500,
        ..Interaction::new("s1", 0, r#"[{"role":"user","content":"hi"}]"#, "hello", 1_700_000_000_000)
    }
}

#[test]
fn interaction_round_trips_through_arrow() {
    let rows = vec![interaction()];
    let batch = serde_arrow::to_record_batch(&field_refs::<Interaction>(), &rows).unwrap();
    assert_eq!(batch.schema().fields().len(), Interaction::fields().len());
    let back: Vec<Interaction> = serde_arrow::from_record_batch(&batch).unwrap();
    assert_eq!(back, rows);
}

#[test]
fn nested_tables_round_trip() {
    let j = Judgment {
        schema_version: 1,
        judgment_id: "j".into(),
        pipeline: "p".into(),
        interaction_id: "i".into(),
        session_id: "s".into(),
        tenant: None,
        turn_index: 1,
        policy_version: None,
        votes: vec![
            Vote { index: 0, raw: "\\boxed{1}".into(), value: Some(1), error: None, cached: false },
            Vote { index: 1, raw: "".into(), value: None, error: Some("timeout".into()), cached: true },
        ],
        m: 2,
        valid_votes: 1,
        tie: false,
        score: 1,
        judge_backend: "rules".into(),
        judge_model: "rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        temperature: 0.6,
        max_tokens: 512,
        cache_hits: 1,
        event_time: 5,
        processed_time: 6,
    };
    let batch = serde_arrow::to_record_batch(&field_refs::<Judgment>(), &vec![j.clone()]).unwrap();
    let back: Vec<Judgment> = serde_arrow::from_record_batch(&batch).unwrap();
    assert_eq!(back, vec![j]);

    let t = TeacherLogprobs {
        schema_version: 1,
        teacher_id: "t".into(),
        pipeline: "p".into(),
        interaction_id: "i".into(),
        session_id: "s".into(),
        tenant: None,
        turn_index: 0,
        teacher_model: "m".into(),
        teacher_version: 0,
        teacher_prompt_token_ids: vec![1, 2],
        response_token_ids: vec![3],
        teacher_logprobs: vec![-0.1],
        topk_ids: Some(vec![vec![3, 9]]),
        topk_logprobs: Some(vec![vec![-0.1, -2.5]]),
        student_topk_ids: Some(vec![vec![3, 4]]),
        logprobs_at_student_topk: Some(vec![vec![-0.1, -3.0]]),
        event_time: 1,
        processed_time: 2,
    };
    let batch = serde_arrow::to_record_batch(&field_refs::<TeacherLogprobs>(), &vec![t.clone()]).unwrap();
    let back: Vec<TeacherLogprobs> = serde_arrow::from_record_batch(&batch).unwrap();
    assert_eq!(back, vec![t.clone()]);

    // Files written before the multi-candidate columns existed still read: the columns become null.
    let keep: Vec<usize> = (0..batch.num_columns()).filter(|&i| !batch.schema().field(i).name().contains("student_topk")).collect();
    let old = batch.project(&keep).unwrap();
    assert_eq!(old.num_columns(), batch.num_columns() - 2);
    let back: Vec<TeacherLogprobs> = serde_arrow::from_record_batch(&old).unwrap();
    assert_eq!(back, vec![TeacherLogprobs { student_topk_ids: None, logprobs_at_student_topk: None, ..t }]);
}

#[test]
fn samples_with_candidates_round_trip_and_old_files_read() {
    let c = TeacherCandidate { teacher_id: "t0".into(), hint_index: 2, topk_ids: vec![vec![5, 6]], topk_logprobs: vec![vec![-0.2, -1.9]], logprobs_at_student_topk: vec![vec![-0.3, -2.2]] };
    let s = Sample { teacher_prompt_token_ids: Some(vec![1, 9]), student_topk_ids: Some(vec![vec![5, 7]]), candidates: Some(vec![c]), ..Sample::new(SampleType::Opd, vec![1], vec![5], vec![-0.4], 0.0) };
    let batch = serde_arrow::to_record_batch(&field_refs::<Sample>(), &vec![s.clone()]).unwrap();
    let back: Vec<Sample> = serde_arrow::from_record_batch(&batch).unwrap();
    assert_eq!(back, vec![s.clone()]);
    let keep: Vec<usize> = (0..batch.num_columns()).filter(|&i| !matches!(batch.schema().field(i).name().as_str(), "student_topk_ids" | "candidates" | "teacher_prompt_token_ids")).collect();
    assert_eq!(keep.len(), batch.num_columns() - 3);
    let back: Vec<Sample> = serde_arrow::from_record_batch(&batch.project(&keep).unwrap()).unwrap();
    assert_eq!(back, vec![Sample { student_topk_ids: None, candidates: None, teacher_prompt_token_ids: None, ..s }]);
}

#[test]
fn every_schema_has_version_and_documented_fields() {
    for (name, s) in all_schemas() {
        assert_eq!(s.metadata().get("table").map(String::as_str), Some(name));
        assert_eq!(s.field(0).name(), "schema_version");
        for f in s.fields() {
            assert!(f.metadata().get("doc").is_some_and(|d| !d.is_empty()), "{name}.{} has no doc", f.name());
        }
    }
}

#[test]
fn content_hash_is_length_prefixed() {
    assert_ne!(content_hash(&[b"ab", b"c"]), content_hash(&[b"a", b"bc"]));
    assert_eq!(content_hash(&[b"x"]).len(), 32);
}

#[test]
fn checked_in_schema_files_match_the_code() {
    // `nextstate schema --write schemas` regenerates them.
    for (name, s) in all_schemas() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas").join(format!("{name}.json"));
        let file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(file, schema_json(&s), "{} is stale: run `nextstate schema --write schemas`", path.display());
    }
}
