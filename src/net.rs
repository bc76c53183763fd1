//! TLS for every HTTP client and for our listeners.
//!
//! **Clients.** Every outgoing HTTP call (judge, hint, remote teacher, proxy upstream, server reloads,
//! the demo's client) is made with a client from [`client_builder`]: rustls (the `ring` provider) with
//! the platform's trust store (on Linux the system bundle, or, as with OpenSSL, the file named by the
//! standard `SSL_CERT_FILE` variable *instead of* it), plus the PEM certificates of the process's
//! configured CA file ([`set_extra_ca_file`], from a pipeline's `[tls] ca_file` or a command's
//! `--ca-file`), which are *added*: a private CA for internal endpoints does not take away the public
//! roots hosted judges need. (The certificates of `SSL_CERT_FILE` are also added explicitly, so they are
//! trusted whatever the platform verifier does with the variable.) A server certificate listed itself in
//! the CA file is pinned: accepted even when webpki would refuse it as a server's certificate (the
//! self-signed `CA:TRUE` certificate of the usual `openssl req -x509` one-liner), still checked for the
//! server name, its validity period and the handshake signature ([`PinnedServerVerifier`]). A
//! certificate the client cannot verify fails the call with an error that names the cause (`invalid
//! peer certificate: UnknownIssuer`, ...) and, for one nobody vouches for, what to do ([`NotPinned`]):
//! [`error_chain`] spells out reqwest's error with all its sources, and [`is_tls_error`] tells such a
//! failure apart from a transient one (a bad certificate is not retried).
//!
//! **Listeners.** `serve` and `proxy` listen on https when given a certificate chain and key
//! ([`ServerTls`]); [`Listener`] accepts TCP connections and completes TLS handshakes off the accept
//! loop, so a slow or broken client never holds up the others. [`serve_app_with`] serves HTTP/1.1 on
//! it under [`ListenLimits`]: a client must send a request's headers within `header_read_timeout`
//! (also the longest a connection may sit idle or silent) and its body within `body_read_timeout`,
//! and at most `max_connections` connections are open at once (hyper's own header timeout, a body
//! deadline, a semaphore around accept).
//!
//! **Secrets.** A URL may carry credentials (`http://user:pass@host`): everything that prints or
//! returns one passes it through [`redact_url`] first.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

mod pinned;
pub use pinned::{NotPinned, PinnedServerVerifier};

/// The `[tls]` table of a pipeline: trust for every HTTP client the pipeline makes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM file of extra CA certificates trusted by every HTTP client (besides the platform's roots
    /// and `SSL_CERT_FILE`), e.g. the private CA of internal judge and teacher endpoints. A server's own
    /// certificate listed here is pinned: accepted for the names it carries even when self-signed with
    /// `CA:TRUE` (as `openssl req -x509` makes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

impl TlsConfig {
    /// Whether nothing is set (left out of the pipeline hash then, so older hashes are unchanged).
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none()
    }

    /// Makes `ca_file`, when set, the process's extra client trust ([`set_extra_ca_file`]), after
    /// checking that it reads; without one the process's trust stays as it is.
    ///
    /// # Errors
    /// [`Error::Config`] when the CA file is unreadable or holds no PEM certificate.
    pub fn apply(&self) -> Result<()> {
        if let Some(p) = &self.ca_file {
            read_certs(p, "tls.ca_file")?;
            set_extra_ca_file(Some(p.clone()));
        }
        Ok(())
    }
}

static EXTRA_CA: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Sets (or clears) the process-wide extra CA file that [`client_builder`] trusts from now on. Like
/// `SSL_CERT_FILE`, it is a property of the process: clients built before the call keep their trust.
pub fn set_extra_ca_file(path: Option<PathBuf>) {
    if let Ok(mut g) = EXTRA_CA.lock() {
        *g = path;
    }
}

