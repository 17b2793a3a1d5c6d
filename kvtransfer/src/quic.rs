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
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::{IdleTimeout, MtuDiscoveryConfig, VarInt, WriteError};
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

/// Flow-control windows. The receive windows are what this side advertises to its peer; the
/// send window caps how much unacknowledged data this side buffers per connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuicWindows {
    pub stream_receive_window_bytes: u64,
    pub receive_window_bytes: u64,
    pub send_window_bytes: u64,
}

impl QuicWindows {
    /// quinn 0.11's defaults, sized for 100 Mbit/s at 100 ms: 1.25 MB per stream, no
    /// connection limit, 10 MB send buffer.
    pub const QUINN_DEFAULT: QuicWindows = QuicWindows {
        stream_receive_window_bytes: 1_250_000,
        receive_window_bytes: (1 << 62) - 1,
        send_window_bytes: 10_000_000,
    };

    /// Sized for multi-megabyte layers on fast links, with memory bounded per peer: 8 MiB per
    /// stream (a 4K-token SmolLM2 layer, 6 MiB, in one window; 8 GB/s per stream at 1 ms
    /// RTT), 64 MiB per connection both ways (64 GB/s at 1 ms, 6.4 GB/s at 10 ms). quinn's
    /// default connection window is unbounded, so a receiver could buffer up to
    /// `max_concurrent_streams` stream windows per peer.
    pub const TUNED: QuicWindows = QuicWindows {
        stream_receive_window_bytes: 8 << 20,
        receive_window_bytes: 64 << 20,
        send_window_bytes: 64 << 20,
    };
}

#[derive(Clone, Debug)]
pub struct QuicConfig {
    pub windows: QuicWindows,
    /// Streams a peer may have open at once, so layers of concurrent transfers in flight.
    pub max_concurrent_streams: u32,
    pub idle_timeout_ms: u64,
    pub keep_alive_interval_ms: u64,
    /// Largest UDP payload path-MTU discovery probes for. quinn's default (1452) suits a
    /// 1500-byte Ethernet MTU; 8952 suits 9000-byte jumbo frames.
    pub mtu_upper_bound: u16,
    /// UDP payload size used from the first packet, before path-MTU discovery; at least
    /// 1200. Where the path MTU is known (a jumbo-frame fabric), set it and skip the probing.
    pub initial_mtu: u16,
    /// UDP payload size to a peer on a loopback address (two nodes on one host, the bench),
    /// from the first packet and without discovery: loopback's MTU is 64 KiB and nothing on
    /// it drops a large datagram, and most of QUIC's cost is per packet, so fewer, larger
    /// packets move more bytes per CPU second. At most [`MAX_GSO_MTU`]; 0 uses
    /// `initial_mtu` and discovery as for any peer. Other peers always keep discovery.
    pub loopback_mtu: u16,
    /// BBR instead of Cubic to a peer on a loopback address (with `loopback_mtu`). Off: on
    /// loopback it lost more datagrams and was slower in 5 of 6 A/B rows
    /// (`benchmarks/history/2026-11-29-quic-shm.md`).
    pub loopback_bbr: bool,
    /// Round-robin between streams of equal priority. Off (the default), streams go out in
    /// the order they were written: early layers finish first, packets carry fewer stream
    /// frames, and on loopback a whole transfer finished 5-20% sooner.
    pub send_fairness: bool,
    /// `SO_RCVBUF` and `SO_SNDBUF` of the UDP socket; 0 leaves the OS default. Linux caps it
    /// at `net.core.rmem_max`/`wmem_max`. The default (212,992 bytes on Linux) overflows when
    /// dozens of streams burst at once, and every drop halves the congestion window.
    pub socket_buffer_bytes: usize,
    /// Server: connections served at once; further handshakes wait.
    pub max_connections: usize,
    /// Client: the name checked against the server's certificate instead of the endpoint's
    /// host.
    pub server_name: Option<String>,
    /// Client: local address of the sending endpoint.
    pub client_bind_addr: SocketAddr,
    pub limits: FrameLimits,
}

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            windows: QuicWindows::TUNED,
            max_concurrent_streams: 256,
            idle_timeout_ms: 30_000,
            keep_alive_interval_ms: 10_000,
            mtu_upper_bound: 1452,
            initial_mtu: 1200,
            loopback_mtu: LOOPBACK_MTU,
            loopback_bbr: false,
            send_fairness: false,
            socket_buffer_bytes: 4 << 20,
            max_connections: 1024,
            server_name: None,
            client_bind_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            limits: FrameLimits::default(),
        }
    }
}

