//! Which topics `nextstate run` creates and sinks, and which in-process tasks produce into each, so an
//! until-idle sink ends only after its producers.

use std::collections::BTreeMap;

use super::registry::Stage;
use crate::runtime::DoneFlag;
use crate::schema::{self, DeadLetter, Interaction, Table};

/// Every table a sink is run for: `interactions`, the outputs of every stage of the registry
/// ([`Stage::outputs`]) in data-flow order, and `dead_letters`.
pub fn sink_tables() -> Vec<&'static str> {
    let mut out = vec![Interaction::NAME];
    out.extend(Stage::ALL.into_iter().flat_map(|s| s.outputs().iter().copied()));
    out.push(DeadLetter::NAME);
    out
}

/// Every table of the schema: the topics the pipeline makes sure exist.
pub(super) fn schema_tables() -> Vec<&'static str> {
    schema::all_schemas().into_iter().map(|(n, _)| n).collect()
}

/// In-process tasks whose output lands in `table` (a sink waits for them in until-idle mode): the
/// running stages that write it ([`Stage::writes`]) and, for `interactions` and `dead_letters`, the
/// capture proxy.
pub(super) fn producers_of(table: &str, flags: &BTreeMap<Stage, DoneFlag>, proxy_done: &DoneFlag) -> Vec<DoneFlag> {
    let mut out: Vec<DoneFlag> = flags.iter().filter(|(s, _)| s.writes(table)).map(|(_, f)| f.clone()).collect();
    if table == Interaction::NAME || table == DeadLetter::NAME {
        out.push(proxy_done.clone());
    }
    out
}