/// Installs rustls' `ring` crypto provider as the process default (idempotent). Called by
/// [`client_builder`] and [`ServerTls::load`]; call it first when building a `reqwest::Client` any
/// other way.
pub fn install_crypto_provider() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // Err only when another provider was installed first, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| Error::Config(format!("{what} {}: {e}", path.display())))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Config(format!("{what} {}: not PEM certificates: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!("{what} {}: no PEM certificate in the file", path.display())));
    }
    Ok(certs)
}

/// The extra roots every client trusts: `SSL_CERT_FILE`, then the configured CA file.
///
/// # Errors
/// [`Error::Config`] naming the file when one is set but unreadable or empty.
pub fn extra_roots() -> Result<Vec<reqwest::Certificate>> {
    let mut files: Vec<(PathBuf, &str)> = Vec::new();
    if let Some(p) = std::env::var_os("SSL_CERT_FILE").filter(|p| !p.is_empty()) {
        files.push((PathBuf::from(p), "SSL_CERT_FILE"));
    }
    if let Some(p) = EXTRA_CA.lock().ok().and_then(|g| g.clone()) {
        files.push((p, "tls.ca_file"));
    }
    let mut out = Vec::new();
    for (p, what) in files {
        for c in read_certs(&p, what)? {
            out.push(reqwest::Certificate::from_der(c.as_ref()).map_err(|e| Error::Config(format!("{what} {}: {e}", p.display())))?);
        }
    }
    Ok(out)
}

/// A `reqwest` client builder with the process's TLS trust (module docs). Add timeouts and build; leave
/// its TLS settings alone (with a CA file set, they are those of [`pinning_client_config`]).
///
/// # Errors
/// [`Error::Config`] when a configured CA file cannot be read.
pub fn client_builder() -> Result<reqwest::ClientBuilder> {
    install_crypto_provider();
    let builder = reqwest::Client::builder();
    match EXTRA_CA.lock().ok().and_then(|g| g.clone()) {
        Some(ca_file) => Ok(builder.tls_backend_preconfigured(pinning_client_config(&ca_file)?)),
        None => Ok(builder.tls_certs_merge(extra_roots()?)),
    }
}

/// The rustls client configuration of every HTTP client when a CA file is set: webpki with the
/// platform's roots (`rustls-native-certs`: the system bundle, or `SSL_CERT_FILE` / `SSL_CERT_DIR`
/// instead), `SSL_CERT_FILE`'s and `ca_file`'s certificates as extra roots, and the server certificates
/// listed in `ca_file` pinned ([`PinnedServerVerifier`]); TLS 1.2 and 1.3, ALPN `http/1.1`.
///
/// # Errors
/// [`Error::Config`] naming the file when `ca_file` or `SSL_CERT_FILE` is unreadable, holds no PEM
/// certificate, or holds one that is not a usable root.
pub fn pinning_client_config(ca_file: &Path) -> Result<rustls::ClientConfig> {
    install_crypto_provider();
    let pinned = read_certs(ca_file, "tls.ca_file")?;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!(error = %e, "loading the platform's CA certificates");
    }
    roots.add_parsable_certificates(native.certs);
    let mut extra: Vec<(CertificateDer<'static>, String)> = Vec::new();
    if let Some(p) = std::env::var_os("SSL_CERT_FILE").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        extra.extend(read_certs(&p, "SSL_CERT_FILE")?.into_iter().map(|c| (c, format!("SSL_CERT_FILE {}", p.display()))));
    }
    extra.extend(pinned.iter().cloned().map(|c| (c, format!("tls.ca_file {}", ca_file.display()))));
    for (cert, what) in extra {
        roots.add(cert).map_err(|e| Error::Config(format!("{what}: not a usable CA certificate: {e}")))?;
    }
    let provider = rustls::crypto::CryptoProvider::get_default().cloned().unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::Config(format!("tls.ca_file {}: {e}", ca_file.display())))?;
    let verifier = PinnedServerVerifier::new(webpki, pinned, ca_file.to_path_buf());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS client configuration: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    // What reqwest sets for its own configuration (HTTP/1.1 only: no `http2` feature).
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A client with the process's TLS trust and, when given, a whole-request and connect timeout.
///
/// # Errors
/// [`Error::Config`] for an unreadable CA file; [`Error::Http`] when the client cannot be built.
pub fn http_client(timeout: Option<Duration>) -> Result<reqwest::Client> {
    let mut b = client_builder()?;
    if let Some(t) = timeout {
        b = b.timeout(t).connect_timeout(t);
    }
    b.build().map_err(|e| Error::Http(format!("building the HTTP client: {}", error_chain(&e))))
}

