//! Test helpers: hand-made samples.

use crate::schema::{Sample, SampleType};

/// A sample with all-ones loss mask, no teacher, no top-K, version 0 and lineage `samples`/0/`offset`.
pub fn sample(id: &str, ty: SampleType, prompt: &[i32], response: &[i32], rollout: &[f32], reward: f32) -> Sample {
    Sample {
        sample_id: id.to_string(),
        pipeline: "test".into(),
        interaction_id: format!("i-{id}"),
        session_id: "s".into(),
        source_topic: Some("interactions".into()),
        source_partition: Some(0),
        source_offset: Some(0),
        ..Sample::new(ty, prompt.to_vec(), response.to_vec(), rollout.to_vec(), reward)
    }
}
