//! One [`SignalPairer`] per Kafka partition, rebuilt when a partition is re-read.

use std::collections::HashMap;

use super::pairer::{SignalConfig, SignalPairer};
use crate::schema::{Interaction, Lineage, Signal, TurnType};

/// The partition of rows whose lineage names none (tests, files).
const NO_PARTITION: i32 = -1;

/// What the pairer keeps for one partition.
struct Partition {
    pairer: SignalPairer,
    /// Main-turn rows whose signal is not emitted yet, by interaction id (the wiring sends the row
    /// with its signal so the judge has the whole turn).
    turns: HashMap<String, Interaction>,
    /// Offset of the last row pushed (`i64::MIN` before the first).
    last_offset: i64,
}

/// Pairs the rows of many partitions, each in its own [`SignalPairer`], so that a partition's
/// signals depend only on that partition's rows in offset order: never on batch boundaries, on how
/// partitions interleave, or on where a restart began (module doc of [`crate::signals`]).
///
/// Sessions must not span partitions (the bus keys every row by its session id, so they do not).
/// When a row's offset is at or below the last one pushed for its partition, the consumer went back
/// to a committed offset (a rebalance or a restart): that partition's state is dropped and rebuilt
/// from the rows read again, which re-emits, unchanged, the signals of rows at and after that offset.
pub struct PartitionedPairer {
    cfg: SignalConfig,
    clock: fn() -> i64,
    parts: HashMap<i32, Partition>,
    rebuilt: u64,
}

impl std::fmt::Debug for PartitionedPairer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionedPairer").field("cfg", &self.cfg).field("partitions", &self.parts.len()).field("rebuilt", &self.rebuilt).finish()
    }
}

impl PartitionedPairer {
    /// Pairers whose signals carry the wall-clock time as `processed_time`.
    pub fn new(cfg: SignalConfig) -> PartitionedPairer {
        Self::with_clock(cfg, crate::schema::now_ms)
    }

    /// Pairers with an explicit clock for `processed_time` (ms since the epoch), for tests.
    pub fn with_clock(cfg: SignalConfig, clock: fn() -> i64) -> PartitionedPairer {
        PartitionedPairer { cfg, clock, parts: HashMap::new(), rebuilt: 0 }
    }

    /// Feeds one row with its Kafka position; returns the signals it completed, each with the row of
    /// its turn (`None` only if that row was pushed before a rebuild of its partition) as read at its
    /// own position ([`Interaction::read_at`]: the signal and the row carry the same
    /// `source_topic/partition/offset`, which the later stages copy into `samples`). Side turns are
    /// never paired and never returned.
    pub fn push(&mut self, row: Interaction, lineage: Lineage) -> Vec<(Signal, Option<Interaction>)> {
        let row = row.read_at(&lineage);
        let p = lineage.source_partition.unwrap_or(NO_PARTITION);
        let offset = lineage.source_offset;
        let (cfg, clock) = (&self.cfg, self.clock);
        let part = self.parts.entry(p).or_insert_with(|| Partition::new(cfg, clock));
        if let Some(o) = offset {
            if o <= part.last_offset {
                tracing::info!(partition = p, offset = o, last = part.last_offset, "partition read again from an earlier offset: its pairing state is rebuilt");
                *part = Partition::new(cfg, clock);
                self.rebuilt += 1;
            }
            part.last_offset = o;
        }
        if row.turn_type == TurnType::Main {
            part.turns.insert(row.interaction_id.clone(), row.clone());
        }
        let signals = part.pairer.push(row, lineage);
        signals
            .into_iter()
            .map(|s| {
                let turn = part.turns.remove(&s.interaction_id);
                (s, turn)
            })
            .collect()
    }

    /// Drops the state of partitions not in `assigned` (after a rebalance took them away; whoever
    /// reads them next rebuilds it from the committed offset).
    pub fn retain_partitions(&mut self, assigned: &[i32]) {
        self.parts.retain(|p, _| *p == NO_PARTITION || assigned.contains(p));
    }

    /// Per partition, the offset that may be committed ([`SignalPairer::safe_commit_offsets`]);
    /// partitions absent may commit everything read.
    pub fn safe_commit_offsets(&mut self) -> HashMap<i32, i64> {
        self.parts.iter_mut().filter(|(p, _)| **p != NO_PARTITION).flat_map(|(_, part)| part.pairer.safe_commit_offsets()).collect()
    }

    /// Main turns read but not yet paired, over every partition: each waits for its next state or for
    /// its session to close (a done flag, or `idle_gap_ms` of event time without a row).
    pub fn waiting_turns(&self) -> usize {
        self.parts.values().map(|p| p.turns.len()).sum()
    }

    /// How many times a partition's state was rebuilt because its offsets went back.
    pub fn rebuilt(&self) -> u64 {
        self.rebuilt
    }
}

impl Partition {
    fn new(cfg: &SignalConfig, clock: fn() -> i64) -> Partition {
        Partition { pairer: SignalPairer::with_clock(cfg.clone(), Box::new(clock)), turns: HashMap::new(), last_offset: i64::MIN }
    }
}
