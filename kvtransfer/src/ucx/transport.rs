//! The sending side: a pool of control connections per endpoint, each with a UCP endpoint to
//! the receiver's worker and the region it leased for that connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OnceCell, Semaphore};
use tracing::Instrument;

use super::command::WorkerOptions;
use super::server::HELLO_MAGIC;
use super::worker::{Endpoint, UcxWorker};
use super::UcxConfig;
use crate::error::KvTransferError;
use crate::frame::{FrameHeader, FrameLimits};
use crate::stream_io;
use crate::transport::{resolve, source_for, KvConnection, KvTransport, TransferStat};
use crate::verdict::{Verdict, ACK_LEN};

/// Largest worker address or packed key a hello may carry.
const MAX_HELLO_FIELD: usize = 64 << 10;

/// Sends layers as UCX tagged sends, with a pool of connections per endpoint.
pub struct UcxTransport {
    config: UcxConfig,
    worker: OnceCell<UcxWorker>,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
}

impl UcxTransport {
    /// The transport; its UCX worker starts on the first connect.
    pub fn new(config: UcxConfig) -> Self {
        Self {
            config,
            worker: OnceCell::new(),
            pools: Mutex::new(HashMap::new()),
        }
    }

    async fn worker(&self) -> Result<&UcxWorker, KvTransferError> {
        self.worker
            .get_or_try_init(|| async {
                let options = WorkerOptions {
                    transports: self.config.transports.clone(),
                };
                tokio::task::spawn_blocking(move || UcxWorker::spawn(options))
                    .await
                    .map_err(|e| KvTransferError::Config {
                        field: "kv_transport",
                        reason: format!("UCX worker set-up: {e}"),
                    })?
            })
            .await
    }
}

impl Default for UcxTransport {
    fn default() -> Self {
        Self::new(UcxConfig::default())
    }
}

impl KvTransport for UcxTransport {
    type Connection = UcxConnection;

