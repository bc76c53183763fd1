//! Integration tests of the policy server: started in-process on a free loopback port with the imported
//! SmolLM2-135M-Instruct, called over HTTP with reqwest. Skipped with a message when the model
//! directory is missing (run scripts/setup.sh); a failure under `CI=true` or `NEXTSTATE_REQUIRE_ALL=1`.
//! Per-tenant adapters: `serve/tenants.rs`; the measurement of docs/tenants.md: `serve/tenant_throughput.rs`.

use crate::common;
mod tenant_throughput;
mod tenants;

use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use nextstate::model::{LanguageModel, LoadOptions, LogprobMode};
use nextstate::serve::{PolicyHandle, PolicyServer, ServerOptions};
use serde_json::{json, Value};

struct Running {
    base: String,
    handle: PolicyHandle,
    dir: PathBuf,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(api_key: Option<&str>) -> Option<Running> {
    start_with(api_key, |_| {}).await
}

/// [`start`] with the options changed by `tune` first.
async fn start_with(api_key: Option<&str>, tune: impl FnOnce(&mut ServerOptions)) -> Option<Running> {
    tch::set_num_threads(1);
    let dir = common::test_model_or_missing()?;
    let lm = LanguageModel::load(&dir, &LoadOptions::default()).expect("load model");
    let opts = ServerOptions {
        model_name: "smollm2".into(),
        api_key: api_key.map(str::to_string),
        health_requires_key: false,
        limits: Default::default(),
        max_body_bytes: 1 << 20,
        max_batch: 8,
        batch_window: Duration::from_millis(10),
        default_max_tokens: 64,
        logprobs_mode: LogprobMode::Sampling,
        load: LoadOptions::default(),
        base_dir: dir.clone(),
        threads: 0,
        merge_lora: false,
        continuous_batching: true,
    };
    let mut opts = opts;
    tune(&mut opts);
    let server = PolicyServer::start(lm, 0, opts).expect("start");
    let handle = server.handle();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, async {
        let _ = rx.await;
    }));
    Some(Running { base: format!("http://{addr}"), handle, dir, _stop: tx })
}

