//! Loopback benchmark of a whole transfer (every layer sent at once) over each backend, next
//! to a raw TCP socket that writes the same bytes with no framing, checksum or verdicts.
//!
//! Backends run in turn within each repetition (rotating which goes first), so a noisy
//! machine disturbs them alike. The receiver's sink drops payloads, so the numbers are the
//! transport's; the raw baseline likewise reads into a fresh buffer and drops it.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use identity::{generate_dev_ca, PeerRole, TlsIdentity};
use kv_types::{KvLayout, TransferId};
use kvtransfer::{
    new_endpoint, quic_client_config, quic_server_config, DiscardSink, KvConnection, KvServer,
    KvTransferError, KvTransport, LayerHeader, QuicConfig, QuicConnection, QuicServer,
    QuicTransport, ShmConfig, ShmConnection, ShmServer, ShmTransport, TcpConfig, TcpConnection,
    TcpServer, TcpTransport, TransferRegistry, UcxConfig, UcxConnection, UcxServer, UcxTransport,
    LOOPBACK_MTU, MAX_GSO_MTU,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::loopback::{serve, streamed_transfer};

#[derive(Clone, Debug)]
pub enum BenchBackend {
    /// One TCP stream writing all layers back to back, no framing, checksum or verdicts.
    RawTcp,
    Tcp {
        connections: usize,
    },
    /// Shared memory through a Unix socket in /dev/shm.
    Shm {
        connections: usize,
    },
    /// UCX sends into registered memory, on the UCX transports named (`UCX_TLS`), or every one but shared memory.
    Ucx {
        transports: Option<String>,
        connections: usize,
    },
    Quic {
        label: String,
        config: QuicConfig,
    },
    /// quinn alone: one stream per layer, a one-byte answer, no framing, checksum, registry or
    /// copy on receipt. Separates quinn's cost from this crate's.
    RawQuic {
        config: QuicConfig,
    },
}

impl BenchBackend {
    pub fn label(&self) -> String {
        match self {
            Self::RawTcp => "raw tcp (baseline)".to_owned(),
            Self::Tcp { connections } => format!("tcp, {connections} conns"),
            Self::Shm { connections } => format!("shm, {connections} conns"),
            Self::Ucx {
                transports,
                connections,
            } => format!(
                "ucx over {}, {connections} conns",
                transports.as_deref().unwrap_or("its choice")
            ),
            Self::Quic { label, .. } => format!("quic, {label}"),
            Self::RawQuic { .. } => "raw quinn streams, tuned windows".to_owned(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The cache geometry; `layout.num_layers` layers per transfer.
    pub layout: KvLayout,
    pub prompt_tokens: Vec<usize>,
    /// Measured transfers per backend and prompt length.
    pub repetitions: usize,
    /// Unmeasured transfers first, per backend and prompt length.
    pub warmup: usize,
    pub backends: Vec<BenchBackend>,
}

impl Default for BenchConfig {
    /// SmolLM2-135M in f32 (30 layers, 3 KV heads of 64, 16-token blocks) at 128, 1K and 4K
    /// tokens; raw TCP, TCP, shared memory, UCX over its TCP transport, QUIC as the nodes run
    /// it (tuned windows, large datagrams on loopback) and with quinn's 1452-byte path MTU,
    /// and raw quinn streams.
    fn default() -> Self {
        Self {
            layout: KvLayout::SMOLLM2_135M_F32,
            prompt_tokens: vec![128, 1024, 4096],
            repetitions: 10,
            warmup: 2,
            backends: vec![
                BenchBackend::RawTcp,
                BenchBackend::Tcp { connections: 8 },
                BenchBackend::Shm { connections: 8 },
                BenchBackend::Ucx {
                    transports: Some("tcp".to_owned()),
                    connections: 8,
                },
                // The A/B of issue 34: the nodes' settings, and the same with quinn's
                // 1452-byte path MTU on loopback as before.
                BenchBackend::Quic {
                    label: "tuned windows, 1452-byte packets".to_owned(),
                    config: QuicConfig {
                        loopback_mtu: 0,
                        ..QuicConfig::default()
                    },
                },
                // The A/B of this session: 6,500-byte loopback datagrams as before, and
                // `LOOPBACK_MTU` (16,000) as the nodes now send.
                BenchBackend::Quic {
                    label: format!("tuned windows, {}-byte loopback packets", MAX_GSO_MTU),
                    config: QuicConfig {
                        loopback_mtu: MAX_GSO_MTU,
                        ..QuicConfig::default()
                    },
                },
                BenchBackend::Quic {
                    label: format!("tuned windows, {}-byte loopback packets", LOOPBACK_MTU),
                    config: QuicConfig::default(),
                },
                BenchBackend::RawQuic {
                    config: QuicConfig::default(),
                },
            ],
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub backend: String,
    pub prompt_tokens: usize,
    pub transfer_bytes: u64,
    pub median: Duration,
    pub p90: Duration,
    pub min: Duration,
    /// Decimal gigabytes per second at the median.
    pub gbps: f64,
    /// The process's CPU seconds per byte moved (median over the transfers), sender and
    /// receiver together: what a transfer takes from the steps on a host they share.
    pub cpu_s_per_byte: f64,
    /// Backend details seen during the run (QUIC: path MTU, packets lost).
    pub note: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BenchReport {
    pub layout: KvLayout,
    pub repetitions: usize,
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    fn baseline(&self, prompt_tokens: usize) -> Option<&BenchRow> {
        let raw = BenchBackend::RawTcp.label();
        self.rows
            .iter()
            .find(|r| r.prompt_tokens == prompt_tokens && r.backend == raw)
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.layout;
        writeln!(
            f,
            "KV transfer over loopback: {l}, {} B per token per layer, {} B per token; \
             median and p90 of {} transfers",
            l.token_bytes(),
            l.token_bytes() * u64::from(l.num_layers),
            self.repetitions,
        )?;
        writeln!(
            f,
            "| tokens | backend | MB per transfer | median ms | p90 ms | GB/s (median) | vs raw tcp | CPU ms per MB | notes |"
        )?;
        writeln!(f, "|---:|---|---:|---:|---:|---:|---:|---:|---|")?;
        for r in &self.rows {
            let ratio = self
                .baseline(r.prompt_tokens)
                .map(|b| format!("{:.2}x", r.gbps / b.gbps))
                .unwrap_or_else(|| "-".to_owned());
            writeln!(
                f,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.2} | {} |",
                r.prompt_tokens,
                r.backend,
                r.transfer_bytes as f64 / 1e6,
                r.median.as_secs_f64() * 1e3,
                r.p90.as_secs_f64() * 1e3,
                r.gbps,
                ratio,
                r.cpu_s_per_byte * 1e9,
                r.note,
            )?;
        }
        Ok(())
    }
}

/// One backend, set up and connected.
enum Runner {
    Raw(TcpStream),
    Tcp(TcpConnection),
    Shm(ShmConnection),
    Ucx(UcxConnection),
    Quic(QuicConnection, Arc<QuicTransport>),
    RawQuic(quinn::Connection, quinn::Endpoint),
}

/// Runs the benchmark inside the caller's tokio runtime.
pub async fn run_bench(cfg: BenchConfig) -> Result<BenchReport, KvTransferError> {
    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    let result = run_with_servers(&cfg, &shutdown, &mut servers).await;
    shutdown.cancel();
    while servers.join_next().await.is_some() {}
    result
}

async fn run_with_servers(
    cfg: &BenchConfig,
    shutdown: &CancellationToken,
    servers: &mut JoinSet<()>,
) -> Result<BenchReport, KvTransferError> {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let registry = TransferRegistry::default();
    let sink = Arc::new(DiscardSink::default());
    let ca = generate_dev_ca()?;
    let server_tls = TlsIdentity::dev(&ca, &ca.issue(PeerRole::Decode, "bench-decode")?)?;
    let client_tls = TlsIdentity::dev(&ca, &ca.issue(PeerRole::Prefill, "bench-prefill")?)?;

    let mut runners = Vec::new();
    for backend in &cfg.backends {
        let runner = match backend {
            BenchBackend::RawQuic { config } => {
                let transport = Arc::new(config.transport_config()?);
                let server = new_endpoint(
                    loopback,
                    config,
                    Some(quic_server_config(&server_tls, transport.clone())?),
                )?;
                let addr = server
                    .local_addr()
                    .map_err(|source| KvTransferError::Bind {
                        addr: loopback.to_string(),
                        source,
                    })?;
                let token = shutdown.clone();
                servers.spawn(async move {
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = run_raw_quic_server_task(server.clone()) => {}
                    }
                    server.close(quinn::VarInt::from_u32(0), b"done");
                });
                let mut client = new_endpoint(loopback, config, None)?;
                client.set_default_client_config(quic_client_config(&client_tls, transport)?);
                let endpoint = addr.to_string();
                let conn = client
                    .connect(addr, "localhost")
                    .map_err(|e| KvTransferError::Connect {
                        endpoint: endpoint.clone(),
                        reason: e.to_string(),
                    })?
                    .await
                    .map_err(|source| KvTransferError::Connection { endpoint, source })?;
                Runner::RawQuic(conn, client)
            }
            BenchBackend::RawTcp => {
                let listener =
                    TcpListener::bind(loopback)
                        .await
                        .map_err(|source| KvTransferError::Bind {
                            addr: loopback.to_string(),
                            source,
                        })?;
                let addr = listener
                    .local_addr()
                    .map_err(|source| KvTransferError::Bind {
                        addr: loopback.to_string(),
                        source,
                    })?;
                let token = shutdown.clone();
                servers.spawn(async move {
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = run_raw_server_task(listener) => {}
                    }
                });
                let stream = TcpStream::connect(addr)
                    .await
                    .map_err(|source| io_error("raw tcp", "connect", source))?;
                stream
                    .set_nodelay(true)
                    .map_err(|source| io_error("raw tcp", "set_nodelay", source))?;
                Runner::Raw(stream)
            }
            BenchBackend::Tcp { connections } => {
                let config = TcpConfig {
                    connections_per_endpoint: *connections,
                    ..TcpConfig::default()
                };
                let server = TcpServer::bind(loopback, config.clone()).await?;
                let endpoint = server.local_addr()?.to_string();
                servers.spawn(serve(
                    server,
                    registry.clone(),
                    sink.clone(),
                    shutdown.clone(),
                ));
                let transport = TcpTransport::new(config);
                Runner::Tcp(transport.connect(&endpoint).await?)
            }
            BenchBackend::Shm { connections } => {
                let config = ShmConfig {
                    connections_per_endpoint: *connections,
                    ..ShmConfig::default()
                };
                let server = ShmServer::bind(config.clone())?;
                let endpoint = server.endpoint();
                servers.spawn(serve(
                    server,
                    registry.clone(),
                    sink.clone(),
                    shutdown.clone(),
                ));
                Runner::Shm(ShmTransport::new(config).connect(&endpoint).await?)
            }
            BenchBackend::Ucx {
                transports,
                connections,
            } => {
                let config = UcxConfig {
                    connections_per_endpoint: *connections,
                    transports: transports.clone(),
                    ..UcxConfig::default()
                };
                let server = UcxServer::bind(loopback, config.clone()).await?;
                let endpoint = server.local_addr()?.to_string();
                servers.spawn(serve(
                    server,
                    registry.clone(),
                    sink.clone(),
                    shutdown.clone(),
                ));
                Runner::Ucx(UcxTransport::new(config).connect(&endpoint).await?)
            }
            BenchBackend::Quic { config, .. } => {
                let config = config.clone();
                let server = QuicServer::bind(loopback, &server_tls, config.clone())?;
                let endpoint = server.local_addr()?.to_string();
                servers.spawn(serve(
                    server,
                    registry.clone(),
                    sink.clone(),
                    shutdown.clone(),
                ));
                let transport = Arc::new(QuicTransport::new(&client_tls, config)?);
                let conn = transport.connect(&endpoint).await?;
                Runner::Quic(conn, transport)
            }
        };
        runners.push((backend.label(), runner));
    }

    let mut rows = Vec::new();
    let mut next_xfer_id = TransferId(1);
    for &tokens in &cfg.prompt_tokens {
        let num_blocks = tokens.div_ceil(cfg.layout.block_size as usize).max(1);
        let layer_bytes =
            cfg.layout
                .layer_payload_bytes(num_blocks)
                .ok_or_else(|| KvTransferError::Config {
                    field: "prompt_tokens",
                    reason: format!("{tokens} tokens overflow the payload size"),
                })?;
        let payloads: Vec<Bytes> = (0..cfg.layout.num_layers)
            .map(|layer| pseudo_random_bytes(layer_bytes as usize, u64::from(layer) + 1))
            .collect();
        let template = LayerHeader {
            xfer_id: TransferId(0),
            epoch: 1,
            layer: 0,
            layout: cfg.layout,
            block_ids: (0..num_blocks as u32).collect::<Vec<_>>().into(),
            traceparent: None,
        };
        let mut samples = vec![Vec::with_capacity(cfg.repetitions); runners.len()];
        let mut cpu_samples = vec![Vec::with_capacity(cfg.repetitions); runners.len()];
        let lost_before: Vec<u64> = runners.iter().map(|(_, r)| lost_packets(r)).collect();
        for rep in 0..cfg.warmup + cfg.repetitions {
            for k in 0..runners.len() {
                let i = (rep + k) % runners.len();
                let cpu_before = process_cpu_time();
                let elapsed = match &mut runners[i].1 {
                    Runner::Raw(stream) => raw_transfer(stream, &payloads).await?,
                    Runner::RawQuic(conn, _) => raw_quic_transfer(conn, &payloads).await?,
                    Runner::Tcp(conn) => {
                        framed_transfer(conn, &registry, &template, &payloads, next_xfer_id).await?
                    }
                    Runner::Shm(conn) => {
                        framed_transfer(conn, &registry, &template, &payloads, next_xfer_id).await?
                    }
                    Runner::Ucx(conn) => {
                        framed_transfer(conn, &registry, &template, &payloads, next_xfer_id).await?
                    }
                    Runner::Quic(conn, _) => {
                        framed_transfer(conn, &registry, &template, &payloads, next_xfer_id).await?
                    }
                };
                next_xfer_id.0 += 1;
                let cpu = process_cpu_time().saturating_sub(cpu_before);
                if rep >= cfg.warmup {
                    samples[i].push(elapsed);
                    cpu_samples[i].push(cpu);
                }
            }
        }
        let transfer_bytes = layer_bytes * u64::from(cfg.layout.num_layers);
        for ((((label, runner), mut s), mut cpu), lost_before) in runners
            .iter()
            .zip(samples)
            .zip(cpu_samples)
            .zip(lost_before)
        {
            s.sort();
            cpu.sort();
            let note = match runner {
                Runner::Quic(conn, _) => format!(
                    "path mtu {}, {} packets lost",
                    conn.stats().path.current_mtu,
                    lost_packets(runner) - lost_before
                ),
                Runner::RawQuic(conn, _) => format!(
                    "path mtu {}, {} packets lost",
                    conn.stats().path.current_mtu,
                    lost_packets(runner) - lost_before
                ),
                _ => String::new(),
            };
            let median = percentile(&s, 0.5);
            rows.push(BenchRow {
                backend: label.clone(),
                prompt_tokens: tokens,
                transfer_bytes,
                median,
                p90: percentile(&s, 0.9),
                min: s.first().copied().unwrap_or_default(),
                gbps: transfer_bytes as f64 / median.as_secs_f64().max(1e-9) / 1e9,
                cpu_s_per_byte: percentile(&cpu, 0.5).as_secs_f64() / transfer_bytes as f64,
                note,
            });
        }
    }
    for (_, runner) in &runners {
        match runner {
            Runner::Quic(_, transport) => transport.close(),
            Runner::RawQuic(_, client) => client.close(quinn::VarInt::from_u32(0), b"done"),
            _ => {}
        }
    }
    Ok(BenchReport {
        layout: cfg.layout,
        repetitions: cfg.repetitions,
        rows,
    })
}

/// An I/O failure of the raw TCP baseline, as the crate's transports report theirs.
fn io_error(peer: &str, what: &'static str, source: std::io::Error) -> KvTransferError {
    KvTransferError::Io {
        endpoint: peer.to_owned(),
        what,
        source,
    }
}

/// CPU time this process has used, every thread's, user and system (the scheduler's own
/// count, to the nanosecond; getrusage may count in ticks).
fn process_cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the struct it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Registers a reservation, sends every layer at once, and times it until the last verdict.
async fn framed_transfer<C: KvConnection>(
    conn: &C,
    registry: &TransferRegistry,
    template: &LayerHeader,
    payloads: &[Bytes],
    xfer_id: TransferId,
) -> Result<Duration, KvTransferError> {
    let header = LayerHeader {
        xfer_id,
        ..template.clone()
    };
    // Every layer ready at once: the layer-by-layer push with nothing to wait for.
    let (tx, layers) = tokio::sync::mpsc::unbounded_channel();
    for (layer, payload) in payloads.iter().enumerate() {
        let _ = tx.send((layer as u32, payload.clone()));
    }
    drop(tx);
    streamed_transfer(conn, registry, header, layers).await
}

/// Writes the layer count and size, then every layer back to back; the receiver reads each
/// layer into its own buffer, as the framed receivers do, and answers one byte.
async fn raw_transfer(
    stream: &mut TcpStream,
    payloads: &[Bytes],
) -> Result<Duration, KvTransferError> {
    let layer_bytes = payloads.first().map_or(0, |p| p.len() as u64);
    let mut prefix = [0u8; 16];
    prefix[..8].copy_from_slice(&(payloads.len() as u64).to_le_bytes());
    prefix[8..].copy_from_slice(&layer_bytes.to_le_bytes());
    let io = |what| move |source| io_error("raw tcp", what, source);
    let start = Instant::now();
    stream.write_all(&prefix).await.map_err(io("write"))?;
    for p in payloads {
        stream.write_all(p).await.map_err(io("write"))?;
    }
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).await.map_err(io("read ack"))?;
    Ok(start.elapsed())
}

async fn run_raw_server_task(listener: TcpListener) {
    let mut conns = JoinSet::new();
    while let Ok((mut stream, _)) = listener.accept().await {
        conns.spawn(async move {
            let _ = stream.set_nodelay(true);
            let mut prefix = [0u8; 16];
            while stream.read_exact(&mut prefix).await.is_ok() {
                let mut word = [0u8; 8];
                word.copy_from_slice(&prefix[..8]);
                let num_layers = u64::from_le_bytes(word);
                word.copy_from_slice(&prefix[8..]);
                let layer_bytes = u64::from_le_bytes(word) as usize;
                for _ in 0..num_layers {
                    let mut buf = BytesMut::with_capacity(layer_bytes);
                    while buf.len() < layer_bytes {
                        let want = layer_bytes - buf.len();
                        match stream.read_buf(&mut (&mut buf).limit(want)).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                    drop(buf.freeze());
                }
                if stream.write_all(&[1]).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Every layer on its own stream at once; each answered with one byte once fully read.
async fn raw_quic_transfer(
    conn: &quinn::Connection,
    payloads: &[Bytes],
) -> Result<Duration, KvTransferError> {
    let fail = |what, e: String| KvTransferError::Stream {
        endpoint: "raw quic".to_owned(),
        what,
        reason: e,
    };
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for payload in payloads {
        let (conn, payload) = (conn.clone(), payload.clone());
        tasks.spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_chunk(payload).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            let mut ack = [0u8; 1];
            recv.read_exact(&mut ack).await.map_err(|e| e.to_string())
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined
            .map_err(|e| fail("join", e.to_string()))?
            .map_err(|e| fail("stream", e))?;
    }
    Ok(start.elapsed())
}

async fn run_raw_quic_server_task(endpoint: quinn::Endpoint) {
    let mut conns = JoinSet::new();
    while let Some(incoming) = endpoint.accept().await {
        conns.spawn(async move {
            let Ok(conn) = incoming.await else { return };
            let mut streams = JoinSet::new();
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                streams.spawn(async move {
                    while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
                        drop(chunk);
                    }
                    if send.write_all(&[1]).await.is_ok() {
                        let _ = send.finish();
                    }
                });
                while streams.try_join_next().is_some() {}
            }
        });
    }
}

fn lost_packets(runner: &Runner) -> u64 {
    match runner {
        Runner::Quic(conn, _) => conn.lost_packets(),
        Runner::RawQuic(conn, _) => conn.stats().path.lost_packets,
        _ => 0,
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Incompressible filler (xorshift64*), so nothing on the path can shortcut zeros.
fn pseudo_random_bytes(len: usize, seed: u64) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_picks_ranks() {
        let s: Vec<Duration> = (1..=10).map(Duration::from_millis).collect();
        assert_eq!(percentile(&s, 0.5), Duration::from_millis(5));
        assert_eq!(percentile(&s, 0.9), Duration::from_millis(9));
        assert_eq!(percentile(&[], 0.9), Duration::ZERO);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiny_bench_runs_every_backend() {
        let mut cfg = BenchConfig {
            prompt_tokens: vec![32],
            repetitions: 2,
            warmup: 0,
            layout: KvLayout {
                num_layers: 4,
                ..KvLayout::SMOLLM2_135M_F32
            },
            ..BenchConfig::default()
        };
        cfg.backends.push(BenchBackend::Quic {
            label: "send fairness on".to_owned(),
            config: QuicConfig {
                send_fairness: true,
                ..QuicConfig::default()
            },
        });
        let report = run_bench(cfg).await.unwrap();
        // The default backends (shared memory and UCX among them) and the QUIC row added above.
        assert_eq!(report.rows.len(), 9);
        let table = report.to_string();
        assert!(table.contains("raw tcp (baseline)"), "{table}");
        assert!(table.contains("shm, 8 conns"), "{table}");
        assert!(table.contains("ucx over tcp, 8 conns"), "{table}");
        assert!(table.contains("1.00x"), "{table}");
        // Moving bytes costs CPU: a figure of zero would mean the clock was not read.
        for r in &report.rows {
            assert!(r.cpu_s_per_byte > 0.0, "{r:?}");
        }
    }
}