/// An error with all its sources, `outer: inner: innermost` (reqwest's own `Display` names only the
/// outermost, e.g. "error sending request", and hides "invalid peer certificate: UnknownIssuer").
/// Repeated messages (a source that repeats its wrapper's text) are written once. Credentials in any URL
/// it names (reqwest's "for url (http://user:pass@host/...)") are redacted ([`redact_url`]): the text
/// goes into errors, logs and answers.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let m = s.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cur = s.source();
    }
    redact_url(&out)
}

/// Whether `e` failed in the TLS layer (certificate verification, handshake, protocol): such a call is
/// not worth retrying.
pub fn is_tls_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = cur {
        if s.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        // `io::Error::source` skips the error it wraps, and hyper wraps rustls' io::Error in another
        // (`Other(InvalidData(InvalidCertificate(..)))`): look inside each wrapped error too.
        if let Some(inner) = s.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            if is_tls_error(inner) {
                return true;
            }
        }
        cur = s.source();
    }
    false
}

/// A listener's certificate chain and private key (PEM files), for https on `serve` and `proxy`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

impl ServerTls {
    /// From optional `--tls-cert` / `--tls-key` values: both or neither.
    ///
    /// # Errors
    /// [`Error::Config`] when only one is given.
    pub fn from_pair(cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Option<ServerTls>> {
        match (cert, key) {
            (Some(cert_file), Some(key_file)) => Ok(Some(ServerTls { cert_file, key_file })),
            (None, None) => Ok(None),
            _ => Err(Error::Config("a TLS listener needs both a certificate chain and a private key (--tls-cert and --tls-key)".into())),
        }
    }

    /// Reads the files into a rustls server configuration (HTTP/1.1 over TLS 1.2/1.3).
    ///
    /// # Errors
    /// [`Error::Config`] naming the file when it is unreadable, holds no certificate or key, or the key
    /// does not match the certificate.
    pub fn load(&self) -> Result<Arc<rustls::ServerConfig>> {
        install_crypto_provider();
        let certs = read_certs(&self.cert_file, "TLS certificate")?;
        let key = PrivateKeyDer::from_pem_file(&self.key_file)
            .map_err(|e| Error::Config(format!("TLS private key {}: {e}", self.key_file.display())))?;
        let mut cfg = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| Error::Config(format!("TLS certificate {} with key {}: {e}", self.cert_file.display(), self.key_file.display())))?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// The command-line flags of a TLS listener (`serve`, `proxy`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ListenTlsArgs {
    /// Serve https with this PEM certificate chain (leaf first; needs --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ListenTlsArgs {
    /// The listener's TLS settings, if both flags are given.
    ///
    /// # Errors
    /// [`Error::Config`] when only one is given.
    pub fn server_tls(&self) -> Result<Option<ServerTls>> {
        ServerTls::from_pair(self.tls_cert.clone(), self.tls_key.clone())
    }
}

/// Parses `KEY=VALUE` (a `--kafka-property` flag).
///
/// # Errors
/// A message naming the flag's value when it has no `=` or an empty key.
pub fn parse_key_value(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// How long a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most TLS handshakes in progress at once on one listener; further connections wait to be accepted
/// (a flood of connections that never finish their handshake cannot pile up tasks).
pub const MAX_PENDING_HANDSHAKES: usize = 1024;

/// A bound listener, plain or TLS, for [`serve_app`].
pub struct Listener {
    tcp: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Listener {
    /// A plain TCP listener.
    pub fn plain(tcp: tokio::net::TcpListener) -> Listener {
        Listener { tcp, tls: None }
    }
    /// A listener that speaks TLS with `cfg` (None: plain).
    pub fn new(tcp: tokio::net::TcpListener, cfg: Option<Arc<rustls::ServerConfig>>) -> Listener {
        Listener { tcp, tls: cfg }
    }
    /// Binds `host:port` and loads `tls` when given.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound; [`ServerTls::load`]'s errors.
    pub async fn bind(host: &str, port: u16, tls: Option<&ServerTls>) -> Result<Listener> {
        let cfg = tls.map(ServerTls::load).transpose()?;
        let addr = format!("{host}:{port}");
        let tcp = tokio::net::TcpListener::bind(&addr).await.map_err(|e| Error::io("bind", &addr, e))?;
        Ok(Listener { tcp, tls: cfg })
    }
    /// `http://addr` or `https://addr` of the bound socket.
    ///
    /// # Errors
    /// [`Error::Io`] when the socket has no local address.
    pub fn url(&self) -> Result<String> {
        let a = self.tcp.local_addr().map_err(|e| Error::io("local address", "listener", e))?;
        Ok(format!("{}://{a}", if self.tls.is_some() { "https" } else { "http" }))
    }
    /// The bound socket address.
    ///
    /// # Errors
    /// [`Error::Io`] when the socket has no local address.
    pub fn local_addr(&self) -> Result<std::net::SocketAddr> {
        self.tcp.local_addr().map_err(|e| Error::io("local address", "listener", e))
    }
}

impl From<tokio::net::TcpListener> for Listener {
    fn from(tcp: tokio::net::TcpListener) -> Self {
        Listener::plain(tcp)
    }
}

/// What a listener of `serve` or `proxy` allows its clients ([`serve_app_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenLimits {
    /// Longest a client may take to send a request's headers, counted from when the connection is
    /// accepted (after the TLS handshake) or falls idle after a response; the connection is then closed
    /// without an answer. Also bounds a silent or idle keep-alive connection. Default 10 s.
    pub header_read_timeout: Duration,
    /// Longest a client may take to send a request's whole body, counted from the end of its headers;
    /// the request then gets `408 Request Timeout` and the connection is closed. Default 30 s.
    pub body_read_timeout: Duration,
    /// Most connections open at once (TLS handshakes in progress included). Further connections are
    /// not refused: they wait, unaccepted, in the listen backlog until one closes (the two timeouts
    /// above close slow ones). Each proxied connection also holds one connection to the upstream: keep
    /// twice this under the process's open-file limit (`ulimit -n`). Default 512.
    pub max_connections: usize,
}

impl Default for ListenLimits {
    fn default() -> Self {
        ListenLimits { header_read_timeout: Duration::from_secs(10), body_read_timeout: Duration::from_secs(30), max_connections: 512 }
    }
}

impl ListenLimits {
    /// The limits of a config section's `header_timeout_s`, `body_timeout_s` and `max_connections`
    /// (each `None`: its default); `what` names the section in errors (`"proxy"`, `"serve"`).
    ///
    /// # Errors
    /// [`Error::Config`] for a zero value.
    pub fn from_settings(what: &str, header_timeout_s: Option<u64>, body_timeout_s: Option<u64>, max_connections: Option<usize>) -> Result<ListenLimits> {
        let d = ListenLimits::default();
        for (key, v) in [("header_timeout_s", header_timeout_s.map(|v| v as u128)), ("body_timeout_s", body_timeout_s.map(|v| v as u128)), ("max_connections", max_connections.map(|v| v as u128))] {
            if v == Some(0) {
                return Err(Error::Config(format!("{what}.{key} must be at least 1")));
            }
        }
        Ok(ListenLimits {
            header_read_timeout: header_timeout_s.map(Duration::from_secs).unwrap_or(d.header_read_timeout),
            body_read_timeout: body_timeout_s.map(Duration::from_secs).unwrap_or(d.body_read_timeout),
            max_connections: max_connections.unwrap_or(d.max_connections),
        })
    }
}

/// The command-line flags of a listener's [`ListenLimits`] (`serve`, `proxy`).
#[derive(Debug, Clone, clap::Args)]
pub struct ListenLimitArgs {
    /// Seconds a client may take to send a request's headers (also the longest a connection may stay
    /// silent or idle); the connection is then closed.
    #[arg(long, default_value_t = 10)]
    pub header_timeout_s: u64,
    /// Seconds a client may take to send a request's body after its headers; then 408 and the
    /// connection is closed.
    #[arg(long, default_value_t = 30)]
    pub body_timeout_s: u64,
    /// Most connections open at once; further ones wait in the listen backlog until one closes.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
}

impl ListenLimitArgs {
    /// The limits these flags describe.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero value.
    pub fn limits(&self) -> Result<ListenLimits> {
        for (flag, v) in [("--header-timeout-s", self.header_timeout_s as u128), ("--body-timeout-s", self.body_timeout_s as u128), ("--max-connections", self.max_connections as u128)] {
            if v == 0 {
                return Err(Error::Config(format!("{flag} must be at least 1")));
            }
        }
        Ok(ListenLimits { header_read_timeout: Duration::from_secs(self.header_timeout_s), body_read_timeout: Duration::from_secs(self.body_timeout_s), max_connections: self.max_connections })
    }
}

/// Set in a request's extensions by [`serve_app_with`]: whether its body missed the
/// `body_read_timeout` deadline. A middleware that answers in an API's own error shape checks it after
/// the handler ran and answers 408 in that shape (the listener adds `Connection: close`; without such a
/// middleware it answers a 408 in the OpenAI error shape itself).
#[derive(Debug, Clone, Default)]
pub struct BodyTimedOut(Arc<std::sync::atomic::AtomicBool>);

impl BodyTimedOut {
    /// Whether the body's deadline passed before its last byte arrived.
    pub fn fired(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The error a request body yields once its deadline has passed.
#[derive(Debug)]
struct BodyTimeout(Duration);

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request body not received within {:.1} s", self.0.as_secs_f64())
    }
}

impl std::error::Error for BodyTimeout {}

/// A request body that fails with [`BodyTimeout`] when its last frame has not arrived by a deadline.
struct DeadlineBody {
    inner: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
    fired: BodyTimedOut,
}

impl hyper::body::Body for DeadlineBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<std::result::Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::future::Future;
        let this = self.get_mut();
        if let std::task::Poll::Ready(frame) = std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            return std::task::Poll::Ready(frame);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.fired.0.store(true, std::sync::atomic::Ordering::SeqCst);
            return std::task::Poll::Ready(Some(Err(axum::Error::new(BodyTimeout(this.limit)))));
        }
        std::task::Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The request with its body under a `limit` deadline from now, [`BodyTimedOut`] in its extensions.
fn with_body_deadline(req: axum::extract::Request, limit: Duration) -> (axum::extract::Request, BodyTimedOut) {
    use hyper::body::Body as _;
    let fired = BodyTimedOut::default();
    let (mut parts, body) = req.into_parts();
    parts.extensions.insert(fired.clone());
    if body.is_end_stream() {
        return (axum::extract::Request::from_parts(parts, body), fired);
    }
    let body = DeadlineBody { inner: body, deadline: Box::pin(tokio::time::sleep(limit)), limit, fired: fired.clone() };
    (axum::extract::Request::from_parts(parts, axum::body::Body::new(body)), fired)
}

/// Serves `app` on `listener` (plain or TLS) under the default [`ListenLimits`] until `shutdown`
/// resolves, then drains open requests.
///
/// # Errors
/// The I/O error that ended serving.
pub async fn serve_app(listener: Listener, app: axum::Router, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    serve_app_with(listener, app, ListenLimits::default(), shutdown).await
}

/// Serves `app` over HTTP/1.1 on `listener` (plain or TLS) under `limits` until `shutdown` resolves;
/// then stops accepting, lets every request in flight finish and closes idle connections.
///
/// # Errors
/// The I/O error that ended serving (none today: accept errors are logged and retried).
pub async fn serve_app_with(listener: Listener, app: axum::Router, limits: ListenLimits, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let conns = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    match listener.tls {
        None => serve_loop(PlainAccept { tcp: listener.tcp, conns }, app, limits, shutdown).await,
        Some(cfg) => serve_loop(TlsListener::start(listener.tcp, cfg, conns)?, app, limits, shutdown).await,
    }
}

/// A source of connections, each with its slot of the connection cap.
trait Accept {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl std::future::Future<Output = (Self::Io, std::net::SocketAddr, tokio::sync::OwnedSemaphorePermit)> + Send;
}

/// Plain TCP: a slot of the cap, then the next connection.
struct PlainAccept {
    tcp: tokio::net::TcpListener,
    conns: Arc<tokio::sync::Semaphore>,
}

impl Accept for PlainAccept {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> (Self::Io, std::net::SocketAddr, tokio::sync::OwnedSemaphorePermit) {
        loop {
            let Ok(permit) = self.conns.clone().acquire_owned().await else { return std::future::pending().await };
            match self.tcp.accept().await {
                Ok((s, peer)) => return (s, peer, permit),
                Err(e) => {
                    // Out of file descriptors and the like: wait a moment, as axum's own loop does.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// The accept loop of [`serve_app_with`]: one task per connection; on shutdown, graceful shutdown of
/// every connection and a wait for all of them.
async fn serve_loop<A: Accept>(mut acc: A, app: axum::Router, limits: ListenLimits, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection task holds a clone of `open`; `closed()` resolves when the last is gone.
    let (open_tx, open) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (io, peer, permit) = tokio::select! {
            c = acc.accept() => c,
            _ = &mut shutdown => break,
        };
        let (app, mut stop_rx, open) = (app.clone(), stop_rx.clone(), open.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let mut app = app.clone();
                let (req, timed_out) = with_body_deadline(req.map(axum::body::Body::new), limits.body_read_timeout);
                async move {
                    let mut resp = match tower_service::Service::call(&mut app, req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    };
                    if timed_out.fired() {
                        if resp.status() != axum::http::StatusCode::REQUEST_TIMEOUT {
                            let msg = BodyTimeout(limits.body_read_timeout).to_string();
                            let body = serde_json::json!({"error": {"message": msg, "type": "invalid_request_error", "param": null, "code": "body_timeout"}});
                            resp = axum::response::IntoResponse::into_response((axum::http::StatusCode::REQUEST_TIMEOUT, axum::Json(body)));
                        }
                        // The rest of the body may never come: do not wait for it to reuse the connection.
                        resp.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
            let mut conn = std::pin::pin!(builder.serve_connection(hyper_util::rt::TokioIo::new(io), svc));
            let mut stopping = false;
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(%peer, error = %e, "connection closed");
                        }
                        break;
                    }
                    // The only change ever sent is the stop.
                    _ = stop_rx.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop((permit, open));
        });
    }
    drop(acc);
    let _ = stop_tx.send(true);
    drop(open);
    open_tx.closed().await;
    Ok(())
}

/// Accepts TCP connections on a background task (each once a slot of the connection cap is free) and
/// hands over those whose TLS handshake completed within [`HANDSHAKE_TIMEOUT`] (at most
/// [`MAX_PENDING_HANDSHAKES`] at once); failed handshakes are logged at debug level and dropped (the
/// client sees the TLS alert).
struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::net::SocketAddr, tokio::sync::OwnedSemaphorePermit)>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn start(tcp: tokio::net::TcpListener, cfg: Arc<rustls::ServerConfig>, conns: Arc<tokio::sync::Semaphore>) -> std::io::Result<TlsListener> {
        let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let pending = Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HANDSHAKES));
        let task = tokio::spawn(async move {
            loop {
                let Ok(slot) = conns.clone().acquire_owned().await else { return };
                let Ok(permit) = pending.clone().acquire_owned().await else { return };
                let (stream, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait a moment, as axum's own loop does.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    drop(permit);
                    match handshake {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer, slot)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Accept for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    async fn accept(&mut self) -> (Self::Io, std::net::SocketAddr, tokio::sync::OwnedSemaphorePermit) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends on its own; if it did, wait for shutdown instead of spinning.
            None => std::future::pending().await,
        }
    }
}

/// The token of an `Authorization` header value of the `Bearer` scheme (`Bearer KEY`), the scheme
/// matched case-insensitively as HTTP allows (`bearer KEY`, `BEARER KEY`; RFC 9110 §11.1); `None` for
/// another scheme or a value without a token.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// `text` with the credentials of every URL in it hidden: `http://user:pass@host/p` →
/// `http://user:***@host/p`, `http://token@host` → `http://***@host`. Works on a bare URL and on
/// free text that contains URLs (an error message, a log line); text without credentials comes back
/// unchanged. Use it wherever a URL is printed, logged or returned.
pub fn redact_url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // The authority ends at the path, query or fragment, or where the URL ends in free text (a space,
        // a quote, an angle bracket: characters userinfo cannot hold unescaped). Not at `,` `;` `(` `)`
        // `'`: a password may hold them (RFC 3986 sub-delims), and the last `@` before the end still
        // separates it from the host when the URL stands in brackets, `(http://u:p@h)`.
        let end = tail.find(|c: char| matches!(c, '/' | '?' | '#' | '"' | '<' | '>' | '{' | '}') || c.is_whitespace()).unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                match authority[..at].split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_names_every_source_once() {
        let inner = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("error sending request")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(error_chain(&Outer(inner)), "error sending request: invalid peer certificate: UnknownIssuer");
    }

    #[test]
    fn a_tls_error_inside_io_is_recognised() {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidData, rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer));
        // As hyper hands it over: an io::Error wrapping rustls' io::Error.
        let e = std::io::Error::other(e);
        assert!(is_tls_error(&e));
        assert!(!is_tls_error(&std::io::Error::other("connection reset")));
    }

