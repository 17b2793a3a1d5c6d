//! Pushes one prompt's layers to a decode node as the engine finishes them, then tells the
//! decode node (Done) with the first token and the per-layer checksums.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvtransfer::{
    FrameHeader, KvConnection, KvTransferError, KvTransport, LayerHeader, QuicConnection,
    QuicTransport, TcpConnection, TcpTransport, TransferStat,
};
use proto::v1::decode_client::DecodeClient;
use proto::v1::{self, KvDestination};
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tonic::transport::Channel;
use tracing::Instrument;

use crate::actor::LayerPayload;

/// The configured data-plane backend.
pub enum Transport {
    Quic(QuicTransport),
    Tcp(TcpTransport),
}

#[derive(Clone)]
enum Conn {
    Quic(QuicConnection),
    Tcp(TcpConnection),
}

impl Conn {
    async fn send(
        &self,
        frame: FrameHeader,
        payload: bytes::Bytes,
    ) -> Result<TransferStat, KvTransferError> {
        match self {
            Conn::Quic(c) => c.send_frame(frame, payload).await,
            Conn::Tcp(c) => c.send_frame(frame, payload).await,
        }
    }
}

impl Transport {
    async fn connect(&self, endpoint: &str) -> Result<Conn, KvTransferError> {
        Ok(match self {
            Transport::Quic(t) => Conn::Quic(t.connect(endpoint).await?),
            Transport::Tcp(t) => Conn::Tcp(t.connect(endpoint).await?),
        })
    }
}

/// Runs `fut` on a task of its own, where no span is current. Connections made there (QUIC
/// dials, gRPC channels) spawn driver tasks that take the current span as their parent and
/// live as long as the pooled connection; made inside `kv_transfer`, they would hold that span,
/// and the request's whole trace, open forever. (Entering `Span::none()` does not help: it
/// leaves the current span as it was.)
async fn outside_span<F, T>(fut: F) -> Result<T, String>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(fut).await.map_err(|e| e.to_string())
}

/// gRPC clients of decode nodes, one per endpoint.
#[derive(Default, Clone)]
pub struct DecodeClients {
    clients: Arc<Mutex<HashMap<String, DecodeClient<Channel>>>>,
}

impl DecodeClients {
    pub async fn get(
        &self,
        endpoint: &str,
    ) -> Result<DecodeClient<Channel>, tonic::transport::Error> {
        if let Some(c) = self
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
        {
            return Ok(c.clone());
        }
        let channel = Channel::from_shared(format!("http://{endpoint}"))
            .expect("endpoints are host:port")
            .connect()
            .await?;
        let client = DecodeClient::new(channel);
        self.clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(endpoint.to_string(), client.clone());
        Ok(client)
    }
}

/// What one push achieved, for metrics and the overlap report.
pub struct PushReport {
    pub kv_bytes: u64,
    /// From the last layer's compute to the decode node acknowledging the last layer.
    pub tail: Duration,
}

/// Why a push failed.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error(transparent)]
    Kv(#[from] KvTransferError),
    #[error("cannot reach decode node {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("decode node {endpoint} rejected done for xfer {xfer_id}: {status}")]
    Done {
        endpoint: String,
        xfer_id: u64,
        status: tonic::Status,
    },
    #[error("the engine produced {received} of {num_layers} layers")]
    MissingLayers { received: u32, num_layers: u32 },
    /// The prompt's prefill failed or was cancelled; its RPC reports why.
    #[error("the prefill ended without a first token")]
    PrefillEnded,
    #[error("push task failed: {0}")]
    Task(String),
}

impl PushError {
    pub fn code(&self) -> ErrorCode {
        match self {
            PushError::Kv(_) => ErrorCode::KvTransfer,
            PushError::Connect { .. } => ErrorCode::Unavailable,
            PushError::Done { status, .. } => ErrorCode::from_grpc(status.code()),
            PushError::PrefillEnded => ErrorCode::Cancelled,
            PushError::MissingLayers { .. } | PushError::Task(_) => ErrorCode::Internal,
        }
    }
}

/// One transfer to push: where, what layout, and for which request.
pub struct PushJob {
    pub transport: Arc<Transport>,
    pub clients: DecodeClients,
    pub dest: KvDestination,
    pub num_layers: u32,
    pub layout: kvtransfer::KvLayout,
    pub num_tokens: u32,
    pub request_id: String,
}

/// Runs the push of one transfer inside its `kv_transfer` span: sends each layer as it
/// arrives on `layers_rx`, then Done with the first token from `first_rx`. On failure it marks
/// the span failed, counts the failure and cancels the decode reservation.
pub async fn run_push_task(
    job: PushJob,
    layers_rx: mpsc::UnboundedReceiver<LayerPayload>,
    first_rx: oneshot::Receiver<v1::Token>,
) -> Result<PushReport, PushError> {
    let started = Instant::now();
    let result = push(&job, layers_rx, first_rx).await;
    let span = tracing::Span::current();
    match &result {
        Ok(r) => {
            let took = started.elapsed().as_secs_f64();
            metrics::counter!("fission_prefill_kv_transfer_bytes_total").increment(r.kv_bytes);
            metrics::counter!("fission_prefill_kv_transfers_total").increment(1);
            metrics::histogram!("fission_prefill_kv_transfer_duration_seconds").record(took);
            metrics::histogram!("fission_prefill_kv_transfer_tail_seconds")
                .record(r.tail.as_secs_f64());
            // Over the whole transfer, which overlaps the prompt's compute: a lower bound on
            // what the link could carry.
            metrics::histogram!("fission_prefill_kv_transfer_bytes_per_second")
                .record(r.kv_bytes as f64 / took.max(1e-6));
            span.record("bytes", r.kv_bytes as i64);
            span.record("tail_ms", r.tail.as_secs_f64() * 1e3);
        }
        Err(e) => {
            metrics::counter!("fission_prefill_kv_transfer_failures_total").increment(1);
            crate::errors::failed(&span, e.code());
            tracing::warn!(xfer_id = job.dest.xfer_id, error_type = e.code().as_str(), error = %e, "kv push failed");
            // Carries this span's context; the call runs outside it (see `outside_span`).
            let cancel = telemetry::with_trace(v1::CancelRequest {
                request_id: job.request_id.clone(),
                xfer_id: job.dest.xfer_id,
            });
            let (clients, endpoint) = (job.clients.clone(), job.dest.decode_endpoint.clone());
            let _ = outside_span(async move {
                if let Ok(mut c) = clients.get(&endpoint).await {
                    let _ = c.cancel(cancel).await;
                }
            })
            .await;
        }
    }
    result
}

