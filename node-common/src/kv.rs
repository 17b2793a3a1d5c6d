//! KV-transfer set-up shared by both roles: which backend, and whether the node's identity
//! allows it.

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use identity::{TlsArgs, TlsIdentity};
pub use kv_types::KvBackend;

use crate::error::NodeError;

#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    /// The KV data plane: quic (mutual TLS, the default), tcp (plain, for networks that
    /// block UDP; needs --insecure), shm (shared memory, nodes on one host; needs
    /// --insecure) or ucx (UCX sends into registered memory: RDMA verbs, or UCX's TCP and
    /// shared-memory transports, UCX_TLS; needs --insecure and libucx0).
    #[arg(
        long,
        env = "FISSION_KV_TRANSPORT",
        default_value_t = KvBackend::Quic,
        value_parser = PossibleValuesParser::new(KvBackend::NAMES).try_map(|s| s.parse::<KvBackend>())
    )]
    pub kv_transport: KvBackend,
    /// Beside the network transport, move KV through shared memory between nodes on one host
    /// (decode nodes serve it, prefill nodes push through it to a decode node whose
    /// reservation names their own host): on unless set to false. Its Unix socket runs mutual
    /// TLS with the node's certificate, so it needs no --insecure (with --insecure and no
    /// certificate, only the peer's user is checked, as for --kv-transport shm).
    #[arg(
        long,
        env = "FISSION_KV_SAME_HOST_SHM",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub kv_same_host_shm: bool,
}

impl KvArgs {
    /// Whether the node serves (decode) or uses (prefill) shared memory for peers on its own
    /// host beside `--kv-transport`: never when shm is the transport already.
    pub fn same_host_shm(&self) -> bool {
        self.kv_same_host_shm && self.kv_transport != KvBackend::Shm
    }

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
            KvBackend::Shm if tls.insecure => {
                tracing::warn!("--kv-transport shm: KV blocks move through memory shared with a peer of this node's user on this host, without TLS; a reservation is not bound to the chosen prefill node's certificate");
                Ok(None)
            }
            KvBackend::Ucx if tls.insecure => {
                tracing::warn!("--kv-transport ucx: KV blocks move as UCX sends without TLS; a peer on this host must run as this node's user, one on another host is not authenticated; a reservation is not bound to the chosen prefill node's certificate");
                Ok(None)
            }
            KvBackend::Ucx => Err(NodeError::Config(
                "the UCX KV transport has no TLS: it needs --insecure (a trusted network only), or use the default --kv-transport quic".into(),
            )),
            KvBackend::Shm => Err(NodeError::Config(
                "the shm KV transport has no TLS: it needs --insecure (peers of this node's user on this host only), or use the default --kv-transport quic".into(),
            )),
        }
    }
}
