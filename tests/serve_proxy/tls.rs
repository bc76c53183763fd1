//! TLS end to end: a private CA made by the test (rcgen), https judge and hint endpoints served by our
//! own TLS listener (`nextstate::net::serve_app`), and the pipeline trusting that CA through
//! `[tls] ca_file`. An endpoint whose certificate no trusted CA signed makes every vote invalid with the
//! TLS reason, after one attempt (a certificate is not retried). Our `serve` over https answers an
//! https client, and a plain-http client gets no answer from it. A self-signed `CA:TRUE` server
//! certificate (what `openssl req -x509` makes) listed itself in `ca_file` is pinned: accepted for its
//! names, refused for another, and one not listed is refused with what to do about it.
use crate::common;

use std::path::{Path, PathBuf};

use axum::routing::post;
use axum::{Json, Router};
use nextstate::lake::Lake;
use nextstate::schema::{Interaction, Judgment, Message, TurnType};
use common::{make_pki, Pki};

/// The scripted judge and hint model of tests/e2e/pipeline.rs, reduced: every judged turn scores 1, every
/// hinted turn gets the same hint.
async fn scripted(kind: &'static str, Json(_req): Json<serde_json::Value>) -> Json<serde_json::Value> {
    let content = match kind {
        "judge" => "The user moved on. \\boxed{1}",
        _ => "\\boxed{1} [HINT_START]State the sum as a single number.[HINT_END]",
    };
    Json(serde_json::json!({"id": "x", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}))
}

/// Serves the scripted endpoints over https with `pki`'s certificate; returns `https://127.0.0.1:PORT`.
async fn start_https(pki: &Pki) -> String {
    let app = Router::new().route("/judge/v1/chat/completions", post(|b| scripted("judge", b))).route("/hint/v1/chat/completions", post(|b| scripted("hint", b)));
    let tls = nextstate::net::ServerTls { cert_file: pki.cert.clone(), key_file: pki.key.clone() };
    let l = nextstate::net::Listener::bind("127.0.0.1", 0, Some(&tls)).await.unwrap();
    let url = l.url().unwrap();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    tokio::spawn(nextstate::net::serve_app(l, app, std::future::pending()));
    url
}

/// The process's client trust (`[tls] ca_file`) is global: the tests that set it take turns.
static TRUST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A self-signed server certificate with the properties of the `openssl req -x509` one-liner: `CA:TRUE`
/// (unconstrained), CN and SAN `localhost`, SAN `127.0.0.1` (rcgen, ECDSA P-256), written as
/// `<name>-cert.pem` and `<name>-key.pem`; the returned [`Pki`]'s `ca` is the certificate itself (pin it).
fn self_signed(dir: &Path, name: &str) -> Pki {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    let p = Pki { ca: dir.join(format!("{name}-cert.pem")), cert: dir.join(format!("{name}-cert.pem")), key: dir.join(format!("{name}-key.pem")) };
    std::fs::write(&p.cert, cert.pem()).unwrap();
    std::fs::write(&p.key, key.serialize_pem()).unwrap();
    p
}

/// A client with the process's trust that resolves `host` to the test server at `url`
/// (`https://127.0.0.1:PORT`); returns it and `https://host:PORT`.
fn client_for(url: &str, host: &str) -> (reqwest::Client, String) {
    let addr: std::net::SocketAddr = url.trim_start_matches("https://").parse().unwrap();
    let client = nextstate::net::client_builder().unwrap().resolve(host, addr).timeout(std::time::Duration::from_secs(10)).build().unwrap();
    (client, format!("https://{host}:{}", addr.port()))
}

/// The judge's answer through `client`, or the error's full chain.
async fn ask_judge(client: &reqwest::Client, base: &str) -> Result<String, String> {
    let body = serde_json::json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
    match client.post(format!("{base}/judge/v1/chat/completions")).json(&body).send().await {
        Ok(r) => {
            let v: serde_json::Value = r.json().await.unwrap();
            Ok(v["choices"][0]["message"]["content"].as_str().unwrap().to_string())
        }
        Err(e) => {
            assert!(nextstate::net::is_tls_error(&e), "not a TLS failure: {e:?}");
            Err(nextstate::net::error_chain(&e))
        }
    }
}

