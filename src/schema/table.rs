//! [`Table`]: what a record type stored as a lake table and carried on a Kafka topic provides.

use arrow::datatypes::Field;
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
