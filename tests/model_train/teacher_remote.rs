//! The remote teacher (`[teacher] backend = "sglang" | "vllm"`):
//! - the SGLang client against a fake `/generate` that implements SGLang's documented request and
//!   answer (the fields it receives, the alignment of `input_token_logprobs` from `logprob_start_len`,
//!   retries, and what each failure becomes);
//! - the vLLM backend against our own `nextstate serve` (`/v1/completions` with `prompt_logprobs`),
//!   started in-process with SmolLM2-135M-Instruct, on real turns (the OpenHands log with a human
//!   correction) pushed through signals → hint → teacher: its teacher rows must equal the local
//!   teacher's within 1e-4 per token, with the same top-K ids.
use crate::common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use nextstate::lake::Lake;
use nextstate::schema::{Interaction, TeacherLogprobs};
use nextstate::teacher::remote::{RemoteFailure, RemoteTeacher};
use nextstate::teacher::{TeacherBackend, TeacherConfig};
use serde_json::{json, Value};

/// A fake SGLang server: records every request body and answers from a script of (status, body).
#[derive(Clone, Default)]
struct FakeSglang {
    seen: Arc<Mutex<Vec<Value>>>,
    script: Arc<Mutex<Vec<(u16, Value)>>>,
}

async fn fake_generate(State(f): State<FakeSglang>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    f.seen.lock().unwrap().push(body);
    let (status, answer) = f.script.lock().unwrap().remove(0);
    (StatusCode::from_u16(status).unwrap(), Json(answer))
}