impl QuicConfig {
    pub fn transport_config(&self) -> Result<quinn::TransportConfig, KvTransferError> {
        let varint = |field: &'static str, v: u64| {
            VarInt::from_u64(v).map_err(|_| KvTransferError::Config {
                field,
                reason: format!("{v} exceeds 2^62 - 1"),
            })
        };
        let w = &self.windows;
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(varint(
            "stream_receive_window_bytes",
            w.stream_receive_window_bytes,
        )?)
        .receive_window(varint("receive_window_bytes", w.receive_window_bytes)?)
        .send_window(w.send_window_bytes)
        .max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .keep_alive_interval(Some(Duration::from_millis(self.keep_alive_interval_ms)))
        .max_idle_timeout(Some(
            IdleTimeout::try_from(Duration::from_millis(self.idle_timeout_ms)).map_err(|_| {
                KvTransferError::Config {
                    field: "idle_timeout_ms",
                    reason: format!("{} is too large", self.idle_timeout_ms),
                }
            })?,
        ));
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu_upper_bound.max(self.initial_mtu));
        t.mtu_discovery_config(Some(mtu))
            .initial_mtu(self.initial_mtu.max(1200))
            .send_fairness(self.send_fairness);
        Ok(t)
    }

    /// [`QuicConfig::transport_config`] for a peer on a loopback address: `loopback_mtu`
    /// from the first packet, as the floor and the ceiling.
    fn loopback_transport_config(&self) -> Result<Option<quinn::TransportConfig>, KvTransferError> {
        if self.loopback_mtu == 0 {
            return Ok(None);
        }
        // quinn batches up to 10 datagrams in one GSO send, and the kernel refuses a send over
        // 64 KiB with EMSGSIZE, which quinn-udp drops silently as it would an MTU probe: every
        // such batch would be lost. Datagrams of at most a tenth of that keep GSO. (Larger
        // ones with GSO off stalled the handshake on this kernel: not used.)
        let mtu = self.loopback_mtu.clamp(1200, MAX_GSO_MTU);
        let mut t = self.transport_config()?;
        let mut discovery = MtuDiscoveryConfig::default();
        discovery.upper_bound(mtu);
        t.initial_mtu(mtu)
            .min_mtu(mtu)
            .mtu_discovery_config(Some(discovery));
        if self.loopback_bbr {
            t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
        }
        Ok(Some(t))
    }

    fn endpoint_config(&self) -> Result<quinn::EndpointConfig, KvTransferError> {
        let mut c = quinn::EndpointConfig::default();
        c.max_udp_payload_size(
            self.mtu_upper_bound
                .max(self.initial_mtu)
                .max(self.loopback_mtu)
                .max(1472),
        )
        .map_err(|e| KvTransferError::Config {
            field: "mtu_upper_bound",
            reason: e.to_string(),
        })?;
        Ok(c)
    }
}

/// [`QuicConfig::loopback_mtu`]'s default, measured on loopback in
/// `benchmarks/history/2026-11-29-quic-shm.md`.
pub const LOOPBACK_MTU: u16 = MAX_GSO_MTU;
/// The largest datagram of which quinn's GSO batches (10, `MAX_TRANSMIT_SEGMENTS`) fit one
/// UDP send (65,507 bytes over IPv4).
pub const MAX_GSO_MTU: u16 = 6_500;

