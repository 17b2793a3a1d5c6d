//! The wire format: one frame per layer, then a 4-byte verdict from the receiver.
//!
//! All integers are little-endian.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "FSKV"
//!      4     2  version (1)
//!      6     4  header_len: bytes from offset 0 through header_crc32c
//!     10     8  xfer_id
//!     18     8  epoch
//!     26     4  layer
//!     30     4  num_layers
//!     34     1  dtype (0 f32, 1 bf16, 2 f16)
//!     35     1  flags (0; reserved)
//!     36     4  block_size
//!     40     4  num_kv_heads
//!     44     4  head_dim
//!     48     8  payload_len (must be 2 * num_blocks * block_bytes)
//!     56     4  payload_crc32c (CRC-32C of the payload)
//!     60     4  num_blocks
//!     64  4*n   block_ids
//!      …     2  traceparent_len (0: none)
//!      …     t  traceparent (printable ASCII)
//!      …     4  header_crc32c (CRC-32C of every header byte before it)
//!      …     …  payload (payload_len bytes)
//! ```
//!
//! The receiver answers each frame with a 4-byte [`Verdict`](crate::Verdict). Decoding never
//! panics: every malformed input is a typed [`KvTransferError`]. Reading frames off a byte
//! stream is in `stream_io`.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::KvTransferError;
use kv_types::{KvDtype, KvLayout, TransferId};

use crate::header::LayerHeader;

pub const MAGIC: [u8; 4] = *b"FSKV";
pub use crate::version::VERSION;
/// Magic, version and header length: enough to know how much header follows.
pub const PREFIX_LEN: usize = 10;
/// Header bytes before the block ids.
const FIXED_LEN: usize = 64;
/// The smallest valid header: one block id, no traceparent.
pub const MIN_HEADER_LEN: usize = FIXED_LEN + 4 + 2 + 4;
pub const MAX_TRACEPARENT_LEN: usize = 256;
pub use kv_types::MAX_NUM_LAYERS;

/// Caps that keep a hostile or broken peer from making the receiver allocate without bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// 1 MiB holds about 262,000 block ids.
    pub max_header_bytes: u32,
    pub max_payload_bytes: u64,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 1 << 20,
            max_payload_bytes: 2 << 30,
        }
    }
}

/// A decoded header: the sender's [`LayerHeader`] plus the payload's length and checksum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub header: LayerHeader,
    pub payload_len: u64,
    pub payload_crc32c: u32,
}

impl FrameHeader {
    /// Computes the payload's length and CRC-32C (hardware accelerated where the CPU has it).
    pub fn for_payload(header: LayerHeader, payload: &[u8]) -> Self {
        Self {
            header,
            payload_len: payload.len() as u64,
            payload_crc32c: crate::crc::crc32c_append(0, payload),
        }
    }

    pub fn encoded_len(&self) -> usize {
        let trace = self.header.traceparent.as_ref().map_or(0, String::len);
        FIXED_LEN + 4 * self.header.block_ids.len() + 2 + trace + 4
    }

    /// Serializes the header after running the same checks a receiver runs, so a bad header
    /// fails on the sender.
    pub fn encode(&self, limits: &FrameLimits) -> Result<Bytes, KvTransferError> {
        self.validate(limits)?;
        let h = &self.header;
        let len = self.encoded_len();
        let max = u64::from(limits.max_header_bytes);
        if len as u64 > max {
            return Err(KvTransferError::HeaderLength {
                header_bytes: len as u64,
                min: MIN_HEADER_LEN as u64,
                max,
            });
        }
        let mut buf = BytesMut::with_capacity(len);
        buf.put_slice(&MAGIC);
        buf.put_u16_le(VERSION);
        buf.put_u32_le(len as u32);
        buf.put_u64_le(h.xfer_id.0);
        buf.put_u64_le(h.epoch);
        buf.put_u32_le(h.layer);
        buf.put_u32_le(h.layout.num_layers);
        buf.put_u8(h.layout.dtype.code());
        buf.put_u8(0);
        buf.put_u32_le(h.layout.block_size);
        buf.put_u32_le(h.layout.num_kv_heads);
        buf.put_u32_le(h.layout.head_dim);
        buf.put_u64_le(self.payload_len);
        buf.put_u32_le(self.payload_crc32c);
        buf.put_u32_le(h.block_ids.len() as u32);
        for &id in h.block_ids.iter() {
            buf.put_u32_le(id);
        }
        let trace = h.traceparent.as_deref().unwrap_or("");
        buf.put_u16_le(trace.len() as u16);
        buf.put_slice(trace.as_bytes());
        let crc = crc32c::crc32c(&buf);
        buf.put_u32_le(crc);
        debug_assert_eq!(buf.len(), len);
        Ok(buf.freeze())
    }

