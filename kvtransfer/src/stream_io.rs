//! Reading and writing frames on byte streams (a TCP connection, a QUIC stream).

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::KvTransferError;
use crate::frame::{header_len, FrameHeader, FrameLimits, PREFIX_LEN};

/// Reads one header from a stream. `Ok(None)` is a clean end of stream before its first byte.
pub(crate) async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &FrameLimits,
    scratch: &mut Vec<u8>,
    peer: &str,
) -> Result<Option<FrameHeader>, KvTransferError> {
    scratch.clear();
    scratch.resize(PREFIX_LEN, 0);
    let got = read_full(r, &mut scratch[..], peer).await?;
    if got == 0 {
        return Ok(None);
    }
    if got < PREFIX_LEN {
        return Err(KvTransferError::Truncated {
            what: "header prefix",
            needed: PREFIX_LEN as u64,
            given: got as u64,
        });
    }
    let len = header_len(scratch, limits)?;
    scratch.resize(len, 0);
    let got = read_full(r, &mut scratch[PREFIX_LEN..], peer).await?;
    if got < len - PREFIX_LEN {
        return Err(KvTransferError::Truncated {
            what: "header",
            needed: len as u64,
            given: (PREFIX_LEN + got) as u64,
        });
    }
    FrameHeader::decode(scratch, limits).map(Some)
}

/// Reads the payload that `header` announces into one buffer, without zero-filling it first,
/// and computes its CRC-32C on the way while each piece is still in cache.
pub(crate) async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &FrameHeader,
    peer: &str,
) -> Result<(Bytes, u32), KvTransferError> {
    // validate() capped payload_len at max_payload_bytes, which fits in memory.
    let len =
        usize::try_from(header.payload_len).map_err(|_| KvTransferError::PayloadTooLarge {
            xfer_id: header.header.xfer_id,
            layer: header.header.layer,
            payload_bytes: header.payload_len,
            limit: usize::MAX as u64,
        })?;
    let mut buf = BytesMut::with_capacity(len);
    let mut crc = 0;
    while buf.len() < len {
        let start = buf.len();
        let n = r
            .read_buf(&mut (&mut buf).limit(len - start))
            .await
            .map_err(|source| io_error(peer, "read payload", source))?;
        if n == 0 {
            return Err(KvTransferError::Truncated {
                what: "payload",
                needed: header.payload_len,
                given: start as u64,
            });
        }
        crc = crate::crc::crc32c_append(crc, &buf[start..]);
    }
    Ok((buf.freeze(), crc))
}

/// Reads and drops `len` bytes, to keep a byte stream in step after a refused frame.
pub(crate) async fn discard<R: AsyncRead + Unpin>(
    r: &mut R,
    len: u64,
    peer: &str,
) -> Result<(), KvTransferError> {
    let copied = tokio::io::copy(&mut r.take(len), &mut tokio::io::sink())
        .await
        .map_err(|source| io_error(peer, "discard payload", source))?;
    if copied < len {
        return Err(KvTransferError::Truncated {
            what: "payload",
            needed: len,
            given: copied,
        });
    }
    Ok(())
}

/// Writes a header then its payload, without joining them into one buffer.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &[u8],
    payload: &[u8],
    peer: &str,
) -> Result<(), KvTransferError> {
    w.write_all(header)
        .await
        .map_err(|source| io_error(peer, "write header", source))?;
    w.write_all(payload)
        .await
        .map_err(|source| io_error(peer, "write payload", source))?;
    w.flush()
        .await
        .map_err(|source| io_error(peer, "flush", source))
}

