//! `nextstate run --only reload`: a reload follower. It consumes the `checkpoints` topic with its own
//! consumer group and moves the configured servers ([`crate::serve::reload`]: `[serve] reload`,
//! `reload_urls` / `url`) to each checkpoint of the run, in the order the trainer published them.
//!
//! - Each row's reload finishes (every server confirmed, was skipped, or failed) before the next row
//!   is read; its offset is committed right after, so a restarted follower resumes after the last
//!   row it handled and does not reload it again.
//! - Rows of other runs (`run_id` ≠ the follower's run: `--run-id`, default the pipeline name) are
//!   skipped and counted (`other_run`); undecodable rows too (`bad_record`).
//! - A server only moves forward: a version not newer than the one it confirmed is skipped
//!   (`skipped_not_newer`). A trainer started afresh (not `--resume`) under the same run id numbers
//!   its checkpoints from 1 again: give it a new run id, or restart the follower.
//! - Failures are counted per server with their reason (`failed: unreachable`, `failed: http_4xx`,
//!   `failed: http_5xx`, `failed: refused`) and logged with the engine's answer; the follower goes on
//!   with the next checkpoint (a server that missed version 3 gets 4).
//! - A row with a tenant (per-tenant training) is that tenant's adapter: loaded beside the shared
//!   policy under the tenant's name (`PolicyHandle::reload_tenant`, `Reloader::reload_tenant`), counted
//!   `loaded_tenant` in process; its versions are the tenant's own.
//! - The consumer group is `nextstate.<pipeline>.reload.<hash of the kind and servers>`
//!   ([`follower_group`]): followers of different servers never share a group, so any number of them
//!   each see every checkpoint; two copies of one follower share it (and one of them does the work).
//! - `--until-idle`: the follower ends once the in-process trainer (when it runs) has finished and it
//!   has handled every checkpoint published so far (caught up with the topic, quiet for 1.5 s).
//! - On the embedded bus (no `--brokers`) the topic lives in the process, so a follower there sees only
//!   the checkpoints of a trainer in the same process (`--only train,reload`); nothing is re-read from
//!   the lake.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bus::{Bus, Envelope};
use crate::error::Result;
use crate::runtime::{InputLoop, TaskCtl};
use crate::schema::{Checkpoint, Table};
use crate::serve::reload::{ReloadOutcome, Reloader};
use crate::serve::PolicyHandle;
use crate::stages::StageCounts;

/// The consumer group of a follower of `reloader`'s servers in pipeline `pipeline`:
/// `nextstate.<pipeline>.reload.<first 12 hex of the hash of kind + servers>` (prefixed like every group
/// of the bus).
pub fn follower_group(bus: &Bus, pipeline: &str, reloader: &Reloader) -> String {
    let key = format!("{}|{}", reloader.kind().as_str(), reloader.urls().join("|"));
    let h = crate::schema::content_hash(&[key.as_bytes()]);
    bus.group(&format!("nextstate.{pipeline}.reload.{}", &h[..h.len().min(12)]))
}

/// What a reload follower moves and how it is known.
#[derive(Debug, Clone)]
pub struct Follower {
    /// Its consumer group ([`follower_group`]).
    pub group: String,
    /// The run whose checkpoints it follows.
    pub run_id: String,
    /// The external servers.
    pub reloader: Reloader,
    /// The policy server of this process, when `serve` runs in it: reloaded in place first.
    pub local: Option<PolicyHandle>,
    /// Versions some server confirmed, appended once per checkpoint (the run report's `reloads`).
    pub loaded_log: Option<Arc<Mutex<Vec<i64>>>>,
}

