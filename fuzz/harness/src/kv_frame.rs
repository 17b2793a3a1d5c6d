//! Arbitrary bytes as a KV frame (`kvtransfer::frame`): the whole-buffer decoder and the
//! header decoder the stream reader uses. A frame either decodes into a header that re-encodes
//! to the same bytes, or is refused with a [`KvTransferError`] that formats and maps to a wire
//! verdict.
//!
//! Input: one mode byte, then the frame. With mode bit 0 the harness rewrites both CRC-32Cs to
//! match, so the fuzzer gets past the checksums to the header's fields; without it the bytes
//! go in as they are.

use bytes::Bytes;
use kvtransfer::frame::{header_len, PREFIX_LEN};
use kvtransfer::{decode_frame, FrameHeader, FrameLimits, KvTransferError};

/// Small enough that the fuzzer reaches both limits.
const LIMITS: FrameLimits = FrameLimits {
    max_header_bytes: 4096,
    max_payload_bytes: 1 << 16,
};

/// Where the payload's CRC-32C sits in a header.
const PAYLOAD_CRC_AT: usize = 56;
/// Where the reserved flags byte sits in a header.
const FLAGS_AT: usize = 35;

pub fn kv_frame(data: &[u8]) {
    let Some((&mode, frame)) = data.split_first() else {
        return;
    };
    let mut frame = frame.to_vec();
    if mode & 1 != 0 {
        fix_checksums(&mut frame);
    }

    // The stream reader's way: the prefix gives the length, then exactly the header is decoded.
    match header_len(&frame, &LIMITS) {
        Ok(len) if frame.len() >= len => match FrameHeader::decode(&frame[..len], &LIMITS) {
            Ok(header) => check_round_trip(&header, &frame[..len]),
            Err(error) => check_error(&error),
        },
        Ok(_) => {}
        Err(error) => check_error(&error),
    }

    match decode_frame(Bytes::from(frame.clone()), &LIMITS) {
        Ok((header, payload)) => {
            let len = header.encoded_len();
            assert_eq!(
                payload.len() as u64,
                header.payload_len,
                "the payload handed out is not the length the header gives"
            );
            assert_eq!(
                &frame[len..],
                &payload[..],
                "the payload is not the bytes after the header"
            );
            header
                .verify_payload(&payload)
                .expect("a decoded frame's payload matches its own header");
            check_round_trip(&header, &frame[..len]);
        }
        Err(error) => check_error(&error),
    }
}

/// A decoded header encodes back to the bytes it came from, but for the reserved flags byte,
/// which the decoder ignores and the encoder writes as 0 (and the checksum over it).
fn check_round_trip(header: &FrameHeader, original: &[u8]) {
    let encoded = header
        .encode(&LIMITS)
        .unwrap_or_else(|e| panic!("a header the decoder accepted does not encode: {e}"));
    assert_eq!(
        encoded.len(),
        original.len(),
        "re-encoding changed the length"
    );
    if original[FLAGS_AT] == 0 {
        assert_eq!(&encoded[..], original, "re-encoding changed the header");
    }
    let again = FrameHeader::decode(&encoded, &LIMITS)
        .unwrap_or_else(|e| panic!("a re-encoded header does not decode: {e}"));
    assert_eq!(&again, header, "a header changed through encode and decode");
}

/// Every refusal formats and has a verdict and a name for the error table.
fn check_error(error: &KvTransferError) {
    assert!(!error.to_string().is_empty());
    let _ = error.verdict();
    assert!(!error.error_type().is_empty());
}

/// Makes both CRC-32Cs right for whatever the other bytes say, when the prefix gives a header
/// length that fits the input.
fn fix_checksums(frame: &mut [u8]) {
    let Some(prefix) = frame.get(..PREFIX_LEN) else {
        return;
    };
    let len = u32::from_le_bytes([prefix[6], prefix[7], prefix[8], prefix[9]]) as usize;
    if len < PAYLOAD_CRC_AT + 4 + 4 || len > frame.len() {
        return;
    }
    let payload_crc = crc32c::crc32c(&frame[len..]);
    frame[PAYLOAD_CRC_AT..PAYLOAD_CRC_AT + 4].copy_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32c::crc32c(&frame[..len - 4]);
    frame[len - 4..len].copy_from_slice(&header_crc.to_le_bytes());
}
