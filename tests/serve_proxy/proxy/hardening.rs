//! What the proxy's listener and error answers hold against slow, careless or hostile clients (issue
//! 38): slow clients (a silent connection, half-sent headers, a half-sent body) are dropped within the
//! configured timeouts while a good client is served meanwhile; connections beyond the cap wait for a
//! slot; an upstream URL's password is absent from every output (logs, error bodies, `/health`, the
//! CLI's start-up line); `/health` can be put behind the key; errors come in the API's own JSON shape
//! (a TLS failure says TLS and why, unknown routes get a JSON 404); the bearer scheme is matched in any
//! case. Timeouts here are a fraction of a second, so the tests stay fast.

use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nextstate::net::ListenLimits;
use rustls_pki_types::pem::PemObject;
use nextstate::serve::proxy::ProxyOptions;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{chat, common, embedded, opts, start_fake, start_proxy};

/// Short limits for the tests: headers within 400 ms, bodies within 600 ms.
fn short_limits(max_connections: usize) -> ListenLimits {
    ListenLimits { header_read_timeout: Duration::from_millis(400), body_read_timeout: Duration::from_millis(600), max_connections }
}

/// Reads until the server closes the connection (EOF or reset); returns what it sent and when it
/// closed. Fails the test when the connection is still open after `limit`.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let t = Instant::now();
    let mut got = vec![];
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(limit.saturating_sub(t.elapsed()), s.read(&mut buf)).await {
            Err(_) => panic!("connection still open after {limit:?} (got {:?})", String::from_utf8_lossy(&got)),
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), t.elapsed()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The three slow clients of the issue against `addr` (`host:port`): a silent connection, one that
/// sent half its headers, and one that sent its headers and a tenth of its body.
async fn slow_clients(addr: &str, path: &str) -> (Instant, TcpStream, TcpStream, TcpStream) {
    let opened = Instant::now();
    let silent = TcpStream::connect(addr).await.unwrap();
    let mut half_headers = TcpStream::connect(addr).await.unwrap();
    half_headers.write_all(format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Ty").as_bytes()).await.unwrap();
    let mut half_body = TcpStream::connect(addr).await.unwrap();
    half_body.write_all(format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\":").as_bytes()).await.unwrap();
    (opened, silent, half_headers, half_body)
}

