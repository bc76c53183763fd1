//! Process-wide Prometheus metrics (`prometheus-client`): one registry, prefix `nextstate`, served at
//! `/metrics` by every long-running process (`nextstate serve`, the capture proxy, and `run`, `train`,
//! `ingest --follow` with `--metrics-addr`). `docs/metrics.md` lists every family with its type,
//! labels and meaning; `tests/bus_lake/metrics.rs` checks that what a process exposes is exactly that list.
//!
//! Every family is registered in every process (a family whose part does not run in the process shows
//! its `# TYPE` line and no series, or 0), so the exposed set does not depend on timing. Label values
//! come from fixed sets only: stage and table names, reason and outcome codes, topic names and
//! partition numbers of the pipeline's own topics; never ids or free text. The one exception, the
//! `tenant` label, is capped: the first [`MAX_TENANT_LABELS`] tenants a process counts get their own
//! value, every later one [`OTHER_TENANTS`] ([`tenant_label`]).

use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::LazyLock;

use prometheus_client::encoding::text::encode as encode_registry;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// Label set: `(name, value)` pairs.
pub type Labels = Vec<(&'static str, String)>;

/// An integer gauge.
pub type IntGauge = Gauge<i64, AtomicI64>;
/// A floating-point gauge.
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// Every process-wide metric. Names below are as exposed (prefix `nextstate_`, counters with `_total`).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Every registered family: `(exposed name, help, OpenMetrics type, unit)`, so that a family with
    /// no series yet (prometheus-client leaves those out) is still declared ([`encode`]).
    declared: Vec<Declared>,
    /// `build_info{version}`: 1, labelled with the crate version.
    pub build_info: Family<Labels, IntGauge>,
    /// `records_in_total{stage, topic}`: records a consumer loop received.
    pub records_in: Family<Labels, Counter>,
    /// `records_out_total{stage, table}`: rows a streaming stage emitted, by output table.
    pub records_out: Family<Labels, Counter>,
    /// `dead_letters_total{stage, reason}`: dead letters acknowledged by the bus, by rejecting stage and
    /// reason code.
    pub dead_letters: Family<Labels, Counter>,
    /// `consumer_lag{stage, topic, partition}`: records between a consumer's position and the
    /// partition's high watermark.
    pub consumer_lag: Family<Labels, IntGauge>,
    /// `consumers_recreated_total{stage, topic}`: consumers replaced in-process after a fatal error
    /// (a fenced static member, [`crate::runtime::InputLoop`]).
    pub consumers_recreated: Family<Labels, Counter>,
    /// `sink_rows_total{table}`: rows written to the lake.
    pub sink_rows: Family<Labels, Counter>,
    /// `sink_files_total{table}`: Parquet files written to the lake.
    pub sink_files: Family<Labels, Counter>,
    /// `sink_bytes_total{table}`: bytes of the Parquet files written.
    pub sink_bytes: Family<Labels, Counter>,
    /// `trainer_steps_total`: optimizer steps taken.
    pub trainer_steps: Counter,
    /// `trainer_loss{term}`: the last step's loss and its terms.
    pub trainer_loss: Family<Labels, FloatGauge>,
    /// `trainer_grad_norm`: the last step's gradient norm (before clipping).
    pub trainer_grad_norm: FloatGauge,
    /// `trainer_tokens_per_second`: response tokens of the last step over its wall time.
    pub trainer_tokens_per_second: FloatGauge,
    /// `trainer_reward_mean`: mean reward r over the last step's trained samples.
    pub trainer_reward_mean: FloatGauge,
    /// `trainer_reward_std`: population standard deviation of r over the last step's trained samples.
    pub trainer_reward_std: FloatGauge,
    /// `trainer_learning_rate`: learning rate of the last step.
    pub trainer_learning_rate: FloatGauge,
    /// `trainer_response_length_mean`: mean response length of the last step's trained samples (tokens).
    pub trainer_response_length_mean: FloatGauge,
    /// `trainer_rollout_logprob_abs_diff`: the last step's mean |rollout − recomputed| log-prob (nats).
    pub trainer_rollout_logprob_abs_diff: FloatGauge,
    /// `trainer_staleness_mean`: mean policy versions behind of the last step's trained samples.
    pub trainer_staleness_mean: FloatGauge,
    /// `trainer_positive_advantage_fraction`: the last step's fraction of masked tokens with advantage > 0.
    pub trainer_positive_advantage_fraction: FloatGauge,
    /// `trainer_negative_advantage_fraction`: the last step's fraction of masked tokens with advantage < 0.
    pub trainer_negative_advantage_fraction: FloatGauge,
    /// `trainer_sample_staleness`: per trained-on sample, the trainer's version minus the policy
    /// version that generated the sample.
    pub trainer_sample_staleness: Histogram,
    /// `trainer_skipped_samples_total{reason}`: samples not trained on (dropped by the packer or by a
    /// skipped step).
    pub trainer_skipped_samples: Family<Labels, Counter>,
    /// `trainer_skipped_steps_total{reason}`: steps that left the weights unchanged.
    pub trainer_skipped_steps: Family<Labels, Counter>,
    /// `trainer_alarms_total{kind}`: steps whose gradient norm or log-prob gap spiked against the
    /// running median (`grad_norm`, `logprob_gap`; `trainer.alarms`).
    pub trainer_alarms: Family<Labels, Counter>,
    /// `trainer_tenant_steps_total{tenant}`: optimizer steps of each adapter (per-tenant training: the
    /// tenant, [`tenant_label`]; shared training: `shared`).
    pub trainer_tenant_steps: Family<Labels, Counter>,
    /// `trainer_tenant_samples_total{tenant}`: samples trained, by adapter.
    pub trainer_tenant_samples: Family<Labels, Counter>,
    /// `trainer_tenant_version{tenant}`: the newest checkpoint version written, by adapter.
    pub trainer_tenant_version: Family<Labels, IntGauge>,
    /// `trainer_tenant_handed_over_total{tenant}`: samples handed over at rebalances (per-tenant
    /// training; read again by their partition's new owner).
    pub trainer_tenant_handed_over: Family<Labels, Counter>,
    /// `server_requests_total{route, status}`: policy server HTTP requests.
    pub server_requests: Family<Labels, Counter>,
    /// `server_request_duration_seconds`: chat completion latency, arrival to the last token.
    pub server_request_duration: Histogram,
    /// `server_time_to_first_token_seconds`: chat completion arrival to its first generated token.
    pub server_time_to_first_token: Histogram,
    /// `server_generated_tokens_total`: tokens generated for chat completions and completions.
    pub server_generated_tokens: Counter,
    /// `server_policy_version`: the weights version the policy server serves.
    pub server_policy_version: IntGauge,
    /// `server_tenant_requests_total{tenant, policy}`: chat completions and completions by tenant
    /// ([`tenant_label`]) and the policy that served them (`adapter`: the tenant's own, `shared`).
    pub server_tenant_requests: Family<Labels, Counter>,
    /// `server_adapter_loads_total{tenant, trigger, outcome}`: loads of tenant adapters.
    pub server_adapter_loads: Family<Labels, Counter>,
    /// `server_adapter_evictions_total{tenant}`: resident tenant adapters dropped (least recently used).
    pub server_adapter_evictions: Family<Labels, Counter>,
    /// `server_adapters_resident`: tenant adapters loaded now.
    pub server_adapters_resident: IntGauge,
    /// `server_adapter_resident_bytes`: bytes of the adapter tensors loaded now.
    pub server_adapter_resident_bytes: IntGauge,
    /// `server_reload_load_seconds`: a shared-policy reload's checkpoint load (files read, adapters
    /// attached, and merged unless `merge_lora` is off), on a blocking thread while serving goes on.
    pub server_reload_load: Histogram,
    /// `server_reload_swap_wait_seconds`: a shared-policy reload's wait from the loaded model's hand-over
    /// to the inference worker until the swap (the worker finishes the batch it is decoding first).
    pub server_reload_swap_wait: Histogram,
    /// `reloads_total{kind, outcome}`: checkpoint reloads per server.
    pub reloads: Family<Labels, Counter>,
    /// `reload_version{kind}`: the newest version a reload confirmed.
    pub reload_version: Family<Labels, IntGauge>,
}

