//! The decode side refuses KV whose cache dtype is not its own (issue 33's int8 cache): the
//! reservation holds the decode node's layout, dtype included, and a frame with another
//! layout is refused naming both; a payload sized for another dtype is refused by the frame
//! check; an int8 frame's payload carries its scales.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use kvtransfer::{
    Admission, FrameHeader, FrameLimits, KvDtype, KvLayout, KvTransferError, LayerHeader,
    Reservation, TransferId, TransferRegistry,
};

const INT8: KvLayout = KvLayout {
    dtype: KvDtype::Int8,
    num_layers: 2,
    block_size: 16,
    num_kv_heads: 3,
    head_dim: 64,
    windows: kv_types::LayerWindows::NONE,
};

fn header(layout: KvLayout) -> LayerHeader {
    LayerHeader {
        xfer_id: TransferId(9),
        epoch: 1,
        layer: 0,
        layout,
        block_ids: vec![4, 2].into(),
        traceparent: None,
    }
}

fn frame(layout: KvLayout) -> FrameHeader {
    let h = header(layout);
    let payload = Bytes::from(vec![1u8; h.expected_payload_bytes().unwrap() as usize]);
    FrameHeader::for_payload(h, &payload)
}

#[tokio::test]
async fn a_frame_of_another_cache_dtype_is_refused_naming_both() {
    let reg = TransferRegistry::default();
    reg.register(Reservation {
        xfer_id: TransferId(9),
        epoch: 1,
        block_ids: vec![4, 2].into(),
        layout: INT8,
    })
    .await
    .unwrap();
    for other in [KvDtype::Bf16, KvDtype::F32, KvDtype::F16] {
        let err = match reg.admit(&frame(KvLayout {
            dtype: other,
            ..INT8
        })) {
            Err(e) => e,
            Ok(_) => panic!("a {other} frame was admitted into an int8 reservation"),
        };
        assert!(
            matches!(
                err,
                KvTransferError::ReservationMismatch {
                    field: "layout",
                    ..
                }
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("reserved int8") && msg.contains(&format!("given {other}")),
            "{msg}"
        );
    }
    // The same frame in int8 is the reservation's own.
    assert!(matches!(reg.admit(&frame(INT8)), Ok(Admission::Accept(_))));
}

#[test]
fn int8_payloads_carry_their_scales_and_others_are_refused() {
    let h = header(INT8);
    // Two blocks, K and V: 16 rows of 3 heads of 64 bytes, plus an f32 scale per row and head.
    let want = 2 * 2 * (16 * 3 * 64 + 16 * 3 * 4);
    assert_eq!(h.expected_payload_bytes().unwrap(), want);
    let bf16 = header(KvLayout {
        dtype: KvDtype::Bf16,
        ..INT8
    });
    assert_eq!(
        bf16.expected_payload_bytes().unwrap(),
        2 * (want - 2 * 2 * 16 * 3 * 4),
        "elements are half of bf16's"
    );
    // A bf16-sized payload under an int8 header is refused, as is one without the scales.
    for len in [
        bf16.expected_payload_bytes().unwrap(),
        want - 2 * 2 * 16 * 3 * 4,
    ] {
        let payload = Bytes::from(vec![0u8; len as usize]);
        let f = FrameHeader::for_payload(h.clone(), &payload);
        let err = f.encode(&FrameLimits::default()).unwrap_err();
        assert!(
            matches!(err, KvTransferError::LayoutMismatch { .. }),
            "{err}"
        );
    }
}
