//! The judge stage's catch-up on the embedded default: paired signals without a judgment, re-published
//! from the lake with their interaction (see [`crate::stages::pending`]).

use std::collections::HashSet;

use crate::bus::BusProducer;
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{Interaction, Judgment, NextStateKind, Signal, Table};
use crate::stages::pending::{dead_lettered, done_for, files_of, publish_signals_at, rows_for, scan, RowAt, SignalKey};

/// Judge stage: paired signals without a judgment of `pipeline` (or a judge dead letter), in lake order,
/// carrying their interaction (a signal whose interaction is not in the lake is skipped).
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_pending(lake: &Lake, producer: &BusProducer, pipeline: &str) -> Result<u64> {
    let done = done_for::<Judgment>(lake, pipeline)?;
    let handled = dead_lettered(lake, super::stage::NAME)?;
    let files = files_of(lake, Signal::NAME)?;
    let mut pending: Vec<(RowAt, String)> = vec![];
    scan::<SignalKey>(lake, &files, &["interaction_id", "kind"], |pos, k| {
        if k.kind != NextStateKind::None && !done.contains(&k.interaction_id) && !handled.contains(&k.interaction_id) {
            pending.push((pos, k.interaction_id));
        }
    })?;
    let ids: HashSet<String> = pending.iter().map(|(_, id)| id.clone()).collect();
    let interactions = rows_for::<Interaction>(lake, &ids, None)?;
    let positions = pending.iter().filter(|(_, id)| interactions.contains_key(id)).map(|(pos, _)| *pos);
    publish_signals_at(lake, producer, &files, positions, &interactions).await
}
