//! Hostile requests to the capture proxy over real HTTP (the proxy in-process on the embedded bus, in
//! front of a fake upstream that can also answer badly). Client-side garbage gets a 4xx with
//! `error.code` naming the reason and never reaches the upstream; a bad upstream answer reaches the
//! client unchanged and becomes a dead letter with a reason; good requests around them are captured
//! exactly once; every request finishes within a bound.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use nextstate::bus::{Bus, BusConfig, Envelope};
use nextstate::runtime::InputLoop;
use nextstate::schema::{DeadLetter, Interaction};
use nextstate::serve::proxy::emit::SpoolConfig;
use nextstate::serve::proxy::{Proxy, ProxyOptions, ProxyStats};
use serde_json::{json, Value};

/// Requests the fake upstream received (their `messages[last].content`).
#[derive(Default)]
struct Upstream {
    seen: Mutex<Vec<String>>,
}

fn last_content(body: &Value) -> String {
    body["messages"].as_array().and_then(|m| m.last()).and_then(|m| m["content"].as_str()).unwrap_or("").to_string()
}

fn sse(chunks: &[String]) -> Response {
    let body: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    Response::builder().header("content-type", "text/event-stream").body(Body::from(body)).unwrap()
}

fn chunk(delta: Value, finish: Value, lp: &str) -> String {
    format!(r#"{{"id":"c","object":"chat.completion.chunk","model":"fake","choices":[{{"index":0,"delta":{delta},"finish_reason":{finish},"token_ids":[7],"logprobs":{{"content":[{{"token":"t","logprob":{lp}}}]}}}}]}}"#)
}

/// The fake upstream: the model name picks the answer.
/// - `ok`, `slow` (after 400 ms): `echo: <content>` with ids `[100, 101]` and log-probs;
/// - `nan`, `inf`: the same with a bare `NaN` / `-Infinity` log-prob (not JSON);
/// - `mismatch`: 3 token ids, 2 log-probs;
/// - `no-choices`: `{"choices": []}`;
/// - `nan-stream`: an SSE stream whose second chunk has a `NaN` log-prob;
/// - `cut-stream`: an SSE stream that ends without a finish reason.
async fn fake(State(u): State<Arc<Upstream>>, body: Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "fake: the proxy forwarded a body that is not JSON").into_response();
    };
    let content = last_content(&v);
    u.seen.lock().unwrap().push(content.clone());
    let text = format!("echo: {content}");
    let reply = |ids: &str, lps: &str| {
        let lp: Vec<String> = lps.split(',').map(|x| format!(r#"{{"token":"t","logprob":{x}}}"#)).collect();
        format!(
            r#"{{"id":"x","object":"chat.completion","model":"fake","choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"finish_reason":"stop","token_ids":{ids},"logprobs":{{"content":[{}]}}}}],"prompt_token_ids":[1,2]}}"#,
            Value::String(text.clone()),
            lp.join(",")
        )
    };
    let json_reply = |s: String| ([("content-type", "application/json")], s).into_response();
    match v["model"].as_str().unwrap_or("") {
        "ok" => json_reply(reply("[100,101]", "-0.5,-0.25")),
        "slow" => {
            tokio::time::sleep(Duration::from_millis(400)).await;
            json_reply(reply("[100,101]", "-0.5,-0.25"))
        }
        "nan" => json_reply(reply("[100,101]", "NaN,-0.25")),
        "inf" => json_reply(reply("[100,101]", "-Infinity,-0.25")),
        "mismatch" => json_reply(reply("[100,101,102]", "-0.5,-0.25")),
        "no-choices" => json_reply(r#"{"id":"x","object":"chat.completion","choices":[]}"#.to_string()),
        "nan-stream" => sse(&[chunk(json!({"role": "assistant", "content": "echo:"}), Value::Null, "-0.5"), chunk(json!({"content": " lost"}), Value::Null, "NaN"), chunk(json!({}), json!("stop"), "-0.1"), "[DONE]".into()]),
        "cut-stream" => sse(&[chunk(json!({"role": "assistant", "content": "echo:"}), Value::Null, "-0.5"), chunk(json!({"content": " half"}), Value::Null, "-0.25")]),
        other => (StatusCode::NOT_FOUND, format!("fake: no model {other:?}")).into_response(),
    }
}

struct Running {
    url: String,
    proxy_stats: Box<dyn Fn() -> ProxyStats + Send>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<nextstate::Result<ProxyStats>>,
}

async fn start(bus: &Bus, spool: &std::path::Path, max_body_bytes: usize) -> (Running, Arc<Upstream>) {
    let u = Arc::new(Upstream::default());
    let app = Router::new().route("/v1/chat/completions", post(fake)).with_state(u.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    let mut o = ProxyOptions::new(up);
    o.spool = SpoolConfig::new(spool, 64 << 20);
    o.max_body_bytes = max_body_bytes;
    o.upstream_idle_timeout = Duration::from_secs(10);
    let proxy = Proxy::start(o, bus).await.unwrap();
    let metrics = proxy.metrics();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/chat/completions", l.local_addr().unwrap());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(proxy.serve(l, async {
        let _ = rx.await;
    }));
    (Running { url, proxy_stats: Box::new(move || ProxyStats::of(&metrics)), stop, task }, u)
}

