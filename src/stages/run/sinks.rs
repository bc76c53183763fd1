//! Which topics `nextstate run` creates and sinks, and which in-process tasks produce into each, so an
//! until-idle sink ends only after its producers.

use std::collections::BTreeMap;

use crate::runtime::DoneFlag;
use crate::schema;

/// Every table a sink is run for.
pub const SINK_TABLES: &[&str] =
    &["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "train_steps", "checkpoints", "dead_letters"];

/// Every table of the schema: the topics the pipeline makes sure exist.
pub(super) fn schema_tables() -> Vec<&'static str> {
    schema::all_schemas().into_iter().map(|(n, _)| n).collect()
}

/// In-process tasks whose output lands in `table` (a sink waits for them in until-idle mode).
pub(super) fn producers_of(table: &str, flags: &BTreeMap<&str, DoneFlag>, proxy_done: &DoneFlag) -> Vec<DoneFlag> {
    let names: &[&str] = match table {
        "signals" => &["signals"],
        "judgments" => &["judge"],
        "hints" => &["hint"],
        "teacher_logprobs" | "samples" => &["teacher"],
        "train_steps" | "checkpoints" => &["train"],
        "dead_letters" => &["signals", "judge", "hint", "teacher", "train"],
        _ => &[],
    };
    let mut out: Vec<DoneFlag> = names.iter().filter_map(|n| flags.get(n).cloned()).collect();
    if matches!(table, "interactions" | "dead_letters") {
        out.push(proxy_done.clone());
    }
    out
}
