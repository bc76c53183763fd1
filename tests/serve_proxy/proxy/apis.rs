//! The capture proxy's OpenAI Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`)
//! routes: a fake upstream speaking both (a scripted weather agent: a tool call, then the answer from
//! the tool's result), streamed and not; rows checked by hand, paired with their next states; errors,
//! cut streams and auth; and the official Python `openai` and `anthropic` clients.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use nextstate::bus::{Bus, Envelope};
use nextstate::runtime::InputLoop;
use nextstate::schema::{DeadLetter, Interaction, Lineage, NextStateKind, TurnType};
use nextstate::signals::{SignalConfig, SignalPairer};
use serde_json::{json, Value};

use super::{common, consume, embedded, interactions_input, opts, proxy_on_embedded, python_with_openai, run_python, start_proxy, LEAKY_HEADERS, LEAKY_KEYS};

// ---------------------------------------------------------------- the fake upstream

#[derive(Default)]
struct FakeApis {
    /// (path, request headers, body) of every request received.
    requests: Mutex<Vec<(String, HeaderMap, Value)>>,
    /// The bytes of every stream sent, in order.
    streams: Mutex<Vec<Vec<u8>>>,
    /// Responses created (for ids).
    created: Mutex<u32>,
    /// Every response created, by id (for `GET /v1/responses/{id}` and its cancel and input items).
    stored: Mutex<std::collections::HashMap<String, (Value, Value)>>,
    /// Fetches of each background response so far (the first answers `in_progress`).
    polls: Mutex<std::collections::HashMap<String, u32>>,
    /// The `X-Policy-Version` of stored-response answers (5 when not set).
    fetch_version: Mutex<Option<i64>>,
}

fn leaked(headers: &HeaderMap, body: &Value) -> Vec<&'static str> {
    LEAKY_HEADERS.iter().filter(|h| headers.contains_key(**h)).chain(LEAKY_KEYS.iter().filter(|k| body.get(**k).is_some())).copied().collect()
}

/// SSE bytes of `events` (`event:` and `data:` lines), cut into pieces at fixed offsets so events
/// straddle chunk boundaries.
fn sse_chunks(events: &[Value], with_done: bool) -> Vec<Bytes> {
    let mut all = String::new();
    for e in events {
        all.push_str(&format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or("message")));
    }
    if with_done {
        all.push_str("data: [DONE]\n\n");
    }
    let b = all.into_bytes();
    b.chunks(97).map(Bytes::copy_from_slice).collect()
}

async fn stream_response(f: Arc<FakeApis>, chunks: Vec<Bytes>) -> Response {
    stream_paced(f, chunks, Duration::from_millis(2)).await
}

