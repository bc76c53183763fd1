//! The inference handlers of the policy server: `/v1/chat/completions` (plain and SSE-streamed) and
//! `/v1/completions`, each served by the policy [`pick_policy`] chooses (a tenant's adapter or the
//! shared policy), which the response names (`model`, `policy_tenant`, `policy_version`, and the
//! `X-Policy-Version` / `X-Policy-Tenant` headers).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::admin::{api_error, error_kind, set_policy};
use super::messages::{CompletionJob, Job, JobEvent, PromptInput, TokenOut, WorkerMsg};
use super::shared::{InFlight, Shared};
use super::tenants::{ensure_resident, pick_policy};
use crate::model::{FinishReason, Generation, LogprobMode, SamplingParams};
use crate::serve::openai::{error_body, messages_from_openai, split_tool_calls, ChatCompletionRequest, CompletionRequest, PromptField, MAX_PROMPT_LOGPROBS};

/// The tenant whose adapter serves a request (None: the shared policy; see [`pick_policy`]), counted
/// in `server_tenant_requests_total`, its adapter loaded again first if it was evicted. The error
/// answer: 400 `invalid_tenant` for an invalid tenant header, 503 `adapter_unavailable` when the
/// evicted adapter's checkpoint cannot be loaded any more.
async fn policy_for(s: &Arc<Shared>, model: Option<&str>, headers: &HeaderMap) -> std::result::Result<Option<String>, Response> {
    let pick = pick_policy(s, model, headers).map_err(|m| (StatusCode::BAD_REQUEST, Json(error_body(&m, "invalid_request_error", Some("invalid_tenant")))).into_response())?;
    crate::metrics::server_tenant_request(&pick.tenant, if pick.adapter.is_some() { "adapter" } else { "shared" });
    if let Some(t) = &pick.adapter {
        ensure_resident(s, t).await.map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, Json(error_body(&e.to_string(), "server_error", Some("adapter_unavailable")))).into_response())?;
    }
    Ok(pick.adapter)
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn logprob_entry(t: &TokenOut) -> Value {
    json!({
        "token": lossy(&t.bytes),
        "logprob": t.logprob,
        "bytes": t.bytes,
        "top_logprobs": t.top.iter().map(|(_, b, lp)| json!({"token": lossy(b), "logprob": lp, "bytes": b})).collect::<Vec<_>>(),
    })
}

fn finish_str(g: &Generation, has_tool_calls: bool) -> &'static str {
    if has_tool_calls {
        "tool_calls"
    } else {
        match g.finish_reason {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub(super) async fn chat_completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Json<ChatCompletionRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(e.status(), &e.body_text(), error_kind(e.status())),
    };
    let mut timing = Timing::start();
    let adapter = match policy_for(&s, req.model.as_deref(), &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    if req.n.unwrap_or(1) != 1 {
        return api_error(StatusCode::BAD_REQUEST, "only n = 1 is supported", "invalid_request_error");
    }
    let messages = match messages_from_openai(&req.messages) {
        Ok(m) if !m.is_empty() => m,
        Ok(_) => return api_error(StatusCode::BAD_REQUEST, "messages must not be empty", "invalid_request_error"),
        Err(e) => return api_error(StatusCode::BAD_REQUEST, &e.to_string(), "invalid_request_error"),
    };
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top_logprobs = if want_logprobs { req.top_logprobs.unwrap_or(0) } else { 0 };
    let logprob_mode = match req.logprobs_mode.as_deref() {
        None => s.opts.logprobs_mode,
        Some("sampling") => LogprobMode::Sampling,
        Some("raw") => LogprobMode::Raw,
        Some(other) => return api_error(StatusCode::BAD_REQUEST, &format!("logprobs_mode {other:?} (sampling or raw)"), "invalid_request_error"),
    };
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(0),
        max_new_tokens: req.max_completion_tokens.or(req.max_tokens).unwrap_or(s.opts.default_max_tokens),
        stop_token_ids: None,
        stop_strings: req.stop.clone().map(|x| x.into_vec()).unwrap_or_default(),
        seed: req.seed,
        top_logprobs,
        logprob_mode,
    };
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        adapter,
        messages,
        tools: req.tools.clone(),
        template_kwargs: req.chat_template_kwargs.clone(),
        params,
        extra_stop_ids: req.stop_token_ids.clone().unwrap_or_default(),
        events: tx,
    };
    let guard = InFlight::new(&s);
    if s.jobs.send(WorkerMsg::Job(Box::new(job))).is_err() {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker stopped", "server_error");
    }
    let (version, adapter, prompt_ids) = match rx.recv().await {
        Some(JobEvent::Started { version, adapter, prompt_ids }) => (version, adapter, prompt_ids),
        Some(JobEvent::Failed { status, message }) => return api_error(status, &message, error_kind(status)),
        _ => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let model = adapter.clone().unwrap_or_else(|| s.opts.model_name.clone());
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().map(|o| o.include_usage).unwrap_or(false);
        let (etx, erx) = unbounded_channel::<std::result::Result<Event, Infallible>>();
        let ctx = StreamCtx { id, created, model, version, adapter: adapter.clone(), prompt_ids, want_logprobs, include_usage, timing, _guard: guard };
        tokio::spawn(stream_events(rx, etx, ctx));
        let sse = Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(erx)).keep_alive(KeepAlive::default());
        let mut r = sse.into_response();
        set_policy(&mut r, version, adapter.as_deref());
        return r;
    }
    let mut tokens: Vec<TokenOut> = Vec::new();
    let generation = loop {
        match rx.recv().await {
            Some(JobEvent::Token(t)) => {
                timing.token();
                tokens.push(t);
            }
            Some(JobEvent::Done(g)) => {
                timing.done(g.token_ids.len());
                break g;
            }
            Some(JobEvent::Failed { status, message }) => return api_error(status, &message, error_kind(status)),
            Some(JobEvent::Started { .. }) => {}
            None => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
        }
    };
    drop(guard);
    let (content, tool_calls) = split_tool_calls(&generation.text);
    let mut message = json!({"role": "assistant", "content": content});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls.clone());
    }
    let logprobs = if want_logprobs { json!({"content": tokens.iter().map(logprob_entry).collect::<Vec<_>>()}) } else { Value::Null };
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_str(&generation, !tool_calls.is_empty()),
            "token_ids": generation.token_ids,
        }],
        "usage": usage(prompt_ids.len(), generation.token_ids.len()),
        "policy_version": version,
        "policy_tenant": adapter,
        "prompt_token_ids": prompt_ids,
    });
    let mut r = Json(body).into_response();
    set_policy(&mut r, version, adapter.as_deref());
    r
}

