//! QUIC backend (quinn, rustls with ring, mutual TLS).
//!
//! Each layer travels on its own QUIC stream: the sender opens a bidirectional stream, writes
//! the frame and finishes its half; the receiver answers with a 4-byte verdict on the other
//! half. The data direction is what a unidirectional stream would carry; the return half lets
//! the sender learn that the payload was verified and written, not just delivered. Streams run
//! in parallel and QUIC flow control (per-stream and per-connection windows) gives
//! backpressure. A frame refused from its header is answered at once and its payload is
//! stopped with `STOP_SENDING(verdict)`, so the sender does not push megabytes into the void.
//!
//! Connections are cached per endpoint in [`QuicTransport`] and reused across transfers.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use quinn::{VarInt, WriteError};
use rustls::pki_types::CertificateDer;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::accept::{accept_loop, Accepted};
use crate::error::KvTransferError;
use crate::frame::{FrameHeader, FrameLimits};
use crate::registry::{PeerKey, TransferRegistry};
use crate::sink::KvSink;
use crate::transport::{
    receive_frame, resolve, source_for, EarlyRefusal, Handled, KvConnection, KvServer, KvTransport,
    ReceiveCtx, RefusalObserver, TransferStat,
};
use crate::verdict::{Verdict, ACK_LEN};
use identity::{PeerRole, TlsIdentity};

mod config;
mod socket;

use config::new_loopback_endpoint;

pub use config::{new_endpoint, QuicConfig, QuicWindows, LOOPBACK_MTU, MAX_GSO_MTU};

/// ALPN protocol id of the KV transfer protocol, version 1: a peer that speaks anything else
/// fails the handshake.
pub const ALPN: &[u8] = b"fission-kv/1";

fn tls_err(what: &'static str) -> impl FnOnce(String) -> KvTransferError {
    move |reason| KvTransferError::Tls { what, reason }
}

/// The server side of mutual TLS with the cluster CA ([`identity`]), for QUIC.
pub fn quic_server_config(
    tls: &TlsIdentity,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig, KvTransferError> {
    // Only prefill nodes push KV: a gateway, decode or admin certificate, CA-signed as it may
    // be, fails the handshake (issue 31).
    let tls = tls.rustls_server_config_for_roles(&[ALPN], &[PeerRole::Prefill])?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| tls_err("quic server config")(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport);
    Ok(config)
}

/// The client side of mutual TLS with the cluster CA, for QUIC.
pub fn quic_client_config(
    tls: &TlsIdentity,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig, KvTransferError> {
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls.rustls_client_config(&[ALPN])?)
            .map_err(|e| tls_err("quic client config")(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport);
    Ok(config)
}

/// Receives layers over QUIC.
pub struct QuicServer {
    endpoint: quinn::Endpoint,
    config: QuicConfig,
    on_refusal: Option<RefusalObserver>,
}

impl QuicServer {
    /// Binds a UDP socket; call inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        tls: &TlsIdentity,
        config: QuicConfig,
    ) -> Result<Self, KvTransferError> {
        let server = quic_server_config(tls, Arc::new(config.transport_config()?))?;
        let endpoint = new_endpoint(addr, &config, Some(server))?;
        Ok(Self {
            endpoint,
            config,
            on_refusal: None,
        })
    }
}

impl KvServer for QuicServer {
    fn refusal_observer(&mut self) -> &mut Option<RefusalObserver> {
        &mut self.on_refusal
    }

    fn local_addr(&self) -> Result<SocketAddr, KvTransferError> {
        self.endpoint
            .local_addr()
            .map_err(|source| KvTransferError::Bind {
                addr: "quic endpoint".to_owned(),
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
        tracing::info!(%local_addr, "kv quic server listening");
        let ctx = ReceiveCtx::new(registry, sink, self.config.limits, self.on_refusal);
        let endpoint = self.endpoint.clone();
        accept_loop(
            self.config.max_connections,
            &shutdown,
            || async {
                match endpoint.accept().await {
                    Some(incoming) => Accepted::Connection(incoming),
                    None => Accepted::Closed,
                }
            },
            |incoming, shutdown| run_connection_task(incoming, ctx.clone(), shutdown),
        )
        .await;
        self.endpoint.close(VarInt::from_u32(0), b"shutdown");
        tracing::info!(%local_addr, "kv quic server stopped");
        Ok(())
    }
}

async fn run_connection_task<S: KvSink>(
    incoming: quinn::Incoming,
    ctx: Arc<ReceiveCtx<S>>,
    shutdown: CancellationToken,
) {
    let peer = incoming.remote_address().to_string();
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "kv quic handshake failed");
            return;
        }
    };
    // The verifier admitted only a CA-signed prefill certificate; its DER names the peer that
    // reservations bind to.
    let peer_key: Option<PeerKey> = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.first().map(|c| Arc::from(c.as_ref())));
    tracing::debug!(%peer, "kv quic connection accepted");
    let mut streams = JoinSet::new();
    loop {
        let (send, recv) = tokio::select! {
            _ = shutdown.cancelled() => {
                conn.close(VarInt::from_u32(0), b"shutdown");
                break;
            }
            stream = conn.accept_bi() => match stream {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::debug!(%peer, reason = %e, "kv quic connection closed");
                    break;
                }
            },
        };
        streams.spawn(run_stream_task(
            send,
            recv,
            ctx.clone(),
            peer.clone(),
            peer_key.clone(),
        ));
        while streams.try_join_next().is_some() {}
    }
    streams.shutdown().await;
}

