//! `/metrics` of the long-running processes against `docs/metrics.md`, the spec: a real `nextstate serve`
//! (the imported SmolLM2) and a real `nextstate run --metrics-addr` on the embedded bus expose exactly
//! the process-wide families the spec lists, and known work moves them by known amounts: one chat
//! completion bumps the request counter and both latency histograms by exactly 1; the signals stage
//! counts every interaction it was fed; the signals it emitted, the sink's row counter and the lake's
//! row count are one number. A `nextstate proxy` exposes the process-wide families and nothing unlisted.
use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The metric names of `docs/metrics.md`: (process-wide families, capture-proxy families).
fn spec() -> (BTreeSet<String>, BTreeSet<String>) {
    let text = std::fs::read_to_string(common::root().join("docs/metrics.md")).expect("docs/metrics.md");
    let (mut global, mut proxy) = (BTreeSet::new(), BTreeSet::new());
    let mut in_proxy = false;
    for line in text.lines() {
        if line.starts_with("## ") {
            in_proxy = line.contains("proxy");
        }
        let Some(rest) = line.strip_prefix("| `nextstate_") else { continue };
        let name = format!("nextstate_{}", &rest[..rest.find('`').expect("closing backquote")]);
        if in_proxy { &mut proxy } else { &mut global }.insert(name);
    }
    (global, proxy)
}

/// The families an exposition declares (`# TYPE` lines), named as their samples are: counters with
/// `_total`.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut it = l.split_whitespace();
            let (name, kind) = (it.next().unwrap_or_default(), it.next().unwrap_or_default());
            if kind == "counter" { format!("{name}_total") } else { name.to_string() }
        })
        .collect()
}

/// Every sample line: series (name with labels) → value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Sum of the samples whose series starts with `prefix` (e.g. `name{stage="signals",`).
fn sum(text: &str, prefix: &str) -> f64 {
    samples(text).iter().filter(|(s, _)| s.starts_with(prefix)).map(|(_, v)| v).sum()
}

