//! The Kafka bus: topics per table, records keyed by session id, consumer groups, dead-letter routing.
//!
//! Built on `rdkafka` with tokio. With `--brokers HOST:PORT` it talks to a real cluster (or any
//! Kafka-protocol broker: noida-db in tests). Without, it starts librdkafka's built-in mock cluster
//! in-process for the life of the command (the **embedded default**); then the lake is the durable record
//! between commands (see [`crate::stages`]).
//!
//! Records are JSON envelopes `{"row": <table row>, "carry": {...}}`: `row` is what the table stores,
//! `carry` the upstream context a later stage needs (the interaction, its signal, judgment, hint), so a
//! stage never has to look rows up. The lake sink stores `row` only.

pub mod flow;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::schema::{HintRecord, Interaction, Judgment, Signal, Table};

/// Bus settings (the `[bus]` table of a pipeline file, overridable by flags).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// Bootstrap servers of a real cluster (`HOST:PORT,...`); `None` = embedded mock cluster.
    pub brokers: Option<String>,
    /// Prefix of every topic name (namespaces: e.g. `replay-1.`).
    pub topic_prefix: String,
    /// Partitions of topics the bus creates.
    pub partitions: i32,
    /// Replication factor of topics the bus creates.
    pub replication: i32,
    /// Consumer `session.timeout.ms` (Kafka's minimum is 6000).
    pub session_timeout_ms: u32,
    /// Producer message size limit in bytes (`message.max.bytes`).
    pub max_message_bytes: u32,
    /// Largest fetch response a consumer accepts, bytes (librdkafka `receive.message.max.bytes`, at most
    /// 2,147,483,647). A Kafka broker bounds its fetch responses by `fetch.max.bytes` (50 MB), so with a
    /// real cluster this limit is never reached. noida-db 0.2.3 ignores the fetch size limits and answers
    /// with the partition's whole backlog from the fetch offset: a consumer whose backlog exceeds this
    /// limit gets `Invalid response size` (`BadMessage`) and reconnects forever without reading a
    /// record. Default 1 GiB, so the embedded defaults and the benchmarks' backlogs fit.
    pub receive_max_bytes: u32,
    /// Consumer `max.poll.interval.ms`: a member that does not poll for this long leaves its group;
    /// it is also the time a broker may wait for a dead member during a rebalance. The embedded
    /// cluster (one process) uses 24 h.
    pub max_poll_interval_ms: u32,
    /// Static group membership (Kafka KIP-345): a stable name of this process, unique among the
    /// processes that share its consumer groups (e.g. `sinks-0`). Each consumer then joins as
    /// `group.instance.id = <this>.<group>`, so a process restarted after a crash takes over its old
    /// member and partitions at once instead of waiting for the broker to expire the dead member
    /// (`session_timeout_ms` on Kafka; some Kafka-protocol brokers, such as noida-db 0.2.3, never
    /// expire a killed member, and its group then never rebalances). None (default): dynamic
    /// membership. Ignored by the embedded cluster.
    pub group_instance_id: Option<String>,
    /// Any librdkafka setting, passed to every client of a real cluster (`[bus.properties]`), e.g.
    /// `"security.protocol" = "SASL_SSL"`, `"sasl.mechanisms" = "SCRAM-SHA-512"`, `"sasl.username"`,
    /// `"ssl.ca.location" = "/etc/kafka/ca.pem"`. librdkafka is built with OpenSSL, so `SSL` and
    /// `SASL_SSL` with `PLAIN`, `SCRAM-SHA-256` and `SCRAM-SHA-512` work (GSSAPI/Kerberos does not: no
    /// cyrus-sasl). The settings nextstate makes itself for correctness (idempotence, acks, offsets
    /// committed by hand, group ids, size limits; see [`Bus::producer`] and [`Bus::consumer`]) take
    /// precedence; `bootstrap.servers` is refused (use `brokers`). Ignored by the embedded cluster.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
    /// librdkafka settings whose values come from environment variables (`[bus.secret_env]`, setting
    /// → variable name), e.g. `"sasl.password" = "KAFKA_PASSWORD"`: secrets stay out of the file, and
    /// neither the values nor the configuration holding them are ever printed. A variable that is not
    /// set is a configuration error naming the variable.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub secret_env: BTreeMap<String, String>,
}

