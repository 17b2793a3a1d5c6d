//! The decode node's gRPC service: reservations, token streams, Done from prefill nodes,
//! local (colocated) generation and cancellation.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use engine::ids::{BlockId, SeqId};
use futures::Stream;
use kv_types::{KvLayout, TransferId};
use kvtransfer::{Reservation, TransferRegistry};
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::{refuse_if_draining, WorkGuard, WorkTracker};
use proto::v1::decode_server::Decode;
use proto::v1::{self, reserve_response};
use proto::ErrorCode;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{Instrument, Span};

use crate::actor::{EngineHandle, TokenMsg, TokenTx};
use crate::metrics::ERRORS;
use crate::transfers::Transfers;

/// A reservation whose KV is on its way.
struct Pending {
    seq_id: SeqId,
    epoch: u64,
    request_id: String,
    /// The reserving request's trace context, for the sequence's `decode` span.
    trace: telemetry::Context,
    tokens_tx: TokenTx,
    /// Taken by the Stream call.
    tokens_rx: Option<mpsc::UnboundedReceiver<TokenMsg>>,
}

/// What the service is made of.
pub(crate) struct ServiceParts {
    pub handle: EngineHandle,
    pub registry: TransferRegistry,
    pub transfers: Transfers,
    pub layout: KvLayout,
    pub kv_endpoint: String,
    pub lease: Duration,
    pub info: v1::NodeInfo,
    /// Token streams in flight: a draining node waits for them.
    pub work: WorkTracker,
    /// Cancelled by the drain (SIGTERM or the Drain RPC). Once it is, new work is refused.
    pub drain: CancellationToken,
}

pub struct DecodeService {
    handle: EngineHandle,
    registry: TransferRegistry,
    transfers: Transfers,
    layout: KvLayout,
    kv_endpoint: String,
    lease: Duration,
    info: v1::NodeInfo,
    pending: Arc<Mutex<HashMap<TransferId, Pending>>>,
    next_seq: AtomicU64,
    work: WorkTracker,
    drain: CancellationToken,
}

impl DecodeService {
    pub(crate) fn new(p: ServiceParts) -> Self {
        DecodeService {
            handle: p.handle,
            registry: p.registry,
            transfers: p.transfers,
            layout: p.layout,
            kv_endpoint: p.kv_endpoint,
            lease: p.lease,
            info: p.info,
            pending: Arc::new(Mutex::new(HashMap::new())),
            next_seq: AtomicU64::new(1),
            work: p.work,
            drain: p.drain,
        }
    }

    /// Ends a reservation that will not be activated: frees its blocks, fences its KV writes
    /// and tells a waiting stream why.
    async fn abandon(
        pending: &Mutex<HashMap<TransferId, Pending>>,
        handle: &EngineHandle,
        registry: &TransferRegistry,
        transfers: &Transfers,
        xfer_id: TransferId,
        why: Failure,
    ) -> bool {
        let p = pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&xfer_id);
        let Some(p) = p else {
            return false;
        };
        registry.deregister(xfer_id).await;
        transfers.close(xfer_id);
        handle.cancel(p.seq_id);
        let _ = p.tokens_tx.send(Err(why));
        true
    }
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<v1::Token, Status>> + Send>>;

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(
        &self,
        request: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        let trace = telemetry::extract_grpc(request.metadata());
        self.reserve_in(request.into_inner(), trace)
            .await
            .map_err(|f| ERRORS.report(f, &Span::none()))
    }

    type StreamStream = TokenStream;

    async fn stream(
        &self,
        request: Request<v1::StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let span = stream_span(&request);
        self.stream_in(TransferId(request.into_inner().xfer_id), span.clone())
            .map_err(|f| ERRORS.report(f, &span))
    }

    type LocalGenerateStream = TokenStream;

    async fn local_generate(
        &self,
        request: Request<v1::LocalGenerateRequest>,
    ) -> Result<Response<Self::LocalGenerateStream>, Status> {
        let span = stream_span(&request);
        self.local_generate_in(request.into_inner(), span.clone())
            .await
            .map_err(|f| ERRORS.report(f, &span))
    }

    async fn done(
        &self,
        request: Request<v1::DoneRequest>,
    ) -> Result<Response<v1::DoneResponse>, Status> {
        self.done_in(request.into_inner())
            .await
            .map_err(|f| ERRORS.report(f, &Span::none()))
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let xfer_id = TransferId(request.into_inner().xfer_id);
        let mut found = Self::abandon(
            &self.pending,
            &self.handle,
            &self.registry,
            &self.transfers,
            xfer_id,
            Failure::new(ErrorCode::Cancelled, "cancelled"),
        )
        .await;
        if !found {
            // Already activated: cancel the running sequence.
            if let Some(seq_id) = self.transfers.close(xfer_id) {
                self.handle.cancel(seq_id);
                found = true;
            }
        }
        Ok(Response::new(v1::CancelResponse { found }))
    }
}

