//! `nextstate proxy`: a capture proxy in front of a policy server (ours, vLLM, SGLang, a hosted
//! API). It forwards `POST /v1/chat/completions`, `POST /v1/responses` (OpenAI Responses) and
//! `POST /v1/messages` (Anthropic Messages), streamed or not, and `GET /v1/models`, and emits one
//! `interactions` event per finished turn (docs/method.md §1) to Kafka without ever making the client
//! wait on Kafka. What is specific to the Responses and Messages APIs (conversations, responses,
//! stream events, `previous_response_id` chains, `x-api-key` / `anthropic-*` headers) is in
//! [`apis`]; everything below holds for all three, except the log-prob rewriting, which is chat
//! completions only.
//!
//! Per request:
//! - Turn metadata from headers `X-Session-Id`, `X-Turn-Type` (`main`|`side`), `X-Session-Done`
//!   (truthy: 1/true/yes/on), `X-Turn-Index`, or the body keys `session_id`, `turn_type`,
//!   `session_done`, `turn_index` (headers win). The body keys are removed and the headers are not
//!   forwarded: the upstream never sees them. A bad turn type or index → 400.
//! - No session id → inferred ([`crate::ingest::sessions`]; `session_inferred = true`). The default
//!   turn type is configurable and `main` by default (docs/method.md §1: the reference's `side` default
//!   trains nothing).
//! - `turn_index`: explicit (`X-Turn-Index`) when given; else, for an explicit session, the number of
//!   turns (main and side) of that session this proxy process has seen, in the order their responses
//!   finished (failed turns do not count) — **a proxy restart resets it**
//!   (clients that need stable indices across restarts send `X-Turn-Index`); for an inferred session,
//!   the number of assistant messages in the request (restart-proof).
//! - Log-probs: the proxy sets `logprobs: true` when the client did not, and then nulls
//!   `choices[].logprobs` in what the client gets (stream chunks included), so the client sees what
//!   it asked for. It adds `return_token_ids: true` (vLLM's switch for `prompt_token_ids` and
//!   `choices[].token_ids`; ours returns them anyway and ignores the key) unless disabled. It does
//!   **not** set `logprobs_mode`: the upstream's own default applies to proxied and direct calls
//!   alike (ours: `nextstate serve --logprobs-mode`, default `sampling` = the distribution actually
//!   sampled from; vLLM: raw). The trainer's ratio `exp(new − old)` (docs/method.md §6) compares these
//!   rollout log-probs with its own forward pass, so deployments that sample with temperature ≠ 1 or
//!   top-p/top-k and want the two to agree set `--logprobs-mode raw` on the server, or
//!   `--upstream-logprobs-mode raw` here (sent only when the client sent none).
//! - The response is returned unchanged otherwise (non-stream: the upstream's bytes, re-serialised
//!   only when log-probs had to be removed); streams are forwarded chunk by chunk as they arrive.
//! - Upstream error status → passed through (status and body), no event, counted; upstream
//!   unreachable → 502 with a JSON error (`error.code` `upstream_tls_error` for a TLS failure, whose
//!   message says TLS and why; `upstream_timeout`, `upstream_unreachable` with the OS's reason, or
//!   `upstream_failed`); body over the limit → 413; missing/wrong
//!   key (`Authorization: Bearer`, the scheme in any case, or `x-api-key`) → 401 (compared in constant
//!   time; `/health` is open unless [`ProxyOptions::health_requires_key`]); an unknown path → 404 and
//!   a wrong method → 405. The proxy's own errors come in the client's API's shape: OpenAI's
//!   `{"error": {"message", "type", "param", "code"}}` for chat completions and Responses,
//!   Anthropic's `{"type": "error", "error": {"type", "message"}}` for Messages (and for unknown
//!   routes asked with Anthropic headers); see [`apis::Api::error_body`].
//! - Slow clients ([`ProxyOptions::limits`], [`crate::net::ListenLimits`]): headers not complete
//!   within the header timeout (default 10 s; also a silent or idle connection) → connection closed;
//!   a body not complete within the body timeout (default 30 s) → 408 and connection closed; at most
//!   `max_connections` (default 512) connections, further ones wait to be accepted.
//! - An upstream URL with credentials (`http://user:pass@host`) is never shown with its password:
//!   logs, error bodies and `/health` carry it as `http://user:***@host`.
//! - Requests that could not become a row are refused before the upstream runs, with 400 and
//!   `error.code` naming why ([`request::Rejected`]): not JSON (`malformed_json`: bad syntax, invalid
//!   UTF-8, nesting deeper than 128), not an object (`wrong_type`), bad turn metadata
//!   (`invalid_turn_metadata`), `messages` missing or not an array (`missing_messages`), a message
//!   that does not normalise (`wrong_type`, `missing_role`, `unknown_role`, ...). An explicit session
//!   and `X-Turn-Index` this proxy already captured → 409 `duplicate_turn`.
//! - An upstream 2xx response that cannot be recorded is passed to the client unchanged and becomes a
//!   `dead_letters` row (stage `proxy`): not JSON (`malformed_json`, e.g. a `NaN` log-prob), no
//!   `choices[0].message` (`bad_response`), a stream chunk that is not JSON (`bad_response`), a stream
//!   without a finish reason (`incomplete_stream`); a second capture of one session and turn (two
//!   requests in flight at once, or an inferred session asked again) → `duplicate_turn`.
//!
//! Rows (`interactions`, `source_format = "proxy"`): request messages normalised
//! ([`crate::ingest::normalize`]), tools, response text / reasoning (`<think>` split or
//! `reasoning_content`) / tool calls, finish reason, `truncated` (finish reason `length` or an
//! unclosed reasoning block), `policy_version` (body field, else the `X-Policy-Version` header, else
//! the version an in-process reloader confirmed for the upstream: [`ProxyOptions::upstream_versions`]),
//! prompt and response token ids and rollout log-probs when the upstream returns them (validated:
//! ids are non-negative `i32`s, log-probs finite, one per response token; anything invalid is dropped
//! with a note and counted in `token_capture_total{kind="rejected"}`), `event_time` = when the
//! request arrived, `ingest_time` = when the row was built. The `source_*` lineage columns stay null:
//! the row is itself the Kafka record.
//!
//! Background responses (Responses API `background: true`): the turn is held by response id and
//! recorded when a later `GET /v1/responses/{id}` (or `?stream=true`, or a cancel) returns the
//! response finished; see [`background`].
//!
//! Events: see [`emit`] (bounded channel → emitter task → Kafka, or a bounded local spool while Kafka
//! is down, replayed later; at-least-once). `/metrics` ([`metrics`]) and `/health` report the counts.

pub mod apis;
pub mod background;
pub mod capture;
mod cli;
mod config;
pub mod emit;
mod handlers;
pub mod metrics;
mod relay;
pub mod request;
pub mod response;
mod server;
pub mod sessions;
pub mod sse;
mod state;
pub mod streams;
pub mod tokens;
mod upstream;

pub use self::cli::ProxyArgs;
pub use self::config::ProxyOptions;
pub use self::metrics::ProxyStats;
pub use self::server::{serve_proxy, Proxy};