/// `POST /v1/completions`: OpenAI's legacy completions with vLLM's `prompt_logprobs` extension, scoring
/// first. The prompt is token ids (used as given) or a text (tokenised without special tokens).
/// With `prompt_logprobs: K`, `choices[0].prompt_logprobs` is vLLM's list: `null` for the first
/// position, then per position a map `{"<token id>": {"logprob", "rank", "decoded_token"}}` with the
/// prompt token (rank in the whole vocabulary, 1 = most likely) and the K most likely tokens (ranks
/// 1..=K); log-probs in nats from the same scoring code as the local teacher
/// ([`LanguageModel::score_ranked`]) under the weights being served. Then `max_tokens` tokens (default
/// 16; 0 = none) are generated with the request's sampling parameters (the chat route's generator), as
/// `text`. `choices[0].prompt_token_ids` and `token_ids` give the ids. Not supported (400): `n` > 1,
/// `stream`, `echo`, `logprobs` of generated tokens, several prompts.
pub(super) async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: std::result::Result<Json<CompletionRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return api_error(e.status(), &e.body_text(), error_kind(e.status())),
    };
    let adapter = match policy_for(&s, req.model.as_deref(), &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let refuse = |m: &str| api_error(StatusCode::BAD_REQUEST, m, "invalid_request_error");
    if req.n.unwrap_or(1) != 1 {
        return refuse("only n = 1 is supported");
    }
    if req.stream.unwrap_or(false) {
        return refuse("stream is not supported on /v1/completions (use /v1/chat/completions)");
    }
    if req.echo.unwrap_or(false) {
        return refuse("echo is not supported (prompt_token_ids and prompt_logprobs give the prompt)");
    }
    if req.logprobs.is_some_and(|n| n > 0) {
        return refuse("logprobs of generated tokens are not supported on /v1/completions (use /v1/chat/completions); prompt_logprobs is");
    }
    let prompt = match req.prompt {
        PromptField::Ids(ids) => PromptInput::Ids(ids),
        PromptField::Text(t) => PromptInput::Text(t),
        PromptField::ManyIds(mut v) if v.len() == 1 => PromptInput::Ids(v.remove(0)),
        PromptField::ManyTexts(mut v) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        _ => return refuse("one prompt per request"),
    };
    let prompt_logprobs = match req.prompt_logprobs {
        None => None,
        Some(k) if (0..=MAX_PROMPT_LOGPROBS as i64).contains(&k) => Some(k as usize),
        Some(k) => return refuse(&format!("prompt_logprobs = {k}: must be in 0..={MAX_PROMPT_LOGPROBS}")),
    };
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(0),
        max_new_tokens: req.max_tokens.unwrap_or(16),
        stop_token_ids: None,
        stop_strings: req.stop.map(|x| x.into_vec()).unwrap_or_default(),
        seed: req.seed,
        top_logprobs: 0,
        logprob_mode: s.opts.logprobs_mode,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let _guard = InFlight::new(&s);
    if s.jobs.send(WorkerMsg::Complete(Box::new(CompletionJob { adapter, prompt, prompt_logprobs, params, reply: tx }))).is_err() {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker stopped", "server_error");
    }
    let out = match rx.await {
        Ok(Ok(out)) => out,
        Ok(Err((status, message))) => return api_error(status, &message, error_kind(status)),
        Err(_) => return api_error(StatusCode::INTERNAL_SERVER_ERROR, "inference worker dropped the request", "server_error"),
    };
    if let Some(g) = &out.generation {
        crate::metrics::get().server_generated_tokens.inc_by(g.token_ids.len() as u64);
    }
    let (text, token_ids, finish) = match &out.generation {
        Some(g) => (g.text.clone(), g.token_ids.clone(), finish_str(g, false)),
        None => (String::new(), vec![], "length"),
    };
    let body = json!({
        "id": format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "text_completion",
        "created": chrono::Utc::now().timestamp(),
        "model": out.adapter.clone().unwrap_or_else(|| s.opts.model_name.clone()),
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish,
            "stop_reason": null,
            "prompt_logprobs": out.prompt_logprobs,
            "prompt_token_ids": out.prompt_ids,
            "token_ids": token_ids,
        }],
        "usage": usage(out.prompt_ids.len(), token_ids.len()),
        "policy_version": out.version,
        "policy_tenant": out.adapter,
    });
    let mut r = Json(body).into_response();
    set_policy(&mut r, out.version, out.adapter.as_deref());
    r
}