#[derive(Debug)]
struct Declared {
    name: String,
    help: &'static str,
    kind: &'static str,
    unit: Option<&'static str>,
}

/// A registry that remembers what it registered.
struct Registering {
    registry: Registry,
    declared: Vec<Declared>,
}

impl Registering {
    fn add<M: prometheus_client::registry::Metric + prometheus_client::metrics::TypedMetric + Clone>(&mut self, name: &str, help: &'static str, unit: Option<Unit>, metric: &M) {
        let unit_str: Option<&'static str> = match unit {
            Some(Unit::Seconds) => Some("seconds"),
            Some(Unit::Bytes) => Some("bytes"),
            _ => None,
        };
        self.declared.push(Declared {
            name: format!("nextstate_{name}{}", unit_str.map(|u| format!("_{u}")).unwrap_or_default()),
            help,
            kind: match M::TYPE {
                prometheus_client::metrics::MetricType::Counter => "counter",
                prometheus_client::metrics::MetricType::Gauge => "gauge",
                prometheus_client::metrics::MetricType::Histogram => "histogram",
                prometheus_client::metrics::MetricType::Info => "info",
                _ => "unknown",
            },
            unit: unit_str,
        });
        match unit {
            Some(u) => self.registry.register_with_unit(name, help, u, metric.clone()),
            None => self.registry.register(name, help, metric.clone()),
        }
    }
}

