//! TCP backend, for networks that block UDP.
//!
//! The same frames and verdicts as QUIC, over plain TCP with `TCP_NODELAY`. A TCP stream
//! carries one frame at a time (frame, then verdict), so each endpoint gets a small pool of
//! connections and concurrent layers take one each. A frame refused from its header has its
//! payload read and dropped so the stream stays in step; a frame that cannot be parsed ends
//! the connection.
//!
//! There is no TLS on this path yet: use it only inside a trusted network.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::accept::{accept_loop, Accepted};
use crate::error::KvTransferError;
use crate::frame::{FrameHeader, FrameLimits};
use crate::receive::{serve_frames, FrameLoop, Open};
use crate::registry::TransferRegistry;
use crate::sink::KvSink;
use crate::stream_io;
use crate::transport::{
    resolve, source_for, EarlyRefusal, KvConnection, KvServer, KvTransport, ReceiveCtx,
    RefusalObserver, TransferStat,
};
use crate::verdict::{Verdict, ACK_LEN};

#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Client: most connections per endpoint, so most layers in flight to one node.
    pub connections_per_endpoint: usize,
    pub connect_timeout_ms: u64,
    /// Client: the local address connections leave from (the node's own interface), or the
    /// system's choice when unset.
    pub bind_ip: Option<std::net::IpAddr>,
    /// Server: connections served at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    pub limits: FrameLimits,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            connections_per_endpoint: 8,
            connect_timeout_ms: 5_000,
            bind_ip: None,
            max_connections: 1024,
            limits: FrameLimits::default(),
        }
    }
}

/// Receives layers over TCP.
pub struct TcpServer {
    listener: TcpListener,
    config: TcpConfig,
    on_refusal: Option<RefusalObserver>,
}

impl TcpServer {
    pub async fn bind(addr: SocketAddr, config: TcpConfig) -> Result<Self, KvTransferError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| KvTransferError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        Ok(Self {
            listener,
            config,
            on_refusal: None,
        })
    }
}

impl KvServer for TcpServer {
    fn refusal_observer(&mut self) -> &mut Option<RefusalObserver> {
        &mut self.on_refusal
    }

    fn local_addr(&self) -> Result<SocketAddr, KvTransferError> {
        self.listener
            .local_addr()
            .map_err(|source| KvTransferError::Bind {
                addr: "tcp listener".to_owned(),
                source,
            })
    }

    async fn serve<S: KvSink>(
        self,
        registry: TransferRegistry,
        sink: Arc<S>,
        shutdown: CancellationToken,
    ) -> Result<(), KvTransferError> {
        let local_addr = self.local_addr()?;
        tracing::info!(%local_addr, "kv tcp server listening");
        let ctx = ReceiveCtx::new(registry, sink, self.config.limits, self.on_refusal);
        let listener = &self.listener;
        accept_loop(
            self.config.max_connections,
            &shutdown,
            || async {
                match listener.accept().await {
                    Ok((stream, peer)) => Accepted::Connection((stream, peer)),
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "kv tcp accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Accepted::Retry
                    }
                }
            },
            |(stream, peer), shutdown| {
                run_connection_task(stream, peer.to_string(), ctx.clone(), shutdown)
            },
        )
        .await;
        tracing::info!(%local_addr, "kv tcp server stopped");
        Ok(())
    }
}

async fn run_connection_task<S: KvSink>(
    mut stream: TcpStream,
    peer: String,
    ctx: Arc<ReceiveCtx<S>>,
    shutdown: CancellationToken,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "kv tcp set_nodelay failed");
    }
    tracing::debug!(%peer, "kv tcp connection accepted");
    let frames = FrameLoop {
        ctx: &ctx,
        early: EarlyRefusal::Discard,
        peer: &peer,
        peer_key: None,
    };
    serve_frames(&mut stream, frames, Open, &shutdown).await;
}

/// Sends layers over TCP, with a pool of connections per endpoint.
pub struct TcpTransport {
    config: TcpConfig,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
}

impl TcpTransport {
    pub fn new(config: TcpConfig) -> Self {
        Self {
            config,
            pools: Mutex::new(HashMap::new()),
        }
    }