/// Two sessions, each a main turn answered by the user's next message.
fn sessions() -> Vec<Interaction> {
    (1..=2)
        .map(|i| {
            let q = Message::text("user", format!("What is {i} plus {i}?"));
            let req = serde_json::to_string(&vec![q]).unwrap();
            Interaction {
                turn_type: TurnType::Main,
                policy_version: Some(0),
                finish_reason: Some("stop".into()),
                source_format: "test".into(),
                ingest_time: 1_764_000_000_000,
                ..Interaction::new(&format!("tls-{i}"), 0, &req, &format!("It is {}.", 2 * i), 1_764_000_000_000 + i as i64)
            }
        })
        .flat_map(|first| {
            let sid = first.session_id.clone();
            let mut msgs: Vec<Message> = serde_json::from_str(&first.request_messages).unwrap();
            msgs.push(Message::text("assistant", first.response_text.clone()));
            msgs.push(Message::text("user", "ok, next one please."));
            let second = Interaction {
                turn_type: TurnType::Side,
                session_done: true,
                policy_version: Some(0),
                finish_reason: Some("stop".into()),
                source_format: "test".into(),
                ingest_time: 1_764_000_000_000,
                ..Interaction::new(&sid, 1, &serde_json::to_string(&msgs).unwrap(), "bye", first.event_time + 1000)
            };
            [first, second]
        })
        .collect()
}

fn pipeline(lake: &Path, url: &str, ca: Option<&Path>) -> nextstate::config::PipelineConfig {
    pipeline_with(lake, url, ca, "")
}

/// The pipeline with `extra` TOML tables appended (a teacher, a policy).
fn pipeline_with(lake: &Path, url: &str, ca: Option<&Path>, extra: &str) -> nextstate::config::PipelineConfig {
    let tls = ca.map(|c| format!("[tls]\nca_file = \"{}\"\n", c.display())).unwrap_or_default();
    let toml = format!(
        r#"name = "tls"
method = "combined"
lake = "{}"
{tls}
[judge]
backend = "openai"
url = "{url}/judge"
model = "scripted"
m = 2
retries = 3
backoff_base_ms = 10
[hint]
backend = "openai"
url = "{url}/hint"
model = "scripted"
m = 1
{extra}
"#,
        lake.display()
    );
    let cfg: nextstate::config::PipelineConfig = toml::from_str(&toml).unwrap();
    cfg.validate().unwrap();
    cfg
}

/// Runs signals, judge and hint; every vote is valid (score 1) and every turn gets the scripted hint.
async fn judged_and_hinted_over_https(cfg: &nextstate::config::PipelineConfig) {
    run_judge_and_hint(cfg).await;
    let lake = Lake::open(&cfg.lake).unwrap();
    let judgments = lake.read_table::<Judgment>().unwrap();
    assert_eq!(judgments.len(), 2, "{judgments:?}");
    for j in &judgments {
        assert_eq!((j.valid_votes, j.score), (2, 1), "{j:?}");
        assert!(j.votes.iter().all(|v| v.error.is_none() && v.value == Some(1)), "{j:?}");
    }
    let hints = lake.read_table::<nextstate::schema::HintRecord>().unwrap();
    assert_eq!(hints.len(), 2);
    assert!(hints.iter().all(|h| h.chosen_hint.as_deref() == Some("State the sum as a single number.")), "{hints:?}");
}

async fn run_judge_and_hint(cfg: &nextstate::config::PipelineConfig) -> nextstate::stages::run::RunReport {
    run_stages(cfg, &["signals", "judge", "hint", "sinks"]).await
}

async fn run_stages(cfg: &nextstate::config::PipelineConfig, stages: &[&str]) -> nextstate::stages::run::RunReport {
    let lake = Lake::open(&cfg.lake).unwrap();
    lake.write_rows(&sessions(), "test", 1).unwrap();
    let opts = nextstate::stages::run::RunOptions {
        only: Some(stages.iter().map(|s| s.to_string()).collect()),
        until_idle: true,
        ..Default::default()
    };
    nextstate::stages::run::run_pipeline(cfg, &opts, nextstate::runtime::Stop::default()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_and_hint_over_https_with_a_private_ca() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "private");
    let url = start_https(&pki).await;
    let cfg = pipeline(&dir.path().join("lake"), &url, Some(&pki.ca));
    judged_and_hinted_over_https(&cfg).await;
}

