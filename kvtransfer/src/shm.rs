//! Shared-memory backend, for a prefill node and a decode node on one host.
//!
//! The decode node listens on a Unix socket (`unix:/dev/shm/fission-kv-….sock`). For each
//! connection it creates a memory region, a file in the socket's directory that only its own
//! user may open, and names it to the sender, which maps it too; once the sender has it
//! mapped the file is unlinked, so the region lives only in the two mappings. Each frame then
//! moves as: the sender copies the payload into a slot of the region, computing its CRC-32C
//! on the way, and sends the usual frame header (checksum, epoch, trace context) on the
//! socket; the receiver checks the CRC on the slot as every backend does, hands the sink a
//! view of the slot, and answers with the verdict and the slot for the next frame
//! ([`region`]: one copy per byte in all). Like TCP, a connection carries one frame at a time
//! and each endpoint gets a small pool of them.
//!
//! Trust ([`crate::shm_auth`]): both ends admit only a peer of their own user (`SO_PEERCRED`)
//! before any region exists, and the region file is mode 0600. With the node's identity
//! ([`ShmServer::with_identity`], [`ShmTransport::with_identity`]) the socket runs mutual TLS,
//! and a reservation is bound to the chosen prefill node's certificate as over QUIC; the
//! payloads themselves never leave the user's memory, so they are not encrypted. Without one
//! (`--insecure`), like TCP, a reservation's binding is not checked (SECURITY.md).
//!
//! A peer that rewrites a slot after its check can only change its own frame's payload, in the
//! blocks its header names ([`region`] says why that is no more than it could send anyway).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

mod region;

use bytes::Bytes;
use identity::TlsIdentity;
use memmap2::{Mmap, MmapMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::accept::{accept_loop, Accepted};
use crate::error::KvTransferError;
use crate::frame::{FrameHeader, FrameLimits};
use crate::header::LayerHeader;
use crate::registry::{PeerKey, TransferRegistry};
use crate::shm_auth::{check_peer_user, ClientAuth, ServerAuth, Socket};
use crate::sink::KvSink;
use crate::slots::{Slots, SLOTS};
use crate::stream_io;
use crate::transport::{
    receive_frame, EarlyRefusal, Handled, KvConnection, KvServer, KvTransport, ReceiveCtx,
    RefusalObserver, TransferStat,
};
use crate::verdict::{Verdict, ACK_LEN};
use region::copy_in;

/// What a shared-memory endpoint starts with: `unix:` and the socket's path.
pub const SHM_SCHEME: &str = "unix:";
/// Version 2: a region of [`SLOTS`] slots, and each verdict names the next frame's slot.
const HELLO_MAGIC: [u8; 4] = *b"FKS2";
/// Magic, region size (u64 LE), name length (u16 LE).
const HELLO_LEN: usize = 14;
/// A verdict and the slot of the next frame.
const ANSWER_LEN: usize = ACK_LEN + 1;
const MAX_REGION_NAME: usize = 255;

#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Server: where the socket and the regions are created; on tmpfs, so the regions are
    /// memory. `/dev/shm` where it exists, else the temporary directory.
    pub dir: PathBuf,
    /// Client: most connections per endpoint, so most layers in flight to one node.
    pub connections_per_endpoint: usize,
    pub connect_timeout_ms: u64,
    /// Server: connections served at once.
    pub max_connections: usize,
    /// The largest payload a frame may carry is also the size of each of a region's slots:
    /// a region is a sparse file, so only the pages the largest layers touched take memory.
    pub limits: FrameLimits,
    /// Client with an identity: the name the receiver's certificate must carry, as QUIC's
    /// `server_name`; `localhost` when unset (and [`ShmTransport::connect_as`] names another).
    pub server_name: Option<String>,
}

impl Default for ShmConfig {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        Self {
            dir: if shm.is_dir() {
                shm.to_owned()
            } else {
                std::env::temp_dir()
            },
            connections_per_endpoint: 8,
            connect_timeout_ms: 5_000,
            max_connections: 1024,
            limits: FrameLimits::default(),
            server_name: None,
        }
    }
}

