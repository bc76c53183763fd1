//! Task control shared by every long-running task (stages, lake sinks, trainer): stop requests,
//! `--until-idle` completion, and a consumer loop that knows whether it has caught up with its topic.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::bus::{Bus, BusContext, RebalanceFlag, Revoked};
use crate::error::{Error, Result};

/// A flag a task raises when it has finished (until-idle mode) — downstream tasks wait for it.
#[derive(Clone, Debug)]
pub struct DoneFlag(Arc<watch::Sender<bool>>);

impl Default for DoneFlag {
    fn default() -> Self {
        DoneFlag(Arc::new(watch::channel(false).0))
    }
}

impl DoneFlag {
    /// Marks the task done.
    pub fn set(&self) {
        self.0.send_replace(true);
    }
    /// Whether the task is done.
    pub fn is_set(&self) -> bool {
        *self.0.borrow()
    }
}

/// A process-wide stop request (Ctrl-C / SIGTERM, or the end of a demo).
#[derive(Clone, Debug)]
pub struct Stop(watch::Receiver<bool>, Arc<watch::Sender<bool>>);

impl Default for Stop {
    fn default() -> Self {
        let (tx, rx) = watch::channel(false);
        Stop(rx, Arc::new(tx))
    }
}

impl Stop {
    /// Requests every holder to stop.
    pub fn request(&self) {
        self.1.send_replace(true);
    }
    /// A stop of its own that is also requested when this one is, while requesting it leaves this one
    /// alone: for a part that ends itself with a stop request (a demo run) inside a longer job (an
    /// online ablation). Spawns a task on the current Tokio runtime (it ends when either is requested).
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn child(&self) -> Stop {
        let child = Stop::default();
        let (mut parent, mut own, c) = (self.clone(), child.clone(), child.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = parent.wait() => c.request(),
                _ = own.wait() => {}
            }
        });
        child
    }
    /// Whether a stop was requested.
    pub fn requested(&self) -> bool {
        *self.0.borrow()
    }
    /// Resolves when a stop is requested.
    pub async fn wait(&mut self) {
        while !*self.0.borrow() {
            if self.0.changed().await.is_err() {
                return;
            }
        }
    }
    /// Requests a stop on Ctrl-C or SIGTERM.
    pub fn on_signals(&self) {
        let s = self.clone();
        tokio::spawn(async move {
            #[cfg(unix)]
            {
                let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(_) => return,
                };
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {},
                    _ = term.recv() => {},
                }
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("stop requested; finishing in-flight work");
            s.request();
        });
    }

    /// [`Stop::on_signals`] for commands whose unfinished work may be dropped (`ingest`: what it has
    /// not produced yet is read again by the next run): the first Ctrl-C or SIGTERM requests a stop,
    /// a second one of either ends the process at once with exit status 130.
    pub fn on_signals_second_exits(&self) {
        let s = self.clone();
        tokio::spawn(async move {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{signal, SignalKind};
                // Persistent streams: a second signal that comes while the first is handled still counts.
                let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else { return };
                for n in 0.. {
                    tokio::select! {
                        _ = int.recv() => {},
                        _ = term.recv() => {},
                    }
                    if n > 0 {
                        eprintln!("second stop signal: exiting now");
                        std::process::exit(130);
                    }
                    eprintln!("stop requested: finishing in-flight records (a second Ctrl-C or SIGTERM exits at once)");
                    s.request();
                }
            }
            #[cfg(not(unix))]
            {
                for n in 0.. {
                    let _ = tokio::signal::ctrl_c().await;
                    if n > 0 {
                        std::process::exit(130);
                    }
                    s.request();
                }
            }
        });
    }
}

