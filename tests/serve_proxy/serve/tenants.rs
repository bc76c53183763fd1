//! Serving per tenant (issue 41): one server, the shared policy and LoRA adapters of several tenants on
//! its base. Every answer is compared with a direct greedy generation of a model loaded with that
//! tenant's adapter (or the shared policy), token id for token id.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nextstate::model::{LanguageModel, LoadOptions, LogprobMode, LoraConfig, LoraTarget, SamplingParams, Trainable};
use nextstate::schema::Message;
use nextstate::serve::{AdapterOptions, PolicyHandle, PolicyServer, ServerOptions};
use serde_json::{json, Value};

use super::common;

const PROMPT: &str = "Name a colour of the sky.";
const MAX_TOKENS: usize = 12;

/// A rank-`rank` adapter (α = 2·rank) on `base` on every projection, whose B matrices are N(0, scale²)
/// from `seed` (so it changes the answers), saved in PEFT's layout to `dir`.
pub(super) fn make_adapter(base: &Path, dir: &Path, rank: usize, seed: i64, scale: f64) {
    let lora = LoraConfig { rank, alpha: 2.0 * rank as f64, targets: LoraTarget::ALL.to_vec() };
    // Seeded before the load too: the A matrices are drawn there (unseeded, the adapter differed from
    // run to run and sometimes left a 12-token greedy answer unchanged). libtorch's generator is global:
    // one adapter at a time in this binary, so a concurrent test's draws cannot interleave.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    let lm = LanguageModel::load(base, &LoadOptions { trainable: Trainable::Lora(lora), ..Default::default() }).unwrap();
    let _g = tch::no_grad_guard();
    for (name, mut t) in lm.transformer().adapter_state() {
        if name.contains("lora_B") {
            t.copy_(&(tch::Tensor::randn_like(&t) * scale));
        }
    }
    lm.save_adapters(dir).unwrap();
}

/// The greedy answer (token ids) of the shared model (`adapter` None) or of `adapter` on `base`, as a
/// client with no server would get it.
fn direct(base: &Path, adapter: Option<&Path>) -> Vec<u32> {
    let lm = match adapter {
        None => LanguageModel::load(base, &LoadOptions::default()).unwrap(),
        Some(a) => LanguageModel::load_checkpoint(a, Some(base), &LoadOptions::default()).unwrap(),
    };
    let prompt = lm.chat_prompt_ids(&[Message::text("user", PROMPT)], None, true).unwrap();
    lm.generate(&[prompt], &SamplingParams::greedy(MAX_TOKENS)).unwrap().remove(0).token_ids
}

struct Fleet {
    url: String,
    handle: PolicyHandle,
    base: PathBuf,
    _dir: tempfile::TempDir,
    alice: PathBuf,
    bob: PathBuf,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Serves the model at `base` as the shared policy version 7, with `adapters`, a batching window and
/// `threads` libtorch threads (0: libtorch's choice): (URL, handle, the sender that stops it when dropped).
pub(super) async fn start_server(base: &Path, adapters: AdapterOptions, batch_window: Duration, threads: usize) -> (String, PolicyHandle, tokio::sync::oneshot::Sender<()>) {
    start_server_with(base, adapters, batch_window, threads, false).await
}

/// [`start_server`], shared-policy reloads folding a LoRA checkpoint into the weights when `merge_lora`.
async fn start_server_with(base: &Path, adapters: AdapterOptions, batch_window: Duration, threads: usize, merge_lora: bool) -> (String, PolicyHandle, tokio::sync::oneshot::Sender<()>) {
    let opts = ServerOptions {
        model_name: "smollm2".into(),
        api_key: None,
        health_requires_key: false,
        limits: Default::default(),
        max_body_bytes: 1 << 20,
        max_batch: 8,
        batch_window,
        default_max_tokens: 64,
        logprobs_mode: LogprobMode::Raw,
        load: LoadOptions::default(),
        base_dir: base.to_path_buf(),
        threads,
        merge_lora,
        continuous_batching: true,
    };
    let lm = LanguageModel::load(base, &LoadOptions::default()).unwrap();
    let server = PolicyServer::start_with_adapters(lm, 7, opts, adapters).unwrap();
    let handle = server.handle();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, async {
        let _ = rx.await;
    }));
    (url, handle, tx)
}

