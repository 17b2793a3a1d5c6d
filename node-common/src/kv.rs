//! KV-transfer set-up shared by both roles: which backend, and whether the node's identity
//! allows it.

use clap::{Args, ValueEnum};
use identity::{TlsArgs, TlsIdentity};

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
}

impl KvArgs {
    /// Checks the backend against the node's identity: QUIC is mutual TLS and needs the
    /// certificate; TCP has no TLS, so it runs only where `--insecure` says plaintext is
    /// acceptable. Returns the identity QUIC uses.
    pub fn identity(&self, tls: &TlsArgs) -> Result<Option<TlsIdentity>, NodeError> {
        match self.kv_transport {
            KvBackend::Quic => match tls.identity()? {
                Some(identity) => Ok(Some(identity)),
                None => Err(NodeError::Config(
                    "the QUIC KV transport needs --tls-ca, --tls-cert and --tls-key (fission up generates a dev CA), or use --kv-transport tcp with --insecure".into(),
                )),
            },
            KvBackend::Tcp if tls.insecure => {
                tracing::warn!("--kv-transport tcp: KV blocks travel unencrypted and unauthenticated; for local development or a trusted network only");
                Ok(None)
            }
            KvBackend::Tcp => Err(NodeError::Config(
                "the TCP KV transport has no TLS: it needs --insecure (local development only), or use the default --kv-transport quic".into(),
            )),
        }
    }
}