async fn serve_on_loopback(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

/// SGLang's answer for input ids [11, 12, 13, 21, 22] with `logprob_start_len` = 2 and
/// `top_logprobs_num` = 2: one entry per input position from 2 on, the first always null-valued.
fn sglang_answer() -> Value {
    json!({"text": "", "meta_info": {
        "id": "x", "prompt_tokens": 5, "completion_tokens": 0, "finish_reason": {"type": "length", "length": 0},
        "input_token_logprobs": [[null, 13, null], [-0.5, 21, null], [-1.25, 22, null]],
        "input_top_logprobs": [null, [[-0.5, 21, null], [-2.0, 30, null]], [[-0.75, 31, null], [-1.25, 22, null]]],
        "output_token_logprobs": [], "output_top_logprobs": [],
    }})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_client_sends_the_documented_request_and_aligns_the_answer() {
    let fake = FakeSglang::default();
    let url = serve_on_loopback(Router::new().route("/generate", post(fake_generate)).with_state(fake.clone())).await;
    let cfg = TeacherConfig {
        backend: TeacherBackend::Sglang,
        url: Some(url.clone()),
        model: Some(PathBuf::from("teacher-x")),
        top_k: 2,
        retries: 2,
        backoff_base_ms: 1,
        ..TeacherConfig::default()
    };
    cfg.validate().unwrap();
    let client = RemoteTeacher::new(&cfg).unwrap();
    assert_eq!((client.url(), client.model()), (format!("{url}/generate").as_str(), "teacher-x"));
    let (prompt, response) = (vec![11u32, 12, 13], vec![21u32, 22]);

    // A 503 is retried; the second answer is read.
    *fake.script.lock().unwrap() = vec![(503, json!({"error": "warming up"})), (200, sglang_answer())];
    let s = client.score_one(&prompt, &response).await.unwrap();
    assert_eq!(s.logprobs, vec![-0.5, -1.25], "logprobs[i] scores response[i]");
    assert_eq!(s.topk_ids, Some(vec![vec![21, 30], vec![31, 22]]));
    assert_eq!(s.topk_logprobs, Some(vec![vec![-0.5, -2.0], vec![-0.75, -1.25]]));
    let seen = fake.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1],
        json!({"input_ids": [11, 12, 13, 21, 22], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": true, "logprob_start_len": 2, "top_logprobs_num": 2, "return_text_in_logprobs": false})
    );

    // A one-token response whose token differs from the prompt's last: logprob_start_len = P - 1 still.
    fake.seen.lock().unwrap().clear();
    let one = json!({"meta_info": {"input_token_logprobs": [[null, 13, null], [-3.5, 40, null]],
        "input_top_logprobs": [null, [[-0.1, 7, null], [-2.5, 8, null]]]}});
    *fake.script.lock().unwrap() = vec![(200, one)];
    let s = client.score_one(&prompt, &[40]).await.unwrap();
    assert_eq!((s.logprobs, s.topk_ids), (vec![-3.5], Some(vec![vec![7, 8]])));
    assert_eq!(fake.seen.lock().unwrap()[0]["logprob_start_len"], 2);

    // What each failure becomes: a 400 and a misaligned answer are this turn's (dead letter), a 401 and
    // exhausted retries stop the stage.
    let turn_code = |r: Result<nextstate::model::ScoredResponse, RemoteFailure>| match r {
        Err(RemoteFailure::Turn { code, .. }) => code,
        other => panic!("expected a turn failure, got {other:?}"),
    };
    *fake.script.lock().unwrap() = vec![(400, json!({"error": "prompt too long"}))];
    assert_eq!(turn_code(client.score_one(&prompt, &response).await), "teacher_rejected");
    *fake.script.lock().unwrap() = vec![(200, sglang_answer())];
    assert_eq!(turn_code(client.score_one(&prompt, &[21, 23]).await), "teacher_bad_response", "token 23 is not what was scored");
    *fake.script.lock().unwrap() = vec![(200, sglang_answer())];
    assert_eq!(turn_code(client.score_one(&prompt, &[21]).await), "logprob_length_mismatch");
    let mut nan = sglang_answer();
    nan["meta_info"]["input_token_logprobs"][1][0] = Value::Null;
    *fake.script.lock().unwrap() = vec![(200, nan)];
    assert_eq!(turn_code(client.score_one(&prompt, &response).await), "non_finite_logprob");
    *fake.script.lock().unwrap() = vec![(401, json!({"error": "bad key"}))];
    assert!(matches!(client.score_one(&prompt, &response).await, Err(RemoteFailure::Unavailable(_))));
    *fake.script.lock().unwrap() = vec![(500, json!({})), (500, json!({})), (502, json!({}))];
    let e = match client.score_one(&prompt, &response).await {
        Err(RemoteFailure::Unavailable(e)) => e.to_string(),
        other => panic!("expected unavailable, got {other:?}"),
    };
    assert!(e.contains("after 3 attempt(s)") && e.contains("502"), "{e}");
}

#[test]
fn remote_backends_are_validated_and_keep_the_default_pipeline_hash() {
    let base = TeacherConfig::default();
    let json = serde_json::to_string(&base).unwrap();
    assert!(!json.contains("backend") && !json.contains("url") && !json.contains("timeout_s"), "{json}");
    let remote = |f: &dyn Fn(&mut TeacherConfig)| {
        let mut c = TeacherConfig { backend: TeacherBackend::Vllm, url: Some("http://h:1".into()), model: Some("m".into()), ..TeacherConfig::default() };
        f(&mut c);
        c.validate()
    };
    assert!(remote(&|_| {}).is_ok());
    assert!(remote(&|c| c.url = None).unwrap_err().to_string().contains("needs teacher.url"));
    assert!(remote(&|c| c.model = None).unwrap_err().to_string().contains("needs teacher.model"));
    assert!(remote(&|c| {
        c.candidates = 2;
        c.top_k = 4;
    })
    .unwrap_err()
    .to_string()
    .contains("needs teacher.backend = \"local\""));
    assert!(remote(&|c| c.timeout_s = 0.0).is_err());
    assert!(TeacherConfig { url: Some("http://h:1".into()), ..TeacherConfig::default() }.validate().is_err(), "a url with the local backend");
    let parsed: TeacherConfig = toml::from_str("backend = \"sglang\"\nurl = \"http://h:2\"\nmodel = \"Qwen/Qwen3-4B\"\napi_key_env = \"K\"").unwrap();
    assert_eq!((parsed.backend, parsed.remote_model().as_deref()), (TeacherBackend::Sglang, Some("Qwen/Qwen3-4B")));
}

/// The hint judge: every turn with a next state gets an accepted hint.
async fn always_hint(Json(_req): Json<Value>) -> Json<Value> {
    let content = "The user wanted the literal answer. \\boxed{1} [HINT_START]Answer the question exactly as asked, then stop.[HINT_END]";
    Json(json!({"id": "h", "object": "chat.completion", "model": "hinter",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}))
}

fn opd_pipeline(lake: &Path, hint_url: &str, model: &Path, teacher: TeacherConfig) -> nextstate::config::PipelineConfig {
    let base = "name = \"t-remote-teacher\"\nmethod = \"opd\"\n[hint]\nbackend = \"openai\"\nmodel = \"hinter\"\nm = 1\n[policy]\nthreads = 1\n";
    let mut cfg: nextstate::config::PipelineConfig = toml::from_str(base).unwrap();
    cfg.lake = lake.to_path_buf();
    cfg.hint.url = Some(hint_url.to_string());
    cfg.policy.model = model.to_path_buf();
    cfg.teacher = teacher;
    cfg.validate().unwrap();
    cfg
}

/// Real turns: the OpenHands log with a human correction.
fn real_turns() -> Vec<Interaction> {
    let path = common::data("agent-logs/openhands__basic_interactions.json");
    let mut rows = vec![];
    let opts = nextstate::ingest::IngestOptions::new(1_764_000_000_000);
    nextstate::ingest::read_path(&path, nextstate::ingest::FormatChoice::Auto, &opts, &mut |_| {}, &mut |item| {
        if let nextstate::ingest::IngestItem::Interaction(i) = item {
            rows.push(*i);
        }
        Ok(())
    })
    .unwrap();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_teacher_on_our_server_matches_the_local_teacher() {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let (serve_url, stop) = common::start_policy_server(&model, None).await;
    let hint_url = serve_on_loopback(Router::new().route("/v1/chat/completions", post(always_hint))).await;

    let turns = real_turns();
    assert!(turns.len() >= 2, "the OpenHands log has several turns: {}", turns.len());
    let dir = tempfile::tempdir().unwrap();
    let mut rows_by_backend = vec![];
    let local_teacher = TeacherConfig { top_k: 4, batch: 2, ..TeacherConfig::default() };
    let vllm_teacher = TeacherConfig {
        backend: TeacherBackend::Vllm,
        url: Some(serve_url.clone()),
        model: Some(PathBuf::from("smollm2-135m-instruct")),
        ..local_teacher.clone()
    };
    for (name, teacher) in [("local", local_teacher), ("vllm", vllm_teacher)] {
        let lake_dir = dir.path().join(name);
        Lake::open(&lake_dir).unwrap().write_rows(&turns, "test", 1).unwrap();
        let cfg = opd_pipeline(&lake_dir, &hint_url, &model, teacher);
        let run = nextstate::stages::run::RunOptions {
            only: Some(["signals", "hint", "teacher", "sinks"].iter().map(|s| s.to_string()).collect()),
            until_idle: true,
            ..Default::default()
        };
        let report = nextstate::stages::run::run_pipeline(&cfg, &run, nextstate::runtime::Stop::default()).await.unwrap();
        let counts = &report.stages["teacher"];
        assert!(counts.outcomes.keys().all(|k| !k.starts_with("dead_letter")), "{name}: {counts:?}");
        let mut rows = Lake::open(&lake_dir).unwrap().read_table::<TeacherLogprobs>().unwrap();
        rows.sort_by(|a, b| a.interaction_id.cmp(&b.interaction_id));
        assert!(!rows.is_empty(), "{name}: no teacher rows ({counts:?})");
        rows_by_backend.push(rows);
    }
    let (local, remote) = (&rows_by_backend[0], &rows_by_backend[1]);
    assert_eq!(local.len(), remote.len());
    let (mut tokens, mut max_diff) = (0, 0f32);
    for (l, r) in local.iter().zip(remote) {
        assert_eq!(l.interaction_id, r.interaction_id);
        assert_eq!((&l.teacher_model, l.teacher_version), (&r.teacher_model, r.teacher_version), "the served model id at version 0");
        assert_eq!(l.teacher_prompt_token_ids, r.teacher_prompt_token_ids);
        assert_eq!(l.response_token_ids, r.response_token_ids);
        assert_eq!(l.teacher_logprobs.len(), l.response_token_ids.len());
        for (t, (a, b)) in l.teacher_logprobs.iter().zip(&r.teacher_logprobs).enumerate() {
            assert!((a - b).abs() < 1e-4, "{}: token {t}: local {a} vs vllm {b}", l.interaction_id);
            max_diff = max_diff.max((a - b).abs());
        }
        assert_eq!(l.topk_ids, r.topk_ids, "{}: top-K ids", l.interaction_id);
        let (lk, rk) = (l.topk_logprobs.as_ref().unwrap(), r.topk_logprobs.as_ref().unwrap());
        for (a, b) in lk.iter().flatten().zip(rk.iter().flatten()) {
            assert!((a - b).abs() < 1e-4, "{}: top-K log-prob {a} vs {b}", l.interaction_id);
        }
        tokens += l.response_token_ids.len();
    }
    assert!(tokens > 0);
    eprintln!("local vs vllm teacher: {} rows, {tokens} response tokens, largest difference {max_diff:e} nats", local.len());

    // The vllm run's rows came from the server: the teacher stage's start-up probe, then one request
    // per teacher row.
    let client = nextstate::net::http_client(None).unwrap();
    let health: Value = client.get(format!("{serve_url}/health")).send().await.unwrap().json().await.unwrap();
    assert_eq!(health["requests_completed"].as_u64(), Some(1 + remote.len() as u64), "{health}");

    // The route itself: vLLM's shape, the local scorer's values, ranks in the whole vocabulary.
    let post = |body: Value| {
        let (client, url) = (client.clone(), format!("{serve_url}/v1/completions"));
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let ids: Vec<u32> = local[0].teacher_prompt_token_ids.iter().take(16).map(|&x| x as u32).collect();
    let (status, v) = post(json!({"model": "smollm2-135m-instruct", "prompt": ids, "max_tokens": 0, "prompt_logprobs": 3})).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!((choice["text"].as_str(), choice["prompt_token_ids"].clone()), (Some(""), json!(ids)));
    let positions = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(positions.len(), ids.len());
    assert!(positions[0].is_null(), "no log-prob for the first prompt token");
    let lm = nextstate::model::LanguageModel::load(&model, &nextstate::model::LoadOptions::default()).unwrap();
    let want = lm.score_ranked(&[(ids[..1].to_vec(), ids[1..].to_vec())], 3).unwrap().remove(0);
    let (want_top, want_ranks) = (want.topk_ids.as_ref().unwrap(), want.ranks.as_ref().unwrap());
    for (t, pos) in positions[1..].iter().enumerate() {
        let m = pos.as_object().unwrap();
        let own = &m[&ids[t + 1].to_string()];
        assert!((own["logprob"].as_f64().unwrap() as f32 - want.logprobs[t]).abs() < 1e-5, "position {}", t + 1);
        assert!(own["decoded_token"].is_string());
        match want_top[t].iter().position(|&x| x == ids[t + 1]) {
            Some(j) => assert_eq!((m.len(), own["rank"].as_u64()), (3, Some(j as u64 + 1))),
            None => assert_eq!((m.len(), own["rank"].as_u64()), (4, Some(u64::from(want_ranks[t])))),
        }
        for (j, id) in want_top[t].iter().enumerate() {
            assert_eq!(m[&id.to_string()]["rank"], json!(j + 1));
        }
    }
    assert!(want_ranks.iter().all(|&r| r >= 1));
    // Greedy generation after the prompt, and a text prompt.
    let (status, v) = post(json!({"prompt": ids, "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(status, 200, "{v}");
    let gen = v["choices"][0]["token_ids"].as_array().unwrap();
    assert!(!gen.is_empty() && gen.len() <= 3, "{v}");
    assert!(v["choices"][0]["prompt_logprobs"].is_null());
    let (status, v) = post(json!({"prompt": "The capital of France is", "max_tokens": 0, "prompt_logprobs": 0})).await;
    assert_eq!(status, 200, "{v}");
    let n = v["choices"][0]["prompt_token_ids"].as_array().unwrap().len();
    assert_eq!(v["choices"][0]["prompt_logprobs"].as_array().map(Vec::len), Some(n));
    assert!(v["choices"][0]["prompt_logprobs"][1].as_object().is_some_and(|m| m.len() == 1));
    // Refused: what this route does not do.
    for bad in [
        json!({"prompt": ids, "n": 2}),
        json!({"prompt": ids, "stream": true}),
        json!({"prompt": ids, "echo": true}),
        json!({"prompt": ids, "prompt_logprobs": 1000}),
        json!({"prompt": [99_999_999u32], "max_tokens": 0, "prompt_logprobs": 1}),
        json!({"prompt": [[1, 2], [3, 4]]}),
        json!({"prompt": []}),
    ] {
        let (status, v) = post(bad.clone()).await;
        assert_eq!(status, 400, "{bad} → {v}");
        assert!(v["error"]["message"].is_string());
    }
    let _ = stop.send(());
}

/// The start-up probe (`RemoteTeacher::probe`) stops a systematically wrong endpoint with the setting
/// to check, and lets a good one (and one not up yet) through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_up_probe_names_the_setting_of_a_wrong_endpoint() {
    let fake = FakeSglang::default();
    let app = Router::new().route("/v1/completions", post(fake_generate)).route("/generate", post(fake_generate)).with_state(fake.clone());
    let url = serve_on_loopback(app).await;
    let client = |backend: TeacherBackend, url: &str, top_k: usize| {
        let cfg = TeacherConfig { backend, url: Some(url.to_string()), model: Some(PathBuf::from("teacher-x")), top_k, retries: 0, backoff_base_ms: 1, timeout_s: 5.0, ..TeacherConfig::default() };
        cfg.validate().unwrap();
        RemoteTeacher::new(&cfg).unwrap()
    };
    // vLLM refusing more prompt log-probs than its --max-logprobs (its 400 answer's wording).
    // (each wrong answer three times: the probe tries PROBE_TRIES times before it calls the endpoint wrong)
    *fake.script.lock().unwrap() = vec![(400, json!({"object": "error", "message": "Requested prompt logprobs of 8, which is greater than max allowed: 5", "code": 400})); 3];
    let e = client(TeacherBackend::Vllm, &url, 8).probe(&[11], &[21]).await.unwrap_err().to_string();
    assert!(e.contains("[teacher] start-up probe") && e.contains("[teacher] top_k = 8") && e.contains("--max-logprobs"), "{e}");
    // A server without prompt log-probs (an OpenAI-compatible server that ignores the extension).
    *fake.script.lock().unwrap() = vec![(200, json!({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})); 3];
    let e = client(TeacherBackend::Vllm, &url, 0).probe(&[11], &[21]).await.unwrap_err().to_string();
    assert!(e.contains("prompt_logprobs") && e.contains("check the backend"), "{e}");
    // The wrong backend kind: sglang pointed at a vLLM-only server → 404 on /generate.
    let only_vllm = serve_on_loopback(Router::new().route("/v1/completions", post(fake_generate)).with_state(fake.clone())).await;
    let e = client(TeacherBackend::Sglang, &only_vllm, 0).probe(&[11], &[21]).await.unwrap_err().to_string();
    assert!(e.contains("HTTP status 404") && e.contains("[teacher] backend = \"sglang\""), "{e}");
    // A flaky server (one bad answer, then a good one) passes, as does a good answer and a server that
    // is not up yet (the stage stops on the first turn then).
    let good = json!({"meta_info": {"input_token_logprobs": [[null, 11, null], [-0.5, 21, null]]}});
    *fake.script.lock().unwrap() = vec![(200, json!({"text": "<html>"})), (200, good.clone())];
    client(TeacherBackend::Sglang, &url, 0).probe(&[11], &[21]).await.unwrap();
    assert!(fake.script.lock().unwrap().is_empty(), "two requests");
    *fake.script.lock().unwrap() = vec![(200, json!({"meta_info": {"input_token_logprobs": [[null, 11, null], [-0.5, 21, null]]}}))];
    client(TeacherBackend::Sglang, &url, 0).probe(&[11], &[21]).await.unwrap();
    client(TeacherBackend::Sglang, "http://127.0.0.1:9", 0).probe(&[11], &[21]).await.unwrap();
}
