//! `--to slime`: one row per sample with the fields of slime's `Sample` (THUDM/slime,
//! `slime/utils/types.py`) that the lake holds, under slime's names, plus our ids.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::files::{token_columns_ok, write_rows, FileReport, Skips};
use crate::error::Result;
use crate::schema::Sample;

/// One row of `slime.parquet`.
#[derive(Debug, Serialize, Deserialize)]
struct SlimeRow {
    /// slime `index`: position of the row in the export.
    index: i64,
    /// slime `tokens`: prompt token ids followed by response token ids, [P + T] int32.
    tokens: Vec<i32>,
    /// slime `response_length`: T.
    response_length: i64,
    /// slime `loss_mask` over the response, [T] int32, 1 = trained.
    loss_mask: Vec<i32>,
    /// slime `rollout_log_probs`, [T] float32 (nats).
    rollout_log_probs: Vec<f32>,
    /// slime `reward`: the PRM majority score r (0 when the sample has none).
    reward: f32,
    /// slime `teacher_log_probs` for OPD, [T] float32; null for binary samples.
    teacher_log_probs: Option<Vec<f32>>,
    /// slime `weight_versions`: the policy version that produced the response, as a string (empty when
    /// unknown).
    weight_versions: Vec<String>,
    /// slime `session_id`.
    session_id: String,
    /// Ours: P, so `tokens[:prompt_length]` is the prompt.
    prompt_length: i64,
    sample_id: String,
    interaction_id: String,
    turn_index: i32,
    pipeline: String,
    method: String,
    sample_type: String,
    policy_version: Option<i64>,
    judgment_id: Option<String>,
    hint_id: Option<String>,
    teacher_id: Option<String>,
    /// Event time of the turn (ms since the epoch, int64).
    event_time: i64,
}

/// Writes `out/slime.parquet`; skips rows without response tokens or with per-token columns of
/// another length than the response.
pub(super) fn write(out: &Path, samples: &[Sample]) -> Result<FileReport> {
    let mut skips = Skips::default();
    let mut rows = vec![];
    for s in samples {
        if let Err(why) = token_columns_ok(s) {
            skips.add(why);
            continue;
        }
        let mut tokens = s.prompt_token_ids.clone();
        tokens.extend_from_slice(&s.response_token_ids);
        rows.push(SlimeRow {
            index: rows.len() as i64,
            tokens,
            response_length: s.response_token_ids.len() as i64,
            loss_mask: s.loss_mask.clone(),
            rollout_log_probs: s.rollout_logprobs.clone(),
            reward: s.reward,
            teacher_log_probs: s.teacher_logprobs.clone(),
            weight_versions: s.policy_version.map(|v| vec![v.to_string()]).unwrap_or_default(),
            session_id: s.session_id.clone(),
            prompt_length: s.prompt_token_ids.len() as i64,
            sample_id: s.sample_id.clone(),
            interaction_id: s.interaction_id.clone(),
            turn_index: s.turn_index,
            pipeline: s.pipeline.clone(),
            method: s.method.clone(),
            sample_type: s.sample_type.as_str().to_string(),
            policy_version: s.policy_version,
            judgment_id: s.judgment_id.clone(),
            hint_id: s.hint_id.clone(),
            teacher_id: s.teacher_id.clone(),
            event_time: s.event_time,
        });
    }
    write_rows(out, "slime.parquet", &rows, skips)
}