/// The issue's "done when": judge, hint and the remote teacher all on https endpoints signed by the
/// private CA. The teacher is our own policy server (SmolLM2) listening on https, asked as a vLLM server
/// (`/v1/completions` with `prompt_logprobs`); every trainable turn becomes a sample with teacher
/// log-probs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_hint_and_remote_teacher_over_https_with_a_private_ca() {
    let _trust = TRUST.lock().await;
    let model = common::root().join("models/smollm2-135m-instruct");
    if !model.join("model.safetensors").is_file() {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "private");
    let url = start_https(&pki).await;
    let tls = nextstate::net::ServerTls { cert_file: pki.cert.clone(), key_file: pki.key.clone() };
    let (teacher_url, _stop) = common::start_policy_server(&model, Some(&tls)).await;
    assert!(teacher_url.starts_with("https://"), "{teacher_url}");
    let extra = format!(
        "[teacher]\nbackend = \"vllm\"\nurl = \"{teacher_url}\"\nmodel = \"smollm2-135m-instruct\"\n[policy]\nmodel = \"{}\"\nthreads = 1\n",
        model.display()
    );
    let cfg = pipeline_with(&dir.path().join("lake"), &url, Some(&pki.ca), &extra);
    let report = run_stages(&cfg, &["signals", "judge", "hint", "teacher", "sinks"]).await;
    let teacher = &report.stages["teacher"].outcomes;
    assert!(teacher.keys().all(|k| !k.starts_with("dead_letter")), "{teacher:?}");
    let lake = Lake::open(&cfg.lake).unwrap();
    let rows = lake.read_table::<nextstate::schema::TeacherLogprobs>().unwrap();
    assert_eq!(rows.len(), 2, "one teacher row per hinted turn: {teacher:?}");
    for r in &rows {
        assert_eq!(r.teacher_model, "smollm2-135m-instruct");
        assert_eq!(r.teacher_logprobs.len(), r.response_token_ids.len());
        assert!(r.teacher_logprobs.iter().all(|l| l.is_finite() && *l <= 0.0), "{r:?}");
    }
    let samples = lake.read_table::<nextstate::schema::Sample>().unwrap();
    assert_eq!(samples.len(), 2, "{samples:?}");
    assert!(samples.iter().all(|s| s.teacher_logprobs.as_ref().is_some_and(|t| t.len() == s.response_token_ids.len())), "{samples:?}");
}

/// An endpoint whose certificate nobody trusts is systematically wrong: the judge stage's start-up
/// probe stops the run before any turn is read, with the TLS reason and what to do (before the probe,
/// every vote became invalid with that reason instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_stops_the_judge_at_start_with_the_tls_reason() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // The endpoint's certificate is signed by a CA nobody trusts; the pipeline trusts another one.
    let rogue = make_pki(dir.path(), "rogue");
    let trusted = make_pki(dir.path(), "trusted");
    let url = start_https(&rogue).await;
    let cfg = pipeline(&dir.path().join("lake"), &url, Some(&trusted.ca));
    let lake = Lake::open(&cfg.lake).unwrap();
    lake.write_rows(&sessions(), "test", 1).unwrap();
    let opts = nextstate::stages::run::RunOptions { only: Some(vec!["signals".into(), "judge".into(), "sinks".into()]), until_idle: true, ..Default::default() };
    let e = format!("{:#}", nextstate::stages::run::run_pipeline(&cfg, &opts, nextstate::runtime::Stop::default()).await.unwrap_err());
    assert!(e.contains("[judge] start-up probe") && e.contains("TLS error") && e.contains("UnknownIssuer"), "{e}");
    assert!(e.contains(&format!("tls.ca_file {}", trusted.ca.display())) && e.contains("make a CA") && e.contains("[tls] ca_file"), "without what to do: {e}");
    assert!(lake.read_table::<Judgment>().unwrap_or_default().is_empty(), "no turn was judged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_answers_https_and_refuses_plain_http() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "listener");
    let url = start_https(&pki).await;
    nextstate::net::set_extra_ca_file(Some(pki.ca.clone()));
    let client = nextstate::net::http_client(Some(std::time::Duration::from_secs(10))).unwrap();
    let body = serde_json::json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
    let v: serde_json::Value = client.post(format!("{url}/judge/v1/chat/completions")).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "The user moved on. \\boxed{1}");
    let plain = url.replacen("https://", "http://", 1);
    let r = client.post(format!("{plain}/judge/v1/chat/completions")).json(&body).send().await;
    assert!(r.is_err(), "plain http to a TLS listener must fail, got {r:?}");
}

