//! Server-certificate pinning for `[tls] ca_file`: a server whose own certificate is listed in the file
//! is trusted even when it is not a valid end-entity certificate under a CA, as curl and Python do.
//!
//! The common one-liner `openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost -addext
//! subjectAltName=DNS:localhost` makes a self-signed certificate marked `CA:TRUE`; webpki refuses it as a
//! server's certificate (`CaUsedAsEndEntity`) even when it is a trusted root. [`PinnedServerVerifier`]
//! wraps the normal verifier and, when that refuses a certificate, accepts it if it is byte-equal (DER)
//! to one in the file, still valid at the time, and valid for the server name. Handshake signatures are
//! verified by the wrapped verifier as always, so the server must hold the pinned certificate's key.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, OtherError, SignatureScheme};

/// A [`ServerCertVerifier`] that accepts, besides what `inner` accepts, a server certificate pinned in
/// the CA file (byte-equal DER), within its validity period and valid for the server name.
#[derive(Debug)]
pub struct PinnedServerVerifier {
    inner: Arc<dyn ServerCertVerifier>,
    pinned: Vec<CertificateDer<'static>>,
    ca_file: PathBuf,
}

impl PinnedServerVerifier {
    /// Wraps `inner` (the platform's verifier with the CA file's certificates as extra roots), pinning
    /// the certificates of `ca_file` (already read: `pinned`); `ca_file` is named in errors.
    pub fn new(inner: Arc<dyn ServerCertVerifier>, pinned: Vec<CertificateDer<'static>>, ca_file: PathBuf) -> PinnedServerVerifier {
        PinnedServerVerifier { inner, pinned, ca_file }
    }

    /// The pinned certificate's own checks: name and validity period (its chain is the pin itself).
    fn verify_pinned(end_entity: &CertificateDer<'_>, server_name: &ServerName<'_>, now: UnixTime) -> Result<(), rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_name(&parsed, server_name)?;
        let (not_before, not_after) =
            validity(end_entity.as_ref()).ok_or(rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        let t = now.as_secs();
        if t < not_before {
            return Err(rustls::Error::InvalidCertificate(CertificateError::NotValidYet));
        }
        if t > not_after {
            return Err(rustls::Error::InvalidCertificate(CertificateError::Expired));
        }
        Ok(())
    }
}

impl ServerCertVerifier for PinnedServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let refused = match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if self.pinned.iter().any(|p| p.as_ref() == end_entity.as_ref()) {
            Self::verify_pinned(end_entity, server_name, now)?;
            return Ok(ServerCertVerified::assertion());
        }
        Err(with_advice(refused, &self.ca_file))
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Why an unpinned server certificate was refused, with what the user can do about it.
#[derive(thiserror::Error)]
#[error(
    "{cause}: the server's certificate is neither signed by a trusted CA nor listed itself in tls.ca_file {ca_file}; \
     to trust this server, add its own certificate to that file (a self-signed certificate is accepted when listed \
     there exactly), or make a CA, sign a server certificate for this host with it and list the CA",
    cause = cause_text(.cause),
    ca_file = .ca_file.display()
)]
pub struct NotPinned {
    /// The wrapped verifier's reason (`UnknownIssuer`, `Other(OtherError(CaUsedAsEndEntity))`, ...).
    pub cause: CertificateError,
    /// The CA file the certificate was looked for in.
    pub ca_file: PathBuf,
}

/// The refusal's reason without rustls' wrapping (`CaUsedAsEndEntity`, not
/// `Other(OtherError(CaUsedAsEndEntity))`).
fn cause_text(cause: &CertificateError) -> String {
    match cause {
        CertificateError::Other(OtherError(inner)) => inner.to_string(),
        other => other.to_string(),
    }
}

// rustls writes `CertificateError::Other` with `{:?}`: Debug gives the message, not the fields.
impl std::fmt::Debug for NotPinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Adds [`NotPinned`]'s advice to a refusal about who vouches for the certificate (unknown issuer, a CA
/// certificate as the server's own, a bad chain signature); name, time and revocation refusals already
/// say what is wrong and pass unchanged.
fn with_advice(e: rustls::Error, ca_file: &std::path::Path) -> rustls::Error {
    match e {
        rustls::Error::InvalidCertificate(cause @ (CertificateError::UnknownIssuer | CertificateError::BadSignature | CertificateError::Other(_))) => {
            rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(NotPinned { cause, ca_file: ca_file.to_path_buf() }))))
        }
        other => other,
    }
}

/// A DER element: `(tag, contents, rest)`; `None` when malformed (indefinite or over-long length).
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        (rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize), &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A certificate's validity period, `(notBefore, notAfter)` in UNIX seconds, read from its DER (RFC 5280
/// §4.1: Certificate → tbsCertificate → [version], serial, signature, issuer, validity).
fn validity(cert: &[u8]) -> Option<(u64, u64)> {
    let (_, certificate, _) = der_element(cert).filter(|(t, _, _)| *t == 0x30)?;
    let (_, mut tbs, _) = der_element(certificate).filter(|(t, _, _)| *t == 0x30)?;
    if tbs.first() == Some(&0xa0) {
        tbs = der_element(tbs)?.2;
    }
    for _ in 0..3 {
        tbs = der_element(tbs)?.2; // serial, signature algorithm, issuer
    }
    let (_, period, _) = der_element(tbs).filter(|(t, _, _)| *t == 0x30)?;
    let (t1, before, rest) = der_element(period)?;
    let (t2, after, _) = der_element(rest)?;
    Some((der_time(t1, before)?, der_time(t2, after)?))
}

