//! A judge endpoint (OpenAI-compatible, on loopback) that answers in turn: a 500 error, a hang past
//! the request timeout, garbage (not JSON), a completion without `\boxed{}`, a vote. The judge stage
//! (`nextstate run --only judge`) must finish in bounded time, judge every turn exactly once with the
//! failed votes recorded as invalid, and lose nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use nextstate::lake::Lake;
use nextstate::schema::Judgment;

use super::{base_args, check, common, create_topics, data, pipeline_roles, serial, setting};

/// Requests seen per behaviour: error, hang, garbage, unboxed, vote.
#[derive(Default)]
struct Flaky {
    n: AtomicU64,
    seen: [AtomicU64; 5],
}

async fn chat(State(f): State<Arc<Flaky>>) -> Response {
    let k = (f.n.fetch_add(1, Ordering::SeqCst) % 5) as usize;
    f.seen[k].fetch_add(1, Ordering::SeqCst);
    let completion = |text: &str| {
        axum::Json(serde_json::json!({"id": "j", "object": "chat.completion", "model": "flaky",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}))
        .into_response()
    };
    match k {
        0 => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, r#"{"error":{"message":"judge overloaded"}}"#).into_response(),
        1 => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            completion("too late \\boxed{1}")
        }
        2 => ([("content-type", "application/json")], "<html>502 Bad Gateway</html>").into_response(),
        3 => completion("The user seems happy, I think."),
        _ => completion("The user moved on. \\boxed{1}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_endpoint_errors_hangs_and_garbage_lose_nothing() {
    let _serial = serial();
    let t0 = Instant::now();
    let flaky = Arc::new(Flaky::default());
    let app = Router::new().route("/v1/chat/completions", post(chat)).with_state(flaky.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });

    let brokers = common::brokers();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let pipeline = dir.path().join("p.toml");
    std::fs::write(
        &pipeline,
        format!(
            "name = \"flaky\"\nmethod = \"binary\"\n[bus]\npartitions = 2\nmax_poll_interval_ms = 10000\n[sink]\nroll_ms = 300\n\
             [judge]\nbackend = \"openai\"\nurl = \"{url}\"\nmodel = \"flaky-judge\"\nm = 3\ntimeout_s = 1.0\nretries = 1\nbackoff_base_ms = 50\nconcurrency = 8\n"
        ),
    )
    .unwrap();
    let files = data::write_inputs(dir.path(), setting("NEXTSTATE_CHAOS_SESSIONS", 12) / 2, false);
    let expected = data::expected(&files);
    create_topics(&brokers, &prefix, 2).await;
    let base = base_args(&pipeline, &brokers, &prefix, &lake);
    let mut sup = pipeline_roles(dir.path(), &base, &files, &["signals", "judge", "sinks"]);
    sup.run_until_idle("ingest", Duration::from_secs(60));
    sup.run_until_idle("signals", Duration::from_secs(60));
    let t = Instant::now();
    sup.run_until_idle("judge", Duration::from_secs(150));
    let judge_s = t.elapsed().as_secs_f64();
    sup.run_until_idle("sinks", Duration::from_secs(60));

    let c = check::check(&lake, "flaky", &expected, false, None);
    let judgments: Vec<Judgment> = Lake::open(&lake).unwrap().read_table().unwrap();
    let votes: Vec<&nextstate::schema::Vote> = judgments.iter().flat_map(|j| j.votes.iter()).collect();
    assert_eq!(votes.len(), 3 * judgments.len(), "m = 3 votes per judgment, failed ones included");
    let valid = votes.iter().filter(|v| v.value.is_some()).count();
    let invalid: Vec<&str> = votes.iter().filter_map(|v| v.error.as_deref()).collect();
    assert_eq!(valid + invalid.len(), votes.len(), "a vote is valid or has an error");
    assert!(valid > 0 && !invalid.is_empty(), "valid {valid}, invalid {}", invalid.len());
    for j in &judgments {
        assert_eq!(j.valid_votes as usize, j.votes.iter().filter(|v| v.value.is_some()).count());
        assert!(j.score == 0 || j.score == 1, "score {} from votes of +1 only", j.score);
    }
    let seen: Vec<u64> = flaky.seen.iter().map(|a| a.load(Ordering::SeqCst)).collect();
    assert!(seen.iter().all(|&n| n > 0), "every behaviour was exercised: {seen:?}");
    eprintln!(
        "[chaos] PASS in {:.0} s: judge stage {judge_s:.1} s; endpoint requests error/hang/garbage/unboxed/vote = {seen:?}; {} votes ({valid} valid, {} invalid); {} records checked ({:?})",
        t0.elapsed().as_secs_f64(),
        votes.len(),
        invalid.len(),
        c.total(),
        c.rows
    );
}
