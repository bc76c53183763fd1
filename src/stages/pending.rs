//! Embedded-default catch-up: re-publish each stage's pending input from the lake into the (fresh, mock)
//! bus, with the carry the stage needs. "Pending" = an input row whose turn has no row from this stage
//! yet for this pipeline, and no dead letter from this stage.
//!
//! Bounded memory: what is pending is decided from key columns only ([`Lake::file_columns`]); then only
//! the pending rows and their carry are read ([`Lake::read_rows_at`]), file by file. Peak memory is the
//! key sets, the pending rows (which go onto the embedded bus anyway) and one file's selected rows, not
//! the tables (an `interactions` row holds the whole request history).
//!
//! On a real cluster this is not used: the topics themselves hold the input and consumer groups track
//! progress.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::bus::{BusProducer, Carry};
use crate::error::Result;
use crate::lake::Lake;
use crate::schema::{DeadLetter, HintRecord, Interaction, Judgment, NextStateKind, Sample, Signal, Table, TurnType};

/// Where a row is: (index in its table's file list, position in that file).
type RowAt = (usize, usize);

/// The live files of table `name`, in path order (the order [`Lake::read_table`] reads them).
fn files_of(lake: &Lake, name: &str) -> Result<Vec<PathBuf>> {
    Ok(lake.files(name)?.into_iter().map(|f| f.path).collect())
}

/// Calls `f` with the position and `columns` (as `P`) of every row of `files`, one file at a time.
fn scan<P: DeserializeOwned>(lake: &Lake, files: &[PathBuf], columns: &[&str], mut f: impl FnMut(RowAt, P)) -> Result<()> {
    for (fi, path) in files.iter().enumerate() {
        for (row, p) in lake.file_columns::<P>(path, columns)?.into_iter().enumerate() {
            f((fi, row), p);
        }
    }
    Ok(())
}

/// `positions` grouped by file, ascending.
fn by_file(positions: impl IntoIterator<Item = RowAt>) -> BTreeMap<usize, Vec<usize>> {
    let mut out: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (fi, row) in positions {
        out.entry(fi).or_default().push(row);
    }
    for rows in out.values_mut() {
        rows.sort_unstable();
        rows.dedup();
    }
    out
}

/// The rows of `T` at the positions of `at` (id → position), by id.
fn fetch<T: Table>(lake: &Lake, files: &[PathBuf], at: &HashMap<String, RowAt>) -> Result<HashMap<String, T>> {
    let ids: HashMap<RowAt, &String> = at.iter().map(|(id, &p)| (p, id)).collect();
    let mut out = HashMap::with_capacity(at.len());
    for (fi, rows) in by_file(at.values().copied()) {
        for (row, r) in rows.iter().zip(lake.read_rows_at::<T>(&files[fi], &rows)?) {
            out.insert(ids[&(fi, *row)].clone(), r);
        }
    }
    Ok(out)
}

/// The position and interaction id of every row of `files` (a table with `interaction_id` and `pipeline`
/// columns) of `pipeline` whose id is `pending`, in lake order.
fn pending_of_pipeline(lake: &Lake, files: &[PathBuf], pipeline: &str, pending: impl Fn(&str) -> bool) -> Result<Vec<(RowAt, String)>> {
    let mut out = vec![];
    scan::<PipelineKey>(lake, files, &["interaction_id", "pipeline"], |pos, k| {
        if k.pipeline == pipeline && pending(&k.interaction_id) {
            out.push((pos, k.interaction_id));
        }
    })?;
    Ok(out)
}

#[derive(Deserialize)]
struct IdKey {
    interaction_id: String,
}

#[derive(Deserialize)]
struct PipelineKey {
    interaction_id: String,
    pipeline: String,
}

#[derive(Deserialize)]
struct SignalKey {
    interaction_id: String,
    kind: NextStateKind,
}

/// Turns whose output of `pipeline` is in table `T` (a table with `interaction_id` and `pipeline`).
fn done_for<T: Table>(lake: &Lake, pipeline: &str) -> Result<HashSet<String>> {
    let mut done = HashSet::new();
    scan::<PipelineKey>(lake, &files_of(lake, T::NAME)?, &["interaction_id", "pipeline"], |_, k| {
        if k.pipeline == pipeline {
            done.insert(k.interaction_id);
        }
    })?;
    Ok(done)
}

/// Interaction ids a stage has dead-lettered (these count as handled).
fn dead_lettered(lake: &Lake, stage: &str) -> Result<HashSet<String>> {
    #[derive(Deserialize)]
    struct DeadKey {
        stage: String,
        input_key: Option<String>,
    }
    let mut out = HashSet::new();
    scan::<DeadKey>(lake, &files_of(lake, DeadLetter::NAME)?, &["stage", "input_key"], |_, d| {
        if d.stage == stage {
            out.extend(d.input_key);
        }
    })?;
    Ok(out)
}