/// [`stream_response`] with `pace` between chunks.
async fn stream_paced(f: Arc<FakeApis>, chunks: Vec<Bytes>, pace: Duration) -> Response {
    f.streams.lock().unwrap().push(chunks.concat());
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(4);
    tokio::spawn(async move {
        for c in chunks {
            tokio::time::sleep(pace).await;
            if tx.send(Ok(c)).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-policy-version", "5")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .unwrap()
}

fn json_response(v: &Value) -> Response {
    ([("content-type", "application/json"), ("x-policy-version", "5")], v.to_string()).into_response()
}

/// Responses API: the last input item decides. A `function_call_output` → the answer "It is
/// {output}."; user text with `tools` → a reasoning summary and a `get_weather` call; other user text
/// → "echo: {text}". Model `fail` → 503; model `cut` streams without a terminal event; model `slow`
/// streams 150 ms per chunk; model `fail-later` is a background response that fails. `background:
/// true` without a stream → the response `queued`, fetched later ([`fake_stored`]).
async fn fake_responses(State(f): State<Arc<FakeApis>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap();
    if !leaked(&headers, &body).is_empty() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "fake: turn metadata leaked upstream").into_response();
    }
    f.requests.lock().unwrap().push(("/v1/responses".into(), headers, body.clone()));
    let model = body["model"].as_str().unwrap_or("m").to_string();
    if model == "fail" {
        return (StatusCode::SERVICE_UNAVAILABLE, [("content-type", "application/json")], r#"{"error":{"message":"fake overloaded","type":"server_error"}}"#)
            .into_response();
    }
    let n = {
        let mut c = f.created.lock().unwrap();
        *c += 1;
        *c
    };
    let id = format!("resp_{n}");
    let last = match &body["input"] {
        Value::String(s) => json!({"role": "user", "content": s}),
        Value::Array(items) => items.last().cloned().unwrap_or(Value::Null),
        _ => Value::Null,
    };
    let output: Vec<Value> = if last["type"] == "function_call_output" {
        vec![json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": format!("It is {}.", last["output"].as_str().unwrap_or("")), "annotations": []}]})]
    } else {
        let text = match &last["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join(" "),
            _ => String::new(),
        };
        if body.get("tools").is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
            vec![
                json!({"type": "reasoning", "id": format!("rs_{n}"), "summary": [{"type": "summary_text", "text": "The user wants the weather."}]}),
                json!({"type": "function_call", "id": format!("fc_{n}"), "call_id": format!("call_{n}"), "name": "get_weather",
                    "arguments": json!({"city": text}).to_string(), "status": "completed"}),
            ]
        } else {
            vec![json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": format!("echo: {text}"), "annotations": []}]})]
        }
    };
    let done = json!({"id": id, "object": "response", "created_at": 1_764_000_000 + n, "status": "completed", "model": "fake-responses",
        "output": output, "previous_response_id": body["previous_response_id"], "background": body["background"] == json!(true),
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}});
    let mut done = done;
    if model == "fail-later" {
        done["status"] = json!("failed");
        done["output"] = json!([]);
        done["error"] = json!({"code": "server_error", "message": "the model crashed"});
    }
    f.stored.lock().unwrap().insert(id.clone(), (done.clone(), last.clone()));
    if body["stream"] != json!(true) {
        if body["background"] == json!(true) {
            let mut queued = done.clone();
            queued["status"] = json!("queued");
            queued["output"] = json!([]);
            return json_response(&queued);
        }
        return json_response(&done);
    }
    let mut created = done.clone();
    created["status"] = json!("in_progress");
    created["output"] = json!([]);
    let mut events = vec![
        json!({"type": "response.created", "sequence_number": 0, "response": created}),
        json!({"type": "response.in_progress", "sequence_number": 1, "response": created}),
    ];
    for (i, item) in output.iter().enumerate() {
        events.push(json!({"type": "response.output_item.added", "output_index": i, "item": item}));
        if let Some(t) = item["content"][0]["text"].as_str() {
            for piece in t.split_inclusive(' ') {
                events.push(json!({"type": "response.output_text.delta", "output_index": i, "content_index": 0, "delta": piece}));
            }
        }
        events.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
    }
    if model != "cut" {
        events.push(json!({"type": "response.completed", "response": done}));
    }
    let pace = Duration::from_millis(if model == "slow" { 150 } else { 2 });
    stream_paced(f, sse_chunks(&events, false), pace).await
}

/// Messages API: a user message carrying a `tool_result` → "The result is {content}."; user text
/// with `tools` → a thinking block, a short text and a `get_weather` tool use; other text → "echo:
/// {text}". `max_tokens` 5 → "Hel" cut by `max_tokens`. Model `overloaded` → 529; model `boom`
/// streams an `error` event. Needs `anthropic-version`.
async fn fake_messages(State(f): State<Arc<FakeApis>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap();
    if !leaked(&headers, &body).is_empty() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "fake: turn metadata leaked upstream").into_response();
    }
    if !headers.contains_key("anthropic-version") {
        return (
            StatusCode::BAD_REQUEST,
            [("content-type", "application/json")],
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"anthropic-version header is required"}}"#,
        )
            .into_response();
    }
    f.requests.lock().unwrap().push(("/v1/messages".into(), headers, body.clone()));
    let model = body["model"].as_str().unwrap_or("m").to_string();
    if model == "overloaded" {
        return (
            StatusCode::from_u16(529).unwrap(),
            [("content-type", "application/json")],
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        )
            .into_response();
    }
    let n = {
        let mut c = f.created.lock().unwrap();
        *c += 1;
        *c
    };
    let last = body["messages"].as_array().and_then(|m| m.last()).cloned().unwrap_or(Value::Null);
    let blocks: Vec<Value> = match &last["content"] {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(b) => b.clone(),
        _ => vec![],
    };
    let result = blocks.iter().find(|b| b["type"] == "tool_result");
    let text: String = blocks.iter().filter_map(|b| b["text"].as_str()).collect::<Vec<_>>().join(" ");
    let (content, mut stop): (Vec<Value>, &str) = if let Some(r) = result {
        let c = r["content"].as_str().map(str::to_string).unwrap_or_else(|| r["content"][0]["text"].as_str().unwrap_or("").to_string());
        (vec![json!({"type": "text", "text": format!("The result is {c}.")})], "end_turn")
    } else if body.get("tools").is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
        (
            vec![
                json!({"type": "thinking", "thinking": "Need the weather tool.", "signature": "sig-1"}),
                json!({"type": "text", "text": "Let me check."}),
                json!({"type": "tool_use", "id": format!("toolu_{n}"), "name": "get_weather", "input": {"city": text}}),
            ],
            "tool_use",
        )
    } else {
        (vec![json!({"type": "text", "text": format!("echo: {text}")})], "end_turn")
    };
    let mut content = content;
    if body["max_tokens"] == json!(5) {
        content = vec![json!({"type": "text", "text": "Hel"})];
        stop = "max_tokens";
    }
    let msg = json!({"id": format!("msg_{n}"), "type": "message", "role": "assistant", "model": "fake-claude", "content": content,
        "stop_reason": stop, "stop_sequence": null, "usage": {"input_tokens": 10, "output_tokens": 5}});
    if body["stream"] != json!(true) {
        return json_response(&msg);
    }
    let mut start = msg.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    let mut events = vec![json!({"type": "message_start", "message": start}), json!({"type": "ping"})];
    for (i, b) in content.iter().enumerate() {
        match b["type"].as_str().unwrap() {
            "text" => {
                events.push(json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}));
                for piece in b["text"].as_str().unwrap().split_inclusive(' ') {
                    events.push(json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": piece}}));
                }
            }
            "thinking" => {
                events.push(json!({"type": "content_block_start", "index": i, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}));
                events.push(json!({"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": b["thinking"]}}));
                events.push(json!({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": b["signature"]}}));
            }
            _ => {
                events.push(json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}));
                let input = b["input"].to_string();
                let (a, z) = input.split_at(input.len() / 2);
                for piece in ["", a, z] {
                    events.push(json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": piece}}));
                }
            }
        }
        events.push(json!({"type": "content_block_stop", "index": i}));
        if model == "boom" {
            events.push(json!({"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}));
            break;
        }
    }
    if model != "boom" {
        events.push(json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 5}}));
        events.push(json!({"type": "message_stop"}));
    }
    stream_response(f, sse_chunks(&events, false)).await
}

