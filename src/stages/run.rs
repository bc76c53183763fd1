//! `nextstate run`: the configured stages and lake sinks as tasks of one process — all of them on the
//! embedded defaults, or any subset (`--only`) against a real cluster. The same code either way.

use std::collections::BTreeMap;

use tokio::task::JoinSet;

use crate::bus::{Bus, BusProducer};
use crate::config::{Method, PipelineConfig};
use crate::error::{Error, Result};
use crate::lake::sink::{run_sink, SinkStats};
use crate::lake::Lake;
use crate::runtime::{DoneFlag, Stop, TaskCtl};
use crate::schema;

/// The task names `--only` accepts.
pub const TASKS: &[&str] = &["signals", "judge", "hint", "teacher", "sinks"];

/// What `nextstate run` should start.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Subset of [`TASKS`] (None = every stage of the method, and the sinks).
    pub only: Option<Vec<String>>,
    /// Exit once every input is processed.
    pub until_idle: bool,
}

/// The result of a run: counts per stage and per sink.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunReport {
    /// Per stage: outcome counts.
    pub stages: BTreeMap<String, crate::stages::StageCounts>,
    /// Per table: sink statistics.
    pub sinks: BTreeMap<String, SinkStats>,
    /// Rows re-published from the lake per stage (embedded catch-up).
    pub republished: BTreeMap<String, u64>,
}

/// The stages of `method`, in chain order.
pub fn chain(method: Method) -> Vec<&'static str> {
    match method {
        Method::Binary => vec!["signals", "judge", "teacher"],
        Method::Opd => vec!["signals", "hint", "teacher"],
        Method::Combined => vec!["signals", "judge", "hint", "teacher"],
    }
}

