//! TLS for every HTTP client and for our listeners.
//!
//! **Clients.** Every outgoing HTTP call (judge, hint, remote teacher, proxy upstream, server reloads,
//! the demo's client) is made with a client from [`client_builder`]: rustls (the `ring` provider) with
//! the platform's trust store (on Linux the system bundle, or, as with OpenSSL, the file named by the
//! standard `SSL_CERT_FILE` variable *instead of* it), plus the PEM certificates of the process's
//! configured CA file ([`set_extra_ca_file`], from a pipeline's `[tls] ca_file` or a command's
//! `--ca-file`), which are *added*: a private CA for internal endpoints does not take away the public
//! roots hosted judges need. (The certificates of `SSL_CERT_FILE` are also added explicitly, so they are
//! trusted whatever the platform verifier does with the variable.) A certificate the client cannot verify fails the call with an error
//! that names the cause (`invalid peer certificate: UnknownIssuer`, ...): [`error_chain`] spells out
//! reqwest's error with all its sources, and [`is_tls_error`] tells such a failure apart from a transient
//! one (a bad certificate is not retried).
//!
//! **Listeners.** `serve` and `proxy` listen on https when given a certificate chain and key
//! ([`ServerTls`]); [`Listener`] accepts TCP connections and completes TLS handshakes off the accept
//! loop, so a slow or broken client never holds up the others.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The `[tls]` table of a pipeline: trust for every HTTP client the pipeline makes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM file of extra CA certificates trusted by every HTTP client (besides the platform's roots
    /// and `SSL_CERT_FILE`), e.g. the private CA of internal judge and teacher endpoints.
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

/// A `reqwest` client builder with the process's TLS trust (module docs). Add timeouts and build.
///
/// # Errors
/// [`Error::Config`] when a configured CA file cannot be read.
pub fn client_builder() -> Result<reqwest::ClientBuilder> {
    install_crypto_provider();
    Ok(reqwest::Client::builder().tls_certs_merge(extra_roots()?))
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
/// Repeated messages (a source that repeats its wrapper's text) are written once.
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
    out
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

/// Serves `app` on `listener` (plain or TLS) until `shutdown` resolves, then drains open requests.
///
/// # Errors
/// The I/O error that ended serving.
pub async fn serve_app(listener: Listener, app: axum::Router, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    match listener.tls {
        None => axum::serve(listener.tcp, app).with_graceful_shutdown(shutdown).await,
        Some(cfg) => axum::serve(TlsListener::start(listener.tcp, cfg)?, app).with_graceful_shutdown(shutdown).await,
    }
}

/// Accepts TCP connections on a background task and hands over those whose TLS handshake completed
/// within [`HANDSHAKE_TIMEOUT`] (at most [`MAX_PENDING_HANDSHAKES`] at once); failed handshakes are
/// logged at debug level and dropped (the client sees the TLS alert).
struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::net::SocketAddr)>,
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn start(tcp: tokio::net::TcpListener, cfg: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let addr = tcp.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let pending = Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HANDSHAKES));
        let task = tokio::spawn(async move {
            loop {
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
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, addr, task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends on its own; if it did, wait for shutdown instead of spinning.
            None => std::future::pending().await,
        }
    }
    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
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
    fn listener_tls_needs_both_files() {
        assert!(ServerTls::from_pair(Some("c.pem".into()), None).is_err());
        assert_eq!(ServerTls::from_pair(None, None).unwrap(), None);
    }
}
