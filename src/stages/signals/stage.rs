//! Signal extraction wiring: `interactions` → [`PartitionedPairer`] → `signals` (docs/method.md §1). An
//! interaction whose `tenant` is not a valid tenant id is a dead letter (`invalid_tenant`).
//!
//! State: one pairer per input partition, holding that partition's open sessions. Offsets are
//! committed only up to [`PartitionedPairer::safe_commit_offsets`]: no session incarnation spans the
//! committed offset, so after a crash or a rebalance the stage re-reads from it, rebuilds every
//! session it lost whole, and emits again, unchanged and under the same key, the signals of the rows
//! it reads again (the signals sink keeps one copy). The price: a restart re-reads from the first row
//! of the oldest session still open in the partition (sessions close on their done flag or after
//! `idle_gap_ms` of event time without a row).

use std::collections::HashMap;

use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::runtime::TaskCtl;
use crate::stages::{run_stage, Input, Output, StageCounts, StageLogic, StageRun, StageTask};
use crate::bus::Carry;
use crate::error::Result;
use crate::schema::{DeadLetter, Interaction, TurnType};
use crate::signals::{PartitionedPairer, SignalConfig};

/// The stage's name: its metrics label, its dead letters' `stage`, its consumer group's suffix and its
/// `--only` task name.
pub const NAME: &str = "signals";

/// The outcome counting main turns read but not paired yet when the stage last handled a batch: they
/// wait for their next state or for their session to close (not lost: a later row or the session's
/// idle gap emits them; a restart re-reads them from the committed offset).
pub const WAITING: &str = "waiting (session still open)";

/// The signals stage.
pub struct SignalsStage {
    pairer: PartitionedPairer,
}

impl SignalsStage {
    /// A signals stage with `cfg`.
    pub fn new(cfg: SignalConfig) -> SignalsStage {
        SignalsStage { pairer: PartitionedPairer::new(cfg) }
    }
}

/// The signals stage's task for `cfg`: pairs the `interactions` topic read with `run`'s consumer group
/// until `ctl` ends it (the registry, `crate::stages::run::Stage::build`, calls this).
pub fn build(cfg: &PipelineConfig, bus: &Bus, run: StageRun, ctl: TaskCtl) -> StageTask {
    let stage = SignalsStage::new(cfg.signals.clone());
    let bus = bus.clone();
    Box::pin(async move { run_stage(&bus, &run, stage, &ctl).await })
}

impl StageLogic for SignalsStage {
    type In = Interaction;
    fn name(&self) -> &'static str {
        NAME
    }
    async fn handle(&mut self, batch: Vec<Input<Interaction>>, out: &Output, counts: &mut StageCounts) -> Result<()> {
        let rebuilt = self.pairer.rebuilt();
        for input in batch {
            counts.add("interactions", 1);
            if let Some(Err(e)) = input.row.tenant.as_deref().map(crate::schema::validate_tenant) {
                // Written to the topic by another producer (ingest and the proxy check it first).
                counts.add("dead_letter: invalid_tenant", 1);
                let payload = serde_json::to_vec(&input.row)?;
                let d = DeadLetter::new(NAME, "invalid_tenant", format!("interaction {}: {e}", input.row.interaction_id), &payload, input.lineage)
                    .with_keys(&input.row.session_id, Some(&input.row.interaction_id));
                out.dead(d).await?;
                continue;
            }
            if input.row.turn_type == TurnType::Side {
                counts.add("side turns (recorded, not paired)", 1);
            }
            for (s, turn) in self.pairer.push(input.row, input.lineage) {
                counts.add(&format!("signal: {}", s.kind.as_str()), 1);
                if let Some(r) = &s.excluded_reason {
                    counts.add(&format!("excluded: {}", r.split(" for ").next().unwrap_or(r)), 1);
                }
                let carry = Carry { interaction: turn, ..Default::default() };
                out.emit(&s, Some(&carry)).await?;
            }
        }
        counts.set(WAITING, self.pairer.waiting_turns() as u64);
        let rebuilt = self.pairer.rebuilt() - rebuilt;
        if rebuilt > 0 {
            counts.add("partition state rebuilt (read again from the committed offset)", rebuilt);
        }
        Ok(())
    }
    fn hold(&mut self) -> HashMap<i32, i64> {
        self.pairer.safe_commit_offsets()
    }
    fn on_rebalance(&mut self, assigned: &[i32]) {
        self.pairer.retain_partitions(assigned);
    }
}
