//! Which data plane carries KV blocks between nodes. Nodes publish it in their registration so
//! routers pair only nodes that speak the same one; `kvtransfer` builds the server and the
//! transport for it, so no node matches on it.

use std::fmt;
use std::str::FromStr;

/// A KV transfer backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvBackend {
    /// QUIC with mutual TLS (the default).
    Quic,
    /// Plain TCP, for networks that block UDP. No TLS.
    Tcp,
    /// Shared memory, for two nodes on one host. No TLS; the peer must run as the same user.
    Shm,
    /// UCX sends into registered memory (RDMA verbs, or UCX's TCP and shared-memory
    /// transports). No TLS; a peer on the same host must run as the same user.
    Ucx,
}

impl KvBackend {
    /// Every backend, in the order `--help` lists them.
    pub const ALL: [KvBackend; 4] = [
        KvBackend::Quic,
        KvBackend::Tcp,
        KvBackend::Shm,
        KvBackend::Ucx,
    ];
    /// Their names, as [`KvBackend::as_str`] spells them.
    pub const NAMES: [&'static str; 4] = ["quic", "tcp", "shm", "ucx"];

    /// The name nodes publish in their registration and take on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            KvBackend::Quic => "quic",
            KvBackend::Tcp => "tcp",
            KvBackend::Shm => "shm",
            KvBackend::Ucx => "ucx",
        }
    }

    /// Whether the backend authenticates and encrypts on its own (TLS); the others run only
    /// where the operator says plaintext is acceptable.
    pub fn has_tls(self) -> bool {
        matches!(self, KvBackend::Quic)
    }

    /// Whether the backend reaches only nodes on the same host.
    pub fn same_host_only(self) -> bool {
        matches!(self, KvBackend::Shm)
    }
}

impl fmt::Display for KvBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownBackend(pub String);

impl fmt::Display for UnknownBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown KV transport {:?}, expected one of {}",
            self.0,
            KvBackend::NAMES.join(", ")
        )
    }
}

impl std::error::Error for UnknownBackend {}

impl FromStr for KvBackend {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvBackend::ALL
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| UnknownBackend(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (b, name) in KvBackend::ALL.into_iter().zip(KvBackend::NAMES) {
            assert_eq!(b.as_str(), name);
            assert_eq!(name.parse::<KvBackend>(), Ok(b));
            assert_eq!(b.to_string(), name);
        }
        assert!("udp".parse::<KvBackend>().is_err());
    }
}
