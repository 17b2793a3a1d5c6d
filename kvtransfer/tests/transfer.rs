//! Component tests: real QUIC, TCP and UCX servers on 127.0.0.1:0 and shared-memory servers
//! on a Unix socket, one process.
//!
//! Each scenario is written once against the transport traits and run on every backend
//! (`on_every_backend!`), the shared-memory one through a Unix socket in /dev/shm, UCX on
//! the transports it picks (libucx0 must be installed).

// Helpers outside `#[test]` functions unwrap too; a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use kv_types::TransferId;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use identity::{generate_dev_ca, Ca, PeerRole, TlsIdentity};
use kvtransfer::{
    send_all_layers, FrameHeader, KvConnection, KvDtype, KvLayout, KvServer, KvTransferError,
    KvTransport, LayerHeader, MemorySink, QuicConfig, QuicServer, QuicTransport, Reservation,
    ShmConfig, ShmServer, ShmTransport, TcpConfig, TcpServer, TcpTransport, TransferRegistry,
    TransferStatus, UcxConfig, UcxServer, UcxTransport, Verdict,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const LAYOUT: KvLayout = KvLayout {
    dtype: KvDtype::Bf16,
    num_layers: 2,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    windows: kv_types::LayerWindows::NONE,
};
const NUM_LAYERS: u32 = 6;
const CACHE_BLOCKS: usize = 32;
const TEST_TIMEOUT: Duration = Duration::from_secs(30);

struct Harness<T: KvTransport> {
    registry: TransferRegistry,
    sink: Arc<MemorySink>,
    transport: T,
    endpoint: String,
    shutdown: CancellationToken,
    server: JoinHandle<Result<(), KvTransferError>>,
}

impl<T: KvTransport> Harness<T> {
    async fn conn(&self) -> T::Connection {
        self.transport.connect(&self.endpoint).await.unwrap()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.server.await.unwrap().unwrap();
    }
}

fn start_server<S: KvServer>(
    server: S,
    endpoint: String,
) -> (
    String,
    TransferRegistry,
    Arc<MemorySink>,
    CancellationToken,
    JoinHandle<Result<(), KvTransferError>>,
) {
    let registry = TransferRegistry::default();
    let sink = Arc::new(MemorySink::new(NUM_LAYERS, CACHE_BLOCKS, LAYOUT));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.serve(registry.clone(), sink.clone(), shutdown.clone()));
    (endpoint, registry, sink, shutdown, task)
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn identities(ca: &Ca) -> (TlsIdentity, TlsIdentity) {
    let server = TlsIdentity::dev(ca, &ca.issue(PeerRole::Decode, "decode-0").unwrap()).unwrap();
    let client = TlsIdentity::dev(ca, &ca.issue(PeerRole::Prefill, "prefill-0").unwrap()).unwrap();
    (server, client)
}

fn quic_harness() -> Harness<QuicTransport> {
    let ca = generate_dev_ca().unwrap();
    let (server_tls, client_tls) = identities(&ca);
    let server = QuicServer::bind(loopback(), &server_tls, QuicConfig::default()).unwrap();
    let endpoint = server.local_addr().unwrap().to_string();
    let (endpoint, registry, sink, shutdown, server) = start_server(server, endpoint);
    Harness {
        registry,
        sink,
        transport: QuicTransport::new(&client_tls, QuicConfig::default()).unwrap(),
        endpoint,
        shutdown,
        server,
    }
}

async fn tcp_harness() -> Harness<TcpTransport> {
    let config = TcpConfig {
        connections_per_endpoint: 4,
        ..TcpConfig::default()
    };
    let server = TcpServer::bind(loopback(), config.clone()).await.unwrap();
    let endpoint = server.local_addr().unwrap().to_string();
    let (endpoint, registry, sink, shutdown, server) = start_server(server, endpoint);
    Harness {
        registry,
        sink,
        transport: TcpTransport::new(config),
        endpoint,
        shutdown,
        server,
    }
}

fn shm_harness() -> Harness<ShmTransport> {
    let config = ShmConfig {
        connections_per_endpoint: 4,
        ..ShmConfig::default()
    };
    let server = ShmServer::bind(config.clone()).unwrap();
    let endpoint = server.endpoint();
    let (endpoint, registry, sink, shutdown, server) = start_server(server, endpoint);
    Harness {
        registry,
        sink,
        transport: ShmTransport::new(config),
        endpoint,
        shutdown,
        server,
    }
}

async fn ucx_harness_with(transports: Option<&str>) -> Harness<UcxTransport> {
    let config = UcxConfig {
        connections_per_endpoint: 4,
        transports: transports.map(str::to_owned),
        ..UcxConfig::default()
    };
    let server = UcxServer::bind(loopback(), config.clone()).await.unwrap();
    let endpoint = server.local_addr().unwrap().to_string();
    let (endpoint, registry, sink, shutdown, server) = start_server(server, endpoint);
    Harness {
        registry,
        sink,
        transport: UcxTransport::new(config),
        endpoint,
        shutdown,
        server,
    }
}

/// UCX with its own choice of transports (shared memory or TCP on one host).
async fn ucx_harness() -> Harness<UcxTransport> {
    ucx_harness_with(None).await
}

fn reservation(xfer_id: TransferId, epoch: u64, block_ids: &[u32]) -> Reservation {
    Reservation {
        xfer_id,
        epoch,
        block_ids: block_ids.into(),
        layout: KvLayout {
            num_layers: NUM_LAYERS,
            ..LAYOUT
        },
    }
}

fn header(xfer_id: TransferId, epoch: u64, layer: u32, block_ids: &[u32]) -> LayerHeader {
    LayerHeader {
        xfer_id,
        epoch,
        layer,
        layout: KvLayout {
            num_layers: NUM_LAYERS,
            ..LAYOUT
        },
        block_ids: block_ids.into(),
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned()),
    }
}