impl DecodeService {
    async fn reserve_in(
        &self,
        r: v1::ReserveRequest,
        trace: telemetry::Context,
    ) -> Result<Response<v1::ReserveResponse>, Failure> {
        refuse_if_draining(&self.drain, &self.info, "reservations")?;
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let req = convert::request(
            seq_id,
            r.prompt_ids,
            r.sampling.as_ref(),
            r.stopping.as_ref(),
        );
        let blocks = match self.handle.reserve(req).await {
            Ok(b) => b,
            Err(e) if e.code() == ErrorCode::Overloaded => {
                metrics::counter!("fission_decode_reserve_busy_total").increment(1);
                return Ok(Response::new(v1::ReserveResponse {
                    result: Some(reserve_response::Result::Busy(e.to_string())),
                }));
            }
            Err(e) => return Err(e.into()),
        };
        let xfer_id = self.transfers.open(seq_id);
        let epoch = 1;
        let block_ids: Vec<u32> = blocks.iter().map(|b: &BlockId| b.0).collect();
        self.registry
            .register(Reservation {
                xfer_id,
                epoch,
                block_ids: block_ids.clone().into(),
                layout: self.layout,
            })
            .await
            .map_err(|e| {
                self.transfers.close(xfer_id);
                self.handle.cancel(seq_id);
                Failure::new(ErrorCode::Internal, e.to_string())
            })?;
        let (tokens_tx, tokens_rx) = mpsc::unbounded_channel();
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                xfer_id,
                Pending {
                    seq_id,
                    epoch,
                    request_id: r.request_id.clone(),
                    trace,
                    tokens_tx,
                    tokens_rx: Some(tokens_rx),
                },
            );
        // The lease: nothing is held forever if the KV never comes.
        let (pending, handle, registry, transfers, lease) = (
            Arc::clone(&self.pending),
            self.handle.clone(),
            self.registry.clone(),
            self.transfers.clone(),
            self.lease,
        );
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            if DecodeService::abandon(
                &pending,
                &handle,
                &registry,
                &transfers,
                xfer_id,
                Failure::new(
                    ErrorCode::Timeout,
                    "kv lease expired before the transfer completed",
                ),
            )
            .await
            {
                metrics::counter!("fission_decode_lease_expired_total").increment(1);
                tracing::warn!(%xfer_id, "kv lease expired");
            }
        });
        tracing::debug!(request_id = %r.request_id, %xfer_id, blocks = block_ids.len(), "reserved");
        Ok(Response::new(v1::ReserveResponse {
            result: Some(reserve_response::Result::Reserved(v1::Reserved {
                xfer_id: xfer_id.0,
                epoch,
                block_ids,
                kv_endpoint: self.kv_endpoint.clone(),
                lease_ms: self.lease.as_millis() as u32,
                layout: Some(self.layout.into()),
            })),
        }))
    }

    fn stream_in(&self, xfer_id: TransferId, span: Span) -> Result<Response<TokenStream>, Failure> {
        let (seq_id, rx) = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let p = pending.get_mut(&xfer_id).ok_or_else(|| {
                Failure::new(ErrorCode::NotFound, format!("no reservation {xfer_id}"))
            })?;
            span.record("request_id", p.request_id.as_str());
            let rx = p.tokens_rx.take().ok_or_else(|| {
                Failure::new(
                    ErrorCode::Validation,
                    format!("reservation {xfer_id} is already streamed"),
                )
            })?;
            (p.seq_id, rx)
        };
        let guard = CancelOnDrop {
            handle: self.handle.clone(),
            seq_id,
            finished: false,
            on_drop: Some(Box::new({
                let (pending, registry) = (Arc::clone(&self.pending), self.registry.clone());
                move || {
                    // Not yet activated: give the reservation up too.
                    let gone = pending
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&xfer_id);
                    if gone.is_some() {
                        tokio::spawn(async move {
                            registry.deregister(xfer_id).await;
                        });
                    }
                }
            })),
            transfer: Some((self.transfers.clone(), xfer_id)),
        };
        Ok(Response::new(Box::pin(EngineTokens {
            rx,
            guard,
            _work: self.work.begin(),
            span,
            tokens: 0,
        })))
    }

    async fn local_generate_in(
        &self,
        r: v1::LocalGenerateRequest,
        span: Span,
    ) -> Result<Response<TokenStream>, Failure> {
        span.record("request_id", r.request_id.as_str());
        refuse_if_draining(&self.drain, &self.info, "requests")?;
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let req = convert::request(
            seq_id,
            r.prompt_ids,
            r.sampling.as_ref(),
            r.stopping.as_ref(),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        self.handle
            .generate(req, tx, &r.request_id)
            .instrument(span.clone())
            .await?;
        metrics::counter!("fission_decode_local_prefill_total").increment(1);
        let guard = CancelOnDrop {
            handle: self.handle.clone(),
            seq_id,
            finished: false,
            on_drop: None,
            transfer: None,
        };
        Ok(Response::new(Box::pin(EngineTokens {
            rx,
            guard,
            _work: self.work.begin(),
            span,
            tokens: 0,
        })))
    }

    async fn done_in(&self, d: v1::DoneRequest) -> Result<Response<v1::DoneResponse>, Failure> {
        let xfer_id = TransferId(d.xfer_id);
        let (seq_id, epoch, tokens_tx, trace, request_id) = {
            let pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let p = pending.get(&xfer_id).ok_or_else(|| {
                Failure::new(ErrorCode::NotFound, format!("no reservation {xfer_id}"))
            })?;
            (
                p.seq_id,
                p.epoch,
                p.tokens_tx.clone(),
                p.trace.clone(),
                p.request_id.clone(),
            )
        };
        if d.epoch != epoch {
            return Err(Failure::new(
                ErrorCode::Validation,
                format!(
                    "done for xfer {} carries epoch {}, current is {epoch}",
                    d.xfer_id, d.epoch
                ),
            ));
        }
        let first = d
            .first_token
            .as_ref()
            .ok_or_else(|| Failure::new(ErrorCode::Validation, "done without first_token"))?;
        // Every layer must have landed with the checksum the sender computed.
        let progress = match self
            .registry
            .wait_complete(xfer_id, Duration::from_secs(5))
            .await
        {
            Ok(p) => p,
            Err(e) => {
                let why = Failure::new(
                    ErrorCode::KvTransfer,
                    format!("kv transfer incomplete: {e}"),
                );
                Self::abandon(
                    &self.pending,
                    &self.handle,
                    &self.registry,
                    &self.transfers,
                    xfer_id,
                    why.clone(),
                )
                .await;
                return Err(why);
            }
        };
        let received: Vec<u32> = progress
            .layer_crc32c
            .iter()
            .map(|c| c.unwrap_or(0))
            .collect();
        if !d.checksums.is_empty() && d.checksums != received {
            let why = Failure::new(
                ErrorCode::KvTransfer,
                format!("kv checksums differ for xfer {}", d.xfer_id),
            );
            Self::abandon(
                &self.pending,
                &self.handle,
                &self.registry,
                &self.transfers,
                xfer_id,
                why.clone(),
            )
            .await;
            return Err(why);
        }
        // Fence: no write into these blocks runs after this returns.
        self.registry.deregister(xfer_id).await;
        metrics::counter!("fission_decode_kv_transfers_completed_total").increment(1);
        metrics::histogram!("fission_decode_kv_transfer_bytes")
            .record(progress.payload_bytes as f64);
        // The entry leaves `pending` now, so the lease can no longer fire for it.
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&xfer_id);
        self.handle
            .activate(
                seq_id,
                convert::sampled(first),
                tokens_tx,
                trace,
                &request_id,
            )
            .await?;
        Ok(Response::new(v1::DoneResponse {}))
    }
}

