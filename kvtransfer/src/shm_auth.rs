//! Who is at the other end of a shared-memory connection's Unix socket.
//!
//! Two checks, both before any region exists:
//! - the kernel's `SO_PEERCRED`: the peer runs as this node's user (both ends check it, so a
//!   socket path taken over by another user's process is refused by the sender too);
//! - with a node identity, mutual TLS on the socket (TLS 1.3, the cluster CA, ALPN
//!   `fission-kv-shm/1`): the receiver admits only a prefill certificate, the sender checks
//!   the receiver's certificate by name as QUIC does, and the receiver binds each reservation
//!   to the certificate's DER exactly as over QUIC. The socket then carries only frame headers
//!   and verdicts; the payloads stay in the region, which is private to the user (mode 0600,
//!   unlinked once mapped), so TLS costs a handshake per pooled connection and a few hundred
//!   bytes a frame, not a copy of the payload.
//!
//! Without an identity (`--insecure`), only the user is checked and a reservation's binding to
//! the gateway's chosen prefill node is not (SECURITY.md).

use std::sync::Arc;

use identity::{PeerRole, TlsIdentity};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::error::KvTransferError;
use crate::registry::PeerKey;

/// ALPN protocol id of the shared-memory control socket, version 1.
pub const SHM_ALPN: &[u8] = b"fission-kv-shm/1";

/// A connection's socket, plain or inside TLS.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
pub(crate) type Socket = Box<dyn Io>;

/// The user this process runs as.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Checks that the socket's peer runs as this process's user; returns its pid for logs.
pub(crate) fn check_peer_user(stream: &UnixStream, endpoint: &str) -> Result<i32, KvTransferError> {
    let err = |reason: String| KvTransferError::Stream {
        endpoint: endpoint.to_owned(),
        what: "peer credentials",
        reason,
    };
    let cred = stream.peer_cred().map_err(|e| err(e.to_string()))?;
    if cred.uid() != own_uid() {
        return Err(err(format!(
            "uid {} is not this node's uid {}",
            cred.uid(),
            own_uid()
        )));
    }
    Ok(cred.pid().unwrap_or_default())
}

fn tls_err(what: &'static str) -> impl FnOnce(String) -> KvTransferError {
    move |reason| KvTransferError::Tls { what, reason }
}

/// The receiver's side: mutual TLS admitting only prefill certificates.
#[derive(Clone)]
pub(crate) struct ServerAuth {
    acceptor: TlsAcceptor,
}

impl ServerAuth {
    pub(crate) fn new(tls: &TlsIdentity) -> Result<Self, KvTransferError> {
        let config = tls.rustls_server_config_for_roles(&[SHM_ALPN], &[PeerRole::Prefill])?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The handshake; returns the socket inside TLS and the peer's certificate, the key its
    /// reservations bind to.
    pub(crate) async fn accept(
        &self,
        stream: UnixStream,
        peer: &str,
    ) -> Result<(Socket, PeerKey), KvTransferError> {
        let tls = self
            .acceptor
            .accept(stream)
            .await
            .map_err(|e| tls_err("shm handshake")(format!("{peer}: {e}")))?;
        let key: PeerKey = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|c| Arc::from(c.as_ref()))
            .ok_or_else(|| tls_err("shm handshake")(format!("{peer}: no client certificate")))?;
        Ok((Box::new(tls), key))
    }
}

/// The sender's side: mutual TLS, the receiver's certificate checked by `server_name`.
#[derive(Clone)]
pub(crate) struct ClientAuth {
    connector: TlsConnector,
}

impl ClientAuth {
    pub(crate) fn new(tls: &TlsIdentity) -> Result<Self, KvTransferError> {
        let config = tls.rustls_client_config(&[SHM_ALPN])?;
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
        })
    }

    pub(crate) async fn connect(
        &self,
        stream: UnixStream,
        server_name: &str,
        endpoint: &str,
    ) -> Result<Socket, KvTransferError> {
        let name = ServerName::try_from(server_name.to_owned())
            .map_err(|e| tls_err("shm server name")(format!("{server_name:?}: {e}")))?;
        let tls = self
            .connector
            .connect(name, stream)
            .await
            .map_err(|e| tls_err("shm handshake")(format!("{endpoint}: {e}")))?;
        Ok(Box::new(tls))
    }
}

impl std::fmt::Debug for ServerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerAuth(mutual TLS)")
    }
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientAuth(mutual TLS)")
    }
}
