//! How the nodes' gRPC channels are secured: mutual TLS with the cluster CA, or, for local
//! development only, plaintext.

use std::time::Duration;

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

use crate::error::IdentityError;
use crate::role::PeerRole;
use crate::tls::TlsIdentity;

/// A TLS handshake that takes longer is cut: a peer that opens a connection and sends nothing
/// must not hold a server task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams a peer may reset before the node accepts them (h2's default is 20).
const PENDING_RESETS: usize = 1024;
/// A client's HTTP/2 connection window (hyper's default is 5 MiB); see [`GrpcSecurity::endpoint`].
const CONNECTION_WINDOW: u32 = 64 << 20;

#[derive(Clone, Debug)]
pub enum GrpcSecurity {
    /// Every connection is mutual TLS: both ends present a certificate from the cluster CA.
    Mtls {
        identity: TlsIdentity,
        /// The name checked in servers' certificates instead of the host dialled, for clusters
        /// whose nodes share one certificate name (pod addresses are not known in advance).
        server_name: Option<String>,
    },
    /// Plaintext, no peer checks: `--insecure`, for local development only.
    Insecure,
}

impl GrpcSecurity {
    pub fn is_insecure(&self) -> bool {
        matches!(self, GrpcSecurity::Insecure)
    }

    /// A client endpoint for the gRPC server at `host:port`.
    pub fn endpoint(&self, host_port: &str) -> Result<Endpoint, IdentityError> {
        let invalid = |e: tonic::transport::Error| {
            IdentityError::Config(format!("grpc endpoint {host_port}: {e}"))
        };
        let endpoint = match self {
            GrpcSecurity::Insecure => {
                Endpoint::from_shared(format!("http://{host_port}")).map_err(invalid)?
            }
            GrpcSecurity::Mtls {
                identity,
                server_name,
            } => {
                let mut tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(identity.ca_pem()))
                    .identity(Identity::from_pem(identity.cert_pem(), identity.key_pem()))
                    .timeout(HANDSHAKE_TIMEOUT);
                if let Some(name) = server_name {
                    tls = tls.domain_name(name.clone());
                }
                Endpoint::from_shared(format!("https://{host_port}"))
                    .map_err(invalid)?
                    .tls_config(tls)
                    .map_err(invalid)?
            }
        };
        // Two of h2's defences close a client's connection with GOAWAY ENHANCE_YOUR_CALM,
        // failing every call on it (as RESOURCE_EXHAUSTED), on traffic a loaded cluster makes:
        // - every frame that reaches a stream it has reset and forgotten counts, 1,024 over
        //   the connection's life: a node's last tokens to clients that left (938 in one 40 s
        //   run of the fault suite's etcd outage; past 1,024 in CI, where 2 requests failed);
        // - small DATA frames left unread count against a budget of half the connection
        //   window: ~10,000 tokens with hyper's 5 MiB, which a busy node's streams reach when
        //   the gateway falls behind for a moment.
        // The peer is a cluster node (with mTLS, authenticated): the first count is left
        // unbounded, and a 64 MiB window allows ~140,000 unread tokens.
        Ok(endpoint
            .http2_max_local_error_reset_streams(None)
            .initial_connection_window_size(CONNECTION_WINDOW))
    }

    /// A server builder that, with mutual TLS, refuses any peer without a certificate from the
    /// cluster CA during the handshake. Which role may call which method is checked per call
    /// ([`GrpcSecurity::peer_role`]).
    pub fn server(&self) -> Result<Server, IdentityError> {
        // The server side of the defences in [`GrpcSecurity::endpoint`]: h2 answers more than
        // 20 streams reset before the server accepted them, or 1,024 it reset itself over the
        // connection's life, with GOAWAY ENHANCE_YOUR_CALM, failing every call on it. The
        // gateway's one connection to a node carries all its requests, and a loaded node that
        // accepts late while placements are cancelled passes 20 honestly. The callers are
        // cluster peers (with mTLS, authenticated): the first bound is raised, and the
        // lifetime count left unbounded, as tonic's default already leaves it.
        let server = Server::builder()
            .http2_max_pending_accept_reset_streams(Some(PENDING_RESETS))
            .http2_max_local_error_reset_streams(None);
        match self {
            GrpcSecurity::Insecure => Ok(server),
            GrpcSecurity::Mtls { identity, .. } => {
                let tls = ServerTlsConfig::new()
                    .identity(Identity::from_pem(identity.cert_pem(), identity.key_pem()))
                    .client_ca_root(Certificate::from_pem(identity.ca_pem()))
                    .timeout(HANDSHAKE_TIMEOUT);
                server.tls_config(tls).map_err(|e| IdentityError::Tls {
                    what: "grpc server",
                    reason: e.to_string(),
                })
            }
        }
    }

    /// The role of the peer that sent `request`, from the certificate it presented. `None`
    /// on a plaintext connection or for a certificate naming no role.
    pub fn peer_role(extensions: &http::Extensions) -> Option<PeerRole> {
        let info = extensions.get::<TlsConnectInfo<TcpConnectInfo>>()?;
        let certs = info.peer_certs()?;
        PeerRole::from_cert_der(certs.first()?)
    }
}