/// Follows the `checkpoints` topic of `bus` and moves `f`'s servers to every checkpoint of its run
/// (module docs). Returns the counts per outcome (per server and row; the in-process server counts as
/// `loaded` / `skipped_not_newer` / `failed: in_process`).
///
/// # Errors
/// [`crate::Error::Kafka`] when the consumer cannot be created, a commit fails or the consumer hits a
/// fatal error. Reload failures are not errors: they are counted.
pub async fn follow_checkpoints(bus: &Bus, f: &Follower, ctl: &TaskCtl) -> Result<StageCounts> {
    let (group, run_id, reloader) = (f.group.as_str(), f.run_id.as_str(), &f.reloader);
    // One row can wait on several servers' reloads (minutes each, with retries): poll rarely is fine.
    let mut input = InputLoop::with_max_poll_interval(bus, group, &bus.topic(Checkpoint::NAME), super::SLOW_STAGE_MAX_POLL_INTERVAL_MS)?.for_stage("reload");
    let mut counts = StageCounts::default();
    tracing::info!(group, run_id, kind = reloader.kind().as_str(), servers = ?reloader.urls(), "reload follower started");
    loop {
        if ctl.stop.requested() {
            break;
        }
        let batch = input.next_batch(16, input.poll_wait(ctl, Duration::from_millis(300), 0)).await?;
        if batch.is_empty() {
            if input.idle_finished(ctl, 0).await? {
                break;
            }
            continue;
        }
        for m in batch {
            match serde_json::from_slice::<Envelope<Checkpoint>>(&m.payload) {
                Err(e) => {
                    tracing::warn!(partition = m.partition, offset = m.offset, error = %e, "reload: undecodable checkpoints record skipped");
                    counts.add("bad_record", 1);
                }
                Ok(env) if env.row.run_id != run_id => counts.add("other_run", 1),
                Ok(env) if env.row.tenant.is_some() => {
                    // A tenant's adapter (per-tenant training): loaded beside the shared policy under the
                    // tenant's name; versions are the tenant's own.
                    let row = env.row;
                    let tenant = row.tenant.as_deref().unwrap_or_default();
                    if let Some(h) = &f.local {
                        match h.reload_tenant(tenant, PathBuf::from(&row.path), row.version).await {
                            Ok(_) => counts.add("loaded_tenant", 1),
                            Err(e) => {
                                tracing::error!(tenant, version = row.version, error = %e, "reload: the in-process server could not load the tenant's adapter");
                                crate::metrics::reload("in_process", "failed_in_process", None);
                                counts.add("failed: in_process", 1);
                            }
                        }
                    }
                    for o in &reloader.reload_tenant(tenant, Path::new(&row.path), row.version).await {
                        counts.add(&o.count_key(), 1);
                    }
                }
                Ok(env) => {
                    let row = env.row;
                    let mut any_loaded = false;
                    if let Some(h) = &f.local {
                        if row.version <= h.version() {
                            counts.add("skipped_not_newer", 1);
                        } else {
                            match h.reload(PathBuf::from(&row.path), row.version).await {
                                Ok(_) => {
                                    crate::metrics::reload("in_process", "loaded", Some(row.version));
                                    counts.add("loaded", 1);
                                    any_loaded = true;
                                }
                                Err(e) => {
                                    tracing::error!(version = row.version, error = %e, "reload: the in-process server could not load the checkpoint");
                                    crate::metrics::reload("in_process", "failed_in_process", None);
                                    counts.add("failed: in_process", 1);
                                }
                            }
                        }
                    }
                    let outcomes = reloader.reload(Path::new(&row.path), row.version).await;
                    for o in &outcomes {
                        counts.add(&o.count_key(), 1);
                        if let ReloadOutcome::Loaded { unload_error: Some(_), .. } = o {
                            counts.add("unload_failed", 1);
                        }
                    }
                    if any_loaded || outcomes.iter().any(|o| matches!(o, ReloadOutcome::Loaded { .. })) {
                        if let Some(l) = &f.loaded_log {
                            l.lock().unwrap_or_else(|p| p.into_inner()).push(row.version);
                        }
                    }
                }
            }
            // Committed once the row is handled (reloaded, skipped or counted as failed).
            input.commit(&HashMap::from([(m.partition, m.offset + 1)]))?;
        }
    }
    tracing::info!(counts = %counts.line(), "reload follower finished");
    Ok(counts)
}
