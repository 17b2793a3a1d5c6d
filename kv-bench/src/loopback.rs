//! One of the nodes' KV transports with its receiver in this process, over loopback: for
//! callers that time other work beside a transfer (`fission-loadtest simulate calibrate` times
//! prefill steps beside their push, as a one-host cluster runs them).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use identity::{generate_dev_ca, PeerRole, TlsIdentity};
use kv_types::{KvLayout, TransferId};
use kvtransfer::{
    DiscardSink, KvConnection, KvServer, KvTransferError, KvTransport, LayerHeader, QuicConfig,
    QuicConnection, QuicServer, QuicTransport, Reservation, TcpConfig, TcpConnection, TcpServer,
    TcpTransport, TransferRegistry,
};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// A connected transport and its receiver.
pub struct LoopbackLink {
    conn: LinkConn,
    registry: TransferRegistry,
    layout: KvLayout,
    next_xfer_id: AtomicU64,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

enum LinkConn {
    Tcp(TcpConnection),
    Quic(QuicConnection, Arc<QuicTransport>),
}

impl LoopbackLink {
    /// QUIC with mutual TLS (a dev CA made here) when `quic`, else TCP; the nodes' default
    /// settings either way.
    pub async fn open(quic: bool, layout: KvLayout) -> Result<Self, KvTransferError> {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let registry = TransferRegistry::default();
        let sink = Arc::new(DiscardSink::default());
        let shutdown = CancellationToken::new();
        let (conn, server) = if quic {
            let ca = generate_dev_ca()?;
            let server_tls = TlsIdentity::dev(&ca, &ca.issue(PeerRole::Decode, "link-decode")?)?;
            let client_tls = TlsIdentity::dev(&ca, &ca.issue(PeerRole::Prefill, "link-prefill")?)?;
            let server = QuicServer::bind(loopback, &server_tls, QuicConfig::default())?;
            let endpoint = server.local_addr()?.to_string();
            let task = tokio::spawn(serve(server, registry.clone(), sink, shutdown.clone()));
            let transport = Arc::new(QuicTransport::new(&client_tls, QuicConfig::default())?);
            let conn = transport.connect(&endpoint).await?;
            (LinkConn::Quic(conn, transport), task)
        } else {
            let server = TcpServer::bind(loopback, TcpConfig::default()).await?;
            let endpoint = server.local_addr()?.to_string();
            let task = tokio::spawn(serve(server, registry.clone(), sink, shutdown.clone()));
            let conn = TcpTransport::new(TcpConfig::default())
                .connect(&endpoint)
                .await?;
            (LinkConn::Tcp(conn), task)
        };
        Ok(Self {
            conn,
            registry,
            layout,
            next_xfer_id: AtomicU64::new(1),
            shutdown,
            server,
        })
    }

    /// Pushes a `tokens`-token prompt layer by layer as `layers` yields them (a layer index
    /// and its payload, as a prefill node's layer hook exports them); returns how long from
    /// the first layer to the last verdict.
    pub async fn push_as_computed(
        &self,
        tokens: usize,
        layers: UnboundedReceiver<(u32, Bytes)>,
    ) -> Result<Duration, KvTransferError> {
        let num_blocks = tokens.div_ceil(self.layout.block_size as usize).max(1);
        let header = LayerHeader {
            xfer_id: TransferId(self.next_xfer_id.fetch_add(1, Ordering::Relaxed)),
            epoch: 1,
            layer: 0,
            layout: self.layout,
            block_ids: (0..num_blocks as u32).collect::<Vec<_>>().into(),
            traceparent: None,
        };
        match &self.conn {
            LinkConn::Tcp(c) => streamed_transfer(c, &self.registry, header, layers).await,
            LinkConn::Quic(c, _) => streamed_transfer(c, &self.registry, header, layers).await,
        }
    }

    pub async fn close(self) {
        if let LinkConn::Quic(_, transport) = &self.conn {
            transport.close();
        }
        self.shutdown.cancel();
        let _ = self.server.await;
    }
}

/// Runs a receiver into a discarding sink until `shutdown`; the loopback link's and the
/// bench's servers.
pub(crate) async fn serve<T: KvServer>(
    server: T,
    registry: TransferRegistry,
    sink: Arc<DiscardSink>,
    shutdown: CancellationToken,
) {
    if let Err(e) = server.serve(registry, sink, shutdown).await {
        tracing::error!(error = %e, "loopback kv server failed");
    }
}

/// Registers a reservation, sends each layer as it arrives, and times it from the first
/// layer until the last verdict.
pub(crate) async fn streamed_transfer<C: KvConnection>(
    conn: &C,
    registry: &TransferRegistry,
    header: LayerHeader,
    mut layers: UnboundedReceiver<(u32, Bytes)>,
) -> Result<Duration, KvTransferError> {
    let xfer_id = header.xfer_id;
    registry
        .register(Reservation {
            xfer_id,
            epoch: header.epoch,
            block_ids: header.block_ids.clone(),
            layout: header.layout,
        })
        .await?;
    let mut start = None;
    let mut tasks = JoinSet::new();
    while let Some((layer, payload)) = layers.recv().await {
        start.get_or_insert_with(Instant::now);
        let header = LayerHeader {
            layer,
            ..header.clone()
        };
        let conn = conn.clone();
        tasks.spawn(async move { conn.send_layer(header, payload).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.map_err(|e| KvTransferError::Stream {
            endpoint: conn.endpoint().to_owned(),
            what: "send task",
            reason: e.to_string(),
        })??;
    }
    let elapsed = start.map_or(Duration::ZERO, |s| s.elapsed());
    let status = registry.deregister(xfer_id).await;
    if !status.as_ref().is_some_and(|s| s.is_complete()) {
        return Err(KvTransferError::Timeout {
            xfer_id,
            timeout_ms: 0,
            layers_received: 0,
            num_layers: header.layout.num_layers,
        });
    }
    Ok(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_loopback_link_pushes_whole_prompts_over_either_transport() {
        let layout = KvLayout {
            num_layers: 4,
            ..KvLayout::SMOLLM2_135M_F32
        };
        for quic in [true, false] {
            let link = LoopbackLink::open(quic, layout).await.unwrap();
            // 40 tokens: 3 blocks of K and V per layer.
            let layer_bytes = 2 * 3 * layout.block_bytes() as usize;
            for _ in 0..2 {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                for layer in 0..layout.num_layers {
                    tx.send((layer, Bytes::from(vec![7u8; layer_bytes])))
                        .unwrap();
                }
                drop(tx);
                assert!(link.push_as_computed(40, rx).await.unwrap() > Duration::ZERO);
            }
            // A layer missing is a failed transfer, not a silent one.
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tx.send((0, Bytes::from(vec![7u8; layer_bytes]))).unwrap();
            drop(tx);
            assert!(link.push_as_computed(40, rx).await.is_err());
            link.close().await;
        }
    }
}