/// Distinct bytes per (seed, layer) so a misplaced block shows.
fn payloads(seed: u64, num_blocks: usize) -> Vec<Bytes> {
    let len = LAYOUT.layer_payload_bytes(num_blocks).unwrap() as usize;
    (0..NUM_LAYERS)
        .map(|layer| {
            let mut x = seed.wrapping_mul(1_000_003) ^ (u64::from(layer) << 32) | 1;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<u8>>()
                .into()
        })
        .collect()
}

fn assert_rejected<T: std::fmt::Debug>(res: Result<T, KvTransferError>, want: Verdict) {
    match res {
        Err(KvTransferError::Rejected { verdict, .. }) if verdict == want => {}
        other => panic!("expected a {want} verdict, got {other:?}"),
    }
}

async fn with_timeout<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

// ---- scenarios, generic over the backend ---------------------------------------------------

async fn all_layers_arrive_bit_exact<T: KvTransport>(h: &Harness<T>) {
    let blocks = [7, 2, 30, 0, 11];
    h.registry
        .register(reservation(TransferId(1), 1, &blocks))
        .await
        .unwrap();
    let data = payloads(1, blocks.len());
    let conn = h.conn().await;
    let stats = send_all_layers(&conn, &header(TransferId(1), 1, 0, &blocks), data.clone())
        .await
        .unwrap();
    assert_eq!(stats.len(), NUM_LAYERS as usize);
    assert!(stats
        .iter()
        .all(|s| s.payload_bytes == data[0].len() as u64));
    let progress = h
        .registry
        .wait_complete(TransferId(1), Duration::from_secs(5))
        .await
        .unwrap();
    for (layer, payload) in data.iter().enumerate() {
        let got = h.sink.read_layer(layer as u32, &blocks).unwrap();
        assert!(got == payload[..], "layer {layer} differs");
        assert_eq!(progress.layer_crc32c[layer], Some(crc32c::crc32c(payload)));
    }
    assert!(matches!(
        h.registry.deregister(TransferId(1)).await,
        Some(TransferStatus::Complete(_))
    ));
}

