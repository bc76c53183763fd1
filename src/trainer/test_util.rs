//! Test helpers: hand-made samples.

use crate::schema::{Sample, SampleType, Table};

/// A sample with all-ones loss mask, no teacher, no top-K, version 0 and lineage `samples`/0/`offset`.
pub fn sample(id: &str, ty: SampleType, prompt: &[i32], response: &[i32], rollout: &[f32], reward: f32) -> Sample {
    let method = match ty {
        SampleType::Binary => "binary",
        SampleType::Opd => "opd",
        _ => "combined",
    };
    Sample {
        schema_version: Sample::SCHEMA_VERSION,
        sample_id: id.to_string(),
        pipeline: "test".into(),
        method: method.into(),
        sample_type: ty,
        interaction_id: format!("i-{id}"),
        session_id: "s".into(),
        turn_index: 0,
        prompt_token_ids: prompt.to_vec(),
        response_token_ids: response.to_vec(),
        loss_mask: vec![1; response.len()],
        rollout_logprobs: rollout.to_vec(),
        rollout_logprobs_recomputed: false,
        reward,
        teacher_logprobs: None,
        topk_ids: None,
        topk_logprobs: None,
        policy_version: Some(0),
        judgment_id: None,
        hint_id: None,
        teacher_id: None,
        source_topic: Some("interactions".into()),
        source_partition: Some(0),
        source_offset: Some(0),
        event_time: 0,
        processed_time: 0,
    }
}
