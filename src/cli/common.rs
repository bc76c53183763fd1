//! What several commands share: stdout that survives a closed pipe, the data and metrics flags, loading
//! the pipeline file, and the error message `main` prints.
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::config::PipelineConfig;
use nextstate::runtime::Stop;

/// Writes `text` to stdout; a closed stdout (`nextstate sql ... | head`) ends the process quietly with
/// exit code 0, as a command-line tool in a pipe does, instead of a panic.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("Error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

/// `print!` through [`emit`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::common::emit(&format!($($arg)*)) };
}
pub(crate) use out;

/// `println!` through [`emit`].
macro_rules! outln {
    () => { $crate::cli::common::emit("\n") };
    ($($arg:tt)*) => { $crate::cli::common::emit(&(format!($($arg)*) + "\n")) };
}
pub(crate) use outln;

/// Where the data lives (shared by the commands that touch the bus or the lake).
#[derive(Args, Clone, Debug, Default)]
pub struct DataArgs {
    /// Kafka bootstrap servers (HOST:PORT,...). Without it: an embedded in-process mock cluster.
    #[arg(long, env = "NEXTSTATE_BROKERS")]
    brokers: Option<String>,
    /// Lake folder (default: the pipeline's, else ./lake).
    #[arg(long, env = "NEXTSTATE_LAKE")]
    lake: Option<PathBuf>,
    /// Prefix of every topic name.
    #[arg(long, env = "NEXTSTATE_TOPIC_PREFIX")]
    topic_prefix: Option<String>,
    /// Static consumer-group membership: a stable name of this process, unique among those sharing
    /// its groups; a restarted process then takes over its partitions at once ([bus] group_instance_id).
    #[arg(long, env = "NEXTSTATE_GROUP_INSTANCE_ID")]
    group_instance_id: Option<String>,
    /// A librdkafka setting for the cluster at --brokers, `KEY=VALUE` (repeatable), e.g.
    /// `security.protocol=SASL_SSL`; added to the pipeline's [bus.properties].
    #[arg(long = "kafka-property", value_parser = nextstate::net::parse_key_value)]
    kafka_properties: Vec<(String, String)>,
    /// A librdkafka setting read from an environment variable, `KEY=VARIABLE` (repeatable), e.g.
    /// `sasl.password=KAFKA_PASSWORD`; added to the pipeline's [bus.secret_env].
    #[arg(long = "kafka-secret-env", value_parser = nextstate::net::parse_key_value)]
    kafka_secret_env: Vec<(String, String)>,
    /// Extra CA certificates (PEM) trusted by every HTTP client (judge, hint, teacher, reloads),
    /// besides the platform's roots and SSL_CERT_FILE ([tls] ca_file); a server's own certificate
    /// listed there (self-signed included) is pinned.
    #[arg(long, env = "NEXTSTATE_CA_FILE")]
    ca_file: Option<PathBuf>,
}

impl DataArgs {
    pub fn apply(&self, cfg: &mut PipelineConfig) {
        if let Some(b) = &self.brokers {
            cfg.bus.brokers = Some(b.clone());
        }
        if let Some(l) = &self.lake {
            cfg.lake = l.clone();
        }
        if let Some(p) = &self.topic_prefix {
            cfg.bus.topic_prefix = p.clone();
        }
        if let Some(g) = &self.group_instance_id {
            cfg.bus.group_instance_id = Some(g.clone());
        }
        cfg.bus.properties.extend(self.kafka_properties.iter().cloned());
        cfg.bus.secret_env.extend(self.kafka_secret_env.iter().cloned());
        if let Some(c) = &self.ca_file {
            cfg.tls.ca_file = Some(c.clone());
        }
    }
}

/// `--metrics-addr`, on the long-running commands without a listener of their own.
#[derive(Args, Clone, Debug, Default)]
pub struct MetricsArgs {
    /// Serve this process's Prometheus metrics at http://HOST:PORT/metrics (docs/metrics.md).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<String>,
}

impl MetricsArgs {
    /// Starts the `--metrics-addr` endpoint when one is given (until `stop`).
    pub async fn serve(&self, stop: &Stop) -> Result<()> {
        if let Some(a) = &self.metrics_addr {
            nextstate::stages::metrics_http::serve_metrics(a, stop.clone()).await.context("--metrics-addr")?;
        }
        Ok(())
    }
}

pub fn load_pipeline(path: &Option<PathBuf>, data: &DataArgs) -> Result<PipelineConfig> {
    let mut cfg = match path {
        Some(p) => PipelineConfig::load(p)?,
        None => PipelineConfig::embedded_layered()?,
    };
    data.apply(&mut cfg);
    cfg.validate()?;
    cfg.tls.apply()?;
    Ok(cfg)
}

/// `e`'s message and causes joined by ": " (as anyhow's `{:#}`), leaving out a cause whose text the
/// message before it already contains: thiserror's `#[error("sql: {0}")]` wrappers print their source in
/// their own text, and DataFusion nests one error in another with the same text, so `{:#}` would print a
/// schema error's list of valid fields four times.
pub fn user_message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if previous.is_empty() || !previous.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        previous = text;
    }
    out
}
