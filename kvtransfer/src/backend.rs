//! One server type and one transport type over every backend, so a node builds its data plane
//! from a [`KvBackend`] and never matches on it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use identity::TlsIdentity;
use kv_types::KvBackend;
use tokio_util::sync::CancellationToken;

use crate::error::KvTransferError;
use crate::frame::FrameHeader;
use crate::quic::{QuicConfig, QuicConnection, QuicServer, QuicTransport};
use crate::registry::TransferRegistry;
use crate::shm::{ShmConfig, ShmConnection, ShmServer, ShmTransport};
use crate::sink::KvSink;
use crate::tcp::{TcpConfig, TcpConnection, TcpServer, TcpTransport};
use crate::transport::{KvConnection, KvServer, KvTransport, RefusalObserver, TransferStat};
use crate::ucx::{UcxConfig, UcxConnection, UcxServer, UcxTransport};

/// Each backend's settings; a node takes the defaults and sets what it knows (its address,
/// the name its peers' certificates carry).
#[derive(Clone, Debug, Default)]
pub struct BackendConfig {
    pub quic: QuicConfig,
    pub tcp: TcpConfig,
    pub shm: ShmConfig,
    pub ucx: UcxConfig,
}

impl BackendConfig {
    /// A sender's settings: connections leave from `bind_ip`, and a QUIC peer's certificate
    /// is checked by `server_name` when given instead of the endpoint's host.
    pub fn sender(bind_ip: IpAddr, server_name: Option<String>) -> Self {
        let mut c = Self::default();
        c.quic.client_bind_addr = SocketAddr::new(bind_ip, 0);
        c.quic.server_name = server_name;
        c.tcp.bind_ip = Some(bind_ip);
        c.ucx.bind_ip = Some(bind_ip);
        c.shm.server_name = c.quic.server_name.clone();
        c
    }
}

fn needs_identity(backend: KvBackend) -> KvTransferError {
    KvTransferError::Config {
        field: "identity",
        reason: format!("the {backend} KV transport is mutual TLS and needs a certificate"),
    }
}

/// The receiving side of any backend.
pub enum BackendServer {
    Quic(QuicServer),
    Tcp(TcpServer),
    Shm(ShmServer),
    Ucx(UcxServer),
}

impl BackendServer {
    /// Binds `backend`'s receiver on `addr`. QUIC needs the node's `identity`; shm runs
    /// mutual TLS on its socket when given one; TCP ignores it.
    pub async fn bind(
        backend: KvBackend,
        addr: SocketAddr,
        identity: Option<&TlsIdentity>,
        config: BackendConfig,
    ) -> Result<Self, KvTransferError> {
        Ok(match backend {
            KvBackend::Quic => {
                let identity = identity.ok_or_else(|| needs_identity(backend))?;
                Self::Quic(QuicServer::bind(addr, identity, config.quic)?)
            }
            KvBackend::Tcp => Self::Tcp(TcpServer::bind(addr, config.tcp).await?),
            // Its control socket on `addr`; the data moves as UCX sends into registered memory.
            KvBackend::Ucx => Self::Ucx(UcxServer::bind(addr, config.ucx).await?),
            // A Unix socket of its own in `config.shm.dir`; `addr` is the network's. With an
            // identity the socket runs mutual TLS.
            KvBackend::Shm => {
                let server = ShmServer::bind(config.shm)?;
                Self::Shm(match identity {
                    Some(identity) => server.with_identity(identity)?,
                    None => server,
                })
            }
        })
    }

    /// The endpoint the node advertises: `advertise_host:port`, or the shm server's socket.
    pub fn endpoint(&self, advertise_host: &str) -> Result<String, KvTransferError> {
        match self {
            Self::Shm(s) => Ok(s.endpoint()),
            _ => Ok(format!("{advertise_host}:{}", self.local_addr()?.port())),
        }
    }

    pub fn backend(&self) -> KvBackend {
        match self {
            Self::Quic(_) => KvBackend::Quic,
            Self::Tcp(_) => KvBackend::Tcp,
            Self::Shm(_) => KvBackend::Shm,
            Self::Ucx(_) => KvBackend::Ucx,
        }
    }
}