/// Cancels the sequence when a stream is dropped before its final token: the client left.
struct CancelOnDrop {
    handle: EngineHandle,
    seq_id: SeqId,
    finished: bool,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
    /// The transfer the sequence came from, closed when its stream ends either way.
    transfer: Option<(Transfers, TransferId)>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((transfers, id)) = self.transfer.take() {
            transfers.close(id);
        }
        if !self.finished {
            self.handle.cancel(self.seq_id);
            if let Some(f) = self.on_drop.take() {
                f();
            }
        }
    }
}

struct EngineTokens {
    rx: mpsc::UnboundedReceiver<TokenMsg>,
    guard: CancelOnDrop,
    _work: WorkGuard,
    /// The `stream` span: open while tokens flow to the caller.
    span: Span,
    tokens: i64,
}

/// The `stream` span of a token stream, a child of the caller's span.
fn stream_span<T>(request: &Request<T>) -> Span {
    let span = tracing::info_span!(
        "stream",
        request_id = tracing::field::Empty,
        tokens = tracing::field::Empty,
        error_type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    telemetry::set_parent(&span, telemetry::extract_grpc(request.metadata()));
    span
}

impl Stream for EngineTokens {
    type Item = Result<v1::Token, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(ev))) => {
                self.tokens += 1;
                if ev.finish.is_some() {
                    self.guard.finished = true;
                    self.span.record("tokens", self.tokens);
                }
                Poll::Ready(Some(Ok(convert::token(&ev))))
            }
            Poll::Ready(Some(Err(why))) => {
                self.guard.finished = true;
                self.span.record("tokens", self.tokens);
                Poll::Ready(Some(Err(ERRORS.report(why, &self.span))))
            }
            Poll::Ready(None) => {
                self.guard.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for EngineTokens {
    fn drop(&mut self) {
        if !self.guard.finished {
            // The caller left mid-stream: what it got is still worth knowing.
            self.span.record("tokens", self.tokens);
        }
    }
}