/// librdkafka settings `[bus.properties]` may not set, with the key to use instead.
const RESERVED_PROPERTIES: &[(&str, &str)] = &[
    ("bootstrap.servers", "bus.brokers (or --brokers)"),
    ("metadata.broker.list", "bus.brokers (or --brokers)"),
    ("group.id", "the stage's own group (bus.topic_prefix namespaces them)"),
    ("group.instance.id", "bus.group_instance_id"),
    ("transactional.id", "nothing: nextstate's producers are idempotent, not transactional"),
];

/// Whether a librdkafka setting holds a secret, which belongs in `[bus.secret_env]` (a file and the
/// command line are read by others, and the configuration is printed in errors and logs).
fn is_secret_setting(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password") || k.contains("secret") || k == "ssl.key.pem" || k.ends_with("jaas.config") || k == "sasl.oauthbearer.config"
}

impl BusConfig {
    /// Checks `properties` and `secret_env` (reserved keys; secret variables set and non-empty).
    ///
    /// # Errors
    /// [`Error::Config`] naming the key or the environment variable (never a secret's value).
    pub fn validate(&self) -> Result<()> {
        for k in self.properties.keys().chain(self.secret_env.keys()) {
            if let Some((_, instead)) = RESERVED_PROPERTIES.iter().find(|(r, _)| r == k) {
                return Err(Error::Config(format!("bus.properties: {k:?} is set by nextstate; use {instead}")));
            }
        }
        if let Some(k) = self.properties.keys().find(|k| self.secret_env.contains_key(*k)) {
            return Err(Error::Config(format!("bus: {k:?} is in both [bus.properties] and [bus.secret_env]")));
        }
        if let Some(k) = self.properties.keys().find(|k| is_secret_setting(k)) {
            return Err(Error::Config(format!(
                "bus.properties: {k:?} holds a secret; name an environment variable for it in [bus.secret_env] (or --kafka-secret-env {k}=VARIABLE)"
            )));
        }
        if self.brokers.is_some() {
            self.secrets()?;
        }
        Ok(())
    }

    /// The `secret_env` settings with their values read from the environment.
    fn secrets(&self) -> Result<Vec<(&str, String)>> {
        self.secret_env
            .iter()
            .map(|(k, var)| match std::env::var(var) {
                Ok(v) if !v.is_empty() => Ok((k.as_str(), v)),
                _ => Err(Error::Config(format!("bus.secret_env: environment variable {var} (for {k:?}) is not set or empty"))),
            })
            .collect()
    }

    /// `e` with the value of a `secret_env` setting taken out: librdkafka's refusal of a setting
    /// (`KafkaError::ClientConfig`) names the key and quotes the value, in its description too.
    pub fn redact(&self, e: KafkaError) -> Error {
        match e {
            KafkaError::ClientConfig(_, _, key, _) if self.secret_env.contains_key(&key) => Error::Config(format!(
                "librdkafka refused the setting {key:?} (its value, from ${}, is not shown)",
                self.secret_env[&key]
            )),
            e => Error::Kafka(e),
        }
    }

    /// The client configuration of a real cluster at `bootstrap`: `bootstrap.servers`, then
    /// `properties`, then the `secret_env` values. Callers add their own settings after, which win.
    ///
    /// # Errors
    /// As [`BusConfig::validate`].
    pub fn client_config(&self, bootstrap: &str) -> Result<ClientConfig> {
        self.validate()?;
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", bootstrap);
        if self.brokers.is_some() {
            for (k, v) in &self.properties {
                c.set(k, v);
            }
            for (k, v) in self.secrets()? {
                c.set(k, v);
            }
        }
        Ok(c)
    }
}

impl Default for BusConfig {
    fn default() -> Self {
        BusConfig {
            brokers: None,
            topic_prefix: String::new(),
            partitions: 4,
            replication: 1,
            session_timeout_ms: 6000,
            max_message_bytes: 64 << 20,
            receive_max_bytes: 1 << 30,
            max_poll_interval_ms: 300_000,
            group_instance_id: None,
            properties: BTreeMap::new(),
            secret_env: BTreeMap::new(),
        }
    }
}

