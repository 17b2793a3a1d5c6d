//! The transport traits, and the receive loop that every backend shares.
//!
//! Methods return `impl Future + Send` so callers can spawn one task per layer on a generic
//! connection; implementations write plain `async fn`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncRead;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::KvTransferError;
use crate::frame::{FrameHeader, FrameLimits};
use crate::header::LayerHeader;
use crate::registry::{Admission, PeerKey, TransferRegistry};
use crate::sink::KvSink;
use crate::stream_io;
use crate::verdict::Verdict;

/// What one `send_layer` moved, and how long it took until the receiver's verdict came back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferStat {
    pub layer: u32,
    pub payload_bytes: u64,
    /// Header plus payload.
    pub frame_bytes: u64,
    pub elapsed: Duration,
}

/// The sending side: a factory of connections to `kv_endpoint`s (`host:port`).
pub trait KvTransport: Send + Sync + 'static {
    type Connection: KvConnection;

    /// Returns a connection to `endpoint`, reusing a cached one while it is alive.
    fn connect(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<Self::Connection, KvTransferError>> + Send;
}

/// A connection to one decode node. Cheap to clone; `send_layer` may run concurrently for
/// different layers.
pub trait KvConnection: Clone + Send + Sync + 'static {
    fn endpoint(&self) -> &str;

    /// Sends one frame whose header the caller built, payload length and checksum included,
    /// and waits for the receiver's verdict. `Ok` means the receiver verified the checksum and
    /// its sink took the payload; any other verdict is [`KvTransferError::Rejected`], and the
    /// connection stays usable.
    fn send_frame(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> impl Future<Output = Result<TransferStat, KvTransferError>> + Send;

    /// Computes the payload's checksum and sends it as one layer (see
    /// [`KvConnection::send_frame`]).
    fn send_layer(
        &self,
        header: LayerHeader,
        payload: Bytes,
    ) -> impl Future<Output = Result<TransferStat, KvTransferError>> + Send {
        let frame = FrameHeader::for_payload(header, &payload);
        self.send_frame(frame, payload)
    }
}

/// The receiving side, bound to a local address.
pub trait KvServer: Send + Sized + 'static {
    fn local_addr(&self) -> Result<SocketAddr, KvTransferError>;

    /// Where [`KvServer::on_refusal`] keeps its observer.
    fn refusal_observer(&mut self) -> &mut Option<RefusalObserver>;

    /// Calls `f` with the error of every frame this server refuses (a bad header, a frame the
    /// registry or the sink refuses, a stream cut inside a payload), so the service can count
    /// them. Ignored frames (stale epoch, closed transfer) are not refusals.
    fn on_refusal(mut self, f: impl Fn(&KvTransferError) + Send + Sync + 'static) -> Self {
        *self.refusal_observer() = Some(Arc::new(f));
        self
    }

    /// Accepts frames until `shutdown` is cancelled, checks each against `registry` and hands
    /// accepted payloads to `sink`. On shutdown it stops accepting, drops frames in flight
    /// (their layers go back to pending) and returns.
    fn serve<S: KvSink>(
        self,
        registry: TransferRegistry,
        sink: Arc<S>,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), KvTransferError>> + Send;
}

/// Sends every layer at once, each on its own stream, and returns their stats in layer order.
/// `template` supplies everything but the layer index; `payloads[i]` is layer `i`.
pub async fn send_all_layers<C: KvConnection>(
    conn: &C,
    template: &LayerHeader,
    payloads: Vec<Bytes>,
) -> Result<Vec<TransferStat>, KvTransferError> {
    let mut tasks = JoinSet::new();
    for (layer, payload) in payloads.into_iter().enumerate() {
        let header = LayerHeader {
            layer: layer as u32,
            ..template.clone()
        };
        let conn = conn.clone();
        tasks.spawn(async move { conn.send_layer(header, payload).await });
    }
    let mut stats = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        let stat = joined.map_err(|e| KvTransferError::Stream {
            endpoint: conn.endpoint().to_owned(),
            what: "send task",
            reason: e.to_string(),
        })??;
        stats.push(stat);
    }
    stats.sort_by_key(|s| s.layer);
    Ok(stats)
}

/// Told of every frame the receiving side refuses, with why: kvtransfer has no metrics of its
/// own, so a service counts refusals under its names through this (see the servers'
/// `on_refusal`). Called on the receiving task: keep it cheap.
/// Called with each frame a server refuses.
pub type RefusalObserver = Arc<dyn Fn(&KvTransferError) + Send + Sync>;