/// A server on the test model with `adapters`, and two adapters written (not yet loaded).
async fn fleet(adapters: AdapterOptions, batch_window: Duration) -> Option<Fleet> {
    tch::set_num_threads(1);
    let base = common::test_model_or_missing()?;
    let dir = tempfile::tempdir().unwrap();
    let (alice, bob) = (dir.path().join("alice/1"), dir.path().join("bob/1"));
    // Seeds whose adapters change the greedy answer (seed 1's leaves it as the base model's).
    make_adapter(&base, &alice, 4, 3, 0.05);
    make_adapter(&base, &bob, 4, 2, 0.05);
    let (url, handle, stop) = start_server(&base, adapters, batch_window, 0).await;
    Some(Fleet { url, handle, base, _dir: dir, alice, bob, _stop: stop })
}

/// One greedy chat completion with `headers` and body `model`: (status, X-Policy-Tenant, X-Policy-Version, body).
async fn ask(url: &str, headers: &[(&str, &str)], model: Option<&str>) -> (u16, Option<String>, String, Value) {
    let client = nextstate::net::http_client(None).unwrap();
    let mut body = json!({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    let mut req = client.post(format!("{url}/v1/chat/completions")).json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let tenant = r.headers().get("x-policy-tenant").map(|v| v.to_str().unwrap().to_string());
    let version = r.headers().get("x-policy-version").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    (status, tenant, version, r.json().await.unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_is_served_by_its_own_adapter_and_the_rest_by_the_shared_policy() {
    // A long batching window: the three concurrent requests below are drained into one batch.
    let Some(f) = fleet(AdapterOptions::default(), Duration::from_millis(300)).await else { return };
    assert_eq!(f.handle.reload_tenant("alice", f.alice.clone(), 3).await.unwrap(), None);
    assert_eq!(f.handle.reload_tenant("bob", f.bob.clone(), 5).await.unwrap(), None);
    let (want_shared, want_alice, want_bob) = (direct(&f.base, None), direct(&f.base, Some(&f.alice)), direct(&f.base, Some(&f.bob)));
    assert!(want_alice != want_shared && want_bob != want_shared && want_alice != want_bob, "the adapters change the answer: {want_shared:?} {want_alice:?} {want_bob:?}");

    // One batch of three policies: each request gets its own policy's answer.
    let (a, b, s) = tokio::join!(ask(&f.url, &[("x-agent-id", "alice")], None), ask(&f.url, &[("x-user-id", "bob")], None), ask(&f.url, &[], None));
    assert_eq!((a.0, a.1.as_deref(), a.2.as_str()), (200, Some("alice"), "3"));
    assert_eq!((a.3["policy_tenant"].as_str(), a.3["policy_version"].as_i64(), a.3["model"].as_str()), (Some("alice"), Some(3), Some("alice")));
    assert_eq!(ids(&a.3), want_alice);
    assert_eq!((b.0, b.1.as_deref(), b.2.as_str()), (200, Some("bob"), "5"));
    assert_eq!(ids(&b.3), want_bob);
    assert_eq!((s.0, s.1, s.2.as_str(), s.3["policy_tenant"].clone()), (200, None, "7", Value::Null));
    assert_eq!(ids(&s.3), want_shared);

    // The header decides: `model` cannot name another tenant's adapter; without a header it can. A tenant
    // without an adapter gets the shared policy.
    let by_header = ask(&f.url, &[("x-agent-id", "bob")], Some("alice")).await;
    assert_eq!((by_header.1.as_deref(), ids(&by_header.3)), (Some("bob"), want_bob.clone()));
    let by_model = ask(&f.url, &[], Some("alice")).await;
    assert_eq!((by_model.1.as_deref(), ids(&by_model.3)), (Some("alice"), want_alice.clone()));
    let carol = ask(&f.url, &[("x-agent-id", "carol")], Some("smollm2")).await;
    assert_eq!((carol.0, carol.1, carol.2.as_str(), carol.3["model"].as_str()), (200, None, "7", Some("smollm2")));
    assert_eq!(ids(&carol.3), want_shared);

    // An invalid tenant header is refused as the capture proxy refuses it.
    let bad = ask(&f.url, &[("x-agent-id", "team/a")], None).await;
    assert_eq!((bad.0, bad.3["error"]["code"].as_str()), (400, Some("invalid_tenant")));
    assert!(bad.3["error"]["message"].as_str().unwrap().starts_with("header x-agent-id: tenant id \"team/a\" has the character '/'"), "{}", bad.3);

    // /v1/models: the shared model and both adapters with their versions.
    let client = nextstate::net::http_client(None).unwrap();
    let m: Value = client.get(format!("{}/v1/models", f.url)).send().await.unwrap().json().await.unwrap();
    let listed: Vec<(String, i64, bool)> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].as_str().unwrap().to_string(), e["policy_version"].as_i64().unwrap(), e["resident"].as_bool().unwrap_or(true)))
        .collect();
    assert_eq!(listed, vec![("smollm2".into(), 7, true), ("alice".into(), 3, true), ("bob".into(), 5, true)]);

    // The completions route picks the adapter too.
    let r = client.post(format!("{}/v1/completions", f.url)).header("x-agent-id", "bob").json(&json!({"prompt": "The sky is", "max_tokens": 2, "temperature": 0})).send().await.unwrap();
    assert_eq!(r.headers()["x-policy-tenant"], "bob");
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["policy_version"].as_i64(), v["model"].as_str()), (Some(5), Some("bob")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_room_for_one_adapter_both_tenants_are_still_answered_by_their_own() {
    let Some(f) = fleet(AdapterOptions { max_adapters: 1, ..AdapterOptions::default() }, Duration::from_millis(10)).await else { return };
    f.handle.reload_tenant("alice", f.alice.clone(), 1).await.unwrap();
    f.handle.reload_tenant("bob", f.bob.clone(), 1).await.unwrap();
    let resident = |h: &PolicyHandle| h.tenant_adapters().into_iter().map(|a| (a.tenant, a.resident)).collect::<Vec<_>>();
    assert_eq!(resident(&f.handle), vec![("alice".into(), false), ("bob".into(), true)], "loading bob evicted alice");
    let (want_alice, want_bob) = (direct(&f.base, Some(&f.alice)), direct(&f.base, Some(&f.bob)));
    for (tenant, want) in [("alice", &want_alice), ("bob", &want_bob), ("alice", &want_alice)] {
        let (status, served, _, v) = ask(&f.url, &[("x-agent-id", tenant)], None).await;
        assert_eq!((status, served.as_deref()), (200, Some(tenant)), "{v}");
        assert_eq!(&ids(&v), want, "{tenant}, loaded again after its eviction");
        assert_eq!(resident(&f.handle).iter().filter(|(_, r)| *r).map(|(t, _)| t.as_str()).collect::<Vec<_>>(), vec![tenant]);
    }
    // Concurrent requests of both: each is answered by its own adapter, whatever the evictions.
    let (a, b) = tokio::join!(ask(&f.url, &[("x-agent-id", "alice")], None), ask(&f.url, &[("x-agent-id", "bob")], None));
    assert_eq!((ids(&a.3), ids(&b.3)), (want_alice, want_bob));
    // Each adapter's bytes are its LoRA tensors' (f32: 4 bytes an element).
    let lm = LanguageModel::load_checkpoint(&f.alice, Some(&f.base), &LoadOptions::default()).unwrap();
    let want: usize = lm.transformer().adapter_state().iter().map(|(_, t)| t.numel() * 4).sum();
    assert!(f.handle.tenant_adapters().iter().all(|a| a.bytes == want as u64), "{:?} vs {want}", f.handle.tenant_adapters());
    // Beyond them, a second adapter model shares the first's tokenizer (and base tensors).
    let other = LanguageModel::load_checkpoint(&f.bob, Some(&f.base), &LoadOptions::default()).unwrap();
    assert!(std::ptr::eq(lm.tokenizer(), other.tokenizer()), "one tokenizer for both");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_adapter_fails_its_own_reload_only() {
    let Some(f) = fleet(AdapterOptions::default(), Duration::from_millis(10)).await else { return };
    f.handle.reload_tenant("alice", f.alice.clone(), 1).await.unwrap();
    f.handle.reload_tenant("bob", f.bob.clone(), 1).await.unwrap();
    // Version 2 of alice: a truncated weights file.
    let broken = f.alice.parent().unwrap().join("2");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(f.alice.join("adapter_config.json"), broken.join("adapter_config.json")).unwrap();
    let weights = std::fs::read(f.alice.join("adapter_model.safetensors")).unwrap();
    std::fs::write(broken.join("adapter_model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let client = nextstate::net::http_client(None).unwrap();
    let reload = |body: Value| {
        let client = client.clone();
        let url = format!("{}/v1/reload", f.url);
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = reload(json!({"path": broken, "version": 2, "tenant": "alice"})).await;
    assert_eq!(status, 422, "{v}");
    // Nothing changed: alice keeps version 1, bob and the shared policy answer as before.
    let (want_shared, want_alice, want_bob) = (direct(&f.base, None), direct(&f.base, Some(&f.alice)), direct(&f.base, Some(&f.bob)));
    let a = ask(&f.url, &[("x-agent-id", "alice")], None).await;
    assert_eq!((a.2.as_str(), ids(&a.3)), ("1", want_alice));
    assert_eq!(ids(&ask(&f.url, &[("x-agent-id", "bob")], None).await.3), want_bob);
    assert_eq!(ids(&ask(&f.url, &[], None).await.3), want_shared);
    // Refusals: an older version (409), full weights as a tenant's checkpoint (422), an invalid id (400).
    let (status, _) = reload(json!({"path": f.bob, "version": 0, "tenant": "bob"})).await;
    assert_eq!(status, 409);
    let (status, v) = reload(json!({"path": f.base, "version": 9, "tenant": "bob"})).await;
    assert_eq!(status, 422, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("must be a LoRA adapter"), "{v}");
    let (status, v) = reload(json!({"path": f.bob, "version": 9, "tenant": "no/such"})).await;
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_tenant")));
    // A good reload over HTTP moves bob on; the failed loads were counted.
    let (status, v) = reload(json!({"path": f.alice, "version": 4, "tenant": "bob"})).await;
    assert_eq!((status, v["previous_version"].as_i64(), v["tenant"].as_str()), (200, Some(1), Some("bob")));
    let b = ask(&f.url, &[("x-agent-id", "bob")], None).await;
    assert_eq!((b.2.as_str(), ids(&b.3)), ("4", direct(&f.base, Some(&f.alice))));
    let metrics = nextstate::metrics::encode();
    assert!(metrics.contains("nextstate_server_adapter_loads_total{tenant=\"alice\",trigger=\"reload\",outcome=\"load_error\"}"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_checkpoint_reloaded_as_the_shared_policy_answers_as_the_model_loaded_directly_merged_or_not() {
    tch::set_num_threads(1);
    let Some(base) = common::test_model_or_missing() else { return };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run/9");
    make_adapter(&base, &ckpt, 4, 3, 0.05);
    let want = direct(&base, Some(&ckpt));
    assert_ne!(want, direct(&base, None), "the adapter changes the answer");
    for merge_lora in [false, true] {
        let (url, handle, _stop) = start_server_with(&base, AdapterOptions::default(), Duration::from_millis(5), 0, merge_lora).await;
        assert_eq!(handle.reload(ckpt.clone(), 9).await.unwrap(), 7, "merge_lora {merge_lora}: the previous version");
        let (status, tenant, version, body) = ask(&url, &[], None).await;
        assert_eq!((status, tenant, version.as_str()), (200, None, "9"), "merge_lora {merge_lora}");
        assert_eq!(ids(&body), want, "merge_lora {merge_lora}: the reloaded policy answers as the checkpoint loaded directly");
        assert!(handle.reload(ckpt.clone(), 8).await.unwrap_err().to_string().contains("older"), "merge_lora {merge_lora}");
        // The worker adds a batch's time after it has answered: poll a little.
        let mut t = handle.time_spent();
        for _ in 0..100 {
            if t.chat_seconds > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            t = handle.time_spent();
        }
        assert_eq!((t.reloads, t.completions_seconds), (1, 0.0), "merge_lora {merge_lora}: the refused reload is not counted");
        assert!(t.chat_seconds > 0.0 && t.reload_load_seconds > 0.0, "merge_lora {merge_lora}: {t:?}");
    }
    let text = nextstate::metrics::encode();
    for family in ["nextstate_server_reload_load_seconds_count", "nextstate_server_reload_swap_wait_seconds_count"] {
        let count: f64 = text.lines().find_map(|l| l.strip_prefix(family)).and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("{family} missing"));
        assert!(count >= 2.0, "{family} counts both reloads: {count}");
    }
}