    /// Decodes exactly one header (`buf.len()` must equal the prefix's `header_len`).
    pub fn decode(buf: &[u8], limits: &FrameLimits) -> Result<Self, KvTransferError> {
        let header_len = header_len(buf, limits)?;
        if buf.len() < header_len {
            return Err(KvTransferError::Truncated {
                what: "header",
                needed: header_len as u64,
                given: buf.len() as u64,
            });
        }
        if buf.len() > header_len {
            return Err(KvTransferError::TrailingBytes {
                extra: (buf.len() - header_len) as u64,
            });
        }
        let (body, crc_bytes) = buf.split_at(header_len - 4);
        let expected = u32::from_le_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
        let actual = crc32c::crc32c(body);
        if expected != actual {
            return Err(KvTransferError::HeaderChecksumMismatch { expected, actual });
        }

        let mut c = Cursor::new(&body[PREFIX_LEN..]);
        let xfer_id = TransferId(c.u64()?);
        let epoch = c.u64()?;
        let layer = c.u32()?;
        let num_layers = c.u32()?;
        let dtype_code = c.u8()?;
        let _flags = c.u8()?;
        let block_size = c.u32()?;
        let num_kv_heads = c.u32()?;
        let head_dim = c.u32()?;
        let payload_len = c.u64()?;
        let payload_crc32c = c.u32()?;
        let num_blocks = c.u32()? as usize;
        let invalid = |field: &'static str, reason: String| KvTransferError::InvalidHeader {
            xfer_id,
            layer,
            field,
            reason,
        };
        let dtype = KvDtype::from_code(dtype_code)
            .ok_or_else(|| invalid("dtype", format!("unknown dtype code {dtype_code}")))?;
        // The header length fixes how many block ids can follow; check before allocating.
        let room = c.remaining().saturating_sub(2) / 4;
        if num_blocks > room {
            return Err(invalid(
                "num_blocks",
                format!("{num_blocks} blocks do not fit a {header_len}-byte header"),
            ));
        }
        let mut block_ids = Vec::with_capacity(num_blocks);
        for _ in 0..num_blocks {
            block_ids.push(c.u32()?);
        }
        let trace_len = usize::from(c.u16()?);
        if trace_len != c.remaining() {
            return Err(invalid(
                "traceparent_len",
                format!(
                    "{trace_len} disagrees with the {} bytes left in the header",
                    c.remaining()
                ),
            ));
        }
        let trace = c.take(trace_len)?;
        let traceparent = if trace_len == 0 {
            None
        } else {
            let s = std::str::from_utf8(trace)
                .map_err(|_| invalid("traceparent", "not ASCII".to_owned()))?;
            Some(s.to_owned())
        };
        let frame = Self {
            header: LayerHeader {
                xfer_id,
                epoch,
                layer,
                layout: KvLayout {
                    dtype,
                    num_layers,
                    block_size,
                    num_kv_heads,
                    head_dim,
                    windows: Default::default(),
                },
                block_ids: Arc::from(block_ids),
                traceparent,
            },
            payload_len,
            payload_crc32c,
        };
        frame.validate(limits)?;
        Ok(frame)
    }

    /// Checks the payload against the header's length and CRC-32C.
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), KvTransferError> {
        if payload.len() as u64 != self.payload_len {
            return Err(KvTransferError::Truncated {
                what: "payload",
                needed: self.payload_len,
                given: payload.len() as u64,
            });
        }
        self.check_crc32c(crate::crc::crc32c_append(0, payload))
    }

    /// Compares a CRC-32C computed over the payload with the header's.
    pub fn check_crc32c(&self, actual: u32) -> Result<(), KvTransferError> {
        if actual != self.payload_crc32c {
            return Err(KvTransferError::ChecksumMismatch {
                xfer_id: self.header.xfer_id,
                layer: self.header.layer,
                expected: self.payload_crc32c,
                actual,
            });
        }
        Ok(())
    }

    /// Checks that hold for any frame, whatever the receiver has registered.
    fn validate(&self, limits: &FrameLimits) -> Result<(), KvTransferError> {
        let h = &self.header;
        let invalid = |field: &'static str, reason: String| KvTransferError::InvalidHeader {
            xfer_id: h.xfer_id,
            layer: h.layer,
            field,
            reason,
        };
        h.layout
            .validate()
            .map_err(|e| invalid(e.field, format!("{} must be in 1..={}", e.value, e.max)))?;
        if h.layer >= h.layout.num_layers {
            return Err(invalid(
                "layer",
                format!(
                    "{} is not below num_layers {}",
                    h.layer, h.layout.num_layers
                ),
            ));
        }
        if h.block_ids.is_empty() {
            return Err(invalid("block_ids", "empty".to_owned()));
        }
        if let Some(t) = &h.traceparent {
            if t.is_empty() || t.len() > MAX_TRACEPARENT_LEN {
                return Err(invalid(
                    "traceparent",
                    format!("length {} outside 1..={MAX_TRACEPARENT_LEN}", t.len()),
                ));
            }
            if !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid("traceparent", "not printable ASCII".to_owned()));
            }
        }
        if self.payload_len > limits.max_payload_bytes {
            return Err(KvTransferError::PayloadTooLarge {
                xfer_id: h.xfer_id,
                layer: h.layer,
                payload_bytes: self.payload_len,
                limit: limits.max_payload_bytes,
            });
        }
        let expected = h.expected_payload_bytes()?;
        if self.payload_len != expected {
            return Err(KvTransferError::LayoutMismatch {
                xfer_id: h.xfer_id,
                layer: h.layer,
                payload_bytes: self.payload_len,
                expected,
                num_blocks: h.block_ids.len(),
            });
        }
        Ok(())
    }
}

