//! `nextstate run`: the pipeline as tasks of one process — policy server, capture proxy, every stage,
//! the trainer and the lake sinks on the embedded defaults, or any subset (`--only`) against a real
//! cluster. The same code either way. On the embedded bus the lake sinks run with any subset (its
//! topics end with the process, so the sinks are the only way a subset's output reaches the lake). Nothing waits for anything else: serving, judging and training
//! run concurrently, and each checkpoint the trainer publishes is loaded by the server while it serves.
//!
//! This module selects the tasks and starts them in order ([`start_pipeline`]); what each start needs
//! lives by what it starts: the stage registry with each stage's chain position, input, groups, builder
//! and embedded catch-up ([`Stage`], `registry`), the servers (`server`), the trainer's reload hook
//! (`reload_hook`), the sinks and their producers (`sinks`), and the running pipeline with its report
//! ([`RunningPipeline`]).

mod registry;
mod reload_hook;
mod running;
mod server;
mod sinks;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinSet;

use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::lake::sink::{sink_group, spawn_sink};
use crate::lake::Lake;
use crate::runtime::{DoneFlag, Stop, TaskCtl};
use crate::serve::reload::Reloader;
use crate::stages::reload::{follow_checkpoints, follower_group, Follower};
use crate::stages::train::{self, TrainOptions, TrainSource};

pub use registry::Stage;
pub use running::{IdleHandle, RunReport, RunningPipeline};
pub use server::resume_tenants;
pub use sinks::sink_tables;

use running::Done;

/// The task names `--only` accepts: `serve`, `proxy`, every stage of the registry ([`Stage::ALL`], the
/// trainer `train` included), `sinks` and `reload`. `reload` is the reload follower
/// ([`crate::stages::reload`]): it consumes `checkpoints` and moves the servers of `[serve] reload_urls`
/// / `url` (and the in-process server, when `serve` runs too) to each checkpoint; without it, an
/// in-process trainer reloads them itself as it publishes.
pub fn tasks() -> Vec<&'static str> {
    let mut out = vec!["serve", "proxy"];
    out.extend(Stage::ALL.map(Stage::name));
    out.extend(["sinks", "reload"]);
    out
}

/// What `nextstate run` should start.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Subset of [`tasks`] (None = every task but `reload`).
    pub only: Option<Vec<String>>,
    /// Exit once every input is processed (the proxy, when run, is an unbounded input: it ends on a
    /// stop request or [`RunningPipeline::close_sources`]).
    pub until_idle: bool,
    /// Checkpoints folder of the trainer.
    pub checkpoints_dir: Option<PathBuf>,
    /// Trainer run id (default: the pipeline name).
    pub run_id: Option<String>,
    /// Resume the trainer (and serve its newest checkpoint) instead of starting fresh.
    pub resume: bool,
}

/// Runs the pipeline until idle (`opts.until_idle`) or stopped.
///
/// # Errors
/// Configuration errors (unknown task names), Kafka and lake errors, and the first task error.
pub async fn run_pipeline(cfg: &PipelineConfig, opts: &RunOptions, stop: Stop) -> Result<RunReport> {
    start_pipeline(cfg, opts, stop).await?.finish().await
}

/// The tasks `opts` selects: `--only`'s list, else every task but the reload follower (the in-process
/// trainer reloads the servers itself).
///
/// # Errors
/// [`Error::Config`] for a name not in [`tasks`].
fn selected_tasks(opts: &RunOptions) -> Result<Vec<String>> {
    let known = tasks();
    match &opts.only {
        Some(list) => {
            for t in list {
                if !known.contains(&t.as_str()) {
                    return Err(Error::Config(format!("unknown task '{t}' in --only (known: {})", known.join(", "))));
                }
            }
            Ok(list.clone())
        }
        None => Ok(known.iter().filter(|t| **t != "reload").map(|s| s.to_string()).collect()),
    }
}

