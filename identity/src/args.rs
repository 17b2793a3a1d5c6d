//! The flags every process that joins the cluster takes for its identity: nodes, the gateway
//! and `fission nodes`.

use std::path::PathBuf;

use clap::Args;

use crate::ca::TlsFiles;
use crate::error::IdentityError;
use crate::grpc::GrpcSecurity;
use crate::role::PeerRole;
use crate::tls::TlsIdentity;

#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Cluster CA certificate (PEM). Every gRPC and KV peer must present a certificate it
    /// signed.
    #[arg(long, env = "FISSION_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), issued by the cluster CA for its role.
    #[arg(long, env = "FISSION_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long, env = "FISSION_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Name to check in servers' certificates instead of the host dialled (for nodes whose
    /// certificates share one name).
    #[arg(long, env = "FISSION_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// Local development only: allow channels without TLS (plaintext gRPC when no certificate
    /// is given, the TCP KV backend). Anyone who can reach the ports can then call every
    /// method.
    #[arg(long)]
    pub insecure: bool,
}

impl TlsArgs {
    /// The identity in the PEM files; `None` when no file is named.
    pub fn identity(&self) -> Result<Option<TlsIdentity>, IdentityError> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => TlsIdentity::from_files(&TlsFiles {
                ca_cert: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            })
            .map(Some),
            _ => Err(IdentityError::Config(
                "--tls-ca, --tls-cert and --tls-key go together".into(),
            )),
        }
    }

    /// How this process, of role `role`, secures its gRPC channels: mutual TLS with its
    /// identity, or plaintext when it has none and `--insecure` allows it. A certificate
    /// issued for another role is refused here, at start-up, rather than by every peer later.
    pub fn grpc(&self, role: PeerRole) -> Result<GrpcSecurity, IdentityError> {
        self.grpc_as(&[role])
    }

    /// [`TlsArgs::grpc`] for a process that may act as any of `roles` (the operator's
    /// commands take an admin or a gateway certificate).
    pub fn grpc_as(&self, roles: &[PeerRole]) -> Result<GrpcSecurity, IdentityError> {
        let names = roles
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(" or ");
        match self.identity()? {
            Some(identity) => {
                let has = identity.role();
                if !has.is_some_and(|r| roles.contains(&r)) {
                    return Err(IdentityError::Config(format!(
                        "the certificate in --tls-cert is for role {}, and this process needs {names}: issue it one with the SAN URI {}",
                        has.map_or("(none)", PeerRole::as_str),
                        roles.first().map_or(String::new(), |r| r.uri()),
                    )));
                }
                Ok(GrpcSecurity::Mtls {
                    identity,
                    server_name: self.tls_server_name.clone(),
                })
            }
            None if self.insecure => {
                tracing::warn!(
                    role = %names,
                    "--insecure: gRPC is plaintext and unauthenticated; anyone who can reach this process's ports can call every method. For local development only"
                );
                Ok(GrpcSecurity::Insecure)
            }
            None => Err(IdentityError::Config(
                "gRPC needs mutual TLS: pass --tls-ca, --tls-cert and --tls-key (`fission up` and `fission certs` issue them), or --insecure for local development".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::{generate_dev_ca, write_pem_files};

    fn args_for(role: PeerRole, dir: &std::path::Path) -> TlsArgs {
        let ca = generate_dev_ca().unwrap();
        let files = write_pem_files(dir, &ca, &ca.issue(role, "p").unwrap()).unwrap();
        TlsArgs {
            tls_ca: Some(files.ca_cert),
            tls_cert: Some(files.cert),
            tls_key: Some(files.key),
            ..TlsArgs::default()
        }
    }

    #[test]
    fn no_certificate_needs_insecure() {
        let err = TlsArgs::default().grpc(PeerRole::Decode).unwrap_err();
        assert!(err.to_string().contains("--insecure"), "{err}");
        let insecure = TlsArgs {
            insecure: true,
            ..TlsArgs::default()
        };
        assert!(insecure.grpc(PeerRole::Decode).unwrap().is_insecure());
    }

    #[test]
    fn a_certificate_of_another_role_is_refused_at_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let args = args_for(PeerRole::Gateway, dir.path());
        assert!(!args.grpc(PeerRole::Gateway).unwrap().is_insecure());
        let err = args.grpc(PeerRole::Decode).unwrap_err();
        assert!(err.to_string().contains("role gateway"), "{err}");
    }

    #[test]
    fn half_the_files_is_an_error() {
        let args = TlsArgs {
            tls_ca: Some("ca.pem".into()),
            ..TlsArgs::default()
        };
        assert!(args.identity().is_err());
    }
}