fn value(text: &str, series: &str) -> f64 {
    samples(text).get(series).copied().unwrap_or(0.0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Scrapes `url`, retrying until it answers (the process may still be starting) or `limit` passes.
async fn scrape(url: &str, proc: &mut common::Proc, limit: Duration) -> String {
    let client = nextstate::net::http_client(Some(Duration::from_secs(60))).unwrap();
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                let ctype = r.headers().get("content-type").map(|v| v.to_str().unwrap_or("").to_string()).unwrap_or_default();
                assert!(ctype.starts_with("application/openmetrics-text"), "content type {ctype}");
                let text = r.text().await.unwrap();
                assert_eq!(text.matches("# EOF").count(), 1, "one # EOF:\n{text}");
                assert!(text.trim_end().ends_with("# EOF"), "{text}");
                return text;
            }
        }
        if let Some(s) = proc.exited() {
            panic!("{} exited ({s}) before answering {url}:\n{}", proc.name, proc.log_tail(40));
        }
        assert!(Instant::now() < deadline, "{url} did not answer within {limit:?}:\n{}", proc.log_tail(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn assert_same(exposed: &BTreeSet<String>, spec: &BTreeSet<String>, what: &str) {
    let missing: Vec<_> = spec.difference(exposed).collect();
    let extra: Vec<_> = exposed.difference(spec).collect();
    assert!(missing.is_empty() && extra.is_empty(), "{what}: listed in docs/metrics.md but not exposed: {missing:?}; exposed but not listed: {extra:?}");
}

#[test]
fn the_spec_lists_each_family_once_with_conventional_names() {
    let (global, proxy) = spec();
    assert!(global.len() >= 20 && proxy.len() >= 10, "{global:?} {proxy:?}");
    let text = std::fs::read_to_string(common::root().join("docs/metrics.md")).unwrap();
    for name in global.iter().chain(&proxy) {
        assert_eq!(text.matches(&format!("| `{name}` |")).count(), 1, "{name} is listed once");
        assert!(!name.ends_with("_seconds_total") && !name.contains("_ms"), "{name}: durations are _seconds histograms");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exposes_the_spec_and_counts_one_completion_exactly_once() {
    let Some(model) = common::test_model_or_missing() else { return };
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let args = common::args(&["serve", "--model", model.to_str().unwrap(), "--port", &port.to_string(), "--threads", "1", "--policy-version", "3"]);
    let mut server = common::Proc::spawn("serve", &args, &dir.path().join("serve.log"));
    let base = format!("http://127.0.0.1:{port}");
    let before = scrape(&format!("{base}/metrics"), &mut server, Duration::from_secs(120)).await;

    let (global, _) = spec();
    assert_same(&families(&before), &global, "nextstate serve");
    assert_eq!(value(&before, &format!("nextstate_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"))), 1.0);
    assert_eq!(value(&before, "nextstate_server_policy_version"), 3.0);

    let reply: Value = nextstate::net::http_client(Some(Duration::from_secs(60))).unwrap()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0.0}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let generated = reply["usage"]["completion_tokens"].as_f64().expect("usage");
    assert!(generated >= 1.0, "{reply}");
    let after = scrape(&format!("{base}/metrics"), &mut server, Duration::from_secs(10)).await;

    let ok = "nextstate_server_requests_total{route=\"chat_completions\",status=\"200\"}";
    for series in [ok, "nextstate_server_request_duration_seconds_count", "nextstate_server_time_to_first_token_seconds_count"] {
        assert_eq!(value(&after, series) - value(&before, series), 1.0, "{series}");
    }
    let tokens = "nextstate_server_generated_tokens_total";
    assert_eq!(value(&after, tokens) - value(&before, tokens), generated);
    // The first scrape is counted under its own route.
    assert!(value(&after, "nextstate_server_requests_total{route=\"metrics\",status=\"200\"}") >= 1.0, "{after}");
    server.term();
    assert!(server.wait_for(Duration::from_secs(30)).is_some(), "serve did not stop on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_exposes_the_spec_and_counts_records_in_and_lake_rows() {
    let fixture = common::root().join("tests/fixtures/agent-logs/synthetic__openai-chat.jsonl");
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let lake_s = lake.to_str().unwrap();
    // Interactions into a fresh lake (embedded bus: the lake is what outlives the process).
    let (ok, out, err) = common::run_bin(&["ingest", "--lake", lake_s, fixture.to_str().unwrap()]);
    assert!(ok, "ingest failed: {err}");
    let fed: f64 = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("interactions="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no interactions= in {out}"));
    assert!(fed > 0.0, "{out}");

    // The signals stage and the sinks, long-running (no --until-idle): everything pending in the lake
    // is re-published and paired.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let args = common::args(&[
        "run", "--pipeline", "pipelines/combined.toml", "--only", "signals,sinks", "--lake", lake_s,
        "--checkpoints", dir.path().join("ckpt").to_str().unwrap(), "--metrics-addr", &format!("127.0.0.1:{port}"),
    ]);
    let mut run = common::Proc::spawn("run", &args, &dir.path().join("run.log"));
    let first = scrape(&url, &mut run, Duration::from_secs(60)).await;
    let (global, _) = spec();
    assert_same(&families(&first), &global, "nextstate run --metrics-addr");

    let records_in = "nextstate_records_in_total{stage=\"signals\",";
    let sink_rows = "nextstate_sink_rows_total{table=\"signals\"}";
    let deadline = Instant::now() + Duration::from_secs(180);
    let text = loop {
        let text = scrape(&url, &mut run, Duration::from_secs(10)).await;
        let (ok, out, _) = common::run_bin(&["sql", "--format", "csv", "--lake", lake_s, "SELECT count(*) AS n FROM signals"]);
        let lake_rows: f64 = if ok { out.lines().nth(1).and_then(|n| n.trim().parse().ok()).unwrap_or(0.0) } else { 0.0 };
        let out_rows = sum(&text, "nextstate_records_out_total{stage=\"signals\",table=\"signals\"}");
        if sum(&text, records_in) == fed && lake_rows > 0.0 && value(&text, sink_rows) == lake_rows && out_rows == lake_rows {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "records_in {} of {fed}, signals emitted {out_rows}, sink rows {} vs lake {lake_rows}:\n{text}\n{}",
            sum(&text, records_in),
            value(&text, sink_rows),
            run.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(value(&text, "nextstate_sink_files_total{table=\"signals\"}") >= 1.0, "{text}");
    assert!(value(&text, "nextstate_sink_bytes_total{table=\"signals\"}") > 0.0, "{text}");
    // Lag per topic and partition of the stage's input, caught up.
    let lag: Vec<(String, f64)> = samples(&text).into_iter().filter(|(s, _)| s.starts_with("nextstate_consumer_lag{stage=\"signals\",")).collect();
    assert!(!lag.is_empty() && lag.iter().all(|(s, v)| s.contains("partition=\"") && *v == 0.0), "{lag:?}");
    run.term();
    assert!(run.wait_for(Duration::from_secs(60)).is_some(), "run did not stop on SIGTERM:\n{}", run.log_tail(20));
}

/// The capture proxy's `/metrics`: its own families, then the process-wide ones, one `# EOF`. Before
/// any traffic its labelled families have no series and are left out by prometheus-client, so the check
/// is: every process-wide family, and nothing the spec does not list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_exposes_the_process_wide_families_and_only_listed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let spool = dir.path().join("spool");
    let args = common::args(&["proxy", "--upstream", "http://127.0.0.1:9", "--port", &port.to_string(), "--spool-dir", spool.to_str().unwrap(), "--lake", dir.path().join("lake").to_str().unwrap()]);
    let mut proxy = common::Proc::spawn("proxy", &args, &dir.path().join("proxy.log"));
    let text = scrape(&format!("http://127.0.0.1:{port}/metrics"), &mut proxy, Duration::from_secs(60)).await;
    let exposed = families(&text);
    let (global, listed_proxy) = spec();
    let listed: BTreeSet<String> = global.union(&listed_proxy).cloned().collect();
    assert!(global.is_subset(&exposed), "missing: {:?}", global.difference(&exposed).collect::<Vec<_>>());
    assert!(exposed.is_subset(&listed), "not in docs/metrics.md: {:?}", exposed.difference(&listed).collect::<Vec<_>>());
    assert!(exposed.contains("nextstate_proxy_kafka_up") && exposed.contains("nextstate_proxy_request_duration_seconds"), "{text}");
    proxy.term();
    assert!(proxy.wait_for(Duration::from_secs(30)).is_some(), "proxy did not stop on SIGTERM:\n{}", proxy.log_tail(20));
}
