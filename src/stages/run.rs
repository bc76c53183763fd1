//! `nextstate run`: the pipeline as tasks of one process — policy server, capture proxy, every stage,
//! the trainer and the lake sinks on the embedded defaults, or any subset (`--only`) against a real
//! cluster. The same code either way. On the embedded bus the lake sinks run with any subset (its
//! topics end with the process, so the sinks are the only way a subset's output reaches the lake). Nothing waits for anything else: serving, judging and training
//! run concurrently, and each checkpoint the trainer publishes is loaded by the server while it serves.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinSet;

use crate::bus::{Bus, BusProducer};
use crate::config::{Method, PipelineConfig};
use crate::error::{Error, Result};
use crate::lake::sink::{run_sink, SinkStats};
use crate::lake::Lake;
use crate::runtime::{DoneFlag, Stop, TaskCtl};
use crate::schema;
use crate::serve::PolicyHandle;

/// The task names `--only` accepts. `reload` is the reload follower ([`crate::stages::reload`]): it
/// consumes `checkpoints` and moves the servers of `[serve] reload_urls` / `url` (and the in-process
/// server, when `serve` runs too) to each checkpoint; without it, an in-process trainer reloads them
/// itself as it publishes.
pub const TASKS: &[&str] = &["serve", "proxy", "signals", "judge", "hint", "teacher", "train", "sinks", "reload"];

/// What `nextstate run` should start.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Subset of [`TASKS`] (None = every task but `reload`).
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

/// The result of a run: counts per stage and per sink.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunReport {
    /// Per stage: outcome counts.
    pub stages: BTreeMap<String, crate::stages::StageCounts>,
    /// Per table: sink statistics.
    pub sinks: BTreeMap<String, SinkStats>,
    /// Rows re-published from the lake per stage (embedded catch-up).
    pub republished: BTreeMap<String, u64>,
    /// The trainer's report, when it ran.
    pub train: Option<crate::stages::train::TrainReport>,
    /// The proxy's counters, when it ran.
    pub proxy: Option<crate::serve::proxy::ProxyStats>,
    /// Checkpoint versions some server confirmed (the in-process one, or an external one of `[serve]`),
    /// once per checkpoint, in the order they were loaded.
    pub reloads: Vec<i64>,
    /// The lake sinks ran although `--only` did not name them: on the embedded bus the topics end with
    /// the process, so what the selected tasks produce reaches the lake only through the sinks.
    pub sinks_added: bool,
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
pub const SINK_TABLES: &[&str] =
    &["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples", "train_steps", "checkpoints", "dead_letters"];

enum Done {
    Stage(String, crate::stages::StageCounts),
    Sink(String, SinkStats),
    Train(crate::stages::train::TrainReport),
    Proxy(crate::serve::proxy::ProxyStats),
    Serve,
}

/// A started pipeline: addresses of its servers and the handle to finish it.
pub struct RunningPipeline {
    set: JoinSet<Result<Done>>,
    report: RunReport,
    stop: Stop,
    source_stop: Stop,
    /// The in-process policy server (reload handle), if `serve` runs.
    pub policy: Option<PolicyHandle>,
    /// `http://host:port` of the in-process policy server.
    pub serve_url: Option<String>,
    /// `http://host:port` of the in-process proxy.
    pub proxy_url: Option<String>,
    reloads: Arc<std::sync::Mutex<Vec<i64>>>,
    producer: BusProducer,
    keep_serving: bool,
    idle: DoneFlag,
    /// The bus the pipeline runs on.
    pub bus: Bus,
    /// The lake.
    pub lake: Lake,
}

/// Runs the pipeline until idle (`opts.until_idle`) or stopped.
///
/// # Errors
/// Configuration errors (unknown task names), Kafka and lake errors, and the first task error.
pub async fn run_pipeline(cfg: &PipelineConfig, opts: &RunOptions, stop: Stop) -> Result<RunReport> {
    start_pipeline(cfg, opts, stop).await?.finish().await
}

