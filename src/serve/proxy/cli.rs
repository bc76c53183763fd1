//! `nextstate proxy`: the command-line flags ([`ProxyArgs`]) and the process around the proxy
//! (Kafka or the embedded bus, the optional lake sinks, the listener, the final summary line).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::config::{upstream_base, ProxyOptions};
use super::emit::SpoolConfig;
use super::server::serve_proxy;
use crate::bus::{Bus, BusConfig};
use crate::lake::sink::start_sinks;
use crate::schema::{DeadLetter, Interaction, Table, TurnType};
use crate::{Error, Result};

/// `nextstate proxy`: the capture proxy.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Upstream OpenAI-compatible server (ours, vLLM, SGLang), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub upstream: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) from clients on every route but
    /// /health.
    #[arg(long, env = "NEXTSTATE_PROXY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Require the API key on /health too (default: /health is open, for load balancers).
    #[arg(long)]
    pub health_requires_key: bool,
    /// Header and body read timeouts and the connection cap.
    #[command(flatten)]
    pub limits: crate::net::ListenLimitArgs,
    /// Name of the environment variable holding the upstream's API key.
    #[arg(long)]
    pub upstream_api_key_env: Option<String>,
    /// Header naming a request's tenant (repeatable; the first present wins). Default: X-Agent-Id,
    /// then X-User-Id. A request naming none belongs to the `default` tenant.
    #[arg(long = "tenant-header")]
    pub tenant_headers: Vec<String>,
    /// Do not send a turn's tenant upstream as `X-Agent-Id` (e.g. the upstream is a third-party API).
    #[arg(long)]
    pub no_forward_tenant: bool,
    /// Turn type of requests that do not mark it (main = trainable; docs/method.md §1).
    #[arg(long, default_value = "main")]
    pub default_turn_type: String,
    /// Folder of the spool that holds events while Kafka is unavailable.
    #[arg(long, default_value = ".cache/proxy-spool")]
    pub spool_dir: PathBuf,
    /// Most bytes the spool may hold; events beyond are dropped and counted.
    #[arg(long, default_value_t = 256 << 20)]
    pub spool_max_bytes: u64,
    /// Largest accepted request body, bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Milliseconds Kafka may take to acknowledge an event before it is spooled.
    #[arg(long, default_value_t = 5000)]
    pub send_timeout_ms: u64,
    /// Seconds the upstream may stay silent (before headers or between chunks).
    #[arg(long, default_value_t = 600)]
    pub upstream_timeout_s: u64,
    /// Do not add `return_token_ids: true` to upstream requests.
    #[arg(long)]
    pub no_return_token_ids: bool,
    /// `logprobs_mode` to send upstream when the client sends none (raw or sampling; ours only).
    #[arg(long)]
    pub upstream_logprobs_mode: Option<String>,
    /// Kafka bootstrap servers (HOST:PORT,...). Without it: an embedded in-process mock cluster
    /// (then the lake sink runs in this process).
    #[arg(long, env = "NEXTSTATE_BROKERS")]
    pub brokers: Option<String>,
    /// Prefix of every topic name.
    #[arg(long, env = "NEXTSTATE_TOPIC_PREFIX", default_value = "")]
    pub topic_prefix: String,
    /// Also write `interactions` and `dead_letters` to this lake from this process (always on with
    /// the embedded bus, default ./lake).
    #[arg(long, env = "NEXTSTATE_LAKE")]
    pub lake: Option<PathBuf>,
    /// A librdkafka setting for the cluster at --brokers, `KEY=VALUE` (repeatable), e.g.
    /// `security.protocol=SASL_SSL` ([bus.properties] of a pipeline).
    #[arg(long = "kafka-property", value_parser = crate::net::parse_key_value)]
    pub kafka_properties: Vec<(String, String)>,
    /// A librdkafka setting whose value is read from an environment variable, `KEY=VARIABLE`
    /// (repeatable), e.g. `sasl.password=KAFKA_PASSWORD` ([bus.secret_env]).
    #[arg(long = "kafka-secret-env", value_parser = crate::net::parse_key_value)]
    pub kafka_secret_env: Vec<(String, String)>,
    /// Extra CA certificates (PEM) trusted for an https upstream, besides the platform's roots and
    /// `SSL_CERT_FILE`; the upstream's own certificate listed there (self-signed included) is pinned.
    #[arg(long, env = "NEXTSTATE_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// https instead of http for clients of the proxy.
    #[command(flatten)]
    pub tls: crate::net::ListenTlsArgs,
}

