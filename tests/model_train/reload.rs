//! Contract tests of the checkpoint reloads (`[serve] reload`, `nextstate run --only reload`) against
//! fake engines: small axum apps on 127.0.0.1:0 that implement the documented request and response of
//! each engine endpoint (vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/collective_rpc`;
//! SGLang's `/load_lora_adapter`, `/unload_lora_adapter`, `/update_weights_from_disk`,
//! `/get_weight_version`; ours `/v1/reload`), validating bodies as the engines' FastAPI models do
//! (422 on a missing or mistyped field). What these do not show — that the real vLLM and SGLang load
//! our checkpoint folders — needs a GPU run (see `nextstate::serve::reload`).
use crate::common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use nextstate::bus::{Bus, BusConfig};
use nextstate::runtime::{Stop, TaskCtl};
use nextstate::schema::{Checkpoint, Table};
use nextstate::serve::reload::{adapter_name, ReloadKind, ReloadOutcome, Reloader, RELOAD_ATTEMPTS};
use nextstate::stages::reload::{follow_checkpoints, follower_group, Follower};
use serde_json::{json, Value};

// ---------------------------------------------------------------- the fake engines

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Nextstate,
    Vllm,
    Sglang,
}

/// One request the fake received.
#[derive(Clone, Debug, PartialEq)]
struct Call {
    method: String,
    path: String,
    body: Value,
}

#[derive(Default)]
struct EngineState {
    calls: Vec<Call>,
    /// Loaded LoRA adapters: name → path.
    adapters: std::collections::BTreeMap<String, String>,
    /// The weights folder served (disk kinds) and SGLang's weight version.
    model_path: Option<String>,
    weight_version: Option<String>,
    /// vLLM: the model path `update_config` set (read by `reload_weights`).
    config_model: Option<String>,
    /// Ours: the policy version.
    version: i64,
    /// Forced answers for the next requests (status, body), consumed one per request.
    forced: Vec<(u16, String)>,
}

struct Fake {
    engine: Engine,
    state: Mutex<EngineState>,
}

fn json_resp(status: u16, v: Value) -> Response {
    (StatusCode::from_u16(status).unwrap(), [("content-type", "application/json")], v.to_string()).into_response()
}

/// FastAPI's answer to a body that does not fit the request model.
fn unprocessable(field: &str) -> Response {
    json_resp(422, json!({"detail": [{"type": "missing", "loc": ["body", field], "msg": "Field required"}]}))
}

fn str_field<'a>(b: &'a Value, k: &str) -> Option<&'a str> {
    b.get(k).and_then(Value::as_str)
}

/// vLLM's error body (`ErrorResponse`).
fn vllm_error(status: u16, msg: &str, kind: &str) -> Response {
    json_resp(status, json!({"object": "error", "message": msg, "type": kind, "param": null, "code": status}))
}