    /// Drops every pooled connection.
    pub fn close(&self) {
        self.pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl Default for TcpTransport {
    fn default() -> Self {
        Self::new(TcpConfig::default())
    }
}

impl KvTransport for TcpTransport {
    type Connection = TcpConnection;

    async fn connect(&self, endpoint: &str) -> Result<TcpConnection, KvTransferError> {
        let existing = self
            .pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
            .cloned();
        let pool = match existing {
            Some(pool) => pool,
            None => {
                let (addr, _) = resolve(endpoint).await?;
                let pool = Arc::new(Pool {
                    endpoint: endpoint.into(),
                    addr,
                    bind_ip: self.config.bind_ip,
                    connect_timeout: Duration::from_millis(self.config.connect_timeout_ms),
                    idle: Mutex::new(Vec::new()),
                    permits: Arc::new(Semaphore::new(self.config.connections_per_endpoint.max(1))),
                });
                // Dial once now so an unreachable endpoint fails here, not on the first layer.
                let stream = pool.dial().await?;
                pool.put_back(stream);
                self.pools
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(endpoint.to_owned())
                    .or_insert(pool)
                    .clone()
            }
        };
        Ok(TcpConnection {
            pool,
            limits: self.config.limits,
        })
    }
}

struct Pool {
    endpoint: Arc<str>,
    addr: SocketAddr,
    bind_ip: Option<std::net::IpAddr>,
    connect_timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    permits: Arc<Semaphore>,
}

impl Pool {
    async fn dial(&self) -> Result<TcpStream, KvTransferError> {
        let connect_err = |reason: String| KvTransferError::Connect {
            endpoint: self.endpoint.to_string(),
            reason,
        };
        let connect = async {
            // A bind address that cannot reach the peer (loopback, for a peer elsewhere) is
            // left out, as no bind at all.
            let Some(ip) = self
                .bind_ip
                .map(|ip| source_for(ip, self.addr.ip()))
                .filter(|ip| !ip.is_unspecified())
            else {
                return TcpStream::connect(self.addr).await;
            };
            let socket = if ip.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            socket.bind(SocketAddr::new(ip, 0))?;
            socket.connect(self.addr).await
        };
        let stream = tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| {
                connect_err(format!(
                    "no answer within connect_timeout_ms {}",
                    self.connect_timeout.as_millis()
                ))
            })?
            .map_err(|e| connect_err(e.to_string()))?;
        stream
            .set_nodelay(true)
            .map_err(|source| stream_io::io_error(&self.endpoint, "set_nodelay", source))?;
        Ok(stream)
    }

    fn take_idle(&self) -> Option<TcpStream> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn put_back(&self, stream: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stream);
    }
}

/// A pool of TCP connections to one decode node.
#[derive(Clone)]
pub struct TcpConnection {
    pool: Arc<Pool>,
    limits: FrameLimits,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConnection")
            .field("endpoint", &self.pool.endpoint)
            .finish_non_exhaustive()
    }
}

/// Whether the server keeps the stream open after answering with `verdict`.
fn stream_survives(verdict: Verdict) -> bool {
    !matches!(
        verdict,
        Verdict::Malformed | Verdict::TooLarge | Verdict::LayoutMismatch | Verdict::ShuttingDown
    )
}

impl TcpConnection {
    /// One frame on one stream: write it, read the verdict.
    async fn exchange(
        &self,
        stream: &mut TcpStream,
        header: &[u8],
        payload: &[u8],
    ) -> Result<Verdict, KvTransferError> {
        let endpoint = &*self.pool.endpoint;
        stream_io::write_frame(stream, header, payload, endpoint).await?;
        let mut ack = [0u8; ACK_LEN];
        stream
            .read_exact(&mut ack)
            .await
            .map_err(|source| stream_io::io_error(endpoint, "read verdict", source))?;
        Verdict::decode(ack).ok_or_else(|| KvTransferError::Stream {
            endpoint: endpoint.to_owned(),
            what: "read verdict",
            reason: format!("malformed verdict {ack:02x?}"),
        })
    }