async fn bind(host: &str, port: u16, tls: Option<&crate::net::ServerTls>) -> Result<(crate::net::Listener, String)> {
    let l = crate::net::Listener::bind(host, port, tls).await?;
    let url = l.url()?;
    Ok((l, url))
}

/// Starts every selected task and returns once the servers listen and the embedded catch-up is
/// published.
///
/// # Errors
/// As [`run_pipeline`].
pub async fn start_pipeline(cfg: &PipelineConfig, opts: &RunOptions, stop: Stop) -> Result<RunningPipeline> {
    let selected: Vec<String> = match &opts.only {
        Some(list) => {
            for t in list {
                if !TASKS.contains(&t.as_str()) {
                    return Err(Error::Config(format!("unknown task '{t}' in --only (known: {})", TASKS.join(", "))));
                }
            }
            list.clone()
        }
        // Every task but the reload follower: the in-process trainer reloads the servers itself.
        None => TASKS.iter().filter(|t| **t != "reload").map(|s| s.to_string()).collect(),
    };
    let has = |t: &str| selected.iter().any(|s| s == t);
    // The pipeline's `[tls] ca_file` is the trust of every HTTP client this process makes from here on.
    cfg.tls.apply()?;
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&schema_tables()).await?;
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

    let stage_chain: Vec<&'static str> = chain(cfg.method).into_iter().filter(|n| has(n)).collect();
    // On the embedded bus every output must reach the lake before the process exits: the in-process
    // topics die with it, so the sinks always run there.
    let run_sinks = has("sinks") || bus.is_embedded();
    if run_sinks && !has("sinks") {
        tracing::info!("embedded bus: the lake sinks run too (--only did not name them; the in-process topics end with this process)");
        report.sinks_added = true;
    }
    let run_train = has("train");
    let run_follower = has("reload");
    // The external servers to reload (an in-process `serve` replaces `[serve] url`: it is reloaded in
    // place, so only `reload_urls` are external then).
    let external = {
        let mut sc = cfg.serve.clone();
        if has("serve") {
            sc.url = None;
        }
        crate::serve::reload::Reloader::from_config(&sc)?
    };
    if run_follower && !external.is_active() && !has("serve") {
        return Err(Error::Config(format!(
            "--only reload has nothing to reload: set [serve] reload_urls (or url) and a reload kind other than none (serve.reload = {:?})",
            cfg.serve.reload
        )));
    }
    let follower_group = crate::stages::reload::follower_group(&bus, &cfg.name, &external);
    // Every consumer is declared before anything is produced (the embedded bus's flow control waits
    // for declared consumers; see bus::flow).
    for &name in &stage_chain {
        bus.expect_consumer(&crate::stages::stage_group(&bus, cfg, name), crate::stages::stage_input(cfg, name));
    }
    if run_train {
        bus.expect_consumer(&bus.group(&format!("nextstate.{}.trainer", cfg.name)), "samples");
    }
    if run_follower {
        bus.expect_consumer(&follower_group, "checkpoints");
    }
    if run_sinks {
        for &table in SINK_TABLES {
            bus.expect_consumer(&sink_group(&bus, &cfg.sink, table), table);
        }
    }
    let mut set: JoinSet<Result<Done>> = JoinSet::new();
    let reloads = Arc::new(std::sync::Mutex::new(Vec::new()));

    // 1. The policy server (serving the newest checkpoint when resuming).
    let mut policy = None;
    let mut serve_url = cfg.serve.url.clone();
    if has("serve") {
        let (handle, url, fut) = start_server(cfg, opts.resume.then(|| checkpoints_dir.join(&run_id)), stop.clone()).await?;
        policy = Some(handle);
        serve_url = Some(url);
        set.spawn(async move { fut.await.map(|_| Done::Serve) });
    }
    // 2. The capture proxy in front of it.
    let proxy_done = DoneFlag::default();
    let mut proxy_url = None;
    if has("proxy") {
        let upstream = serve_url.clone().ok_or_else(|| Error::Config("the proxy needs an upstream: run `serve` too, or set [serve] url".into()))?;
        let mut popts = crate::serve::proxy::ProxyOptions::new(upstream);
        // External upstream: the versions the reloader confirms stand in for an `x-policy-version`.
        popts.upstream_versions = Some(external.loaded());
        popts.default_turn_type = schema::TurnType::parse(&cfg.proxy.default_turn_type)
            .ok_or_else(|| Error::Config(format!("proxy.default_turn_type must be main or side, got {}", cfg.proxy.default_turn_type)))?;
        popts.spool = crate::serve::proxy::emit::SpoolConfig::new(&cfg.proxy.spool_dir, cfg.proxy.spool_max_bytes);
        if let Some(env) = &cfg.proxy.api_key_env {
            popts.api_key = Some(std::env::var(env).map_err(|_| Error::Config(format!("proxy.api_key_env: ${env} is not set")))?);
        }
        let (listener, url) = bind(&cfg.proxy.host, cfg.proxy.port, cfg.proxy.tls.as_ref()).await?;
        tracing::info!(%url, "capture proxy listening");
        proxy_url = Some(url);
        let proxy = crate::serve::proxy::Proxy::start(popts, &bus).await?;
        let (mut s, flag) = (source_stop.clone(), proxy_done.clone());
        set.spawn(async move {
            let r = proxy.serve(listener, async move { s.wait().await }).await;
            flag.set();
            r.map(Done::Proxy)
        });
    } else {
        proxy_done.set();
    }

    // 3. The stages.
    let republish_done = DoneFlag::default();
    let mut flags: BTreeMap<&str, DoneFlag> = BTreeMap::new();
    let mut prev: Option<DoneFlag> = if has("proxy") { Some(proxy_done.clone()) } else { None };
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
    // 4. The trainer, whose checkpoints the server loads as they are published.
    if run_train {
        let mut ctl = TaskCtl::new("train", opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(p) = &prev {
            ctl = ctl.after(p);
        }
        flags.insert("train", ctl.done.clone());
        let topts = crate::stages::train::TrainOptions {
            source: crate::stages::train::TrainSource::Topic,
            resume: opts.resume,
            run_id: Some(run_id.clone()),
            checkpoints_dir: checkpoints_dir.clone(),
            max_steps: None,
        };
        // With a follower in this process, it reloads (in order, from the topic); else the trainer does.
        let on_checkpoint = if run_follower { reloader(None, None, reloads.clone()) } else { reloader(policy.clone(), Some(external.clone()), reloads.clone()) };
        let (cfg2, bus2) = (cfg.clone(), bus.clone());
        set.spawn(async move { crate::stages::train::run_train(&cfg2, &topts, &bus2, &ctl, Some(on_checkpoint)).await.map(Done::Train) });
    }
    // 4b. The reload follower, after the in-process trainer when it runs.
    if run_follower {
        let mut ctl = TaskCtl::new("reload", opts.until_idle, stop.clone()).after(&republish_done);
        if let Some(f) = flags.get("train") {
            ctl = ctl.after(f);
        }
        let follower = crate::stages::reload::Follower { group: follower_group.clone(), run_id: run_id.clone(), reloader: external.clone(), local: policy.clone(), loaded_log: Some(reloads.clone()) };
        let bus2 = bus.clone();
        set.spawn(async move { crate::stages::reload::follow_checkpoints(&bus2, &follower, &ctl).await.map(|c| Done::Stage("reload".into(), c)) });
    }
    // 5. The lake sinks.
    if run_sinks {
        for &table in SINK_TABLES {
            let mut ctl = TaskCtl::new(&format!("sink:{table}"), opts.until_idle, stop.clone()).after(&republish_done);
            for f in producers_of(table, &flags, &proxy_done) {
                ctl = ctl.after(&f);
            }
            let (bus, lake, sink_cfg) = (bus.clone(), lake.clone(), cfg.sink.clone());
            let dl = if table == "dead_letters" { None } else { Some(producer.clone()) };
            set.spawn(async move { spawn_sink(table, &bus, &lake, &sink_cfg, &ctl, dl.as_ref()).await.map(|s| Done::Sink(table.to_string(), s)) });
        }
    }
    // 6. Embedded default: re-publish each stage's pending input from the lake (the mock cluster is new).
    if bus.is_embedded() {
        let mut todo: Vec<&str> = stage_chain.clone();
        if run_train {
            todo.push("train");
        }
        for name in todo {
            let r = if name == "train" {
                crate::stages::train::republish_untrained(&lake, &producer, cfg, &checkpoints_dir.join(&run_id)).await
            } else {
                republish(&lake, &producer, cfg, name).await
            };
            match r {
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
    Ok(RunningPipeline { set, report, stop, source_stop, policy, serve_url, proxy_url, reloads, producer, keep_serving: false, idle: DoneFlag::default(), bus, lake })
}

/// Lets an orchestrator close a pipeline's sources and learn when everything but the policy server has
/// finished (see [`RunningPipeline::keep_serving_when_idle`]).
#[derive(Clone, Debug)]
pub struct IdleHandle {
    source_stop: Stop,
    idle: DoneFlag,
}

impl IdleHandle {
    /// Stops the unbounded sources (the proxy).
    pub fn close_sources(&self) {
        self.source_stop.request();
    }
    /// Whether every task but the policy server has finished.
    pub fn is_set(&self) -> bool {
        self.idle.is_set()
    }
}

impl RunningPipeline {
    /// Keep the policy server running after every other task finished (until-idle), until a stop
    /// request: the caller can still query the final weights. [`IdleHandle::is_set`] tells when.
    pub fn keep_serving_when_idle(&mut self) {
        self.keep_serving = true;
    }

    /// A handle to close the sources and watch for idleness.
    pub fn idle_flag(&self) -> IdleHandle {
        IdleHandle { source_stop: self.source_stop.clone(), idle: self.idle.clone() }
    }

    /// Stops the unbounded sources (the proxy, after it has flushed its events); an until-idle pipeline
    /// then drains and finishes.
    pub fn close_sources(&self) {
        self.source_stop.request();
    }

    /// Stops every task.
    pub fn stop(&self) {
        self.stop.request();
    }

    /// Waits for the tasks (until idle, or until stopped) and returns the report. The first task error
    /// stops the others and is returned.
    ///
    /// # Errors
    /// The first task error.
    pub async fn finish(mut self) -> Result<RunReport> {
        let mut first_err: Option<Error> = None;
        let only_servers_left = |set: &JoinSet<Result<Done>>, serving: bool| serving && set.len() == 1;
        let serving = self.policy.is_some();
        while let Some(res) = self.set.join_next().await {
            match res {
                Ok(Ok(Done::Stage(n, c))) => {
                    self.report.stages.insert(n, c);
                }
                Ok(Ok(Done::Sink(t, s))) => {
                    self.report.sinks.insert(t, s);
                }
                Ok(Ok(Done::Train(r))) => self.report.train = Some(r),
                Ok(Ok(Done::Proxy(p))) => self.report.proxy = Some(p),
                Ok(Ok(Done::Serve)) => {}
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "task failed; stopping the others");
                    self.stop.request();
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    self.stop.request();
                    first_err.get_or_insert(Error::Internal(format!("task panicked: {e}")));
                }
            }
            // Everything but the server has finished (until-idle): stop serving too, unless asked to keep
            // serving (then only mark the pipeline idle).
            if only_servers_left(&self.set, serving) && !self.stop.requested() {
                self.idle.set();
                if !self.keep_serving {
                    self.stop.request();
                }
            }
        }
        self.producer.flush()?;
        self.report.reloads = self.reloads.lock().map(|r| r.clone()).unwrap_or_default();
        match first_err {
            Some(e) => Err(e),
            None => Ok(self.report),
        }
    }
}

/// Loads the policy (or the newest checkpoint under `resume_run`) and starts the server; returns its
/// reload handle, URL and the future serving it until `stop`.
async fn start_server(
    cfg: &PipelineConfig,
    resume_run: Option<PathBuf>,
    stop: Stop,
) -> Result<(PolicyHandle, String, std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>)> {
    use crate::model::{LanguageModel, LoadOptions, LogprobMode, Trainable};
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let load = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable: Trainable::Frozen };
    let latest = match &resume_run {
        Some(dir) => crate::trainer::latest_complete(dir)?,
        None => None,
    };
    let (lm, version) = {
        let (load, base) = (load.clone(), cfg.policy.model.clone());
        let latest = latest.clone();
        tokio::task::spawn_blocking(move || -> Result<(LanguageModel, i64)> {
            match latest {
                Some((path, m)) => {
                    let mut lm = LanguageModel::load_checkpoint(&path, Some(&base), &load)?;
                    lm.transformer_mut().merge_lora()?;
                    Ok((lm, m.version))
                }
                None => Ok((LanguageModel::load(&base, &load)?, 0)),
            }
        })
        .await
        .map_err(|e| Error::Internal(format!("model load task: {e}")))??
    };
    let logprobs_mode = match cfg.serve.logprobs_mode.as_str() {
        "raw" => LogprobMode::Raw,
        "sampling" => LogprobMode::Sampling,
        other => return Err(Error::Config(format!("serve.logprobs_mode = {other:?} (raw or sampling)"))),
    };
    let opts = crate::serve::ServerOptions {
        model_name: cfg.policy.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "policy".into()),
        api_key: None,
        max_body_bytes: 16 << 20,
        max_batch: cfg.serve.max_batch,
        batch_window: std::time::Duration::from_millis(cfg.serve.batch_window_ms),
        default_max_tokens: cfg.serve.default_max_tokens,
        logprobs_mode,
        load,
        base_dir: cfg.policy.model.clone(),
        threads: cfg.policy.threads,
    };
    let server = crate::serve::PolicyServer::start(lm, version, opts)?;
    let handle = server.handle();
    let (listener, url) = bind(&cfg.serve.host, cfg.serve.port, cfg.serve.tls.as_ref()).await?;
    tracing::info!(%url, version, "policy server listening");
    let mut s = stop;
    let fut = Box::pin(async move { server.serve(listener, async move { s.wait().await }).await });
    Ok((handle, url, fut))
}