    #[test]
    fn credentials_in_urls_are_redacted() {
        assert_eq!(redact_url("http://user:s3cret@host:8000/v1"), "http://user:***@host:8000/v1");
        assert_eq!(redact_url("https://tok3n@h"), "https://***@h");
        assert_eq!(redact_url("http://u:p@ss@h/x?y=1"), "http://u:***@h/x?y=1");
        assert_eq!(redact_url("http://h:1/a@b"), "http://h:1/a@b");
        let e = "error sending request for url (http://user:s3cret@127.0.0.1:9/v1/models): refused; see https://a:b@c";
        assert_eq!(redact_url(e), "error sending request for url (http://user:***@127.0.0.1:9/v1/models): refused; see https://a:***@c");
        assert_eq!(redact_url("no url here"), "no url here");
        // passwords with sub-delimiters, an IPv6 host, a URL in brackets
        assert_eq!(redact_url("http://u:a,b@h/v1"), "http://u:***@h/v1");
        assert_eq!(redact_url("http://u:p(1);x'y@h"), "http://u:***@h");
        assert_eq!(redact_url("http://[::1]:8000/v1"), "http://[::1]:8000/v1");
        assert_eq!(redact_url("failed (http://u:p@h)"), "failed (http://u:***@h)");
        // error chains (judge, teacher and reload clients' errors) come out redacted
        let e = std::io::Error::other("error sending request for url (http://u:s3cret@h/v1)");
        assert_eq!(error_chain(&e), "error sending request for url (http://u:***@h/v1)");
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k", "bearer k", "BEARER k", "BeArEr   k "] {
            assert_eq!(bearer_token(v), Some("k"), "{v}");
        }
        assert_eq!(bearer_token("Basic k"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearerk"), None);
    }

    #[test]
    fn zero_limits_are_refused() {
        assert!(ListenLimits::from_settings("proxy", Some(0), None, None).unwrap_err().to_string().contains("proxy.header_timeout_s"));
        assert_eq!(ListenLimits::from_settings("proxy", None, None, None).unwrap(), ListenLimits::default());
    }

    #[test]
    fn listener_tls_needs_both_files() {
        assert!(ServerTls::from_pair(Some("c.pem".into()), None).is_err());
        assert_eq!(ServerTls::from_pair(None, None).unwrap(), None);
    }
}