async fn fake_engine(State(f): State<Arc<Fake>>, method: Method, uri: Uri, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let body: Value = if body.is_empty() { Value::Null } else { serde_json::from_slice(&body).unwrap_or(Value::String("<not json>".into())) };
    let mut st = f.state.lock().unwrap();
    st.calls.push(Call { method: method.to_string(), path: path.clone(), body: body.clone() });
    if !st.forced.is_empty() {
        let (status, b) = st.forced.remove(0);
        return (StatusCode::from_u16(status).unwrap(), [("content-type", "application/json")], b).into_response();
    }
    match (f.engine, method.as_str(), path.as_str()) {
        // ours: src/serve/server.rs `reload` (deny_unknown_fields: path, version).
        (Engine::Nextstate, "POST", "/v1/reload") => {
            let (Some(p), Some(v)) = (str_field(&body, "path"), body.get("version").and_then(Value::as_i64)) else { return unprocessable("path/version") };
            if body.as_object().is_some_and(|o| o.len() != 2) {
                return json_resp(400, json!({"error": {"message": "unknown field", "type": "invalid_request_error"}}));
            }
            let prev = st.version;
            st.version = v;
            st.model_path = Some(p.to_string());
            json_resp(200, json!({"policy_version": v, "previous_version": prev, "path": p}))
        }
        // vLLM: LoadLoRAAdapterRequest {lora_name, lora_path}; plain-text success; 400 when the name is loaded.
        (Engine::Vllm, "POST", "/v1/load_lora_adapter") => {
            let (Some(n), Some(p)) = (str_field(&body, "lora_name"), str_field(&body, "lora_path")) else { return unprocessable("lora_name/lora_path") };
            if st.adapters.contains_key(n) {
                return vllm_error(400, &format!("The lora adapter '{n}' has already been loaded."), "InvalidUserInput");
            }
            st.adapters.insert(n.to_string(), p.to_string());
            (StatusCode::OK, format!("Success: LoRA adapter '{n}' added successfully.")).into_response()
        }
        (Engine::Vllm, "POST", "/v1/unload_lora_adapter") => {
            let Some(n) = str_field(&body, "lora_name") else { return unprocessable("lora_name") };
            if st.adapters.remove(n).is_none() {
                return vllm_error(404, &format!("The lora adapter '{n}' cannot be found."), "NotFoundError");
            }
            (StatusCode::OK, format!("Success: LoRA adapter '{n}' removed successfully.")).into_response()
        }
        // vLLM dev mode: {"method", "args"?, "kwargs"?, "timeout"?} → {"results": [...]} (one per worker).
        (Engine::Vllm, "POST", "/collective_rpc") => match str_field(&body, "method") {
            Some("update_config") => {
                let Some(m) = body.pointer("/kwargs/overrides/model_config/model").and_then(Value::as_str) else { return unprocessable("kwargs.overrides") };
                st.config_model = Some(m.to_string());
                json_resp(200, json!({"results": [null]}))
            }
            Some("reload_weights") => {
                st.model_path = st.config_model.clone();
                json_resp(200, json!({"results": [null]}))
            }
            Some(other) => json_resp(500, json!({"error": format!("worker has no method {other}")})),
            None => unprocessable("method"),
        },
        // SGLang: LoadLoRAAdapterReqInput {lora_name, lora_path, pinned?} → LoRAUpdateOutput.
        (Engine::Sglang, "POST", "/load_lora_adapter") => {
            let (Some(n), Some(p)) = (str_field(&body, "lora_name"), str_field(&body, "lora_path")) else { return unprocessable("lora_name/lora_path") };
            if st.adapters.contains_key(n) {
                return json_resp(400, json!({"success": false, "error_message": format!("LoRA adapter {n} is already loaded"), "loaded_adapters": st.adapters}));
            }
            st.adapters.insert(n.to_string(), p.to_string());
            json_resp(200, json!({"success": true, "error_message": null, "loaded_adapters": st.adapters}))
        }
        (Engine::Sglang, "POST", "/unload_lora_adapter") => {
            let Some(n) = str_field(&body, "lora_name") else { return unprocessable("lora_name") };
            if st.adapters.remove(n).is_none() {
                return json_resp(400, json!({"success": false, "error_message": format!("LoRA adapter {n} is not loaded")}));
            }
            json_resp(200, json!({"success": true, "error_message": null, "loaded_adapters": st.adapters}))
        }
        // SGLang: UpdateWeightFromDiskReqInput {model_path, load_format?, weight_version?, ...}.
        (Engine::Sglang, "POST", "/update_weights_from_disk") => {
            let Some(p) = str_field(&body, "model_path") else { return unprocessable("model_path") };
            if body.get("weight_version").is_some_and(|v| !v.is_string()) {
                return unprocessable("weight_version");
            }
            st.model_path = Some(p.to_string());
            if let Some(v) = str_field(&body, "weight_version") {
                st.weight_version = Some(v.to_string());
            }
            json_resp(200, json!({"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}))
        }
        (Engine::Sglang, "GET", "/get_weight_version") => json_resp(200, json!({"weight_version": st.weight_version})),
        // An OpenAI chat completion as SGLang answers it: no policy version anywhere.
        (Engine::Sglang, "POST", "/v1/chat/completions") => json_resp(
            200,
            json!({"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "logprobs": null, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
        ),
        _ => json_resp(404, json!({"detail": "Not Found"})),
    }
}

async fn start_engine(engine: Engine) -> (String, Arc<Fake>) {
    let f = Arc::new(Fake { engine, state: Mutex::new(EngineState::default()) });
    let app = Router::new().fallback(fake_engine).with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}"), f)
}

fn calls(f: &Fake) -> Vec<(String, String, Value)> {
    f.state.lock().unwrap().calls.iter().map(|c| (c.method.clone(), c.path.clone(), c.body.clone())).collect()
}

fn post(path: &str, body: Value) -> (String, String, Value) {
    ("POST".into(), path.into(), body)
}

fn reloader(kind: &str, urls: &[String]) -> Reloader {
    Reloader::new(ReloadKind::parse(kind).unwrap(), urls, Duration::from_secs(10)).unwrap()
}

fn ckpt_dir(v: i64) -> PathBuf {
    PathBuf::from(format!("/ckpt/run/{v}"))
}

fn loaded(o: &[ReloadOutcome]) -> Vec<i64> {
    o.iter().filter_map(|o| if let ReloadOutcome::Loaded { version, .. } = o { Some(*version) } else { None }).collect()
}

// ---------------------------------------------------------------- each kind's request

#[tokio::test]
async fn nextstate_kind_posts_path_and_version() {
    let (url, f) = start_engine(Engine::Nextstate).await;
    let r = reloader("nextstate", &[format!("{url}/v1")]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(1), 1).await), vec![1]);
    assert_eq!(calls(&f), vec![post("/v1/reload", json!({"path": "/ckpt/run/1", "version": 1}))]);
    assert_eq!(f.state.lock().unwrap().version, 1);
    assert_eq!(r.loaded().get(&url).version, Some(1));
}

#[tokio::test]
async fn vllm_lora_loads_each_version_as_an_adapter_and_unloads_the_previous_one() {
    let (url, f) = start_engine(Engine::Vllm).await;
    let r = reloader("vllm-lora", &[url.clone()]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(1), 1).await), vec![1]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(2), 2).await), vec![2]);
    assert_eq!(
        calls(&f),
        vec![
            post("/v1/load_lora_adapter", json!({"lora_name": "policy-v1", "lora_path": "/ckpt/run/1"})),
            post("/v1/load_lora_adapter", json!({"lora_name": "policy-v2", "lora_path": "/ckpt/run/2"})),
            post("/v1/unload_lora_adapter", json!({"lora_name": "policy-v1"})),
        ]
    );
    let st = f.state.lock().unwrap();
    assert_eq!(st.adapters.keys().cloned().collect::<Vec<_>>(), vec!["policy-v2".to_string()]);
    let rec = r.loaded().get(&url);
    assert_eq!((rec.version, rec.adapter.as_deref()), (Some(2), Some("policy-v2")));
}

