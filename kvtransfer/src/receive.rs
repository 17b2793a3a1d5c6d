//! The receiving loop of a byte-stream connection that carries one frame at a time and
//! answers each with its verdict (TCP, and the control sockets of UCX and shm).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::registry::PeerKey;
use crate::sink::KvSink;
use crate::stream_io;
use crate::transport::{receive_frame, EarlyRefusal, Handled, ReceiveCtx};

/// What a connection's loop needs besides the stream.
pub(crate) struct FrameLoop<'a, S: ?Sized> {
    pub ctx: &'a ReceiveCtx<S>,
    /// Where payloads are: on the stream (TCP) or in the connection's region (UCX, shm).
    pub early: EarlyRefusal<'a>,
    pub peer: &'a str,
    /// The peer's authenticated identity, where the backend has one (shm's certificate).
    pub peer_key: Option<&'a PeerKey>,
}

/// Receives frames on `stream` and answers each with its verdict until the peer closes, a
/// frame ends the connection (answered, then lingered on) or `shutdown` fires.
pub(crate) async fn serve_frames<St, S>(
    stream: &mut St,
    frames: FrameLoop<'_, S>,
    shutdown: &CancellationToken,
) where
    St: AsyncRead + AsyncWrite + Unpin,
    S: KvSink + ?Sized,
{
    let FrameLoop {
        ctx,
        early,
        peer,
        peer_key,
    } = frames;
    let mut scratch = Vec::new();
    loop {
        let handled = tokio::select! {
            _ = shutdown.cancelled() => break,
            handled = receive_frame(&mut *stream, ctx, &mut scratch, early, peer, peer_key) => handled,
        };
        let (verdict, keep_going) = match handled {
            Handled::Eof => break,
            Handled::Answer(v) => (v, true),
            Handled::Refused(v) | Handled::Fatal(v) => (v, false),
        };
        if let Err(e) = stream_io::write_frame(&mut *stream, &verdict.encode(), &[], peer).await {
            tracing::debug!(peer, error = %e, "kv verdict not sent");
            break;
        }
        if !keep_going {
            linger(stream).await;
            break;
        }
    }
}

/// Half-closes and drains briefly before a refused connection is dropped: closing a socket
/// with unread input sends a reset, which can destroy the verdict before the peer reads it.
async fn linger<St: AsyncRead + AsyncWrite + Unpin>(stream: &mut St) {
    const LINGER: Duration = Duration::from_millis(200);
    const MAX_DRAIN_BYTES: u64 = 1 << 20;
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut drain = (&mut *stream).take(MAX_DRAIN_BYTES);
    let _ = tokio::time::timeout(LINGER, tokio::io::copy(&mut drain, &mut tokio::io::sink())).await;
}
