//! Getting events to Kafka without ever making a client wait: a bounded in-memory channel from the
//! request handlers to one background emitter task, which produces with short timeouts and, while
//! Kafka is unavailable, appends events to a bounded local spool (JSONL segment files) that it replays
//! once Kafka answers again.
//!
//! Guarantees: at-least-once from the moment an event is accepted into the channel, except for
//! events counted in `events_dropped_total` (channel full, spool full, spool I/O error, corrupt spool
//! line) and events still in memory when the process is killed (a graceful shutdown drains the
//! channel and spools what Kafka does not take). Duplicates happen (a segment is replayed whole
//! after a partial failure, a restart replays the spool from its start); the lake dedups by
//! `interaction_id`. While the spool holds events, new events are appended behind them, so a session's
//! turns stay in order.
//!
//! Spool layout: `DIR/spool-<seq, 20 digits>.jsonl`, one event a line:
//! `{"topic": ..., "key": ..., "payload": <the bus envelope JSON>}`. Appends are flushed to the OS at
//! once (no fsync: a process crash loses nothing written, a power cut may).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};

use super::metrics::Metrics;
use crate::bus::BusProducer;
use crate::{Error, Result};

/// One record to produce.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outgoing {
    /// Full topic name.
    pub topic: String,
    /// Message key (session id).
    pub key: String,
    /// The bus envelope (JSON).
    pub payload: Box<serde_json::value::RawValue>,
}

impl PartialEq for Outgoing {
    fn eq(&self, other: &Self) -> bool {
        self.topic == other.topic && self.key == other.key && self.payload.get() == other.payload.get()
    }
}

impl Outgoing {
    /// Wraps `row` in a bus envelope (no carry) for `topic` (full name), keyed by its session id.
    ///
    /// # Errors
    /// [`Error::Json`] when the row cannot be serialised.
    pub fn of<T: crate::schema::Table>(topic: String, row: &T) -> Result<Outgoing> {
        let env = crate::bus::Envelope { row, carry: None };
        let payload = serde_json::value::to_raw_value(&env)?;
        Ok(Outgoing { topic, key: row.session_id().to_string(), payload })
    }
}

/// Spool settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    /// Folder of the segment files (created if missing).
    pub dir: PathBuf,
    /// Most bytes kept on disk; events beyond are dropped and counted.
    pub max_bytes: u64,
    /// A segment is closed and a new one started past this size (replay granularity).
    pub segment_bytes: u64,
}

impl SpoolConfig {
    /// `dir` with `max_bytes`, segments of `min(max_bytes / 4, 4 MiB)` (at least 4 KiB).
    pub fn new(dir: impl Into<PathBuf>, max_bytes: u64) -> SpoolConfig {
        SpoolConfig { dir: dir.into(), max_bytes, segment_bytes: (max_bytes / 4).clamp(4096, 4 << 20) }
    }
}

#[derive(Debug)]
struct Segment {
    seq: u64,
    path: PathBuf,
    bytes: u64,
    events: u64,
}

/// The on-disk spool (see the module docs). Owned by the emitter task.
#[derive(Debug)]
pub struct Spool {
    cfg: SpoolConfig,
    segments: VecDeque<Segment>,
    writer: Option<tokio::fs::File>,
    next_seq: u64,
    bytes: u64,
    events: u64,
}

fn segment_name(seq: u64) -> String {
    format!("spool-{seq:020}.jsonl")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    name.strip_prefix("spool-")?.strip_suffix(".jsonl")?.parse().ok()
}