/// Latency buckets, seconds: 1 ms … about 65 s, doubling (the policy server's and the capture proxy's).
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

impl Metrics {
    fn new() -> Metrics {
        let mut r = Registering { registry: Registry::with_prefix("nextstate"), declared: vec![] };
        let m = Metrics {
            registry: Registry::default(),
            declared: vec![],
            build_info: Family::default(),
            records_in: Family::default(),
            records_out: Family::default(),
            dead_letters: Family::default(),
            consumer_lag: Family::default(),
            consumers_recreated: Family::default(),
            sink_rows: Family::default(),
            sink_files: Family::default(),
            sink_bytes: Family::default(),
            trainer_steps: Counter::default(),
            trainer_loss: Family::default(),
            trainer_grad_norm: FloatGauge::default(),
            trainer_tokens_per_second: FloatGauge::default(),
            trainer_reward_mean: FloatGauge::default(),
            trainer_reward_std: FloatGauge::default(),
            trainer_learning_rate: FloatGauge::default(),
            trainer_response_length_mean: FloatGauge::default(),
            trainer_rollout_logprob_abs_diff: FloatGauge::default(),
            trainer_staleness_mean: FloatGauge::default(),
            trainer_positive_advantage_fraction: FloatGauge::default(),
            trainer_negative_advantage_fraction: FloatGauge::default(),
            trainer_sample_staleness: Histogram::new([0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
            trainer_skipped_samples: Family::default(),
            trainer_skipped_steps: Family::default(),
            trainer_alarms: Family::default(),
            trainer_tenant_steps: Family::default(),
            trainer_tenant_samples: Family::default(),
            trainer_tenant_version: Family::default(),
            trainer_tenant_handed_over: Family::default(),
            server_requests: Family::default(),
            server_request_duration: Histogram::new(latency_buckets()),
            server_time_to_first_token: Histogram::new(latency_buckets()),
            server_generated_tokens: Counter::default(),
            server_policy_version: IntGauge::default(),
            server_tenant_requests: Family::default(),
            server_adapter_loads: Family::default(),
            server_adapter_evictions: Family::default(),
            server_adapters_resident: IntGauge::default(),
            server_adapter_resident_bytes: IntGauge::default(),
            server_reload_load: Histogram::new(latency_buckets()),
            server_reload_swap_wait: Histogram::new(latency_buckets()),
            reloads: Family::default(),
            reload_version: Family::default(),
        };
        r.add("build_info", "1, labelled with the nextstate version", None, &m.build_info);
        r.add("records_in", "Records a consumer loop received, by stage and topic", None, &m.records_in);
        r.add("records_out", "Rows a streaming stage emitted, by stage and output table", None, &m.records_out);
        r.add("dead_letters", "Dead letters acknowledged by the bus, by stage and reason code", None, &m.dead_letters);
        r.add("consumer_lag", "Records between a consumer's position and the partition's high watermark", None, &m.consumer_lag);
        r.add("consumers_recreated", "Consumers replaced in-process after a fatal error (a fenced static member), by stage and topic", None, &m.consumers_recreated);
        r.add("sink_rows", "Rows written to the lake, by table", None, &m.sink_rows);
        r.add("sink_files", "Parquet files written to the lake, by table", None, &m.sink_files);
        r.add("sink", "Bytes of Parquet files written to the lake, by table", Some(Unit::Bytes), &m.sink_bytes);
        r.add("trainer_steps", "Optimizer steps taken", None, &m.trainer_steps);
        r.add("trainer_loss", "The last step's loss and its terms", None, &m.trainer_loss);
        r.add("trainer_grad_norm", "The last step's gradient norm before clipping", None, &m.trainer_grad_norm);
        r.add("trainer_tokens_per_second", "Response tokens of the last step over its wall time", None, &m.trainer_tokens_per_second);
        r.add("trainer_reward_mean", "Mean reward of the last step's trained samples", None, &m.trainer_reward_mean);
        r.add("trainer_reward_std", "Population std of the reward of the last step's trained samples", None, &m.trainer_reward_std);
        r.add("trainer_learning_rate", "Learning rate of the last step", None, &m.trainer_learning_rate);
        r.add("trainer_response_length_mean", "Mean response length of the last step's trained samples (tokens)", None, &m.trainer_response_length_mean);
        r.add("trainer_rollout_logprob_abs_diff", "The last step's mean |rollout - recomputed| log-prob (nats)", None, &m.trainer_rollout_logprob_abs_diff);
        r.add("trainer_staleness_mean", "Mean policy versions behind of the last step's trained samples", None, &m.trainer_staleness_mean);
        r.add("trainer_positive_advantage_fraction", "The last step's fraction of masked tokens with advantage > 0", None, &m.trainer_positive_advantage_fraction);
        r.add("trainer_negative_advantage_fraction", "The last step's fraction of masked tokens with advantage < 0", None, &m.trainer_negative_advantage_fraction);
        r.add("trainer_sample_staleness", "Per trained-on sample: trainer version minus the sample's policy version", None, &m.trainer_sample_staleness);
        r.add("trainer_skipped_samples", "Samples not trained on, by reason", None, &m.trainer_skipped_samples);
        r.add("trainer_skipped_steps", "Steps that left the weights unchanged, by reason", None, &m.trainer_skipped_steps);
        r.add("trainer_alarms", "Steps whose gradient norm or log-prob gap spiked against the running median, by kind", None, &m.trainer_alarms);
        r.add("trainer_tenant_steps", "Optimizer steps by adapter: the tenant (capped) or shared", None, &m.trainer_tenant_steps);
        r.add("trainer_tenant_samples", "Samples trained by adapter: the tenant (capped) or shared", None, &m.trainer_tenant_samples);
        r.add("trainer_tenant_version", "Newest checkpoint version written by adapter: the tenant (capped) or shared", None, &m.trainer_tenant_version);
        r.add("trainer_tenant_handed_over", "Samples handed over at rebalances by tenant (capped): read again by the partition's new owner", None, &m.trainer_tenant_handed_over);
        r.add("server_requests", "Policy server HTTP requests by route and status", None, &m.server_requests);
        r.add("server_request_duration", "Chat completion latency, arrival to the last token", Some(Unit::Seconds), &m.server_request_duration);
        r.add("server_time_to_first_token", "Chat completion arrival to its first generated token", Some(Unit::Seconds), &m.server_time_to_first_token);
        r.add("server_generated_tokens", "Tokens generated by the policy server", None, &m.server_generated_tokens);
        r.add("server_policy_version", "Weights version the policy server serves", None, &m.server_policy_version);
        r.add("server_tenant_requests", "Policy server inference requests by tenant (capped) and serving policy (adapter or shared)", None, &m.server_tenant_requests);
        r.add("server_adapter_loads", "Tenant adapter loads by tenant (capped), trigger and outcome", None, &m.server_adapter_loads);
        r.add("server_adapter_evictions", "Resident tenant adapters evicted (least recently used), by tenant (capped)", None, &m.server_adapter_evictions);
        r.add("server_adapters_resident", "Tenant adapters loaded in the policy server", None, &m.server_adapters_resident);
        r.add("server_adapter_resident", "Bytes of the tenant adapter tensors loaded in the policy server", Some(Unit::Bytes), &m.server_adapter_resident_bytes);
        r.add("server_reload_load", "Shared-policy reloads: checkpoint load time, serving going on meanwhile", Some(Unit::Seconds), &m.server_reload_load);
        r.add("server_reload_swap_wait", "Shared-policy reloads: wait for the inference worker to swap the loaded weights in (the batch being decoded finishes first)", Some(Unit::Seconds), &m.server_reload_swap_wait);
        r.add("reloads", "Checkpoint reloads per server, by reload kind and outcome", None, &m.reloads);
        r.add("reload_version", "Newest checkpoint version a reload confirmed, by reload kind", None, &m.reload_version);
        m.build_info.get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_string())]).set(1);
        Metrics { registry: r.registry, declared: r.declared, ..m }
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

/// The OpenMetrics text exposition of the process-wide registry (ends with `# EOF`). Every family is
/// declared (`# HELP`, `# TYPE`, `# UNIT`) even before it has a series, so the families a process
/// exposes do not depend on what it has done yet (OpenMetrics allows a family without samples).
pub fn encode() -> String {
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = encode_registry(&mut text, &get().registry);
    let mut out = text.trim_end().strip_suffix("# EOF").unwrap_or(&text).to_string();
    for d in &get().declared {
        if !text.contains(&format!("# TYPE {} ", d.name)) {
            out.push_str(&format!("# HELP {} {}\n# TYPE {} {}\n", d.name, d.help, d.name, d.kind));
            if let Some(u) = d.unit {
                out.push_str(&format!("# UNIT {} {u}\n", d.name));
            }
        }
    }
    out.push_str("# EOF\n");
    out
}

/// Joins OpenMetrics expositions into one body with a single `# EOF` at its end.
pub fn join(parts: &[String]) -> String {
    let mut out = String::new();
    for p in parts {
        out.push_str(p.trim_end().strip_suffix("# EOF").unwrap_or(p));
    }
    out.push_str("# EOF\n");
    out
}

/// The `Content-Type` of [`encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn labels(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// Counts `n` records received by `stage` from `topic`.
pub fn records_in(stage: &str, topic: &str, n: u64) {
    get().records_in.get_or_create(&labels(&[("stage", stage), ("topic", topic)])).inc_by(n);
}

/// Counts one row emitted by `stage` to `table`.
pub fn record_out(stage: &str, table: &str) {
    get().records_out.get_or_create(&labels(&[("stage", stage), ("table", table)])).inc();
}

/// Counts one dead letter of `stage` with reason code `reason`.
pub fn dead_letter(stage: &str, reason: &str) {
    get().dead_letters.get_or_create(&labels(&[("stage", stage), ("reason", reason)])).inc();
}

/// Sets the lag of `stage`'s consumer on `topic`/`partition`, records.
pub fn consumer_lag(stage: &str, topic: &str, partition: i32, lag: i64) {
    get().consumer_lag.get_or_create(&labels(&[("stage", stage), ("topic", topic), ("partition", &partition.to_string())])).set(lag.max(0));
}

/// Counts one consumer of `stage` on `topic` replaced after a fatal error.
pub fn consumer_recreated(stage: &str, topic: &str) {
    get().consumers_recreated.get_or_create(&labels(&[("stage", stage), ("topic", topic)])).inc();
}

/// Counts one Parquet file of `rows` rows and `bytes` bytes written to `table` (an empty file counts
/// as a file).
pub fn sink_file(table: &str, rows: u64, bytes: u64) {
    let m = get();
    let l = labels(&[("table", table)]);
    m.sink_rows.get_or_create(&l).inc_by(rows);
    m.sink_files.get_or_create(&l).inc();
    m.sink_bytes.get_or_create(&l).inc_by(bytes);
}

/// Records one optimizer step: its loss terms, gradient norm, response tokens and wall time.
pub fn trainer_step(loss_terms: &[(&'static str, f64)], grad_norm: f64, tokens: i64, seconds: f64) {
    let m = get();
    m.trainer_steps.inc();
    for (term, v) in loss_terms {
        m.trainer_loss.get_or_create(&labels(&[("term", term)])).set(*v);
    }
    m.trainer_grad_norm.set(grad_norm);
    if seconds > 0.0 {
        m.trainer_tokens_per_second.set(tokens as f64 / seconds);
    }
}

/// The figures of one optimizer step a practitioner reads first (the `train_steps` columns of the
/// same names); a `None` leaves its gauge as it was.
#[derive(Debug, Clone, Default)]
pub struct StepFigures {
    /// Mean reward r.
    pub reward_mean: Option<f64>,
    /// Population standard deviation of r.
    pub reward_std: Option<f64>,
    /// Learning rate of the step.
    pub learning_rate: Option<f64>,
    /// Tokens.
    pub response_length_mean: Option<f64>,
    /// Nats.
    pub rollout_logprob_abs_diff: Option<f64>,
    /// Policy versions.
    pub staleness_mean: Option<f64>,
    /// Fraction of masked tokens with advantage > 0.
    pub positive_advantage_fraction: Option<f64>,
    /// Fraction of masked tokens with advantage < 0.
    pub negative_advantage_fraction: Option<f64>,
}

/// Sets the trainer's per-step gauges from `f`.
pub fn trainer_step_figures(f: &StepFigures) {
    let m = get();
    let pairs = [
        (&m.trainer_reward_mean, f.reward_mean),
        (&m.trainer_reward_std, f.reward_std),
        (&m.trainer_learning_rate, f.learning_rate),
        (&m.trainer_response_length_mean, f.response_length_mean),
        (&m.trainer_rollout_logprob_abs_diff, f.rollout_logprob_abs_diff),
        (&m.trainer_staleness_mean, f.staleness_mean),
        (&m.trainer_positive_advantage_fraction, f.positive_advantage_fraction),
        (&m.trainer_negative_advantage_fraction, f.negative_advantage_fraction),
    ];
    for (g, v) in pairs {
        if let Some(v) = v {
            g.set(v);
        }
    }
}

/// `--metrics-jsonl FILE`: appends one JSON object per line (one per optimizer step), flushed after
/// each line so `tail -f FILE` follows a run. The one writer `train` and `ablate` share.
#[derive(Debug)]
pub struct JsonlWriter {
    path: std::path::PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl JsonlWriter {
    /// Opens `path` for appending (created if missing, with its parent folder).
    ///
    /// # Errors
    /// [`crate::Error::Io`] when the file cannot be created or opened.
    pub fn open(path: &std::path::Path) -> crate::Result<JsonlWriter> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| crate::Error::io("create folder", parent, e))?;
        }
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| crate::Error::io("open", path, e))?;
        Ok(JsonlWriter { path: path.to_path_buf(), file: std::io::BufWriter::new(file) })
    }

