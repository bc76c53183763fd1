//! Event schemas: one Rust record type and one documented Arrow schema per table/topic.
//!
//! These are the contract between stages. Every table has a `schema_version` column (and the same
//! number in the Arrow schema metadata), a primary key used for idempotent writes, and a session id
//! used as the Kafka message key so that one session stays on one partition.
//!
//! Conventions (all tables): token ids are `list<int32>`, log-probs `list<float32>` (natural log,
//! nats), times are `timestamp[ms, UTC]` (Rust side: `i64` milliseconds since the Unix epoch),
//! free-form structured values (chat messages, tool calls, metrics) are JSON text in `utf8` columns.
//! `nextstate schema` prints them; `schemas/*.json` holds the same schemas as checked-in files.

/// The row accessors of a [`Table`] impl whose key, session and event time are plain fields:
/// `table_accessors!(key, session, time)` writes `fn key` (`&self.key`), `fn session_id`
/// (`&self.session`) and `fn event_time_ms` (`self.time`, ms since the epoch).
macro_rules! table_accessors {
    ($key:ident, $session:ident, $time:ident) => {
        fn key(&self) -> &str {
            &self.$key
        }
        fn session_id(&self) -> &str {
            &self.$session
        }
        fn event_time_ms(&self) -> i64 {
            self.$time
        }
    };
}

mod checkpoints;
mod clock;
mod dead_letters;
mod eval_scores;
mod fields;
mod hash;
mod hints;
mod interactions;
mod judgments;
mod lineage;
mod samples;
mod signals;
mod table;
mod teacher;
mod tenant;
mod train_steps;

pub use checkpoints::Checkpoint;
pub use clock::now_ms;
pub use dead_letters::DeadLetter;
pub use eval_scores::EvalScore;
pub use fields::{HISTORY_LAYOUT, LAYOUT_KEY};
pub use hash::content_hash;
pub use hints::{HintCandidate, HintRecord};
pub use interactions::{Interaction, Message, ToolCall, TurnType};
pub use judgments::{Judgment, Vote};
pub use lineage::Lineage;
pub use samples::{Sample, SampleType, TeacherCandidate};
pub use signals::{NextStateKind, Signal};
pub use table::Table;
pub use teacher::TeacherLogprobs;
pub use tenant::{tenant_or_default, tenant_session_key, validate_tenant, TenantError, DEFAULT_TENANT, MAX_TENANT_LEN, TENANT_HEADERS};
pub use train_steps::TrainStep;

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{FieldRef, Schema, SchemaRef};

/// The Arrow schema of table `T` with its name, version and description as metadata.
pub fn schema_of<T: Table>() -> SchemaRef {
    let md = HashMap::from([
        ("table".to_string(), T::NAME.to_string()),
        ("schema_version".to_string(), T::SCHEMA_VERSION.to_string()),
        ("primary_key".to_string(), T::KEY.to_string()),
        ("doc".to_string(), T::DOC.to_string()),
    ]);
    Arc::new(Schema::new_with_metadata(T::fields(), md))
}

/// `T::fields()` as `FieldRef`s, the form `serde_arrow` takes.
pub fn field_refs<T: Table>() -> Vec<FieldRef> {
    T::fields().into_iter().map(Arc::new).collect()
}

/// Every table's name and schema, in pipeline order.
pub fn all_schemas() -> Vec<(&'static str, SchemaRef)> {
    vec![
        (Interaction::NAME, schema_of::<Interaction>()),
        (Signal::NAME, schema_of::<Signal>()),
        (Judgment::NAME, schema_of::<Judgment>()),
        (HintRecord::NAME, schema_of::<HintRecord>()),
        (TeacherLogprobs::NAME, schema_of::<TeacherLogprobs>()),
        (Sample::NAME, schema_of::<Sample>()),
        (Checkpoint::NAME, schema_of::<Checkpoint>()),
        (TrainStep::NAME, schema_of::<TrainStep>()),
        (EvalScore::NAME, schema_of::<EvalScore>()),
        (DeadLetter::NAME, schema_of::<DeadLetter>()),
    ]
}

/// The schema as a JSON document (name, version, key, doc, and for each field its name, Arrow type,
/// nullability and doc), as written to `schemas/<table>.json`.
pub fn schema_json(schema: &Schema) -> serde_json::Value {
    let fields: Vec<serde_json::Value> = schema
        .fields()
        .iter()
        .map(|f| {
            serde_json::json!({
                "name": f.name(),
                "type": f.data_type().to_string(),
                "nullable": f.is_nullable(),
                "doc": f.metadata().get("doc").cloned().unwrap_or_default(),
            })
        })
        .collect();
    let md = schema.metadata();
    serde_json::json!({
        "table": md.get("table"),
        "schema_version": md.get("schema_version").and_then(|v| v.parse::<i64>().ok()),
        "primary_key": md.get("primary_key"),
        "doc": md.get("doc"),
        "fields": fields,
    })
}

#[cfg(test)]
mod tests;