/// The upstream context a stage forwards with its row (see module docs).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Carry {
    /// The turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interaction: Option<Interaction>,
    /// Its signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<Signal>,
    /// Its judgment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judgment: Option<Judgment>,
    /// Its hint record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<HintRecord>,
}

/// Reason code of a record the bus refused for its size (the dead letter that stands in for it).
pub const TOO_LARGE: &str = "record_too_large";

/// Payload kept in the dead letter of a record too large for the bus, bytes (well under any limit,
/// even after JSON escaping).
pub const TOO_LARGE_PAYLOAD_BYTES: usize = 256 << 10;

/// A record on the bus.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// The table row.
    pub row: T,
    /// Upstream context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carry: Option<Carry>,
}

/// A connection to a Kafka cluster (real or embedded).
#[derive(Clone)]
pub struct Bus {
    cfg: BusConfig,
    bootstrap: String,
    source_id: String,
    mock: Option<Arc<MockHandle>>,
    flow: Option<Arc<flow::Flow>>,
}

struct MockHandle(#[allow(dead_code)] MockCluster<'static, DefaultProducerContext>);
// SAFETY: the mock cluster handle is only used to keep the cluster alive and is dropped once; librdkafka's
// mock cluster runs on its own thread and its handle may be released from any thread.
unsafe impl Send for MockHandle {}
unsafe impl Sync for MockHandle {}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus").field("bootstrap", &self.bootstrap).field("source_id", &self.source_id).finish()
    }
}

impl Bus {
    /// Connects to `cfg.brokers`, or starts the embedded mock cluster when it is `None`.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the mock cluster cannot start or the cluster's metadata cannot be fetched
    /// within 10 s.
    pub async fn connect(cfg: BusConfig) -> Result<Bus> {
        match cfg.brokers.clone() {
            None => Bus::embedded(cfg),
            Some(brokers) => {
                let mut client = cfg.client_config(&brokers)?;
                // Warnings at least, whatever the log crate's level, so the context sees why a connect fails.
                client.set_log_level(rdkafka::config::RDKafkaLogLevel::Warning);
                let (b, redact) = (brokers.clone(), cfg.clone());
                let cluster_id = tokio::task::spawn_blocking(move || -> Result<Option<String>> {
                    // A plain client whose poll() hands librdkafka's log and error events to the context.
                    let probe: rdkafka::producer::BaseProducer<ConnectContext> = client.create_with_context(ConnectContext::default()).map_err(|e| redact.redact(e))?;
                    if let Err(e) = probe.client().fetch_metadata(None, Duration::from_secs(10)) {
                        // librdkafka's own account of why (a TLS certificate, SASL authentication,
                        // a refused connection) is in its log, not in the error code: name it.
                        probe.poll(Duration::from_millis(100));
                        let why = probe.context().last_problem().map(|p| format!("; librdkafka: {p}")).unwrap_or_default();
                        return Err(Error::Unreachable(format!("the Kafka cluster at {b}: {e}{why}")));
                    }
                    Ok(probe.client().fetch_cluster_id(Duration::from_secs(5)))
                })
                .await
                .map_err(|e| Error::Internal(e.to_string()))??;
                let source_id = match cluster_id {
                    Some(id) if !id.is_empty() => id,
                    _ => crate::schema::content_hash(&[brokers.as_bytes()]),
                };
                Ok(Bus::remote(cfg, brokers, source_id))
            }
        }
    }

    /// Like [`Bus::connect`] but never contacts a real cluster: for a process that must start while
    /// the cluster may be down (the capture proxy). The source id is then a hash of the bootstrap
    /// string, not the cluster id. Starts the embedded mock cluster when `cfg.brokers` is `None`.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the mock cluster cannot start.
    pub fn connect_lazy(cfg: BusConfig) -> Result<Bus> {
        match cfg.brokers.clone() {
            None => Bus::embedded(cfg),
            Some(brokers) => {
                let source_id = crate::schema::content_hash(&[brokers.as_bytes()]);
                Ok(Bus::remote(cfg, brokers, source_id))
            }
        }
    }