    /// Writes `row` as one JSON line and flushes it.
    ///
    /// # Errors
    /// [`crate::Error::Io`] when the line cannot be written; the serializer's error otherwise.
    pub fn append<T: serde::Serialize>(&mut self, row: &T) -> crate::Result<()> {
        use std::io::Write;
        let mut line = serde_json::to_vec(row)?;
        line.push(b'\n');
        self.file.write_all(&line).and_then(|_| self.file.flush()).map_err(|e| crate::Error::io("write", &self.path, e))
    }
}

/// Counts one sample not trained on, with its reason code.
pub fn trainer_skipped_sample(reason: &str) {
    get().trainer_skipped_samples.get_or_create(&labels(&[("reason", reason)])).inc();
}

/// Counts one spike alarm of kind `kind` (`grad_norm` or `logprob_gap`).
pub fn trainer_alarm(kind: &str) {
    get().trainer_alarms.get_or_create(&labels(&[("kind", kind)])).inc();
}

/// Counts one step that left the weights unchanged, with its reason code.
pub fn trainer_skipped_step(reason: &str) {
    get().trainer_skipped_steps.get_or_create(&labels(&[("reason", reason)])).inc();
}

/// Counts one policy server request on `route` (a fixed route name) answered with `status`.
pub fn server_request(route: &'static str, status: u16) {
    get().server_requests.get_or_create(&labels(&[("route", route), ("status", &status.to_string())])).inc();
}

