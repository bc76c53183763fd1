//! The proxy's metrics (`prometheus-client`), exposed at `/metrics` in the OpenMetrics text format
//! (which Prometheus scrapes natively) and read back for `/health` and [`ProxyStats`].

use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

pub use crate::metrics::Labels;
use crate::metrics::latency_buckets;

/// Every metric of one proxy (names are prefixed `nextstate_proxy_`).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `requests_total{route, status}`: HTTP requests by route and response status.
    pub requests: Family<Labels, Counter>,
    /// `request_duration_seconds`: chat-completion latency, request arrival to the last byte of the
    /// upstream response (whole stream for streams), seconds.
    pub latency: Histogram,
    /// `turns_total{outcome}`: chat completions by outcome (`captured`, `dead_letter`,
    /// `upstream_error`, `upstream_unreachable`, `client_disconnected`, `bad_response`,
    /// `incomplete_stream`, `bad_request`; Responses background responses ([`super::background`]):
    /// `background_pending` each time a turn is held for a later fetch (its final outcome is counted
    /// again when a fetch records it), `background_cancelled`, `background_not_found` (404/410 on a
    /// fetch), `background_forgotten` (pushed out of the bounded store, or pending at shutdown),
    /// `background_client_left` (a client left a background stream, which was read to its end)).
    pub turns: Family<Labels, Counter>,
    /// `token_capture_total{kind}`: captured turns by token data (`ids_and_logprobs`, `ids_only`,
    /// `text_only`, `rejected` = invalid ids/log-probs dropped with a note).
    pub token_capture: Family<Labels, Counter>,
    /// `events_emitted_total`: events acknowledged by Kafka (directly or replayed from the spool).
    pub emitted: Counter,
    /// `events_spooled_total`: events written to the spool.
    pub spooled: Counter,
    /// `events_replayed_total`: spooled events later acknowledged by Kafka.
    pub replayed: Counter,
    /// `events_dropped_total{reason}`: events lost (`spool_full`, `queue_full`, `spool_error`,
    /// `spool_corrupt`, `serialize`, `too_large`: a dead letter over the bus's record limit).
    pub dropped: Family<Labels, Counter>,
    /// `spool_bytes`: bytes waiting in the spool.
    pub spool_bytes: Gauge<i64, AtomicI64>,
    /// `spool_events`: events waiting in the spool.
    pub spool_events: Gauge<i64, AtomicI64>,
    /// `kafka_up`: 1 while events go straight to Kafka, 0 while they are spooled.
    pub kafka_up: Gauge<i64, AtomicI64>,
    /// `background_pending`: background responses whose turn waits for a fetch
    /// ([`super::background`]).
    pub background_pending: Gauge<i64, AtomicI64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("nextstate_proxy");
        let requests = Family::<Labels, Counter>::default();
        let latency = Histogram::new(latency_buckets());
        let turns = Family::<Labels, Counter>::default();
        let token_capture = Family::<Labels, Counter>::default();
        let emitted = Counter::default();
        let spooled = Counter::default();
        let replayed = Counter::default();
        let dropped = Family::<Labels, Counter>::default();
        let spool_bytes = Gauge::<i64, AtomicI64>::default();
        let spool_events = Gauge::<i64, AtomicI64>::default();
        let kafka_up = Gauge::<i64, AtomicI64>::default();
        let background_pending = Gauge::<i64, AtomicI64>::default();
        registry.register("requests", "HTTP requests by route and status", requests.clone());
        registry.register_with_unit("request_duration", "Chat completion latency (to the last upstream byte)", Unit::Seconds, latency.clone());
        registry.register("turns", "Chat completions by outcome", turns.clone());
        registry.register("token_capture", "Captured turns by token data kept", token_capture.clone());
        registry.register("events_emitted", "Interaction events acknowledged by Kafka", emitted.clone());
        registry.register("events_spooled", "Events written to the local spool", spooled.clone());
        registry.register("events_replayed", "Spooled events later acknowledged by Kafka", replayed.clone());
        registry.register("events_dropped", "Events lost, by reason", dropped.clone());
        registry.register_with_unit("spool", "Bytes waiting in the spool", Unit::Bytes, spool_bytes.clone());
        registry.register("spool_events", "Events waiting in the spool", spool_events.clone());
        registry.register("kafka_up", "1 while events go straight to Kafka, 0 while spooling", kafka_up.clone());
        registry.register("background_pending", "Background responses whose turn waits for a fetch", background_pending.clone());
        Metrics { registry, requests, latency, turns, token_capture, emitted, spooled, replayed, dropped, spool_bytes, spool_events, kafka_up, background_pending }
    }

    /// Counts one request.
    pub fn request(&self, route: &'static str, status: u16) {
        self.requests.get_or_create(&vec![("route", route.to_string()), ("status", status.to_string())]).inc();
    }

    /// Counts one chat completion outcome.
    pub fn turn(&self, outcome: &'static str) {
        self.turns.get_or_create(&vec![("outcome", outcome.to_string())]).inc();
    }

    /// Value of `turns_total{outcome}`.
    pub fn turns_of(&self, outcome: &'static str) -> u64 {
        self.turns.get(&vec![("outcome", outcome.to_string())]).map(|c| c.get()).unwrap_or(0)
    }

    /// Counts one dropped event.
    pub fn drop_event(&self, reason: &'static str) {
        self.dropped.get_or_create(&vec![("reason", reason.to_string())]).inc();
    }

    /// Sum of `events_dropped_total` over reasons.
    pub fn dropped_total(&self) -> u64 {
        ["spool_full", "queue_full", "spool_error", "spool_corrupt", "serialize", "too_large"]
            .iter()
            .map(|r| self.dropped.get(&vec![("reason", r.to_string())]).map(|c| c.get()).unwrap_or(0))
            .sum()
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Counters of a proxy (a snapshot of its metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProxyStats {
    /// Turns turned into `interactions` events.
    pub turns_captured: u64,
    /// Turns sent to `dead_letters` instead (an upstream answer that cannot be recorded, a duplicate turn).
    pub dead_letters: u64,
    /// Requests the upstream answered with an error status (passed through, no event).
    pub upstream_errors: u64,
    /// Requests the upstream could not be reached for (502).
    pub upstream_unreachable: u64,
    /// Captured turns whose token ids/log-probs were invalid and dropped (event kept, with a note).
    pub token_rejected: u64,
    /// Events acknowledged by Kafka (direct or replayed).
    pub events_emitted: u64,
    /// Events written to the spool.
    pub events_spooled: u64,
    /// Spooled events replayed to Kafka.
    pub events_replayed: u64,
    /// Events lost (queue full, spool full, spool errors), all reasons.
    pub events_dropped: u64,
    /// Bytes in the spool now.
    pub spool_bytes: u64,
    /// Events in the spool now.
    pub spool_events: u64,
}

impl ProxyStats {
    /// Reads the counters from a proxy's metrics ([`crate::serve::proxy::Proxy::metrics`]).
    pub fn of(m: &Metrics) -> ProxyStats {
        ProxyStats {
            turns_captured: m.turns_of("captured"),
            dead_letters: m.turns_of("dead_letter"),
            upstream_errors: m.turns_of("upstream_error"),
            upstream_unreachable: m.turns_of("upstream_unreachable"),
            token_rejected: m.token_capture.get(&vec![("kind", "rejected".to_string())]).map(|c| c.get()).unwrap_or(0),
            events_emitted: m.emitted.get(),
            events_spooled: m.spooled.get(),
            events_replayed: m.replayed.get(),
            events_dropped: m.dropped_total(),
            spool_bytes: m.spool_bytes.get().max(0) as u64,
            spool_events: m.spool_events.get().max(0) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histogram() {
        let m = Metrics::new();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("chat", 401);
        m.turn("captured");
        m.drop_event("spool_full");
        m.spool_bytes.set(123);
        m.latency.observe(0.003);
        let text = m.render();
        assert!(text.contains("nextstate_proxy_requests_total{route=\"chat\",status=\"200\"} 2"), "{text}");
        assert!(text.contains("nextstate_proxy_requests_total{route=\"chat\",status=\"401\"} 1"), "{text}");
        assert!(text.contains("nextstate_proxy_events_dropped_total{reason=\"spool_full\"} 1"), "{text}");
        assert!(text.contains("nextstate_proxy_spool_bytes 123"), "{text}");
        assert!(text.contains("nextstate_proxy_request_duration_seconds_bucket{le=\"0.004\"} 1"), "{text}");
        assert!(text.contains("nextstate_proxy_request_duration_seconds_bucket{le=\"0.002\"} 0"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"));
        assert_eq!((m.turns_of("captured"), m.dropped_total()), (1, 1));
    }
}
