//! The shared-memory backend with node identities (issue 34): its Unix socket runs mutual TLS
//! with the cluster CA, so it keeps QUIC's trust rules with no `--insecure`: only a prefill
//! certificate completes the handshake, a reservation takes frames only from the prefill node
//! the gateway chose, and the blocks arrive bit-exact. [`PickingTransport`] takes it for a
//! reservation naming the sender's own host and the network otherwise.

// Helpers outside `#[test]` functions unwrap too; a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use identity::{generate_dev_ca, Ca, PeerRole, TlsIdentity};
use kv_types::{KvBackend, TransferId};
use kvtransfer::{
    peer_fingerprint, BackendTransport, KvConnection, KvLayout, KvRoute, KvServer, KvTransferError,
    KvTransport, LayerHeader, MemorySink, PeerFingerprint, PickingTransport, QuicConfig,
    QuicServer, QuicTransport, Reservation, ShmConfig, ShmServer, ShmTransport, TransferRegistry,
    Verdict,
};
use tokio_util::sync::CancellationToken;

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    ..KvLayout::SMOLLM2_135M_F32
};
const BLOCKS: &[u32] = &[2, 5];

struct Receiver {
    shm_endpoint: String,
    quic_endpoint: String,
    registry: TransferRegistry,
    sink: Arc<MemorySink>,
    shutdown: CancellationToken,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn identity(ca: &Ca, role: PeerRole, name: &str) -> TlsIdentity {
    TlsIdentity::dev(ca, &ca.issue(role, name).unwrap()).unwrap()
}

/// A decode node's receivers as the node runs them: QUIC and, beside it, shm with the same
/// identity, both into one registry.
fn receiver(ca: &Ca) -> Receiver {
    let tls = identity(ca, PeerRole::Decode, "decode-0");
    let registry = TransferRegistry::default();
    let sink = Arc::new(MemorySink::new(LAYOUT.num_layers, 8, LAYOUT));
    let shutdown = CancellationToken::new();
    let shm = ShmServer::bind(ShmConfig::default())
        .unwrap()
        .with_identity(&tls)
        .unwrap();
    let shm_endpoint = shm.endpoint();
    tokio::spawn(shm.serve(registry.clone(), sink.clone(), shutdown.clone()));
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let quic = QuicServer::bind(loopback, &tls, QuicConfig::default()).unwrap();
    let quic_endpoint = quic.local_addr().unwrap().to_string();
    tokio::spawn(quic.serve(registry.clone(), sink.clone(), shutdown.clone()));
    Receiver {
        shm_endpoint,
        quic_endpoint,
        registry,
        sink,
        shutdown,
    }
}

fn shm_sender(ca: &Ca, role: PeerRole, name: &str) -> (ShmTransport, PeerFingerprint) {
    let tls = identity(ca, role, name);
    let fingerprint = peer_fingerprint(tls.cert_der().unwrap());
    let config = ShmConfig {
        connect_timeout_ms: 2_000,
        ..ShmConfig::default()
    };
    (
        ShmTransport::new(config).with_identity(&tls).unwrap(),
        fingerprint,
    )
}

async fn register_for(r: &Receiver, xfer_id: TransferId, chosen: PeerFingerprint) {
    r.registry
        .register_from(
            Reservation {
                xfer_id,
                epoch: 1,
                block_ids: BLOCKS.into(),
                layout: LAYOUT,
            },
            Some(chosen),
        )
        .await
        .unwrap();
}

fn layer(xfer_id: TransferId, layer: u32) -> (LayerHeader, Bytes) {
    let header = LayerHeader {
        xfer_id,
        epoch: 1,
        layer,
        layout: LAYOUT,
        block_ids: BLOCKS.into(),
        traceparent: None,
    };
    let len = header.expected_payload_bytes().unwrap() as usize;
    let payload = (0..len)
        .map(|i| (i as u64 * 31 + u64::from(layer) * 7 + xfer_id.0) as u8)
        .collect::<Vec<u8>>();
    (header, Bytes::from(payload))
}

async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("finished within 20 s")
}