async fn run_stream_task<S: KvSink>(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    ctx: Arc<ReceiveCtx<S>>,
    peer: String,
    peer_key: Option<PeerKey>,
) {
    let mut scratch = Vec::new();
    let received = receive_frame(
        &mut recv,
        &ctx,
        &mut scratch,
        EarlyRefusal::Abandon,
        &peer,
        peer_key.as_ref(),
    );
    let verdict = match received.await {
        Handled::Eof => return,
        Handled::Answer(v) => v,
        Handled::Refused(v) | Handled::Fatal(v) => {
            // Ignore the error: the sender may already have reset its half.
            let _ = recv.stop(VarInt::from_u32(v as u32));
            v
        }
    };
    if send.write_all(&verdict.encode()).await.is_ok() {
        let _ = send.finish();
    }
}

/// Endpoints bound to the unspecified address, made on first use for peers that the
/// configured bind address cannot reach ([`source_for`]), by address family.
struct Fallback {
    endpoints: Mutex<HashMap<IpAddr, quinn::Endpoint>>,
    client: quinn::ClientConfig,
    /// For peers on a loopback address ([`QuicConfig::loopback_mtu`]).
    loopback: Option<quinn::ClientConfig>,
}

/// Sends layers over QUIC, caching one connection per endpoint.
pub struct QuicTransport {
    endpoint: quinn::Endpoint,
    /// Boxed: a transport sits in enums beside the TCP one.
    fallback: Box<Fallback>,
    config: QuicConfig,
    /// Per endpoint, its [`QuicConfig::connections_per_endpoint`] connections.
    connections: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Vec<quinn::Connection>>>>>,
}

impl QuicTransport {
    /// Binds the client endpoint; call inside a tokio runtime.
    pub fn new(tls: &TlsIdentity, config: QuicConfig) -> Result<Self, KvTransferError> {
        let mut endpoint = new_endpoint(config.client_bind_addr, &config, None)?;
        let client = quic_client_config(tls, Arc::new(config.transport_config()?))?;
        endpoint.set_default_client_config(client.clone());
        let loopback = match config.loopback_transport_config()? {
            Some(t) => Some(quic_client_config(tls, Arc::new(t))?),
            None => None,
        };
        Ok(Self {
            endpoint,
            fallback: Box::new(Fallback {
                endpoints: Mutex::new(HashMap::new()),
                client,
                loopback,
            }),
            config,
            connections: Mutex::new(HashMap::new()),
        })
    }

    /// The endpoint whose socket can reach `peer`.
    fn endpoint_for(&self, peer: SocketAddr) -> Result<quinn::Endpoint, KvTransferError> {
        if peer.ip().is_loopback() && self.fallback.loopback.is_some() {
            return self.loopback_endpoint(peer);
        }
        let bind = self.config.client_bind_addr;
        let source = source_for(bind.ip(), peer.ip());
        if source == bind.ip() {
            return Ok(self.endpoint.clone());
        }
        self.cached_endpoint(source, || {
            tracing::info!(%bind, %peer, %source, "kv quic: the bind address cannot reach this peer; sending from the unspecified address");
            let mut endpoint = new_endpoint(SocketAddr::new(source, 0), &self.config, None)?;
            endpoint.set_default_client_config(self.fallback.client.clone());
            Ok(endpoint)
        })
    }

    /// The endpoint sending from `source`, made by `make` the first time.
    fn cached_endpoint(
        &self,
        source: IpAddr,
        make: impl FnOnce() -> Result<quinn::Endpoint, KvTransferError>,
    ) -> Result<quinn::Endpoint, KvTransferError> {
        let mut endpoints = self
            .fallback
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(endpoint) = endpoints.get(&source) {
            return Ok(endpoint.clone());
        }
        let endpoint = make()?;
        endpoints.insert(source, endpoint.clone());
        Ok(endpoint)
    }

