//! [`Lineage`]: where a record came from, and its columns in the tables a stage writes.

use arrow::datatypes::Field;
use serde::Serialize;

use super::fields::{i32f, i64f, utf8};

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