/// A quinn endpoint bound as the KV transport binds its own (socket buffers, MTU); public for
/// baselines that time quinn alone on the same sockets (`kv-bench`'s raw QUIC row).
pub fn new_endpoint(
    addr: SocketAddr,
    config: &QuicConfig,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, KvTransferError> {
    let bind = |source| KvTransferError::Bind {
        addr: addr.to_string(),
        source,
    };
    let socket = std::net::UdpSocket::bind(addr).map_err(bind)?;
    if config.socket_buffer_bytes > 0 {
        let sock_err = |source| KvTransferError::Bind {
            addr: format!("{addr} (socket buffers)"),
            source,
        };
        let state = quinn::udp::UdpSocketState::new((&socket).into()).map_err(sock_err)?;
        state
            .set_recv_buffer_size((&socket).into(), config.socket_buffer_bytes)
            .map_err(sock_err)?;
        state
            .set_send_buffer_size((&socket).into(), config.socket_buffer_bytes)
            .map_err(sock_err)?;
        tracing::debug!(
            %addr,
            recv_buffer_bytes = state.recv_buffer_size((&socket).into()).unwrap_or(0),
            send_buffer_bytes = state.send_buffer_size((&socket).into()).unwrap_or(0),
            "kv quic socket buffers"
        );
    }
    quinn::Endpoint::new(
        config.endpoint_config()?,
        server,
        socket,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(bind)
}

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
    connections: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<quinn::Connection>>>>>,
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
        let bind = self.config.client_bind_addr;
        let source = source_for(bind.ip(), peer.ip());
        if source == bind.ip() {
            return Ok(self.endpoint.clone());
        }
        let mut fallback = self
            .fallback
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(endpoint) = fallback.get(&source) {
            return Ok(endpoint.clone());
        }
        tracing::info!(%bind, %peer, %source, "kv quic: the bind address cannot reach this peer; sending from the unspecified address");
        let mut endpoint = new_endpoint(SocketAddr::new(source, 0), &self.config, None)?;
        endpoint.set_default_client_config(self.fallback.client.clone());
        fallback.insert(source, endpoint.clone());
        Ok(endpoint)
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
        // One dial per endpoint at a time; the others wait and reuse its connection.
        let mut cached = slot.lock().await;
        if let Some(conn) = cached.as_ref().filter(|c| c.close_reason().is_none()) {
            return Ok(QuicConnection::new(conn.clone(), endpoint, &self.config));
        }
        let (addr, host) = resolve(endpoint).await?;
        let server_name = self.config.server_name.as_deref().unwrap_or(&host);
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
        *cached = Some(conn.clone());
        Ok(QuicConnection::new(conn, endpoint, &self.config))
    }
}

/// One QUIC connection to a decode node.
#[derive(Clone)]
pub struct QuicConnection {
    conn: quinn::Connection,
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
    fn new(conn: quinn::Connection, endpoint: &str, config: &QuicConfig) -> Self {
        Self {
            conn,
            endpoint: endpoint.into(),
            limits: config.limits,
        }
    }

    /// Identifies the underlying QUIC connection: equal ids mean a cached connection was
    /// reused.
    pub fn connection_id(&self) -> usize {
        self.conn.stable_id()
    }

    /// quinn's counters for this connection (RTT, congestion window, lost packets).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.conn.stats()
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
        let (mut send, mut recv) =
            self.conn
                .open_bi()
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
        let ca = generate_dev_ca().unwrap();
        let server_tls =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Decode, "decode-0").unwrap()).unwrap();
        let client_tls =
            TlsIdentity::dev(&ca, &ca.issue(PeerRole::Prefill, "prefill-0").unwrap()).unwrap();
        let refusals = RefusalLog::default();
        let server = QuicServer::bind(
            ([127, 0, 0, 1], 0).into(),
            &server_tls,
            QuicConfig::default(),
        )
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
        let transport = QuicTransport::new(&client_tls, QuicConfig::default()).unwrap();
        let conn = transport.connect(&endpoint).await.unwrap();
        let payload = Bytes::from(vec![1u8; 2 * layout.block_bytes() as usize]);
        let err = conn.send_layer(header, payload).await.unwrap_err();
        refusals.assert_only_unknown_transfer(&err);
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}