/// How a task decides it is finished.
#[derive(Clone, Debug)]
pub struct TaskCtl {
    /// Task name (for logs).
    pub name: String,
    /// Exit once every input is processed (batch use and tests); otherwise run until stopped.
    pub until_idle: bool,
    /// How long the input must stay quiet (and caught up) before an until-idle task exits, in ms.
    pub idle_ms: u64,
    /// In-process tasks that feed this one; an until-idle task waits for all of them to finish.
    pub upstream: Vec<DoneFlag>,
    /// Raised when this task finishes.
    pub done: DoneFlag,
    /// Stop request.
    pub stop: Stop,
}

impl TaskCtl {
    /// A control block named `name`.
    pub fn new(name: &str, until_idle: bool, stop: Stop) -> TaskCtl {
        TaskCtl { name: name.to_string(), until_idle, idle_ms: 1500, upstream: vec![], done: DoneFlag::default(), stop }
    }
    /// Adds an upstream task.
    pub fn after(mut self, up: &DoneFlag) -> TaskCtl {
        self.upstream.push(up.clone());
        self
    }
    /// Whether every in-process upstream task is done.
    pub fn upstream_done(&self) -> bool {
        self.upstream.iter().all(DoneFlag::is_set)
    }
    /// How long the task's next poll for records may wait, given `base` (its usual wait), `quiet_ms`
    /// (ms since its last record) and `pending` (its own unfinished work, as for
    /// [`InputLoop::idle_finished`]), so that an until-idle task decides it is idle when the idle wait
    /// ends, not up to one poll later:
    /// - not until-idle, or an upstream task still running: `base`;
    /// - quiet for less than `idle_ms`: the milliseconds left of the idle wait (at most `base`);
    /// - quiet long enough but work pending: [`PENDING_POLL`] (at most `base`), so the task finishes
    ///   soon after its work does (pending work is checked locally, without a broker request);
    /// - quiet long enough, nothing pending: `base` (the idle check then asks the broker, so it is not
    ///   repeated faster than the usual poll).
    ///
    /// Never under 1 ms.
    pub fn poll_wait(&self, quiet_ms: u64, base: Duration, pending: usize) -> Duration {
        if !self.until_idle || !self.upstream_done() {
            return base;
        }
        let wait = if quiet_ms < self.idle_ms {
            Duration::from_millis(self.idle_ms - quiet_ms)
        } else if pending > 0 {
            PENDING_POLL
        } else {
            base
        };
        wait.min(base).max(Duration::from_millis(1))
    }
}

/// The longest an until-idle task that is quiet long enough waits between polls while its own work
/// (e.g. a sink's file writes) is still pending ([`TaskCtl::poll_wait`]).
pub const PENDING_POLL: Duration = Duration::from_millis(20);

/// One consumed record.
#[derive(Debug, Clone)]
pub struct InMsg {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Message key (session id).
    pub key: String,
    /// Payload bytes (empty for a null payload).
    pub payload: Vec<u8>,
}

/// How long dropping an [`InputLoop`] waits for librdkafka to close its consumer.
///
/// librdkafka's close serves a pending rebalance first, and its unassign waits on the group
/// coordinator without a timeout: after a broker restart (seen with nisshi 0.8.1 SIGKILLed and
/// restarted, `tests/e2e/chaos/broker.rs`) a finished `--until-idle` process hung there for minutes after
/// every record was written and committed. Offsets are committed explicitly before a loop ends, so a
/// close that does not finish loses nothing: it is left to finish (or not) on its own thread and the
/// process goes on, exiting normally.
pub const CONSUMER_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times an [`InputLoop`] replaces its consumer after a fatal error within
/// [`CONSUMER_RECREATE_WINDOW`] before the error is returned instead (two processes configured with one
/// `group.instance.id` fence each other forever: that is a configuration error to report, not to retry).
pub const CONSUMER_RECREATE_LIMIT: usize = 5;

/// The window of [`CONSUMER_RECREATE_LIMIT`].
pub const CONSUMER_RECREATE_WINDOW: Duration = Duration::from_secs(600);