/// Most distinct `tenant` label values a process uses: 32 ([`tenant_label`]).
pub const MAX_TENANT_LABELS: usize = 32;

/// The `tenant` label value of every tenant past the first [`MAX_TENANT_LABELS`]: `_other` (not a
/// valid tenant id, so never a tenant's own).
pub const OTHER_TENANTS: &str = "_other";

/// The `tenant` label value of `tenant`: the id itself for the first [`MAX_TENANT_LABELS`] tenants
/// this process labels (in the order it first sees them), [`OTHER_TENANTS`] for every later one, so a
/// fleet of any size adds a bounded number of series.
pub fn tenant_label(tenant: &str) -> String {
    static SEEN: LazyLock<std::sync::Mutex<std::collections::BTreeSet<String>>> = LazyLock::new(Default::default);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.contains(tenant) {
        return tenant.to_string();
    }
    if seen.len() < MAX_TENANT_LABELS {
        seen.insert(tenant.to_string());
        return tenant.to_string();
    }
    OTHER_TENANTS.to_string()
}

/// Counts one policy server inference request of `tenant` served by `policy` (`adapter` or `shared`).
pub fn server_tenant_request(tenant: &str, policy: &'static str) {
    get().server_tenant_requests.get_or_create(&labels(&[("tenant", &tenant_label(tenant)), ("policy", policy)])).inc();
}