impl Spool {
    /// Opens (creating) the spool folder and indexes the segments a previous run left there.
    ///
    /// # Errors
    /// [`Error::Io`] when the folder cannot be created or read.
    pub async fn open(cfg: SpoolConfig) -> Result<Spool> {
        tokio::fs::create_dir_all(&cfg.dir).await.map_err(|e| Error::io("create spool dir", &cfg.dir, e))?;
        let mut found = vec![];
        let mut rd = tokio::fs::read_dir(&cfg.dir).await.map_err(|e| Error::io("read spool dir", &cfg.dir, e))?;
        while let Some(entry) = rd.next_entry().await.map_err(|e| Error::io("read spool dir", &cfg.dir, e))? {
            let Some(seq) = entry.file_name().to_str().and_then(parse_segment_name) else { continue };
            let path = entry.path();
            let data = tokio::fs::read(&path).await.map_err(|e| Error::io("read spool segment", &path, e))?;
            let events = data.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count() as u64;
            found.push(Segment { seq, path, bytes: data.len() as u64, events });
        }
        found.sort_by_key(|s| s.seq);
        let next_seq = found.last().map(|s| s.seq + 1).unwrap_or(0);
        let bytes = found.iter().map(|s| s.bytes).sum();
        let events = found.iter().map(|s| s.events).sum();
        Ok(Spool { cfg, segments: found.into(), writer: None, next_seq, bytes, events })
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Events on disk.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// True when nothing is spooled.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// Appends one event. Returns `Ok(false)` (nothing written) when it would exceed `max_bytes`.
    ///
    /// # Errors
    /// [`Error::Io`] when the segment cannot be created or written, [`Error::Json`] when the event
    /// cannot be serialised.
    pub async fn append(&mut self, o: &Outgoing) -> Result<bool> {
        let mut line = serde_json::to_vec(o)?;
        line.push(b'\n');
        let n = line.len() as u64;
        if self.bytes + n > self.cfg.max_bytes {
            return Ok(false);
        }
        let rotate = match (self.segments.back(), &self.writer) {
            (Some(last), Some(_)) => last.bytes + n > self.cfg.segment_bytes && last.bytes > 0,
            _ => true,
        };
        if rotate {
            self.seal().await?;
            let seq = self.next_seq;
            self.next_seq += 1;
            let path = self.cfg.dir.join(segment_name(seq));
            let f = tokio::fs::OpenOptions::new().create(true).append(true).open(&path).await.map_err(|e| Error::io("create spool segment", &path, e))?;
            self.writer = Some(f);
            self.segments.push_back(Segment { seq, path, bytes: 0, events: 0 });
        }
        let (Some(w), Some(seg)) = (self.writer.as_mut(), self.segments.back_mut()) else {
            return Err(Error::Internal("spool writer missing after rotation".into()));
        };
        w.write_all(&line).await.map_err(|e| Error::io("append to spool", &seg.path, e))?;
        w.flush().await.map_err(|e| Error::io("flush spool", &seg.path, e))?;
        seg.bytes += n;
        seg.events += 1;
        self.bytes += n;
        self.events += 1;
        Ok(true)
    }

    /// Closes the segment being written (the next append starts a new one).
    async fn seal(&mut self) -> Result<()> {
        if let Some(mut w) = self.writer.take() {
            let path = self.segments.back().map(|s| s.path.clone()).unwrap_or_default();
            w.flush().await.map_err(|e| Error::io("flush spool", &path, e))?;
        }
        Ok(())
    }

    /// Reads the oldest segment (closing it first if it is the one being written): its sequence
    /// number, the events that parse, and the number of lines that did not.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read.
    pub async fn oldest(&mut self) -> Result<Option<(u64, Vec<Outgoing>, u64)>> {
        let Some((seq, path)) = self.segments.front().map(|f| (f.seq, f.path.clone())) else { return Ok(None) };
        if self.segments.len() == 1 && self.writer.is_some() {
            self.seal().await?;
        }
        let data = tokio::fs::read(&path).await.map_err(|e| Error::io("read spool segment", &path, e))?;
        let mut out = vec![];
        let mut corrupt = 0u64;
        for line in data.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice::<Outgoing>(line) {
                Ok(o) => out.push(o),
                Err(_) => corrupt += 1,
            }
        }
        Ok(Some((seq, out, corrupt)))
    }

    /// Deletes segment `seq` (after its events were delivered).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be removed.
    pub async fn remove(&mut self, seq: u64) -> Result<()> {
        let Some(pos) = self.segments.iter().position(|s| s.seq == seq) else { return Ok(()) };
        if pos + 1 == self.segments.len() && self.writer.is_some() {
            self.seal().await?;
        }
        if let Some(s) = self.segments.remove(pos) {
            match tokio::fs::remove_file(&s.path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    self.segments.insert(pos, s);
                    let path = self.segments[pos].path.clone();
                    return Err(Error::io("remove spool segment", path, e));
                }
            }
            self.bytes -= s.bytes;
            self.events -= s.events;
        }
        Ok(())
    }
}

/// Emitter settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmitterConfig {
    /// Capacity of the channel from the handlers (events beyond are dropped and counted).
    pub queue_capacity: usize,
    /// Most sends awaiting a Kafka acknowledgement at once.
    pub max_in_flight: usize,
    /// A send not acknowledged within this time fails (the producer's `message.timeout.ms`); the
    /// event then goes to the spool.
    pub send_timeout: Duration,
    /// First wait before retrying Kafka after a failure; doubles up to `retry_max`.
    pub retry_min: Duration,
    /// Longest wait between retries.
    pub retry_max: Duration,
}