#[tokio::test]
async fn sglang_lora_loads_and_unloads_by_name_and_reads_success() {
    let (url, f) = start_engine(Engine::Sglang).await;
    let r = reloader("sglang-lora", &[url.clone()]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(1), 1).await), vec![1]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(2), 2).await), vec![2]);
    assert_eq!(
        calls(&f),
        vec![
            post("/load_lora_adapter", json!({"lora_name": "policy-v1", "lora_path": "/ckpt/run/1"})),
            post("/load_lora_adapter", json!({"lora_name": "policy-v2", "lora_path": "/ckpt/run/2"})),
            post("/unload_lora_adapter", json!({"lora_name": "policy-v1"})),
        ]
    );
    assert_eq!(f.state.lock().unwrap().adapters.get("policy-v2").map(String::as_str), Some("/ckpt/run/2"));
}

#[tokio::test]
async fn sglang_disk_and_its_old_name_send_model_path_and_weight_version() {
    for kind in ["sglang-disk", "sglang"] {
        let (url, f) = start_engine(Engine::Sglang).await;
        let r = reloader(kind, &[url.clone()]);
        assert_eq!(loaded(&r.reload(&ckpt_dir(3), 3).await), vec![3], "{kind}");
        assert_eq!(calls(&f), vec![post("/update_weights_from_disk", json!({"model_path": "/ckpt/run/3", "weight_version": "3"}))], "{kind}");
        // The engine now reports the version it was given.
        let v: Value = nextstate::net::http_client(None).unwrap().get(format!("{url}/get_weight_version")).send().await.unwrap().json().await.unwrap();
        assert_eq!(v, json!({"weight_version": "3"}), "{kind}");
    }
}

