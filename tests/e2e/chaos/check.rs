//! The end-of-run checks of the chaos tests: every table holds each record exactly once (by key), the
//! stage chain is complete (each input has its output or a dead letter saying why), and the trainer's
//! checkpoint lineage consumed each sample exactly once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use nextstate::lake::Lake;
use nextstate::schema::{Checkpoint, DeadLetter, Interaction, Judgment, Sample, Signal, Table, TrainStep};

use super::data::Expected;

/// Counts of what was checked.
#[derive(Debug, Default)]
pub struct Checked {
    /// Rows read per table.
    pub rows: BTreeMap<&'static str, usize>,
    /// Samples in the final checkpoint's lineage.
    pub lineage: usize,
    /// Checkpoints in the final ancestry.
    pub checkpoints: usize,
}

impl Checked {
    /// Total rows checked.
    pub fn total(&self) -> usize {
        self.rows.values().sum::<usize>() + self.lineage
    }
}

/// Keys that occur more than once.
fn duplicates<'a>(keys: impl IntoIterator<Item = &'a str>) -> Vec<(String, usize)> {
    let mut n: HashMap<&str, usize> = HashMap::new();
    for k in keys {
        *n.entry(k).or_default() += 1;
    }
    let mut d: Vec<(String, usize)> = n.into_iter().filter(|(_, c)| *c > 1).map(|(k, c)| (k.to_string(), c)).collect();
    d.sort();
    d
}

fn table<T: Table>(lake: &Lake, checked: &mut Checked) -> Vec<T> {
    let rows = lake.read_table::<T>().unwrap_or_else(|e| panic!("read {}: {e}", T::NAME));
    let dup = duplicates(rows.iter().map(|r| r.key()));
    assert!(dup.is_empty(), "table {} holds keys more than once: {dup:?}", T::NAME);
    checked.rows.insert(T::NAME, rows.len());
    rows
}

/// Checks the lake of a binary-method pipeline named `pipeline` against `e`: up to the judgments, then
/// with `samples` the teacher's output, and with `checkpoints` the trainer's run folder.
pub fn check(lake_dir: &Path, pipeline: &str, e: &Expected, samples: bool, checkpoints: Option<&Path>) -> Checked {
    let lake = Lake::open(lake_dir).expect("open lake");
    let mut c = Checked::default();

    let interactions: Vec<Interaction> = table(&lake, &mut c);
    let got: BTreeSet<String> = interactions.iter().map(|i| i.interaction_id.clone()).collect();
    assert_eq!(got, e.interactions, "interactions: the lake differs from the input files");

    let dead: Vec<DeadLetter> = table(&lake, &mut c);
    // A rejection is one record: the same input rejected again by the same stage for the same reason
    // (after an upstream re-emission) must not be a second row.
    let rejections: Vec<String> = dead.iter().filter_map(|d| d.input_key.as_ref().map(|k| format!("{}/{}/{k}", d.stage, d.reason_code))).collect();
    let dup = duplicates(rejections.iter().map(String::as_str));
    assert!(dup.is_empty(), "dead letters: the same input rejected more than once by a stage: {dup:?}");
    let ingest_dead: BTreeSet<String> = dead.iter().filter(|d| d.stage == "ingest").map(|d| d.dead_letter_id.clone()).collect();
    assert_eq!(ingest_dead, e.ingest_dead, "ingest dead letters differ from the input files'");
    let dead_of = |stage: &str| -> BTreeSet<String> { dead.iter().filter(|d| d.stage == stage).filter_map(|d| d.input_key.clone()).collect() };

    let signals: Vec<Signal> = table(&lake, &mut c);
    let got: BTreeSet<String> = signals.iter().map(|s| s.interaction_id.clone()).collect();
    assert_eq!(got, e.main, "signals: each main turn must have exactly one");

    let judgments: Vec<Judgment> = table(&lake, &mut c);
    let judgments: Vec<Judgment> = judgments.into_iter().filter(|j| j.pipeline == pipeline).collect();
    let judged: BTreeSet<String> = judgments.iter().map(|j| j.interaction_id.clone()).collect();
    assert_eq!(judgments.len(), judged.len(), "judgments: one per turn");
    let want: BTreeSet<String> = signals.iter().filter(|s| s.excluded_reason.is_none()).map(|s| s.interaction_id.clone()).collect();
    let judge_dead = dead_of("judge");
    let accounted: BTreeSet<String> = judged.union(&judge_dead).cloned().collect();
    assert_eq!(accounted, want, "judgments: each signal with a next state is judged or dead-lettered");

    if !samples {
        return c;
    }
    let samples: Vec<Sample> = table(&lake, &mut c);
    let samples: Vec<Sample> = samples.into_iter().filter(|s| s.pipeline == pipeline).collect();
    let sampled: BTreeSet<String> = samples.iter().map(|s| s.interaction_id.clone()).collect();
    assert_eq!(samples.len(), sampled.len(), "samples: at most one per turn");
    let teacher_dead = dead_of("teacher");
    assert!(sampled.is_disjoint(&teacher_dead), "samples: a turn both sampled and dead-lettered by the teacher");
    let scored: BTreeSet<String> = judgments.iter().filter(|j| j.score != 0).map(|j| j.interaction_id.clone()).collect();
    let accounted: BTreeSet<String> = sampled.union(&teacher_dead).cloned().collect();
    assert_eq!(accounted, scored, "samples: each judgment with score ±1 gives a sample or a teacher dead letter");

    if let Some(dir) = checkpoints {
        let steps: Vec<TrainStep> = table(&lake, &mut c);
        let rows: Vec<Checkpoint> = table(&lake, &mut c);
        let scan = nextstate::trainer::scan(&dir.join(pipeline)).expect("scan checkpoints");
        let manifests: Vec<nextstate::trainer::Manifest> = scan.complete.iter().map(|(_, m)| m.clone()).collect();
        let last = manifests.last().expect("at least one checkpoint");
        let chain = nextstate::trainer::ancestry(&manifests, last.version);
        assert_eq!(chain.len(), manifests.len(), "every checkpoint is an ancestor of the newest (no lost branch)");
        let consumed: Vec<&str> = chain.iter().flat_map(|m| m.lineage.iter().map(|l| l.sample_id.as_str())).collect();
        let dup = duplicates(consumed.iter().copied());
        assert!(dup.is_empty(), "the trainer consumed samples more than once: {dup:?}");
        let consumed: BTreeSet<String> = consumed.into_iter().map(str::to_string).collect();
        let lake_samples: BTreeSet<String> = samples.iter().map(|s| s.sample_id.clone()).collect();
        assert_eq!(consumed, lake_samples, "the checkpoints' lineage holds exactly the samples in the lake");
        let versions: BTreeSet<i64> = rows.iter().map(|r| r.version).collect();
        assert_eq!(versions, manifests.iter().map(|m| m.version).collect(), "one checkpoints row per checkpoint folder");
        assert_eq!(steps.len() as i64, last.step, "one train_steps row per optimizer step");
        c.lineage = chain.iter().map(|m| m.lineage.len()).sum();
        c.checkpoints = chain.len();
    }
    c
}
