//! A process's TLS identity: the cluster CA it trusts, and its own certificate chain and key,
//! turned into rustls configs for any protocol (the ALPN ids are the caller's).
//!
//! Servers require a client certificate that chains to the CA; clients check that the server's
//! certificate chains to the CA and names the host they dialled. Only TLS 1.3 with ring's
//! cipher suites is offered, AES-128-GCM first.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::ca::{Ca, RoleCert, TlsFiles};
use crate::error::{tls_err, IdentityError};
use crate::role::PeerRole;

pub struct TlsIdentity {
    roots: Arc<RootCertStore>,
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// The PEMs as given: tonic's TLS configs take PEM.
    pem: Arc<Pems>,
}

struct Pems {
    ca: String,
    cert: String,
    key: String,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("roots", &self.roots.len())
            .field("cert_chain", &self.cert_chain.len())
            .field("role", &self.role())
            .finish_non_exhaustive()
    }
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self {
            roots: self.roots.clone(),
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            pem: self.pem.clone(),
        }
    }
}

impl TlsIdentity {
    /// Parses the CA certificate(s), the process's certificate chain and its private key.
    pub fn from_pem(
        ca_cert_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self, IdentityError> {
        let certs = |what: &'static str, pem: &str| {
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err(what)(e.to_string()))?;
            if certs.is_empty() {
                return Err(tls_err(what)("no CERTIFICATE block".to_owned()));
            }
            Ok(certs)
        };
        let mut roots = RootCertStore::empty();
        for ca in certs("ca certificate", ca_cert_pem)? {
            roots
                .add(ca)
                .map_err(|e| tls_err("ca certificate")(e.to_string()))?;
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| tls_err("private key")(e.to_string()))?;
        Ok(Self {
            roots: Arc::new(roots),
            cert_chain: certs("certificate", cert_pem)?,
            key,
            pem: Arc::new(Pems {
                ca: ca_cert_pem.to_owned(),
                cert: cert_pem.to_owned(),
                key: key_pem.to_owned(),
            }),
        })
    }

    pub fn from_files(files: &TlsFiles) -> Result<Self, IdentityError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| IdentityError::File {
                path: path.display().to_string(),
                source,
            })
        };
        Self::from_pem(
            &read(&files.ca_cert)?,
            &read(&files.cert)?,
            &read(&files.key)?,
        )
    }

    /// The identity `cert` gives in a cluster whose CA is `ca`.
    pub fn dev(ca: &Ca, cert: &RoleCert) -> Result<Self, IdentityError> {
        Self::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem)
    }

    /// The role this process's own certificate names.
    pub fn role(&self) -> Option<PeerRole> {
        PeerRole::from_cert_der(self.cert_chain.first()?)
    }

    /// The DER of this process's own certificate, the one its peers see: a decode node tells
    /// the prefill node the gateway chose by its hash (`NodeInfo.kv_identity`).
    pub fn cert_der(&self) -> Option<&[u8]> {
        self.cert_chain.first().map(|c| c.as_ref())
    }

    pub(crate) fn ca_pem(&self) -> &str {
        &self.pem.ca
    }

    pub(crate) fn cert_pem(&self) -> &str {
        &self.pem.cert
    }

    pub(crate) fn key_pem(&self) -> &str {
        &self.pem.key
    }

    /// ring's suites with AES-128-GCM first. ring lists AES-256-GCM first, and a server picks
    /// by its own order; 128-bit keys are TLS 1.3's mandatory suite and take 10 AES rounds
    /// instead of 14, which the KV push over QUIC feels (AES-GCM is about a fifth of its CPU).
    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        let mut provider = rustls::crypto::ring::default_provider();
        provider
            .cipher_suites
            .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        Arc::new(provider)
    }

    /// TLS 1.3 server config that requires a client certificate from the cluster CA and
    /// offers the ALPN protocols `alpn`.
    pub fn rustls_server_config(
        &self,
        alpn: &[&[u8]],
    ) -> Result<rustls::ServerConfig, IdentityError> {
        self.server_config(alpn, None)
    }

    /// As [`TlsIdentity::rustls_server_config`], and the client certificate must name one of
    /// `roles`: a CA-signed peer of any other role (or none) fails the handshake.
    pub fn rustls_server_config_for_roles(
        &self,
        alpn: &[&[u8]],
        roles: &[PeerRole],
    ) -> Result<rustls::ServerConfig, IdentityError> {
        self.server_config(alpn, Some(roles))
    }

    fn server_config(
        &self,
        alpn: &[&[u8]],
        roles: Option<&[PeerRole]>,
    ) -> Result<rustls::ServerConfig, IdentityError> {
        let provider = Self::provider();
        let mut verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
                .build()
                .map_err(|e| tls_err("client verifier")(e.to_string()))?;
        if let Some(roles) = roles {
            verifier = Arc::new(crate::role_verifier::RoleVerifier {
                inner: verifier,
                roles: roles.to_vec(),
            });
        }
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("server config")(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| tls_err("server certificate")(e.to_string()))?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }

    /// TLS 1.3 client config that trusts only the cluster CA, presents this process's
    /// certificate and offers the ALPN protocols `alpn`.
    pub fn rustls_client_config(
        &self,
        alpn: &[&[u8]],
    ) -> Result<rustls::ClientConfig, IdentityError> {
        let mut config = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("client config")(e.to_string()))?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| tls_err("client certificate")(e.to_string()))?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate_dev_ca;

    #[test]
    fn dev_identities_build_both_configs() {
        let ca = generate_dev_ca().unwrap();
        let cert = ca.issue(PeerRole::Decode, "decode-0").unwrap();
        let id = TlsIdentity::dev(&ca, &cert).unwrap();
        id.rustls_server_config(&[b"x"]).unwrap();
        id.rustls_client_config(&[b"x"]).unwrap();
    }

    #[test]
    fn a_handshake_between_two_identities_picks_aes_128_gcm() {
        let ca = generate_dev_ca().unwrap();
        let server =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Decode, "decode-0").unwrap()).unwrap();
        let client =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Prefill, "prefill-0").unwrap()).unwrap();
        let server_config = Arc::new(server.rustls_server_config(&[b"kv"]).unwrap());
        let client_config = Arc::new(client.rustls_client_config(&[b"kv"]).unwrap());
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut c = rustls::ClientConnection::new(client_config, name).unwrap();
        let mut s = rustls::ServerConnection::new(server_config).unwrap();
        // Hand the records across in memory until both sides are through the handshake.
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets().unwrap();
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets().unwrap();
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        assert!(!c.is_handshaking() && !s.is_handshaking());
        for suite in [c.negotiated_cipher_suite(), s.negotiated_cipher_suite()] {
            assert_eq!(
                suite.map(|s| s.suite()),
                Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            );
        }
    }

    #[test]
    fn garbage_pem_is_a_tls_error() {
        let err = TlsIdentity::from_pem("nope", "nope", "nope").unwrap_err();
        assert!(
            matches!(
                err,
                IdentityError::Tls {
                    what: "ca certificate",
                    ..
                }
            ),
            "{err}"
        );
    }
}