impl Default for EmitterConfig {
    fn default() -> Self {
        EmitterConfig {
            queue_capacity: 10_000,
            max_in_flight: 512,
            send_timeout: Duration::from_secs(5),
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(30),
        }
    }
}

/// The handlers' side of the channel.
#[derive(Debug, Clone)]
pub struct EmitterHandle {
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<Metrics>,
}

impl EmitterHandle {
    /// Queues an event without waiting; when the queue is full (or the emitter stopped) the event
    /// is dropped, counted (`events_dropped_total{reason="queue_full"}`) and logged.
    pub fn submit(&self, o: Outgoing) -> bool {
        match self.tx.try_send(o) {
            Ok(()) => true,
            Err(e) => {
                let n = self.metrics.dropped.get_or_create(&vec![("reason", "queue_full".to_string())]).inc() + 1;
                if n == 1 || n.is_power_of_two() {
                    tracing::warn!(dropped = n, error = %e, "proxy event queue full or closed: event dropped");
                }
                false
            }
        }
    }
}

/// A running emitter: its handle for submitting events, and a way to stop it.
#[derive(Debug)]
pub struct Emitter {
    handle: EmitterHandle,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Emitter {
    /// Starts the emitter task on the current tokio runtime. `topics` (table names) are created
    /// before the first send (retried while Kafka is down).
    pub fn start(producer: BusProducer, bus: crate::bus::Bus, topics: Vec<&'static str>, spool: Spool, metrics: Arc<Metrics>, cfg: EmitterConfig) -> Emitter {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let (stop, stop_rx) = watch::channel(false);
        metrics.spool_bytes.set(spool.bytes() as i64);
        metrics.spool_events.set(spool.events() as i64);
        let task = tokio::spawn(
            Worker { producer, bus, topics, topics_ready: false, spool, metrics: metrics.clone(), cfg, drops_logged: 0 }.run(rx, stop_rx),
        );
        Emitter { handle: EmitterHandle { tx, metrics }, stop, task }
    }

    /// A handle for submitting events.
    pub fn handle(&self) -> EmitterHandle {
        self.handle.clone()
    }

    /// Stops accepting events, delivers or spools everything queued, and waits for the task.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        drop(self.handle);
        let _ = self.task.await;
    }
}

struct Worker {
    producer: BusProducer,
    bus: crate::bus::Bus,
    topics: Vec<&'static str>,
    topics_ready: bool,
    spool: Spool,
    metrics: Arc<Metrics>,
    cfg: EmitterConfig,
    drops_logged: u64,
}

type SendFut = std::pin::Pin<Box<dyn std::future::Future<Output = (Outgoing, Result<()>)> + Send>>;

fn send_one(producer: BusProducer, o: Outgoing, timeout: Duration, metrics: Arc<Metrics>) -> SendFut {
    Box::pin(async move {
        // librdkafka fails the delivery after `timeout`; the outer bound also covers the embedded
        // bus's flow-control wait.
        let r = match tokio::time::timeout(timeout * 2 + Duration::from_secs(1), producer.send_raw(&o.topic, &o.key, o.payload.get().as_bytes())).await {
            Ok(Ok(_)) => Ok(()),
            // Too large for the bus: retrying (or spooling) can never succeed, so the turn becomes a
            // dead letter; a refused dead letter is not retried either.
            Ok(Err(e @ Error::RecordTooLarge { .. })) => too_large(&producer, &o, &e, &metrics).await,
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Timeout((timeout * 2).as_secs_f64() + 1.0)),
        };
        (o, r)
    })
}

/// Sends the dead letter of an event the bus refused for its size (stage `proxy`, reason
/// `record_too_large`, keyed by the event's interaction id, with the event's first bytes).
async fn too_large(producer: &BusProducer, o: &Outgoing, e: &Error, metrics: &Metrics) -> Result<()> {
    use crate::schema::DeadLetter;
    if o.topic == producer.topic_of::<DeadLetter>() {
        metrics.drop_event("too_large");
        tracing::error!(error = %e, "proxy: dead letter too large for the bus: dropped (counted in events_dropped_total{{reason=\"too_large\"}})");
        return Ok(());
    }
    let payload = o.payload.get().as_bytes();
    let head = &payload[..payload.len().min(crate::bus::TOO_LARGE_PAYLOAD_BYTES)];
    let key = serde_json::from_str::<serde_json::Value>(o.payload.get()).ok().and_then(|v| v["row"]["interaction_id"].as_str().map(str::to_string));
    tracing::warn!(error = %e, "proxy: event too large for the bus: dead-lettered");
    let d = DeadLetter::new("proxy", crate::bus::TOO_LARGE, format!("{e} (payload: first {} bytes)", head.len()), head, crate::schema::Lineage::default())
        .with_keys(&o.key, key.as_deref());
    producer.send(&d, None).await.map(|_| ())
}