#[tokio::test]
async fn vllm_disk_points_the_worker_config_at_the_checkpoint_then_reloads_weights() {
    let (url, f) = start_engine(Engine::Vllm).await;
    let r = reloader("vllm-disk", &[url.clone()]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(4), 4).await), vec![4]);
    assert_eq!(
        calls(&f),
        vec![
            post("/collective_rpc", json!({"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": "/ckpt/run/4"}}}})),
            post("/collective_rpc", json!({"method": "reload_weights"})),
        ]
    );
    assert_eq!(f.state.lock().unwrap().model_path.as_deref(), Some("/ckpt/run/4"));
}

#[tokio::test]
async fn none_sends_nothing_and_versions_only_move_forward() {
    let (url, f) = start_engine(Engine::Nextstate).await;
    assert!(reloader("none", &[url.clone()]).reload(&ckpt_dir(1), 1).await.is_empty());
    assert!(calls(&f).is_empty());
    let r = reloader("nextstate", &[url.clone()]);
    assert_eq!(loaded(&r.reload(&ckpt_dir(2), 2).await), vec![2]);
    for v in [1, 2] {
        let o = r.reload(&ckpt_dir(v), v).await;
        assert!(matches!(o.as_slice(), [ReloadOutcome::Skipped { loaded: 2, .. }]), "v{v}: {o:?}");
        assert_eq!(o[0].count_key(), "skipped_not_newer");
    }
    assert_eq!(calls(&f).len(), 1, "skipped versions send nothing");
}

#[tokio::test]
async fn several_servers_each_get_every_version() {
    let (a, fa) = start_engine(Engine::Sglang).await;
    let (b, fb) = start_engine(Engine::Sglang).await;
    let r = reloader("sglang-disk", &[a.clone(), b.clone(), format!("{a}/")]);
    assert_eq!(r.urls(), &[a.clone(), b.clone()], "duplicates removed");
    for v in 1..=2 {
        assert_eq!(loaded(&r.reload(&ckpt_dir(v), v).await), vec![v, v]);
    }
    for f in [&fa, &fb] {
        let versions: Vec<Value> = calls(f).iter().map(|c| c.2["weight_version"].clone()).collect();
        assert_eq!(versions, vec![json!("1"), json!("2")]);
    }
}

// ---------------------------------------------------------------- errors

fn failure(o: &[ReloadOutcome]) -> (&'static str, String) {
    match o {
        [ReloadOutcome::Failed(f)] => (f.reason, f.error.to_string()),
        other => panic!("expected one failure, got {other:?}"),
    }
}

#[tokio::test]
async fn a_4xx_fails_at_once_with_the_engines_message() {
    let (url, f) = start_engine(Engine::Vllm).await;
    let r = reloader("vllm-lora", &[url.clone()]);
    // vLLM refuses a second load under a loaded name.
    f.state.lock().unwrap().adapters.insert("policy-v1".into(), "/elsewhere".into());
    let o = r.reload(&ckpt_dir(1), 1).await;
    let (reason, msg) = failure(&o);
    assert_eq!(reason, "http_4xx");
    assert!(msg.contains("POST /v1/load_lora_adapter answered 400 Bad Request") && msg.contains("has already been loaded"), "{msg}");
    assert_eq!(o[0].count_key(), "failed: http_4xx");
    assert_eq!(calls(&f).len(), 1, "4xx is not retried");
    let rec = r.loaded().get(&url);
    assert_eq!((rec.version, rec.reloading), (None, false), "the server's version is unknown after a failure");
    // The next version loads.
    assert_eq!(loaded(&r.reload(&ckpt_dir(2), 2).await), vec![2]);
}

