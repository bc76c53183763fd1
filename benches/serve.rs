//! The policy server under concurrent clients: generated tokens/s, time to first token (TTFT) and
//! request latency with continuous batching and with static batches, for 1, 4 and 8 clients.
//!
//! Set-up: this process starts the policy server (`PolicyServer`, SmolLM2-135M-Instruct f32, one
//! libtorch thread on the inference worker, `max_batch` 8, batching window 10 ms) on loopback and runs
//! the clients (reqwest). Each client sends `requests` streaming chat requests one after another
//! (closed loop), greedy, with the prompts and `max_tokens` of `benches/serve_workload.json`: mixed lengths, as agents'
//! turns are, which is where a static batch makes short answers wait for long ones. The same requests
//! in the same order for every mode and client count; greedy answers are the same tokens either way.
//! TTFT is from sending a request to its first token chunk; latency to its last byte.
//!
//! Modes: `mode=continuous` (the default server) or `mode=static` (`--static-batching`); one mode per
//! process, so the `BENCH` line's `peak_rss_mb` (VmHWM at the end) is that mode's alone.
//!
//! Run: `cargo bench --bench serve -- mode=continuous` (`clients=1,4,8`, `requests=6`;
//! `NEXTSTATE_BENCH_MODEL` for another model directory). The peer (`benches/peer_serve.py`) runs the same
//! requests through transformers' batched `generate`.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use nextstate::model::{LanguageModel, LoadOptions, LogprobMode};
use nextstate::serve::{PolicyServer, ServerOptions};
use serde_json::{json, Value};

use common::{arg, emit, ms, percentile};

/// The (prompt, max_tokens) pairs of `benches/serve_workload.json`, shared with the peer; request `j` of
/// client `c` is entry `(c * 5 + j) % len`.
fn workload() -> Vec<(String, usize)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/serve_workload.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read benches/serve_workload.json")).expect("workload: [[prompt, max_tokens], ...]")
}

/// Resident memory high-water mark of this process (VmHWM), bytes.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// One request: (TTFT, latency, completion tokens).
async fn one(client: &reqwest::Client, url: &str, prompt: &str, max_tokens: usize) -> (Duration, Duration, u64) {
    let body = json!({"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
        "stream": true, "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let r = client.post(url).json(&body).send().await.expect("send");
    assert_eq!(r.status(), 200);
    let (mut ttft, mut buf) = (None, String::new());
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("body");
        buf.push_str(&String::from_utf8_lossy(&chunk));
        if ttft.is_none() && buf.contains("\"token_ids\"") {
            ttft = Some(t0.elapsed());
        }
    }
    let latency = t0.elapsed();
    let tokens = buf
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())
        .expect("usage chunk");
    (ttft.unwrap_or(latency), latency, tokens)
}

fn main() {
    let mode = arg("mode", "continuous");
    let continuous = match mode.as_str() {
        "continuous" => true,
        "static" => false,
        other => panic!("mode={other}: continuous or static"),
    };
    let clients: Vec<usize> = arg("clients", "1,4,8").split(',').map(|c| c.trim().parse().expect("clients=1,4,8")).collect();
    let requests: usize = arg("requests", "6").parse().expect("requests=N");
    let dir = std::env::var("NEXTSTATE_BENCH_MODEL").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct"));
    tch::set_num_threads(1);
    let lm = LanguageModel::load(&dir, &LoadOptions::default()).expect("load the model (scripts/setup.sh)");
    let opts = ServerOptions {
        model_name: "bench".into(),
        api_key: None,
        health_requires_key: false,
        limits: Default::default(),
        max_body_bytes: 1 << 20,
        max_batch: 8,
        batch_window: Duration::from_millis(10),
        default_max_tokens: 128,
        logprobs_mode: LogprobMode::Raw,
        load: LoadOptions::default(),
        base_dir: dir.clone(),
        threads: 1,
        merge_lora: true,
        continuous_batching: continuous,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let server = PolicyServer::start(lm, 0, opts).expect("start");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/v1/chat/completions", listener.local_addr().expect("addr"));
        let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(server.serve(listener, async {
            let _ = rx.await;
        }));
        let client = nextstate::net::http_client(None).expect("client");
        let work = workload();
        // Warm-up: one short request.
        one(&client, &url, &work[0].0, 8).await;
        for &n in &clients {
            let t0 = Instant::now();
            let mut tasks = vec![];
            for c in 0..n {
                let (client, url, work) = (client.clone(), url.clone(), work.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = vec![];
                    for j in 0..requests {
                        let (prompt, max_tokens) = &work[(c * 5 + j) % work.len()];
                        out.push(one(&client, &url, prompt, *max_tokens).await);
                    }
                    out
                }));
            }
            let mut results = vec![];
            for t in tasks {
                results.extend(t.await.expect("client"));
            }
            let wall = t0.elapsed().as_secs_f64();
            let tokens: u64 = results.iter().map(|r| r.2).sum();
            let mut ttft: Vec<f64> = results.iter().map(|r| ms(r.0)).collect();
            let mut lat: Vec<f64> = results.iter().map(|r| ms(r.1)).collect();
            ttft.sort_by(f64::total_cmp);
            lat.sort_by(f64::total_cmp);
            emit(json!({
                "bench": "serve", "mode": mode, "clients": n, "requests": results.len(), "tokens": tokens,
                "seconds": wall, "tokens_per_s": tokens as f64 / wall,
                "ttft_p50_ms": percentile(&ttft, 50.0), "ttft_p90_ms": percentile(&ttft, 90.0),
                "latency_p50_ms": percentile(&lat, 50.0), "latency_p90_ms": percentile(&lat, 90.0),
                "peak_rss_mb": peak_rss() as f64 / 1e6,
            }));
        }
    });
}