/// Every table a sink is run for.
pub const SINK_TABLES: &[&str] = &["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "dead_letters"];

enum Done {
    Stage(String, crate::stages::StageCounts),
    Sink(String, SinkStats),
}

/// Runs the pipeline. `stages` builds the stage tasks (see [`crate::stages::build`]).
///
/// # Errors
/// Configuration errors (unknown task names), Kafka and lake errors, and the first task error.
pub async fn run_pipeline(cfg: &PipelineConfig, opts: &RunOptions, stop: Stop) -> Result<RunReport> {
    let selected: Vec<String> = match &opts.only {
        Some(list) => {
            for t in list {
                if !TASKS.contains(&t.as_str()) {
                    return Err(Error::Config(format!("unknown task '{t}' in --only (known: {})", TASKS.join(", "))));
                }
            }
            list.clone()
        }
        None => chain(cfg.method).into_iter().map(String::from).chain(["sinks".to_string()]).collect(),
    };
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&schema_tables()).await?;
    let producer = bus.producer()?;
    let mut report = RunReport::default();

    let stage_chain: Vec<&'static str> = chain(cfg.method).into_iter().filter(|n| selected.iter().any(|s| s == n)).collect();
    let run_sinks = selected.iter().any(|s| s == "sinks");
    // Every consumer is declared before anything is produced (the embedded bus's flow control waits
    // for declared consumers; see bus::flow).
    for &name in &stage_chain {
        bus.expect_consumer(&crate::stages::stage_group(&bus, cfg, name), crate::stages::stage_input(cfg, name));
    }
    if run_sinks {
        for &table in SINK_TABLES {
            bus.expect_consumer(&sink_group(&bus, &cfg.sink, table), table);
        }
    }
    let republish_done = DoneFlag::default();
    let mut flags: BTreeMap<&str, DoneFlag> = BTreeMap::new();
    let mut set: JoinSet<Result<Done>> = JoinSet::new();
    let mut prev: Option<DoneFlag> = None;
    for &name in &stage_chain {
        let mut ctl = TaskCtl::new(name, opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(p) = &prev {
            ctl = ctl.after(p);
        }
        flags.insert(name, ctl.done.clone());
        prev = Some(ctl.done.clone());
        let fut = crate::stages::build(name, cfg, &bus, &lake, ctl)?;
        let n = name.to_string();
        set.spawn(async move { fut.await.map(|c| Done::Stage(n, c)) });
    }
    if run_sinks {
        for &table in SINK_TABLES {
            let mut ctl = TaskCtl::new(&format!("sink:{table}"), opts.until_idle, stop.clone()).after(&republish_done);
            for f in producers_of(table, &flags) {
                ctl = ctl.after(&f);
            }
            let (bus, lake, sink_cfg) = (bus.clone(), lake.clone(), cfg.sink.clone());
            let dl = if table == "dead_letters" { None } else { Some(producer.clone()) };
            set.spawn(async move { spawn_sink(table, &bus, &lake, &sink_cfg, &ctl, dl.as_ref()).await.map(|s| Done::Sink(table.to_string(), s)) });
        }
    }
    // Embedded default: re-publish each stage's pending input from the lake (the mock cluster is new).
    if bus.is_embedded() {
        for &name in &stage_chain {
            match republish(&lake, &producer, cfg, name).await {
                Ok(n) => {
                    report.republished.insert(name.to_string(), n);
                }
                Err(e) => {
                    stop.request();
                    republish_done.set();
                    return Err(e);
                }
            }
        }
    }
    republish_done.set();
    let mut first_err: Option<Error> = None;
    while let Some(res) = set.join_next().await {
        match res {
            Ok(Ok(Done::Stage(n, c))) => {
                report.stages.insert(n, c);
            }
            Ok(Ok(Done::Sink(t, s))) => {
                report.sinks.insert(t, s);
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "task failed; stopping the others");
                stop.request();
                first_err.get_or_insert(e);
            }
            Err(e) => {
                stop.request();
                first_err.get_or_insert(Error::Internal(format!("task panicked: {e}")));
            }
        }
    }
    producer.flush()?;
    match first_err {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

fn schema_tables() -> Vec<&'static str> {
    schema::all_schemas().into_iter().map(|(n, _)| n).collect()
}

/// In-process tasks whose output lands in `table` (a sink waits for them in until-idle mode).
fn producers_of(table: &str, flags: &BTreeMap<&str, DoneFlag>) -> Vec<DoneFlag> {
    let names: &[&str] = match table {
        "signals" => &["signals"],
        "judgments" => &["judge"],
        "hints" => &["hint"],
        "teacher_logprobs" | "samples" => &["teacher"],
        "dead_letters" => &["signals", "judge", "hint", "teacher"],
        _ => &[],
    };
    names.iter().filter_map(|n| flags.get(n).cloned()).collect()
}

async fn republish(lake: &Lake, producer: &BusProducer, cfg: &PipelineConfig, stage: &str) -> Result<u64> {
    use crate::stages::pending::*;
    match stage {
        "signals" => publish_for_signals(lake, producer).await,
        "judge" => publish_for_judge(lake, producer, &cfg.name).await,
        "hint" => publish_for_hint(lake, producer, &cfg.name, cfg.method.uses_judge()).await,
        "teacher" => publish_for_teacher(lake, producer, &cfg.name, cfg.method.uses_hints()).await,
        _ => Ok(0),
    }
}

/// The consumer group of the lake sink of `table`.
pub fn sink_group(bus: &Bus, cfg: &crate::lake::sink::SinkConfig, table: &str) -> String {
    bus.group(&format!("{}.{}", cfg.group_prefix, table))
}

/// Runs the lake sink of `table` (by name).
///
/// # Errors
/// [`Error::Config`] for an unknown table; sink errors.
pub async fn spawn_sink(table: &str, bus: &Bus, lake: &Lake, cfg: &crate::lake::sink::SinkConfig, ctl: &TaskCtl, dl: Option<&BusProducer>) -> Result<SinkStats> {
    use schema::*;
    match table {
        t if t == Interaction::NAME => run_sink::<Interaction>(bus, lake, cfg, ctl, dl).await,
        t if t == Signal::NAME => run_sink::<Signal>(bus, lake, cfg, ctl, dl).await,
        t if t == Judgment::NAME => run_sink::<Judgment>(bus, lake, cfg, ctl, dl).await,
        t if t == HintRecord::NAME => run_sink::<HintRecord>(bus, lake, cfg, ctl, dl).await,
        t if t == TeacherLogprobs::NAME => run_sink::<TeacherLogprobs>(bus, lake, cfg, ctl, dl).await,
        t if t == Sample::NAME => run_sink::<Sample>(bus, lake, cfg, ctl, dl).await,
        t if t == Checkpoint::NAME => run_sink::<Checkpoint>(bus, lake, cfg, ctl, dl).await,
        t if t == TrainStep::NAME => run_sink::<TrainStep>(bus, lake, cfg, ctl, dl).await,
        t if t == DeadLetter::NAME => run_sink::<DeadLetter>(bus, lake, cfg, ctl, dl).await,
        t => Err(Error::Config(format!("no sink for table '{t}'"))),
    }
}
