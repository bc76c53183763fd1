//! The network judge backends against a local axum server on 127.0.0.1:0 that returns canned OpenAI
//! and SGLang answers, 5xx, garbage, or hangs: votes, invalid votes, retries and backoff, timeouts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use nextstate::hint::{hint_turn, HintConfig, Hinter};
use nextstate::judge::{judge_turn, BackendKind, Judge, JudgeConfig, TurnContext};
use nextstate::schema::{Message, NextStateKind};
use serde_json::{json, Value};

/// What the server answers to call n (the last entry repeats).
#[derive(Clone)]
enum Reply {
    Json(Value),
    Status(u16, &'static str),
    Raw(&'static str),
    Hang,
}

#[derive(Default)]
struct Srv {
    script: Vec<Reply>,
    calls: AtomicU32,
    call_times: Mutex<Vec<Instant>>,
    bodies: Mutex<Vec<Value>>,
    auth: Mutex<Vec<Option<String>>>,
}

async fn handle(State(s): State<Arc<Srv>>, headers: HeaderMap, body: String) -> Response {
    let n = s.calls.fetch_add(1, Ordering::SeqCst) as usize;
    s.call_times.lock().unwrap().push(Instant::now());
    s.bodies.lock().unwrap().push(serde_json::from_str(&body).unwrap_or(Value::Null));
    s.auth.lock().unwrap().push(headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string));
    match s.script[n.min(s.script.len() - 1)].clone() {
        Reply::Json(v) => axum::Json(v).into_response(),
        Reply::Status(code, body) => (StatusCode::from_u16(code).unwrap(), body).into_response(),
        Reply::Raw(body) => (StatusCode::OK, body).into_response(),
        Reply::Hang => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            (StatusCode::OK, "late").into_response()
        }
    }
}

/// Starts a server answering `path` with `script`; returns its base URL and state.
async fn serve(path: &str, script: Vec<Reply>) -> (String, Arc<Srv>) {
    let state = Arc::new(Srv { script, ..Srv::default() });
    let app = Router::new().route(path, post(handle)).with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), state)
}

fn openai_answer(text: &str) -> Reply {
    Reply::Json(json!({
        "id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
    }))
}

fn turn() -> TurnContext {
    TurnContext {
        interaction_id: "i1".into(),
        session_id: "s1".into(),
        tenant: None,
        turn_index: 1,
        policy_version: Some(2),
        event_time: 1_700_000_000_000,
        request: vec![Message::text("system", "sys"), Message::text("user", "Convert 3 miles to km.")],
        response: Message::text("assistant", "3 miles is 4.83 km."),
        next_state: vec![Message::text("user", "Thanks! Now 10 miles please.")],
        next_state_kind: NextStateKind::User,
        next_state_text: "Thanks! Now 10 miles please.".into(),
        has_error: false,
        exit_code: None,
        correction_cue: false,
        thanks_cue: true,
        success_cue: false,
    }
}

fn cfg(backend: BackendKind, url: &str) -> JudgeConfig {
    JudgeConfig {
        backend,
        url: Some(url.to_string()),
        model: Some("judge-model".into()),
        m: 3,
        timeout_s: 5.0,
        retries: 3,
        backoff_base_ms: 20,
        ..JudgeConfig::default()
    }
}