/// The Responses API's stored responses: `GET /v1/responses/{id}` (the response), `POST
/// /v1/responses/{id}/cancel` (it, `status: cancelled`), `GET /v1/responses/{id}/input_items` (its last
/// input item as a list); 404 for an unknown id. A background response's first fetch answers it
/// `in_progress`, later ones finished; `?stream=true` streams `response.in_progress` then
/// `response.completed`.
async fn fake_stored(State(f): State<Arc<FakeApis>>, uri: axum::http::Uri, headers: HeaderMap) -> Response {
    let path = uri.path().to_string();
    f.requests.lock().unwrap().push((path.clone(), headers, Value::Null));
    let rest = path.trim_start_matches("/v1/responses/");
    let (id, what) = rest.split_once('/').unwrap_or((rest, ""));
    let Some((resp, last)) = f.stored.lock().unwrap().get(id).cloned() else {
        return (StatusCode::NOT_FOUND, [("content-type", "application/json")], r#"{"error":{"message":"no such response","type":"invalid_request_error"}}"#).into_response();
    };
    match what {
        "cancel" => {
            let mut r = resp;
            r["status"] = json!("cancelled");
            json_response(&r)
        }
        "input_items" => {
            let text = last["content"].as_str().unwrap_or_default();
            let item = json!({"type": "message", "id": "msg_in", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": text}]});
            json_response(&json!({"object": "list", "data": [item], "first_id": "msg_in", "last_id": "msg_in", "has_more": false}))
        }
        _ if resp["background"] == json!(true) => {
            let polls = {
                let mut p = f.polls.lock().unwrap();
                let n = p.entry(id.to_string()).or_insert(0);
                *n += 1;
                *n
            };
            let mut running = resp.clone();
            running["status"] = json!("in_progress");
            running["output"] = json!([]);
            if uri.query().is_some_and(|q| q.contains("stream=true")) {
                let events = [json!({"type": "response.in_progress", "sequence_number": 5, "response": running}), json!({"type": "response.completed", "sequence_number": 9, "response": resp})];
                return stream_response(f.clone(), sse_chunks(&events, false)).await;
            }
            let version = f.fetch_version.lock().unwrap().unwrap_or(5).to_string();
            let body = if polls == 1 { &running } else { &resp };
            ([("content-type", "application/json".to_string()), ("x-policy-version", version)], body.to_string()).into_response()
        }
        _ => json_response(&resp),
    }
}

/// `POST /v1/messages/count_tokens`: 10 tokens per message.
async fn fake_count_tokens(State(f): State<Arc<FakeApis>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap();
    f.requests.lock().unwrap().push(("/v1/messages/count_tokens".into(), headers, body.clone()));
    json_response(&json!({"input_tokens": 10 * body["messages"].as_array().map_or(0, Vec::len)}))
}

async fn start_fake_apis() -> (String, Arc<FakeApis>) {
    let f = Arc::new(FakeApis::default());
    let app = Router::new()
        .route("/v1/responses", post(fake_responses))
        .route("/v1/messages", post(fake_messages))
        .route("/v1/messages/count_tokens", post(fake_count_tokens))
        .route("/v1/responses/{id}", get(fake_stored))
        .route("/v1/responses/{id}/cancel", post(fake_stored))
        .route("/v1/responses/{id}/input_items", get(fake_stored))
        .with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}"), f)
}

// ---------------------------------------------------------------- helpers

const WEATHER_TOOL_RESPONSES: &str = r#"[{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]"#;
const WEATHER_TOOL_MESSAGES: &str =
    r#"[{"name": "get_weather", "description": "weather of a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]"#;

fn dead_letters_input(bus: &Bus) -> InputLoop {
    InputLoop::new(bus, &format!("test-dl-{}", uuid::Uuid::new_v4().simple()), &bus.topic("dead_letters")).unwrap()
}

async fn dead_letters(input: &mut InputLoop, n: usize) -> Vec<DeadLetter> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut out = vec![];
    while out.len() < n && std::time::Instant::now() < deadline {
        for m in input.next_batch(100, Duration::from_millis(300)).await.unwrap() {
            out.push(serde_json::from_slice::<Envelope<DeadLetter>>(&m.payload).unwrap().row);
        }
    }
    out
}

/// The next states the pairer gives each row: (turn index, kind, next-state text as the judge reads
/// it: each message after a `[role]` tag).
fn paired(rows: &[Interaction]) -> Vec<(i32, NextStateKind, String)> {
    let mut p = SignalPairer::with_clock(SignalConfig::default(), Box::new(|| 0));
    let mut out = vec![];
    for (i, r) in rows.iter().enumerate() {
        out.extend(p.push(r.clone(), Lineage { source_partition: Some(0), source_offset: Some(i as i64), ..Lineage::default() }));
    }
    out.extend(p.finish());
    let mut v: Vec<(i32, NextStateKind, String)> = out.into_iter().map(|s| (s.turn_index, s.kind, s.next_state_text)).collect();
    v.sort_by_key(|x| x.0);
    v
}

fn roles(row: &Interaction) -> Vec<String> {
    row.messages().unwrap().iter().map(|m| m.role.clone()).collect()
}

async fn post_json(c: &reqwest::Client, url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Vec<u8>, Option<String>) {
    let mut rb = c.post(url).json(body);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    (status, r.bytes().await.unwrap().to_vec(), ct)
}

// ---------------------------------------------------------------- tests

/// A three-turn Responses conversation chained by `previous_response_id`, with no session header:
/// one inferred session, turns 0–2, the chain's history rebuilt into each request, and each turn
/// paired with the next one's new input (the tool's output, then the user's thanks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_chained_by_previous_response_id_are_one_session() {
    let (up, fake) = start_fake_apis().await;
    let (_bus, p, mut input, _spool) = proxy_on_embedded(&up, |_| {}).await;
    let c = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/responses", p.url);
    let tools: Value = serde_json::from_str(WEATHER_TOOL_RESPONSES).unwrap();

    let b0 = json!({"model": "gpt-x", "instructions": "You are a weather agent.", "tools": tools, "input": [{"role": "user", "content": "Paris"}]});
    let (st, bytes, _) = post_json(&c, &url, &b0, &[]).await;
    assert_eq!(st, 200);
    let r0: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!((r0["id"].as_str(), r0["output"][1]["call_id"].as_str()), (Some("resp_1"), Some("call_1")), "the upstream's body, unchanged");

    let b1 = json!({"model": "gpt-x", "instructions": "You are a weather agent.", "tools": tools, "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}]});
    let (st, bytes, _) = post_json(&c, &url, &b1, &[]).await;
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_slice::<Value>(&bytes).unwrap()["output"][0]["content"][0]["text"], "It is 18C and sunny.");

    // Streamed, marked done in the body. Clients send their instructions with every request: they are
    // not carried over a chain.
    let b2 =
        json!({"model": "gpt-x", "instructions": "You are a weather agent.", "previous_response_id": "resp_2", "stream": true, "session_done": true, "input": "thanks!"});
    let (st, bytes, ct) = post_json(&c, &url, &b2, &[]).await;
    assert_eq!((st, ct.as_deref()), (200, Some("text/event-stream")));
    assert_eq!(bytes, fake.streams.lock().unwrap()[0], "the stream reaches the client byte for byte");

    let rows = consume(&mut input, 3, Duration::from_secs(20), Duration::from_millis(500)).await;
    assert_eq!(rows.len(), 3);
    let session = rows[0].session_id.clone();
    assert!(rows.iter().all(|r| r.session_id == session && r.session_inferred), "one inferred session");
    assert_eq!(rows.iter().map(|r| r.turn_index).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(rows.iter().map(|r| r.session_done).collect::<Vec<_>>(), [false, false, true]);
    assert!(rows.iter().all(|r| r.source_format == "proxy" && r.policy_version == Some(5) && r.response_token_ids.is_none()));

    // Turn 0: the tool call, with the reasoning summary.
    assert_eq!(roles(&rows[0]), ["system", "user"]);
    assert_eq!((rows[0].response_text.as_str(), rows[0].reasoning_text.as_deref()), ("", Some("The user wants the weather.")));
    let calls: Value = serde_json::from_str(rows[0].tool_calls.as_deref().unwrap()).unwrap();
    assert_eq!((calls[0]["id"].as_str(), calls[0]["name"].as_str(), &calls[0]["arguments"]), (Some("call_1"), Some("get_weather"), &json!({"city": "Paris"})));
    assert_eq!((rows[0].finish_reason.as_deref(), rows[0].model.as_deref()), (Some("tool_calls"), Some("fake-responses")));
    // Turn 1: the chain's history, then the tool's output.
    assert_eq!(roles(&rows[1]), ["system", "user", "assistant", "tool"]);
    let m1 = rows[1].messages().unwrap();
    assert_eq!((m1[3].content.as_str(), m1[3].tool_call_id.as_deref()), ("18C and sunny", Some("call_1")));
    assert_eq!((rows[1].response_text.as_str(), rows[1].finish_reason.as_deref()), ("It is 18C and sunny.", Some("stop")));
    // Turn 2 (streamed): the instructions, the chain's history (its instructions not repeated), the input.
    assert_eq!(roles(&rows[2]), ["system", "user", "assistant", "tool", "assistant", "user"]);
    assert_eq!(rows[2].response_text, "echo: thanks!");
    assert!(rows.iter().all(|r| r.notes.is_empty()), "{:?}", rows.iter().map(|r| &r.notes).collect::<Vec<_>>());

    assert_eq!(
        paired(&rows),
        [(0, NextStateKind::Tool, "[tool] 18C and sunny".to_string()), (1, NextStateKind::User, "[user] thanks!".to_string()), (2, NextStateKind::None, String::new())]
    );
    // The upstream got each body as sent, without the proxy's keys.
    {
        let reqs = fake.requests.lock().unwrap();
        assert_eq!(reqs.len(), 3);
        assert!(reqs[2].2.get("session_done").is_none() && reqs[2].2["previous_response_id"] == "resp_2");
        assert!(reqs[0].2.get("logprobs").is_none(), "Responses requests are not rewritten");
    }

    // A chain this proxy did not see: the conversation starts at the input, with a note.
    let (st, _, _) =
        post_json(&c, &url, &json!({"model": "gpt-x", "previous_response_id": "resp_elsewhere", "input": "hello again"}), &[("x-session-id", "s-other")]).await;
    assert_eq!(st, 200);
    let rows = consume(&mut input, 1, Duration::from_secs(20), Duration::from_millis(300)).await;
    assert_eq!((rows[0].session_id.as_str(), rows[0].turn_index, roles(&rows[0])), ("s-other", 0, vec!["user".to_string()]));
    assert_eq!(rows[0].notes.len(), 1);
    assert!(rows[0].notes[0].starts_with("previous response \"resp_elsewhere\" was not captured"), "{:?}", rows[0].notes);

    // `store: false`: the upstream keeps no copy to chain on, and neither does the proxy.
    let (_, bytes, _) = post_json(&c, &url, &json!({"model": "gpt-x", "store": false, "input": "one"}), &[("x-session-id", "s-nostore")]).await;
    let id = serde_json::from_slice::<Value>(&bytes).unwrap()["id"].as_str().unwrap().to_string();
    post_json(&c, &url, &json!({"model": "gpt-x", "previous_response_id": id, "input": "two"}), &[("x-session-id", "s-nostore")]).await;
    let rows = consume(&mut input, 2, Duration::from_secs(20), Duration::from_millis(300)).await;
    assert_eq!((rows[1].turn_index, roles(&rows[1])), (1, vec!["user".to_string()]));
    assert!(rows[1].notes[0].contains("was not captured by this proxy process"), "{:?}", rows[1].notes);
    let st = p.shutdown().await;
    assert_eq!((st.turns_captured, st.dead_letters, st.events_emitted), (6, 0, 6));
}

/// Polls `GET /v1/responses/{id}` (at most 5 times) until the response is no longer running; its
/// last body.
async fn poll_response(c: &reqwest::Client, proxy: &str, id: &str) -> Value {
    for _ in 0..5 {
        let v: Value = c.get(format!("{proxy}/v1/responses/{id}")).send().await.unwrap().json().await.unwrap();
        if v["status"] != "queued" && v["status"] != "in_progress" {
            return v;
        }
    }
    panic!("{id} still running after 5 fetches");
}

/// Background responses (`background: true`): the turn is recorded when a later fetch returns the
/// response finished (plain or streamed), once; a cancelled one, or one the upstream no longer has,
/// records nothing (counted); a failed one is a dead letter; a background stream the client leaves
/// early is still read to its end and recorded; one that ends without its terminal event waits for
/// the next fetch; a version the create call and the fetch disagree on is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_become_turns_when_fetched_finished() {
    let (up, fake) = start_fake_apis().await;
    let (_bus, p, mut input, _spool) = proxy_on_embedded(&up, |_| {}).await;
    let c = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/responses", p.url);
    let session = [("x-session-id", "s-bg")];

    // Queued at once: no turn yet; the first fetch is still running, the second finished → the turn.
    let (st, bytes, _) = post_json(&c, &url, &json!({"model": "gpt-x", "background": true, "input": "Paris?"}), &session).await;
    let r: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!((st, r["id"].as_str(), r["status"].as_str()), (200, Some("resp_1"), Some("queued")));
    assert!(consume(&mut input, 1, Duration::from_secs(1), Duration::from_millis(300)).await.is_empty(), "no turn while queued");
    let fetched = poll_response(&c, &p.url, "resp_1").await;
    assert_eq!(fetched["output"][0]["content"][0]["text"], "echo: Paris?", "the upstream's body, unchanged");
    let rows = consume(&mut input, 1, Duration::from_secs(20), Duration::from_millis(300)).await;
    assert_eq!((rows[0].session_id.as_str(), rows[0].turn_index, rows[0].response_text.as_str()), ("s-bg", 0, "echo: Paris?"));
    assert_eq!((roles(&rows[0]), rows[0].policy_version, rows[0].finish_reason.as_deref()), (vec!["user".to_string()], Some(5), Some("stop")));
    // Fetched again: passed through, not recorded twice.
    assert_eq!(poll_response(&c, &p.url, "resp_1").await["status"], "completed");

    // Cancelled: no turn.
    post_json(&c, &url, &json!({"model": "gpt-x", "background": true, "input": "never mind"}), &session).await;
    let (st, bytes, _) = post_json(&c, &format!("{url}/resp_2/cancel"), &json!({}), &[]).await;
    assert_eq!((st, serde_json::from_slice::<Value>(&bytes).unwrap()["status"].as_str()), (200, Some("cancelled")));

    // Fetched as a stream: recorded from its terminal event.
    post_json(&c, &url, &json!({"model": "gpt-x", "background": true, "input": "Rome?"}), &session).await;
    let r = c.get(format!("{url}/resp_3?stream=true")).send().await.unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert!(String::from_utf8(r.bytes().await.unwrap().to_vec()).unwrap().contains("response.completed"));

    // A background stream the client leaves after its first bytes (150 ms a chunk: it has seconds to
    // go): read to its end and recorded (`background_client_left` below), and a later fetch records
    // nothing more.
    let mut r = c.post(&url).json(&json!({"model": "slow", "background": true, "stream": true, "input": "Oslo?"})).header("x-session-id", "s-bg").send().await.unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    drop(r);
    let rows = consume(&mut input, 2, Duration::from_secs(20), Duration::from_millis(300)).await;
    let got: Vec<(i32, &str)> = rows.iter().map(|r| (r.turn_index, r.response_text.as_str())).collect();
    assert_eq!(got, [(1, "echo: Rome?"), (2, "echo: Oslo?")]);
    assert_eq!(poll_response(&c, &p.url, "resp_4").await["status"], "completed");

    // A background stream that ends without its terminal event: the turn waits for the next fetch.
    // The upstream reloaded in between (version 5 at create, 6 at fetch): the row's version is unknown.
    let (st, _, _) = post_json(&c, &url, &json!({"model": "cut", "background": true, "stream": true, "input": "Lima?"}), &session).await;
    assert_eq!(st, 200);
    *fake.fetch_version.lock().unwrap() = Some(6);
    assert_eq!(poll_response(&c, &p.url, "resp_5").await["status"], "completed");
    let rows = consume(&mut input, 1, Duration::from_secs(20), Duration::from_millis(300)).await;
    assert_eq!((rows[0].turn_index, rows[0].response_text.as_str(), rows[0].policy_version), (3, "echo: Lima?", None));
    *fake.fetch_version.lock().unwrap() = None;

    // Gone upstream (404): no turn, counted. Failed: a dead letter, as when answered at once.
    post_json(&c, &url, &json!({"model": "gpt-x", "background": true, "input": "expired"}), &session).await;
    fake.stored.lock().unwrap().remove("resp_6");
    let r = c.get(format!("{url}/resp_6")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    post_json(&c, &url, &json!({"model": "fail-later", "background": true, "input": "crash?"}), &session).await;
    assert_eq!(poll_response(&c, &p.url, "resp_7").await["status"], "failed");
    assert!(consume(&mut input, 1, Duration::from_secs(1), Duration::from_millis(300)).await.is_empty(), "nothing else recorded");

    let metrics = c.get(format!("{}/metrics", p.url)).send().await.unwrap().text().await.unwrap();
    let outcomes = [("background_pending", 6), ("background_cancelled", 1), ("background_not_found", 1), ("background_client_left", 1), ("captured", 4), ("dead_letter", 1)];
    for (outcome, n) in outcomes {
        assert!(metrics.contains(&format!("nextstate_proxy_turns_total{{outcome=\"{outcome}\"}} {n}")), "{outcome} {n}: {metrics}");
    }
    assert!(!metrics.contains("outcome=\"client_disconnected\"") && metrics.contains("nextstate_proxy_background_pending 0"), "{metrics}");
    let st = p.shutdown().await;
    assert_eq!((st.turns_captured, st.dead_letters), (4, 1));
}

/// Messages, streamed and not, with an explicit session: tool use and its result, thinking, the
/// token limit; the Anthropic headers reach the upstream, the proxy's own headers do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_streamed_and_not_are_captured_with_tool_use_and_results() {
    let (up, fake) = start_fake_apis().await;
    let (_bus, p, mut input, _spool) = proxy_on_embedded(&up, |o| o.upstream_api_key = Some("up-key".into())).await;
    let c = nextstate::net::http_client(None).unwrap();
    let url = format!("{}/v1/messages", p.url);
    let tools: Value = serde_json::from_str(WEATHER_TOOL_MESSAGES).unwrap();
    let hdr = [("anthropic-version", "2023-06-01"), ("anthropic-beta", "fake-beta"), ("x-session-id", "claude-1")];

    let user0 = json!({"role": "user", "content": "Paris"});
    let b0 = json!({"model": "claude-x", "max_tokens": 256, "system": "You are a weather agent.", "tools": tools, "stream": true, "messages": [user0]});
    let (st, bytes, ct) = post_json(&c, &url, &b0, &hdr).await;
    assert_eq!((st, ct.as_deref()), (200, Some("text/event-stream")));
    assert_eq!(bytes, fake.streams.lock().unwrap()[0]);

    let assistant0 = json!({"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Need the weather tool.", "signature": "sig-1"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]});
    let user1 = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C and sunny"}]});
    let b1 = json!({"model": "claude-x", "max_tokens": 256, "system": [{"type": "text", "text": "You are a weather agent."}], "tools": tools,
        "messages": [user0, assistant0, user1]});
    let (st, bytes, _) = post_json(&c, &url, &b1, &hdr).await;
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_slice::<Value>(&bytes).unwrap()["content"][0]["text"], "The result is 18C and sunny.");

    let assistant1 = json!({"role": "assistant", "content": [{"type": "text", "text": "The result is 18C and sunny."}]});
    let b2 = json!({"model": "claude-x", "max_tokens": 5, "stream": true, "system": "You are a weather agent.",
        "messages": [user0, assistant0, user1, assistant1, {"role": "user", "content": "More?"}]});
    let (st, _, _) = post_json(&c, &url, &b2, &[hdr[0], hdr[2], ("x-session-done", "true")]).await;
    assert_eq!(st, 200);

    let rows = consume(&mut input, 3, Duration::from_secs(20), Duration::from_millis(500)).await;
    assert_eq!(
        rows.iter().map(|r| (r.session_id.as_str(), r.turn_index, r.session_done)).collect::<Vec<_>>(),
        [("claude-1", 0, false), ("claude-1", 1, false), ("claude-1", 2, true)]
    );
    assert_eq!((rows[0].response_text.as_str(), rows[0].reasoning_text.as_deref()), ("Let me check.", Some("Need the weather tool.")));
    let calls: Value = serde_json::from_str(rows[0].tool_calls.as_deref().unwrap()).unwrap();
    assert_eq!((calls[0]["id"].as_str(), calls[0]["name"].as_str(), &calls[0]["arguments"]), (Some("toolu_1"), Some("get_weather"), &json!({"city": "Paris"})));
    assert_eq!((rows[0].finish_reason.as_deref(), rows[0].model.as_deref(), rows[0].truncated), (Some("tool_calls"), Some("fake-claude"), false));
    assert_eq!(roles(&rows[1]), ["system", "user", "assistant", "tool"]);
    assert_eq!((rows[1].response_text.as_str(), rows[1].finish_reason.as_deref()), ("The result is 18C and sunny.", Some("stop")));
    assert_eq!((rows[2].response_text.as_str(), rows[2].finish_reason.as_deref(), rows[2].truncated), ("Hel", Some("length"), true));
    assert_eq!(serde_json::from_str::<Value>(rows[0].tools.as_deref().unwrap()).unwrap(), tools);
    assert_eq!(
        paired(&rows),
        [(0, NextStateKind::Tool, "[tool] 18C and sunny".to_string()), (1, NextStateKind::User, "[user] More?".to_string()), (2, NextStateKind::None, String::new())]
    );
    for (path, h, body) in fake.requests.lock().unwrap().iter() {
        assert_eq!(path, "/v1/messages");
        assert_eq!(h.get("x-api-key").and_then(|v| v.to_str().ok()), Some("up-key"), "the configured upstream key, as x-api-key");
        assert!(h.get("authorization").is_none());
        assert_eq!(h.get("anthropic-version").and_then(|v| v.to_str().ok()), Some("2023-06-01"));
        assert!(body.get("logprobs").is_none());
    }
    assert_eq!(fake.requests.lock().unwrap()[0].1.get("anthropic-beta").and_then(|v| v.to_str().ok()), Some("fake-beta"));
    let st = p.shutdown().await;
    assert_eq!((st.turns_captured, st.dead_letters), (3, 0));
}