    async fn connect(&self, endpoint: &str) -> Result<UcxConnection, KvTransferError> {
        let existing = self
            .pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
            .cloned();
        let pool = match existing {
            Some(pool) => pool,
            None => {
                let (addr, _) = resolve(endpoint).await?;
                let pool = Arc::new(Pool {
                    endpoint: endpoint.into(),
                    addr,
                    bind_ip: self.config.bind_ip,
                    connect_timeout: Duration::from_millis(self.config.connect_timeout_ms),
                    put_timeout: Duration::from_millis(self.config.put_timeout_ms),
                    worker: self.worker().await?.clone(),
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
        Ok(UcxConnection {
            pool,
            limits: self.config.limits,
        })
    }
}

/// One control connection, its UCP endpoint and the receiver's region for it.
struct Link {
    stream: TcpStream,
    ep: Endpoint,
    /// The tag of the receive the server posts on this connection's region.
    tag: u64,
    region_len: u64,
}

struct Pool {
    endpoint: Arc<str>,
    addr: SocketAddr,
    bind_ip: Option<std::net::IpAddr>,
    connect_timeout: Duration,
    put_timeout: Duration,
    worker: UcxWorker,
    idle: Mutex<Vec<Link>>,
    permits: Arc<Semaphore>,
}

async fn read_field(
    stream: &mut TcpStream,
    endpoint: &str,
    what: &'static str,
) -> Result<Vec<u8>, KvTransferError> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .await
        .map_err(|e| stream_io::io_error(endpoint, what, e))?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_HELLO_FIELD {
        return Err(KvTransferError::Connect {
            endpoint: endpoint.to_owned(),
            reason: format!("{what} of {len} bytes"),
        });
    }
    let mut field = vec![0u8; len];
    stream
        .read_exact(&mut field)
        .await
        .map_err(|e| stream_io::io_error(endpoint, what, e))?;
    Ok(field)
}

impl Pool {
    async fn dial(&self) -> Result<Link, KvTransferError> {
        let endpoint = &*self.endpoint;
        let connect_err = |reason: String| KvTransferError::Connect {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let handshake = async {
            let mut stream = match self
                .bind_ip
                .map(|ip| source_for(ip, self.addr.ip()))
                .filter(|ip| !ip.is_unspecified())
            {
                None => TcpStream::connect(self.addr).await,
                Some(ip) => {
                    let socket = if ip.is_ipv4() {
                        tokio::net::TcpSocket::new_v4()
                    } else {
                        tokio::net::TcpSocket::new_v6()
                    }
                    .map_err(|e| connect_err(e.to_string()))?;
                    socket
                        .bind(SocketAddr::new(ip, 0))
                        .map_err(|e| connect_err(e.to_string()))?;
                    socket.connect(self.addr).await
                }
            }
            .map_err(|e| connect_err(e.to_string()))?;
            stream
                .set_nodelay(true)
                .map_err(|e| stream_io::io_error(endpoint, "set_nodelay", e))?;
            // A server that refuses this peer closes without a word: the read fails here.
            let mut magic = [0u8; 4];
            stream
                .read_exact(&mut magic)
                .await
                .map_err(|e| connect_err(format!("refused before the hello (another user, or another host without insecure mode?): {e}")))?;
            if magic != HELLO_MAGIC {
                return Err(connect_err(format!(
                    "not a fission ucx server: {magic:02x?}"
                )));
            }
            let address = read_field(&mut stream, endpoint, "worker address").await?;
            let mut region = [0u8; 24];
            stream
                .read_exact(&mut region)
                .await
                .map_err(|e| stream_io::io_error(endpoint, "read region", e))?;
            // region[..8] is the region's address, which a tagged send does not need.
            let region_len = u64::from_le_bytes(region[8..16].try_into().unwrap_or_default());
            let tag = u64::from_le_bytes(region[16..].try_into().unwrap_or_default());
            let rkey = read_field(&mut stream, endpoint, "remote key").await?;
            let ep = self.worker.connect(address, rkey).await?;
            stream
                .write_all(&[1])
                .await
                .map_err(|e| stream_io::io_error(endpoint, "endpoint ready", e))?;
            Ok(Link {
                stream,
                ep,
                tag,
                region_len,
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

/// A pool of UCX connections to one decode node.
#[derive(Clone)]
pub struct UcxConnection {
    pool: Arc<Pool>,
    limits: FrameLimits,
}

impl std::fmt::Debug for UcxConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxConnection")
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

impl UcxConnection {
    /// One frame on one link: payload into the region, header on the socket, read the verdict.
    async fn exchange(
        &self,
        link: &mut Link,
        header: &[u8],
        payload: &Bytes,
    ) -> Result<Verdict, KvTransferError> {
        let endpoint = &*self.pool.endpoint;
        if payload.len() as u64 > link.region_len {
            return Err(KvTransferError::Stream {
                endpoint: endpoint.to_owned(),
                what: "write region",
                reason: format!(
                    "{} bytes do not fit a region of {}",
                    payload.len(),
                    link.region_len
                ),
            });
        }
        // Every frame sends its payload, an empty one too: the server waits for it before
        // it reads the header. The header follows at once, while UCX still moves the payload
        // (the server reads it only once the payload has landed), and the verdict is awaited
        // beside the send, so a failed send ends the exchange at once.
        let sent = link.ep.send(payload.clone(), link.tag)?.wait();
        let put_timeout = self.pool.put_timeout;
        let sent = async move {
            tokio::time::timeout(put_timeout, sent)
                .await
                .map_err(|_| KvTransferError::Stream {
                    endpoint: endpoint.to_owned(),
                    what: "ucx send",
                    reason: format!("not sent within put_timeout_ms {}", put_timeout.as_millis()),
                })?
        };
        tokio::pin!(sent);
        let answered = async {
            stream_io::write_frame(&mut link.stream, header, &[], endpoint).await?;
            let mut ack = [0u8; ACK_LEN];
            link.stream
                .read_exact(&mut ack)
                .await
                .map_err(|e| stream_io::io_error(endpoint, "read verdict", e))?;
            Ok::<_, KvTransferError>(ack)
        };
        tokio::pin!(answered);
        let mut sent_ok = false;
        let ack = loop {
            tokio::select! {
                result = &mut sent, if !sent_ok => {
                    result?;
                    sent_ok = true;
                }
                answered = &mut answered => break answered?,
            }
        };
        // A verdict means the payload landed; the send's own completion follows.
        if !sent_ok {
            sent.await?;
        }
        Verdict::decode(ack).ok_or_else(|| KvTransferError::Stream {
            endpoint: endpoint.to_owned(),
            what: "read verdict",
            reason: format!("malformed verdict {ack:02x?}"),
        })
    }

    async fn send_frame_inner(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let start = Instant::now();
        let (xfer_id, layer) = (frame.header.xfer_id, frame.header.layer);
        let header = frame.encode(&self.limits)?;
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
        let verdict = match self.pool.take_idle() {
            Some(mut link) => match self.exchange(&mut link, &header, &payload).await {
                Ok(v) => {
                    if link_survives(v) {
                        self.pool.put_back(link);
                    }
                    v
                }
                // A pooled link the server has since closed: retry once on a fresh one.
                Err(e) => {
                    tracing::debug!(error = %e, "kv ucx pooled link failed, redialling");
                    self.exchange_fresh(&header, &payload).await?
                }
            },
            None => self.exchange_fresh(&header, &payload).await?,
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
            frame_bytes: (header.len() + payload.len()) as u64,
            elapsed: start.elapsed(),
        })
    }

    async fn exchange_fresh(
        &self,
        header: &[u8],
        payload: &Bytes,
    ) -> Result<Verdict, KvTransferError> {
        let mut link = self.pool.dial().await?;
        let verdict = self.exchange(&mut link, header, payload).await?;
        if link_survives(verdict) {
            self.pool.put_back(link);
        }
        Ok(verdict)
    }
}

impl KvConnection for UcxConnection {
    fn endpoint(&self) -> &str {
        &self.pool.endpoint
    }

    async fn send_frame(
        &self,
        frame: FrameHeader,
        payload: Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        let h = &frame.header;
        let span = tracing::debug_span!(
            "kv_send_layer",
            xfer_id = h.xfer_id.0 as i64,
            epoch = h.epoch as i64,
            layer = i64::from(h.layer),
            payload_bytes = payload.len() as i64,
            endpoint = %self.pool.endpoint,
        );
        self.send_frame_inner(frame, payload).instrument(span).await
    }
}