fn io<'a>(
    endpoint: &'a str,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> KvTransferError + 'a {
    move |source| stream_io::io_error(endpoint, what, source)
}

/// Files this process created, numbered apart.
fn unique_name(prefix: &str, suffix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // The process's start time besides its pid: a file left by a killed process whose pid is
    // reused would otherwise make bind (or create_new) fail with "already in use".
    static STARTED: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let started = STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    });
    format!(
        "{prefix}-{}-{started:x}-{}{suffix}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes the socket file when the server goes.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Receives layers through shared memory.
pub struct ShmServer {
    listener: UnixListener,
    socket: SocketFile,
    config: ShmConfig,
    auth: Option<ServerAuth>,
    on_refusal: Option<RefusalObserver>,
}

impl ShmServer {
    /// Listens on a new socket in `config.dir`.
    pub fn bind(config: ShmConfig) -> Result<Self, KvTransferError> {
        let path = config.dir.join(unique_name("fission-kv", ".sock"));
        let listener = UnixListener::bind(&path).map_err(|source| KvTransferError::Bind {
            addr: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            listener,
            socket: SocketFile(path),
            config,
            auth: None,
            on_refusal: None,
        })
    }

    /// Runs mutual TLS on every connection's socket with `tls`: only a prefill certificate is
    /// admitted, and reservations bind to it ([`crate::shm_auth`]).
    pub fn with_identity(mut self, tls: &TlsIdentity) -> Result<Self, KvTransferError> {
        self.auth = Some(ServerAuth::new(tls)?);
        Ok(self)
    }

    /// The endpoint senders connect to: `unix:` and the socket's path.
    pub fn endpoint(&self) -> String {
        format!("{SHM_SCHEME}{}", self.socket.0.display())
    }
}

impl KvServer for ShmServer {
    fn local_addr(&self) -> Result<std::net::SocketAddr, KvTransferError> {
        Err(KvTransferError::Config {
            field: "local_addr",
            reason: format!(
                "the shm server listens on a Unix socket, {}",
                self.endpoint()
            ),
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
        let endpoint = self.endpoint();
        tracing::info!(%endpoint, "kv shm server listening");
        let ctx = ReceiveCtx::new(registry, sink, self.config.limits, self.on_refusal);
        let listener = &self.listener;
        let auth = self.auth;
        let config = Arc::new(self.config);
        accept_loop(
            config.max_connections,
            &shutdown,
            || async {
                match listener.accept().await {
                    Ok((stream, _)) => Accepted::Connection(stream),
                    Err(e) => {
                        tracing::warn!(error = %e, "kv shm accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Accepted::Retry
                    }
                }
            },
            |stream, shutdown| {
                run_connection(stream, ctx.clone(), config.clone(), auth.clone(), shutdown)
            },
        )
        .await;
        drop(self.socket);
        tracing::info!(%endpoint, "kv shm server stopped");
        Ok(())
    }
}

/// The receiving end of one connection: the peer's user, and with an identity its
/// certificate, are checked before any region exists.
async fn run_connection<S: KvSink>(
    stream: UnixStream,
    ctx: Arc<ReceiveCtx<S>>,
    config: Arc<ShmConfig>,
    auth: Option<ServerAuth>,
    shutdown: CancellationToken,
) {
    let peer = match check_peer_user(&stream, "shm") {
        Ok(pid) => format!("shm pid {pid}"),
        Err(e) => {
            tracing::warn!(error = %e, "kv shm peer refused");
            ctx.refused(&e);
            return;
        }
    };
    let (mut stream, peer_key): (Socket, Option<PeerKey>) = match auth {
        None => (Box::new(stream), None),
        Some(auth) => {
            let timeout = Duration::from_millis(config.connect_timeout_ms);
            match tokio::time::timeout(timeout, auth.accept(stream, &peer)).await {
                Ok(Ok((socket, key))) => (socket, Some(key)),
                Ok(Err(e)) => {
                    tracing::warn!(%peer, error = %e, "kv shm handshake failed");
                    ctx.refused(&e);
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, "kv shm handshake timed out");
                    return;
                }
            }
        }
    };
    let slots = match offer_region(&mut stream, &config, &peer).await {
        Ok(slots) => slots,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "kv shm region not set up");
            return;
        }
    };
    let mut scratch = Vec::new();
    loop {
        let handled = tokio::select! {
            _ = shutdown.cancelled() => break,
            handled = receive_frame(&mut stream, &ctx, &mut scratch, EarlyRefusal::Source(&slots), &peer, peer_key.as_ref()) => handled,
        };
        let (verdict, keep_going) = match handled {
            Handled::Eof => break,
            Handled::Answer(v) => (v, true),
            Handled::Refused(v) | Handled::Fatal(v) => (v, false),
        };
        let mut answer = [0u8; ANSWER_LEN];
        answer[..ACK_LEN].copy_from_slice(&verdict.encode());
        answer[ACK_LEN] = slots.next_slot();
        if let Err(e) = stream_io::write_frame(&mut stream, &answer, &[], &peer).await {
            tracing::debug!(%peer, error = %e, "kv shm verdict not sent");
            break;
        }
        if !keep_going {
            break;
        }
    }
}

/// Creates the connection's region, names it to the peer, and unlinks it once the peer has
/// mapped it. Hello: magic, region size (u64 LE: [`SLOTS`] slots), name length (u16 LE), name.
/// The first frame goes to slot 0.
async fn offer_region(
    stream: &mut Socket,
    config: &ShmConfig,
    peer: &str,
) -> Result<Slots, KvTransferError> {
    let name = unique_name("fission-kv-region", "");
    let path = config.dir.join(&name);
    let slot_bytes = config.limits.max_payload_bytes;
    let size = slot_bytes
        .checked_mul(SLOTS as u64)
        .filter(|&s| usize::try_from(s).is_ok())
        .ok_or_else(|| KvTransferError::Config {
            field: "max_payload_bytes",
            reason: format!("{SLOTS} slots of {slot_bytes} bytes do not fit in memory"),
        })?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|source| KvTransferError::File {
            path: path.display().to_string(),
            source,
        })?;
    let _unlink = SocketFile(path.clone());
    file.set_len(size).map_err(io(peer, "size region"))?;
    // SAFETY: the file is private to this user and unlinked below; the peer may write it
    // while it is mapped, which can change only its own frames' payloads (`region`).
    let region = unsafe { Mmap::map(&file) }.map_err(io(peer, "map region"))?;
    let mut hello = Vec::with_capacity(HELLO_LEN + name.len());
    hello.extend_from_slice(&HELLO_MAGIC);
    hello.extend_from_slice(&size.to_le_bytes());
    hello.extend_from_slice(&(name.len() as u16).to_le_bytes());
    hello.extend_from_slice(name.as_bytes());
    stream
        .write_all(&hello)
        .await
        .map_err(io(peer, "send region"))?;
    stream.flush().await.map_err(io(peer, "send region"))?;
    let mut ack = [0u8; 1];
    stream
        .read_exact(&mut ack)
        .await
        .map_err(io(peer, "region mapped"))?;
    Ok(Slots::new(Arc::new(region), slot_bytes as usize))
}

