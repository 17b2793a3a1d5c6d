//! The receiving side: a TCP control socket, and one registered region per connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::command::WorkerOptions;
use super::peer::{peer_origin, PeerOrigin};
use super::worker::{RegionLease, UcxWorker};
use super::UcxConfig;
use crate::accept::{accept_loop, Accepted};
use crate::error::KvTransferError;
use crate::receive::{serve_frames, FrameGate, FrameLoop};
use crate::registry::TransferRegistry;
use crate::sink::KvSink;
use crate::slots::{Slots, SLOTS};
use crate::stream_io;
use crate::transport::{EarlyRefusal, KvServer, ReceiveCtx, RefusalObserver};

/// The hello's first bytes.
pub(crate) const HELLO_MAGIC: [u8; 4] = *b"FKUX";

/// Each connection's tag, unique in this process, so that a message for one connection can
/// never match another's receive.
static NEXT_TAG: AtomicU64 = AtomicU64::new(1);

/// Before each frame, waits for its payload: a tagged message into the connection's region.
/// The sender sends one for every frame (an empty one for an empty payload) before the
/// header, so a header without it is a peer out of step, dropped after `timeout`.
struct RecvGate<'a> {
    worker: &'a UcxWorker,
    region: &'a RegionLease,
    slots: &'a Slots,
    slot_bytes: usize,
    tag: u64,
    timeout: Duration,
    peer: &'a str,
}

impl FrameGate<TcpStream> for RecvGate<'_> {
    async fn ready(&mut self, stream: &TcpStream) -> bool {
        // The slot the sink does not hold: the payload lands there and is read in place.
        let slot = usize::from(self.slots.next_slot());
        let recv = self.worker.recv(
            self.region,
            slot * self.slot_bytes,
            self.slot_bytes,
            self.tag,
        );
        tokio::pin!(recv);
        let mut byte = [0u8; 1];
        let received = tokio::select! {
            received = &mut recv => received,
            // The peer closed (or a header came first): stop, or give the payload its time.
            peeked = stream.peek(&mut byte) => match peeked {
                Ok(n) if n > 0 => tokio::time::timeout(self.timeout, recv)
                    .await
                    .unwrap_or_else(|_| Err(KvTransferError::Stream {
                        endpoint: self.peer.to_owned(),
                        what: "ucx receive",
                        reason: format!("a header without its payload within {} ms", self.timeout.as_millis()),
                    })),
                _ => return false,
            },
        };
        match received {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(peer = self.peer, error = %e, "kv ucx receive failed");
                false
            }
        }
    }
}

/// Receives layers through UCX tagged sends into its registered regions.
pub struct UcxServer {
    listener: TcpListener,
    worker: UcxWorker,
    config: UcxConfig,
    on_refusal: Option<RefusalObserver>,
}

impl UcxServer {
    /// Binds the control socket on `addr` and starts the UCX worker; fails if UCX is not
    /// installed.
    pub async fn bind(addr: SocketAddr, config: UcxConfig) -> Result<Self, KvTransferError> {
        let options = WorkerOptions {
            transports: config.transports.clone(),
        };
        let worker = tokio::task::spawn_blocking(move || UcxWorker::spawn(options))
            .await
            .map_err(|e| KvTransferError::Config {
                field: "kv_transport",
                reason: format!("UCX worker set-up: {e}"),
            })??;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| KvTransferError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        Ok(Self {
            listener,
            worker,
            config,
            on_refusal: None,
        })
    }
}

impl UcxServer {
    /// A count of the server's registered regions that are free to lease, to read while it
    /// serves: once every connection has ended and UCX has finished with every receive, all
    /// of them are (a region leaked to a dead peer would not be).
    pub fn free_regions(&self) -> impl Fn() -> usize + Send + Sync + 'static {
        let worker = self.worker.clone();
        move || worker.free_regions()
    }
}

impl KvServer for UcxServer {
    fn local_addr(&self) -> Result<SocketAddr, KvTransferError> {
        self.listener
            .local_addr()
            .map_err(|source| KvTransferError::Bind {
                addr: "ucx control listener".to_owned(),
                source,
            })
    }

    fn refusal_observer(&mut self) -> &mut Option<RefusalObserver> {
        &mut self.on_refusal
    }