/// What the server needs for every frame.
pub(crate) struct ReceiveCtx<S: ?Sized> {
    pub registry: TransferRegistry,
    pub sink: Arc<S>,
    pub limits: FrameLimits,
    pub on_refusal: Option<RefusalObserver>,
}

impl<S: ?Sized> ReceiveCtx<S> {
    pub(crate) fn new(
        registry: TransferRegistry,
        sink: Arc<S>,
        limits: FrameLimits,
        on_refusal: Option<RefusalObserver>,
    ) -> Arc<Self> {
        Arc::new(ReceiveCtx {
            registry,
            sink,
            limits,
            on_refusal,
        })
    }

    pub(crate) fn refused(&self, e: &KvTransferError) {
        if let Some(f) = &self.on_refusal {
            f(e);
        }
    }
}

/// Where a frame's payload is, and so what to do with it when the frame is refused from its
/// header alone.
#[derive(Clone, Copy)]
pub(crate) enum EarlyRefusal<'a> {
    /// On the stream: read and drop it, to keep a byte stream (TCP) in step.
    Discard,
    /// On the stream: leave it unread; the caller stops the stream (QUIC).
    Abandon,
    /// In a region that hands the payload out itself (the slots of shm and UCX): nothing to
    /// drop.
    Source(&'a dyn PayloadSource),
}

/// A receiver-side region that gives out a frame's payload with its CRC-32C, copied or not.
pub(crate) trait PayloadSource: Sync {
    /// The payload of `len` bytes and its CRC-32C; `None` when it does not fit the region.
    fn take(&self, len: usize) -> Option<(Bytes, u32)>;
    fn capacity(&self) -> usize;
}

/// How one frame ended on the receiving side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handled {
    /// The stream ended cleanly before a frame began.
    Eof,
    /// The whole frame was consumed; answer with the verdict.
    Answer(Verdict),
    /// Refused from the header; the payload was left unread (`EarlyRefusal::Abandon`).
    Refused(Verdict),
    /// The stream can no longer be parsed; answer and close it.
    Fatal(Verdict),
}

/// Reads one frame from `r`, checks it, and hands its payload to the sink.
pub(crate) async fn receive_frame<R, S>(
    r: &mut R,
    ctx: &ReceiveCtx<S>,
    scratch: &mut Vec<u8>,
    early: EarlyRefusal<'_>,
    peer: &str,
    peer_key: Option<&PeerKey>,
) -> Handled
where
    R: AsyncRead + Unpin,
    S: KvSink + ?Sized,
{
    let frame = match stream_io::read_header(r, &ctx.limits, scratch, peer).await {
        Ok(Some(frame)) => frame,
        Ok(None) => return Handled::Eof,
        Err(e) => {
            tracing::warn!(peer, error = %e, error_type = e.error_type(), "kv frame header refused");
            ctx.refused(&e);
            return Handled::Fatal(e.verdict());
        }
    };
    let h = &frame.header;
    // One span per received layer, a child of the sender's `kv_transfer` span through the
    // frame's traceparent, so one request's trace shows both ends of the transfer.
    let span = tracing::info_span!(
        "kv_receive",
        xfer_id = h.xfer_id.0 as i64,
        epoch = h.epoch as i64,
        layer = h.layer as i64,
        payload_bytes = frame.payload_len as i64,
        peer,
    );
    if let Some(tp) = h.traceparent.as_deref() {
        telemetry::set_parent(&span, telemetry::context_from_traceparent(tp));
    }
    async {
        let (claim, verdict) = match ctx.registry.admit_from(&frame, peer_key) {
            Ok(Admission::Accept(claim)) => (Some(claim), Verdict::Accepted),
            Ok(Admission::Ignore(why)) => {
                tracing::debug!(?why, "kv frame ignored");
                (None, why.verdict())
            }
            Err(e) => {
                tracing::warn!(error = %e, error_type = e.error_type(), "kv frame refused");
                ctx.refused(&e);
                (None, e.verdict())
            }
        };
        let Some(claim) = claim else {
            return match early {
                EarlyRefusal::Abandon => Handled::Refused(verdict),
                EarlyRefusal::Source(_) => Handled::Answer(verdict),
                EarlyRefusal::Discard => match stream_io::discard(r, frame.payload_len, peer).await
                {
                    Ok(()) => Handled::Answer(verdict),
                    Err(e) => {
                        tracing::debug!(error = %e, "kv stream ended inside a refused payload");
                        Handled::Fatal(verdict)
                    }
                },
            };
        };
        let read = match early {
            EarlyRefusal::Source(source) => usize::try_from(frame.payload_len)
                .ok()
                .and_then(|len| source.take(len))
                .ok_or_else(|| KvTransferError::PayloadTooLarge {
                    xfer_id: frame.header.xfer_id,
                    layer: frame.header.layer,
                    payload_bytes: frame.payload_len,
                    limit: source.capacity() as u64,
                }),
            _ => stream_io::read_payload(r, &frame, peer).await,
        };
        let (payload, crc) = match read {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(error = %e, "kv stream ended inside a payload");
                ctx.refused(&e);
                return Handled::Fatal(Verdict::Malformed);
            }
        };
        match claim.complete_with_crc32c(&*ctx.sink, &frame, payload, crc) {
            Ok(outcome) => {
                tracing::trace!(?outcome, "kv layer received");
                Handled::Answer(outcome.verdict())
            }
            Err(e) => {
                tracing::warn!(error = %e, error_type = e.error_type(), "kv layer refused");
                ctx.refused(&e);
                Handled::Answer(e.verdict())
            }
        }
    }
    .instrument(span)
    .await
}