/// Reads the prefix at the start of `buf` and returns the whole header's length.
pub fn header_len(buf: &[u8], limits: &FrameLimits) -> Result<usize, KvTransferError> {
    if buf.len() < PREFIX_LEN {
        return Err(KvTransferError::Truncated {
            what: "header prefix",
            needed: PREFIX_LEN as u64,
            given: buf.len() as u64,
        });
    }
    let magic = [buf[0], buf[1], buf[2], buf[3]];
    if magic != MAGIC {
        return Err(KvTransferError::BadMagic { given: magic });
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version != VERSION {
        return Err(KvTransferError::UnsupportedVersion {
            given: version,
            supported: VERSION,
        });
    }
    let len = u32::from_le_bytes([buf[6], buf[7], buf[8], buf[9]]);
    let max = limits.max_header_bytes.max(MIN_HEADER_LEN as u32);
    if (len as usize) < MIN_HEADER_LEN || len > max {
        return Err(KvTransferError::HeaderLength {
            header_bytes: u64::from(len),
            min: MIN_HEADER_LEN as u64,
            max: u64::from(max),
        });
    }
    Ok(len as usize)
}

/// Decodes a whole frame held in one buffer; the payload is a zero-copy slice of `buf`.
pub fn decode_frame(
    mut buf: Bytes,
    limits: &FrameLimits,
) -> Result<(FrameHeader, Bytes), KvTransferError> {
    let len = header_len(&buf, limits)?;
    if buf.len() < len {
        return Err(KvTransferError::Truncated {
            what: "header",
            needed: len as u64,
            given: buf.len() as u64,
        });
    }
    let header_bytes = buf.split_to(len);
    let header = FrameHeader::decode(&header_bytes, limits)?;
    let given = buf.len() as u64;
    if given < header.payload_len {
        return Err(KvTransferError::Truncated {
            what: "payload",
            needed: header.payload_len,
            given,
        });
    }
    if given > header.payload_len {
        return Err(KvTransferError::TrailingBytes {
            extra: given - header.payload_len,
        });
    }
    header.verify_payload(&buf)?;
    Ok((header, buf))
}

/// Bounds-checked little-endian reads over a byte slice.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], KvTransferError> {
        if n > self.buf.len() {
            return Err(KvTransferError::Truncated {
                what: "header field",
                needed: n as u64,
                given: self.buf.len() as u64,
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], KvTransferError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, KvTransferError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, KvTransferError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, KvTransferError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, KvTransferError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn layout() -> KvLayout {
        KvLayout {
            dtype: KvDtype::F16,
            num_layers: 2,
            block_size: 2,
            num_kv_heads: 2,
            head_dim: 4,
            windows: Default::default(),
        }
    }

    fn frame(block_ids: Vec<u32>, trace: Option<&str>) -> (FrameHeader, Bytes) {
        let header = LayerHeader {
            xfer_id: TransferId(42),
            epoch: 3,
            layer: 1,
            layout: KvLayout {
                num_layers: 4,
                ..layout()
            },
            block_ids: block_ids.into(),
            traceparent: trace.map(str::to_owned),
        };
        let len = header.expected_payload_bytes().unwrap() as usize;
        let payload: Bytes = (0..len)
            .map(|i| (i * 7 + 1) as u8)
            .collect::<Vec<_>>()
            .into();
        (FrameHeader::for_payload(header, &payload), payload)
    }

    fn encode(h: &FrameHeader, payload: &Bytes) -> Vec<u8> {
        let mut v = h.encode(&FrameLimits::default()).unwrap().to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn round_trip() {
        let (h, p) = frame(vec![5, 9, 2], Some(TRACE));
        let (got, payload) =
            decode_frame(Bytes::from(encode(&h, &p)), &FrameLimits::default()).unwrap();
        assert_eq!(got, h);
        assert_eq!(payload, p);
        assert_eq!(
            h.encoded_len(),
            h.encode(&FrameLimits::default()).unwrap().len()
        );
    }

    #[test]
    fn bad_magic_and_version() {
        let (h, p) = frame(vec![1], None);
        let mut v = encode(&h, &p);
        v[0] = b'X';
        let err = decode_frame(v.into(), &FrameLimits::default()).unwrap_err();
        assert!(matches!(err, KvTransferError::BadMagic { .. }), "{err}");

        let mut v = encode(&h, &p);
        v[4] = 2;
        let err = decode_frame(v.into(), &FrameLimits::default()).unwrap_err();
        assert!(
            matches!(err, KvTransferError::UnsupportedVersion { given: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn payload_len_must_match_layout() {
        let (mut h, _) = frame(vec![1, 2], None);
        let payload = Bytes::from(vec![0u8; 10]);
        h = FrameHeader::for_payload(h.header, &payload);
        let err = h.encode(&FrameLimits::default()).unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::LayoutMismatch {
                    payload_bytes: 10,
                    expected: 128,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn absurd_sizes_are_capped() {
        let limits = FrameLimits {
            max_header_bytes: 128,
            max_payload_bytes: 100,
        };
        // Header too big for the limit.
        let (h, p) = frame((0..40).collect(), None);
        let v = encode(&h, &p);
        let err = decode_frame(v.into(), &limits).unwrap_err();
        assert!(matches!(err, KvTransferError::HeaderLength { .. }), "{err}");
        // Payload too big for the limit.
        let (h, p) = frame((0..4).collect(), None);
        let v = encode(&h, &p);
        let err = decode_frame(v.into(), &limits).unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::PayloadTooLarge {
                    payload_bytes: 256,
                    limit: 100,
                    ..
                }
            ),
            "{err}"
        );
        // A header_len of 4 GiB is refused from the prefix alone.
        let mut v = encode(&h, &p);
        v[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = decode_frame(v.into(), &FrameLimits::default()).unwrap_err();
        assert!(matches!(err, KvTransferError::HeaderLength { .. }), "{err}");
    }

    #[test]
    fn payload_corruption_is_a_checksum_mismatch() {
        let (h, p) = frame(vec![3, 4], None);
        let mut v = encode(&h, &p);
        let last = v.len() - 1;
        v[last] ^= 0x40;
        let err = decode_frame(v.into(), &FrameLimits::default()).unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::ChecksumMismatch {
                    xfer_id: TransferId(42),
                    layer: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    fn arb_frame() -> impl Strategy<Value = (FrameHeader, Bytes)> {
        (
            any::<u64>(),
            any::<u64>(),
            1u32..64,
            0usize..3,
            1u32..5,
            1u32..4,
            1u32..9,
            proptest::collection::vec(any::<u32>(), 1..20),
            proptest::option::of("[!-~]{1,60}"),
            any::<u8>(),
        )
            .prop_map(
                |(xfer_id, epoch, num_layers, d, bs, heads, dim, ids, trace, seed)| {
                    let dtype = [KvDtype::F32, KvDtype::Bf16, KvDtype::F16][d];
                    let header = LayerHeader {
                        xfer_id: TransferId(xfer_id),
                        epoch,
                        layer: seed as u32 % num_layers,
                        layout: KvLayout {
                            dtype,
                            num_layers,
                            block_size: bs,
                            num_kv_heads: heads,
                            head_dim: dim,
                            windows: Default::default(),
                        },
                        block_ids: ids.into(),
                        traceparent: trace,
                    };
                    let len = header.expected_payload_bytes().unwrap() as usize;
                    let payload: Bytes = (0..len)
                        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                        .collect::<Vec<_>>()
                        .into();
                    (FrameHeader::for_payload(header, &payload), payload)
                },
            )
    }

    proptest! {
        #[test]
        fn prop_round_trip((h, p) in arb_frame()) {
            let wire = encode(&h, &p);
            let (got, payload) = decode_frame(wire.into(), &FrameLimits::default()).unwrap();
            prop_assert_eq!(got, h);
            prop_assert_eq!(payload, p);
        }

        #[test]
        fn prop_truncation_is_an_error((h, p) in arb_frame(), frac in 0.0f64..1.0) {
            let wire = encode(&h, &p);
            let cut = ((wire.len() as f64) * frac) as usize;
            prop_assume!(cut < wire.len());
            let res = decode_frame(Bytes::copy_from_slice(&wire[..cut]), &FrameLimits::default());
            prop_assert!(res.is_err());
        }

        /// Flipping any bits of any one byte is caught: in the header by magic, version, length
        /// or header checksum; in the payload by the payload checksum.
        #[test]
        fn prop_corruption_is_an_error(
            (h, p) in arb_frame(),
            frac in 0.0f64..1.0,
            flip in 1u8..=255,
        ) {
            let mut wire = encode(&h, &p);
            let at = ((wire.len() as f64) * frac) as usize % wire.len();
            wire[at] ^= flip;
            let res = decode_frame(wire.into(), &FrameLimits::default());
            prop_assert!(res.is_err());
        }

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn prop_garbage_never_panics(mut bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if bytes.len() >= 6 && bytes[0] & 1 == 0 {
                // Give half the inputs a valid prefix so decoding gets past the magic.
                bytes[..4].copy_from_slice(&MAGIC);
                bytes[4..6].copy_from_slice(&VERSION.to_le_bytes());
            }
            let _ = decode_frame(bytes.into(), &FrameLimits::default());
        }
    }
}