/// Fills `buf` unless the stream ends first; returns how many bytes arrived.
async fn read_full<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    peer: &str,
) -> Result<usize, KvTransferError> {
    let mut got = 0;
    while got < buf.len() {
        let n = match r.read(&mut buf[got..]).await {
            Ok(n) => n,
            // A TLS stream (shm's) whose peer closed between frames without close_notify,
            // as a prefill node does when it exits: the same clean end as a plain EOF. Inside
            // a header it is still truncation, which the caller reports.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(source) => return Err(io_error(peer, "read header", source)),
        };
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

pub(crate) fn io_error(peer: &str, what: &'static str, source: std::io::Error) -> KvTransferError {
    KvTransferError::Io {
        endpoint: peer.to_owned(),
        what,
        source,
    }
}

/// Copies `len` bytes out of `region` into a buffer of the receiver's own, computing their
/// CRC-32C piece by piece while each piece is in cache.
pub(crate) fn copy_out(region: &[u8], len: usize) -> Option<(Bytes, u32)> {
    const PIECE: usize = 256 << 10;
    let src = region.get(..len)?;
    let mut buf = BytesMut::with_capacity(len);
    let mut crc = 0;
    for piece in src.chunks(PIECE) {
        let start = buf.len();
        buf.extend_from_slice(piece);
        crc = crate::crc::crc32c_append(crc, &buf[start..]);
    }
    Some((buf.freeze(), crc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::LayerHeader;
    use kv_types::{KvDtype, KvLayout, TransferId};

    const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn frame(block_ids: Vec<u32>, trace: Option<&str>) -> (FrameHeader, Bytes) {
        let header = LayerHeader {
            xfer_id: TransferId(42),
            epoch: 3,
            layer: 1,
            layout: KvLayout {
                num_layers: 4,
                dtype: KvDtype::F16,
                block_size: 2,
                num_kv_heads: 2,
                head_dim: 4,
                windows: Default::default(),
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

    #[tokio::test]
    async fn stream_read_matches_buffer_decode() {
        let (h, p) = frame(vec![8, 1, 6], Some(TRACE));
        let mut wire = encode(&h, &p);
        wire.extend(encode(&h, &p));
        let mut r = &wire[..];
        let mut scratch = Vec::new();
        let limits = FrameLimits::default();
        for _ in 0..2 {
            let got = read_header(&mut r, &limits, &mut scratch, "test")
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, h);
            let (payload, crc) = read_payload(&mut r, &got, "test").await.unwrap();
            got.verify_payload(&payload).unwrap();
            got.check_crc32c(crc).unwrap();
        }
        assert!(read_header(&mut r, &limits, &mut scratch, "test")
            .await
            .unwrap()
            .is_none());
    }

    /// Reads `bytes`, then fails as a TLS stream does whose peer left without close_notify.
    struct EofAfter(Vec<u8>);

    impl AsyncRead for EofAfter {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0.is_empty() {
                return std::task::Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()));
            }
            let n = self.0.len().min(buf.remaining());
            buf.put_slice(&self.0[..n]);
            self.0.drain(..n);
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_peer_gone_without_close_notify_is_a_clean_end_between_frames_only() {
        let (h, p) = frame(vec![8, 1], None);
        let wire = encode(&h, &p);
        let limits = FrameLimits::default();
        let mut scratch = Vec::new();
        let mut r = EofAfter(Vec::new());
        let got = read_header(&mut r, &limits, &mut scratch, "test").await;
        assert!(matches!(got, Ok(None)), "{got:?}");
        let mut r = EofAfter(wire[..PREFIX_LEN + 5].to_vec());
        let got = read_header(&mut r, &limits, &mut scratch, "test").await;
        assert!(
            matches!(got, Err(KvTransferError::Truncated { .. })),
            "{got:?}"
        );
    }

    #[tokio::test]
    async fn stream_read_reports_truncation() {
        let (h, p) = frame(vec![8, 1], None);
        let wire = encode(&h, &p);
        let limits = FrameLimits::default();
        for cut in [3, PREFIX_LEN + 5, wire.len() - 1] {
            let mut r = &wire[..cut];
            let mut scratch = Vec::new();
            let res = match read_header(&mut r, &limits, &mut scratch, "test").await {
                Ok(Some(h)) => read_payload(&mut r, &h, "test").await.map(|_| ()),
                Ok(None) => panic!("cut {cut}: clean eof"),
                Err(e) => Err(e),
            };
            assert!(
                matches!(res, Err(KvTransferError::Truncated { .. })),
                "cut {cut}: {res:?}"
            );
        }
    }
}