/// Reads every record of `topic` until `n` arrived or `limit` passed, then waits `extra` for more.
async fn drain<T: serde::de::DeserializeOwned>(input: &mut InputLoop, n: usize, limit: Duration, extra: Duration) -> Vec<T> {
    let deadline = Instant::now() + limit;
    let mut out = vec![];
    while out.len() < n && Instant::now() < deadline {
        for m in input.next_batch(100, Duration::from_millis(300)).await.unwrap() {
            out.push(serde_json::from_slice::<Envelope<T>>(&m.payload).unwrap().row);
        }
    }
    for m in input.next_batch(100, extra).await.unwrap() {
        out.push(serde_json::from_slice::<Envelope<T>>(&m.payload).unwrap().row);
    }
    out
}

fn good(model: &str, session: &str, user: &str) -> (Vec<(&'static str, String)>, Vec<u8>) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": user}]});
    (vec![("x-session-id", session.to_string())], serde_json::to_vec(&body).unwrap())
}

/// One hostile request: what to send, and the status and `error.code` it must get.
struct Hostile {
    name: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn hostile_requests() -> Vec<Hostile> {
    let h = |name, body: Vec<u8>, code| Hostile { name, headers: vec![], body, status: 400, code };
    let full = br#"{"model": "ok", "messages": [{"role": "user", "content": "hello"}]}"#;
    let deep = format!(r#"{{"model": "ok", "messages": [{{"role": "user", "content": {}{}}}]}}"#, "[".repeat(100_000), "]".repeat(100_000));
    vec![
        h("truncated JSON", full[..full.len() / 2].to_vec(), "malformed_json"),
        h("empty body", vec![], "malformed_json"),
        h("body is an array", b"[1, 2, 3]".to_vec(), "wrong_type"),
        h("messages not an array", br#"{"model": "ok", "messages": "hello"}"#.to_vec(), "missing_messages"),
        h("no messages", br#"{"model": "ok", "prompt": "hello"}"#.to_vec(), "missing_messages"),
        h("content is a number", br#"{"model": "ok", "messages": [{"role": "user", "content": 5}]}"#.to_vec(), "wrong_type"),
        h("message is a string", br#"{"model": "ok", "messages": ["hello"]}"#.to_vec(), "wrong_type"),
        h("no role", br#"{"model": "ok", "messages": [{"content": "hello"}]}"#.to_vec(), "missing_role"),
        h("unknown role", br#"{"model": "ok", "messages": [{"role": "wizard", "content": "abracadabra"}]}"#.to_vec(), "unknown_role"),
        h("deep nesting", deep.into_bytes(), "malformed_json"),
        h("invalid UTF-8", b"{\"model\": \"ok\", \"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9 \xff\"}]}".to_vec(), "malformed_json"),
        h("NaN in the request", br#"{"model": "ok", "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}"#.to_vec(), "malformed_json"),
        h("session id is an object", br#"{"model": "ok", "session_id": {"a": 1}, "messages": [{"role": "user", "content": "x"}]}"#.to_vec(), "invalid_turn_metadata"),
        Hostile { name: "bad turn index", headers: vec![("x-turn-index", "-3".into())], body: full.to_vec(), status: 400, code: "invalid_turn_metadata" },
    ]
}

/// Every client-side hostile request gets its 4xx and reason code without reaching the upstream;
/// bad upstream answers reach the client and become dead letters; duplicate turns are refused (409)
/// or, when in flight at once, dead-lettered; the good requests between them are captured once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_refuses_hostile_requests_and_dead_letters_bad_upstream_answers() {
    tokio::time::timeout(Duration::from_secs(120), scenario()).await.expect("the whole scenario finishes within 120 s");
}

async fn scenario() {
    let bus = Bus::connect(BusConfig::default()).await.unwrap();
    let group = format!("t-{}", uuid::Uuid::new_v4().simple());
    let mut interactions = InputLoop::new(&bus, &format!("{group}-i"), &bus.topic("interactions")).unwrap();
    let mut dead_letters = InputLoop::new(&bus, &format!("{group}-d"), &bus.topic("dead_letters")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (p, upstream) = start(&bus, dir.path(), 1 << 20).await;
    // No pooled connections: the proxy may close a connection after refusing an over-size body while
    // the client is still sending it, and a request reusing that connection would then fail with
    // IncompleteMessage (seen once under load); each request gets its own connection instead.
    let c = nextstate::net::client_builder().unwrap().timeout(Duration::from_secs(15)).pool_max_idle_per_host(0).build().unwrap();
    let send = |headers: Vec<(&'static str, String)>, body: Vec<u8>| {
        let mut rb = c.post(&p.url).header("content-type", "application/json").body(body);
        for (k, v) in headers {
            rb = rb.header(k, v);
        }
        rb.send()
    };

    // Client-side garbage, each between two good requests.
    let mut good_sessions = vec![];
    let mut turn = 0;
    let mut next_good = |good_sessions: &mut Vec<String>| {
        turn += 1;
        let s = format!("good-{turn}");
        good_sessions.push(s.clone());
        good("ok", &s, &format!("question {turn}"))
    };
    let (hd, b) = next_good(&mut good_sessions);
    assert_eq!(send(hd, b).await.unwrap().status(), 200);
    let cases = hostile_requests();
    let tried = cases.len();
    for case in cases {
        let t0 = Instant::now();
        let r = send(case.headers, case.body).await.unwrap_or_else(|e| panic!("{}: no answer: {e}", case.name));
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or_else(|e| panic!("{}: the error is not JSON: {e}", case.name));
        assert_eq!((status, v["error"]["code"].as_str()), (case.status, Some(case.code)), "{}: {v}", case.name);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{}", case.name);
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.len() >= 10), "{}: unclear message {v}", case.name);
        assert!(t0.elapsed() < Duration::from_secs(5), "{}: took {:?}", case.name, t0.elapsed());
        let (hd, b) = next_good(&mut good_sessions);
        assert_eq!(send(hd, b).await.unwrap().status(), 200, "the good request after {:?}", case.name);
    }

    // Over the body limit (1 MiB): with a length, and streamed without one (chunked).
    let huge = serde_json::to_vec(&json!({"model": "ok", "messages": [{"role": "user", "content": "x".repeat(2 << 20)}]})).unwrap();
    let r = send(vec![], huge.clone()).await.unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "invalid_request_error");
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> = huge.chunks(64 << 10).map(|c| Ok(c.to_vec())).collect();
    let r = c.post(&p.url).header("content-type", "application/json").body(reqwest::Body::wrap_stream(futures::stream::iter(pieces))).send().await;
    // The proxy may answer 413 before reading the whole body, or close the connection while the
    // client is still sending; either way no turn, no hang.
    if let Ok(r) = r {
        assert_eq!(r.status(), 413);
    }
    let (hd, b) = next_good(&mut good_sessions);
    assert_eq!(send(hd, b).await.unwrap().status(), 200);

    // Duplicate turns: the same explicit session and turn index again → 409 before the upstream.
    let dup = |model: &str, text: &str| {
        let mut r = good(model, "dup", text);
        r.0.push(("x-turn-index", "0".into()));
        r
    };
    let (hd, b) = dup("ok", "first");
    assert_eq!(send(hd, b).await.unwrap().status(), 200);
    let (hd, b) = dup("ok", "first, again");
    let r = send(hd, b).await.unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "duplicate_turn");
    // Two in flight at once with one index: both answered, one captured, one dead letter.
    let (h1, b1) = good("slow", "race", "one");
    let (h2, b2) = good("slow", "race", "two");
    let with_index = |mut h: Vec<(&'static str, String)>| {
        h.push(("x-turn-index", "5".into()));
        h
    };
    let (r1, r2) = tokio::join!(send(with_index(h1), b1), send(with_index(h2), b2));
    assert_eq!((r1.unwrap().status(), r2.unwrap().status()), (StatusCode::OK, StatusCode::OK));

    // Bad upstream answers: the client gets the upstream's bytes; the turn is a dead letter.
    for model in ["nan", "inf"] {
        let (hd, b) = good(model, &format!("up-{model}"), "numbers");
        let r = send(hd, b).await.unwrap();
        assert_eq!(r.status(), 200, "{model}");
        let text = r.text().await.unwrap();
        assert!(text.contains(if model == "nan" { "NaN" } else { "-Infinity" }), "{model}: passed through unchanged: {text}");
    }
    let (hd, b) = good("no-choices", "up-empty", "anything");
    assert_eq!(send(hd, b).await.unwrap().status(), 200);
    for model in ["nan-stream", "cut-stream"] {
        let (hd, mut b) = good(model, &format!("up-{model}"), "stream please");
        let mut v: Value = serde_json::from_slice(&b).unwrap();
        v["stream"] = json!(true);
        b = serde_json::to_vec(&v).unwrap();
        let r = send(hd, b).await.unwrap();
        assert_eq!(r.status(), 200, "{model}");
        let text = r.text().await.unwrap();
        if model == "nan-stream" {
            assert!(text.contains(r#""logprob":NaN"#) && text.contains("[DONE]"), "{model}: forwarded as received: {text}");
        }
    }
    // Mismatched token/log-prob lengths: kept, without the token data, with a note.
    let (hd, b) = good("mismatch", "up-mismatch", "count");
    assert_eq!(send(hd, b).await.unwrap().status(), 200);
    let (hd, b) = next_good(&mut good_sessions);
    assert_eq!(send(hd, b).await.unwrap().status(), 200);

    // What reached the upstream: the good requests, the duplicates' first, the race, the bad answers.
    let seen = upstream.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), good_sessions.len() + 1 + 2 + 6, "requests refused by the proxy never reach the upstream: {seen:?}");

    let rows: Vec<Interaction> = drain(&mut interactions, good_sessions.len() + 3, Duration::from_secs(30), Duration::from_millis(800)).await;
    let mut sessions: Vec<String> = rows.iter().map(|r| r.session_id.clone()).collect();
    sessions.sort();
    let mut want: Vec<String> = good_sessions.clone();
    want.extend(["dup".to_string(), "race".to_string(), "up-mismatch".to_string()]);
    want.sort();
    assert_eq!(sessions, want, "each good turn captured once");
    let mm = rows.iter().find(|r| r.session_id == "up-mismatch").unwrap();
    assert_eq!((mm.response_token_ids.as_ref(), mm.rollout_logprobs.as_ref(), mm.prompt_token_ids.as_ref()), (None, None, Some(&vec![1, 2])));
    assert_eq!(mm.notes, vec!["response token ids (3) and log-probs (2) differ in length; dropped both".to_string()]);
    let ok = rows.iter().find(|r| r.session_id == "good-1").unwrap();
    assert_eq!((ok.response_text.as_str(), ok.rollout_logprobs.as_ref()), ("echo: question 1", Some(&vec![-0.5, -0.25])));
    let race = rows.iter().find(|r| r.session_id == "race").unwrap();
    assert_eq!(race.turn_index, 5);

    let dead: Vec<DeadLetter> = drain(&mut dead_letters, 6, Duration::from_secs(30), Duration::from_millis(800)).await;
    let mut got: Vec<(String, String)> = dead.iter().map(|d| (d.session_id.clone(), d.reason_code.clone())).collect();
    got.sort();
    let want: Vec<(String, String)> = [
        ("race", "duplicate_turn"),
        ("up-cut-stream", "incomplete_stream"),
        ("up-empty", "bad_response"),
        ("up-inf", "malformed_json"),
        ("up-nan", "malformed_json"),
        ("up-nan-stream", "bad_response"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(got, want, "dead letters (session, reason code)");
    for d in &dead {
        assert_eq!(d.stage, "proxy");
        assert!(d.reason.len() >= 20, "unclear reason {:?}", d.reason);
        eprintln!("dead letter {} {}: {}", d.session_id, d.reason_code, d.reason);
    }
    let reason = |s: &str| dead.iter().find(|d| d.session_id == s).unwrap().reason.clone();
    assert!(reason("up-nan").contains("is not JSON") && reason("up-nan").contains("column"), "{}", reason("up-nan"));
    assert!(reason("up-nan-stream").contains("stream chunk 2 of 3 is not JSON"), "{}", reason("up-nan-stream"));
    assert!(reason("up-empty").contains("empty choices"), "{}", reason("up-empty"));
    assert!(reason("race").contains("turn 5 of session \"race\" was already captured"), "{}", reason("race"));

    let st = (p.proxy_stats)();
    assert_eq!((st.turns_captured, st.dead_letters, st.token_rejected, st.events_dropped), (rows.len() as u64, 6, 1, 0));
    let _ = p.stop.send(());
    let fin = p.task.await.unwrap().unwrap();
    assert_eq!(fin.events_emitted, rows.len() as u64 + 6);
    eprintln!("proxy: {tried} hostile requests + 2 over the body limit + 1 duplicate refused; {} good turns captured; 6 dead letters", rows.len());
}