/// Counts one load of `tenant`'s adapter: `trigger` `reload` (a per-tenant reload) or `on_demand` (an
/// evicted adapter a request needs); `outcome` `loaded`, `older_version` or `load_error`.
pub fn server_adapter_load(tenant: &str, trigger: &'static str, outcome: &'static str) {
    get().server_adapter_loads.get_or_create(&labels(&[("tenant", &tenant_label(tenant)), ("trigger", trigger), ("outcome", outcome)])).inc();
}

/// Counts adapter `adapter`'s optimizer step (`stepped`) and its `samples` trained (`adapter`: a tenant id,
/// labelled by [`tenant_label`], or `shared`).
pub fn trainer_tenant_step(adapter: &str, stepped: bool, samples: u64) {
    let m = get();
    let l = labels(&[("tenant", &adapter_label(adapter))]);
    if stepped {
        m.trainer_tenant_steps.get_or_create(&l).inc();
    }
    m.trainer_tenant_samples.get_or_create(&l).inc_by(samples);
}

/// Sets adapter `adapter`'s newest checkpoint version written.
pub fn trainer_tenant_version(adapter: &str, version: i64) {
    get().trainer_tenant_version.get_or_create(&labels(&[("tenant", &adapter_label(adapter))])).set(version);
}

/// Counts `samples` of `tenant` handed over at a rebalance.
pub fn trainer_tenant_handed_over(tenant: &str, samples: u64) {
    get().trainer_tenant_handed_over.get_or_create(&labels(&[("tenant", &tenant_label(tenant))])).inc_by(samples);
}