async fn push(
    job: &PushJob,
    mut layers_rx: mpsc::UnboundedReceiver<LayerPayload>,
    first_rx: oneshot::Receiver<v1::Token>,
) -> Result<PushReport, PushError> {
    let dest = &job.dest;
    let num_layers = job.num_layers;
    // The frames carry this span's context, so the decode side's receive spans join the trace.
    let traceparent = telemetry::current_traceparent();
    // Connections outlive this transfer (they are pooled), and the tasks that drive them take
    // the span current at creation as their parent: made outside the `kv_transfer` span, they
    // do not keep it (and the request's trace) open forever.
    let conn = {
        let (transport, endpoint) = (Arc::clone(&job.transport), dest.kv_endpoint.clone());
        outside_span(async move { transport.connect(&endpoint).await })
            .await
            .map_err(PushError::Task)??
    };
    let block_ids: Arc<[u32]> = dest.block_ids.clone().into();
    let mut checksums = vec![0u32; num_layers as usize];
    let mut sends = JoinSet::new();
    let mut last_computed = None;
    let mut received = 0u32;
    while let Some(lp) = layers_rx.recv().await {
        let header = LayerHeader {
            xfer_id: dest.xfer_id,
            epoch: dest.epoch,
            layer: lp.layer as u32,
            num_layers,
            layout: job.layout,
            block_ids: Arc::clone(&block_ids),
            traceparent: traceparent.clone(),
        };
        let frame = FrameHeader::for_payload(header, &lp.bytes);
        checksums[lp.layer] = frame.payload_crc32c;
        last_computed = Some(lp.computed_at);
        received += 1;
        let conn = conn.clone();
        let layer = lp.layer;
        // A spawned task has no current span: without this, each layer's `kv_send_layer` span
        // would be a root of its own instead of a child of `kv_transfer`.
        sends.spawn(
            async move {
                conn.send(frame, lp.bytes)
                    .await
                    .map(|s| (layer, s, Instant::now()))
            }
            .instrument(tracing::Span::current()),
        );
    }
    if received != num_layers {
        // Fewer layers: the prompt's prefill ended early (failed or cancelled) unless a first
        // token still comes.
        return Err(match first_rx.await {
            Ok(_) => PushError::MissingLayers {
                received,
                num_layers,
            },
            Err(_) => PushError::PrefillEnded,
        });
    }
    let mut kv_bytes = 0;
    let mut last_ack = None::<Instant>;
    while let Some(joined) = sends.join_next().await {
        let (layer, stat, at) = joined.map_err(|e| PushError::Task(e.to_string()))??;
        kv_bytes += stat.payload_bytes;
        metrics::histogram!("fission_prefill_kv_transfer_layer_seconds")
            .record(stat.elapsed.as_secs_f64());
        // An event of the trace, not a log line: 30 a request at info would drown the log.
        tracing::info!(
            target: crate::TRACE_EVENTS_TARGET,
            layer = layer as i64,
            bytes = stat.payload_bytes as i64,
            duration_ms = stat.elapsed.as_secs_f64() * 1e3,
            "layer sent"
        );
        last_ack = Some(last_ack.map_or(at, |l: Instant| l.max(at)));
    }
    let tail = match (last_computed, last_ack) {
        (Some(c), Some(a)) => a.saturating_duration_since(c),
        _ => Duration::ZERO,
    };
    let first = first_rx.await.map_err(|_| PushError::PrefillEnded)?;
    let mut client = {
        let (clients, endpoint) = (job.clients.clone(), dest.decode_endpoint.clone());
        outside_span(async move { clients.get(&endpoint).await })
            .await
            .map_err(PushError::Task)?
            .map_err(|e| PushError::Connect {
                endpoint: dest.decode_endpoint.clone(),
                reason: e.to_string(),
            })?
    };
    let done = telemetry::with_trace(v1::DoneRequest {
        xfer_id: dest.xfer_id,
        epoch: dest.epoch,
        first_token: Some(first),
        num_tokens: job.num_tokens,
        checksums,
    });
    // The context travels in `done`'s metadata; the call itself runs outside the span (see
    // `outside_span`).
    outside_span(async move { client.done(done).await })
        .await
        .map_err(PushError::Task)?
        .map_err(|status| PushError::Done {
            endpoint: dest.decode_endpoint.clone(),
            xfer_id: dest.xfer_id,
            status,
        })?;
    Ok(PushReport { kv_bytes, tail })
}
