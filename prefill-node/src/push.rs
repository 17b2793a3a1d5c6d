//! Pushes one prompt's layers to a decode node as the engine finishes them, then tells the
//! decode node (Done) with the first token and the per-layer checksums.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use identity::GrpcSecurity;
use kv_types::{KvLayout, TransferId};
use kvtransfer::{
    FrameHeader, KvConnection, KvRoute, KvTransferError, LayerHeader, PickingTransport,
};
use proto::v1;
use proto::v1::decode_client::DecodeClient;
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tonic::transport::Channel;
use tracing::Instrument;

use crate::actor::LayerPayload;

/// The configured data-plane backend, and shared memory for decode nodes on this host.
pub type Transport = PickingTransport;

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

/// `FISSION_FAILPOINT_PUSH_DELAY_MS`, read once: how long every push waits before its first
/// layer. A test failpoint: only builds with the `failpoints` feature (which only the tests
/// turn on) read it.
#[cfg(feature = "failpoints")]
fn push_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("FISSION_FAILPOINT_PUSH_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    })
}

#[cfg(not(feature = "failpoints"))]
fn push_delay() -> Option<Duration> {
    None
}

/// gRPC clients of decode nodes, one per endpoint, over the node's own identity (the decode
/// node lets only a prefill certificate renew and complete its reservations).
#[derive(Clone)]
pub struct DecodeClients {
    security: GrpcSecurity,
    clients: Arc<Mutex<HashMap<String, DecodeClient<Channel>>>>,
}

impl DecodeClients {
    pub fn new(security: GrpcSecurity) -> Self {
        Self {
            security,
            clients: Arc::default(),
        }
    }

    pub async fn get(&self, endpoint: &str) -> Result<DecodeClient<Channel>, String> {
        if let Some(c) = self
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
        {
            return Ok(c.clone());
        }
        let channel = self
            .security
            .endpoint(endpoint)
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| e.to_string())?;
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
#[non_exhaustive]
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
            // The decode node's side failed, not this node: the gateway retries the prompt
            // without holding it against this node, and hears from the decode node's own
            // stream whether that node died.
            PushError::Kv(_) | PushError::Connect { .. } => ErrorCode::KvTransfer,
            PushError::Done { status, .. } => done_failure(status),
            PushError::PrefillEnded => ErrorCode::Cancelled,
            PushError::MissingLayers { .. } | PushError::Task(_) => ErrorCode::Internal,
        }
    }
}

/// What a failed Done stands for. A call that broke on the way (the decode node was killed
/// or restarted while its reservation waited) is a failed transfer, which the gateway
/// retries or migrates; read as the gRPC code alone (`Unknown`), it was an internal error
/// that failed a request the cluster could still serve. A reservation the decode node no
/// longer holds, or holds at a newer epoch, was given up there (its lease ended, or the
/// request moved on): the prompt is cancelled, as when the node refuses a Renew.
fn done_failure(status: &tonic::Status) -> ErrorCode {
    match status.code() {
        tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::Cancelled => {
            ErrorCode::KvTransfer
        }
        tonic::Code::NotFound | tonic::Code::InvalidArgument => ErrorCode::Cancelled,
        other => ErrorCode::from_grpc(other),
    }
}

/// One transfer to push: where, what layout, and for which request.
pub struct PushJob {
    pub transport: Arc<Transport>,
    pub clients: DecodeClients,
    pub xfer_id: TransferId,
    /// The decode node's reservation, as it sent it.
    pub dest: v1::Reserved,
    /// The decode node's gRPC endpoint, for Done and Renew.
    pub decode_endpoint: String,
    /// This node's cache geometry, which the destination's matches.
    pub layout: KvLayout,
    pub request_id: String,
}

