//! `checkpoints`: one row per published checkpoint (issue "trainer").

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::fields::{i64f, schema_version_field, ts, utf8};
use super::table::Table;

/// A checkpoint the trainer wrote and published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Schema version.
    pub schema_version: i32,
    /// Key: `<run id>/<version>`.
    pub checkpoint_id: String,
    /// Training run id (the checkpoints folder's run).
    pub run_id: String,
    /// Tenant whose adapter this is (per-tenant training); null for a policy shared by all tenants.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Policy version (1, 2, ...; 0 is the initial weights).
    pub version: i64,
    /// Parent version.
    pub parent_version: i64,
    /// Optimizer steps taken when written.
    pub step: i64,
    /// Method (`binary`, `opd`, `combined`).
    pub method: String,
    /// Hash of the trainer configuration.
    pub config_hash: String,
    /// Folder holding the checkpoint (weights, optimizer state, manifest.json).
    pub path: String,
    /// `full` or `lora`.
    pub weights_format: String,
    /// Number of samples consumed since the parent.
    pub samples: i64,
    /// Metrics of the steps since the parent (JSON).
    pub metrics: String,
    /// Lineage: sample ids and their source topic/partition/offsets consumed since the parent (JSON).
    pub lineage: String,
    /// When published (ms). Also the event time.
    pub created_time: i64,
}

impl Table for Checkpoint {
    const NAME: &'static str = "checkpoints";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "checkpoint_id";
    const DOC: &'static str = "Checkpoints published by the trainer after their files are durable: \
        version, parent, step, method, config hash, folder, metrics and lineage of the samples consumed.";
    fn fields() -> Vec<Field> {
        vec![
            schema_version_field(),
            utf8("checkpoint_id", false, "<run id>/<version>."),
            utf8("run_id", false, "Training run id."),
            utf8("tenant", true, "Tenant whose adapter this is (per-tenant training); null for a policy shared by all tenants."),
            i64f("version", false, "Policy version."),
            i64f("parent_version", false, "Parent version."),
            i64f("step", false, "Optimizer steps taken."),
            utf8("method", false, "binary | opd | combined."),
            utf8("config_hash", false, "Hash of the trainer configuration."),
            utf8("path", false, "Checkpoint folder."),
            utf8("weights_format", false, "full | lora."),
            i64f("samples", false, "Samples consumed since the parent."),
            utf8("metrics", false, "Metrics since the parent (JSON)."),
            utf8("lineage", false, "Sample ids and source positions consumed since the parent (JSON)."),
            ts("created_time", false, "When published (UTC)."),
        ]
    }
    fn key(&self) -> &str {
        &self.checkpoint_id
    }
    fn session_id(&self) -> &str {
        &self.run_id
    }
    fn event_time_ms(&self) -> i64 {
        self.created_time
    }
}
