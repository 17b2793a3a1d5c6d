//! QUIC settings: flow-control windows, datagram sizes, connections per peer, and the UDP
//! endpoint they bind.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, VarInt};

use crate::error::KvTransferError;
use crate::frame::FrameLimits;

use super::socket::GsoCapped;

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
    /// packets move more bytes per CPU second. At most [`MAX_LOOPBACK_MTU`]; 0 uses
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
    /// Client: QUIC connections to each decode node, a transfer's layers spread over them
    /// (layer `i` on connection `i % n`). One connection's packets are sealed, sent, received
    /// and opened by one driver task on each side, so one connection keeps one core busy;
    /// two let a 2-core host encrypt and decrypt on both cores
    /// (`benchmarks/history/2026-11-29-quic-speed.md`). Each is its own mutual-TLS handshake.
    pub connections_per_endpoint: usize,
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
            connections_per_endpoint: 1,
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
    pub(super) fn loopback_transport_config(
        &self,
    ) -> Result<Option<quinn::TransportConfig>, KvTransferError> {
        if self.loopback_mtu == 0 {
            return Ok(None);
        }
        // The endpoint's socket caps quinn's GSO batches at 64 KiB (`GsoCapped`), so any
        // datagram size up to that keeps GSO.
        let mtu = self.loopback_mtu.clamp(1200, MAX_LOOPBACK_MTU);
        let mut t = self.transport_config()?;
        let mut discovery = MtuDiscoveryConfig::default();
        discovery.upper_bound(mtu);
        t.initial_mtu(mtu)
            .min_mtu(mtu)
            .mtu_discovery_config(Some(discovery));
        // quinn's initial congestion window is 12,000 bytes at most, and a datagram that does
        // not fit below it is never sent: from 12,000 bytes up the handshake stalled. Ten
        // datagrams, as for small ones.
        let initial_window = u64::from(mtu) * 10;
        if self.loopback_bbr {
            let mut bbr = quinn::congestion::BbrConfig::default();
            bbr.initial_window(initial_window);
            t.congestion_controller_factory(Arc::new(bbr));
        } else {
            let mut cubic = quinn::congestion::CubicConfig::default();
            cubic.initial_window(initial_window);
            t.congestion_controller_factory(Arc::new(cubic));
        }
        Ok(Some(t))
    }

    /// The largest datagram sent to a peer not on loopback.
    fn path_datagram(&self) -> u16 {
        self.mtu_upper_bound.max(self.initial_mtu).max(1472)
    }

    /// The largest datagram an endpoint sends or takes.
    fn max_datagram(&self) -> u16 {
        self.mtu_upper_bound
            .max(self.initial_mtu)
            .max(self.loopback_mtu.min(MAX_LOOPBACK_MTU))
            .max(1472)
    }

    fn endpoint_config(&self) -> Result<quinn::EndpointConfig, KvTransferError> {
        let mut c = quinn::EndpointConfig::default();
        c.max_udp_payload_size(self.max_datagram())
            .map_err(|e| KvTransferError::Config {
                field: "mtu_upper_bound",
                reason: e.to_string(),
            })?;
        Ok(c)
    }
}

/// [`QuicConfig::loopback_mtu`]'s default, measured on loopback in
/// `benchmarks/history/2026-11-29-quic-speed.md` (16,000 bytes: 0.69-0.75 CPU ms per MB,
/// against 0.84-0.91 at 6,500 in the same runs).
pub const LOOPBACK_MTU: u16 = MAX_LOOPBACK_MTU;
/// The largest datagram of which quinn's full GSO batches (10, `MAX_TRANSMIT_SEGMENTS`) fit
/// one UDP send (65,507 bytes over IPv4); larger ones go in smaller batches.
pub const MAX_GSO_MTU: u16 = 6_500;
/// The largest [`QuicConfig::loopback_mtu`]. The handshake's packets are padded to it, and
/// quinn encodes a long-header packet's length in 14 bits (a 16,384-byte one panics in
/// `PacketBuilder::finish`).
pub const MAX_LOOPBACK_MTU: u16 = 16_000;

/// A quinn endpoint bound as the KV transport binds its own (socket buffers, MTU); public for
/// baselines that time quinn alone on the same sockets (`kv-bench`'s raw QUIC row).
pub fn new_endpoint(
    addr: SocketAddr,
    config: &QuicConfig,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, KvTransferError> {
    bind_endpoint(addr, config, server, config.path_datagram())
}

/// A client endpoint for peers on a loopback address, its GSO batches sized for
/// [`QuicConfig::loopback_mtu`].
pub(super) fn new_loopback_endpoint(
    addr: SocketAddr,
    config: &QuicConfig,
) -> Result<quinn::Endpoint, KvTransferError> {
    bind_endpoint(addr, config, None, config.max_datagram())
}

/// `gso_datagram`: the largest datagram this endpoint's connections send, which sizes its GSO
/// batches ([`GsoCapped`]).
fn bind_endpoint(
    addr: SocketAddr,
    config: &QuicConfig,
    server: Option<quinn::ServerConfig>,
    gso_datagram: u16,
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
        // Past `net.core.rmem_max` where the process may (CAP_NET_ADMIN), else up to it.
        if !force_buffer(&socket, BufferSide::Recv, config.socket_buffer_bytes) {
            state
                .set_recv_buffer_size((&socket).into(), config.socket_buffer_bytes)
                .map_err(sock_err)?;
        }
        if !force_buffer(&socket, BufferSide::Send, config.socket_buffer_bytes) {
            state
                .set_send_buffer_size((&socket).into(), config.socket_buffer_bytes)
                .map_err(sock_err)?;
        }
        tracing::debug!(
            %addr,
            recv_buffer_bytes = state.recv_buffer_size((&socket).into()).unwrap_or(0),
            send_buffer_bytes = state.send_buffer_size((&socket).into()).unwrap_or(0),
            "kv quic socket buffers"
        );
    }
    let endpoint_config = config.endpoint_config()?;
    let socket = GsoCapped::wrap(socket, gso_datagram).map_err(bind)?;
    quinn::Endpoint::new_with_abstract_socket(
        endpoint_config,
        server,
        socket,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(bind)
}

#[derive(Clone, Copy)]
enum BufferSide {
    Recv,
    Send,
}

/// `SO_RCVBUFFORCE`/`SO_SNDBUFFORCE`: a socket buffer of `bytes` whatever `rmem_max` and
/// `wmem_max` say, where the process holds CAP_NET_ADMIN. False where it may not (or off
/// Linux): the caller then asks for the capped size.
#[cfg(target_os = "linux")]
fn force_buffer(socket: &std::net::UdpSocket, side: BufferSide, bytes: usize) -> bool {
    use std::os::fd::AsRawFd;
    let opt = match side {
        BufferSide::Recv => libc::SO_RCVBUFFORCE,
        BufferSide::Send => libc::SO_SNDBUFFORCE,
    };
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt reads one c_int from a live local through a pointer of its size.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn force_buffer(_: &std::net::UdpSocket, _: BufferSide, _: usize) -> bool {
    false
}
