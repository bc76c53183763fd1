//! The measurement of docs/tenants.md, "Serving per tenant" (not a test: it asserts nothing about
//! timings): greedy tokens/s of one server for the same 16 requests served by the shared policy, by
//! one tenant adapter, and by 8 tenant adapters (2 requests each); bytes per adapter (its tensors, and
//! the process's resident memory per loaded adapter); the time to load one adapter.
//!
//! `cargo test --test serve_proxy -- --ignored --nocapture measure_serving_per_tenant`
//! (`NEXTSTATE_MEASURE_THREADS`, default 2: libtorch threads of the inference worker).

use std::time::{Duration, Instant};

use nextstate::serve::AdapterOptions;
use serde_json::{json, Value};

use super::common;
use super::tenants::{make_adapter, start_server};

const RANK: usize = 16;
const REQUESTS: usize = 16;
const MAX_TOKENS: usize = 32;

/// Resident memory of this process (VmRSS), bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// Sends the 16 requests at once, request `i` as tenant `tenant_of(i)` (None: no tenant header);
/// returns (generated tokens, seconds).
async fn run(url: &str, tenant_of: impl Fn(usize) -> Option<String>) -> (usize, f64) {
    let client = nextstate::net::http_client(None).unwrap();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let mut req = client.post(format!("{url}/v1/chat/completions")).json(&json!({
            "messages": [{"role": "user", "content": format!("Write a short story about a lighthouse keeper, number {i}.")}],
            "temperature": 0, "max_tokens": MAX_TOKENS}));
        if let Some(t) = tenant_of(i) {
            req = req.header("x-agent-id", t);
        }
        tasks.push(tokio::spawn(async move {
            let v: Value = req.send().await.unwrap().json().await.unwrap();
            v["choices"][0]["token_ids"].as_array().map(Vec::len).unwrap_or_else(|| panic!("{v}"))
        }));
    }
    let mut tokens = 0;
    for t in tasks {
        tokens += t.await.unwrap();
    }
    (tokens, t0.elapsed().as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (minutes on CPU); see docs/tenants.md"]
async fn measure_serving_per_tenant() {
    let Some(base) = common::test_model_or_missing() else { return };
    let threads: usize = std::env::var("NEXTSTATE_MEASURE_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    // Freed tensors go back to the OS, so resident memory follows what is alive.
    nextstate::model::return_freed_memory();
    let dir = tempfile::tempdir().unwrap();
    let adapters: Vec<_> = (0..8).map(|i| dir.path().join(format!("t{i}/1"))).collect();
    for (i, a) in adapters.iter().enumerate() {
        make_adapter(&base, a, RANK, 10 + i as i64, 0.002);
    }
    let (url, handle, _stop) = start_server(&base, AdapterOptions::default(), Duration::from_millis(50), threads).await;
    let rss_base = rss();
    let t0 = Instant::now();
    handle.reload_tenant("t0", adapters[0].clone(), 1).await.unwrap();
    let first_load = t0.elapsed().as_secs_f64();
    let rss_one = rss();
    let t0 = Instant::now();
    for (i, a) in adapters.iter().enumerate().skip(1) {
        handle.reload_tenant(&format!("t{i}"), a.clone(), 1).await.unwrap();
    }
    let later_loads = t0.elapsed().as_secs_f64() / 7.0;
    let rss_eight = rss();
    let bytes = handle.tenant_adapters()[0].bytes;
    // Warm-up, then each arm twice (the faster run is reported: the machine is shared).
    run(&url, |_| None).await;
    let arms: [(&str, Box<dyn Fn(usize) -> Option<String>>); 3] = [
        ("shared policy (merged, no adapter)", Box::new(|_| None)),
        ("1 tenant adapter (16 requests of t0)", Box::new(|_| Some("t0".to_string()))),
        ("8 tenant adapters (2 requests each)", Box::new(|i| Some(format!("t{}", i % 8)))),
    ];
    println!("SmolLM2-135M-Instruct f32 CPU, {threads} libtorch threads, max_batch 8, {REQUESTS} concurrent greedy requests of {MAX_TOKENS} tokens, LoRA rank {RANK} on all 7 projections");
    for (name, tenant_of) in &arms {
        let best = [run(&url, tenant_of).await, run(&url, tenant_of).await].into_iter().max_by(|a, b| (a.0 as f64 / a.1).total_cmp(&(b.0 as f64 / b.1))).unwrap();
        println!("{name}: {} tokens in {:.2} s = {:.1} tokens/s", best.0, best.1, best.0 as f64 / best.1);
    }
    println!(
        "adapter tensors: {bytes} bytes ({:.2} MiB) each; process resident memory: {:.0} MiB serving the shared policy, first adapter +{:.1} MiB, 7 more +{:.1} MiB each",
        bytes as f64 / (1 << 20) as f64,
        rss_base as f64 / (1 << 20) as f64,
        (rss_one.saturating_sub(rss_base)) as f64 / (1 << 20) as f64,
        (rss_eight.saturating_sub(rss_one)) as f64 / 7.0 / (1 << 20) as f64
    );
    println!("adapter load (reload_tenant, file to swapped in): first {first_load:.2} s, later {later_loads:.2} s each");
}