#[tokio::test]
async fn the_chosen_prefill_certificate_pushes_bit_exact_and_no_other_may() {
    within(async {
        let ca = generate_dev_ca().unwrap();
        let r = receiver(&ca);
        let (chosen, chosen_id) = shm_sender(&ca, PeerRole::Prefill, "prefill-0");
        let (other, _) = shm_sender(&ca, PeerRole::Prefill, "prefill-1");
        let xfer = TransferId(7);
        register_for(&r, xfer, chosen_id).await;
        // Another prefill node, CA-signed, completes the handshake but not the write.
        let (header, payload) = layer(xfer, 0);
        let err = other
            .connect(&r.shm_endpoint)
            .await
            .unwrap()
            .send_layer(header, payload)
            .await
            .expect_err("a prefill node the gateway did not choose is refused");
        assert!(
            matches!(
                err,
                KvTransferError::Rejected {
                    verdict: Verdict::WrongPeer,
                    ..
                }
            ),
            "{err}"
        );
        let conn = chosen.connect(&r.shm_endpoint).await.unwrap();
        let mut sent = Vec::new();
        for l in 0..LAYOUT.num_layers {
            let (header, payload) = layer(xfer, l);
            conn.send_layer(header, payload.clone()).await.unwrap();
            sent.push(payload);
        }
        let progress = r
            .registry
            .wait_complete(xfer, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(progress.layers_received, LAYOUT.num_layers);
        for (l, payload) in sent.iter().enumerate() {
            let got = r.sink.read_layer(l as u32, BLOCKS).unwrap();
            assert_eq!(got[..], payload[..], "layer {l}");
        }
    })
    .await;
}

#[tokio::test]
async fn only_a_prefill_certificate_completes_the_handshake() {
    within(async {
        let ca = generate_dev_ca().unwrap();
        let r = receiver(&ca);
        let (decode, _) = shm_sender(&ca, PeerRole::Decode, "decode-1");
        let err = decode.connect(&r.shm_endpoint).await.unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::Tls { .. } | KvTransferError::Io { .. }
            ),
            "{err}"
        );
        // Another CA's prefill certificate, and no certificate at all, fail as well.
        let stranger_ca = generate_dev_ca().unwrap();
        let (stranger, _) = shm_sender(&stranger_ca, PeerRole::Prefill, "prefill-0");
        stranger.connect(&r.shm_endpoint).await.unwrap_err();
        let plain = ShmTransport::new(ShmConfig {
            connect_timeout_ms: 2_000,
            ..ShmConfig::default()
        });
        plain.connect(&r.shm_endpoint).await.unwrap_err();
    })
    .await;
}

#[tokio::test]
async fn a_reservation_naming_this_host_is_pushed_through_shm_and_another_over_quic() {
    within(async {
        let ca = generate_dev_ca().unwrap();
        let r = receiver(&ca);
        let tls = identity(&ca, PeerRole::Prefill, "prefill-0");
        let picker = PickingTransport::from(BackendTransport::Quic(
            QuicTransport::new(&tls, QuicConfig::default()).unwrap(),
        ))
        .with_same_host_shm(
            ShmTransport::default().with_identity(&tls).unwrap(),
            "machine/boot".into(),
        );
        for (xfer, host, want) in [
            (TransferId(1), "machine/boot", KvBackend::Shm),
            (TransferId(2), "other/boot", KvBackend::Quic),
        ] {
            r.registry
                .register(Reservation {
                    xfer_id: xfer,
                    epoch: 1,
                    block_ids: BLOCKS.into(),
                    layout: LAYOUT,
                })
                .await
                .unwrap();
            let route = KvRoute {
                kv_endpoint: &r.quic_endpoint,
                kv_shm_endpoint: &r.shm_endpoint,
                host_id: host,
            };
            let (conn, backend) = picker.connect_route(&route).await.unwrap();
            assert_eq!(backend, want, "{host}");
            for l in 0..LAYOUT.num_layers {
                let (header, payload) = layer(xfer, l);
                conn.send_layer(header, payload).await.unwrap();
            }
            r.registry
                .wait_complete(xfer, Duration::from_secs(5))
                .await
                .unwrap();
        }
    })
    .await;
}