    /// A new embedded mock cluster (one broker, flow control on) under a fresh `mock-<uuid>` source id.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the mock cluster cannot start.
    fn embedded(cfg: BusConfig) -> Result<Bus> {
        let mock = MockCluster::new(1)?;
        let bootstrap = mock.bootstrap_servers();
        let source_id = format!("mock-{}", uuid::Uuid::new_v4().simple());
        Ok(Bus { cfg, bootstrap, source_id, mock: Some(Arc::new(MockHandle(mock))), flow: Some(Arc::new(flow::Flow::default())) })
    }

    /// A bus on the real cluster at `brokers`, known as `source_id`.
    fn remote(cfg: BusConfig, brokers: String, source_id: String) -> Bus {
        Bus { cfg, bootstrap: brokers, source_id, mock: None, flow: None }
    }

    /// True when running on the embedded mock cluster.
    pub fn is_embedded(&self) -> bool {
        self.mock.is_some()
    }

    /// The embedded bus's flow control (None on a real cluster).
    pub fn flow(&self) -> Option<&Arc<flow::Flow>> {
        self.flow.as_ref()
    }

    /// Declares that consumer group `group` will read table `table`'s topic, before anything is produced
    /// to it, so that the embedded bus's flow control waits for it (no-op on a real cluster).
    pub fn expect_consumer(&self, group: &str, table: &str) {
        if let Some(f) = &self.flow {
            f.register(group, &self.topic(table));
        }
    }

    /// The consumer group name for `name` (prefixed like the topics, so namespaces never share groups).
    pub fn group(&self, name: &str) -> String {
        format!("{}{}", self.cfg.topic_prefix, name)
    }

    /// The bootstrap servers string.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Cluster identity used to name lake files (cluster id; `mock-<uuid>` for the embedded cluster).
    pub fn source_id(&self) -> &str {
        &self.source_id
    }

    /// The configuration.
    pub fn config(&self) -> &BusConfig {
        &self.cfg
    }

    /// Topic name of table `table` (with the configured prefix).
    pub fn topic(&self, table: &str) -> String {
        format!("{}{}", self.cfg.topic_prefix, table)
    }

