//! `--metrics-addr HOST:PORT`: a small HTTP server answering `GET /metrics` with the process-wide
//! metrics ([`crate::metrics`]) for the processes that have no listener of their own (`run` without
//! `serve`, `train`, `ingest --follow`). `nextstate serve` and the capture proxy answer `/metrics` on
//! their own port.

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::error::{Error, Result};
use crate::net::Listener;
use crate::runtime::Stop;

/// Binds `addr` (`HOST:PORT`; port 0 = any free port) and serves `GET /metrics` until `stop` is
/// requested. Returns the bound `http://host:port`.
///
/// # Errors
/// [`Error::Config`] for an address without a port; [`Error::Io`] when it cannot be bound.
pub async fn serve_metrics(addr: &str, stop: Stop) -> Result<String> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| Error::Config(format!("--metrics-addr {addr:?}: expected HOST:PORT")))?;
    let port: u16 = port.parse().map_err(|_| Error::Config(format!("--metrics-addr {addr:?}: the port must be a number 0-65535")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let listener = Listener::bind(host, port, None).await?;
    let url = listener.url()?;
    let app = Router::new().route("/metrics", get(|| async { ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], crate::metrics::encode()).into_response() }));
    let mut s = stop;
    tokio::spawn(async move {
        if let Err(e) = crate::net::serve_app(listener, app, async move { s.wait().await }).await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    tracing::info!(url = %format!("{url}/metrics"), "metrics endpoint listening");
    Ok(url)
}