impl Worker {
    fn gauges(&self) {
        self.metrics.spool_bytes.set(self.spool.bytes() as i64);
        self.metrics.spool_events.set(self.spool.events() as i64);
    }

    async fn spool_event(&mut self, o: Outgoing) {
        match self.spool.append(&o).await {
            Ok(true) => {
                self.metrics.spooled.inc();
            }
            Ok(false) => {
                self.metrics.drop_event("spool_full");
                self.drops_logged += 1;
                if self.drops_logged == 1 || self.drops_logged.is_power_of_two() {
                    tracing::warn!(
                        dropped = self.drops_logged,
                        spool_bytes = self.spool.bytes(),
                        max_bytes = self.spool.cfg.max_bytes,
                        "proxy spool full: event dropped (Kafka unavailable for too long; raise --spool-max-bytes)"
                    );
                }
            }
            Err(e) => {
                self.metrics.drop_event("spool_error");
                tracing::error!(error = %e, "proxy spool write failed: event dropped");
            }
        }
        self.gauges();
    }

    async fn ensure_topics(&mut self) -> bool {
        if self.topics_ready {
            return true;
        }
        match tokio::time::timeout(self.cfg.send_timeout, self.bus.ensure_topics(&self.topics)).await {
            Ok(Ok(())) => self.topics_ready = true,
            Ok(Err(e)) => {
                // The cluster answered (e.g. no permission to create topics, which may exist already):
                // let the sends decide.
                tracing::warn!(error = %e, "proxy: cannot create topics; sending anyway");
                self.topics_ready = true;
            }
            Err(_) => tracing::debug!("proxy: creating topics timed out (Kafka unreachable?)"),
        }
        self.topics_ready
    }