    /// Creates the topics of `tables` (prefixed) with the configured partitions; existing topics are kept.
    ///
    /// # Errors
    /// [`Error::Kafka`] when creation fails for another reason than "already exists".
    pub async fn ensure_topics(&self, tables: &[&str]) -> Result<()> {
        if let Some(m) = &self.mock {
            // librdkafka's mock cluster does not answer CreateTopics; it has its own call.
            for t in tables {
                match m.0.create_topic(&self.topic(t), self.cfg.partitions, 1) {
                    Ok(()) | Err(KafkaError::MockCluster(RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(());
        }
        let admin: AdminClient<DefaultClientContext> = self.base_config()?.create().map_err(|e| self.cfg.redact(e))?;
        let names: Vec<String> = tables.iter().map(|t| self.topic(t)).collect();
        let new: Vec<NewTopic> = names
            .iter()
            .map(|n| NewTopic::new(n, self.cfg.partitions, TopicReplication::Fixed(self.cfg.replication)))
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.create_topics(new.iter(), &opts).await? {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, e)) => return Err(Error::Kafka(KafkaError::AdminOp(e)).context_topic(&t)),
            }
        }
        Ok(())
    }

    fn base_config(&self) -> Result<ClientConfig> {
        let mut c = self.cfg.client_config(&self.bootstrap)?;
        // librdkafka debug contexts (e.g. "consumer,cgrp,fetch") for diagnosing a cluster.
        if let Ok(d) = std::env::var("NEXTSTATE_KAFKA_DEBUG") {
            c.set("debug", d);
            c.set_log_level(rdkafka::config::RDKafkaLogLevel::Debug);
        }
        Ok(c)
    }

    /// A producer (idempotent, acks=all, lz4-free: no compression so any broker accepts it).
    ///
    /// # Errors
    /// [`Error::Kafka`] on an invalid configuration.
    pub fn producer(&self) -> Result<BusProducer> {
        self.producer_with_timeout(Duration::from_secs(300), Duration::from_secs(300))
    }

    /// Like [`Bus::producer`], but a delivery fails after `message_timeout` (librdkafka's
    /// `message.timeout.ms`, at least 1 ms) instead of 300 s, and a send waits at most `queue_timeout`
    /// for room in librdkafka's local queue: for callers that must not wait on an unavailable
    /// cluster (the capture proxy spools instead).
    ///
    /// # Errors
    /// [`Error::Kafka`] on an invalid configuration.
    pub fn producer_with_timeout(&self, message_timeout: Duration, queue_timeout: Duration) -> Result<BusProducer> {
        let p: FutureProducer = self
            .base_config()?
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("message.timeout.ms", message_timeout.as_millis().max(1).to_string())
            .set("message.max.bytes", self.cfg.max_message_bytes.to_string())
            .create()
            .map_err(|e| self.cfg.redact(e))?;
        Ok(BusProducer { inner: p, bus: self.clone(), queue_timeout })
    }

    /// A consumer in group `group` subscribed to `topics` (full names), reading from the earliest offset
    /// when the group has none, committing only explicitly. Rebalances set the returned
    /// [`RebalanceFlag`] so the caller can reload per-partition state.
    ///
    /// # Errors
    /// [`Error::Kafka`] on an invalid configuration or subscription failure.
    pub fn consumer(&self, group: &str, topics: &[String]) -> Result<(StreamConsumer<BusContext>, RebalanceFlag)> {
        self.consumer_with_max_poll(group, topics, self.cfg.max_poll_interval_ms)
    }

    /// [`Bus::consumer`] whose `max.poll.interval.ms` is at least `max_poll_ms`: for a consumer whose
    /// caller may not poll for a long time between batches (the trainer during an optimizer step, which
    /// takes minutes on a CPU). Past the interval librdkafka leaves the group; a static member is then
    /// fenced, which is fatal to the consumer.
    ///
    /// # Errors
    /// [`Error::Kafka`] on an invalid configuration or subscription failure.
    pub fn consumer_with_max_poll(&self, group: &str, topics: &[String], max_poll_ms: u32) -> Result<(StreamConsumer<BusContext>, RebalanceFlag)> {
        let max_poll_ms = max_poll_ms.max(self.cfg.max_poll_interval_ms);
        let flag = RebalanceFlag::default();
        let ctx = BusContext { flag: flag.clone() };
        let mut cfg = self.base_config()?;
        if let (Some(id), None) = (&self.cfg.group_instance_id, &self.mock) {
            cfg.set("group.instance.id", format!("{id}.{group}"));
        }
        let c: StreamConsumer<BusContext> = cfg
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", self.cfg.session_timeout_ms.to_string())
            .set("max.poll.interval.ms", if self.mock.is_some() { "86400000".to_string() } else { max_poll_ms.to_string() })
            .set("heartbeat.interval.ms", "1000")
            .set("isolation.level", "read_uncommitted")
            .set("fetch.message.max.bytes", self.cfg.max_message_bytes.to_string())
            .set("max.partition.fetch.bytes", self.cfg.max_message_bytes.to_string())
            .set("receive.message.max.bytes", self.cfg.receive_max_bytes.to_string())
            .set("topic.metadata.refresh.interval.ms", "2000")
            .create_with_context(ctx).map_err(|e| self.cfg.redact(e))?;
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        c.subscribe(&refs)?;
        Ok((c, flag))
    }

    /// Low and high watermark of every partition of `topic` (full name).
    ///
    /// # Errors
    /// [`Error::Kafka`] when metadata or watermarks cannot be fetched.
    pub async fn watermarks(&self, topic: &str) -> Result<HashMap<i32, (i64, i64)>> {
        let cfg = self.base_config()?;
        let redact = self.cfg.clone();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || -> Result<HashMap<i32, (i64, i64)>> {
            let c: rdkafka::consumer::BaseConsumer = cfg.create().map_err(|e| redact.redact(e))?;
            let md = c.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
            let mut out = HashMap::new();
            for t in md.topics() {
                for p in t.partitions() {
                    let w = c.fetch_watermarks(&topic, p.id(), Duration::from_secs(10))?;
                    out.insert(p.id(), w);
                }
            }
            Ok(out)
        })
        .await
        .map_err(|e| Error::Internal(e.to_string()))?
    }
}