async fn unregistered_xfer_is_rejected<T: KvTransport>(h: &Harness<T>) {
    let blocks = [1, 2];
    let data = payloads(2, blocks.len());
    let conn = h.conn().await;
    let res = conn
        .send_layer(header(TransferId(999), 1, 0, &blocks), data[0].clone())
        .await;
    assert_rejected(res, Verdict::UnknownTransfer);
    assert_eq!(h.registry.stats().frames_rejected, 1);
    // The connection is still good for a registered transfer.
    h.registry
        .register(reservation(TransferId(2), 1, &blocks))
        .await
        .unwrap();
    conn.send_layer(header(TransferId(2), 1, 0, &blocks), data[0].clone())
        .await
        .unwrap();
}

async fn old_epoch_is_ignored_while_current_proceeds<T: KvTransport>(h: &Harness<T>) {
    let blocks = [4, 5, 6];
    h.registry
        .register(reservation(TransferId(3), 1, &blocks))
        .await
        .unwrap();
    // A retry: the decode node re-registers with epoch 2.
    h.registry
        .register(reservation(TransferId(3), 2, &blocks))
        .await
        .unwrap();
    let data = payloads(3, blocks.len());
    let conn = h.conn().await;
    let res = conn
        .send_layer(header(TransferId(3), 1, 0, &blocks), data[0].clone())
        .await;
    assert_rejected(res, Verdict::StaleEpoch);
    assert_eq!(h.registry.stats().frames_ignored_stale_epoch, 1);
    send_all_layers(&conn, &header(TransferId(3), 2, 0, &blocks), data.clone())
        .await
        .unwrap();
    let progress = h
        .registry
        .wait_complete(TransferId(3), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!((progress.epoch, progress.stale_frames), (2, 1));
    // A late old-epoch frame after completion is still only counted.
    let res = conn
        .send_layer(header(TransferId(3), 1, 1, &blocks), data[1].clone())
        .await;
    assert_rejected(res, Verdict::StaleEpoch);
    assert_eq!(h.registry.stats().frames_ignored_stale_epoch, 2);
    assert!(h.registry.status(TransferId(3)).is_complete());
}

async fn corrupted_payload_is_rejected<T: KvTransport>(h: &Harness<T>) {
    let blocks = [9, 8];
    h.registry
        .register(reservation(TransferId(4), 1, &blocks))
        .await
        .unwrap();
    let data = payloads(4, blocks.len());
    let conn = h.conn().await;
    // Checksum computed over the good payload, then a byte flips on the way.
    let frame = FrameHeader::for_payload(header(TransferId(4), 1, 2, &blocks), &data[2]);
    let mut bad = data[2].to_vec();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x01;
    assert_rejected(
        conn.send_frame(frame.clone(), bad.into()).await,
        Verdict::ChecksumMismatch,
    );
    assert!(h.sink.layer_bytes(TransferId(4), 2).is_none());
    // The layer went back to pending: the good copy goes through.
    conn.send_frame(frame, data[2].clone()).await.unwrap();
    assert_eq!(
        h.sink.layer_bytes(TransferId(4), 2),
        Some(data[2].len() as u64)
    );
}

async fn mismatched_frames_are_refused<T: KvTransport>(h: &Harness<T>) {
    let blocks = [12, 13];
    h.registry
        .register(reservation(TransferId(5), 1, &blocks))
        .await
        .unwrap();
    let data = payloads(5, blocks.len());
    let conn = h.conn().await;
    let res = conn
        .send_layer(header(TransferId(5), 1, 0, &[13, 12]), data[0].clone())
        .await;
    assert_rejected(res, Verdict::BlockIdsMismatch);
    conn.send_layer(header(TransferId(5), 1, 0, &blocks), data[0].clone())
        .await
        .unwrap();
    let res = conn
        .send_layer(header(TransferId(5), 1, 0, &blocks), data[0].clone())
        .await;
    assert_rejected(res, Verdict::DuplicateLayer);
    let res = conn
        .send_layer(header(TransferId(5), 7, 1, &blocks), data[1].clone())
        .await;
    assert_rejected(res, Verdict::EpochAhead);
}

async fn late_frames_after_deregistration_are_dropped<T: KvTransport>(h: &Harness<T>) {
    let blocks = [20, 21, 22];
    h.registry
        .register(reservation(TransferId(6), 1, &blocks))
        .await
        .unwrap();
    let data = payloads(6, blocks.len());
    let conn = h.conn().await;
    conn.send_layer(header(TransferId(6), 1, 0, &blocks), data[0].clone())
        .await
        .unwrap();
    let status = h.registry.deregister(TransferId(6)).await.unwrap();
    assert!(matches!(status, TransferStatus::Receiving(p) if p.layers_received == 1));
    let res = conn
        .send_layer(header(TransferId(6), 1, 1, &blocks), data[1].clone())
        .await;
    assert_rejected(res, Verdict::TransferClosed);
    assert!(h.sink.layer_bytes(TransferId(6), 1).is_none());
    assert_eq!(h.registry.stats().frames_ignored_closed, 1);
    assert_eq!(
        h.registry.status(TransferId(6)),
        TransferStatus::Closed { epoch: 1 }
    );
}

async fn concurrent_transfers_share_the_endpoint<T: KvTransport>(
    h: &Harness<T>,
) -> Vec<T::Connection> {
    const TRANSFERS: u64 = 8;
    let mut tasks = tokio::task::JoinSet::new();
    let mut conns = Vec::new();
    for i in 0..TRANSFERS {
        let xfer_id = 100 + i;
        // Disjoint blocks per transfer, so each can be checked in the shared sink.
        let blocks: Vec<u32> = (0..3).map(|b| (i * 3 + b) as u32).collect();
        h.registry
            .register(reservation(TransferId(xfer_id), 1, &blocks))
            .await
            .unwrap();
        let conn = h.conn().await;
        conns.push(conn.clone());
        let data = payloads(xfer_id, blocks.len());
        let template = header(TransferId(xfer_id), 1, 0, &blocks);
        tasks.spawn(async move {
            send_all_layers(&conn, &template, data.clone())
                .await
                .unwrap();
            (blocks, data)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        let (blocks, data) = joined.unwrap();
        for (layer, payload) in data.iter().enumerate() {
            assert!(h.sink.read_layer(layer as u32, &blocks).unwrap() == payload[..]);
        }
    }
    for i in 0..TRANSFERS {
        assert!(h.registry.status(TransferId(100 + i)).is_complete());
    }
    conns
}

// ---- every scenario on every backend ------------------------------------------------------

/// Runs `$scenario` on QUIC, TCP, shared memory and UCX, as
/// `$scenario::{quic, tcp, shm, ucx}`.
macro_rules! on_every_backend {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn quic() {
                with_timeout(async {
                    let h = quic_harness();
                    super::$scenario(&h).await;
                    h.stop().await;
                })
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp() {
                with_timeout(async {
                    let h = tcp_harness().await;
                    super::$scenario(&h).await;
                    h.stop().await;
                })
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shm() {
                with_timeout(async {
                    let h = shm_harness();
                    super::$scenario(&h).await;
                    h.stop().await;
                })
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx() {
                with_timeout(async {
                    let h = ucx_harness().await;
                    super::$scenario(&h).await;
                    h.stop().await;
                })
                .await;
            }
        }
    )*};
}

on_every_backend!(
    all_layers_arrive_bit_exact,
    unregistered_xfer_is_rejected,
    old_epoch_is_ignored_while_current_proceeds,
    corrupted_payload_is_rejected,
    mismatched_frames_are_refused,
    late_frames_after_deregistration_are_dropped,
    concurrent_transfers_share_the_endpoint,
);

// ---- UCX ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_over_tcp_and_over_shared_memory_each_carry_every_scenario() {
    // The same puts on UCX's TCP transport (what runs across hosts without RDMA) and on its
    // shared-memory ones, chosen by name as an operator's UCX_TLS would.
    for transports in ["tcp", "sm,self"] {
        with_timeout(async {
            let h = ucx_harness_with(Some(transports)).await;
            all_layers_arrive_bit_exact(&h).await;
            corrupted_payload_is_rejected(&h).await;
            old_epoch_is_ignored_while_current_proceeds(&h).await;
            concurrent_transfers_share_the_endpoint(&h).await;
            h.stop().await;
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_refuses_a_peer_of_another_user_before_naming_any_region() {
    use std::os::unix::process::CommandExt;
    // The check needs a second user: as root, run the peer as `nobody`.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a peer as another user");
        return;
    }
    with_timeout(async {
        let h = ucx_harness().await;
        let endpoint = h.endpoint.clone();
        let out = tokio::task::spawn_blocking(move || {
            let (host, port) = endpoint.rsplit_once(':').unwrap();
            std::process::Command::new("python3")
                .arg("-c")
                .arg("import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2]))); print(len(s.recv(64)))")
                .args([host, port])
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // The connection closed with nothing said: no worker address, no key.
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
        // A peer of the node's own user still transfers.
        all_layers_arrive_bit_exact(&h).await;
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_names_its_region_to_its_own_user_and_a_payload_too_large_for_it_is_refused() {
    with_timeout(async {
        // Regions as large as the largest frame: a larger payload cannot be put.
        let limits = kvtransfer::FrameLimits {
            max_payload_bytes: 1 << 10,
            ..kvtransfer::FrameLimits::default()
        };
        let config = UcxConfig {
            limits,
            ..UcxConfig::default()
        };
        let server = UcxServer::bind(loopback(), config.clone()).await.unwrap();
        let endpoint = server.local_addr().unwrap().to_string();
        let (endpoint, registry, _sink, shutdown, server) = start_server(server, endpoint);
        // The hello: magic, worker address, region address and size, remote key.
        let mut raw = tokio::net::TcpStream::connect(&endpoint).await.unwrap();
        let mut magic = [0u8; 4];
        raw.read_exact(&mut magic).await.unwrap();
        assert_eq!(&magic, b"FKUX");
        let mut len = [0u8; 4];
        raw.read_exact(&mut len).await.unwrap();
        let mut address = vec![0u8; u32::from_le_bytes(len) as usize];
        raw.read_exact(&mut address).await.unwrap();
        let mut region = [0u8; 16];
        raw.read_exact(&mut region).await.unwrap();
        assert_eq!(u64::from_le_bytes(region[8..].try_into().unwrap()), 1 << 10);
        drop(raw);
        let blocks = [1u32, 2, 3, 4, 5];
        registry
            .register(reservation(TransferId(40), 1, &blocks))
            .await
            .unwrap();
        // A sender whose own limit would take it.
        let conn = UcxTransport::default().connect(&endpoint).await.unwrap();
        // Five blocks of this layout are 1,280 bytes.
        let big = payloads(40, blocks.len()).swap_remove(0);
        assert!(big.len() > 1 << 10);
        let err = conn
            .send_layer(header(TransferId(40), 1, 0, &blocks), big)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        assert_eq!(registry.stats().frames_accepted, 0);
        shutdown.cancel();
        server.await.unwrap().unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_shutdown_ends_the_server_promptly() {
    with_timeout(async {
        let h = ucx_harness().await;
        let _conn = h.conn().await;
        // A sender stalled halfway through a header.
        let mut stalled = tokio::net::TcpStream::connect(&h.endpoint).await.unwrap();
        let mut magic = [0u8; 4];
        stalled.read_exact(&mut magic).await.unwrap();
        let start = Instant::now();
        h.shutdown.cancel();
        h.server.await.unwrap().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    })
    .await;
}

// ---- QUIC ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_concurrent_transfers_reuse_one_connection() {
    with_timeout(async {
        let h = quic_harness();
        let conns = concurrent_transfers_share_the_endpoint(&h).await;
        let first = conns[0].connection_id();
        assert!(conns.iter().all(|c| c.connection_id() == first));
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_client_from_another_ca_fails_the_handshake() {
    with_timeout(async {
        let h = quic_harness();
        let other_ca = generate_dev_ca().unwrap();
        let (_, stranger) = identities(&other_ca);
        let transport = QuicTransport::new(&stranger, QuicConfig::default()).unwrap();
        let err = transport.connect(&h.endpoint).await;
        // With TLS 1.3 the client may finish its side before the server refuses its
        // certificate; then the first stream fails instead.
        let failed = match err {
            Err(KvTransferError::Connection { .. }) => true,
            Err(other) => panic!("unexpected error {other}"),
            Ok(conn) => {
                h.registry
                    .register(reservation(TransferId(7), 1, &[1]))
                    .await
                    .unwrap();
                let data = payloads(7, 1);
                conn.send_layer(header(TransferId(7), 1, 0, &[1]), data[0].clone())
                    .await
                    .is_err()
            }
        };
        assert!(failed, "a client certificate from another CA was accepted");
        assert_eq!(h.registry.stats().frames_accepted, 0);
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_server_from_another_ca_fails_the_handshake() {
    with_timeout(async {
        let h = quic_harness();
        // The client trusts only its own CA, and the server's certificate is from another.
        let client_ca = generate_dev_ca().unwrap();
        let (_, client) = identities(&client_ca);
        let transport = QuicTransport::new(&client, QuicConfig::default()).unwrap();
        let err = transport.connect(&h.endpoint).await.unwrap_err();
        assert!(matches!(err, KvTransferError::Connection { .. }), "{err}");
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_shutdown_ends_the_server_promptly() {
    with_timeout(async {
        let h = quic_harness();
        let conn = h.conn().await;
        h.registry
            .register(reservation(TransferId(8), 1, &[3]))
            .await
            .unwrap();
        conn.send_layer(header(TransferId(8), 1, 0, &[3]), payloads(8, 1)[0].clone())
            .await
            .unwrap();
        // The connection stays open and idle while the server shuts down.
        let start = Instant::now();
        h.shutdown.cancel();
        h.server.await.unwrap().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let res = conn
            .send_layer(header(TransferId(8), 1, 1, &[3]), payloads(8, 1)[1].clone())
            .await;
        assert!(res.is_err(), "a stopped server answered");
    })
    .await;
}

// ---- TCP ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_garbage_closes_only_that_connection() {
    with_timeout(async {
        let h = tcp_harness().await;
        let mut raw = tokio::net::TcpStream::connect(&h.endpoint).await.unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        raw.read_to_end(&mut answer).await.unwrap();
        assert_eq!(
            Verdict::decode(answer[..].try_into().unwrap()),
            Some(Verdict::Malformed)
        );
        // Other connections are unaffected.
        unregistered_xfer_is_rejected(&h).await;
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_shutdown_ends_the_server_promptly() {
    with_timeout(async {
        let h = tcp_harness().await;
        let _conn = h.conn().await;
        // A sender stalled halfway through a header.
        let mut stalled = tokio::net::TcpStream::connect(&h.endpoint).await.unwrap();
        stalled.write_all(b"FSKV").await.unwrap();
        let start = Instant::now();
        h.shutdown.cancel();
        h.server.await.unwrap().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        // The stalled connection was closed by the server.
        let mut buf = [0u8; 1];
        assert_eq!(stalled.read(&mut buf).await.unwrap_or(0), 0);
    })
    .await;
}

// ---- shared memory ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_refuses_a_network_endpoint() {
    // A peer on another host has no socket here: the shm transport takes only `unix:` paths.
    let err = ShmTransport::default()
        .connect("10.0.0.9:7200")
        .await
        .unwrap_err();
    assert!(
        matches!(err, KvTransferError::InvalidEndpoint { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_refuses_a_peer_of_another_user_before_any_region() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // The check needs a second user: as root, run the peer as `nobody`.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a peer as another user");
        return;
    }
    with_timeout(async {
        let h = shm_harness();
        let socket = h.endpoint.strip_prefix("unix:").unwrap().to_owned();
        // Let anyone connect, so the server's own check is what refuses.
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
        let regions_before = count_regions();
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new("python3")
                .arg("-c")
                .arg("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print(len(s.recv(64)))")
                .arg(&socket)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // The connection closed with nothing said: no region was named to the peer.
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
        assert_eq!(count_regions(), regions_before);
        // A peer of the node's own user still transfers.
        all_layers_arrive_bit_exact(&h).await;
        h.stop().await;
    })
    .await;
}

/// Region files of this process still linked in /dev/shm: each is unlinked once mapped.
fn count_regions() -> usize {
    let prefix = format!("fission-kv-region-{}-", std::process::id());
    std::fs::read_dir(ShmConfig::default().dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_shutdown_ends_the_server_promptly_and_removes_its_socket() {
    with_timeout(async {
        let h = shm_harness();
        let _conn = h.conn().await;
        let socket = h.endpoint.strip_prefix("unix:").unwrap().to_owned();
        // A sender stalled halfway through a header.
        let mut stalled = tokio::net::UnixStream::connect(&socket).await.unwrap();
        // The hello: magic, region size, the region's name (length-prefixed).
        let mut hello = [0u8; 14];
        stalled.read_exact(&mut hello).await.unwrap();
        let mut name = vec![0u8; usize::from(u16::from_le_bytes([hello[12], hello[13]]))];
        stalled.read_exact(&mut name).await.unwrap();
        stalled.write_all(b"\x01FSKV").await.unwrap();
        let start = Instant::now();
        h.shutdown.cancel();
        h.server.await.unwrap().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let mut buf = [0u8; 1];
        assert_eq!(stalled.read(&mut buf).await.unwrap_or(0), 0);
        assert!(!std::path::Path::new(&socket).exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_client_without_a_certificate_is_refused_in_the_handshake() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    with_timeout(async {
        let ca = generate_dev_ca().unwrap();
        let (server_tls, _) = identities(&ca);
        let server = QuicServer::bind(loopback(), &server_tls, QuicConfig::default()).unwrap();
        let endpoint = server.local_addr().unwrap().to_string();
        let (endpoint, registry, _sink, shutdown, server) = start_server(server, endpoint);
        // A client that trusts the cluster CA and speaks the protocol, but has no certificate.
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.cert_pem().as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut crypto = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        crypto.alpn_protocols = vec![kvtransfer::ALPN.to_vec()];
        let mut client = quinn::Endpoint::client(loopback()).unwrap();
        client.set_default_client_config(quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(crypto).unwrap(),
        )));
        let addr: std::net::SocketAddr = endpoint.parse().unwrap();
        // With TLS 1.3 the client may finish its side first; the server's refusal then closes
        // the connection.
        let refused = match client.connect(addr, "localhost").unwrap().await {
            Err(e) => e.to_string(),
            Ok(conn) => conn.closed().await.to_string(),
        };
        assert!(refused.contains("no certificates"), "{refused}");
        assert_eq!(registry.stats().frames_accepted, 0);
        shutdown.cancel();
        server.await.unwrap().unwrap();
    })
    .await;
}