#[test]
fn a_missing_ca_file_is_a_config_error_naming_it() {
    let cfg = nextstate::net::TlsConfig { ca_file: Some(PathBuf::from("/nonexistent/ca.pem")) };
    let e = cfg.apply().unwrap_err().to_string();
    assert!(e.contains("tls.ca_file") && e.contains("/nonexistent/ca.pem"), "{e}");
}

/// The issue: a self-signed `CA:TRUE` server certificate listed in `ca_file` was refused with
/// `CaUsedAsEndEntity`; pinned, it serves judge and hint to the pipeline like a CA-signed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_self_signed_ca_true_certificate_serves_judge_and_hint() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let server = self_signed(dir.path(), "pinned");
    let url = start_https(&server).await;
    let cfg = pipeline(&dir.path().join("lake"), &url, Some(&server.ca));
    judged_and_hinted_over_https(&cfg).await;
}

/// Pinning is by the exact certificate: another self-signed one in `ca_file` does not vouch for the
/// server's, and the refusal says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_certificate_not_listed_in_ca_file_is_refused_with_what_to_do() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let server = self_signed(dir.path(), "server");
    let other = self_signed(dir.path(), "other");
    let url = start_https(&server).await;
    nextstate::net::set_extra_ca_file(Some(other.ca.clone()));
    let (client, base) = client_for(&url, "localhost");
    let e = ask_judge(&client, &base).await.unwrap_err();
    assert!(e.contains("invalid peer certificate") && e.contains("CaUsedAsEndEntity"), "{e}");
    assert!(e.contains(&format!("neither signed by a trusted CA nor listed itself in tls.ca_file {}", other.ca.display())), "{e}");
    assert!(e.contains("add its own certificate to that file") && e.contains("make a CA, sign a server certificate"), "{e}");
}

/// A pinned certificate still has to name the host asked for: `localhost` is served, `judge.internal`
/// (resolved to the same server) is refused with the name mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_certificate_is_refused_for_a_host_name_it_does_not_carry() {
    let _trust = TRUST.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let server = self_signed(dir.path(), "named");
    let url = start_https(&server).await;
    nextstate::net::set_extra_ca_file(Some(server.ca.clone()));
    let (client, base) = client_for(&url, "localhost");
    assert_eq!(ask_judge(&client, &base).await.unwrap(), "The user moved on. \\boxed{1}");
    let (client, base) = client_for(&url, "judge.internal");
    let e = ask_judge(&client, &base).await.unwrap_err();
    assert!(e.contains("certificate not valid for name \"judge.internal\"") && e.contains("localhost"), "{e}");
    assert!(!e.contains("tls.ca_file"), "a name mismatch is not a trust problem: {e}");
}

/// The issue's certificate itself: `openssl req -x509 -newkey rsa:2048 -nodes ... -subj /CN=localhost
/// -addext subjectAltName=DNS:localhost` (RSA, `CA:TRUE`), pinned, answers at `https://localhost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openssl_one_liner_certificate_is_accepted_when_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .args(["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-days", "30"])
        .output();
    match made {
        Ok(o) if o.status.success() => {}
        other => {
            common::missing(&format!("openssl could not make the certificate: {other:?}"));
            return;
        }
    }
    let _trust = TRUST.lock().await;
    let server = Pki { ca: cert.clone(), cert, key };
    let url = start_https(&server).await;
    nextstate::net::set_extra_ca_file(Some(server.ca.clone()));
    let (client, base) = client_for(&url, "localhost");
    assert_eq!(ask_judge(&client, &base).await.unwrap(), "The user moved on. \\boxed{1}");
}