trait ContextTopic {
    fn context_topic(self, topic: &str) -> Self;
}
impl ContextTopic for Error {
    fn context_topic(self, topic: &str) -> Self {
        match self {
            Error::Kafka(e) => Error::Internal(format!("topic {topic}: {e}")),
            e => e,
        }
    }
}

/// Set by the consumer context whenever partitions are assigned or revoked; also keeps which partitions
/// were revoked since the caller last asked ([`RebalanceFlag::take_revoked`]).
#[derive(Debug, Clone, Default)]
pub struct RebalanceFlag {
    raised: Arc<std::sync::atomic::AtomicBool>,
    revoked: Arc<std::sync::Mutex<Option<Revoked>>>,
    /// The same, for the consumer loop's own use ([`RebalanceFlag::take_recent_revoked`]).
    recent: Arc<std::sync::Mutex<Option<Revoked>>>,
}

/// Partitions a consumer lost since the caller last asked: the revoked ones of an eager rebalance (every
/// partition it had) or of a cooperative one (only those that move), or all of them after a rebalance
/// error (librdkafka unassigns then).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Revoked {
    /// These partitions (of the consumer's topics; one topic per `runtime::InputLoop`).
    Partitions(std::collections::BTreeSet<i32>),
    /// Every partition the consumer had.
    All,
}

impl RebalanceFlag {
    /// Returns true (once) if a rebalance happened since the last call.
    pub fn take(&self) -> bool {
        self.raised.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Marks a rebalance (the consumer context does on every assign and revoke; a consumer loop does
    /// when it replaced its consumer, `runtime::InputLoop`).
    pub fn raise(&self) {
        self.raised.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The partitions revoked since the last call (None: none).
    pub fn take_revoked(&self) -> Option<Revoked> {
        self.revoked.lock().ok().and_then(|mut g| g.take())
    }

    /// The partitions revoked since the last call of this, kept apart from [`RebalanceFlag::take_revoked`]
    /// (the consumer loop drops the records it holds of them; its caller takes the other).
    pub fn take_recent_revoked(&self) -> Option<Revoked> {
        self.recent.lock().ok().and_then(|mut g| g.take())
    }


    /// Records revoked partitions (`None`: all of them).
    pub(crate) fn revoke(&self, partitions: Option<&[i32]>) {
        for slot in [&self.revoked, &self.recent] {
            if let Ok(mut g) = slot.lock() {
                *g = merge_revoked(g.take(), partitions);
            }
        }
    }
}

/// `before` with `partitions` (None: all) revoked too.
fn merge_revoked(before: Option<Revoked>, partitions: Option<&[i32]>) -> Option<Revoked> {
    match (before, partitions) {
        (Some(Revoked::All), _) | (_, None) => Some(Revoked::All),
        (Some(Revoked::Partitions(mut s)), Some(p)) => {
            s.extend(p);
            Some(Revoked::Partitions(s))
        }
        (None, Some(p)) => Some(Revoked::Partitions(p.iter().copied().collect())),
    }
}

/// Consumer context that records rebalances.
pub struct BusContext {
    flag: RebalanceFlag,
}

impl ClientContext for BusContext {}

/// The context of the first connection to a cluster ([`Bus::connect`]): keeps librdkafka's first
/// distinct warnings and errors (e.g. `SSL handshake failed: ... certificate verify failed`, `SASL
/// authentication error`) so a failed connect can say why, and forwards every message to the log.
#[derive(Default)]
struct ConnectContext {
    seen: std::sync::Mutex<Vec<String>>,
}

impl ConnectContext {
    /// The distinct problems reported, ` | `-separated (None when librdkafka said nothing).
    fn last_problem(&self) -> Option<String> {
        let g = self.seen.lock().ok()?;
        (!g.is_empty()).then(|| g.join(" | "))
    }
    fn remember(&self, what: String) {
        if let Ok(mut g) = self.seen.lock() {
            if g.len() < 2 && !g.contains(&what) {
                g.push(what);
            }
        }
    }
}

impl rdkafka::producer::ProducerContext for ConnectContext {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

impl ClientContext for ConnectContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        if matches!(level, L::Emerg | L::Alert | L::Critical | L::Error | L::Warning) {
            self.remember(format!("{fac}: {log_message}"));
        }
        DefaultClientContext.log(level, fac, log_message);
    }
    fn error(&self, error: KafkaError, reason: &str) {
        self.remember(reason.to_string());
        DefaultClientContext.error(error, reason);
    }
}
impl ConsumerContext for BusContext {
    fn post_rebalance(&self, _c: &rdkafka::consumer::BaseConsumer<Self>, r: &Rebalance<'_>) {
        match r {
            Rebalance::Assign(tpl) => {
                tracing::debug!(partitions = ?tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition(), e.offset())).collect::<Vec<_>>(), "assigned")
            }
            Rebalance::Revoke(tpl) => {
                let partitions: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                tracing::debug!(?partitions, "revoked");
                self.flag.revoke(Some(&partitions));
            }
            Rebalance::Error(e) => {
                tracing::warn!(error = %e, "rebalance error");
                self.flag.revoke(None);
            }
        }
        self.flag.raise();
    }
}