/// Sends layers through shared memory, with a pool of connections per endpoint.
pub struct ShmTransport {
    config: ShmConfig,
    auth: Option<ClientAuth>,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
}

impl ShmTransport {
    pub fn new(config: ShmConfig) -> Self {
        Self {
            config,
            auth: None,
            pools: Mutex::new(HashMap::new()),
        }
    }

    /// Runs mutual TLS on every connection's socket with `tls` ([`crate::shm_auth`]).
    pub fn with_identity(mut self, tls: &TlsIdentity) -> Result<Self, KvTransferError> {
        self.auth = Some(ClientAuth::new(tls)?);
        Ok(self)
    }

    /// As [`KvTransport::connect`], checking the receiver's certificate by `server_name` (the
    /// host of its network endpoint, as QUIC checks it) when `config.server_name` is unset.
    pub async fn connect_as(
        &self,
        endpoint: &str,
        server_name: &str,
    ) -> Result<ShmConnection, KvTransferError> {
        let server_name = self.config.server_name.as_deref().unwrap_or(server_name);
        let existing = self
            .pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
            .cloned();
        let pool = match existing {
            Some(pool) => pool,
            None => {
                let socket = endpoint
                    .strip_prefix(SHM_SCHEME)
                    .filter(|p| p.starts_with('/'))
                    .ok_or_else(|| KvTransferError::InvalidEndpoint {
                        endpoint: endpoint.to_owned(),
                        reason: format!(
                            "the shm transport takes {SHM_SCHEME}/path/of/socket; is the peer on this host?"
                        ),
                    })?;
                let pool = Arc::new(Pool {
                    endpoint: endpoint.into(),
                    socket: PathBuf::from(socket),
                    connect_timeout: Duration::from_millis(self.config.connect_timeout_ms),
                    auth: self.auth.clone(),
                    server_name: server_name.to_owned(),
                    idle: Mutex::new(Vec::new()),
                    permits: Arc::new(Semaphore::new(self.config.connections_per_endpoint.max(1))),
                });
                // Dial once now so an unreachable endpoint fails here, not on the first layer.
                let link = pool.dial().await?;
                pool.put_back(link);
                self.pools
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(endpoint.to_owned())
                    .or_insert(pool)
                    .clone()
            }
        };
        Ok(ShmConnection {
            pool,
            limits: self.config.limits,
        })
    }
}