/// Splits `host:port` into a resolved address and the host name that TLS checks.
/// The local address a sending socket should bind to reach `peer`, given the one configured
/// (`bind`, port 0). A node that listens on loopback (`fission up`'s default) can still be
/// joined by nodes on other addresses, and a socket bound to 127.0.0.1 cannot reach those:
/// connect fails with EINVAL. So a loopback or other-family address gives way to the
/// unspecified address of the peer's family, and the kernel picks the source by its routes.
/// Any other configured address is kept, so that on a multi-homed host pushes leave from the
/// node's own address.
pub(crate) fn source_for(bind: IpAddr, peer: IpAddr) -> IpAddr {
    let same_family = bind.is_ipv4() == peer.is_ipv4();
    if same_family && !bind.is_unspecified() && (!bind.is_loopback() || peer.is_loopback()) {
        return bind;
    }
    match peer {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

pub(crate) async fn resolve(endpoint: &str) -> Result<(SocketAddr, String), KvTransferError> {
    let invalid = |reason: String| KvTransferError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let (host, _port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| invalid("expected host:port".to_owned()))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(invalid("empty host".to_owned()));
    }
    let addr = tokio::net::lookup_host(endpoint)
        .await
        .map_err(|e| invalid(e.to_string()))?
        .next()
        .ok_or_else(|| invalid("resolves to no address".to_owned()))?;
    Ok((addr, host.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_for_gives_up_a_bind_address_that_cannot_reach_the_peer() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // Loopback reaches loopback only; elsewhere the kernel picks (issue 31, EINVAL).
        assert_eq!(
            source_for(ip("127.0.0.1"), ip("127.0.0.1")),
            ip("127.0.0.1")
        );
        assert_eq!(source_for(ip("127.0.0.1"), ip("10.213.0.2")), ip("0.0.0.0"));
        assert_eq!(source_for(ip("::1"), ip("fd00::2")), ip("::"));
        // The other family: its unspecified address.
        assert_eq!(source_for(ip("127.0.0.1"), ip("::1")), ip("::"));
        assert_eq!(source_for(ip("10.0.0.5"), ip("fd00::2")), ip("::"));
        // A node's own address on a multi-homed host is kept.
        assert_eq!(source_for(ip("10.0.0.5"), ip("10.0.0.9")), ip("10.0.0.5"));
        assert_eq!(source_for(ip("0.0.0.0"), ip("10.0.0.9")), ip("0.0.0.0"));
    }

    #[tokio::test]
    async fn resolve_splits_host_and_port() {
        let (addr, host) = resolve("127.0.0.1:4000").await.unwrap();
        assert_eq!(addr.port(), 4000);
        assert_eq!(host, "127.0.0.1");
        let (addr, host) = resolve("[::1]:4001").await.unwrap();
        assert!(addr.is_ipv6());
        assert_eq!(host, "::1");
        assert!(matches!(
            resolve("nohostport").await,
            Err(KvTransferError::InvalidEndpoint { .. })
        ));
    }
}