    async fn send_frame_inner(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let start = Instant::now();
        let (xfer_id, layer) = (frame.header.xfer_id, frame.header.layer);
        let header = frame.encode(&self.limits)?;
        let _permit = self
            .pool
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| KvTransferError::Stream {
                endpoint: self.pool.endpoint.to_string(),
                what: "connection pool",
                reason: e.to_string(),
            })?;
        let verdict = match self.pool.take_idle() {
            Some(mut stream) => match self.exchange(&mut stream, &header, &payload).await {
                Ok(v) => {
                    if stream_survives(v) {
                        self.pool.put_back(stream);
                    }
                    v
                }
                // A pooled stream the server has since closed: retry once on a fresh one.
                Err(e) => {
                    tracing::debug!(error = %e, "kv tcp pooled stream failed, redialling");
                    self.exchange_fresh(&header, &payload).await?
                }
            },
            None => self.exchange_fresh(&header, &payload).await?,
        };
        if verdict != Verdict::Accepted {
            return Err(KvTransferError::Rejected {
                xfer_id,
                layer,
                endpoint: self.pool.endpoint.to_string(),
                verdict,
            });
        }
        Ok(TransferStat {
            layer,
            payload_bytes: payload.len() as u64,
            frame_bytes: (header.len() + payload.len()) as u64,
            elapsed: start.elapsed(),
        })
    }

    async fn exchange_fresh(
        &self,
        header: &[u8],
        payload: &[u8],
    ) -> Result<Verdict, KvTransferError> {
        let mut stream = self.pool.dial().await?;
        let verdict = self.exchange(&mut stream, header, payload).await?;
        if stream_survives(verdict) {
            self.pool.put_back(stream);
        }
        Ok(verdict)
    }
}

impl KvConnection for TcpConnection {
    fn endpoint(&self) -> &str {
        &self.pool.endpoint
    }

    async fn send_frame(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let h = &frame.header;
        // A child of the caller's span (the node's `kv_transfer`); integers as i64, which OTLP
        // exports as ints (u64 becomes a string).
        let span = tracing::debug_span!(
            "kv_send_layer",
            xfer_id = h.xfer_id.0 as i64,
            epoch = h.epoch as i64,
            layer = i64::from(h.layer),
            payload_bytes = payload.len() as i64,
            endpoint = %self.pool.endpoint,
        );
        self.send_frame_inner(frame, payload).instrument(span).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::LayerHeader;
    use crate::refusal_log::RefusalLog;
    use crate::registry::Reservation;
    use crate::sink::DiscardSink;
    use kv_types::{KvDtype, KvLayout, TransferId};

    const LAYOUT: KvLayout = KvLayout {
        dtype: KvDtype::F32,
        num_layers: 2,
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 4,
        windows: kv_types::LayerWindows::NONE,
    };

    fn header(xfer_id: TransferId, layer: u32) -> LayerHeader {
        LayerHeader {
            xfer_id,
            epoch: 1,
            layer,
            layout: KvLayout {
                num_layers: 2,
                ..LAYOUT
            },
            block_ids: Arc::from(vec![3u32]),
            traceparent: None,
        }
    }

    #[tokio::test]
    async fn refused_frames_reach_the_observer_and_accepted_ones_do_not() {
        let refusals = RefusalLog::default();
        let server = TcpServer::bind(([127, 0, 0, 1], 0).into(), TcpConfig::default())
            .await
            .unwrap()
            .on_refusal(refusals.observer());
        let endpoint = server.local_addr().unwrap().to_string();
        let registry = TransferRegistry::default();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(server.serve(
            registry.clone(),
            Arc::new(DiscardSink::default()),
            shutdown.clone(),
        ));
        registry
            .register(Reservation {
                xfer_id: TransferId(7),
                epoch: 1,
                block_ids: Arc::from(vec![3u32]),
                layout: KvLayout {
                    num_layers: 2,
                    ..LAYOUT
                },
            })
            .await
            .unwrap();
        let payload = Bytes::from(vec![1u8; 2 * LAYOUT.block_bytes() as usize]);
        let conn = TcpTransport::default().connect(&endpoint).await.unwrap();
        conn.send_layer(header(TransferId(7), 0), payload.clone())
            .await
            .unwrap();
        let err = conn
            .send_layer(header(TransferId(99), 0), payload.clone())
            .await
            .unwrap_err();
        refusals.assert_only_unknown_transfer(&err);
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}