impl Default for ShmTransport {
    fn default() -> Self {
        Self::new(ShmConfig::default())
    }
}

impl KvTransport for ShmTransport {
    type Connection = ShmConnection;

    async fn connect(&self, endpoint: &str) -> Result<ShmConnection, KvTransferError> {
        self.connect_as(endpoint, "localhost").await
    }
}

/// One connection and the region its receiver made for it.
struct Link {
    stream: Socket,
    region: MmapMut,
    slot_bytes: usize,
    slots: usize,
    /// Where the next frame goes, as the last verdict said.
    slot: usize,
    _file: File,
}

impl Link {
    /// The next frame's slot, `len` bytes of it.
    fn slot_mut(&mut self, len: usize, endpoint: &str) -> Result<&mut [u8], KvTransferError> {
        let (slot_bytes, off) = (self.slot_bytes, self.slot * self.slot_bytes);
        self.region
            .get_mut(off..)
            .and_then(|r| r.get_mut(..len))
            .filter(|_| len <= slot_bytes)
            .ok_or_else(|| KvTransferError::Stream {
                endpoint: endpoint.to_owned(),
                what: "write region",
                reason: format!("{len} bytes do not fit a slot of {slot_bytes}"),
            })
    }
}

struct Pool {
    endpoint: Arc<str>,
    socket: PathBuf,
    connect_timeout: Duration,
    auth: Option<ClientAuth>,
    server_name: String,
    idle: Mutex<Vec<Link>>,
    permits: Arc<Semaphore>,
}

