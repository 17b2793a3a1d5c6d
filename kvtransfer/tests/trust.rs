//! Who may write into a decode node's reservations over QUIC (issue 31, item 9), with real
//! certificates from one cluster CA: only a prefill certificate completes the handshake on the
//! KV port, and a reservation takes frames from the one prefill node the gateway chose for its
//! epoch (or, with no choice given, the one that filled it first), refusing every other,
//! CA-signed and of the prefill role as they may be.

// Helpers outside `#[test]` functions unwrap too; a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use identity::{generate_dev_ca, Ca, PeerRole, TlsIdentity};
use kv_types::TransferId;
use kvtransfer::{
    peer_fingerprint, KvConnection, KvDtype, KvLayout, KvServer, KvTransferError, KvTransport,
    LayerHeader, MemorySink, PeerFingerprint, QuicConfig, QuicServer, QuicTransport, Reservation,
    TransferRegistry, Verdict,
};
use tokio_util::sync::CancellationToken;

const LAYOUT: KvLayout = KvLayout {
    dtype: KvDtype::Bf16,
    num_layers: 3,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    windows: kv_types::LayerWindows::NONE,
};
const BLOCKS: &[u32] = &[2, 5];

struct Receiver {
    endpoint: String,
    registry: TransferRegistry,
    shutdown: CancellationToken,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn receiver(ca: &Ca) -> Receiver {
    let tls = TlsIdentity::dev(ca, &ca.issue(PeerRole::Decode, "decode-0").unwrap()).unwrap();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = QuicServer::bind(loopback, &tls, QuicConfig::default()).unwrap();
    let endpoint = server.local_addr().unwrap().to_string();
    let registry = TransferRegistry::default();
    let sink = Arc::new(MemorySink::new(LAYOUT.num_layers, 8, LAYOUT));
    let shutdown = CancellationToken::new();
    tokio::spawn(server.serve(registry.clone(), sink, shutdown.clone()));
    Receiver {
        endpoint,
        registry,
        shutdown,
    }
}

fn sender(ca: &Ca, role: PeerRole, name: &str) -> QuicTransport {
    identified_sender(ca, role, name).0
}

/// A sender and its `kv_identity`, the fingerprint the gateway names it by.
fn identified_sender(ca: &Ca, role: PeerRole, name: &str) -> (QuicTransport, PeerFingerprint) {
    let tls = TlsIdentity::dev(ca, &ca.issue(role, name).unwrap()).unwrap();
    let fingerprint = peer_fingerprint(tls.cert_der().unwrap());
    (
        QuicTransport::new(&tls, QuicConfig::default()).unwrap(),
        fingerprint,
    )
}

/// Registers `xfer_id` at `epoch` for the prefill node `chosen` only.
async fn register_for(r: &Receiver, xfer_id: TransferId, epoch: u64, chosen: PeerFingerprint) {
    r.registry
        .register_from(
            Reservation {
                xfer_id,
                epoch,
                block_ids: BLOCKS.into(),
                layout: LAYOUT,
            },
            Some(chosen),
        )
        .await
        .unwrap();
}

fn assert_wrong_peer(result: Result<(), KvTransferError>) {
    let err = result.expect_err("a prefill node the gateway did not choose is refused");
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
}

async fn register(r: &Receiver, xfer_id: TransferId, epoch: u64) {
    r.registry
        .register(Reservation {
            xfer_id,
            epoch,
            block_ids: BLOCKS.into(),
            layout: LAYOUT,
        })
        .await
        .unwrap();
}

/// Connects as `transport` and sends layer `layer` of `xfer_id` at `epoch`.
async fn send(
    transport: &QuicTransport,
    r: &Receiver,
    xfer_id: TransferId,
    epoch: u64,
    layer: u32,
) -> Result<(), KvTransferError> {
    let header = LayerHeader {
        xfer_id,
        epoch,
        layer,
        layout: LAYOUT,
        block_ids: BLOCKS.into(),
        traceparent: None,
    };
    let len = header.expected_payload_bytes().unwrap() as usize;
    let payload = Bytes::from(vec![layer as u8; len]);
    let conn = transport.connect(&r.endpoint).await?;
    conn.send_layer(header, payload).await.map(drop)
}

#[tokio::test]
async fn only_a_prefill_certificate_may_push_kv() {
    let ca = generate_dev_ca().unwrap();
    let r = receiver(&ca);
    let xfer = TransferId(0x5eed_0001);
    register(&r, xfer, 1).await;
    for (layer, role) in [PeerRole::Gateway, PeerRole::Decode, PeerRole::Admin]
        .into_iter()
        .enumerate()
    {
        let transport = sender(&ca, role, role.as_str());
        let err = send(&transport, &r, xfer, 1, layer as u32)
            .await
            .expect_err("a certificate of another role is refused");
        // Refused at the handshake: no frame of it was read, so none was refused by the
        // registry either.
        assert!(
            matches!(
                err,
                KvTransferError::Connection { .. } | KvTransferError::Stream { .. }
            ),
            "{role}: {err}"
        );
        let stats = r.registry.stats();
        assert_eq!(
            (stats.frames_accepted, stats.frames_rejected),
            (0, 0),
            "{role}"
        );
    }
    let prefill = sender(&ca, PeerRole::Prefill, "prefill-0");
    for layer in 0..LAYOUT.num_layers {
        send(&prefill, &r, xfer, 1, layer).await.unwrap();
    }
    assert!(r.registry.status(xfer).is_complete());
}

#[tokio::test]
async fn a_reservation_takes_frames_from_one_prefill_node() {
    let ca = generate_dev_ca().unwrap();
    let r = receiver(&ca);
    let (chosen, other) = (
        sender(&ca, PeerRole::Prefill, "prefill-0"),
        sender(&ca, PeerRole::Prefill, "prefill-1"),
    );
    let xfer = TransferId(0x5eed_0002);
    register(&r, xfer, 1).await;
    send(&chosen, &r, xfer, 1, 0).await.unwrap();
    // Another prefill node, with the id and the epoch right, writes nothing.
    let err = send(&other, &r, xfer, 1, 1).await.unwrap_err();
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
    send(&chosen, &r, xfer, 1, 1).await.unwrap();
    send(&chosen, &r, xfer, 1, 2).await.unwrap();
    assert!(r.registry.status(xfer).is_complete());

    // A retry at a newer epoch (the gateway sent another prefill node) binds afresh: the new
    // node fills it, and the first one is now the stranger.
    let retry = TransferId(0x5eed_0003);
    register(&r, retry, 1).await;
    send(&chosen, &r, retry, 1, 0).await.unwrap();
    register(&r, retry, 2).await;
    send(&other, &r, retry, 2, 0).await.unwrap();
    let err = send(&chosen, &r, retry, 2, 1).await.unwrap_err();
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
}

#[tokio::test]
async fn a_reservation_takes_frames_only_from_the_prefill_node_the_gateway_chose() {
    let ca = generate_dev_ca().unwrap();
    let r = receiver(&ca);
    let (chosen, chosen_id) = identified_sender(&ca, PeerRole::Prefill, "prefill-0");
    let (other, other_id) = identified_sender(&ca, PeerRole::Prefill, "prefill-1");
    let xfer = TransferId(0x5eed_0004);
    register_for(&r, xfer, 1, chosen_id).await;
    // Another prefill node that knows the id and the epoch and races the chosen one to the
    // first frame writes nothing, and binds nothing.
    assert_wrong_peer(send(&other, &r, xfer, 1, 0).await);
    assert_wrong_peer(send(&other, &r, xfer, 1, 1).await);
    for layer in 0..LAYOUT.num_layers {
        send(&chosen, &r, xfer, 1, layer).await.unwrap();
    }
    assert!(r.registry.status(xfer).is_complete());
    assert_eq!(r.registry.stats().frames_rejected, 2);

    // The gateway re-prefills on the other node at a new epoch: it fills the reservation, and
    // the node of the old epoch is refused at the new one.
    let retry = TransferId(0x5eed_0005);
    register_for(&r, retry, 1, chosen_id).await;
    send(&chosen, &r, retry, 1, 0).await.unwrap();
    register_for(&r, retry, 2, other_id).await;
    assert_wrong_peer(send(&chosen, &r, retry, 2, 0).await);
    for layer in 0..LAYOUT.num_layers {
        send(&other, &r, retry, 2, layer).await.unwrap();
    }
    assert!(r.registry.status(retry).is_complete());
}

#[tokio::test]
async fn a_binding_sent_after_the_reservation_refuses_every_other_prefill_node() {
    let ca = generate_dev_ca().unwrap();
    let r = receiver(&ca);
    let (chosen, chosen_id) = identified_sender(&ca, PeerRole::Prefill, "prefill-0");
    let (other, other_id) = identified_sender(&ca, PeerRole::Prefill, "prefill-1");
    let xfer = TransferId(0x5eed_0006);
    register(&r, xfer, 1).await;
    r.registry.bind(xfer, 1, chosen_id).unwrap();
    assert_wrong_peer(send(&other, &r, xfer, 1, 0).await);
    send(&chosen, &r, xfer, 1, 0).await.unwrap();
    // Once the chosen node's frames are in, the reservation cannot be handed to another
    // peer at that epoch, nor bound at another epoch.
    assert!(matches!(
        r.registry.bind(xfer, 1, other_id),
        Err(KvTransferError::WrongPeer { .. })
    ));
    assert!(r.registry.bind(xfer, 2, chosen_id).is_err());
    assert_wrong_peer(send(&other, &r, xfer, 1, 1).await);
    for layer in 1..LAYOUT.num_layers {
        send(&chosen, &r, xfer, 1, layer).await.unwrap();
    }
    assert!(r.registry.status(xfer).is_complete());
}