    /// An endpoint of its own for peers on a loopback address, bound there: its GSO batches
    /// are sized for [`QuicConfig::loopback_mtu`], the other endpoints' for the path MTU
    /// (a batch of 16,000-byte datagrams holds 4, one of 1,452-byte ones 10).
    fn loopback_endpoint(&self, peer: SocketAddr) -> Result<quinn::Endpoint, KvTransferError> {
        let source = match peer {
            SocketAddr::V4(_) => IpAddr::from(Ipv4Addr::LOCALHOST),
            SocketAddr::V6(_) => IpAddr::from(Ipv6Addr::LOCALHOST),
        };
        self.cached_endpoint(source, || {
            new_loopback_endpoint(SocketAddr::new(source, 0), &self.config)
        })
    }

    /// Closes every cached connection.
    pub fn close(&self) {
        self.endpoint.close(VarInt::from_u32(0), b"closed");
        for endpoint in self
            .fallback
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            endpoint.close(VarInt::from_u32(0), b"closed");
        }
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.close();
    }
}

impl KvTransport for QuicTransport {
    type Connection = QuicConnection;

    async fn connect(&self, endpoint: &str) -> Result<QuicConnection, KvTransferError> {
        let slot = self
            .connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(endpoint.to_owned())
            .or_default()
            .clone();
        // One dial per endpoint at a time; the others wait and reuse its connections. A
        // closed one is redialled alone.
        let mut cached = slot.lock().await;
        let want = self.config.connections_per_endpoint.max(1);
        cached.retain(|c| c.close_reason().is_none());
        if cached.len() < want {
            let (addr, host) = resolve(endpoint).await?;
            while cached.len() < want {
                cached.push(self.dial(endpoint, addr, &host).await?);
            }
        }
        Ok(QuicConnection::new(
            cached.iter().take(want).cloned().collect(),
            endpoint,
            &self.config,
        ))
    }
}

impl QuicTransport {
    async fn dial(
        &self,
        endpoint: &str,
        addr: SocketAddr,
        host: &str,
    ) -> Result<quinn::Connection, KvTransferError> {
        let server_name = self.config.server_name.as_deref().unwrap_or(host);
        let local = self.endpoint_for(addr)?;
        let connecting = match self.fallback.loopback.as_ref() {
            Some(loopback) if addr.ip().is_loopback() => {
                local.connect_with(loopback.clone(), addr, server_name)
            }
            _ => local.connect(addr, server_name),
        };
        let conn = connecting
            .map_err(|e| KvTransferError::Connect {
                endpoint: endpoint.to_owned(),
                reason: e.to_string(),
            })?
            .await
            .map_err(|source| KvTransferError::Connection {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        tracing::debug!(endpoint, %addr, "kv quic connection established");
        Ok(conn)
    }
}

/// The QUIC connections to one decode node ([`QuicConfig::connections_per_endpoint`]).
#[derive(Clone)]
pub struct QuicConnection {
    /// Never empty.
    conns: Arc<[quinn::Connection]>,
    endpoint: Arc<str>,
    limits: FrameLimits,
}

impl std::fmt::Debug for QuicConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConnection")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl QuicConnection {
    fn new(conns: Vec<quinn::Connection>, endpoint: &str, config: &QuicConfig) -> Self {
        debug_assert!(!conns.is_empty());
        Self {
            conns: conns.into(),
            endpoint: endpoint.into(),
            limits: config.limits,
        }
    }

    /// Identifies the first underlying QUIC connection: equal ids mean cached connections
    /// were reused.
    pub fn connection_id(&self) -> usize {
        self.conns[0].stable_id()
    }

    /// How many QUIC connections this one spreads layers over.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// quinn's counters for the first connection (RTT, congestion window, path MTU).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.conns[0].stats()
    }

    /// Packets lost on every connection together.
    pub fn lost_packets(&self) -> u64 {
        self.conns.iter().map(|c| c.stats().path.lost_packets).sum()
    }

    fn stream_err(&self, what: &'static str, e: impl std::fmt::Display) -> KvTransferError {
        KvTransferError::Stream {
            endpoint: self.endpoint.to_string(),
            what,
            reason: e.to_string(),
        }
    }

