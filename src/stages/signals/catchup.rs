//! The signals stage's catch-up on the embedded default: the interactions of sessions with a main turn
//! that has no signal yet, re-published from the lake (see [`crate::stages::pending`]).

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

use crate::bus::BusProducer;
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{Interaction, Signal, Table, TurnType};
use crate::stages::pending::{by_file, dead_lettered, files_of, scan, RowAt};

/// Signals stage: every interaction of each session that has a main turn without a signal (and without
/// a signals dead letter), in (session, turn index, event time) order, rows that tie in lake order.
/// Returns the number published.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_pending(lake: &Lake, producer: &BusProducer) -> Result<u64> {
    #[derive(Deserialize)]
    struct OpenKey {
        interaction_id: String,
        session_id: String,
        turn_type: TurnType,
    }
    #[derive(Deserialize)]
    struct OrderKey {
        session_id: String,
        turn_index: i32,
        event_time: i64,
    }
    let done: HashSet<String> = lake.keys::<Signal>()?;
    let handled = dead_lettered(lake, super::stage::NAME)?;
    let files = files_of(lake, Interaction::NAME)?;
    let mut open: HashSet<String> = HashSet::new();
    scan::<OpenKey>(lake, &files, &["interaction_id", "session_id", "turn_type"], |_, k| {
        if k.turn_type == TurnType::Main && !done.contains(&k.interaction_id) && !handled.contains(&k.interaction_id) {
            open.insert(k.session_id);
        }
    })?;
    if open.is_empty() {
        return Ok(0);
    }
    let mut order: Vec<(OrderKey, RowAt)> = vec![];
    scan::<OrderKey>(lake, &files, &["session_id", "turn_index", "event_time"], |pos, k| {
        if open.contains(&k.session_id) {
            order.push((k, pos));
        }
    })?;
    // stable: rows with equal keys keep their lake order
    order.sort_by(|(a, _), (b, _)| (&a.session_id, a.turn_index, a.event_time).cmp(&(&b.session_id, b.turn_index, b.event_time)));
    let slot: HashMap<RowAt, usize> = order.iter().enumerate().map(|(i, (_, pos))| (*pos, i)).collect();
    let mut rows: Vec<Option<Interaction>> = vec![None; order.len()];
    for (fi, positions) in by_file(order.iter().map(|(_, pos)| *pos)) {
        for (row, r) in positions.iter().zip(lake.read_rows_at::<Interaction>(&files[fi], &positions)?) {
            rows[slot[&(fi, *row)]] = Some(r);
        }
    }
    drop((order, slot));
    for r in rows.iter().flatten() {
        producer.send(r, None).await?;
    }
    Ok(rows.len() as u64)
}
