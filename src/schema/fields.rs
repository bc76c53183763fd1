//! Field constructors: Arrow fields with their `doc` metadata (keep the table files readable), and the
//! storage-layout marks of [`LAYOUT_KEY`].

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, TimeUnit};

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
