//! Hand-made rows for the ablation's unit tests.

use crate::schema::{Interaction, Judgment, Sample, SampleType, Table, Vote};

/// A main-turn interaction of `session` with id `<session>-<turn>`.
pub fn interaction(session: &str, turn: i32) -> Interaction {
    Interaction {
        interaction_id: format!("{session}-{turn}"),
        policy_version: Some(0),
        finish_reason: Some("stop".into()),
        source_format: "test".into(),
        ..Interaction::new(session, turn, "[]", "x", 1_000)
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
        tenant: None,
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
        sample_id: "s".into(),
        pipeline: "p".into(),
        method: "combined".into(),
        interaction_id: "i".into(),
        session_id: "s".into(),
        loss_mask: mask.to_vec(),
        teacher_logprobs: teacher.map(|t| t.to_vec()),
        ..Sample::new(ty, vec![1, 2], (0..rollout.len() as i32).map(|i| i + 3).collect(), rollout.to_vec(), reward)
    }
}
