//! Mutual TLS with a cluster CA, for the QUIC backend.
//!
//! Every node holds the cluster CA certificate and its own certificate and key. Servers require
//! a client certificate that chains to the CA; clients check that the server's certificate
//! chains to the CA and names the host they dialled (or
//! [`QuicConfig::server_name`](crate::QuicConfig::server_name)). Only TLS 1.3 with ring's
//! cipher suites is offered, and the ALPN protocol is [`ALPN`] (`fission-kv/1`): a peer that
//! speaks anything else fails the handshake.
//!
//! `fission up` calls [`generate_dev_ca`] and [`Ca::issue_node_cert`] and writes the PEMs with
//! [`write_dev_tls_files`]; production passes file paths to [`TlsIdentity::from_files`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::error::KvTransferError;

/// ALPN protocol id of the KV transfer protocol, version 1.
pub const ALPN: &[u8] = b"fission-kv/1";

fn tls_err(what: &'static str) -> impl FnOnce(String) -> KvTransferError {
    move |reason| KvTransferError::Tls { what, reason }
}

/// A cluster certificate authority that can issue node certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// A node's certificate and private key, PEM encoded.
#[derive(Clone)]
pub struct NodeCert {
    pub node_name: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for NodeCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCert")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

/// Creates a self-signed CA with a fresh ECDSA P-256 key, for development clusters.
pub fn generate_dev_ca() -> Result<Ca, KvTransferError> {
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(|e| tls_err("ca params")(e.to_string()))?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "fission dev cluster CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().map_err(|e| tls_err("ca key")(e.to_string()))?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| tls_err("self-sign ca")(e.to_string()))?;
    let key_pem = key.serialize_pem();
    Ok(Ca {
        cert_pem: cert.pem(),
        key_pem,
        issuer: Issuer::new(params, key),
    })
}

impl Ca {
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues a certificate for `node_name`, usable as TLS server and client. Besides the node
    /// name it names `localhost`, `127.0.0.1` and `::1`, so a one-machine dev cluster can dial
    /// loopback addresses; use [`Ca::issue_node_cert_with_sans`] to choose the names exactly.
    pub fn issue_node_cert(&self, node_name: &str) -> Result<NodeCert, KvTransferError> {
        let sans = [
            node_name.to_owned(),
            "localhost".to_owned(),
            IpAddr::V4(Ipv4Addr::LOCALHOST).to_string(),
            IpAddr::V6(Ipv6Addr::LOCALHOST).to_string(),
        ];
        self.issue_node_cert_with_sans(node_name, &sans)
    }

    /// Issues a certificate for `node_name` whose subject alternative names are exactly
    /// `sans` (DNS names or IP addresses).
    pub fn issue_node_cert_with_sans(
        &self,
        node_name: &str,
        sans: &[String],
    ) -> Result<NodeCert, KvTransferError> {
        let mut params = CertificateParams::new(sans.to_vec())
            .map_err(|e| tls_err("node cert params")(format!("{node_name}: {e}")))?;
        params
            .distinguished_name
            .push(DnType::CommonName, node_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(|e| tls_err("node key")(e.to_string()))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| tls_err("sign node cert")(format!("{node_name}: {e}")))?;
        Ok(NodeCert {
            node_name: node_name.to_owned(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Paths of the three PEM files a node needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Writes `ca.pem`, `<node>.pem` and `<node>.key` (mode 0600 on Unix) into `dir`.
pub fn write_dev_tls_files(
    dir: &Path,
    ca: &Ca,
    node: &NodeCert,
) -> Result<TlsFiles, KvTransferError> {
    let write = |path: PathBuf, contents: &str, private: bool| {
        let io = |source| KvTransferError::File {
            path: path.display().to_string(),
            source,
        };
        std::fs::write(&path, contents).map_err(io)?;
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        }
        #[cfg(not(unix))]
        let _ = private;
        Ok::<_, KvTransferError>(path)
    };
    Ok(TlsFiles {
        ca_cert: write(dir.join("ca.pem"), ca.cert_pem(), false)?,
        cert: write(
            dir.join(format!("{}.pem", node.node_name)),
            &node.cert_pem,
            false,
        )?,
        key: write(
            dir.join(format!("{}.key", node.node_name)),
            &node.key_pem,
            true,
        )?,
    })
}

/// A node's TLS identity: the cluster CA it trusts, and its own certificate chain and key.
pub struct TlsIdentity {
    roots: Arc<RootCertStore>,
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("roots", &self.roots.len())
            .field("cert_chain", &self.cert_chain.len())
            .finish_non_exhaustive()
    }
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self {
            roots: self.roots.clone(),
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl TlsIdentity {
    /// Parses the CA certificate(s), the node's certificate chain and its private key.
    pub fn from_pem(
        ca_cert_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self, KvTransferError> {
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
        })
    }

    pub fn from_files(files: &TlsFiles) -> Result<Self, KvTransferError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| KvTransferError::File {
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

    /// The identity of `node` in a cluster whose CA is `ca`.
    pub fn dev(ca: &Ca, node: &NodeCert) -> Result<Self, KvTransferError> {
        Self::from_pem(ca.cert_pem(), &node.cert_pem, &node.key_pem)
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// TLS 1.3 server config that requires a client certificate from the cluster CA.
    pub fn rustls_server_config(&self) -> Result<rustls::ServerConfig, KvTransferError> {
        let provider = Self::provider();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
                .build()
                .map_err(|e| tls_err("client verifier")(e.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("server config")(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| tls_err("server certificate")(e.to_string()))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// TLS 1.3 client config that trusts only the cluster CA and presents this node's
    /// certificate.
    pub fn rustls_client_config(&self) -> Result<rustls::ClientConfig, KvTransferError> {
        let mut config = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("client config")(e.to_string()))?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.cert_chain.clone(), self.key.clone_key())
            .map_err(|e| tls_err("client certificate")(e.to_string()))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    pub fn quic_server_config(
        &self,
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<quinn::ServerConfig, KvTransferError> {
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(self.rustls_server_config()?)
                .map_err(|e| tls_err("quic server config")(e.to_string()))?;
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        config.transport_config(transport);
        Ok(config)
    }

    pub fn quic_client_config(
        &self,
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<quinn::ClientConfig, KvTransferError> {
        let crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(self.rustls_client_config()?)
                .map_err(|e| tls_err("quic client config")(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport);
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_ca_issues_loadable_identities() {
        let ca = generate_dev_ca().unwrap();
        let node = ca.issue_node_cert("decode-0").unwrap();
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(node.key_pem.contains("PRIVATE KEY"));
        let id = TlsIdentity::dev(&ca, &node).unwrap();
        id.rustls_server_config().unwrap();
        id.rustls_client_config().unwrap();
    }

    #[test]
    fn pem_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_dev_ca().unwrap();
        let node = ca.issue_node_cert("prefill-0").unwrap();
        let files = write_dev_tls_files(dir.path(), &ca, &node).unwrap();
        assert_eq!(files.key, dir.path().join("prefill-0.key"));
        TlsIdentity::from_files(&files).unwrap();
    }

    #[test]
    fn garbage_pem_is_a_tls_error() {
        let err = TlsIdentity::from_pem("nope", "nope", "nope").unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::Tls {
                    what: "ca certificate",
                    ..
                }
            ),
            "{err}"
        );
    }
}