/// Asserts the slow clients (opened at the first element) are dropped within the limits (with 1.5 s
/// of slack): the silent and half-headers connections closed without an answer, the half-body one
/// answered 408 with `want.1` at JSON pointer `want.0` of its body, and closed.
async fn assert_slow_clients_dropped(clients: (Instant, TcpStream, TcpStream, TcpStream), limits: ListenLimits, want: (&str, &str)) {
    let (opened, mut silent, mut half_headers, mut half_body) = clients;
    let slack = Duration::from_millis(1500);
    let (got, _) = read_until_closed(&mut silent, limits.header_read_timeout + slack).await;
    assert!(got.is_empty(), "a silent connection gets no answer, got {got:?}");
    assert!(opened.elapsed() + Duration::from_millis(50) >= limits.header_read_timeout, "closed before its timeout");
    let (got, _) = read_until_closed(&mut half_headers, limits.header_read_timeout + slack).await;
    assert!(!got.contains("200 OK"), "{got}");
    let (got, _) = read_until_closed(&mut half_body, limits.body_read_timeout + slack).await;
    assert!(got.starts_with("HTTP/1.1 408"), "a half-sent body gets 408, got {got:?}");
    assert!(got.to_ascii_lowercase().contains("connection: close"), "{got}");
    let body: Value = serde_json::from_str(got.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap_or(Value::Null);
    assert_eq!(body.pointer(want.0).and_then(Value::as_str), Some(want.1), "{got}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_dropped_while_a_good_client_is_served() {
    let (up, _f) = start_fake(Duration::ZERO).await;
    let bus = embedded().await;
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(&up, dir.path());
    o.limits = short_limits(64);
    let p = start_proxy(o, &bus).await;
    let addr = p.url.trim_start_matches("http://").to_string();
    let clients = slow_clients(&addr, "/v1/chat/completions").await;
    // A good client is served while the slow ones hang on.
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    let r = c.post(format!("{}/v1/chat/completions", p.url)).json(&chat("m", "hello there", json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_millis(400), "the good client waited {:?}", t.elapsed());
    // Anthropic clients get the 408 in their shape.
    let mut anthropic = TcpStream::connect(&addr).await.unwrap();
    anthropic.write_all(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{").await.unwrap();
    assert_slow_clients_dropped(clients, short_limits(64), ("/error/code", "body_timeout")).await;
    let (got, _) = read_until_closed(&mut anthropic, Duration::from_secs(3)).await;
    let body: Value = serde_json::from_str(got.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap_or(Value::Null);
    assert_eq!((body["type"].as_str(), body["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")), "{got}");
    // And still is afterwards.
    let r = c.post(format!("{}/v1/chat/completions", p.url)).json(&chat("m", "again", json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_for_a_slot() {
    let (up, _f) = start_fake(Duration::ZERO).await;
    let bus = embedded().await;
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(&up, dir.path());
    o.limits = ListenLimits { header_read_timeout: Duration::from_millis(700), ..short_limits(2) };
    let p = start_proxy(o, &bus).await;
    let addr = p.url.trim_start_matches("http://").to_string();
    // Two silent connections take both slots...
    let mut held = vec![TcpStream::connect(&addr).await.unwrap(), TcpStream::connect(&addr).await.unwrap()];
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ... so a third client waits until the header timeout frees one, then is served.
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    let r = c.post(format!("{}/v1/chat/completions", p.url)).json(&chat("m", "patient", json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(450), "the third connection was served at once ({waited:?}): no cap");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    for s in &mut held {
        read_until_closed(s, Duration::from_secs(2)).await;
    }
    p.shutdown().await;
}

/// The process-wide log of this test binary (every `tracing` event up to debug level), for grepping.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        #[derive(Clone)]
        struct W(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let w = W(buf.clone());
        let _ = tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).with_ansi(false).with_writer(move || w.clone()).try_init();
        buf
    })
    .clone()
}

const SECRET: &str = "s3cret-pw";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_credentials_are_absent_from_every_output() {
    let logs = captured_logs();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let upstream = format!("http://alice:{SECRET}@{dead}/v1");
    let bus = embedded().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(opts(&upstream, dir.path()), &bus).await;
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    let mut outputs = vec![];
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", chat("m", "hi", json!({}))),
        ("POST", "/v1/chat/completions", chat("m", "hi", json!({"stream": true}))),
        ("POST", "/v1/messages", json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})),
        ("GET", "/v1/models", Value::Null),
        ("GET", "/health", Value::Null),
    ] {
        let rb = if method == "GET" { c.get(format!("{}{path}", p.url)) } else { c.post(format!("{}{path}", p.url)).json(&body) };
        let r = rb.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert!(status == 502 || status == 503, "{path}: {status} {text}");
        outputs.push(format!("{path} {status} {text}"));
    }
    assert!(outputs[4].contains(&format!("alice:***@{dead}")), "/health names the upstream, redacted: {}", outputs[4]);
    assert!(outputs[0].contains(&format!("alice:***@{dead}")), "the 502 names the upstream, redacted: {}", outputs[0]);
    p.shutdown().await;
    // A bad upstream URL's error does not echo the password either.
    let bad = nextstate::serve::proxy::Proxy::start(ProxyOptions::new(format!("ftp://alice:{SECRET}@h")), &bus).await.unwrap_err().to_string();
    outputs.push(bad);
    let logged = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(logged.contains("alice:***@"), "the warnings name the upstream, redacted");
    for o in outputs.iter().chain([&logged]) {
        assert!(!o.contains(SECRET), "the upstream password leaked: {o}");
    }
}

#[test]
fn the_cli_start_up_line_and_answers_hide_the_upstream_password() {
    let dir = tempfile::tempdir().unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let log = dir.path().join("proxy.log");
    let args = common::args(&[
        "proxy",
        "--upstream",
        &format!("http://alice:{SECRET}@{dead}"),
        "--port",
        "0",
        "--lake",
        &dir.path().join("lake").display().to_string(),
        "--spool-dir",
        &dir.path().join("spool").display().to_string(),
    ]);
    let mut proc = common::Proc::spawn("proxy", &args, &log);
    let deadline = Instant::now() + Duration::from_secs(60);
    let url = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(i) = text.find("capture proxy on ") {
            break text[i + 17..].split_whitespace().next().unwrap().to_string();
        }
        assert!(Instant::now() < deadline && proc.exited().is_none(), "the proxy did not start:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let answers = rt.block_on(async {
        let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
        let chat = c.post(format!("{url}/v1/chat/completions")).json(&chat("m", "hi", json!({}))).send().await.unwrap().text().await.unwrap();
        let health = c.get(format!("{url}/health")).send().await.unwrap().text().await.unwrap();
        format!("{chat}\n{health}")
    });
    proc.term();
    proc.wait_for(Duration::from_secs(20));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(&format!("alice:***@{dead}")), "the start-up line names the upstream, redacted:\n{text}");
    assert!(answers.contains("alice:***@"), "{answers}");
    for o in [&text, &answers] {
        assert!(!o.contains(SECRET), "the upstream password leaked:\n{o}");
    }
    let _ = std::io::stderr().flush();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_can_be_put_behind_the_key_and_the_bearer_scheme_is_case_insensitive() {
    let (up, _f) = start_fake(Duration::ZERO).await;
    let bus = embedded().await;
    let dir = tempfile::tempdir().unwrap();
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    for requires in [false, true] {
        let mut o = opts(&up, dir.path());
        o.api_key = Some("k3y".into());
        o.health_requires_key = requires;
        let p = start_proxy(o, &bus).await;
        let open = c.get(format!("{}/health", p.url)).send().await.unwrap();
        assert_eq!(open.status(), if requires { 401 } else { 200 }, "health_requires_key = {requires}");
        if requires {
            assert_eq!(open.json::<Value>().await.unwrap()["error"]["type"], "authentication_error");
        }
        assert_eq!(c.get(format!("{}/health", p.url)).header("authorization", "Bearer k3y").send().await.unwrap().status(), 200);
        for auth in ["Bearer k3y", "bearer k3y", "BEARER k3y", "bEaReR  k3y"] {
            let r = c.post(format!("{}/v1/chat/completions", p.url)).header("authorization", auth).json(&chat("m", "hi", json!({}))).send().await.unwrap();
            assert_eq!(r.status(), 200, "{auth:?}");
        }
        for auth in ["Basic k3y", "Bearer nope", "k3y"] {
            let r = c.get(format!("{}/v1/models", p.url)).header("authorization", auth).send().await.unwrap();
            assert_eq!(r.status(), 401, "{auth:?}");
        }
        p.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_come_in_the_apis_own_json_shape() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let bus = embedded().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(opts(&format!("http://{dead}"), dir.path()), &bus).await;
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    // Upstream unreachable: OpenAI's shape for chat, Anthropic's for Messages.
    let r = c.post(format!("{}/v1/chat/completions", p.url)).json(&chat("m", "hi", json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["error"]["type"].as_str(), v["error"]["code"].as_str()), (Some("upstream_error"), Some("upstream_unreachable")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("refused"), "the OS's reason is in the message: {v}");
    let r = c.post(format!("{}/v1/messages", p.url)).json(&json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("api_error")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(&dead.to_string())), "{v}");
    // A refused Messages request: Anthropic's shape, the reason code kept.
    let r = c.post(format!("{}/v1/messages", p.url)).body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str(), v["error"]["code"].as_str()), (Some("error"), Some("invalid_request_error"), Some("malformed_json")), "{v}");
    // Unknown routes and wrong methods: JSON, in the shape the client's headers ask for.
    let r = c.get(format!("{}/v1/nope", p.url)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "unknown_route");
    let r = c.post(format!("{}/v1/complete", p.url)).header("anthropic-version", "2023-06-01").send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "not_found_error");
    let r = c.get(format!("{}/v1/chat/completions", p.url)).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "method_not_allowed");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_failure_to_the_upstream_says_tls_and_why() {
    let dir = tempfile::tempdir().unwrap();
    // An https upstream whose CA the proxy does not trust.
    let pki = common::make_pki(dir.path(), "untrusted");
    let tls = nextstate::net::ServerTls { cert_file: pki.cert.clone(), key_file: pki.key.clone() };
    let l = nextstate::net::Listener::bind("127.0.0.1", 0, Some(&tls)).await.unwrap();
    let up = l.url().unwrap();
    let app = axum::Router::new().route("/v1/chat/completions", axum::routing::post(|| async { "{}" }));
    tokio::spawn(nextstate::net::serve_app(l, app, std::future::pending()));
    let bus = embedded().await;
    let p = start_proxy(opts(&up, dir.path()), &bus).await;
    let c = nextstate::net::http_client(Some(Duration::from_secs(5))).unwrap();
    let r = c.post(format!("{}/v1/chat/completions", p.url)).json(&chat("m", "hi", json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("TLS") && m.contains("UnknownIssuer"), "{v}");
    assert!(!m.contains("refused"), "{v}");
    assert_eq!(v["error"]["code"], "upstream_tls_error");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_drops_a_client_silent_after_its_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let pki = common::make_pki(dir.path(), "listener");
    let tls = nextstate::net::ServerTls { cert_file: pki.cert.clone(), key_file: pki.key.clone() };
    let l = nextstate::net::Listener::bind("127.0.0.1", 0, Some(&tls)).await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    let limits = short_limits(8);
    tokio::spawn(nextstate::net::serve_app_with(l, app, limits, std::future::pending()));
    nextstate::net::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(&pki.ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = Arc::new(rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth());
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let opened = Instant::now();
    let mut silent = connector.connect(name.clone(), TcpStream::connect(addr).await.unwrap()).await.unwrap();
    // A good client over TLS is served meanwhile.
    let mut good = connector.connect(name, TcpStream::connect(addr).await.unwrap()).await.unwrap();
    good.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    good.read_to_string(&mut answer).await.ok();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(limits.header_read_timeout + Duration::from_millis(1500), silent.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "a silent TLS connection is still open: {r:?}");
    assert!(opened.elapsed() + Duration::from_millis(50) >= limits.header_read_timeout);
}
