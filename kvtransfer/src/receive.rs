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

/// What must happen before each frame's header is read: UCX waits for the frame's payload
/// to land in the connection's region.
pub(crate) trait FrameGate<St> {
    /// Whether the connection goes on; `false` ends it.
    async fn ready(&mut self, stream: &St) -> bool;
}

/// No gate: the payload follows its header on the stream (TCP), or is in a region before
/// the header is sent (shm).
pub(crate) struct Open;

impl<St> FrameGate<St> for Open {
    async fn ready(&mut self, _stream: &St) -> bool {
        true
    }
}

/// Receives frames on `stream` and answers each with its verdict until the peer closes, a
/// frame ends the connection (answered, then lingered on), `gate` says stop or `shutdown`
/// fires.
pub(crate) async fn serve_frames<St, S, G>(
    stream: &mut St,
    frames: FrameLoop<'_, S>,
    mut gate: G,
    shutdown: &CancellationToken,
) where
    St: AsyncRead + AsyncWrite + Unpin,
    S: KvSink + ?Sized,
    G: FrameGate<St>,
{
    let FrameLoop {
        ctx,
        early,
        peer,
        peer_key,
    } = frames;
    let mut scratch = Vec::new();
    loop {
        let next = async {
            if !gate.ready(&*stream).await {
                return None;
            }
            Some(receive_frame(&mut *stream, ctx, &mut scratch, early, peer, peer_key).await)
        };
        let handled = tokio::select! {
            _ = shutdown.cancelled() => break,
            handled = next => match handled {
                Some(handled) => handled,
                None => break,
            },
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