/// The trainer's checkpoint callback: the in-process server reloads in place, then the external servers
/// ([`crate::serve::reload::Reloader`]). One task handles the checkpoints in the order they are
/// published (a server never gets version 3 before 2); versions some server confirmed go to `log`.
fn reloader(policy: Option<PolicyHandle>, external: Option<crate::serve::reload::Reloader>, log: Arc<std::sync::Mutex<Vec<i64>>>) -> crate::stages::train::OnCheckpoint {
    let external = external.filter(|r| r.is_active());
    if policy.is_none() && external.is_none() {
        return Box::new(|_row: &schema::Checkpoint| {});
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(PathBuf, i64)>();
    tokio::spawn(async move {
        while let Some((path, version)) = rx.recv().await {
            let mut loaded = false;
            if let Some(h) = &policy {
                match h.reload(path.clone(), version).await {
                    Ok(_) => loaded = true,
                    Err(e) => tracing::error!(version, error = %e, "the policy server could not load the checkpoint"),
                }
            }
            if let Some(r) = &external {
                // Failures are logged (with the engine's answer) by the reloader.
                loaded |= r.reload(&path, version).await.iter().any(|o| matches!(o, crate::serve::reload::ReloadOutcome::Loaded { .. }));
            }
            if loaded {
                if let Ok(mut l) = log.lock() {
                    l.push(version);
                }
            }
        }
    });
    Box::new(move |row: &schema::Checkpoint| {
        // Err only once the worker is gone (the runtime is shutting down).
        let _ = tx.send((PathBuf::from(&row.path), row.version));
    })
}

fn schema_tables() -> Vec<&'static str> {
    schema::all_schemas().into_iter().map(|(n, _)| n).collect()
}

/// In-process tasks whose output lands in `table` (a sink waits for them in until-idle mode).
fn producers_of(table: &str, flags: &BTreeMap<&str, DoneFlag>, proxy_done: &DoneFlag) -> Vec<DoneFlag> {
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