/// Runs the push of one transfer inside its `kv_transfer` span: sends each layer as it
/// arrives on `layers_rx`, then Done with the first token from `first_rx`. On failure it marks
/// the span failed and counts the failure.
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
            crate::metrics::ERRORS.failed(&span, e.code());
            // No cancel here: the gateway hears of the failure on the Prefill call and retries
            // into the same reservation at a newer epoch, or lets its lease end it.
            tracing::warn!(xfer_id = job.dest.xfer_id, error_type = e.code().as_str(), error = %e, "kv push failed");
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
    let num_layers = job.layout.num_layers;
    if let Some(delay) = push_delay() {
        // Test-only failpoint: the prompt's answer goes out while its KV is held back, so a
        // test can kill the node between the two.
        tokio::time::sleep(delay).await;
    }
    // The frames carry this span's context, so the decode side's receive spans join the trace.
    let traceparent = telemetry::current_traceparent();
    // Connections outlive this transfer (they are pooled), and the tasks that drive them take
    // the span current at creation as their parent: made outside the `kv_transfer` span, they
    // do not keep it (and the request's trace) open forever.
    let conn = {
        let transport = Arc::clone(&job.transport);
        let (endpoint, shm_endpoint, host_id) = (
            dest.kv_endpoint.clone(),
            dest.kv_shm_endpoint.clone(),
            dest.host_id.clone(),
        );
        let (conn, backend) = outside_span(async move {
            let route = KvRoute {
                kv_endpoint: &endpoint,
                kv_shm_endpoint: &shm_endpoint,
                host_id: &host_id,
            };
            transport.connect_route(&route).await
        })
        .await
        .map_err(PushError::Task)??;
        metrics::counter!("fission_prefill_kv_pushes_total", "transport" => backend.as_str())
            .increment(1);
        tracing::Span::current().record("transport", backend.as_str());
        conn
    };
    let block_ids: Arc<[u32]> = dest.block_ids.clone().into();
    let mut checksums = vec![0u32; num_layers as usize];
    let mut sends = JoinSet::new();
    let mut last_computed = None;
    let mut received = 0u32;
    while let Some(lp) = layers_rx.recv().await {
        // A sliding-window layer carries the tail of the reservation's blocks that its window
        // reads at the prompt's end (the engine's `LayerDone::pushed_blocks`).
        let layer_blocks = match lp.first_block {
            0 => Arc::clone(&block_ids),
            from => Arc::from(block_ids.get(from..).unwrap_or_default()),
        };
        let header = LayerHeader {
            xfer_id: job.xfer_id,
            epoch: dest.epoch,
            layer: lp.layer as u32,
            layout: job.layout,
            block_ids: layer_blocks,
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
                conn.send_frame(frame, lp.bytes)
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
            target: node_common::launch::TRACE_EVENTS_TARGET,
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
        let (clients, endpoint) = (job.clients.clone(), job.decode_endpoint.clone());
        outside_span(async move { clients.get(&endpoint).await })
            .await
            .map_err(PushError::Task)?
            .map_err(|e| PushError::Connect {
                endpoint: job.decode_endpoint.clone(),
                reason: e.to_string(),
            })?
    };
    let done = telemetry::with_trace(v1::DoneRequest {
        xfer_id: dest.xfer_id,
        epoch: dest.epoch,
        first_token: Some(first),
        checksums,
    });
    // The context travels in `done`'s metadata; the call itself runs outside the span (see
    // `outside_span`).
    outside_span(async move { client.done(done).await })
        .await
        .map_err(PushError::Task)?
        .map_err(|status| PushError::Done {
            endpoint: job.decode_endpoint.clone(),
            xfer_id: dest.xfer_id,
            status,
        })?;
    Ok(PushReport { kv_bytes, tail })
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use futures::Stream;
    use kvtransfer::{
        DiscardSink, KvDtype, KvServer, Reservation, TcpConfig, TcpServer, TransferRegistry,
    };
    use proto::v1::decode_server::{Decode, DecodeServer};
    use testkit::span_capture::{Captured, Value};
    use tokio_util::sync::CancellationToken;
    use tonic::{Request, Response, Status};

    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        dtype: KvDtype::F32,
        num_layers: 2,
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 4,
        windows: kv_types::LayerWindows::NONE,
    };

    /// What the fake decode node was called with: the RPC, its traceparent, the xfer id and
    /// the request id.
    type Calls = Arc<Mutex<Vec<(&'static str, Option<String>, u64, String)>>>;

    /// A decode node that answers Done and Renew only.
    #[derive(Clone, Default)]
    struct FakeDecode {
        calls: Calls,
    }

    type Down = Pin<Box<dyn Stream<Item = Result<v1::GenerateDown, Status>> + Send>>;

    fn traceparent<T>(r: &Request<T>) -> Option<String> {
        r.metadata()
            .get(proto::TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    #[tonic::async_trait]
    impl Decode for FakeDecode {
        type GenerateStream = Down;
        async fn generate(
            &self,
            _: Request<tonic::Streaming<v1::GenerateUp>>,
        ) -> Result<Response<Down>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn done(
            &self,
            r: Request<v1::DoneRequest>,
        ) -> Result<Response<v1::DoneResponse>, Status> {
            let tp = traceparent(&r);
            let xfer_id = r.into_inner().xfer_id;
            self.calls
                .lock()
                .unwrap()
                .push(("done", tp, xfer_id, String::new()));
            Ok(Response::new(v1::DoneResponse {}))
        }
        async fn renew(
            &self,
            r: Request<v1::RenewRequest>,
        ) -> Result<Response<v1::RenewResponse>, Status> {
            let tp = traceparent(&r);
            let xfer_id = r.into_inner().xfer_id;
            self.calls
                .lock()
                .unwrap()
                .push(("renew", tp, xfer_id, String::new()));
            Ok(Response::new(v1::RenewResponse {}))
        }
    }

    /// A fake decode node (gRPC) and a real KV receiver holding a reservation for xfer 7.
    struct Peers {
        decode_endpoint: String,
        kv_endpoint: String,
        calls: Calls,
        stop: CancellationToken,
    }

    async fn peers() -> Peers {
        let stop = CancellationToken::new();
        let fake = FakeDecode::default();
        let calls = Arc::clone(&fake.calls);
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let decode_endpoint = grpc.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DecodeServer::new(fake))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(grpc),
                    stop.clone().cancelled_owned(),
                ),
        );
        let kv = TcpServer::bind(([127, 0, 0, 1], 0).into(), TcpConfig::default())
            .await
            .unwrap();
        let kv_endpoint = kv.local_addr().unwrap().to_string();
        let registry = TransferRegistry::default();
        registry
            .register(Reservation {
                xfer_id: TransferId(7),
                epoch: 1,
                block_ids: Arc::from(vec![0u32]),
                layout: LAYOUT,
            })
            .await
            .unwrap();
        tokio::spawn(kv.serve(registry, Arc::new(DiscardSink::default()), stop.clone()));
        Peers {
            decode_endpoint,
            kv_endpoint,
            calls,
            stop,
        }
    }

    fn payload_len() -> usize {
        2 * LAYOUT.block_bytes() as usize
    }

    /// Pushes both layers of one block to `xfer_id` inside a `kv_transfer` span.
    async fn push_two_layers(p: &Peers, xfer_id: u64) -> Result<PushReport, PushError> {
        let job = PushJob {
            transport: Arc::new(Transport::from(kvtransfer::BackendTransport::Tcp(
                kvtransfer::TcpTransport::default(),
            ))),
            clients: DecodeClients::new(GrpcSecurity::Insecure),
            xfer_id: TransferId(xfer_id),
            dest: v1::Reserved {
                kv_endpoint: p.kv_endpoint.clone(),
                xfer_id,
                epoch: 1,
                block_ids: vec![0],
                ..Default::default()
            },
            decode_endpoint: p.decode_endpoint.clone(),
            layout: LAYOUT,
            request_id: format!("req-{xfer_id}"),
        };
        let (layers_tx, layers_rx) = mpsc::unbounded_channel();
        let (first_tx, first_rx) = oneshot::channel();
        for layer in 0..LAYOUT.num_layers as usize {
            layers_tx
                .send(LayerPayload {
                    layer,
                    first_block: 0,
                    bytes: bytes::Bytes::from(vec![1u8; payload_len()]),
                    computed_at: Instant::now(),
                })
                .unwrap();
        }
        drop(layers_tx);
        first_tx.send(v1::Token::default()).unwrap();
        let span = tracing::info_span!(
            "kv_transfer",
            request_id = job.request_id.as_str(),
            bytes = tracing::field::Empty,
            tail_ms = tracing::field::Empty,
            error_type = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        run_push_task(job, layers_rx, first_rx)
            .instrument(span)
            .await
    }

    #[tokio::test]
    async fn a_push_traces_each_layer_under_its_kv_transfer_span() {
        let capture = Captured::default();
        let _subscriber = capture.install();
        let p = peers().await;
        let report = push_two_layers(&p, 7).await.expect("pushed");
        assert_eq!(report.kv_bytes, 2 * payload_len() as u64);
        assert_eq!(p.calls.lock().unwrap()[0].0, "done");

        let transfers = capture.named("kv_transfer");
        assert_eq!(transfers.len(), 1);
        let (index, transfer) = &transfers[0];
        assert_eq!(
            transfer.field("bytes"),
            Some(&Value::I64(2 * payload_len() as i64))
        );
        assert_eq!(transfer.field("error_type"), None);
        let layer_events: Vec<_> = transfer
            .events
            .iter()
            .filter(|e| e.get("message").and_then(Value::as_str) == Some("layer sent"))
            .collect();
        assert_eq!(
            layer_events.len(),
            LAYOUT.num_layers as usize,
            "one event per layer"
        );
        for e in layer_events {
            assert_eq!(
                e.get("target").and_then(Value::as_str),
                Some(node_common::launch::TRACE_EVENTS_TARGET)
            );
            assert_eq!(e.get("bytes"), Some(&Value::I64(payload_len() as i64)));
            assert!(matches!(e.get("layer"), Some(Value::I64(_))));
            assert!(matches!(e.get("duration_ms"), Some(Value::F64(_))));
        }
        let sends = capture.named("kv_send_layer");
        assert_eq!(sends.len(), LAYOUT.num_layers as usize);
        for (_, s) in &sends {
            assert_eq!(s.parent, Some(*index), "a child of kv_transfer");
            assert_eq!(s.field("xfer_id"), Some(&Value::I64(7)));
            assert_eq!(s.field("epoch"), Some(&Value::I64(1)));
            assert!(matches!(s.field("layer"), Some(Value::I64(_))));
            assert_eq!(
                s.field("payload_bytes"),
                Some(&Value::I64(payload_len() as i64))
            );
        }
        p.stop.cancel();
    }

    #[tokio::test]
    async fn a_failed_push_marks_its_span_and_leaves_the_retry_to_the_gateway() {
        let capture = Captured::default();
        let _subscriber = capture.install();
        let p = peers().await;
        // No reservation 8 on the receiver: every layer is refused.
        let err = push_two_layers(&p, 8).await.err().expect("refused");
        assert_eq!(err.code(), ErrorCode::KvTransfer, "{err}");
        let (_, transfer) = capture.named("kv_transfer").remove(0);
        assert_eq!(
            transfer.field("error_type"),
            Some(&Value::Str("kv_transfer".into()))
        );
        assert_eq!(
            transfer.field("otel.status_code"),
            Some(&Value::Str("ERROR".into()))
        );
        // No Done: the reservation waits for the gateway's next epoch, or its lease.
        assert!(p.calls.lock().unwrap().is_empty());
        p.stop.cancel();
    }

    #[tokio::test]
    async fn a_decode_node_gone_before_done_is_a_failed_transfer_for_the_gateway_to_retry() {
        let mut p = peers().await;
        // The decode node's process is gone: its gRPC port refuses connections.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        p.decode_endpoint = closed.local_addr().unwrap().to_string();
        drop(closed);
        let err = push_two_layers(&p, 7).await.err().expect("no Done");
        assert!(matches!(err, PushError::Connect { .. }), "{err}");
        assert_eq!(err.code(), ErrorCode::KvTransfer, "{err}");
        p.stop.cancel();
    }

    #[test]
    fn a_done_that_broke_on_the_way_is_a_failed_transfer_and_a_refused_one_a_cancelled_prompt() {
        let code = |status| {
            PushError::Done {
                endpoint: "d".into(),
                xfer_id: 7,
                status,
            }
            .code()
        };
        // What tonic makes of a connection the killed node reset mid-call.
        assert_eq!(
            code(tonic::Status::unknown("transport error")),
            ErrorCode::KvTransfer
        );
        assert_eq!(
            code(tonic::Status::unavailable("connection refused")),
            ErrorCode::KvTransfer
        );
        assert_eq!(
            code(tonic::Status::not_found("no reservation is waiting")),
            ErrorCode::Cancelled
        );
        assert_eq!(
            code(tonic::Status::invalid_argument("epoch 1 is stale")),
            ErrorCode::Cancelled
        );
        assert_eq!(
            code(tonic::Status::data_loss("checksum mismatch")),
            ErrorCode::KvTransfer
        );
    }

    /// Done carries the transfer's trace context, so the decode side joins the trace.
    #[test]
    fn done_carries_the_trace() {
        let (dispatch, guard) = telemetry::build(&telemetry::TelemetrySettings {
            service_name: "fission-prefill-test".into(),
            // Nothing listens there: spans get real contexts, and their export fails quietly.
            otlp_endpoint: Some("http://127.0.0.1:9".into()),
            default_filter: "off".into(),
        })
        .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let calls = tracing::dispatcher::with_default(&dispatch, || {
            runtime.block_on(async {
                let p = peers().await;
                push_two_layers(&p, 7).await.expect("pushed");
                p.stop.cancel();
                let calls = p.calls.lock().unwrap().clone();
                calls
            })
        });
        drop(runtime);
        drop(guard);
        let (rpc, traceparent, xfer_id, _) = &calls[0];
        assert_eq!((*rpc, *xfer_id), ("done", 7));
        assert!(
            traceparent.as_deref().is_some_and(|t| t.starts_with("00-")),
            "{traceparent:?}"
        );
    }
}