impl Pool {
    async fn dial(&self) -> Result<Link, KvTransferError> {
        let endpoint = &*self.endpoint;
        let connect_err = |reason: String| KvTransferError::Connect {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let handshake = async {
            let stream = UnixStream::connect(&self.socket)
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            // The listener's user, from the kernel: a socket another user bound is refused
            // before any KV is written.
            check_peer_user(&stream, endpoint)?;
            let mut stream: Socket = match &self.auth {
                None => Box::new(stream),
                Some(auth) => auth.connect(stream, &self.server_name, endpoint).await?,
            };
            let mut head = [0u8; HELLO_LEN];
            stream
                .read_exact(&mut head)
                .await
                .map_err(io(endpoint, "read region"))?;
            if head[..4] != HELLO_MAGIC {
                return Err(connect_err(format!(
                    "not a fission shm server of this version: {:02x?}",
                    &head[..4]
                )));
            }
            let size = u64::from_le_bytes(head[4..12].try_into().unwrap_or_default());
            let slots = SLOTS as u64;
            if size % slots != 0 || usize::try_from(size).is_err() {
                return Err(connect_err(format!("a region of {size} bytes")));
            }
            let slot_bytes = size / slots;
            let name_len = usize::from(u16::from_le_bytes([head[12], head[13]]));
            if name_len > MAX_REGION_NAME {
                return Err(connect_err(format!("region name of {name_len} bytes")));
            }
            let mut name = vec![0u8; name_len];
            stream
                .read_exact(&mut name)
                .await
                .map_err(io(endpoint, "read region"))?;
            let name = String::from_utf8(name)
                .ok()
                .filter(|n| !n.is_empty() && !n.contains('/') && n != "..")
                .ok_or_else(|| connect_err("invalid region name".into()))?;
            // The region lives next to the socket, in the server's directory.
            let dir = self.socket.parent().unwrap_or(Path::new("/"));
            let path = dir.join(name);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|source| KvTransferError::File {
                    path: path.display().to_string(),
                    source,
                })?;
            let len = file.metadata().map_err(io(endpoint, "region size"))?.len();
            if len != size {
                return Err(connect_err(format!(
                    "region is {len} bytes, the server said {size}"
                )));
            }
            // SAFETY: a shared mapping of the receiver's region; only this connection writes
            // it, and only the slot the last verdict named, which the receiver neither reads
            // nor lends out until the next header arrives.
            let region = unsafe { MmapMut::map_mut(&file) }.map_err(io(endpoint, "map region"))?;
            stream
                .write_all(&[1])
                .await
                .map_err(io(endpoint, "region mapped"))?;
            stream
                .flush()
                .await
                .map_err(io(endpoint, "region mapped"))?;
            Ok(Link {
                stream,
                region,
                slot_bytes: slot_bytes as usize,
                slots: slots as usize,
                slot: 0,
                _file: file,
            })
        };
        tokio::time::timeout(self.connect_timeout, handshake)
            .await
            .map_err(|_| {
                connect_err(format!(
                    "no answer within connect_timeout_ms {}",
                    self.connect_timeout.as_millis()
                ))
            })?
    }

    fn take_idle(&self) -> Option<Link> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn put_back(&self, link: Link) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(link);
    }
}

/// A pool of shared-memory connections to one decode node.
#[derive(Clone)]
pub struct ShmConnection {
    pool: Arc<Pool>,
    limits: FrameLimits,
}

impl std::fmt::Debug for ShmConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmConnection")
            .field("endpoint", &self.pool.endpoint)
            .finish_non_exhaustive()
    }
}

/// Whether the server keeps the connection after answering with `verdict`.
fn link_survives(verdict: Verdict) -> bool {
    !matches!(
        verdict,
        Verdict::Malformed | Verdict::TooLarge | Verdict::LayoutMismatch | Verdict::ShuttingDown
    )
}