/// UTCTime (`YYMMDDHHMMSSZ`, years 1950–2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) as UNIX seconds.
fn der_time(tag: u8, s: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(s).ok()?;
    let digits = s.strip_suffix('Z')?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let num = |r: std::ops::Range<usize>| digits.get(r)?.parse::<i64>().ok();
    let (year, rest) = match (tag, digits.len()) {
        (0x17, 12) => {
            let yy = num(0..2)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
        }
        (0x18, 14) => (num(0..4)?, 4),
        _ => return None,
    };
    let (month, day) = (num(rest..rest + 2)?, num(rest + 2..rest + 4)?);
    let (h, m, sec) = (num(rest + 4..rest + 6)?, num(rest + 6..rest + 8)?, num(rest + 8..rest + 10)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    // Days from 1970-01-01 (Howard Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3600 + m * 60 + sec).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate as the openssl one-liner makes it: CA:TRUE, SAN localhost and
    /// 127.0.0.1, valid from 2020 to 2040.
    fn self_signed_ca_true(cn: &str) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.not_before = rcgen::date_time_ymd(2020, 1, 2);
        p.not_after = rcgen::date_time_ymd(2040, 3, 4);
        p.self_signed(&key).unwrap().der().clone()
    }

    /// The pinning verifier around webpki with `roots` as the only trust anchors.
    fn verifier(roots: &[CertificateDer<'static>], pinned: Vec<CertificateDer<'static>>) -> PinnedServerVerifier {
        let mut store = rustls::RootCertStore::empty();
        for r in roots {
            store.add(r.clone()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(store), provider).build().unwrap();
        PinnedServerVerifier::new(inner, pinned, PathBuf::from("/etc/ca.pem"))
    }

    fn verify(v: &PinnedServerVerifier, cert: &CertificateDer<'_>, name: &str, now_s: u64) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from(name.to_string()).unwrap();
        v.verify_server_cert(cert, &[], &name, &[], UnixTime::since_unix_epoch(std::time::Duration::from_secs(now_s)))
    }

    const MID_2026: u64 = 1_782_000_000;

    #[test]
    fn validity_reads_both_dates_of_a_certificate() {
        let cert = self_signed_ca_true("localhost");
        // 2020-01-02T00:00:00Z and 2040-03-04T00:00:00Z.
        assert_eq!(validity(cert.as_ref()), Some((1_577_923_200, 2_214_432_000)));
        assert_eq!(der_time(0x17, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(der_time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(der_time(0x18, b"20000229120000Z"), Some(951_825_600));
        assert_eq!(der_time(0x17, b"700101000000"), None);
        assert_eq!(validity(&[0x30, 0x03, 0x02, 0x01]), None);
    }

    #[test]
    fn a_ca_true_self_signed_root_is_refused_by_webpki_alone() {
        // The failure: trusted as a root, refused as the server's own certificate.
        let cert = self_signed_ca_true("localhost");
        let e = verify(&verifier(std::slice::from_ref(&cert), vec![]), &cert, "localhost", MID_2026).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("CaUsedAsEndEntity") && text.contains("tls.ca_file /etc/ca.pem") && text.contains("add its own certificate"), "{text}");
    }

    #[test]
    fn a_pinned_self_signed_certificate_is_accepted_for_its_names() {
        let cert = self_signed_ca_true("localhost");
        let v = verifier(std::slice::from_ref(&cert), vec![cert.clone()]);
        assert!(verify(&v, &cert, "localhost", MID_2026).is_ok());
        assert!(verify(&v, &cert, "127.0.0.1", MID_2026).is_ok());
    }

    #[test]
    fn a_pinned_certificate_for_another_name_or_out_of_its_period_is_refused() {
        let cert = self_signed_ca_true("localhost");
        let v = verifier(std::slice::from_ref(&cert), vec![cert.clone()]);
        let e = verify(&v, &cert, "judge.internal", MID_2026).unwrap_err();
        assert!(
            matches!(e, rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. } | CertificateError::NotValidForName)),
            "{e:?}"
        );
        assert!(e.to_string().contains("judge.internal"), "{e}");
        let expired = verify(&v, &cert, "localhost", 2_214_432_001).unwrap_err();
        assert_eq!(expired, rustls::Error::InvalidCertificate(CertificateError::Expired));
        let early = verify(&v, &cert, "localhost", 1_577_923_199).unwrap_err();
        assert_eq!(early, rustls::Error::InvalidCertificate(CertificateError::NotValidYet));
    }

    #[test]
    fn an_unpinned_self_signed_certificate_is_refused_with_advice() {
        let listed = self_signed_ca_true("localhost");
        let presented = self_signed_ca_true("localhost");
        let v = verifier(std::slice::from_ref(&listed), vec![listed.clone()]);
        let e = verify(&v, &presented, "localhost", MID_2026).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("invalid peer certificate: "), "{text}");
        assert!(text.contains("tls.ca_file /etc/ca.pem") && text.contains("add its own certificate to that file") && text.contains("make a CA"), "{text}");
    }
}