/// A consumer-group reader of one topic with offset bookkeeping and an until-idle check.
///
/// A consumer that hits a fatal error never delivers again. librdkafka raises one when a static member
/// (`group.instance.id`) is fenced: by a copy of the process that took its place after it exceeded
/// `max.poll.interval.ms`, or by its own rejoin after a broker restart racing a commit that still
/// carried the old member id (seen with noida-db stopped and restarted, `tests/e2e/chaos/broker.rs`). The
/// loop then replaces the consumer in-process (same group and instance id) and goes on from the
/// group's committed offsets, as a restarted process would; the caller sees a rebalance with a new
/// [`InputLoop::generation`] and drops every partition's uncommitted state.
pub struct InputLoop {
    /// Dropped by hand ([`close_consumer`]), bounded by [`CONSUMER_CLOSE_TIMEOUT`].
    consumer: std::mem::ManuallyDrop<StreamConsumer<BusContext>>,
    flag: RebalanceFlag,
    bus: Bus,
    /// `max.poll.interval.ms` asked for (to create a replacement consumer alike).
    max_poll_ms: u32,
    /// Consumers replaced so far (0: the first one still reads).
    generation: u64,
    /// When the consumer was replaced, newest last (the ones within [`CONSUMER_RECREATE_WINDOW`]).
    recreated_at: Vec<Instant>,
    /// Full topic name.
    pub topic: String,
    consumed_next: HashMap<i32, i64>,
    last_msg: Instant,
    group: String,
    /// Stage label of this loop's metrics ([`InputLoop::for_stage`]; default: the group).
    stage: String,
}

impl Drop for InputLoop {
    fn drop(&mut self) {
        if let Some(f) = self.bus.flow() {
            f.unregister(&self.group, &self.topic);
        }
        // SAFETY: `consumer` is not used after this point; `drop` runs once.
        let consumer = unsafe { std::mem::ManuallyDrop::take(&mut self.consumer) };
        close_consumer(consumer, &self.topic, &self.group);
    }
}

/// Drops `consumer` on its own thread, waiting at most [`CONSUMER_CLOSE_TIMEOUT`] for it.
fn close_consumer(consumer: StreamConsumer<BusContext>, topic: &str, group: &str) {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let closing = std::thread::Builder::new().name("consumer-close".into()).spawn(move || {
        drop(consumer);
        let _ = tx.send(());
    });
    if closing.is_ok() && rx.recv_timeout(CONSUMER_CLOSE_TIMEOUT).is_err() {
        tracing::warn!(%topic, %group, timeout_s = CONSUMER_CLOSE_TIMEOUT.as_secs(), "consumer close did not finish; left on its own thread (offsets were committed)");
    }
}

/// Leaves out of `out` the records of the partitions `revoked` names.
fn drop_revoked(out: &mut Vec<InMsg>, revoked: Option<Revoked>) {
    match revoked {
        Some(Revoked::All) => out.clear(),
        Some(Revoked::Partitions(ps)) => out.retain(|x| !ps.contains(&x.partition)),
        None => {}
    }
}

impl InputLoop {
    /// Subscribes group `group` to `topic` (full name).
    ///
    /// # Errors
    /// [`Error::Kafka`] when the consumer cannot be created.
    pub fn new(bus: &Bus, group: &str, topic: &str) -> Result<InputLoop> {
        Self::with_max_poll_interval(bus, group, topic, 0)
    }

    /// [`InputLoop::new`] for a caller that may not poll for up to `max_poll_ms` milliseconds between
    /// batches (see [`Bus::consumer_with_max_poll`]); the bus's own setting applies when it is larger.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the consumer cannot be created.
    pub fn with_max_poll_interval(bus: &Bus, group: &str, topic: &str, max_poll_ms: u32) -> Result<InputLoop> {
        let (consumer, flag) = bus.consumer_with_max_poll(group, &[topic.to_string()], max_poll_ms)?;
        if let Some(f) = bus.flow() {
            f.register(group, topic);
        }
        Ok(InputLoop {
            consumer: std::mem::ManuallyDrop::new(consumer),
            flag,
            bus: bus.clone(),
            max_poll_ms,
            generation: 0,
            recreated_at: vec![],
            topic: topic.to_string(),
            consumed_next: HashMap::new(),
            last_msg: Instant::now(),
            group: group.to_string(),
            stage: group.to_string(),
        })
    }