/// What a frame's header is when its payload goes into the slot.
enum Outgoing<'a> {
    /// Encoded by the caller's checksum ([`KvConnection::send_frame`]).
    Framed(&'a [u8]),
    /// Checksummed while copied into the slot ([`KvConnection::send_layer`]).
    Layer(&'a LayerHeader),
}

impl ShmConnection {
    /// One frame on one link: payload into the slot, header on the socket, read the verdict
    /// and the next frame's slot. Returns the verdict and the header's length.
    async fn exchange(
        &self,
        link: &mut Link,
        frame: &Outgoing<'_>,
        payload: &[u8],
    ) -> Result<(Verdict, usize), KvTransferError> {
        let endpoint = &*self.pool.endpoint;
        let dst = link.slot_mut(payload.len(), endpoint)?;
        let computed;
        let header = match frame {
            Outgoing::Framed(header) => {
                dst.copy_from_slice(payload);
                *header
            }
            Outgoing::Layer(layer) => {
                let crc = copy_in(dst, payload);
                computed = FrameHeader {
                    header: (*layer).clone(),
                    payload_len: payload.len() as u64,
                    payload_crc32c: crc,
                }
                .encode(&self.limits)?;
                &computed[..]
            }
        };
        stream_io::write_frame(&mut link.stream, header, &[], endpoint).await?;
        let mut answer = [0u8; ANSWER_LEN];
        link.stream
            .read_exact(&mut answer)
            .await
            .map_err(io(endpoint, "read verdict"))?;
        let malformed = || KvTransferError::Stream {
            endpoint: endpoint.to_owned(),
            what: "read verdict",
            reason: format!("malformed verdict {answer:02x?}"),
        };
        let mut ack = [0u8; ACK_LEN];
        ack.copy_from_slice(&answer[..ACK_LEN]);
        let verdict = Verdict::decode(ack).ok_or_else(malformed)?;
        let slot = usize::from(answer[ACK_LEN]);
        if slot >= link.slots {
            return Err(malformed());
        }
        link.slot = slot;
        Ok((verdict, header.len()))
    }

    async fn send_inner(
        &self,
        frame: Outgoing<'_>,
        layer: u32,
        xfer_id: kv_types::TransferId,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let start = Instant::now();
        let _permit = self
            .pool
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| KvTransferError::Stream {
                endpoint: self.pool.endpoint.to_string(),
                what: "connection pool",
                reason: e.to_string(),
            })?;
        let (verdict, header_len) = match self.pool.take_idle() {
            Some(mut link) => match self.exchange(&mut link, &frame, &payload).await {
                Ok((v, len)) => {
                    if link_survives(v) {
                        self.pool.put_back(link);
                    }
                    (v, len)
                }
                // A pooled link the server has since closed: retry once on a fresh one.
                Err(e) => {
                    tracing::debug!(error = %e, "kv shm pooled link failed, redialling");
                    self.exchange_fresh(&frame, &payload).await?
                }
            },
            None => self.exchange_fresh(&frame, &payload).await?,
        };
        if verdict != Verdict::Accepted {
            return Err(KvTransferError::Rejected {
                xfer_id,
                layer,
                endpoint: self.pool.endpoint.to_string(),
                verdict,
            });
        }
        Ok(TransferStat {
            layer,
            payload_bytes: payload.len() as u64,
            frame_bytes: (header_len + payload.len()) as u64,
            elapsed: start.elapsed(),
        })
    }

    async fn exchange_fresh(
        &self,
        frame: &Outgoing<'_>,
        payload: &[u8],
    ) -> Result<(Verdict, usize), KvTransferError> {
        let mut link = self.pool.dial().await?;
        let (verdict, len) = self.exchange(&mut link, frame, payload).await?;
        if link_survives(verdict) {
            self.pool.put_back(link);
        }
        Ok((verdict, len))
    }
}

fn send_span(h: &LayerHeader, payload: &Bytes, endpoint: &str) -> tracing::Span {
    tracing::debug_span!(
        "kv_send_layer",
        xfer_id = h.xfer_id.0 as i64,
        epoch = h.epoch as i64,
        layer = i64::from(h.layer),
        payload_bytes = payload.len() as i64,
        endpoint = %endpoint,
    )
}

impl KvConnection for ShmConnection {
    fn endpoint(&self) -> &str {
        &self.pool.endpoint
    }

    async fn send_frame(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let span = send_span(&frame.header, &payload, &self.pool.endpoint);
        let (xfer_id, layer) = (frame.header.xfer_id, frame.header.layer);
        async {
            let header = frame.encode(&self.limits)?;
            self.send_inner(Outgoing::Framed(&header), layer, xfer_id, payload)
                .await
        }
        .instrument(span)
        .await
    }

    /// The checksum is computed while the payload is copied into the slot, not in a pass of
    /// its own before.
    async fn send_layer(
        &self,
        header: LayerHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let span = send_span(&header, &payload, &self.pool.endpoint);
        let (xfer_id, layer) = (header.xfer_id, header.layer);
        async {
            // The receiver's checks, on the sender, before anything is copied; the checksum
            // is filled in with the copy.
            FrameHeader {
                header: header.clone(),
                payload_len: payload.len() as u64,
                payload_crc32c: 0,
            }
            .encode(&self.limits)?;
            self.send_inner(Outgoing::Layer(&header), layer, xfer_id, payload)
                .await
        }
        .instrument(span)
        .await
    }
}
