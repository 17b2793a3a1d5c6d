//! KV-transfer set-up shared by both roles: which backend, and the TLS identity.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use kvtransfer::{TlsFiles, TlsIdentity};

use crate::error::NodeError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvBackend {
    /// QUIC with mutual TLS (default).
    Quic,
    /// Plain TCP, for networks that block UDP.
    Tcp,
}

impl KvBackend {
    /// The name nodes publish in their registration, so routers pair only nodes that speak
    /// the same backend.
    pub fn as_str(self) -> &'static str {
        match self {
            KvBackend::Quic => "quic",
            KvBackend::Tcp => "tcp",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    #[arg(long, env = "FISSION_KV_TRANSPORT", value_enum, default_value_t = KvBackend::Quic)]
    pub kv_transport: KvBackend,
    /// Cluster CA certificate (PEM); QUIC needs it.
    #[arg(long, env = "FISSION_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This node's certificate (PEM), issued by the cluster CA.
    #[arg(long, env = "FISSION_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "FISSION_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

impl KvArgs {
    pub fn tls(&self) -> Result<TlsIdentity, NodeError> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => Ok(TlsIdentity::from_files(&TlsFiles {
                ca_cert: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            })?),
            _ => Err(NodeError::Config(
                "the QUIC KV transport needs --tls-ca, --tls-cert and --tls-key (fission up generates a dev CA), or use --kv-transport tcp".into(),
            )),
        }
    }
}