fn germany(extra: Value) -> Value {
    let mut body = json!({"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of Germany?"}],
        "temperature": 0, "max_tokens": 24});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_completion_with_logprobs_matches_score() {
    let Some(s) = start(None).await else { return };
    let client = nextstate::net::http_client(None).unwrap();
    let r = client.post(format!("{}/v1/chat/completions", s.base)).json(&germany(json!({"logprobs": true, "top_logprobs": 3}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-policy-version"], "0");
    let v: Value = r.json().await.unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "The capital of Germany is Berlin.");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(v["policy_version"], 0);
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    let prompt: Vec<u32> = serde_json::from_value(v["prompt_token_ids"].clone()).unwrap();
    assert_eq!(*ids.last().unwrap(), 2, "ends with <|im_end|>");
    assert_eq!(prompt[0], 1, "ChatML prompt starts with <|im_start|>");
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), ids.len(), "one log-prob entry per response token id");
    assert_eq!(entries[0]["token"], "The");
    assert_eq!(entries[0]["bytes"], json!([84, 104, 101]));
    assert_eq!(entries[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(v["usage"]["completion_tokens"], ids.len());
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    // The returned log-probs are the policy's: re-scoring (prompt ids, token ids) reproduces them.
    let lm = LanguageModel::load(&s.dir, &LoadOptions::default()).unwrap();
    let scored = lm.score(&[(prompt, ids)], 0).unwrap();
    for (e, want) in entries.iter().zip(&scored[0].logprobs) {
        let got = e["logprob"].as_f64().unwrap() as f32;
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
}

/// Reads an SSE response into its `data:` payloads.
async fn sse_payloads(r: reqwest::Response) -> Vec<String> {
    let mut buf = String::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    buf.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_one_chunk_per_token() {
    let Some(s) = start(None).await else { return };
    let client = nextstate::net::http_client(None).unwrap();
    let body = germany(json!({"stream": true, "logprobs": true, "stream_options": {"include_usage": true}}));
    let r = client.post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-policy-version"], "0");
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let payloads = sse_payloads(r).await;
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["prompt_token_ids"].as_array().is_some_and(|a| !a.is_empty()));
    let token_chunks: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["token_ids"].is_array()).collect();
    let text: String = token_chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or("")).collect();
    assert_eq!(text, "The capital of Germany is Berlin.");
    for c in &token_chunks {
        assert_eq!(c["choices"][0]["logprobs"]["content"].as_array().map(|a| a.len()), Some(1));
        assert_eq!(c["policy_version"], 0);
    }
    let finish = chunks.iter().find(|c| c["choices"][0]["finish_reason"].is_string()).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.iter().find(|c| c["usage"].is_object()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], token_chunks.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_while_requests_are_in_flight() {
    let Some(s) = start(None).await else { return };
    let client = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/chat/completions", s.base);
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (client, url) = (client.clone(), url.clone());
        let body = json!({"messages": [{"role": "user", "content": format!("Count from 1 to {}.", 5 + i)}], "temperature": 0.7, "seed": i,
            "max_tokens": 24});
        tasks.push(tokio::spawn(async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            let header: i64 = r.headers()["x-policy-version"].to_str().unwrap().parse().unwrap();
            let v: Value = r.json().await.unwrap();
            (status, header, v)
        }));
    }
    // Let the first batch start, then reload (same weights, new version) while it generates.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_flight = s.handle.in_flight();
    let r = client.post(format!("{}/v1/reload", s.base)).json(&json!({"path": s.dir, "version": 1})).send().await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let mut old = 0;
    for t in tasks {
        let (status, header, v) = t.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["policy_version"], header, "body and header agree");
        assert!(header == 0 || header == 1);
        assert!(!v["choices"][0]["token_ids"].as_array().unwrap().is_empty());
        old += (header == 0) as usize;
    }
    assert!(in_flight > 0 && old > 0, "some requests were in flight on version 0 during the reload ({in_flight}, {old})");
    assert_eq!(s.handle.version(), 1);
    let r = client.post(&url).json(&germany(json!({}))).send().await.unwrap();
    assert_eq!(r.headers()["x-policy-version"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["policy_version"], 1);
    assert_eq!(v["choices"][0]["message"]["content"], "The capital of Germany is Berlin.");
    let h: Value = client.get(format!("{}/health", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!((h["policy_version"].as_i64(), h["requests_failed"].as_u64()), (Some(1), Some(0)));
    // An older version is refused; a directory without weights is unprocessable; neither swaps.
    let r = client.post(format!("{}/v1/reload", s.base)).json(&json!({"path": s.dir, "version": 0})).send().await.unwrap();
    assert_eq!(r.status(), 409);
    let r = client.post(format!("{}/v1/reload", s.base)).json(&json!({"path": "/nonexistent", "version": 2})).send().await.unwrap();
    assert_eq!(r.status(), 422);
    assert_eq!(s.handle.version(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_goes_ahead_of_queued_requests_and_the_running_batch_keeps_its_weights() {
    // Batches of one: while the first request decodes, the next two wait in the queue.
    let Some(s) = start_with(None, |o| o.max_batch = 1).await else { return };
    let client = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/chat/completions", s.base);
    let ask = |max_tokens: usize| {
        let (client, url) = (client.clone(), url.clone());
        let body = json!({"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}], "temperature": 0, "max_tokens": max_tokens});
        tokio::spawn(async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            let v: Value = r.json().await.unwrap();
            v["policy_version"].as_i64().unwrap_or_else(|| panic!("{v}"))
        })
    };
    // Long enough (seconds on CPU) that the reload's load, from the cached base, is over while it decodes.
    let first = ask(160);
    while s.handle.in_flight() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let queued = [ask(4), ask(4)];
    while s.handle.in_flight() < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = client.post(format!("{}/v1/reload", s.base)).json(&json!({"path": s.dir, "version": 1})).send().await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert_eq!(first.await.unwrap(), 0, "the batch being decoded finishes on the weights it started with");
    for q in queued {
        assert_eq!(q.await.unwrap(), 1, "requests queued before the reload run on the new weights");
    }
}

/// Continuous batching: a request sent while a long one decodes (after the long one's first token) joins
/// the running batch at the next token boundary and is answered while the long one still decodes; with
/// static batches it waits for the whole batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_mid_batch_joins_it_and_is_answered_first_unless_batches_are_static() {
    for continuous in [true, false] {
        let Some(s) = start_with(None, |o| o.continuous_batching = continuous).await else { return };
        let client = nextstate::net::http_client(None).unwrap();
        let url = format!("{}/v1/chat/completions", s.base);
        // The long request streams; `first` fires at its first token chunk.
        let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
        let long = {
            let (client, url) = (client.clone(), url.clone());
            let body = json!({"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}], "temperature": 0,
                "max_tokens": 160, "stream": true, "stream_options": {"include_usage": true}});
            tokio::spawn(async move {
                let r = client.post(url).json(&body).send().await.unwrap();
                let (mut first_tx, mut buf, mut stream) = (Some(first_tx), String::new(), r.bytes_stream());
                while let Some(chunk) = stream.next().await {
                    buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                    if buf.contains("\"token_ids\"") {
                        if let Some(tx) = first_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                }
                let at = std::time::Instant::now();
                let usage = buf.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|p| serde_json::from_str::<Value>(p).ok()).find_map(|v| v["usage"]["completion_tokens"].as_u64());
                (at, usage.unwrap_or_else(|| panic!("no usage in {buf}")))
            })
        };
        first_rx.await.expect("the long request's first token");
        let body = json!({"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "temperature": 0, "max_tokens": 4});
        let v: Value = client.post(&url).json(&body).send().await.unwrap().json().await.unwrap();
        let short_at = std::time::Instant::now();
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
        let (long_at, long_tokens) = long.await.unwrap();
        assert_eq!(long_tokens, 160, "continuous = {continuous}");
        if continuous {
            assert!(short_at < long_at, "the short request joined the running batch and was answered first");
        } else {
            assert!(short_at > long_at, "with static batches the short request waits for the long one's batch");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_models_and_bad_requests() {
    let Some(s) = start(Some("sekrit")).await else { return };
    let client = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/chat/completions", s.base);
    let r = client.post(&url).json(&germany(json!({"max_tokens": 2}))).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["x-policy-version"], "0");
    let r = client.post(&url).bearer_auth("sekrit-not").json(&germany(json!({"max_tokens": 2}))).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client.post(&url).bearer_auth("sekrit").json(&germany(json!({"max_tokens": 2}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 2);
    // /health is open; /v1/models needs the key.
    assert_eq!(client.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{}/v1/models", s.base)).send().await.unwrap().status(), 401);
    let m: Value = client.get(format!("{}/v1/models", s.base)).bearer_auth("sekrit").send().await.unwrap().json().await.unwrap();
    assert_eq!(m["data"][0]["id"], "smollm2");
    // Bad requests get OpenAI-style 400s.
    for bad in [germany(json!({"n": 2})), germany(json!({"top_p": 0})), json!({"messages": []}), json!({"messages": [{"content": "no role"}]})] {
        let r = client.post(&url).bearer_auth("sekrit").json(&bad).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let e: Value = r.json().await.unwrap();
        assert!(e["error"]["message"].is_string());
    }
    let r = client.post(&url).bearer_auth("sekrit").header("content-type", "application/json").body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    // Oversized bodies are refused.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(2 << 20)}]});
    let r = client.post(&url).bearer_auth("sekrit").json(&big).send().await.unwrap();
    assert_eq!(r.status(), 413);
}

/// Reads until the server closes the connection; returns what it sent and when it closed. Fails the
/// test when the connection is still open after `limit`.
async fn read_until_closed(s: &mut tokio::net::TcpStream, limit: Duration) -> (String, Duration) {
    use tokio::io::AsyncReadExt;
    let t = std::time::Instant::now();
    let (mut got, mut buf) = (vec![], [0u8; 4096]);
    loop {
        match tokio::time::timeout(limit.saturating_sub(t.elapsed()), s.read(&mut buf)).await {
            Err(_) => panic!("connection still open after {limit:?} (got {:?})", String::from_utf8_lossy(&got)),
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), t.elapsed()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Issue 38 on the policy server: a silent connection, half-sent headers and a half-sent body are
/// dropped within the (short) timeouts while a good client is served; `/health` behind the key when
/// asked; the bearer scheme in any case; unknown routes get a JSON 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_dropped_and_health_can_require_the_key() {
    use tokio::io::AsyncWriteExt;
    let limits = nextstate::net::ListenLimits { header_read_timeout: Duration::from_millis(400), body_read_timeout: Duration::from_millis(600), max_connections: 64 };
    let Some(s) = start_with(Some("k3y"), |o| {
        o.limits = limits;
        o.health_requires_key = true;
    })
    .await
    else {
        return;
    };
    let addr = s.base.trim_start_matches("http://").to_string();
    let opened = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut half_headers = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half_headers.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthoriza").await.unwrap();
    let mut half_body = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half_body.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":").await.unwrap();
    // Served meanwhile, with the scheme in any case.
    let client = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    let t = std::time::Instant::now();
    for auth in ["Bearer k3y", "bearer k3y", "BEARER k3y"] {
        let r = client.get(format!("{}/v1/models", s.base)).header("authorization", auth).send().await.unwrap();
        assert_eq!(r.status(), 200, "{auth:?}");
    }
    assert!(t.elapsed() < Duration::from_millis(400), "the good client waited {:?}", t.elapsed());
    let slack = Duration::from_millis(1500);
    let (got, after) = read_until_closed(&mut silent, limits.header_read_timeout + slack).await;
    assert!(got.is_empty(), "a silent connection gets no answer, got {got:?}");
    assert!(opened.elapsed() + Duration::from_millis(50) >= limits.header_read_timeout, "closed before its timeout ({after:?} into the read)");
    read_until_closed(&mut half_headers, limits.header_read_timeout + slack).await;
    let (got, _) = read_until_closed(&mut half_body, limits.body_read_timeout + slack).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("body_timeout"), "{got}");
    // /health behind the key; JSON 404 for unknown routes.
    assert_eq!(client.get(format!("{}/health", s.base)).send().await.unwrap().status(), 401);
    assert_eq!(client.get(format!("{}/health", s.base)).bearer_auth("k3y").send().await.unwrap().status(), 200);
    let r = client.get(format!("{}/v1/nope", s.base)).bearer_auth("k3y").send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "unknown_route");
}
