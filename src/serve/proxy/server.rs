//! The running capture proxy ([`Proxy`]): opens the spool and starts the emitter, builds the routes,
//! serves until shutdown and reports its counters.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

use super::apis::Api;
use super::config::{upstream_base, ProxyOptions};
use super::emit::{Emitter, Spool};
use super::handlers::{auth_and_count, chat_completions, health, messages, method_not_allowed, metrics_text, models, not_found, responses};
use super::metrics::{Metrics, ProxyStats};
use super::request::RewriteOptions;
use super::sessions::Sessions;
use super::state::Shared;
use crate::bus::Bus;
use crate::schema::{DeadLetter, Interaction, Table};
use crate::{Error, Result};

/// A running proxy: its routes, its emitter and its metrics.
pub struct Proxy {
    shared: Arc<Shared>,
    emitter: Emitter,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").field("upstream", &crate::net::redact_url(&self.shared.base)).finish()
    }
}

impl Proxy {
    /// Opens the spool and starts the emitter on `bus` (which may be unreachable: see
    /// [`Bus::connect_lazy`]). Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Config`] for an upstream URL that is not `http(s)://…`, [`Error::Io`] when the spool
    /// folder cannot be opened, [`Error::Kafka`] when the producer cannot be created,
    /// [`Error::Http`] when the HTTP client cannot be built.
    pub async fn start(opts: ProxyOptions, bus: &Bus) -> Result<Proxy> {
        let base = upstream_base(&opts.upstream);
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(crate::config_err!("--upstream must be an http:// URL, got {:?}", crate::net::redact_url(&opts.upstream)));
        }
        let client = crate::net::client_builder()?
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.upstream_idle_timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| Error::Http(format!("http client: {}", crate::net::error_chain(&e))))?;
        let metrics = Arc::new(Metrics::new());
        let spool = Spool::open(opts.spool.clone()).await?;
        if !spool.is_empty() {
            tracing::info!(events = spool.events(), bytes = spool.bytes(), dir = %spool.dir().display(), "proxy: spool from an earlier run will be replayed");
        }
        let producer = bus.producer_with_timeout(opts.emitter.send_timeout, Duration::ZERO)?;
        let emitter = Emitter::start(producer, bus.clone(), vec![Interaction::NAME, DeadLetter::NAME], spool, metrics.clone(), opts.emitter.clone());
        let rewrite = RewriteOptions {
            default_turn_type: opts.default_turn_type,
            request_token_ids: opts.request_token_ids,
            logprobs_mode: opts.logprobs_mode.clone(),
            tenant_headers: opts.tenant_headers.clone(),
        };
        let shared = Arc::new(Shared {
            sessions: Mutex::new(Sessions::new(opts.session_capacity)),
            background: Mutex::new(super::background::Background::new(opts.session_capacity)),
            base,
            client,
            rewrite,
            emitter: emitter.handle(),
            metrics,
            interactions_topic: bus.topic(Interaction::NAME),
            dead_letters_topic: bus.topic(DeadLetter::NAME),
            opts,
        });
        Ok(Proxy { shared, emitter })
    }

    /// The routes: `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages` (captured),
    /// `POST /v1/messages/count_tokens`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
    /// `GET /v1/responses/{id}/input_items` (passed through, not captured), `GET /v1/models`,
    /// `GET /health`, `GET /metrics`; any other path is a JSON 404 and another method on a route a
    /// JSON 405, in the client's API's error shape.
    pub fn router(&self) -> Router {
        let [count_tokens, stored, cancel, input_items] = super::handlers::PASS_THROUGH;
        Router::new()
            .route(Api::ChatCompletions.path(), post(chat_completions))
            .route(Api::Responses.path(), post(responses))
            .route(Api::Messages.path(), post(messages))
            .route(count_tokens, post(super::handlers::pass_through))
            .route(stored, get(super::handlers::pass_through))
            .route(cancel, post(super::handlers::pass_through))
            .route(input_items, get(super::handlers::pass_through))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(self.shared.clone(), auth_and_count))
            .layer(DefaultBodyLimit::max(self.shared.opts.max_body_bytes))
            .with_state(self.shared.clone())
    }

    /// The metrics registry.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        ProxyStats::of(&self.shared.metrics)
    }

    /// Serves on `listener` until `shutdown` resolves, then finishes requests in flight, delivers or
    /// spools every queued event and returns the final counters.
    ///
    /// # Errors
    /// [`Error::Http`] when the server fails.
    pub async fn serve(self, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<ProxyStats> {
        let app = self.router();
        let limits = self.shared.opts.limits;
        let r = crate::net::serve_app_with(listener.into(), app, limits, shutdown).await.map_err(|e| Error::Http(format!("proxy server: {e}")));
        let stats = self.shutdown().await;
        r.map(|_| stats)
    }

    /// Stops the emitter after it delivered or spooled every queued event; returns the final counters.
    pub async fn shutdown(self) -> ProxyStats {
        let Proxy { shared, emitter } = self;
        // Background turns still waiting for a fetch are lost with the process: counted, and logged.
        let pending = shared.background.lock().unwrap_or_else(|e| e.into_inner()).drain();
        if !pending.is_empty() {
            tracing::warn!(count = pending.len(), "proxy: shutting down with background responses not fetched finished; their turns are not recorded");
            for _ in &pending {
                shared.metrics.turn("background_forgotten");
            }
            shared.metrics.background_pending.set(0);
        }
        emitter.shutdown().await;
        ProxyStats::of(&shared.metrics)
    }
}

/// Runs a proxy on `listener` with events going to `bus` until `shutdown` resolves (see
/// [`Proxy::serve`]); for running the proxy as a task inside another command.
///
/// # Errors
/// As [`Proxy::start`] and [`Proxy::serve`].
pub async fn serve_proxy(opts: ProxyOptions, bus: Bus, listener: impl Into<crate::net::Listener>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<ProxyStats> {
    Proxy::start(opts, &bus).await?.serve(listener, shutdown).await
}