/// A producer of JSON envelopes keyed by [`Table::message_key`] (the session id; a sample's tenant).
#[derive(Clone)]
pub struct BusProducer {
    inner: FutureProducer,
    bus: Bus,
    queue_timeout: Duration,
}

impl BusProducer {
    /// Sends `row` (with optional carry) to the topic of table `T`, keyed by [`Table::message_key`] (its
    /// session id; a sample's tenant); returns the
    /// (partition, offset) once the broker acknowledged it.
    ///
    /// # Errors
    /// [`Error::Json`] when the row cannot be serialised, [`Error::Kafka`] when delivery fails.
    pub async fn send<T: Table>(&self, row: &T, carry: Option<&Carry>) -> Result<(i32, i64)> {
        let env = EnvelopeRef { row, carry };
        let payload = serde_json::to_vec(&env)?;
        self.send_raw(&self.bus.topic(T::NAME), row.message_key(), &payload).await
    }

    /// The topic name of table `T` on this producer's bus.
    pub fn topic_of<T: Table>(&self) -> String {
        self.bus.topic(T::NAME)
    }

    /// Sends raw bytes to `topic` (full name) with `key`.
    ///
    /// # Errors
    /// [`Error::RecordTooLarge`] when the payload is over the embedded bus's record limit
    /// ([`flow::EMBEDDED_MAX_RECORD_BYTES`]) or the producer or broker refuses its size;
    /// [`Error::Kafka`] when delivery fails otherwise.
    pub async fn send_raw(&self, topic: &str, key: &str, payload: &[u8]) -> Result<(i32, i64)> {
        let bytes = payload.len() as u64;
        let too_large = |limit: u64| Error::RecordTooLarge { topic: topic.to_string(), bytes, limit };
        if self.bus.flow.is_some() && bytes > flow::EMBEDDED_MAX_RECORD_BYTES {
            return Err(too_large(flow::EMBEDDED_MAX_RECORD_BYTES));
        }
        if let Some(f) = &self.bus.flow {
            f.wait_room(topic, bytes).await;
            f.sending(topic, bytes);
        }
        let rec = FutureRecord::to(topic).key(key).payload(payload);
        let r = self.inner.send(rec, self.queue_timeout).await.map_err(|(e, _)| match e.rdkafka_error_code() {
            // Refused by the producer's `message.max.bytes` or by the broker's limit.
            Some(RDKafkaErrorCode::MessageSizeTooLarge) => too_large(self.bus.cfg.max_message_bytes as u64),
            _ => Error::Kafka(e),
        });
        if let Some(f) = &self.bus.flow {
            f.sent(topic, bytes, r.as_ref().ok().map(|d| (d.partition, d.offset)));
        }
        let d = r?;
        if topic == self.bus.topic(crate::schema::DeadLetter::NAME) {
            count_dead_letter(payload);
        }
        Ok((d.partition, d.offset))
    }

    /// Waits until every queued message is delivered.
    ///
    /// # Errors
    /// [`Error::Kafka`] on timeout (60 s).
    pub fn flush(&self) -> Result<()> {
        self.inner.flush(Duration::from_secs(60))?;
        Ok(())
    }
}

