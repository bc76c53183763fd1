//! The hint stage's catch-up on the embedded default: its input rows without a hint record, re-published
//! from the lake with their carry (see [`crate::stages::pending`]).

use std::collections::{HashMap, HashSet};

use crate::bus::{BusProducer, Carry};
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{HintRecord, Interaction, Judgment, NextStateKind, Signal, Table};
use crate::stages::pending::{by_file, carried, dead_lettered, done_for, files_of, pending_of_pipeline, publish_signals_at, rows_for, scan, RowAt, SignalKey};

/// Hint stage: its input rows (signals for OPD, judgments of `pipeline` for combined) without a hint
/// record of `pipeline` (or a hint dead letter), in lake order; a turn with several signal rows is
/// published once, from its last. Each carries its interaction and signal (and judgment): a row without
/// them in the lake is skipped.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_pending(lake: &Lake, producer: &BusProducer, pipeline: &str, after_judge: bool) -> Result<u64> {
    let done = done_for::<HintRecord>(lake, pipeline)?;
    let handled = dead_lettered(lake, super::stage::NAME)?;
    let pending_id = |id: &str| !done.contains(id) && !handled.contains(id);
    let mut n = 0;
    if after_judge {
        let files = files_of(lake, Judgment::NAME)?;
        let pending = pending_of_pipeline(lake, &files, pipeline, pending_id)?;
        let ids: HashSet<String> = pending.iter().map(|(_, id)| id.clone()).collect();
        let interactions = rows_for::<Interaction>(lake, &ids, None)?;
        let signals = rows_for::<Signal>(lake, &ids, None)?;
        let carried_ids = pending.iter().filter(|(_, id)| interactions.contains_key(id) && signals.contains_key(id));
        for (fi, positions) in by_file(carried_ids.map(|(pos, _)| *pos)) {
            for j in lake.read_rows_at::<Judgment>(&files[fi], &positions)? {
                let (Some(i), Some(s)) = (interactions.get(&j.interaction_id), signals.get(&j.interaction_id)) else { continue };
                let carry = Carry { interaction: Some(carried(i, Some(s))), signal: Some(s.clone()), judgment: Some(j.clone()), hint: None };
                producer.send(&j, Some(&carry)).await?;
                n += 1;
            }
        }
    } else {
        let files = files_of(lake, Signal::NAME)?;
        // the last row of each pending turn, and whether it is paired
        let mut last: HashMap<String, (RowAt, bool)> = HashMap::new();
        scan::<SignalKey>(lake, &files, &["interaction_id", "kind"], |pos, k| {
            if pending_id(&k.interaction_id) {
                last.insert(k.interaction_id, (pos, k.kind != NextStateKind::None));
            }
        })?;
        last.retain(|_, (_, paired)| *paired);
        let ids: HashSet<String> = last.keys().cloned().collect();
        let interactions = rows_for::<Interaction>(lake, &ids, None)?;
        let positions = last.iter().filter(|(id, _)| interactions.contains_key(*id)).map(|(_, (pos, _))| *pos);
        n = publish_signals_at(lake, producer, &files, positions, &interactions).await?;
    }
    Ok(n)
}