#[tokio::test]
async fn openai_votes_with_bearer_key() {
    let (url, srv) = serve(
        "/v1/chat/completions",
        vec![openai_answer("The user thanked. \\boxed{1}"), openai_answer("\\boxed{0}"), openai_answer("\\boxed{1}")],
    )
    .await;
    std::env::set_var("NEXTSTATE_TEST_JUDGE_KEY", "sk-test-123");
    let c = JudgeConfig { api_key_env: Some("NEXTSTATE_TEST_JUDGE_KEY".into()), concurrency: 1, ..cfg(BackendKind::Openai, &url) };
    let judge = Judge::new(c).unwrap();
    assert!(!format!("{judge:?}").contains("sk-test-123"), "the key never shows in Debug output");
    let j = judge_turn(&judge, "p", &turn()).await;
    // concurrency 1: the calls are made one at a time, in vote order.
    assert_eq!(j.votes.iter().map(|v| v.value).collect::<Vec<_>>(), [Some(1), Some(0), Some(1)]);
    assert_eq!((j.score, j.valid_votes, j.tie), (1, 3, false));
    assert_eq!((j.judge_backend.as_str(), j.judge_model.as_str()), ("openai", "judge-model"));
    assert_eq!(srv.calls.load(Ordering::SeqCst), 3);
    assert!(srv.auth.lock().unwrap().iter().all(|a| a.as_deref() == Some("Bearer sk-test-123")));
    let body = srv.bodies.lock().unwrap()[0].clone();
    assert_eq!(body["model"], "judge-model");
    assert_eq!(body["max_tokens"], 4096);
    assert!((body["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
    assert_eq!(body["messages"].as_array().unwrap().len(), 2);
    assert_eq!(body["messages"][0]["role"], "system");
    let user = body["messages"][1]["content"].as_str().unwrap();
    assert!(user.contains("[user]\nConvert 3 miles to km."), "{user}");
    assert!(user.contains("(the user's reply)\nThanks! Now 10 miles please."), "{user}");

    // Same data again: all from the cache, no new request.
    let again = judge_turn(&judge, "p", &turn()).await;
    assert_eq!(again.cache_hits, 3);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn sglang_generate_with_role_tagged_prompt() {
    let (url, srv) = serve("/generate", vec![Reply::Json(json!({"text": "Wrong unit. \\boxed{-1}", "meta_info": {"id": "a"}}))]).await;
    let judge = Judge::new(cfg(BackendKind::Sglang, &url)).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    assert_eq!((j.score, j.valid_votes), (-1, 3));
    assert_eq!(j.judge_backend, "sglang");
    let body = srv.bodies.lock().unwrap()[0].clone();
    let text = body["text"].as_str().unwrap();
    assert!(text.starts_with("<|system|>\nYou grade a single step"), "{text}");
    assert!(text.contains("\n<|user|>\n### The user's request"), "{text}");
    assert!(text.ends_with("\\boxed{-1}.\n<|assistant|>\n"), "{text}");
    assert_eq!(body["sampling_params"]["max_new_tokens"], 4096);
    assert!((body["sampling_params"]["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
    assert_eq!(srv.auth.lock().unwrap()[0], None);

    // A batch-style answer (an array) is read too.
    let (url, _) = serve("/generate", vec![Reply::Json(json!([{"text": "\\boxed{1}"}]))]).await;
    let j = judge_turn(&Judge::new(JudgeConfig { m: 1, ..cfg(BackendKind::Sglang, &url) }).unwrap(), "p", &turn()).await;
    assert_eq!(j.votes[0].value, Some(1));
}

#[tokio::test]
async fn server_errors_are_retried_with_exponential_backoff() {
    let (url, srv) = serve(
        "/v1/chat/completions",
        vec![Reply::Status(500, "boom"), Reply::Status(503, "busy"), Reply::Status(429, "slow down"), openai_answer("\\boxed{1}")],
    )
    .await;
    let judge = Judge::new(JudgeConfig { m: 1, backoff_base_ms: 40, ..cfg(BackendKind::Openai, &url) }).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    assert_eq!(j.votes[0].value, Some(1));
    assert_eq!(srv.calls.load(Ordering::SeqCst), 4);
    let s = judge.stats();
    assert_eq!((s.requests, s.retries, s.failed_votes), (4, 3, 0));
    // Gaps between calls follow the backoff: about 40, 80, 160 ms.
    let times = srv.call_times.lock().unwrap().clone();
    let gaps: Vec<u128> = times.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
    for (gap, want) in gaps.iter().zip([40u128, 80, 160]) {
        assert!(*gap >= want && *gap < want + 1000, "gaps {gaps:?}");
    }
    assert!(gaps[2] > gaps[0], "gaps {gaps:?}");
}

#[tokio::test]
async fn persistent_errors_become_invalid_votes() {
    let (url, srv) = serve("/v1/chat/completions", vec![Reply::Status(500, "internal error")]).await;
    let judge = Judge::new(JudgeConfig { m: 2, retries: 2, backoff_base_ms: 5, ..cfg(BackendKind::Openai, &url) }).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    assert_eq!((j.score, j.valid_votes, j.tie), (0, 0, false));
    assert_eq!(j.votes[0].error.as_deref(), Some("request failed after 3 attempt(s): HTTP status 500: internal error"));
    assert_eq!(srv.calls.load(Ordering::SeqCst), 6);
    assert_eq!(judge.stats().failed_votes, 2);
    assert!(judge.cache().is_empty(), "failures are not cached");

    // A 4xx is not retried.
    let (url, srv) = serve("/v1/chat/completions", vec![Reply::Status(400, "bad request")]).await;
    let judge = Judge::new(JudgeConfig { m: 1, ..cfg(BackendKind::Openai, &url) }).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    assert_eq!(j.votes[0].error.as_deref(), Some("request failed after 1 attempt(s): HTTP status 400: bad request"));
    assert_eq!(srv.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn garbage_answers_are_invalid_votes_without_retry() {
    let (url, srv) = serve(
        "/v1/chat/completions",
        vec![Reply::Raw("<html>oops</html>"), Reply::Json(json!({"choices": []})), openai_answer("I am not sure.")],
    )
    .await;
    let judge = Judge::new(JudgeConfig { concurrency: 1, ..cfg(BackendKind::Openai, &url) }).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    assert_eq!(srv.calls.load(Ordering::SeqCst), 3);
    let errs: Vec<String> = j.votes.iter().map(|v| v.error.clone().unwrap()).collect();
    assert!(errs[0].starts_with("request failed after 1 attempt(s): unreadable response: not JSON"), "{errs:?}");
    assert_eq!(errs[1], "request failed after 1 attempt(s): unreadable response: no choices[0].message.content text: {\"choices\":[]}");
    assert_eq!(errs[2], "no \\boxed{d} with a single signed digit in the judge's answer");
    assert_eq!(j.votes[2].raw, "I am not sure.");
    assert_eq!((j.score, j.valid_votes), (0, 0));
}

#[tokio::test]
async fn a_hanging_server_times_out_in_bounded_time() {
    let (url, srv) = serve("/generate", vec![Reply::Hang]).await;
    let judge = Judge::new(JudgeConfig { m: 3, timeout_s: 0.3, retries: 1, backoff_base_ms: 10, ..cfg(BackendKind::Sglang, &url) }).unwrap();
    let start = Instant::now();
    let j = judge_turn(&judge, "p", &turn()).await;
    let elapsed = start.elapsed();
    // Three votes in parallel, two attempts of 0.3 s each plus a 10 ms backoff.
    assert!(elapsed >= Duration::from_millis(600) && elapsed < Duration::from_secs(3), "{elapsed:?}");
    assert_eq!((j.score, j.valid_votes), (0, 0));
    assert!(j.votes.iter().all(|v| v.error.as_deref() == Some("request failed after 2 attempt(s): timeout after 0.3 s")), "{:?}", j.votes);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 6);
    let s = judge.stats();
    assert_eq!((s.requests, s.timeouts, s.retries, s.failed_votes), (6, 6, 3, 3));
}

#[tokio::test]
async fn connection_refused_is_retried_then_invalid() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let judge = Judge::new(JudgeConfig { m: 1, retries: 2, backoff_base_ms: 5, ..cfg(BackendKind::Openai, &url) }).unwrap();
    let j = judge_turn(&judge, "p", &turn()).await;
    let e = j.votes[0].error.clone().unwrap();
    assert!(e.starts_with("request failed after 3 attempt(s): transport error"), "{e}");
    assert_eq!(judge.stats().requests, 3);
}

#[tokio::test]
async fn hint_votes_over_openai() {
    let (url, srv) = serve(
        "/v1/chat/completions",
        vec![
            openai_answer("\\boxed{1}\n[HINT_START]Give the answer to two decimals and show the factor 1.609.[HINT_END]"),
            openai_answer("\\boxed{-1}"),
            openai_answer("\\boxed{1} [HINT_START]Show the factor.[HINT_END]"),
        ],
    )
    .await;
    let c = HintConfig {
        backend: BackendKind::Openai,
        url: Some(url),
        model: Some("hint-model".into()),
        concurrency: 1,
        backoff_base_ms: 5,
        ..HintConfig::default()
    };
    let hinter = Hinter::new(c).unwrap();
    let rec = hint_turn(&hinter, "p", &turn()).await;
    assert_eq!(rec.chosen_hint.as_deref(), Some("Give the answer to two decimals and show the factor 1.609."));
    assert_eq!(rec.reason, "3 valid votes, 2 accepted, chose vote 0 (longest, 58 chars)");
    let teacher: Vec<Message> = serde_json::from_str(rec.teacher_messages.as_deref().unwrap()).unwrap();
    assert_eq!(
        teacher[1].content,
        "Convert 3 miles to km.\n\n[user's hint / instruction]\nGive the answer to two decimals and show the factor 1.609."
    );
    let user = srv.bodies.lock().unwrap()[0]["messages"][1]["content"].as_str().unwrap().to_string();
    assert!(user.contains("[HINT_START] and [HINT_END]"), "{user}");
}

/// The judge's and hint judge's start-up probe (`VotingStage::probe`): one request before the stage
/// reads input; a wrong key, path, backend kind or model stops it with the setting to check, while a
/// good endpoint, any answer text and a server not up yet pass.
#[tokio::test]
async fn the_start_up_probe_names_the_setting_of_a_wrong_endpoint() {
    let probe = |c: JudgeConfig| async move { Judge::new(c).unwrap().probe().await.map_err(|e| e.to_string()) };
    let (url, srv) = serve("/v1/chat/completions", vec![openai_answer("no box at all")]).await;
    probe(cfg(BackendKind::Openai, &url)).await.unwrap();
    assert_eq!(srv.calls.load(Ordering::SeqCst), 1, "one request");
    let (url, _) = serve("/v1/chat/completions", vec![Reply::Status(401, "invalid api key")]).await;
    let e = probe(cfg(BackendKind::Openai, &url)).await.unwrap_err();
    assert!(e.contains("[judge] start-up probe") && e.contains("[judge] api_key_env"), "{e}");
    // The wrong backend kind: sglang against an OpenAI-only server.
    let (url, _) = serve("/v1/chat/completions", vec![openai_answer("\\boxed{1}")]).await;
    let e = probe(cfg(BackendKind::Sglang, &url)).await.unwrap_err();
    assert!(e.contains("404") && e.contains("[judge] url") && e.contains("[judge] backend = \"sglang\""), "{e}");
    let (url, _) = serve("/v1/chat/completions", vec![Reply::Status(400, "The model `judge-model` does not exist.")]).await;
    let e = probe(cfg(BackendKind::Openai, &url)).await.unwrap_err();
    assert!(e.contains("[judge] model = \"judge-model\""), "{e}");
    let (url, srv) = serve("/v1/chat/completions", vec![Reply::Raw("<html>502 Bad Gateway</html>")]).await;
    let e = probe(cfg(BackendKind::Openai, &url)).await.unwrap_err();
    assert!(e.contains("not the openai API"), "{e}");
    assert_eq!(srv.calls.load(Ordering::SeqCst), 3, "PROBE_TRIES requests before calling it wrong");
    // A flaky gateway (an error page, then an answer) is not wrong.
    let (url, _) = serve("/v1/chat/completions", vec![Reply::Raw("<html>502 Bad Gateway</html>"), openai_answer("ok")]).await;
    probe(cfg(BackendKind::Openai, &url)).await.unwrap();
    // Not up yet: logged, not fatal (each vote retries on its own).
    probe(JudgeConfig { retries: 0, ..cfg(BackendKind::Openai, "http://127.0.0.1:9") }).await.unwrap();
    // The rule backend needs no probe; the hint judge probes the same way.
    Judge::new(JudgeConfig::default()).unwrap().probe().await.unwrap();
    let (url, _) = serve("/v1/chat/completions", vec![Reply::Status(404, "not found")]).await;
    let hint = HintConfig { backend: BackendKind::Openai, url: Some(url), model: Some("h".into()), retries: 0, ..HintConfig::default() };
    let e = Hinter::new(hint).unwrap().probe().await.unwrap_err().to_string();
    assert!(e.contains("[hint] start-up probe") && e.contains("[hint] url"), "{e}");
}
