//! `--to verl`: verl's RL dataset layout (volcengine/verl, `examples/data_preprocess/gsm8k.py`):
//! `data_source`, `prompt` (chat messages), `ability`, `reward_model {style, ground_truth}`,
//! `extra_info`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::files::{write_rows, FileReport, Skips};
use super::texts::{ChatMessage, Texts};
use crate::error::Result;
use crate::schema::Sample;

/// verl's `reward_model` struct.
#[derive(Debug, Serialize, Deserialize)]
struct RewardModel {
    /// `model`: the lake's rewards come from a PRM judge, not a rule.
    style: String,
    /// Always "": the lake holds no reference answer (the PRM score is `extra_info.reward`).
    ground_truth: String,
}

/// verl's free-form `extra_info` struct: our ids and the logged turn.
#[derive(Debug, Serialize, Deserialize)]
struct ExtraInfo {
    split: String,
    index: i64,
    sample_id: String,
    interaction_id: String,
    session_id: String,
    turn_index: i32,
    pipeline: String,
    method: String,
    sample_type: String,
    /// The sample's reward r.
    reward: f32,
    policy_version: Option<i64>,
    /// The response the policy gave in the log.
    response: String,
}

/// One row of `train.parquet`.
#[derive(Debug, Serialize, Deserialize)]
struct VerlRow {
    /// `nextstate/<pipeline>`.
    data_source: String,
    /// The turn's request messages `{role, content}`.
    prompt: Vec<ChatMessage>,
    /// Always `agent`.
    ability: String,
    reward_model: RewardModel,
    extra_info: ExtraInfo,
}

/// Writes `out/train.parquet`; skips rows whose turn is not in the lake's `interactions` or whose
/// request is empty.
pub(super) fn write(out: &Path, samples: &[Sample], texts: &Texts) -> Result<FileReport> {
    let mut skips = Skips::default();
    let mut rows = vec![];
    for s in samples {
        let (prompt, response) = match texts.turn(s) {
            Ok(t) => t,
            Err(m) => {
                skips.add(m.reason());
                continue;
            }
        };
        if prompt.is_empty() {
            skips.add("empty_prompt");
            continue;
        }
        let index = rows.len() as i64;
        rows.push(VerlRow {
            data_source: format!("nextstate/{}", s.pipeline),
            prompt,
            ability: "agent".into(),
            reward_model: RewardModel { style: "model".into(), ground_truth: String::new() },
            extra_info: ExtraInfo {
                split: "train".into(),
                index,
                sample_id: s.sample_id.clone(),
                interaction_id: s.interaction_id.clone(),
                session_id: s.session_id.clone(),
                turn_index: s.turn_index,
                pipeline: s.pipeline.clone(),
                method: s.method.clone(),
                sample_type: s.sample_type.as_str().to_string(),
                reward: s.reward,
                policy_version: s.policy_version,
                response: response.to_string(),
            },
        });
    }
    write_rows(out, "train.parquet", &rows, skips)
}