#[tokio::test]
async fn a_5xx_is_retried_then_counted() {
    let (url, f) = start_engine(Engine::Nextstate).await;
    let r = reloader("nextstate", &[url.clone()]);
    f.state.lock().unwrap().forced = vec![(500, r#"{"error":"disk full"}"#.into()); RELOAD_ATTEMPTS as usize];
    let (reason, msg) = failure(&r.reload(&ckpt_dir(1), 1).await);
    assert_eq!(reason, "http_5xx");
    assert!(msg.contains("answered 500 Internal Server Error: {\"error\":\"disk full\"}"), "{msg}");
    assert_eq!(calls(&f).len(), RELOAD_ATTEMPTS as usize);
    // A 5xx then success: loaded on the second try.
    f.state.lock().unwrap().forced = vec![(503, "{}".into())];
    assert_eq!(loaded(&r.reload(&ckpt_dir(2), 2).await), vec![2]);
}

#[tokio::test]
async fn sglang_success_false_is_a_refusal_and_a_dead_server_is_unreachable() {
    let (url, f) = start_engine(Engine::Sglang).await;
    f.state.lock().unwrap().forced = vec![(200, r#"{"success": false, "message": "Failed to get weights iterator: no safetensors"}"#.into())];
    let (reason, msg) = failure(&reloader("sglang-disk", &[url]).reload(&ckpt_dir(1), 1).await);
    assert_eq!(reason, "refused");
    assert!(msg.contains("no safetensors"), "{msg}");
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let (reason, msg) = failure(&reloader("sglang-disk", &[dead.clone()]).reload(&ckpt_dir(1), 1).await);
    assert_eq!(reason, "unreachable");
    assert!(msg.contains(&dead) && msg.contains("/update_weights_from_disk"), "{msg}");
}

#[test]
fn unknown_kinds_are_rejected_by_pipeline_validation_with_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.toml");
    std::fs::write(&p, "name = \"x\"\nmethod = \"binary\"\n[serve]\nreload = \"vllm\"\n").unwrap();
    let e = nextstate::config::PipelineConfig::load(&p).unwrap_err().to_string();
    assert!(e.contains("\"vllm\"") && e.contains("known: nextstate, none, vllm-lora, vllm-disk, sglang-lora, sglang-disk, sglang"), "{e}");
    std::fs::write(&p, "name = \"x\"\nmethod = \"binary\"\n[serve]\nreload = \"sglang-lora\"\nreload_urls = [\"http://a:1\", \"http://b:2\"]\n[trainer.lora]\nenabled = true\n").unwrap();
    let cfg = nextstate::config::PipelineConfig::load(&p).unwrap();
    assert_eq!(nextstate::serve::reload::reload_targets(&cfg.serve).len(), 2);
    // A LoRA reload with full-weight training (and a disk reload with LoRA) is refused up front.
    std::fs::write(&p, "name = \"x\"\nmethod = \"binary\"\n[serve]\nreload = \"sglang-lora\"\n").unwrap();
    let e = nextstate::config::PipelineConfig::load(&p).unwrap_err().to_string();
    assert!(e.contains("loads LoRA adapters, but the trainer writes full weights"), "{e}");
    std::fs::write(&p, "name = \"x\"\nmethod = \"binary\"\n[serve]\nreload = \"vllm-disk\"\n[trainer.lora]\nenabled = true\n").unwrap();
    let e = nextstate::config::PipelineConfig::load(&p).unwrap_err().to_string();
    assert!(e.contains("loads full weights, but the trainer writes LoRA adapters"), "{e}");
    std::fs::write(&p, "name = \"x\"\nmethod = \"binary\"\n[serve]\nreload = \"sglang-lora\"\nreload_urls = [\"http://a:1\", \"http://b:2\"]\n[trainer.lora]\nenabled = true\n").unwrap();
    let cfg = nextstate::config::PipelineConfig::load(&p).unwrap();
    assert_eq!(nextstate::serve::reload::reload_targets(&cfg.serve), vec!["http://a:1".to_string(), "http://b:2".to_string()]);
}

// ---------------------------------------------------------------- the follower

fn checkpoint(run: &str, v: i64) -> Checkpoint {
    Checkpoint {
        schema_version: Checkpoint::SCHEMA_VERSION,
        checkpoint_id: format!("{run}/{v}"),
        run_id: run.into(),
        tenant: None,
        version: v,
        parent_version: v - 1,
        step: v,
        method: "binary".into(),
        config_hash: "h".into(),
        path: ckpt_dir(v).display().to_string(),
        weights_format: "lora".into(),
        samples: 8,
        metrics: "{}".into(),
        lineage: "[]".into(),
        created_time: 1_700_000_000_000 + v,
    }
}

/// Versions the fake received, in order (`weight_version` of SGLang's disk reload).
fn weight_versions(f: &Fake) -> Vec<String> {
    calls(f).iter().filter(|c| c.1 == "/update_weights_from_disk").map(|c| c.2["weight_version"].as_str().unwrap_or("").to_string()).collect()
}

#[tokio::test]
async fn follower_reloads_each_checkpoint_of_its_run_in_order_and_ends_when_idle() {
    let (url, f) = start_engine(Engine::Sglang).await;
    let (url2, f2) = start_engine(Engine::Sglang).await;
    let bus = Bus::connect(BusConfig::default()).await.unwrap();
    bus.ensure_topics(&["checkpoints"]).await.unwrap();
    let r = reloader("sglang-disk", &[url.clone(), url2.clone()]);
    let group = follower_group(&bus, "p", &r);
    bus.expect_consumer(&group, "checkpoints");
    // A second follower (other servers) has its own group.
    assert_ne!(group, follower_group(&bus, "p", &reloader("sglang-disk", &[url.clone()])));
    let producer = bus.producer().unwrap();
    for row in [checkpoint("run", 1), checkpoint("other", 7), checkpoint("run", 2), checkpoint("run", 2), checkpoint("run", 3)] {
        producer.send(&row, None).await.unwrap();
    }
    // The second server refuses its first request (version 1) once.
    f2.state.lock().unwrap().forced = vec![(400, r#"{"success": false, "message": "bad checkpoint"}"#.into())];
    let log = Arc::new(Mutex::new(vec![]));
    let follower = Follower { group, run_id: "run".into(), reloader: r.clone(), local: None, loaded_log: Some(log.clone()) };
    let mut ctl = TaskCtl::new("reload", true, Stop::default());
    ctl.idle_ms = 300;
    let counts = tokio::time::timeout(Duration::from_secs(60), follow_checkpoints(&bus, &follower, &ctl)).await.expect("the follower ends when idle").unwrap();
    assert_eq!(weight_versions(&f), vec!["1", "2", "3"]);
    assert_eq!(weight_versions(&f2), vec!["1", "2", "3"], "the refused version was sent once, then the next ones");
    assert_eq!(f2.state.lock().unwrap().weight_version.as_deref(), Some("3"));
    assert_eq!(counts.get("loaded"), 5, "{}", counts.line());
    assert_eq!(counts.get("failed: http_4xx"), 1, "{}", counts.line());
    assert_eq!(counts.get("skipped_not_newer"), 2, "the duplicate v2 row, per server: {}", counts.line());
    assert_eq!(counts.get("other_run"), 1);
    assert_eq!(*log.lock().unwrap(), vec![1, 2, 3]);
    assert_eq!(r.loaded().get(&url).version, Some(3));
    assert_eq!(r.loaded().get(&url2).version, Some(3));
    // Offsets were committed: a restarted follower of the same group reloads nothing.
    let (url3, f3) = start_engine(Engine::Sglang).await;
    let again = Follower { reloader: reloader("sglang-disk", &[url3]), ..follower };
    let counts = tokio::time::timeout(Duration::from_secs(60), follow_checkpoints(&bus, &again, &ctl)).await.unwrap().unwrap();
    assert!(calls(&f3).is_empty(), "{}", counts.line());
}

/// `nextstate run --only reload` against the real broker: the trainer's topic gets versions 1, 2, 3 and
/// the fake server receives them in order; `--until-idle` ends the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_reload_follows_the_checkpoints_topic_of_a_real_broker() {
    let brokers = common::brokers();
    let prefix = common::prefix();
    let (url, f) = start_engine(Engine::Vllm).await;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.toml");
    std::fs::write(
        &p,
        format!(
            "name = \"reloadtest\"\nmethod = \"binary\"\nlake = {lake:?}\n[bus]\nbrokers = {brokers:?}\ntopic_prefix = {prefix:?}\n[serve]\nreload = \"vllm-lora\"\nreload_urls = [{url:?}]\n[trainer.lora]\nenabled = true\n",
            lake = dir.path().join("lake").display().to_string()
        ),
    )
    .unwrap();
    let cfg = nextstate::config::PipelineConfig::load(&p).unwrap();
    let bus = Bus::connect(cfg.bus.clone()).await.unwrap();
    bus.ensure_topics(&["checkpoints"]).await.unwrap();
    let producer = bus.producer().unwrap();
    for v in 1..=3 {
        producer.send(&checkpoint("reloadtest", v), None).await.unwrap();
    }
    let opts = nextstate::stages::run::RunOptions { only: Some(vec!["reload".into()]), until_idle: true, ..Default::default() };
    let report = tokio::time::timeout(Duration::from_secs(120), nextstate::stages::run::run_pipeline(&cfg, &opts, Stop::default())).await.expect("--until-idle ends").unwrap();
    let loads: Vec<String> = calls(&f).iter().filter(|c| c.1 == "/v1/load_lora_adapter").map(|c| c.2["lora_name"].as_str().unwrap().to_string()).collect();
    assert_eq!(loads, vec![adapter_name(1), adapter_name(2), adapter_name(3)]);
    let adapters: BTreeSet<String> = f.state.lock().unwrap().adapters.keys().cloned().collect();
    assert_eq!(adapters, BTreeSet::from([adapter_name(3)]), "earlier adapters unloaded");
    assert_eq!(report.reloads, vec![1, 2, 3]);
    assert_eq!(report.stages["reload"].get("loaded"), 3, "{}", report.stages["reload"].line());
}

// ---------------------------------------------------------------- the proxy's version read-back

/// Sends one chat turn for `model` in session `session` through the proxy at `proxy`.
async fn chat(proxy: &str, model: &str, session: &str) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    let r = nextstate::net::http_client(None).unwrap().post(format!("{proxy}/v1/chat/completions")).header("x-session-id", session).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// Reads interactions until `n` arrived (30 s at most); policy version per session.
async fn versions_by_session(bus: &Bus, n: usize) -> std::collections::BTreeMap<String, Option<i64>> {
    let mut input = nextstate::runtime::InputLoop::new(bus, &format!("test-{}", uuid::Uuid::new_v4().simple()), &bus.topic("interactions")).unwrap();
    let mut out = std::collections::BTreeMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while out.len() < n && std::time::Instant::now() < deadline {
        for m in input.next_batch(100, Duration::from_millis(300)).await.unwrap() {
            let env: nextstate::bus::Envelope<nextstate::schema::Interaction> = serde_json::from_slice(&m.payload).unwrap();
            out.insert(env.row.session_id.clone(), env.row.policy_version);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_records_the_version_the_reloader_confirmed_for_an_upstream_that_reports_none() {
    let bus = Bus::connect(BusConfig::default()).await.unwrap();
    bus.ensure_topics(&["interactions", "dead_letters"]).await.unwrap();
    let spool = tempfile::tempdir().unwrap();
    let start_proxy = |upstream: String, r: &Reloader| {
        let mut o = nextstate::serve::proxy::ProxyOptions::new(upstream);
        o.spool = nextstate::serve::proxy::emit::SpoolConfig::new(spool.path().join(uuid::Uuid::new_v4().simple().to_string()), 1 << 20);
        o.upstream_versions = Some(r.loaded());
        let bus = bus.clone();
        async move {
            let proxy = nextstate::serve::proxy::Proxy::start(o, &bus).await.unwrap();
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            tokio::spawn(proxy.serve(l, std::future::pending::<()>()));
            url
        }
    };
    // Full-weight reloads: every request after the confirmed reload is that version.
    let (disk_url, _f) = start_engine(Engine::Sglang).await;
    let disk = reloader("sglang-disk", &[disk_url.clone()]);
    let p1 = start_proxy(disk_url, &disk).await;
    chat(&p1, "m", "before-any-reload").await;
    assert_eq!(loaded(&disk.reload(&ckpt_dir(5), 5).await), vec![5]);
    chat(&p1, "m", "after-v5").await;
    // LoRA reloads: only a request for the loaded adapter is that version.
    let (lora_url, _g) = start_engine(Engine::Sglang).await;
    let lora = reloader("sglang-lora", &[lora_url.clone()]);
    let p2 = start_proxy(lora_url, &lora).await;
    assert_eq!(loaded(&lora.reload(&ckpt_dir(2), 2).await), vec![2]);
    chat(&p2, "base", "lora-base-model").await;
    chat(&p2, "base:policy-v2", "lora-adapter").await;
    let got = versions_by_session(&bus, 4).await;
    let want = std::collections::BTreeMap::from([
        ("before-any-reload".to_string(), None),
        ("after-v5".to_string(), Some(5)),
        ("lora-base-model".to_string(), None),
        ("lora-adapter".to_string(), Some(2)),
    ]);
    assert_eq!(got, want);
}
