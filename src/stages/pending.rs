//! What the embedded default's catch-up queries share: each stage re-publishes its pending input from the
//! lake into the (fresh, mock) bus, with the carry the stage needs ([`crate::stages::signals::publish_pending`],
//! and the same in `judge`, `hint` and `teacher`; the registry, `crate::stages::run::Stage::republish`,
//! calls them). "Pending" = an input row whose turn has no row from this stage yet for this pipeline,
//! and no dead letter from this stage. This module holds the lake scans they are built from.
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
use crate::schema::{DeadLetter, Interaction, NextStateKind, Signal, Table};

/// Where a row is: (index in its table's file list, position in that file).
pub(crate) type RowAt = (usize, usize);

/// The live files of table `name`, in path order (the order [`Lake::read_table`] reads them).
pub(crate) fn files_of(lake: &Lake, name: &str) -> Result<Vec<PathBuf>> {
    Ok(lake.files(name)?.into_iter().map(|f| f.path).collect())
}

/// Calls `f` with the position and `columns` (as `P`) of every row of `files`, one file at a time.
pub(crate) fn scan<P: DeserializeOwned>(lake: &Lake, files: &[PathBuf], columns: &[&str], mut f: impl FnMut(RowAt, P)) -> Result<()> {
    for (fi, path) in files.iter().enumerate() {
        for (row, p) in lake.file_columns::<P>(path, columns)?.into_iter().enumerate() {
            f((fi, row), p);
        }
    }
    Ok(())
}

/// `positions` grouped by file, ascending.
pub(crate) fn by_file(positions: impl IntoIterator<Item = RowAt>) -> BTreeMap<usize, Vec<usize>> {
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
pub(crate) fn fetch<T: Table>(lake: &Lake, files: &[PathBuf], at: &HashMap<String, RowAt>) -> Result<HashMap<String, T>> {
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
pub(crate) fn pending_of_pipeline(lake: &Lake, files: &[PathBuf], pipeline: &str, pending: impl Fn(&str) -> bool) -> Result<Vec<(RowAt, String)>> {
    let mut out = vec![];
    scan::<PipelineKey>(lake, files, &["interaction_id", "pipeline"], |pos, k| {
        if k.pipeline == pipeline && pending(&k.interaction_id) {
            out.push((pos, k.interaction_id));
        }
    })?;
    Ok(out)
}

/// The key column of a per-turn table.
#[derive(Deserialize)]
pub(crate) struct IdKey {
    pub(crate) interaction_id: String,
}

/// The key columns of a per-turn table of several pipelines.
#[derive(Deserialize)]
pub(crate) struct PipelineKey {
    pub(crate) interaction_id: String,
    pub(crate) pipeline: String,
}

/// The key columns of `signals` that decide whether a turn is paired.
#[derive(Deserialize)]
pub(crate) struct SignalKey {
    pub(crate) interaction_id: String,
    pub(crate) kind: NextStateKind,
}

/// Turns whose output of `pipeline` is in table `T` (a table with `interaction_id` and `pipeline`).
pub(crate) fn done_for<T: Table>(lake: &Lake, pipeline: &str) -> Result<HashSet<String>> {
    let mut done = HashSet::new();
    scan::<PipelineKey>(lake, &files_of(lake, T::NAME)?, &["interaction_id", "pipeline"], |_, k| {
        if k.pipeline == pipeline {
            done.insert(k.interaction_id);
        }
    })?;
    Ok(done)
}

/// Interaction ids a stage has dead-lettered (these count as handled).
pub(crate) fn dead_lettered(lake: &Lake, stage: &str) -> Result<HashSet<String>> {
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
pub(crate) fn rows_for<T: Table>(lake: &Lake, ids: &HashSet<String>, pipeline: Option<&str>) -> Result<HashMap<String, T>> {
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

/// Publishes the `signals` rows at `positions` of `files` (the `signals` table's live files), in lake
/// order, each carrying itself and its interaction from `interactions` (by id; a signal whose
/// interaction is not there is skipped). Returns the number published.
///
/// # Errors
/// Lake read errors, Kafka delivery errors.
pub(crate) async fn publish_signals_at(
    lake: &Lake,
    producer: &BusProducer,
    files: &[PathBuf],
    positions: impl IntoIterator<Item = RowAt>,
    interactions: &HashMap<String, Interaction>,
) -> Result<u64> {
    let mut n = 0;
    for (fi, rows) in by_file(positions) {
        for s in lake.read_rows_at::<Signal>(&files[fi], &rows)? {
            let Some(i) = interactions.get(&s.interaction_id) else { continue };
            let carry = Carry { interaction: Some(carried(i, Some(&s))), signal: Some(s.clone()), ..Default::default() };
            producer.send(&s, Some(&carry)).await?;
            n += 1;
        }
    }
    Ok(n)
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