#[derive(Serialize)]
struct EnvelopeRef<'a, T> {
    row: &'a T,
    #[serde(skip_serializing_if = "Option::is_none")]
    carry: Option<&'a Carry>,
}

/// Counts an acknowledged dead letter (`dead_letters_total{stage, reason}`) from its envelope: every
/// dead letter of every process (stages, sinks, ingest, trainer, proxy) goes through
/// [`BusProducer::send_raw`], so this is the one place to count.
fn count_dead_letter(envelope: &[u8]) {
    #[derive(serde::Deserialize)]
    struct Row {
        stage: String,
        reason_code: String,
    }
    #[derive(serde::Deserialize)]
    struct Env {
        row: Row,
    }
    if let Ok(e) = serde_json::from_slice::<Env>(envelope) {
        crate::metrics::dead_letter(&e.row.stage, &e.row.reason_code);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revoked_partitions_accumulate_until_taken_and_an_error_revokes_all() {
        let f = RebalanceFlag::default();
        assert_eq!(f.take_revoked(), None);
        f.revoke(Some(&[2, 0]));
        f.revoke(Some(&[1, 2]));
        assert_eq!(f.take_revoked(), Some(Revoked::Partitions([0, 1, 2].into_iter().collect())));
        assert_eq!(f.take_revoked(), None, "taken once");
        f.revoke(Some(&[3]));
        f.revoke(None);
        f.revoke(Some(&[1]));
        assert_eq!(f.take_revoked(), Some(Revoked::All), "all stays all");
    }

    #[test]
    fn properties_pass_through_to_a_real_cluster_only_and_reserved_keys_are_refused() {
        let mut c = BusConfig { brokers: Some("k:9093".into()), ..BusConfig::default() };
        c.properties.insert("security.protocol".into(), "SSL".into());
        let cc = c.client_config("k:9093").unwrap();
        assert_eq!((cc.get("bootstrap.servers"), cc.get("security.protocol")), (Some("k:9093"), Some("SSL")));
        // The embedded cluster speaks plaintext: the properties are for the real one.
        c.brokers = None;
        assert_eq!(c.client_config("mock:1").unwrap().get("security.protocol"), None);
        c.properties.insert("bootstrap.servers".into(), "other:1".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("bootstrap.servers") && e.contains("bus.brokers"), "{e}");
    }

    #[test]
    fn secrets_stay_out_of_properties_and_out_of_librdkafka_refusals() {
        let mut c = BusConfig { brokers: Some("k:9093".into()), ..BusConfig::default() };
        c.properties.insert("sasl.password".into(), "hunter2".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("secret_env") && !e.contains("hunter2"), "{e}");
        c.properties.clear();
        // A misspelt secret setting: librdkafka's refusal quotes the value; ours does not.
        let var = format!("NEXTSTATE_TEST_SECRET_{}", std::process::id());
        std::env::set_var(&var, "hunter2");
        c.secret_env.insert("sasl.pasword".into(), var.clone());
        let refused: std::result::Result<rdkafka::producer::BaseProducer, _> = c.client_config("k:9093").unwrap().create();
        let raw = refused.err().expect("librdkafka refuses an unknown setting");
        let e = c.redact(raw).to_string();
        assert!(e.contains("sasl.pasword") && e.contains(&var) && !e.contains("hunter2"), "{e}");
        c.secret_env.clear();
        c.properties.insert("group.id".into(), "mine".into());
        assert!(c.validate().unwrap_err().to_string().contains("group.id"));
    }

    #[test]
    fn pipeline_toml_reads_properties_and_secret_env() {
        let c: BusConfig = toml::from_str(
            "brokers = \"k:9093\"\n[properties]\n\"security.protocol\" = \"SASL_SSL\"\n[secret_env]\n\"sasl.password\" = \"KAFKA_PASSWORD\"\n",
        )
        .unwrap();
        assert_eq!(c.properties["security.protocol"], "SASL_SSL");
        assert_eq!(c.secret_env["sasl.password"], "KAFKA_PASSWORD");
    }
}
