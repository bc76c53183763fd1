//! Embedded-default catch-up: re-publish each stage's pending input from the lake into the (fresh, mock)
//! bus, with the carry the stage needs. "Pending" = an input row whose turn has no row from this stage
//! yet for this pipeline, and no dead letter from this stage.
//!
//! On a real cluster this is not used: the topics themselves hold the input and consumer groups track
//! progress.

use std::collections::{HashMap, HashSet};

use crate::bus::{BusProducer, Carry};
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{DeadLetter, HintRecord, Interaction, Judgment, NextStateKind, Signal, TurnType};

/// Interaction ids a stage has dead-lettered (these count as handled).
fn dead_lettered(lake: &Lake, stage: &str) -> Result<HashSet<String>> {
    Ok(lake
        .read_table::<DeadLetter>()?
        .into_iter()
        .filter(|d| d.stage == stage)
        .filter_map(|d| d.input_key)
        .collect())
}

fn interactions_by_id(lake: &Lake) -> Result<HashMap<String, Interaction>> {
    Ok(lake.read_table::<Interaction>()?.into_iter().map(|i| (i.interaction_id.clone(), i)).collect())
}

/// The turn's row as the stages carry it: the lake's row (which has no Kafka position) read at the
/// position its signal recorded, so the samples made from it name the same `interactions` record as
/// when the chain runs straight from the topic.
pub(crate) fn carried(i: &Interaction, signal: Option<&Signal>) -> Interaction {
    match signal {
        Some(s) => i.clone().read_at(&s.read_position()),
        None => i.clone(),
    }
}

/// Signals stage: every interaction of each session that has a main turn without a signal, in
/// (session, turn) order. Returns the number published.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_signals(lake: &Lake, producer: &BusProducer) -> Result<u64> {
    let done: HashSet<String> = lake.keys::<Signal>()?;
    let handled = dead_lettered(lake, "signals")?;
    let mut rows = lake.read_table::<Interaction>()?;
    let open: HashSet<String> = rows
        .iter()
        .filter(|i| i.turn_type == TurnType::Main && !done.contains(&i.interaction_id) && !handled.contains(&i.interaction_id))
        .map(|i| i.session_id.clone())
        .collect();
    rows.retain(|i| open.contains(&i.session_id));
    rows.sort_by(|a, b| (&a.session_id, a.turn_index, a.event_time).cmp(&(&b.session_id, b.turn_index, b.event_time)));
    for r in &rows {
        producer.send(r, None).await?;
    }
    Ok(rows.len() as u64)
}

/// Judge stage: paired signals without a judgment of `pipeline`, carrying their interaction.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_judge(lake: &Lake, producer: &BusProducer, pipeline: &str) -> Result<u64> {
    let done: HashSet<String> = lake
        .read_table::<Judgment>()?
        .into_iter()
        .filter(|j| j.pipeline == pipeline)
        .map(|j| j.interaction_id)
        .collect();
    let handled = dead_lettered(lake, "judge")?;
    let interactions = interactions_by_id(lake)?;
    let mut n = 0;
    for s in lake.read_table::<Signal>()? {
        if s.kind == NextStateKind::None || done.contains(&s.interaction_id) || handled.contains(&s.interaction_id) {
            continue;
        }
        let Some(i) = interactions.get(&s.interaction_id) else { continue };
        let carry = Carry { interaction: Some(carried(i, Some(&s))), signal: Some(s.clone()), ..Default::default() };
        producer.send(&s, Some(&carry)).await?;
        n += 1;
    }
    Ok(n)
}

/// Hint stage: its input rows (signals for OPD, judgments of `pipeline` for combined) without a hint
/// record of `pipeline`.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_hint(lake: &Lake, producer: &BusProducer, pipeline: &str, after_judge: bool) -> Result<u64> {
    let done: HashSet<String> = lake
        .read_table::<HintRecord>()?
        .into_iter()
        .filter(|h| h.pipeline == pipeline)
        .map(|h| h.interaction_id)
        .collect();
    let handled = dead_lettered(lake, "hint")?;
    let interactions = interactions_by_id(lake)?;
    let signals: HashMap<String, Signal> = lake.read_table::<Signal>()?.into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
    let mut n = 0;
    if after_judge {
        for j in lake.read_table::<Judgment>()? {
            if j.pipeline != pipeline || done.contains(&j.interaction_id) || handled.contains(&j.interaction_id) {
                continue;
            }
            let (Some(i), Some(s)) = (interactions.get(&j.interaction_id), signals.get(&j.interaction_id)) else { continue };
            let carry = Carry { interaction: Some(carried(i, Some(s))), signal: Some(s.clone()), judgment: Some(j.clone()), hint: None };
            producer.send(&j, Some(&carry)).await?;
            n += 1;
        }
    } else {
        for s in signals.values() {
            if s.kind == NextStateKind::None || done.contains(&s.interaction_id) || handled.contains(&s.interaction_id) {
                continue;
            }
            let Some(i) = interactions.get(&s.interaction_id) else { continue };
            let carry = Carry { interaction: Some(carried(i, Some(s))), signal: Some(s.clone()), ..Default::default() };
            producer.send(s, Some(&carry)).await?;
            n += 1;
        }
    }
    Ok(n)
}

/// Teacher/sample stage: its input rows (judgments for binary, hint records for OPD and combined) of
/// `pipeline` whose turn has no sample of `pipeline` yet. Turns that yield no sample (e.g. a 0 score in
/// binary) are re-examined each run; that costs no model time.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_teacher(lake: &Lake, producer: &BusProducer, pipeline: &str, from_hints: bool) -> Result<u64> {
    let done: HashSet<String> = lake
        .read_table::<crate::schema::Sample>()?
        .into_iter()
        .filter(|s| s.pipeline == pipeline)
        .map(|s| s.interaction_id)
        .collect();
    let handled = dead_lettered(lake, "teacher")?;
    let interactions = interactions_by_id(lake)?;
    let signals: HashMap<String, Signal> = lake.read_table::<Signal>()?.into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
    let judgments: HashMap<String, Judgment> = lake
        .read_table::<Judgment>()?
        .into_iter()
        .filter(|j| j.pipeline == pipeline)
        .map(|j| (j.interaction_id.clone(), j))
        .collect();
    let mut n = 0;
    let pending = |id: &str| !done.contains(id) && !handled.contains(id);
    if from_hints {
        for h in lake.read_table::<HintRecord>()? {
            if h.pipeline != pipeline || !pending(&h.interaction_id) {
                continue;
            }
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
    } else {
        for j in judgments.values() {
            if !pending(&j.interaction_id) {
                continue;
            }
            let Some(i) = interactions.get(&j.interaction_id) else { continue };
            let carry = Carry { interaction: Some(carried(i, signals.get(&j.interaction_id))), signal: signals.get(&j.interaction_id).cloned(), judgment: Some(j.clone()), hint: None };
            producer.send(j, Some(&carry)).await?;
            n += 1;
        }
    }
    Ok(n)
}
