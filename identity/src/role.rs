//! The role a certificate is issued for, carried in a subject-alternative-name URI.
//!
//! A URI SAN rather than the common name: hostname verification ignores URIs, so the role never
//! interferes with the DNS and IP names a server certificate must carry, and any CA tooling
//! (openssl, cfssl, cert-manager) can add one.

use std::fmt;

use x509_parser::extensions::GeneralName;

/// Prefix of the role URI; the role's name follows it.
pub const ROLE_URI_PREFIX: &str = "urn:fission:role:";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerRole {
    /// Routes requests: the only role that may start generations, prefills and drains.
    Gateway,
    /// Computes prompts and pushes their KV: renews and completes decode reservations.
    Prefill,
    /// Generates tokens.
    Decode,
    /// An operator's tools (`fission nodes drain`): node information and drains.
    Admin,
    /// The cluster's etcd server.
    Etcd,
}

impl PeerRole {
    pub const ALL: [PeerRole; 5] = [
        PeerRole::Gateway,
        PeerRole::Prefill,
        PeerRole::Decode,
        PeerRole::Admin,
        PeerRole::Etcd,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Gateway => "gateway",
            PeerRole::Prefill => "prefill",
            PeerRole::Decode => "decode",
            PeerRole::Admin => "admin",
            PeerRole::Etcd => "etcd",
        }
    }

    pub fn parse(name: &str) -> Option<PeerRole> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The SAN URI that names this role.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.as_str())
    }

    /// The role a DER certificate names. `None` when it names none, an unknown one, or more
    /// than one: an ambiguous certificate gets no rights.
    pub fn from_cert_der(der: &[u8]) -> Option<PeerRole> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut roles = san
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::URI(uri) => uri.strip_prefix(ROLE_URI_PREFIX),
                _ => None,
            });
        let role = PeerRole::parse(roles.next()?)?;
        roles.next().is_none().then_some(role)
    }
}

impl fmt::Display for PeerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
