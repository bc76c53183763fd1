//! A started pipeline: the tasks it runs, the handle an orchestrator holds to close its sources or stop
//! it, and the report it ends with ([`RunningPipeline::finish`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::task::JoinSet;

use crate::bus::{Bus, BusProducer};
use crate::error::{Error, Result};
use crate::lake::sink::SinkStats;
use crate::lake::Lake;
use crate::runtime::{DoneFlag, Stop};
use crate::serve::proxy::ProxyStats;
use crate::serve::PolicyHandle;
use crate::stages::train::TrainReport;
use crate::stages::StageCounts;

/// The result of a run: counts per stage and per sink.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunReport {
    /// Per stage: outcome counts.
    pub stages: BTreeMap<String, StageCounts>,
    /// Per table: sink statistics.
    pub sinks: BTreeMap<String, SinkStats>,
    /// Rows re-published from the lake per stage (embedded catch-up).
    pub republished: BTreeMap<String, u64>,
    /// The trainer's report, when it ran.
    pub train: Option<TrainReport>,
    /// The proxy's counters, when it ran.
    pub proxy: Option<ProxyStats>,
    /// Checkpoint versions some server confirmed (the in-process one, or an external one of `[serve]`),
    /// once per checkpoint, in the order they were loaded.
    pub reloads: Vec<i64>,
    /// The lake sinks ran although `--only` did not name them: on the embedded bus the topics end with
    /// the process, so what the selected tasks produce reaches the lake only through the sinks.
    pub sinks_added: bool,
}

/// What one task of the pipeline ended with.
pub(super) enum Done {
    Stage(String, StageCounts),
    Sink(String, SinkStats),
    Train(TrainReport),
    Proxy(ProxyStats),
    Serve,
}

/// A started pipeline: addresses of its servers and the handle to finish it.
pub struct RunningPipeline {
    pub(super) set: JoinSet<Result<Done>>,
    pub(super) report: RunReport,
    pub(super) stop: Stop,
    pub(super) source_stop: Stop,
    /// The in-process policy server (reload handle), if `serve` runs.
    pub policy: Option<PolicyHandle>,
    /// `http://host:port` of the in-process policy server.
    pub serve_url: Option<String>,
    /// `http://host:port` of the in-process proxy.
    pub proxy_url: Option<String>,
    pub(super) reloads: Arc<std::sync::Mutex<Vec<i64>>>,
    pub(super) producer: BusProducer,
    pub(super) keep_serving: bool,
    pub(super) idle: DoneFlag,
    /// The bus the pipeline runs on.
    pub bus: Bus,
    /// The lake.
    pub lake: Lake,
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