impl KvServer for BackendServer {
    fn local_addr(&self) -> Result<SocketAddr, KvTransferError> {
        match self {
            Self::Quic(s) => s.local_addr(),
            Self::Tcp(s) => s.local_addr(),
            Self::Shm(s) => s.local_addr(),
            Self::Ucx(s) => s.local_addr(),
        }
    }

    fn refusal_observer(&mut self) -> &mut Option<RefusalObserver> {
        match self {
            Self::Quic(s) => s.refusal_observer(),
            Self::Tcp(s) => s.refusal_observer(),
            Self::Shm(s) => s.refusal_observer(),
            Self::Ucx(s) => s.refusal_observer(),
        }
    }

    async fn serve<S: KvSink>(
        self,
        registry: TransferRegistry,
        sink: Arc<S>,
        shutdown: CancellationToken,
    ) -> Result<(), KvTransferError> {
        match self {
            Self::Quic(s) => s.serve(registry, sink, shutdown).await,
            Self::Tcp(s) => s.serve(registry, sink, shutdown).await,
            Self::Shm(s) => s.serve(registry, sink, shutdown).await,
            Self::Ucx(s) => s.serve(registry, sink, shutdown).await,
        }
    }
}

/// The sending side of any backend.
pub enum BackendTransport {
    Quic(QuicTransport),
    Tcp(TcpTransport),
    Shm(ShmTransport),
    Ucx(UcxTransport),
}

impl BackendTransport {
    /// The sender for `backend`. QUIC needs the node's `identity`.
    pub fn new(
        backend: KvBackend,
        identity: Option<&TlsIdentity>,
        config: BackendConfig,
    ) -> Result<Self, KvTransferError> {
        Ok(match backend {
            KvBackend::Quic => {
                let identity = identity.ok_or_else(|| needs_identity(backend))?;
                Self::Quic(QuicTransport::new(identity, config.quic)?)
            }
            KvBackend::Tcp => Self::Tcp(TcpTransport::new(config.tcp)),
            KvBackend::Ucx => Self::Ucx(UcxTransport::new(config.ucx)),
            KvBackend::Shm => {
                let transport = ShmTransport::new(config.shm);
                Self::Shm(match identity {
                    Some(identity) => transport.with_identity(identity)?,
                    None => transport,
                })
            }
        })
    }

    pub fn backend(&self) -> KvBackend {
        match self {
            Self::Quic(_) => KvBackend::Quic,
            Self::Tcp(_) => KvBackend::Tcp,
            Self::Shm(_) => KvBackend::Shm,
            Self::Ucx(_) => KvBackend::Ucx,
        }
    }
}

impl KvTransport for BackendTransport {
    type Connection = BackendConnection;

    async fn connect(&self, endpoint: &str) -> Result<BackendConnection, KvTransferError> {
        Ok(match self {
            Self::Quic(t) => BackendConnection::Quic(t.connect(endpoint).await?),
            Self::Tcp(t) => BackendConnection::Tcp(t.connect(endpoint).await?),
            Self::Shm(t) => BackendConnection::Shm(t.connect(endpoint).await?),
            Self::Ucx(t) => BackendConnection::Ucx(t.connect(endpoint).await?),
        })
    }
}

/// A connection of any backend.
#[derive(Clone)]
pub enum BackendConnection {
    Quic(QuicConnection),
    Tcp(TcpConnection),
    Shm(ShmConnection),
    Ucx(UcxConnection),
}

impl KvConnection for BackendConnection {
    fn endpoint(&self) -> &str {
        match self {
            Self::Quic(c) => c.endpoint(),
            Self::Tcp(c) => c.endpoint(),
            Self::Shm(c) => c.endpoint(),
            Self::Ucx(c) => c.endpoint(),
        }
    }

    async fn send_frame(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        match self {
            Self::Quic(c) => c.send_frame(frame, payload).await,
            Self::Tcp(c) => c.send_frame(frame, payload).await,
            Self::Shm(c) => c.send_frame(frame, payload).await,
            Self::Ucx(c) => c.send_frame(frame, payload).await,
        }
    }
}
