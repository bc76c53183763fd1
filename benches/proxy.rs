//! The capture proxy under load from a second process on loopback: requests/s and latency (p50, p99)
//! calling an OpenAI-compatible upstream directly and through `nextstate proxy`, and what the proxy
//! adds.
//!
//! Set-up: this process runs a fake upstream (axum; a non-streaming chat completion with token ids and
//! log-probs, answered at once) and the load generator (reqwest, keep-alive). The proxy is a separate
//! `nextstate proxy --upstream <fake> --brokers <broker>` process, so the load reaches it from another
//! process; it publishes one `interactions` event per request to a real Kafka-protocol broker (the
//! default `scripts/broker.sh` one). Every request is a distinct turn (its own session id and text).
//! After the run the topic's watermarks must hold exactly one event per proxied request.
//!
//! Measured for each concurrency (`concurrency=1,8`): `requests=N` (default 2,000) requests straight to
//! the upstream, then the same through the proxy, after 100 warm-up requests each way.
//!
//! Run: `cargo bench --bench proxy -- brokers=127.0.0.1:19092`. Prints `BENCH {json}` lines.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use serde_json::{json, Value};

use nextstate::bus::{Bus, BusConfig};

use common::{arg, emit, percentile};

/// The fake upstream: echoes the last user message as the answer, with token ids, prompt ids and
/// log-probs as a vLLM/SGLang server returns them.
async fn fake_chat(body: Bytes) -> axum::response::Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return (axum::http::StatusCode::BAD_REQUEST, format!("bad json: {e}")).into_response(),
    };
    let user = body["messages"].as_array().and_then(|m| m.last()).and_then(|m| m["content"].as_str()).unwrap_or("").to_string();
    let toks: Vec<String> = std::iter::once("echo:".to_string()).chain(user.split_whitespace().map(|w| format!(" {w}"))).collect();
    let ids: Vec<u32> = (0..toks.len() as u32).map(|i| 100 + i).collect();
    let lp: Vec<Value> = toks.iter().enumerate().map(|(i, t)| json!({"token": t, "logprob": -0.25 * (i as f64 + 1.0), "bytes": t.as_bytes(), "top_logprobs": []})).collect();
    let prompt_ids: Vec<u32> = (1..=16).collect();
    let resp = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake-model", "policy_version": 0,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": toks.concat()},
            "logprobs": {"content": lp}, "finish_reason": "stop", "token_ids": ids}],
        "usage": {"prompt_tokens": prompt_ids.len(), "completion_tokens": toks.len(), "total_tokens": prompt_ids.len() + toks.len()},
        "prompt_token_ids": prompt_ids,
    });
    ([("content-type", "application/json")], serde_json::to_vec(&resp).expect("serialise")).into_response()
}

/// `n` requests with `concurrency` in flight; returns (requests/s, sorted latencies in ms).
async fn load(c: &reqwest::Client, url: &str, n: usize, concurrency: usize, tag: &str) -> (f64, Vec<f64>) {
    let t0 = Instant::now();
    let mut lat: Vec<f64> = futures::stream::iter(0..n)
        .map(|i| {
            let (c, url) = (c.clone(), format!("{url}/v1/chat/completions"));
            let body = json!({"model": "policy", "logprobs": true, "max_tokens": 32, "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": format!("request {tag} {i}: what is {i} plus {i}?")}]});
            async move {
                let t = Instant::now();
                let r = c.post(&url).header("x-session-id", format!("bench-{tag}-{i}")).json(&body).send().await.expect("request");
                assert_eq!(r.status(), 200, "{url}");
                r.bytes().await.expect("body");
                t.elapsed().as_secs_f64() * 1e3
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    (n as f64 / secs, lat)
}

fn main() {
    let brokers = arg("brokers", "127.0.0.1:19092");
    let n: usize = arg("requests", "2000").parse().expect("requests=N");
    let concurrency: Vec<usize> = arg("concurrency", "1,8").split(',').map(|c| c.parse().expect("concurrency=1,8")).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let tmp = tempfile::tempdir().expect("tempdir");
    let prefix = format!("benchproxy{}.", &uuid::Uuid::new_v4().simple().to_string()[..10]);

    rt.block_on(async {
        let bus = Bus::connect(BusConfig { brokers: Some(brokers.clone()), topic_prefix: prefix.clone(), partitions: 4, ..Default::default() })
            .await
            .expect("connect to the broker");
        bus.ensure_topics(&["interactions", "dead_letters"]).await.expect("create topics");
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = format!("http://{}", l.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(l, Router::new().route("/v1/chat/completions", post(fake_chat))).await.expect("serve") });

        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let log = std::fs::File::create(tmp.path().join("proxy.log")).expect("log");
        let mut proxy = Command::new(env!("CARGO_BIN_EXE_nextstate"))
            .args(["proxy", "--upstream", &upstream, "--port", &port.to_string(), "--brokers", &brokers, "--topic-prefix", &prefix])
            .args(["--spool-dir", &tmp.path().join("spool").display().to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nextstate proxy");
        let proxy_url = format!("http://127.0.0.1:{port}");
        let c = nextstate::net::http_client(None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.get(format!("{proxy_url}/health")).send().await.map(|r| !r.status().is_success()).unwrap_or(true) {
            assert!(Instant::now() < deadline, "proxy did not start; see {}", tmp.path().join("proxy.log").display());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let mut proxied_total = 0usize;
        load(&c, &upstream, 100, 1, "warm-direct").await;
        load(&c, &proxy_url, 100, 1, "warm-proxy").await;
        proxied_total += 100;
        for &conc in &concurrency {
            let (d_rps, d) = load(&c, &upstream, n, conc, &format!("direct-c{conc}")).await;
            let (p_rps, p) = load(&c, &proxy_url, n, conc, &format!("proxy-c{conc}")).await;
            proxied_total += n;
            let (d50, d99, p50, p99) = (percentile(&d, 50.0), percentile(&d, 99.0), percentile(&p, 50.0), percentile(&p, 99.0));
            emit(json!({"bench": "proxy", "concurrency": conc, "requests": n,
                "direct_rps": d_rps, "direct_p50_ms": d50, "direct_p99_ms": d99,
                "proxy_rps": p_rps, "proxy_p50_ms": p50, "proxy_p99_ms": p99,
                "added_p50_ms": p50 - d50, "added_p99_ms": p99 - d99}));
        }

        // Every proxied request became exactly one event (the proxy publishes before it answers, or
        // spools; give a spooled event time to be replayed).
        let topic = bus.topic("interactions");
        let deadline = Instant::now() + Duration::from_secs(60);
        let events = loop {
            let marks = bus.watermarks(&topic).await.expect("watermarks");
            let events: i64 = marks.values().map(|(lo, hi)| hi - lo).sum();
            if events as usize >= proxied_total || Instant::now() > deadline {
                break events;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let _ = proxy.kill();
        let _ = proxy.wait();
        assert_eq!(events as usize, proxied_total, "one event per proxied request; see {}", tmp.path().join("proxy.log").display());
        emit(json!({"bench": "proxy", "case": "events", "proxied": proxied_total, "events": events}));
    });
}