    /// Replays the oldest spool segment. Ok(true) when the whole spool is now empty.
    async fn replay_segment(&mut self) -> Result<bool> {
        if !self.ensure_topics().await {
            return Err(Error::Timeout(self.cfg.send_timeout.as_secs_f64()));
        }
        let Some((seq, events, corrupt)) = self.spool.oldest().await? else { return Ok(true) };
        for _ in 0..corrupt {
            self.metrics.drop_event("spool_corrupt");
        }
        if corrupt > 0 {
            tracing::warn!(corrupt, segment = seq, "proxy spool: unreadable lines dropped");
        }
        let n = events.len() as u64;
        let mut sends = futures::stream::iter(events.into_iter().map(|o| send_one(self.producer.clone(), o, self.cfg.send_timeout, self.metrics.clone())))
            .buffered(self.cfg.max_in_flight.max(1));
        let mut first_err = None;
        while let Some((_, r)) = sends.next().await {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.spool.remove(seq).await?;
        self.metrics.replayed.inc_by(n);
        self.metrics.emitted.inc_by(n);
        self.gauges();
        tracing::info!(events = n, segment = seq, left = self.spool.events(), "proxy spool: segment replayed to Kafka");
        Ok(self.spool.is_empty())
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Outgoing>, mut stop: watch::Receiver<bool>) {
        let mut inflight: FuturesUnordered<SendFut> = FuturesUnordered::new();
        // Spooled events from a previous run go first.
        let mut degraded = !self.spool.is_empty() || !self.ensure_topics().await;
        // Delays between spool replays while Kafka is down: retry_min, doubling up to retry_max (backon).
        let (min, max) = (self.cfg.retry_min, self.cfg.retry_max);
        let schedule = move || backon::BackoffBuilder::build(backon::ExponentialBuilder::default().with_min_delay(min).with_max_delay(max).with_factor(2.0).without_max_times());
        let mut delays = schedule();
        let mut backoff = delays.next().unwrap_or(max);
        let retry = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(retry);
        let mut stopping = false;
        self.metrics.kafka_up.set(if degraded { 0 } else { 1 });
        loop {
            tokio::select! {
                biased;
                Some((o, r)) = inflight.next(), if !inflight.is_empty() => match r {
                    Ok(()) => { self.metrics.emitted.inc(); }
                    Err(e) => {
                        if !degraded {
                            tracing::warn!(error = %e, "proxy: Kafka send failed; spooling events until it is back");
                            degraded = true;
                            self.metrics.kafka_up.set(0);
                            retry.as_mut().reset(tokio::time::Instant::now() + backoff);
                        }
                        self.spool_event(o).await;
                    }
                },
                msg = rx.recv(), if inflight.len() < self.cfg.max_in_flight => match msg {
                    None => break,
                    Some(o) if degraded => self.spool_event(o).await,
                    Some(o) => inflight.push(send_one(self.producer.clone(), o, self.cfg.send_timeout, self.metrics.clone())),
                },
                _ = &mut retry, if degraded && inflight.is_empty() && !stopping => {
                    match self.replay_segment().await {
                        Ok(true) => {
                            degraded = false;
                            delays = schedule();
                            backoff = delays.next().unwrap_or(max);
                            self.metrics.kafka_up.set(1);
                            tracing::info!("proxy: Kafka is back; spool empty");
                        }
                        Ok(false) => retry.as_mut().reset(tokio::time::Instant::now()),
                        Err(e) => {
                            tracing::debug!(error = %e, backoff_ms = backoff.as_millis() as u64, "proxy: spool replay failed; retrying later");
                            retry.as_mut().reset(tokio::time::Instant::now() + backoff);
                            backoff = delays.next().unwrap_or(max);
                        }
                    }
                },
                r = stop.changed(), if !stopping => {
                    // Stop accepting; what is queued is still received, then recv() returns None.
                    let _ = r;
                    stopping = true;
                    rx.close();
                },
            }
        }
        // Channel drained: wait for the sends in flight; failures go to the spool.
        while let Some((o, r)) = inflight.next().await {
            match r {
                Ok(()) => {
                    self.metrics.emitted.inc();
                }
                Err(_) => self.spool_event(o).await,
            }
        }
        if let Err(e) = self.spool.seal().await {
            tracing::warn!(error = %e, "proxy spool: flush at shutdown failed");
        }
        if let Err(e) = self.producer.flush() {
            tracing::debug!(error = %e, "proxy: producer flush at shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(i: usize) -> Outgoing {
        Outgoing { topic: "t".into(), key: format!("k{i}"), payload: serde_json::value::to_raw_value(&serde_json::json!({"row": {"i": i}})).unwrap() }
    }

    #[tokio::test]
    async fn spool_appends_rotates_bounds_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let line_len = serde_json::to_vec(&ev(0)).unwrap().len() as u64 + 1;
        // Room for exactly 5 lines, segments of 2 lines.
        let cfg = SpoolConfig { dir: dir.path().to_path_buf(), max_bytes: 5 * line_len, segment_bytes: 2 * line_len };
        let mut s = Spool::open(cfg.clone()).await.unwrap();
        for i in 0..5 {
            assert!(s.append(&ev(i)).await.unwrap(), "event {i}");
        }
        assert!(!s.append(&ev(5)).await.unwrap(), "spool full");
        assert_eq!((s.events(), s.bytes()), (5, 5 * line_len));
        assert_eq!(s.segments.len(), 3, "2 + 2 + 1 lines");
        let (seq, events, corrupt) = s.oldest().await.unwrap().unwrap();
        assert_eq!((seq, events, corrupt), (0, vec![ev(0), ev(1)], 0));
        s.remove(seq).await.unwrap();
        assert_eq!(s.events(), 3);
        drop(s);
        // A new process finds what is left, in order, and appends after it.
        let mut s = Spool::open(cfg).await.unwrap();
        assert_eq!((s.events(), s.bytes()), (3, 3 * line_len));
        assert!(s.append(&ev(6)).await.unwrap());
        let mut seen = vec![];
        while let Some((seq, events, _)) = s.oldest().await.unwrap() {
            seen.extend(events.into_iter().map(|e| e.key));
            s.remove(seq).await.unwrap();
        }
        assert_eq!(seen, ["k2", "k3", "k4", "k6"]);
        assert!(s.is_empty() && s.bytes() == 0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn corrupt_lines_are_counted_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let good = serde_json::to_string(&ev(1)).unwrap();
        std::fs::write(dir.path().join(segment_name(3)), format!("{good}\n{{truncated\n")).unwrap();
        std::fs::write(dir.path().join("unrelated.txt"), "x").unwrap();
        let mut s = Spool::open(SpoolConfig::new(dir.path(), 1 << 20)).await.unwrap();
        assert_eq!(s.events(), 2);
        let (seq, events, corrupt) = s.oldest().await.unwrap().unwrap();
        assert_eq!((seq, events.len(), corrupt), (3, 1, 1));
        assert!(s.append(&ev(2)).await.unwrap());
        assert!(dir.path().join(segment_name(4)).exists(), "new segments continue the numbering");
    }
}