    /// Names the stage this loop feeds in the process-wide metrics (`records_in_total{stage}`,
    /// `consumer_lag{stage}`): a fixed stage name, not an id.
    pub fn for_stage(mut self, stage: &str) -> InputLoop {
        self.stage = stage.to_string();
        self
    }

    /// True (once) after partitions were assigned or revoked, or the consumer was replaced.
    pub fn rebalanced(&self) -> bool {
        self.flag.take()
    }

    /// How many times the consumer was replaced after a fatal error (type docs). A caller that keeps
    /// per-partition state past the committed offsets drops all of it when this changes: the new
    /// consumer reads again from the committed offsets, also of partitions it is assigned again.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The partitions this consumer lost since the last call: revoked by a rebalance (eager: all it
    /// had; cooperative: those that move), or all of them after a rebalance error or after the consumer
    /// was replaced. None when none was. What this loop read of them is forgotten (a partition assigned
    /// again is read again from the group's committed offset). A caller that holds state for records of
    /// a revoked partition drops it: their new owner reads them again from the committed offset.
    pub fn take_revoked(&mut self) -> Option<Revoked> {
        let r = self.flag.take_revoked()?;
        match &r {
            Revoked::All => self.consumed_next.clear(),
            Revoked::Partitions(ps) => self.consumed_next.retain(|p, _| !ps.contains(p)),
        }
        Some(r)
    }

    /// Moves the read position of `partition` (assigned to this consumer) back or forward to `offset`:
    /// the next records of that partition start there.
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the seek (e.g. the partition is not assigned).
    pub fn seek(&mut self, partition: i32, offset: i64) -> Result<()> {
        self.consumer.seek(&self.topic, partition, Offset::Offset(offset), Duration::from_secs(10))?;
        self.consumed_next.insert(partition, offset);
        Ok(())
    }

    /// The partitions currently assigned to this consumer.
    pub fn assigned(&self) -> Vec<i32> {
        self.consumer
            .assignment()
            .map(|t| t.elements().iter().map(|e| e.partition()).collect())
            .unwrap_or_default()
    }