/// Errors of both APIs: upstream error statuses and error events pass to the client and make no row;
/// a Responses stream without its terminal event is an `incomplete_stream` dead letter; requests
/// that cannot be recorded are refused with a code; Anthropic clients authenticate with `x-api-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_cut_streams_refusals_and_x_api_key_auth() {
    let (up, fake) = start_fake_apis().await;
    let bus = embedded().await;
    let mut input = interactions_input(&bus);
    let mut dl = dead_letters_input(&bus);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(&up, dir.path());
    o.api_key = Some("sekrit".into());
    let p = start_proxy(o, &bus).await;
    let c = nextstate::net::http_client(None).unwrap();
    let (responses, messages) = (format!("{}/v1/responses", p.url), format!("{}/v1/messages", p.url));
    let av = ("anthropic-version", "2023-06-01");
    let msg = |model: &str, stream: bool| json!({"model": model, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": "hi"}]});

    // Auth: bearer or x-api-key; neither → 401 before the upstream.
    assert_eq!(post_json(&c, &messages, &msg("claude-x", false), &[av]).await.0, 401);
    assert_eq!(post_json(&c, &messages, &msg("claude-x", false), &[av, ("x-api-key", "wrong")]).await.0, 401);
    let (st, body, _) = post_json(&c, &messages, &msg("claude-x", false), &[av, ("x-api-key", "sekrit")]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    assert!(fake.requests.lock().unwrap()[0].1.get("x-api-key").is_none(), "the proxy's own key is not forwarded");
    let key = ("authorization", "Bearer sekrit");

    // Upstream error statuses pass through; an error event mid-stream reaches the client; no rows.
    let (st, body, _) = post_json(&c, &messages, &msg("overloaded", false), &[av, key]).await;
    assert_eq!((st, serde_json::from_slice::<Value>(&body).unwrap()["error"]["type"].as_str()), (529, Some("overloaded_error")));
    let (st, body, _) = post_json(&c, &messages, &msg("boom", true), &[av, key]).await;
    assert_eq!(st, 200);
    assert!(String::from_utf8_lossy(&body).contains("event: error"));
    let (st, _, _) = post_json(&c, &responses, &json!({"model": "fail", "input": "hi"}), &[key]).await;
    assert_eq!(st, 503);

    // A Responses stream cut before `response.completed`: the client has its bytes, the turn is a dead letter.
    let (st, body, _) = post_json(&c, &responses, &json!({"model": "cut", "input": "hi", "stream": true}), &[key, ("x-session-id", "cut-1")]).await;
    assert_eq!(st, 200);
    assert!(String::from_utf8_lossy(&body).contains("response.output_text.delta"));
    let d = dead_letters(&mut dl, 1).await;
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].stage.as_str(), d[0].reason_code.as_str(), d[0].session_id.as_str()), ("proxy", "incomplete_stream", "cut-1"));

    // Refused before the upstream: no input, no messages, a bad role; codes as in dead letters.
    let n_before = fake.requests.lock().unwrap().len();
    for (url, body, code) in [
        (&responses, json!({"model": "m"}), "missing_messages"),
        (&responses, json!({"model": "m", "input": [{"role": "elf", "content": "x"}]}), "unknown_role"),
        (&messages, json!({"model": "m", "max_tokens": 5}), "missing_messages"),
        (&messages, json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}), "wrong_type"),
    ] {
        let (st, b, _) = post_json(&c, url, &body, &[av, key]).await;
        assert_eq!((st, serde_json::from_slice::<Value>(&b).unwrap()["error"]["code"].as_str()), (400, Some(code)), "{body}");
    }
    assert_eq!(fake.requests.lock().unwrap().len(), n_before);

    let rows = consume(&mut input, 1, Duration::from_secs(20), Duration::from_millis(500)).await;
    assert_eq!((rows.len(), rows[0].response_text.as_str()), (1, "echo: hi"), "only the one good turn");
    let metrics = c.get(format!("{}/metrics", p.url)).header("x-api-key", "sekrit").send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"route="messages""#) && metrics.contains(r#"route="responses""#), "{metrics}");
    let st = p.shutdown().await;
    // Upstream errors: the 529, the error event, the 503.
    assert_eq!((st.turns_captured, st.dead_letters, st.upstream_errors), (1, 1, 3));
}

