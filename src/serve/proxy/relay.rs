//! Relaying an upstream SSE stream: forwarded to the client as it arrives (log-probs removed when
//! the client did not ask for them), assembled into a turn on the way, recorded when it ends.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::apis::Api;
use super::background::Pending;
use super::capture::{self, TurnRequest};
use super::request::strip_logprobs;
use super::response::NoTurn;
use super::sse::{SseEvent, SseFramer};
use super::state::{capture, hold_background, reloaded_version, submit_dead, Shared};
use super::streams::Accumulator;

/// Feeds one SSE event to the accumulator; returns the bytes to forward to the client.
pub(super) fn relay_event(acc: &mut Accumulator, ev: SseEvent, strip: bool) -> Vec<u8> {
    let Some(data) = &ev.data else { return ev.raw };
    if data.trim() == "[DONE]" {
        acc.done_marker();
        return ev.raw;
    }
    match serde_json::from_str::<Value>(data) {
        Ok(mut v) => {
            acc.push(&v);
            if strip && strip_logprobs(&mut v) {
                SseEvent::with_data(&v.to_string())
            } else {
                ev.raw
            }
        }
        Err(e) => {
            acc.unreadable_chunk(&e);
            ev.raw
        }
    }
}

/// A streamed turn being relayed: its request, the accumulator of its API, whether log-probs are
/// removed from what the client gets, the upstream's `X-Policy-Version` and when the request arrived.
pub(super) struct StreamedTurn {
    pub(super) req: TurnRequest,
    pub(super) api: Api,
    pub(super) acc: Accumulator,
    pub(super) strip: bool,
    pub(super) header_version: Option<i64>,
    /// The reloader's record of the upstream when the request was sent (see
    /// [`ProxyOptions::upstream_versions`]).
    pub(super) reloads_before: Option<crate::serve::reload::ServerVersion>,
    pub(super) t0: Instant,
    /// A background response's stream (Responses API, [`super::background`]), else None.
    pub(super) background: Option<BackgroundStream>,
}

/// What [`pump_stream`] knows of a background response: when the client leaves the stream, it is
/// still read to its end and its turn recorded; when the upstream stream breaks off, or ends with
/// neither a terminal event nor an error (a resumed stream past its end, a cancelled response), the turn
/// is held again for the next fetch.
pub(super) struct BackgroundStream {
    /// The response id when the stream is a fetch (`GET /v1/responses/{id}?stream=true`); a create
    /// call's stream names it in its first `response` snapshot.
    pub(super) id: Option<String>,
    /// Size of the request's body (bytes): [`Pending::bytes`].
    pub(super) bytes: usize,
    /// A fetch's stream: the create call's `X-Policy-Version` (the stream's own header is the fetch's;
    /// [`super::background::version_of`]).
    pub(super) created_version: Option<i64>,
}