/// The `tenant` label of a trainer adapter: `shared` for the shared policy, else [`tenant_label`].
fn adapter_label(adapter: &str) -> String {
    if adapter == "shared" {
        adapter.to_string()
    } else {
        tenant_label(adapter)
    }
}

/// Counts one eviction of `tenant`'s resident adapter.
pub fn server_adapter_evicted(tenant: &str) {
    get().server_adapter_evictions.get_or_create(&labels(&[("tenant", &tenant_label(tenant))])).inc();
}

/// Sets the resident tenant adapters: `count` adapters of `bytes` bytes in all.
pub fn server_adapters_resident(count: usize, bytes: u64) {
    let m = get();
    m.server_adapters_resident.set(count as i64);
    m.server_adapter_resident_bytes.set(bytes.min(i64::MAX as u64) as i64);
}

/// Counts one reload of one server by `kind` with `outcome`; a confirmed `version` moves
/// `reload_version{kind}` up.
pub fn reload(kind: &str, outcome: &str, version: Option<i64>) {
    let m = get();
    m.reloads.get_or_create(&labels(&[("kind", kind), ("outcome", outcome)])).inc();
    if let Some(v) = version {
        let g = m.reload_version.get_or_create(&labels(&[("kind", kind)]));
        if v > g.get() {
            g.set(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_build_info_and_recorded_values() {
        records_in("signals", "interactions", 3);
        sink_file("signals", 2, 100);
        let text = encode();
        assert!(text.contains(&format!("nextstate_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"))), "{text}");
        assert!(text.contains("nextstate_records_in_total{stage=\"signals\",topic=\"interactions\"}"), "{text}");
        assert!(text.contains("# TYPE nextstate_server_request_duration_seconds histogram"), "{text}");
        // A labelled family without a series is still declared, once.
        assert_eq!(text.matches("# TYPE nextstate_reloads counter\n").count(), 1, "{text}");
        assert_eq!(text.matches("# TYPE nextstate_records_in counter\n").count(), 1, "{text}");
        assert!(text.trim_end().ends_with("# EOF"));
        trainer_tenant_step("shared", true, 2);
        trainer_tenant_version("shared", 3);
        let text = encode();
        assert!(text.contains("nextstate_trainer_tenant_steps_total{tenant=\"shared\"}"), "{text}");
        assert!(text.contains("nextstate_trainer_tenant_version{tenant=\"shared\"}"), "{text}");
        let joined = join(&[text.clone(), "# HELP a_b x\n# TYPE a_b counter\na_b_total 1\n# EOF\n".into()]);
        assert!(text.contains("# TYPE nextstate_server_adapter_resident_bytes gauge"), "{text}");
        assert_eq!(joined.matches("# EOF").count(), 1);
        assert!(joined.ends_with("a_b_total 1\n# EOF\n"), "{joined}");
    }

    #[test]
    fn tenant_labels_are_capped_with_an_other_bucket() {
        // Other tests label tenants too: fill the set past the cap, then the cap holds.
        for i in 0..MAX_TENANT_LABELS {
            tenant_label(&format!("cap-test-{i}"));
        }
        let late = tenant_label("cap-test-late-comer");
        assert_eq!(late, OTHER_TENANTS);
        assert_eq!(tenant_label("cap-test-late-comer"), OTHER_TENANTS, "still other the second time");
        // A tenant id begins with a letter or digit: the bucket is never a tenant's own label.
        assert!(OTHER_TENANTS.starts_with('_'));
    }
}