    /// Receives up to `max` records, waiting at most `wait` for the first and returning what arrived.
    ///
    /// A consumer that hit a fatal error is replaced first (type docs); records received from it in
    /// this call are left out (the replacement reads them again from the committed offsets). Records
    /// received before a revocation of their partition within this call are left out too: not yet
    /// handled, they are uncommitted, and the partition's owner (this consumer again, when it gets the
    /// partition back) reads them again from the committed offset.
    ///
    /// # Errors
    /// [`Error::Kafka`] on a fatal consumer error past [`CONSUMER_RECREATE_LIMIT`] or when the
    /// replacement cannot be created (transient errors are logged and skipped).
    pub async fn next_batch(&mut self, max: usize, wait: Duration) -> Result<Vec<InMsg>> {
        if self.recover_if_fatal()? {
            return Ok(vec![]);
        }
        let mut out: Vec<InMsg> = vec![];
        // revocations before this call concern no record of it
        let _ = self.flag.take_recent_revoked();
        let deadline = tokio::time::Instant::now() + wait;
        while out.len() < max {
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() && !out.is_empty() {
                break;
            }
            let timeout = if out.is_empty() { remaining } else { Duration::from_millis(0).max(remaining.min(Duration::from_millis(20))) };
            match tokio::time::timeout(timeout, self.consumer.recv()).await {
                Err(_) => break,
                Ok(Err(e)) => {
                    tracing::warn!(topic = %self.topic, error = %e, "consumer error");
                    if self.recover_if_fatal()? {
                        return Ok(vec![]);
                    }
                    if out.is_empty() {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    break;
                }
                Ok(Ok(m)) => {
                    // a rebalance callback ran inside this recv: what came before from a revoked
                    // partition is read again from the committed offset
                    drop_revoked(&mut out, self.flag.take_recent_revoked());
                    let msg = InMsg {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default(),
                        payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    };
                    if !self.consumed_next.contains_key(&msg.partition) {
                        tracing::debug!(topic = %self.topic, partition = msg.partition, offset = msg.offset, "first record of partition");
                    }
                    self.consumed_next.insert(msg.partition, msg.offset + 1);
                    if let Some(f) = self.bus.flow() {
                        f.consumed(&self.group, &self.topic, msg.partition, msg.offset + 1);
                    }
                    out.push(msg);
                }
            }
        }
        drop_revoked(&mut out, self.flag.take_recent_revoked());
        if !out.is_empty() {
            self.last_msg = Instant::now();
            self.export_lag(&out);
        }
        Ok(out)
    }

    /// Counts a received batch and sets the lag of its partitions from the high watermarks librdkafka
    /// cached from its fetch responses (no request to the broker).
    fn export_lag(&self, batch: &[InMsg]) {
        crate::metrics::records_in(&self.stage, &self.topic, batch.len() as u64);
        let mut parts: Vec<i32> = batch.iter().map(|m| m.partition).collect();
        parts.sort_unstable();
        parts.dedup();
        for p in parts {
            if let (Some(high), Some(next)) = (self.cached_high_watermark(p), self.consumed_next.get(&p)) {
                crate::metrics::consumer_lag(&self.stage, &self.topic, p, high - next);
            }
        }
    }

    /// The high watermark of `partition` that librdkafka cached from its last fetch response (`None`
    /// when none arrived yet). rdkafka has no safe wrapper for this non-blocking call.
    fn cached_high_watermark(&self, partition: i32) -> Option<i64> {
        let topic = std::ffi::CString::new(self.topic.as_str()).ok()?;
        let (mut low, mut high) = (-1i64, -1i64);
        // SAFETY: the client pointer is valid while `self.consumer` lives; `topic` is a NUL-terminated
        // string that outlives the call; `low` and `high` are valid for writes.
        let err = unsafe { rdkafka::bindings::rd_kafka_get_watermark_offsets(self.consumer.client().native_ptr(), topic.as_ptr(), partition, &mut low, &mut high) };
        (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
    }

    /// Commits `next offset` per partition (the offset of the next record to read) synchronously.
    ///
    /// A commit that fails leaves the records to be read again; every caller's output is keyed and
    /// de-duplicated downstream. A fenced consumer is replaced by the next [`InputLoop::next_batch`].
    /// Nothing is sent while no partition is assigned (a replaced consumer still joining, or a
    /// rebalance under way): a static member's commit then races its own join and the broker answers
    /// `FENCED_INSTANCE_ID`, which is fatal to the consumer.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the commit fails (e.g. the partition was revoked, or the consumer was
    /// fenced); `ConsumerCommit(AssignmentLost)` when no partition is assigned. Partitions of `next`
    /// not assigned to this consumer now are left out, not committed: after a rebalance their new owner
    /// commits them, and a commit from here could move its committed offset back or past what it has
    /// not read.
    pub fn commit(&self, next: &HashMap<i32, i64>) -> Result<()> {
        if next.is_empty() {
            return Ok(());
        }
        let assigned = self.assigned();
        if assigned.is_empty() {
            return Err(Error::Kafka(rdkafka::error::KafkaError::ConsumerCommit(rdkafka::types::RDKafkaErrorCode::AssignmentLost)));
        }
        let mut tpl = TopicPartitionList::new();
        for (p, o) in next {
            if assigned.contains(p) {
                tpl.add_partition_offset(&self.topic, *p, Offset::Offset(*o))?;
            } else {
                tracing::debug!(topic = %self.topic, partition = p, offset = o, "not committed: the partition is not assigned to this consumer");
            }
        }
        if tpl.count() == 0 {
            return Ok(());
        }
        self.consumer.commit(&tpl, CommitMode::Sync)?;
        Ok(())
    }

    /// Replaces the consumer when it hit a fatal error (type docs): true when it did. The old one is
    /// closed within [`CONSUMER_CLOSE_TIMEOUT`]; what this loop read is forgotten and a rebalance is
    /// reported.
    ///
    /// # Errors
    /// [`Error::Kafka`] (`MessageConsumptionFatal`, with the fatal error's code) after
    /// [`CONSUMER_RECREATE_LIMIT`] replacements within [`CONSUMER_RECREATE_WINDOW`]; [`Error::Kafka`]
    /// when the replacement cannot be created.
    fn recover_if_fatal(&mut self) -> Result<bool> {
        let Some((code, reason)) = self.consumer.client().fatal_error() else {
            return Ok(false);
        };
        self.recreated_at.retain(|t| t.elapsed() < CONSUMER_RECREATE_WINDOW);
        if self.recreated_at.len() >= CONSUMER_RECREATE_LIMIT {
            tracing::error!(topic = %self.topic, group = %self.group, %reason, replaced = self.recreated_at.len(), window_s = CONSUMER_RECREATE_WINDOW.as_secs(), "fatal consumer error again after replacing the consumer; giving up (is another process using the same group.instance.id?)");
            return Err(Error::Kafka(rdkafka::error::KafkaError::MessageConsumptionFatal(code)));
        }
        tracing::warn!(topic = %self.topic, group = %self.group, %reason, "fatal consumer error: replacing the consumer; reading again from the committed offsets");
        let (consumer, flag) = self.bus.consumer_with_max_poll(&self.group, std::slice::from_ref(&self.topic), self.max_poll_ms)?;
        let old = std::mem::replace(&mut *self.consumer, consumer);
        close_consumer(old, &self.topic, &self.group);
        flag.raise();
        flag.revoke(None);
        self.flag = flag;
        self.consumed_next.clear();
        self.generation += 1;
        self.recreated_at.push(Instant::now());
        crate::metrics::consumer_recreated(&self.stage, &self.topic);
        Ok(true)
    }

    /// True when, by the high watermarks librdkafka cached from its last fetch responses (no request to
    /// the broker), this consumer has read every record of every partition assigned to it. False with
    /// no partition assigned, for a partition no fetch response has arrived for yet, and for a partition
    /// this loop read no record of that is not empty (it may have started past records). A cheap hint,
    /// not a decision: records produced since those responses are not seen (use
    /// [`InputLoop::caught_up`] to decide).
    pub fn drained(&self) -> bool {
        let assigned = self.assigned();
        !assigned.is_empty()
            && assigned.iter().all(|p| match self.cached_high_watermark(*p) {
                Some(high) => self.consumed_next.get(p).copied().unwrap_or(0) >= high,
                None => false,
            })
    }

    /// Milliseconds since the last record arrived.
    pub fn quiet_ms(&self) -> u64 {
        self.last_msg.elapsed().as_millis() as u64
    }

    /// True when this consumer has read (or its group has committed) every record up to the high
    /// watermark of each partition assigned to it. A consumer with no partition (more members than
    /// partitions, or before its first assignment) is caught up when its group has committed every
    /// partition of the topic up to its high watermark: the other members did the work.
    ///
    /// # Errors
    /// [`Error::Kafka`] when watermarks or committed offsets cannot be fetched.
    pub async fn caught_up(&self) -> Result<bool> {
        let assigned = self.assigned();
        let marks = self.bus.watermarks(&self.topic).await?;
        // An assigned member checks its partitions (what it read counts too); one without a partition
        // checks every partition against what its group committed.
        let own = !assigned.is_empty();
        let parts: Vec<i32> = if own { assigned } else { marks.keys().copied().collect() };
        if parts.is_empty() {
            return Ok(false);
        }
        let mut tpl = TopicPartitionList::new();
        for p in &parts {
            tpl.add_partition(&self.topic, *p);
        }
        let committed: HashMap<i32, i64> = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(5))
            .map(|t| {
                t.elements()
                    .iter()
                    .filter_map(|e| match e.offset() {
                        Offset::Offset(o) => Some((e.partition(), o)),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut caught_up = true;
        for p in parts {
            let (low, high) = marks.get(&p).copied().unwrap_or((0, 0));
            let read = if own { self.consumed_next.get(&p).copied().unwrap_or(0) } else { 0 };
            let position = read.max(committed.get(&p).copied().unwrap_or(0)).max(low);
            if own {
                crate::metrics::consumer_lag(&self.stage, &self.topic, p, high - position);
            }
            if position < high {
                caught_up = false;
            }
        }
        Ok(caught_up)
    }

    /// How long the task's next [`InputLoop::next_batch`] may wait: [`TaskCtl::poll_wait`] with this
    /// loop's [`InputLoop::quiet_ms`].
    pub fn poll_wait(&self, ctl: &TaskCtl, base: Duration, pending: usize) -> Duration {
        ctl.poll_wait(self.quiet_ms(), base, pending)
    }

    /// Decides whether an until-idle task may finish now: upstream done, input quiet for `ctl.idle_ms`,
    /// and caught up. `pending` is the task's own buffered work (must be 0).
    ///
    /// # Errors
    /// As [`InputLoop::caught_up`].
    pub async fn idle_finished(&self, ctl: &TaskCtl, pending: usize) -> Result<bool> {
        if !ctl.until_idle || pending > 0 || !ctl.upstream_done() || self.quiet_ms() < ctl.idle_ms {
            return Ok(false);
        }
        self.caught_up().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_child_stop_follows_its_parent_but_not_the_other_way() {
        let parent = Stop::default();
        let child = parent.child();
        child.request();
        tokio::task::yield_now().await;
        assert!(child.requested() && !parent.requested(), "the child's own request stays its own");
        let other = parent.child();
        assert!(!other.requested());
        parent.request();
        let mut w = other.clone();
        tokio::time::timeout(Duration::from_secs(5), w.wait()).await.expect("the parent's request reaches the child");
        assert!(other.requested());
    }

    /// The idle wait is 300 ms, the usual poll 200 ms.
    fn ctl(until_idle: bool) -> TaskCtl {
        let mut c = TaskCtl::new("t", until_idle, Stop::default());
        c.idle_ms = 300;
        c
    }

    #[test]
    fn poll_wait_ends_at_the_idle_deadline_then_polls_fast_only_for_pending_work() {
        let base = Duration::from_millis(200);
        let ms = Duration::from_millis;
        let c = ctl(true);
        // quiet 0 ms: 300 left, cut to the usual 200; quiet 250: 50 left; quiet 299: 1 left
        assert_eq!(c.poll_wait(0, base, 0), ms(200));
        assert_eq!(c.poll_wait(250, base, 0), ms(50));
        assert_eq!(c.poll_wait(299, base, 3), ms(1));
        // quiet long enough: 20 ms while work is pending, else the usual poll (the check asks the broker)
        assert_eq!(c.poll_wait(300, base, 2), ms(20));
        assert_eq!(c.poll_wait(5000, base, 1), ms(20));
        assert_eq!(c.poll_wait(300, base, 0), ms(200));
        // a usual poll shorter than the fast one is not lengthened; never 0
        assert_eq!(c.poll_wait(300, ms(5), 1), ms(5));
        assert_eq!(c.poll_wait(300, ms(0), 1), ms(1));
    }

    #[test]
    fn poll_wait_is_the_usual_poll_unless_until_idle_with_upstream_done() {
        let base = Duration::from_millis(200);
        assert_eq!(ctl(false).poll_wait(250, base, 1), base);
        let up = DoneFlag::default();
        let c = ctl(true).after(&up);
        assert_eq!(c.poll_wait(250, base, 1), base);
        up.set();
        assert_eq!(c.poll_wait(250, base, 1), Duration::from_millis(50));
    }
}