struct StreamCtx {
    id: String,
    created: i64,
    model: String,
    version: i64,
    adapter: Option<String>,
    prompt_ids: Vec<u32>,
    want_logprobs: bool,
    include_usage: bool,
    timing: Timing,
    _guard: InFlight,
}

/// A chat completion's timing for the server metrics: time to its first token and to its end, from
/// the request's arrival.
struct Timing {
    arrived: std::time::Instant,
    first_token: bool,
}

impl Timing {
    fn start() -> Timing {
        Timing { arrived: std::time::Instant::now(), first_token: false }
    }
    /// A token was generated (the first one is observed as the time to first token).
    fn token(&mut self) {
        if !self.first_token {
            self.first_token = true;
            crate::metrics::get().server_time_to_first_token.observe(self.arrived.elapsed().as_secs_f64());
        }
    }
    /// The generation ended with `tokens` generated tokens.
    fn done(&self, tokens: usize) {
        let m = crate::metrics::get();
        m.server_request_duration.observe(self.arrived.elapsed().as_secs_f64());
        m.server_generated_tokens.inc_by(tokens as u64);
    }
}

impl StreamCtx {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "policy_version": self.version, "policy_tenant": self.adapter, "choices": choices})
    }
}

fn data(v: &Value) -> std::result::Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Turns job events into SSE chunks: a role chunk (with `prompt_token_ids`), one chunk per token, a
/// final chunk with `finish_reason` (and parsed `tool_calls`), an optional usage chunk, `[DONE]`.
async fn stream_events(mut rx: UnboundedReceiver<JobEvent>, tx: UnboundedSender<std::result::Result<Event, Infallible>>, mut ctx: StreamCtx) {
    let mut first = ctx.chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]));
    first["prompt_token_ids"] = json!(ctx.prompt_ids);
    if tx.send(data(&first)).is_err() {
        return;
    }
    let mut completion = 0usize;
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Token(t) => {
                completion += 1;
                ctx.timing.token();
                let logprobs = if ctx.want_logprobs { json!({"content": [logprob_entry(&t)]}) } else { Value::Null };
                let c = ctx.chunk(json!([{"index": 0, "delta": {"content": t.text}, "logprobs": logprobs, "finish_reason": null, "token_ids": [t.id]}]));
                // The client went away: dropping `rx` makes the worker cancel the sequence.
                if tx.send(data(&c)).is_err() {
                    return;
                }
            }
            JobEvent::Done(g) => {
                ctx.timing.done(g.token_ids.len());
                let (_, calls) = split_tool_calls(&g.text);
                let mut delta = json!({});
                if !calls.is_empty() {
                    delta["tool_calls"] = Value::Array(calls.iter().enumerate().map(|(i, c)| {
                        let mut c = c.clone();
                        c["index"] = json!(i);
                        c
                    }).collect());
                }
                let last = ctx.chunk(json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_str(&g, !calls.is_empty())}]));
                let _ = tx.send(data(&last));
                if ctx.include_usage {
                    let mut u = ctx.chunk(json!([]));
                    u["usage"] = usage(ctx.prompt_ids.len(), completion);
                    let _ = tx.send(data(&u));
                }
                let _ = tx.send(Ok(Event::default().data("[DONE]")));
                return;
            }
            JobEvent::Failed { message, .. } => {
                let _ = tx.send(data(&error_body(&message, "server_error", None)));
                let _ = tx.send(Ok(Event::default().data("[DONE]")));
                return;
            }
            JobEvent::Started { .. } => {}
        }
    }
}
