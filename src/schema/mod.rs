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
mod dead_letters;
mod eval_scores;
mod hints;
mod interactions;
mod judgments;
mod samples;
mod signals;
mod teacher;
mod tenant;
mod train_steps;

pub use checkpoints::Checkpoint;
pub use dead_letters::DeadLetter;
pub use eval_scores::EvalScore;
pub use hints::{HintCandidate, HintRecord};
pub use interactions::{Interaction, Message, ToolCall, TurnType};
pub use judgments::{Judgment, Vote};
pub use samples::{Sample, SampleType, TeacherCandidate};
pub use signals::{NextStateKind, Signal};
pub use teacher::TeacherLogprobs;
pub use tenant::{tenant_or_default, tenant_session_key, validate_tenant, TenantError, DEFAULT_TENANT, MAX_TENANT_LEN, TENANT_HEADERS};
pub use train_steps::TrainStep;

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, FieldRef, Schema, SchemaRef, TimeUnit};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A record type that is stored as a lake table and carried on a Kafka topic of the same name.
pub trait Table: Serialize + DeserializeOwned + Clone + Send + Sync + std::fmt::Debug + 'static {
    /// Table and topic name (`interactions`, `signals`, ...).
    const NAME: &'static str;
    /// Version of this schema; bumped on any incompatible change.
    const SCHEMA_VERSION: i32;
    /// Name of the primary-key column (unique per row; used for idempotent writes).
    const KEY: &'static str;
    /// One-paragraph description of the table, stored in the schema metadata.
    const DOC: &'static str;
    /// The Arrow fields, in column order, each with a `doc` metadata entry.
    fn fields() -> Vec<Field>;
    /// This row's primary key.
    fn key(&self) -> &str;
    /// The session this row belongs to.
    fn session_id(&self) -> &str;
    /// The Kafka message key, which decides the partition: the session id (one session's rows stay in
    /// order), except where a table says otherwise (`samples`: the tenant, so one tenant's samples stay
    /// in order in one partition and trainer processes of one consumer group split the tenants).
    fn message_key(&self) -> &str {
        self.session_id()
    }
    /// Event time in ms since the Unix epoch; decides the `date=` partition.
    fn event_time_ms(&self) -> i64;
}

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

// ---- field constructors (keep the table files readable) ----

pub(crate) fn doc(f: Field, doc: &str) -> Field {
    f.with_metadata(HashMap::from([("doc".to_string(), doc.to_string())]))
}
/// Field metadata key that marks a column's storage layout in the lake (see [`HISTORY_LAYOUT`]).
pub const LAYOUT_KEY: &str = "layout";
/// [`LAYOUT_KEY`] value of a column whose value in each row repeats the session's previous rows and
/// grows by a suffix (the request history: a session of n turns holds O(n²) messages). The lake writes
/// it without a dictionary (its values are all distinct) and in pages of up to
/// [`crate::lake::HISTORY_PAGE_BYTES`], with each file's rows grouped by session, so ZSTD finds the
/// previous turn's copy in the same page (measured in docs/BENCHMARKS.md §8).
pub const HISTORY_LAYOUT: &str = "history";

/// `f` marked with the [`HISTORY_LAYOUT`] storage layout.
pub(crate) fn history(f: Field) -> Field {
    let mut md = f.metadata().clone();
    md.insert(LAYOUT_KEY.to_string(), HISTORY_LAYOUT.to_string());
    f.with_metadata(md)
}
pub(crate) fn utf8(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Utf8, nullable), d)
}
pub(crate) fn i32f(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Int32, nullable), d)
}
pub(crate) fn i64f(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Int64, nullable), d)
}
pub(crate) fn f32f(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Float32, nullable), d)
}
pub(crate) fn f64f(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Float64, nullable), d)
}
pub(crate) fn boolf(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Boolean, nullable), d)
}
pub(crate) fn ts(name: &str, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())), nullable), d)
}
pub(crate) fn list_of(name: &str, item: DataType, nullable: bool, d: &str) -> Field {
    doc(Field::new(name, DataType::List(Arc::new(Field::new("element", item, false))), nullable), d)
}
pub(crate) fn list_of_lists(name: &str, item: DataType, nullable: bool, d: &str) -> Field {
    let inner = DataType::List(Arc::new(Field::new("element", item, false)));
    doc(Field::new(name, DataType::List(Arc::new(Field::new("element", inner, false))), nullable), d)
}
pub(crate) fn list_of_struct(name: &str, fields: Vec<Field>, nullable: bool, d: &str) -> Field {
    let st = DataType::Struct(fields.into());
    doc(Field::new(name, DataType::List(Arc::new(Field::new("element", st, false))), nullable), d)
}
pub(crate) fn schema_version_field() -> Field {
    i32f("schema_version", false, "Version of this table's schema (see schemas/).")
}

/// Lineage columns shared by the tables a stage writes: where the input row came from.
pub(crate) fn lineage_fields() -> Vec<Field> {
    vec![
        utf8("source_topic", true, "Kafka topic the input record was read from (null when read from a file)."),
        i32f("source_partition", true, "Kafka partition of the input record."),
        i64f("source_offset", true, "Kafka offset of the input record."),
        utf8("source_file", true, "Input file the record was read from (ingest), if any."),
        i64f("source_line", true, "1-based line (JSONL) or record index (JSON arrays) within source_file."),
    ]
}

/// Where a record came from: a Kafka position or a file position (all optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Lineage {
    /// Kafka topic.
    pub source_topic: Option<String>,
    /// Kafka partition.
    pub source_partition: Option<i32>,
    /// Kafka offset.
    pub source_offset: Option<i64>,
    /// Input file.
    pub source_file: Option<String>,
    /// 1-based line or record index in the file.
    pub source_line: Option<i64>,
}

/// Hex sha256 of the given parts (each length-prefixed so that ("ab","c") ≠ ("a","bc")), truncated
/// to 32 hex characters (128 bits). Used for content-addressed ids and cache keys.
pub fn content_hash(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..16])
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests;