/// The rows of `T` (a table keyed per turn by `interaction_id`) for the turns in `ids`, the last row of
/// a turn in path order winning (as when a whole table is collected into a map by id). With `pipeline`,
/// only rows of that pipeline count.
fn rows_for<T: Table>(lake: &Lake, ids: &HashSet<String>, pipeline: Option<&str>) -> Result<HashMap<String, T>> {
    let files = files_of(lake, T::NAME)?;
    let mut at: HashMap<String, RowAt> = HashMap::new();
    match pipeline {
        Some(p) => scan::<PipelineKey>(lake, &files, &["interaction_id", "pipeline"], |pos, k| {
            if k.pipeline == p && ids.contains(&k.interaction_id) {
                at.insert(k.interaction_id, pos);
            }
        })?,
        None => scan::<IdKey>(lake, &files, &["interaction_id"], |pos, k| {
            if ids.contains(&k.interaction_id) {
                at.insert(k.interaction_id, pos);
            }
        })?,
    }
    fetch(lake, &files, &at)
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

/// Signals stage: every interaction of each session that has a main turn without a signal (and without
/// a signals dead letter), in (session, turn index, event time) order, rows that tie in lake order.
/// Returns the number published.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_signals(lake: &Lake, producer: &BusProducer) -> Result<u64> {
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
    let handled = dead_lettered(lake, "signals")?;
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

/// Judge stage: paired signals without a judgment of `pipeline` (or a judge dead letter), in lake order,
/// carrying their interaction (a signal whose interaction is not in the lake is skipped).
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_judge(lake: &Lake, producer: &BusProducer, pipeline: &str) -> Result<u64> {
    let done = done_for::<Judgment>(lake, pipeline)?;
    let handled = dead_lettered(lake, "judge")?;
    let files = files_of(lake, Signal::NAME)?;
    let mut pending: Vec<(RowAt, String)> = vec![];
    scan::<SignalKey>(lake, &files, &["interaction_id", "kind"], |pos, k| {
        if k.kind != NextStateKind::None && !done.contains(&k.interaction_id) && !handled.contains(&k.interaction_id) {
            pending.push((pos, k.interaction_id));
        }
    })?;
    let ids: HashSet<String> = pending.iter().map(|(_, id)| id.clone()).collect();
    let interactions = rows_for::<Interaction>(lake, &ids, None)?;
    let mut n = 0;
    for (fi, positions) in by_file(pending.iter().filter(|(_, id)| interactions.contains_key(id)).map(|(pos, _)| *pos)) {
        for s in lake.read_rows_at::<Signal>(&files[fi], &positions)? {
            let Some(i) = interactions.get(&s.interaction_id) else { continue };
            let carry = Carry { interaction: Some(carried(i, Some(&s))), signal: Some(s.clone()), ..Default::default() };
            producer.send(&s, Some(&carry)).await?;
            n += 1;
        }
    }
    Ok(n)
}

/// Hint stage: its input rows (signals for OPD, judgments of `pipeline` for combined) without a hint
/// record of `pipeline` (or a hint dead letter), in lake order; a turn with several signal rows is
/// published once, from its last. Each carries its interaction and signal (and judgment): a row without
/// them in the lake is skipped.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_hint(lake: &Lake, producer: &BusProducer, pipeline: &str, after_judge: bool) -> Result<u64> {
    let done = done_for::<HintRecord>(lake, pipeline)?;
    let handled = dead_lettered(lake, "hint")?;
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
        let carried_ids = last.iter().filter(|(id, _)| interactions.contains_key(*id));
        for (fi, positions) in by_file(carried_ids.map(|(_, (pos, _))| *pos)) {
            for s in lake.read_rows_at::<Signal>(&files[fi], &positions)? {
                let Some(i) = interactions.get(&s.interaction_id) else { continue };
                let carry = Carry { interaction: Some(carried(i, Some(&s))), signal: Some(s.clone()), ..Default::default() };
                producer.send(&s, Some(&carry)).await?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// Teacher/sample stage: its input rows (judgments for binary, hint records for OPD and combined) of
/// `pipeline` whose turn has no sample of `pipeline` yet (nor a teacher dead letter), in lake order; a
/// turn with several judgment rows is published once, from its last. Each carries its interaction
/// (required: a row without it is skipped), signal and judgment (when in the lake). Turns that yield no
/// sample (e.g. a 0 score in binary) are re-examined each run; that costs no model time.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub async fn publish_for_teacher(lake: &Lake, producer: &BusProducer, pipeline: &str, from_hints: bool) -> Result<u64> {
    let done = done_for::<Sample>(lake, pipeline)?;
    let handled = dead_lettered(lake, "teacher")?;
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