impl ProxyArgs {
    /// The library options these flags describe.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad turn type, logprobs mode, tenant header name, a zero limit, or a
    /// missing upstream key variable.
    pub fn options(&self) -> Result<ProxyOptions> {
        let mut o = ProxyOptions::new(self.upstream.clone());
        o.api_key = self.api_key.clone().filter(|k| !k.is_empty());
        o.health_requires_key = self.health_requires_key;
        o.limits = self.limits.limits()?;
        if let Some(name) = &self.upstream_api_key_env {
            o.upstream_api_key = Some(std::env::var(name).map_err(|_| crate::config_err!("--upstream-api-key-env {name}: variable not set"))?);
        }
        o.default_turn_type = TurnType::parse(&self.default_turn_type).ok_or_else(|| crate::config_err!("--default-turn-type must be main or side, got {:?}", self.default_turn_type))?;
        if !self.tenant_headers.is_empty() {
            o.tenant_headers = super::request::tenant_header_names(Some(&self.tenant_headers)).map_err(|e| crate::config_err!("--tenant-header: {e}"))?;
        }
        o.forward_tenant = !self.no_forward_tenant;
        o.spool = SpoolConfig::new(self.spool_dir.clone(), self.spool_max_bytes);
        o.emitter.send_timeout = Duration::from_millis(self.send_timeout_ms.max(1));
        o.max_body_bytes = self.max_body_bytes;
        o.upstream_idle_timeout = Duration::from_secs(self.upstream_timeout_s.max(1));
        o.request_token_ids = !self.no_return_token_ids;
        if let Some(m) = &self.upstream_logprobs_mode {
            if m != "raw" && m != "sampling" {
                return Err(crate::config_err!("--upstream-logprobs-mode {m:?} (raw or sampling)"));
            }
            o.logprobs_mode = Some(m.clone());
        }
        Ok(o)
    }

    /// Runs the proxy until Ctrl-C / SIGTERM (own tokio runtime).
    ///
    /// # Errors
    /// [`Error::Config`] for bad flags, [`Error::Io`] when the port cannot be bound, start errors of
    /// [`Proxy::start`].
    pub fn run(self) -> Result<()> {
        crate::net::TlsConfig { ca_file: self.ca_file.clone() }.apply()?;
        let opts = self.options()?;
        let tls = self.tls.server_tls()?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| Error::io("tokio runtime", "-", e))?;
        rt.block_on(async move {
            let cfg = BusConfig {
                brokers: self.brokers.clone(),
                topic_prefix: self.topic_prefix.clone(),
                properties: self.kafka_properties.iter().cloned().collect(),
                secret_env: self.kafka_secret_env.iter().cloned().collect(),
                ..BusConfig::default()
            };
            cfg.validate()?;
            let bus = match &cfg.brokers {
                None => Bus::connect(cfg.clone()).await?,
                Some(b) => match Bus::connect(cfg.clone()).await {
                    Ok(bus) => bus,
                    Err(e) => {
                        tracing::warn!(brokers = %b, error = %e, "Kafka unreachable at start; serving anyway and spooling events until it is back");
                        Bus::connect_lazy(cfg.clone())?
                    }
                },
            };
            let stop = crate::runtime::Stop::default();
            stop.on_signals();
            // The lake sinks stop once the proxy has drained its events and they have caught up.
            let (sink_stop, proxy_done) = (crate::runtime::Stop::default(), crate::runtime::DoneFlag::default());
            let lake = match (&self.lake, bus.is_embedded()) {
                (Some(l), _) => Some(l.clone()),
                (None, true) => Some(PathBuf::from("lake")),
                (None, false) => None,
            };
            let mut sinks = vec![];
            if let Some(dir) = &lake {
                let lake = crate::lake::Lake::open(dir)?;
                let sc = crate::lake::sink::SinkConfig::default();
                bus.ensure_topics(&[Interaction::NAME, DeadLetter::NAME]).await?;
                let dl = bus.producer()?;
                sinks = start_sinks(&[Interaction::NAME, DeadLetter::NAME], &bus, &lake, &sc, &dl, |table| crate::runtime::TaskCtl::new(&format!("sink:{table}"), true, sink_stop.clone()).after(&proxy_done));
                tracing::info!(lake = %dir.display(), "proxy: writing interactions and dead_letters to the lake");
            }
            let listener = crate::net::Listener::bind(&self.host, self.port, tls.as_ref()).await?;
            let addr = listener.url()?;
            tracing::info!(
                "capture proxy on {addr} → {} (auth {}, default turn type {}, events to {}, header/body timeouts {} s/{} s, at most {} connections)",
                crate::net::redact_url(&upstream_base(&opts.upstream)),
                match (&opts.api_key, opts.health_requires_key) {
                    (None, _) => "off",
                    (Some(_), false) => "on, /health open",
                    (Some(_), true) => "on, /health too",
                },
                opts.default_turn_type.as_str(),
                if bus.is_embedded() { "the embedded bus".to_string() } else { bus.bootstrap().to_string() },
                opts.limits.header_read_timeout.as_secs_f64(),
                opts.limits.body_read_timeout.as_secs_f64(),
                opts.limits.max_connections
            );
            let mut wait = stop.clone();
            let served = serve_proxy(opts, bus, listener, async move { wait.wait().await }).await;
            proxy_done.set();
            if served.is_err() {
                sink_stop.request();
            }
            let stats = served?;
            for (table, h) in sinks {
                match h.await {
                    Ok(Ok(st)) => tracing::info!(table, rows = st.rows_written, files = st.files, "lake sink finished"),
                    Ok(Err(e)) => tracing::error!(table, error = %e, "lake sink failed"),
                    Err(e) => tracing::error!(table, error = %e, "lake sink task failed"),
                }
            }
            println!(
                "proxy: turns_captured={} dead_letters={} upstream_errors={} events_emitted={} events_spooled={} events_dropped={} spool_events={}",
                stats.turns_captured, stats.dead_letters, stats.upstream_errors, stats.events_emitted, stats.events_spooled, stats.events_dropped, stats.spool_events
            );
            Ok(())
        })
    }
}
