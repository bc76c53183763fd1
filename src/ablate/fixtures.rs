//! Hand-made rows for the ablation's unit tests.

use crate::schema::{Interaction, Judgment, Sample, SampleType, Table, TurnType, Vote};

/// A main-turn interaction of `session` with id `<session>-<turn>`.
pub fn interaction(session: &str, turn: i32) -> Interaction {
    Interaction {
        schema_version: Interaction::SCHEMA_VERSION,
        interaction_id: format!("{session}-{turn}"),
        session_id: session.into(),
        session_inferred: false,
        turn_index: turn,
        turn_type: TurnType::Main,
        session_done: false,
        policy_version: Some(0),
        model: None,
        request_messages: "[]".into(),
        tools: None,
        response_text: "x".into(),
        reasoning_text: None,
        tool_calls: None,
        finish_reason: Some("stop".into()),
        truncated: false,
        prompt_text: None,
        prompt_token_ids: None,
        response_token_ids: None,
        rollout_logprobs: None,
        next_state: None,
        outcome_reward: None,
        notes: vec![],
        source_format: "test".into(),
        source_topic: None,
        source_partition: None,
        source_offset: None,
        source_file: None,
        source_line: None,
        event_time: 1_000,
        ingest_time: 1_000,
    }
}

/// A judgment of `pipeline` for `session`'s turn 0 with one vote of `score`.
pub fn judgment(pipeline: &str, session: &str, score: i32) -> Judgment {
    Judgment {
        schema_version: Judgment::SCHEMA_VERSION,
        judgment_id: format!("{pipeline}-{session}-{score}"),
        pipeline: pipeline.into(),
        interaction_id: format!("{session}-0"),
        session_id: session.into(),
        turn_index: 0,
        policy_version: Some(0),
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
        processed_time: 1_000,
    }
}

/// A sample with the given type, reward, rollout and teacher log-probs and loss mask (response ids
/// 3, 4, 5, … as long as `rollout`).
pub fn sample(ty: SampleType, reward: f32, rollout: &[f32], teacher: Option<&[f32]>, mask: &[i32]) -> Sample {
    Sample {
        schema_version: Sample::SCHEMA_VERSION,
        sample_id: "s".into(),
        pipeline: "p".into(),
        method: "combined".into(),
        sample_type: ty,
        interaction_id: "i".into(),
        session_id: "s".into(),
        turn_index: 0,
        prompt_token_ids: vec![1, 2],
        response_token_ids: (0..rollout.len() as i32).map(|i| i + 3).collect(),
        loss_mask: mask.to_vec(),
        rollout_logprobs: rollout.to_vec(),
        rollout_logprobs_recomputed: false,
        reward,
        teacher_logprobs: teacher.map(|t| t.to_vec()),
        topk_ids: None,
        topk_logprobs: None,
        policy_version: Some(0),
        judgment_id: None,
        hint_id: None,
        teacher_id: None,
        source_topic: None,
        source_partition: None,
        source_offset: None,
        event_time: 0,
        processed_time: 0,
    }
}