    async fn send_frame_inner(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let start = Instant::now();
        let (xfer_id, layer) = (frame.header.xfer_id, frame.header.layer);
        let header = frame.encode(&self.limits)?;
        let frame_bytes = (header.len() + payload.len()) as u64;
        let payload_bytes = payload.len() as u64;
        let rejected = |verdict| KvTransferError::Rejected {
            xfer_id,
            layer,
            endpoint: self.endpoint.to_string(),
            verdict,
        };
        // Layer i on connection i % n: consecutive layers, written at once, go out through
        // different connection drivers.
        let conn = &self.conns[layer as usize % self.conns.len()];
        let (mut send, mut recv) =
            conn.open_bi()
                .await
                .map_err(|source| KvTransferError::Connection {
                    endpoint: self.endpoint.to_string(),
                    source,
                })?;
        match send.write_all_chunks(&mut [header, payload]).await {
            Ok(()) => {}
            Err(WriteError::Stopped(code)) => {
                return Err(rejected(
                    Verdict::from_code(code.into_inner()).unwrap_or(Verdict::Malformed),
                ))
            }
            Err(WriteError::ConnectionLost(source)) => {
                return Err(KvTransferError::Connection {
                    endpoint: self.endpoint.to_string(),
                    source,
                })
            }
            Err(e) => return Err(self.stream_err("write frame", e)),
        }
        send.finish()
            .map_err(|e| self.stream_err("finish stream", e))?;
        let mut ack = [0u8; ACK_LEN];
        recv.read_exact(&mut ack)
            .await
            .map_err(|e| self.stream_err("read verdict", e))?;
        match Verdict::decode(ack) {
            Some(Verdict::Accepted) => Ok(TransferStat {
                layer,
                payload_bytes,
                frame_bytes,
                elapsed: start.elapsed(),
            }),
            Some(verdict) => Err(rejected(verdict)),
            None => Err(self.stream_err("read verdict", format!("malformed verdict {ack:02x?}"))),
        }
    }
}

impl KvConnection for QuicConnection {
    fn endpoint(&self) -> &str {
        &self.endpoint
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
            endpoint = %self.endpoint,
        );
        self.send_frame_inner(frame, payload).instrument(span).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::LayerHeader;
    use crate::refusal_log::RefusalLog;
    use crate::sink::DiscardSink;
    use identity::generate_dev_ca;
    use kv_types::{KvDtype, KvLayout, TransferId};

    #[tokio::test]
    async fn refused_frames_reach_the_observer() {
        refusals_over(1).await;
    }

    /// Layers spread over two connections: each its own handshake, and every layer's verdict
    /// comes back on the connection it went out on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layers_spread_over_two_connections() {
        refusals_over(2).await;
    }

    async fn refusals_over(connections: usize) {
        let config = QuicConfig {
            connections_per_endpoint: connections,
            ..QuicConfig::default()
        };
        let ca = generate_dev_ca().unwrap();
        let server_tls =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Decode, "decode-0").unwrap()).unwrap();
        let client_tls =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Prefill, "prefill-0").unwrap()).unwrap();
        let refusals = RefusalLog::default();
        let server = QuicServer::bind(([127, 0, 0, 1], 0).into(), &server_tls, config.clone())
            .unwrap()
            .on_refusal(refusals.observer());
        let endpoint = server.local_addr().unwrap().to_string();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(server.serve(
            TransferRegistry::default(),
            Arc::new(DiscardSink::default()),
            shutdown.clone(),
        ));
        let layout = KvLayout {
            dtype: KvDtype::F32,
            num_layers: 2,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
            windows: Default::default(),
        };
        let header = LayerHeader {
            xfer_id: TransferId(99),
            epoch: 1,
            layer: 0,
            layout: KvLayout {
                num_layers: 2,
                ..layout
            },
            block_ids: Arc::from(vec![3u32]),
            traceparent: None,
        };
        let transport = QuicTransport::new(&client_tls, config).unwrap();
        let conn = transport.connect(&endpoint).await.unwrap();
        assert_eq!(conn.connection_count(), connections);
        let ids: std::collections::HashSet<usize> =
            conn.conns.iter().map(|c| c.stable_id()).collect();
        assert_eq!(ids.len(), connections, "distinct connections");
        // A reconnect reuses the cached connections.
        let again = transport.connect(&endpoint).await.unwrap();
        assert_eq!(again.connection_id(), conn.connection_id());
        assert_eq!(again.connection_count(), connections);
        let payload = Bytes::from(vec![1u8; 2 * layout.block_bytes() as usize]);
        for layer in 0..2 {
            let header = LayerHeader {
                layer,
                ..header.clone()
            };
            let err = conn.send_layer(header, payload.clone()).await.unwrap_err();
            if layer == 0 {
                refusals.assert_only_unknown_transfer(&err);
            } else {
                assert!(
                    matches!(
                        err,
                        KvTransferError::Rejected {
                            verdict: Verdict::UnknownTransfer,
                            layer: 1,
                            ..
                        }
                    ),
                    "{err}"
                );
            }
        }
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}