/// The official `openai` (Responses, streamed and not, chained) and `anthropic` (Messages, streamed and
/// not, tool use) Python clients through the proxy (tests/python/proxy_apis_client.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_openai_and_anthropic_clients_through_the_proxy() {
    let Some(py) = python_with_openai() else {
        common::missing("no python with the openai package (python3 -m venv .cache/venv-openai && .cache/venv-openai/bin/pip install openai anthropic)");
        return;
    };
    if !std::process::Command::new(&py).args(["-c", "import anthropic"]).output().is_ok_and(|o| o.status.success()) {
        common::missing("the test python has no anthropic package (.cache/venv-openai/bin/pip install anthropic; scripts/setup.sh installs it)");
        return;
    }
    let (up, fake) = start_fake_apis().await;
    let (_bus, p, mut input, _spool) = proxy_on_embedded(&up, |o| o.api_key = Some("py-key".into())).await;
    let stdout = run_python(py, "proxy_apis_client.py", p.url.clone(), "py-key").await;
    assert!(stdout.contains("6 passed, 0 failed"), "{stdout}");
    let rows = consume(&mut input, 6, Duration::from_secs(20), Duration::from_millis(500)).await;
    let summary: Vec<(&str, i32, TurnType, Option<&str>)> = rows.iter().map(|r| (r.session_id.as_str(), r.turn_index, r.turn_type, r.finish_reason.as_deref())).collect();
    assert_eq!(
        summary,
        [
            ("py-claude", 0, TurnType::Main, Some("tool_calls")),
            ("py-claude", 1, TurnType::Main, Some("stop")),
            ("py-claude", 2, TurnType::Side, Some("stop")),
            ("py-responses", 0, TurnType::Main, Some("tool_calls")),
            ("py-responses", 1, TurnType::Main, Some("stop")),
            ("py-responses", 2, TurnType::Main, Some("stop")),
        ]
    );
    assert_eq!(rows[1].response_text, "The result is 18C.");
    assert_eq!(rows[4].response_text, "It is 18C.");
    assert_eq!(roles(&rows[5]), ["user", "assistant", "tool", "assistant", "user"], "the chain rebuilt for the streamed turn");
    assert_eq!(paired(&rows[3..])[0], (0, NextStateKind::Tool, "[tool] 18C".to_string()));
    assert_eq!(paired(&rows[..3])[0], (0, NextStateKind::Tool, "[tool] 18C".to_string()));
    assert!(fake.requests.lock().unwrap().iter().all(|(path, h, _)| path != "/v1/messages" || h.contains_key("anthropic-version")));
    // Passed through, not captured: count_tokens and the stored response's retrieve, input items and
    // cancel reached the upstream with the client's headers; no turn came of them (6 above, no more).
    let reqs = fake.requests.lock().unwrap().clone();
    let paths: Vec<&str> = reqs.iter().map(|(p, _, _)| p.as_str()).filter(|p| *p == "/v1/messages/count_tokens" || p.starts_with("/v1/responses/")).collect();
    assert_eq!(paths, ["/v1/responses/resp_2", "/v1/responses/resp_2/input_items", "/v1/responses/resp_2/cancel", "/v1/messages/count_tokens"]);
    let header = |h: &HeaderMap, k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    for (path, h, _) in reqs.iter().filter(|(p, _, _)| p.starts_with("/v1/responses")) {
        assert_eq!((header(h, "openai-organization"), header(h, "openai-project")), (Some("org-py".into()), Some("proj-py".into())), "{path}");
    }
    let count = reqs.iter().find(|(p, _, _)| p == "/v1/messages/count_tokens").unwrap();
    assert!(header(&count.1, "anthropic-version").is_some(), "the client's anthropic-version passed on");
    assert!(consume(&mut input, 1, Duration::from_secs(2), Duration::from_millis(500)).await.is_empty(), "nothing recorded for a pass-through");
    let st = p.shutdown().await;
    assert_eq!(st.turns_captured, 6);
}
