//! The teacher stage's catch-up on the embedded default: its input rows without a sample, re-published
//! from the lake with their carry (see [`crate::stages::pending`]).

use std::collections::{HashMap, HashSet};

use crate::bus::{BusProducer, Carry};
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{HintRecord, Interaction, Judgment, Sample, Signal, Table};
use crate::stages::pending::{by_file, carried, dead_lettered, done_for, files_of, pending_of_pipeline, rows_for, scan, PipelineKey, RowAt};

/// Teacher/sample stage: its input rows (judgments for binary, hint records for OPD and combined) of
/// `pipeline` whose turn has no sample of `pipeline` yet (nor a teacher dead letter), in lake order; a
/// turn with several judgment rows is published once, from its last. Each carries its interaction
/// (required: a row without it is skipped), signal and judgment (when in the lake). Turns that yield no
/// sample (e.g. a 0 score in binary) are re-examined each run; that costs no model time.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_pending(lake: &Lake, producer: &BusProducer, pipeline: &str, from_hints: bool) -> Result<u64> {
    let done = done_for::<Sample>(lake, pipeline)?;
    let handled = dead_lettered(lake, super::stage::NAME)?;
    let pending_id = |id: &str| !done.contains(id) && !handled.contains(id);
    let mut n = 0;
    if from_hints {
        let files = files_of(lake, HintRecord::NAME)?;
        let pending = pending_of_pipeline(lake, &files, pipeline, pending_id)?;
        let ids: HashSet<String> = pending.iter().map(|(_, id)| id.clone()).collect();
        let interactions = rows_for::<Interaction>(lake, &ids, None)?;
        let signals = rows_for::<Signal>(lake, &ids, None)?;
        let judgments = rows_for::<Judgment>(lake, &ids, Some(pipeline))?;
        let carried_ids = pending.iter().filter(|(_, id)| interactions.contains_key(id));
        for (fi, positions) in by_file(carried_ids.map(|(pos, _)| *pos)) {
            for h in lake.read_rows_at::<HintRecord>(&files[fi], &positions)? {
                let Some(i) = interactions.get(&h.interaction_id) else { continue };
                let carry = Carry {
                    interaction: Some(carried(i, signals.get(&h.interaction_id))),
                    signal: signals.get(&h.interaction_id).cloned(),
                    judgment: judgments.get(&h.interaction_id).cloned(),
                    hint: Some(h.clone()),
                };
                producer.send(&h, Some(&carry)).await?;
                n += 1;
            }
        }
    } else {
        let files = files_of(lake, Judgment::NAME)?;
        // the last row of each pending turn
        let mut last: HashMap<String, RowAt> = HashMap::new();
        scan::<PipelineKey>(lake, &files, &["interaction_id", "pipeline"], |pos, k| {
            if k.pipeline == pipeline && pending_id(&k.interaction_id) {
                last.insert(k.interaction_id, pos);
            }
        })?;
        let ids: HashSet<String> = last.keys().cloned().collect();
        let interactions = rows_for::<Interaction>(lake, &ids, None)?;
        let signals = rows_for::<Signal>(lake, &ids, None)?;
        let carried_ids = last.iter().filter(|(id, _)| interactions.contains_key(*id));
        for (fi, positions) in by_file(carried_ids.map(|(_, pos)| *pos)) {
            for j in lake.read_rows_at::<Judgment>(&files[fi], &positions)? {
                let Some(i) = interactions.get(&j.interaction_id) else { continue };
                let carry = Carry {
                    interaction: Some(carried(i, signals.get(&j.interaction_id))),
                    signal: signals.get(&j.interaction_id).cloned(),
                    judgment: Some(j.clone()),
                    hint: None,
                };
                producer.send(&j, Some(&carry)).await?;
                n += 1;
            }
        }
    }
    Ok(n)
}