/// Starts every selected task and returns once the servers listen and the embedded catch-up is
/// published.
///
/// # Errors
/// As [`run_pipeline`].
pub async fn start_pipeline(cfg: &PipelineConfig, opts: &RunOptions, stop: Stop) -> Result<RunningPipeline> {
    let selected = selected_tasks(opts)?;
    let has = |t: &str| selected.iter().any(|s| s == t);
    // The pipeline's `[tls] ca_file` is the trust of every HTTP client this process makes from here on.
    cfg.tls.apply()?;
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&sinks::schema_tables()).await?;
    let producer = bus.producer()?;
    let mut report = RunReport::default();
    let checkpoints_dir = opts.checkpoints_dir.clone().unwrap_or_else(|| PathBuf::from("checkpoints"));
    let run_id = opts.run_id.clone().unwrap_or_else(|| cfg.name.clone());
    let source_stop = Stop::default();
    {
        // a global stop also closes the sources
        let (mut g, s) = (stop.clone(), source_stop.clone());
        tokio::spawn(async move {
            g.wait().await;
            s.request();
        });
    }

    let stage_chain: Vec<Stage> = Stage::chain(cfg.method).into_iter().filter(|s| has(s.name())).collect();
    // On the embedded bus every output must reach the lake before the process exits: the in-process
    // topics die with it, so the sinks always run there.
    let run_sinks = has("sinks") || bus.is_embedded();
    if run_sinks && !has("sinks") {
        tracing::info!("embedded bus: the lake sinks run too (--only did not name them; the in-process topics end with this process)");
        report.sinks_added = true;
    }
    let run_train = has(Stage::Train.name());
    let run_follower = has("reload");
    // The external servers to reload (an in-process `serve` replaces `[serve] url`: it is reloaded in
    // place, so only `reload_urls` are external then).
    let external = {
        let mut sc = cfg.serve.clone();
        if has("serve") {
            sc.url = None;
        }
        Reloader::from_config(&sc)?
    };
    if run_follower && !external.is_active() && !has("serve") {
        return Err(Error::Config(format!(
            "--only reload has nothing to reload: set [serve] reload_urls (or url) and a reload kind other than none (serve.reload = {:?})",
            cfg.serve.reload
        )));
    }
    let follower_group = follower_group(&bus, &cfg.name, &external);
    // Every consumer is declared before anything is produced (the embedded bus's flow control waits
    // for declared consumers; see bus::flow).
    for &stage in stage_chain.iter().chain(run_train.then_some(&Stage::Train)) {
        bus.expect_consumer(&stage.group(&bus, &cfg.name), stage.input(cfg.method));
    }
    if run_follower {
        bus.expect_consumer(&follower_group, "checkpoints");
    }
    let sink_tables = sink_tables();
    if run_sinks {
        for &table in &sink_tables {
            bus.expect_consumer(&sink_group(&bus, &cfg.sink, table), table);
        }
    }
    let mut set: JoinSet<Result<Done>> = JoinSet::new();
    let reloads = Arc::new(std::sync::Mutex::new(Vec::new()));

    // 1. The policy server (serving the newest checkpoint when resuming).
    let mut policy = None;
    let mut serve_url = cfg.serve.url.clone();
    if has("serve") {
        let (handle, url, fut) = server::start_server(cfg, opts.resume.then(|| checkpoints_dir.join(&run_id)), stop.clone()).await?;
        policy = Some(handle);
        serve_url = Some(url);
        set.spawn(async move { fut.await.map(|_| Done::Serve) });
    }
    // 2. The capture proxy in front of it.
    let proxy_done = DoneFlag::default();
    let mut proxy_url = None;
    if has("proxy") {
        let (url, fut) = server::start_proxy(cfg, serve_url.clone(), &external, &bus, source_stop.clone()).await?;
        proxy_url = Some(url);
        let flag = proxy_done.clone();
        set.spawn(async move {
            let r = fut.await;
            flag.set();
            r.map(Done::Proxy)
        });
    } else {
        proxy_done.set();
    }

    // 3. The stages.
    let republish_done = DoneFlag::default();
    let mut flags: BTreeMap<Stage, DoneFlag> = BTreeMap::new();
    let mut prev: Option<DoneFlag> = if has("proxy") { Some(proxy_done.clone()) } else { None };
    for &stage in &stage_chain {
        let mut ctl = TaskCtl::new(stage.name(), opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(p) = &prev {
            ctl = ctl.after(p);
        }
        flags.insert(stage, ctl.done.clone());
        prev = Some(ctl.done.clone());
        let fut = stage.build(cfg, &bus, &lake, ctl)?;
        let n = stage.name().to_string();
        set.spawn(async move { fut.await.map(|c| Done::Stage(n, c)) });
    }
    // 4. The trainer, whose checkpoints the server loads as they are published.
    if run_train {
        let mut ctl = TaskCtl::new(Stage::Train.name(), opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(p) = &prev {
            ctl = ctl.after(p);
        }
        flags.insert(Stage::Train, ctl.done.clone());
        let topts = TrainOptions {
            source: TrainSource::Topic,
            resume: opts.resume,
            run_id: Some(run_id.clone()),
            checkpoints_dir: checkpoints_dir.clone(),
            max_steps: None,
            metrics_jsonl: None,
            metrics_jsonl_extra: vec![],
        };
        // With a follower in this process, it reloads (in order, from the topic); else the trainer does.
        let on_checkpoint = if run_follower { reload_hook::reloader(None, None, reloads.clone()) } else { reload_hook::reloader(policy.clone(), Some(external.clone()), reloads.clone()) };
        let (cfg2, bus2) = (cfg.clone(), bus.clone());
        set.spawn(async move { train::run_train(&cfg2, &topts, &bus2, &ctl, Some(on_checkpoint)).await.map(Done::Train) });
    }
    // 4b. The reload follower, after the in-process trainer when it runs.
    if run_follower {
        let mut ctl = TaskCtl::new("reload", opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(f) = flags.get(&Stage::Train) {
            ctl = ctl.after(f);
        }
        let follower = Follower { group: follower_group.clone(), run_id: run_id.clone(), reloader: external.clone(), local: policy.clone(), loaded_log: Some(reloads.clone()) };
        let bus2 = bus.clone();
        set.spawn(async move { follow_checkpoints(&bus2, &follower, &ctl).await.map(|c| Done::Stage("reload".into(), c)) });
    }
    // 5. The lake sinks.
    if run_sinks {
        for &table in &sink_tables {
            let mut ctl = TaskCtl::new(&format!("sink:{table}"), opts.until_idle, stop.clone()).after(&republish_done);
            for f in sinks::producers_of(table, &flags, &proxy_done) {
                ctl = ctl.after(&f);
            }
            let (bus, lake, sink_cfg) = (bus.clone(), lake.clone(), cfg.sink.clone());
            let dl = if table == "dead_letters" { None } else { Some(producer.clone()) };
            set.spawn(async move { spawn_sink(table, &bus, &lake, &sink_cfg, &ctl, dl.as_ref()).await.map(|s| Done::Sink(table.to_string(), s)) });
        }
    }
    // 6. Embedded default: re-publish each stage's pending input from the lake (the mock cluster is new).
    if bus.is_embedded() {
        for &stage in stage_chain.iter().chain(run_train.then_some(&Stage::Train)) {
            match stage.republish(&lake, &producer, cfg, &checkpoints_dir.join(&run_id)).await {
                Ok(n) => {
                    report.republished.insert(stage.name().to_string(), n);
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
    Ok(RunningPipeline { set, report, stop, source_stop, policy, serve_url, proxy_url, reloads, producer, keep_serving: false, idle: DoneFlag::default(), bus, lake })
}