/// Forwards an upstream SSE stream to the client as it arrives, assembling the turn on the way;
/// records the turn when the stream ends with a finish reason.
pub(super) async fn pump_stream(s: Arc<Shared>, resp: reqwest::Response, tx: mpsc::Sender<std::result::Result<Bytes, Infallible>>, turn: StreamedTurn) {
    let StreamedTurn { req, api, mut acc, strip, header_version, reloads_before, t0, background } = turn;
    let is_background = background.is_some();
    // A background turn's record for holding it again until a later fetch (None for other streams).
    let pending_of = |acc: &Accumulator, req: &TurnRequest| -> Option<(String, Pending)> {
        let b = background.as_ref()?;
        let id = b.id.clone().or_else(|| acc.response_id().map(str::to_string))?;
        let created = if b.id.is_some() { b.created_version } else { header_version };
        Some((id, Pending { req: req.clone(), reloads_before: reloads_before.clone(), header_version: created, bytes: b.bytes }))
    };
    // The turn was held again when the upstream stream broke off (nothing more to record here).
    let mut held = false;
    let mut framer = SseFramer::default();
    let mut upstream = resp.bytes_stream();
    let mut failed: Option<&'static str> = None;
    // The stream's first bytes, for the dead letter of a stream that cannot be recorded.
    let mut head: Vec<u8> = vec![];
    // A background response goes on upstream without the client: its stream is read to its end, and
    // its turn recorded, after the client left.
    let mut client_gone = false;
    'read: while let Some(chunk) = upstream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                let reason = crate::net::redact_url(&crate::net::error_chain(&e));
                tracing::warn!(error = %reason, "proxy: upstream stream broke off");
                // A background response goes on upstream: its turn is held before the client hears of
                // the break, so the fetch the client makes next records it.
                if let Some((id, p)) = pending_of(&acc, &req) {
                    hold_background(&s, &id, p);
                    held = true;
                }
                // In the API's own error shape, after a blank line that ends any event cut mid-way.
                let mut out = if framer.has_partial() { b"\n\n".to_vec() } else { vec![] };
                out.extend(api.stream_error_event(&format!("upstream stream failed: {reason}")));
                if !client_gone {
                    let _ = tx.send(Ok(Bytes::from(out))).await;
                }
                failed = Some("upstream_error");
                break;
            }
        };
        head.extend_from_slice(&chunk[..chunk.len().min((64usize << 10).saturating_sub(head.len()))]);
        let events = framer.push(&chunk);
        if strip {
            for ev in events {
                let out = relay_event(&mut acc, ev, true);
                if !client_gone && tx.send(Ok(Bytes::from(out))).await.is_err() {
                    if !is_background {
                        failed = Some("client_disconnected");
                        break 'read;
                    }
                    client_gone = true;
                }
            }
        } else {
            // Forward the bytes as received (no waiting for event boundaries), then assemble.
            if !client_gone && tx.send(Ok(chunk)).await.is_err() {
                if !is_background {
                    failed = Some("client_disconnected");
                    break;
                }
                client_gone = true;
            }
            for ev in events {
                relay_event(&mut acc, ev, false);
            }
        }
    }
    if failed.is_none() {
        if let Some(ev) = framer.finish() {
            let out = relay_event(&mut acc, ev, strip);
            if strip && !client_gone && tx.send(Ok(Bytes::from(out))).await.is_err() && !is_background {
                failed = Some("client_disconnected");
            }
        }
    }
    if client_gone {
        s.metrics.turn("background_client_left");
        tracing::debug!("proxy: the client left a background response's stream; it was read to its end");
    }
    // Dropping the upstream stream closes its connection: the upstream stops generating.
    drop(upstream);
    s.metrics.latency.observe(t0.elapsed().as_secs_f64());
    if held {
        return;
    }
    let version = match &background {
        Some(BackgroundStream { id: Some(_), created_version, .. }) => super::background::version_of(*created_version, header_version),
        _ => header_version,
    };
    // (background streams only: the record to hold again if the stream did not finish the response)
    let rehold = pending_of(&acc, &req);
    match failed {
        Some(outcome) => s.metrics.turn(outcome),
        None => match acc.finish() {
            Ok(c) => capture(&s, &req, &c, version.or_else(|| reloaded_version(&s, reloads_before.as_ref(), &req))),
            // A background stream that ended with neither its terminal event nor an error: the response
            // is not finished here (a resumed stream past its end, a cancel); the next fetch decides.
            Err(NoTurn::Incomplete) if rehold.is_some() => {
                if let Some((id, p)) = rehold {
                    hold_background(&s, &id, p);
                }
            }
            // The upstream's own error: passed to the client, counted, no dead letter (as an error status).
            Err(nt @ NoTurn::StreamError(_)) => {
                tracing::warn!(reason = ?nt, "proxy: stream ended without a turn to record");
                s.metrics.turn(nt.code());
            }
            Err(nt) => submit_dead(&s, &capture::dead_response(nt.code(), nt.reason(), &req, &head)),
        },
    }
}