    async fn serve<S: KvSink>(
        self,
        registry: TransferRegistry,
        sink: Arc<S>,
        shutdown: CancellationToken,
    ) -> Result<(), KvTransferError> {
        let local_addr = self.local_addr()?;
        tracing::info!(%local_addr, "kv ucx server listening");
        let ctx = ReceiveCtx::new(registry, sink, self.config.limits, self.on_refusal);
        let listener = &self.listener;
        let shared = Arc::new((self.worker, self.config));
        accept_loop(
            shared.1.max_connections,
            &shutdown,
            || async {
                match listener.accept().await {
                    Ok((stream, peer)) => Accepted::Connection((stream, peer)),
                    Err(e) => {
                        tracing::warn!(error = %e, "kv ucx accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Accepted::Retry
                    }
                }
            },
            |(stream, peer), shutdown| {
                run_connection(stream, peer, ctx.clone(), shared.clone(), shutdown)
            },
        )
        .await;
        tracing::info!(%local_addr, "kv ucx server stopped");
        Ok(())
    }
}

fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `peer` may learn this node's worker address and a remote key.
fn admit(stream: &TcpStream, peer: SocketAddr, config: &UcxConfig) -> Result<(), String> {
    let local = stream.local_addr().map_err(|e| e.to_string())?;
    match peer_origin(peer, local) {
        PeerOrigin::Local { uid } if uid == own_uid() => Ok(()),
        PeerOrigin::Local { uid } => Err(format!(
            "uid {uid} on this host is not this node's uid {}",
            own_uid()
        )),
        PeerOrigin::Remote if config.remote_peers => Ok(()),
        PeerOrigin::Remote => {
            Err("a peer on another host, and remote_peers is off (UCX has no TLS)".to_owned())
        }
    }
}

/// The receiving end of one connection: the peer is admitted before any region is named.
async fn run_connection<S: KvSink>(
    mut stream: TcpStream,
    peer_addr: SocketAddr,
    ctx: Arc<ReceiveCtx<S>>,
    shared: Arc<(UcxWorker, UcxConfig)>,
    shutdown: CancellationToken,
) {
    let (worker, config) = (&shared.0, &shared.1);
    let peer = format!("ucx {peer_addr}");
    if let Err(reason) = admit(&stream, peer_addr, config) {
        let e = KvTransferError::Stream {
            endpoint: peer.clone(),
            what: "peer admission",
            reason,
        };
        tracing::warn!(error = %e, "kv ucx peer refused");
        ctx.refused(&e);
        return;
    }
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "kv ucx set_nodelay failed");
    }
    let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed);
    let slot_bytes = usize::try_from(config.limits.max_payload_bytes).unwrap_or(usize::MAX);
    let setup = async {
        let region_bytes =
            slot_bytes
                .checked_mul(SLOTS)
                .ok_or_else(|| KvTransferError::Config {
                    field: "max_payload_bytes",
                    reason: format!("{SLOTS} slots of {slot_bytes} bytes do not fit in memory"),
                })?;
        let region = worker.lease_region(region_bytes).await?;
        let info = region.info();
        let address = worker.address();
        let mut hello = Vec::with_capacity(36 + address.len() + info.rkey.len());
        hello.extend_from_slice(&HELLO_MAGIC);
        hello.extend_from_slice(&(address.len() as u32).to_le_bytes());
        hello.extend_from_slice(address);
        hello.extend_from_slice(&(info.addr as u64).to_le_bytes());
        // The largest payload: one slot.
        hello.extend_from_slice(&(slot_bytes as u64).to_le_bytes());
        hello.extend_from_slice(&tag.to_le_bytes());
        hello.extend_from_slice(&(info.rkey.len() as u32).to_le_bytes());
        hello.extend_from_slice(&info.rkey);
        stream
            .write_all(&hello)
            .await
            .map_err(|e| stream_io::io_error(&peer, "send region", e))?;
        let mut ack = [0u8; 1];
        stream
            .read_exact(&mut ack)
            .await
            .map_err(|e| stream_io::io_error(&peer, "endpoint ready", e))?;
        Ok::<_, KvTransferError>(region)
    };
    let region = tokio::select! {
        _ = shutdown.cancelled() => return,
        region = setup => match region {
            Ok(region) => {
                tracing::info!(%peer, region_bytes = region.info().len, "kv ucx connection ready");
                region
            }
            Err(e) => {
                tracing::debug!(%peer, error = %e, "kv ucx region not set up");
                return;
            }
        },
    };
    let region = Arc::new(region);
    // The slots and every payload the sink holds keep the lease, so the region goes back to
    // the worker only once nothing reads it.
    let slots = Slots::new(region.clone(), slot_bytes);
    let frames = FrameLoop {
        ctx: &ctx,
        early: EarlyRefusal::Source(&slots),
        peer: &peer,
        peer_key: None,
    };
    let gate = RecvGate {
        worker,
        region: &region,
        slots: &slots,
        slot_bytes,
        tag,
        timeout: Duration::from_millis(config.put_timeout_ms),
        peer: &peer,
    };
    serve_frames(&mut stream, frames, gate, &shutdown).await;
}
