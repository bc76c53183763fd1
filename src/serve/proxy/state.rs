//! What the capture proxy's handlers share ([`Shared`]: options, upstream client, sessions, emitter,
//! metrics), and how they record a finished turn: its row or its dead letter queued for Kafka
//! without waiting.

use std::sync::{Arc, Mutex};

use super::apis::Api;
use super::background::{Background, Pending};
use super::capture::{build_interaction, Captured, TurnRequest};
use super::config::ProxyOptions;
use super::emit::{EmitterHandle, Outgoing};
use super::metrics::Metrics;
use super::request::{Prepared, RewriteOptions};
use super::response::Completed;
use super::sessions::Sessions;
use crate::schema::DeadLetter;

/// What every handler of one proxy shares.
pub(super) struct Shared {
    pub(super) opts: ProxyOptions,
    pub(super) base: String,
    pub(super) client: reqwest::Client,
    pub(super) rewrite: RewriteOptions,
    pub(super) sessions: Mutex<Sessions>,
    /// Background responses not finished yet ([`super::background`]).
    pub(super) background: Mutex<Background>,
    pub(super) emitter: EmitterHandle,
    pub(super) metrics: Arc<Metrics>,
    pub(super) interactions_topic: String,
    pub(super) dead_letters_topic: String,
}

/// Queues a dead letter of a turn the proxy could not record (counted as outcome `dead_letter`).
pub(super) fn submit_dead(s: &Shared, d: &DeadLetter) {
    s.metrics.turn("dead_letter");
    tracing::warn!(code = %d.reason_code, reason = %d.reason, "proxy: turn sent to dead_letters");
    match Outgoing::of(s.dead_letters_topic.clone(), d) {
        Ok(o) => {
            s.emitter.submit(o);
        }
        Err(e) => {
            s.metrics.drop_event("serialize");
            tracing::error!(error = %e, "proxy: dead letter could not be serialised");
        }
    }
}

/// Records a finished turn: builds its row and queues it for Kafka (never waits).
pub(super) fn capture(s: &Shared, req: &TurnRequest, resp: &Completed, header_version: Option<i64>) {
    let out = match build_interaction(req, resp, header_version, &s.sessions) {
        Captured::Turn(row, tokens) => {
            s.metrics.turn("captured");
            s.metrics.token_capture.get_or_create(&vec![("kind", tokens.kind().to_string())]).inc();
            if tokens.rejected {
                tracing::warn!(session = %row.session_id, turn = row.turn_index, notes = ?tokens.notes, "proxy: invalid token ids/log-probs dropped from the event");
            }
            Outgoing::of(s.interactions_topic.clone(), row.as_ref())
        }
        Captured::Dead(d) => return submit_dead(s, &d),
    };
    match out {
        Ok(o) => {
            s.emitter.submit(o);
        }
        Err(e) => {
            s.metrics.drop_event("serialize");
            tracing::error!(error = %e, "proxy: event could not be serialised");
        }
    }
}

/// The request side of a turn from a prepared request: for a chained Responses request, the chain's
/// history is put between the instructions and the new input.
pub(super) fn turn_request(s: &Shared, api: Api, prepared: &Prepared, received_ms: i64) -> TurnRequest {
    let mut messages = prepared.messages.clone();
    let mut input_start = prepared.instructions;
    let previous = prepared.previous_response_id.as_ref().map(|p| {
        let chain = s.sessions.lock().unwrap_or_else(|e| e.into_inner()).chain(p, &prepared.meta.tenant);
        if let Some(c) = &chain {
            let at = prepared.instructions.min(messages.len());
            messages.splice(at..at, c.history.iter().cloned());
            input_start += c.history.len();
        }
        (p.clone(), chain)
    });
    TurnRequest {
        meta: prepared.meta.clone(),
        messages,
        notes: prepared.notes.clone(),
        raw_messages: prepared.raw_messages.clone(),
        remember: prepared.store && api == Api::Responses,
        previous,
        input_start,
        tools: prepared.tools.clone(),
        model: prepared.model.clone(),
        received_ms,
    }
}

/// The upstream's policy version from the reloader's record ([`ProxyOptions::upstream_versions`]),
/// given the record `before` the request was sent; read when the turn is captured, so a reload that
/// started or ended meanwhile leaves it unknown.
pub(super) fn reloaded_version(s: &Shared, before: Option<&crate::serve::reload::ServerVersion>, req: &TurnRequest) -> Option<i64> {
    s.opts.upstream_versions.as_ref()?.version_for(&s.base, before?, req.model.as_deref())
}

/// Holds a background turn until its response is finished ([`super::background`]); counted as outcome
/// `background_pending` (the turn's final outcome is counted again when a fetch records it), and each
/// pending turn pushed out to make room as `background_forgotten`.
pub(super) fn hold_background(s: &Shared, id: &str, p: Pending) {
    s.metrics.turn("background_pending");
    tracing::debug!(response = id, "proxy: background response held until it is fetched finished");
    let (forgotten, pending) = {
        let mut b = s.background.lock().unwrap_or_else(|e| e.into_inner());
        (b.hold(id, p), b.len())
    };
    s.metrics.background_pending.set(pending as i64);
    for old in forgotten {
        s.metrics.turn("background_forgotten");
        tracing::warn!(response = %old, "proxy: a pending background response was forgotten to make room; its turn will not be recorded");
    }
}

/// Takes background response `id`'s pending turn, if this proxy holds it (only one caller gets it).
pub(super) fn take_background(s: &Shared, id: &str) -> Option<Pending> {
    let mut b = s.background.lock().unwrap_or_else(|e| e.into_inner());
    let p = b.take(id);
    s.metrics.background_pending.set(b.len() as i64);
    p
}
