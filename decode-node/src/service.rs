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
use kvtransfer::{KvLayout as WireLayout, Reservation, TransferRegistry};
use node_common::cache_events::{CacheEventLog, CacheEventStream};
use node_common::convert;
use node_common::membership::{WorkGuard, WorkTracker};
use proto::v1::decode_server::Decode;
use proto::v1::{self, reserve_response};
use proto::ErrorCode;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::actor::{EngineHandle, TokenMsg, TokenTx};

/// A reservation whose KV is on its way.
struct Pending {
    seq_id: SeqId,
    epoch: u64,
    /// The reserving request's trace context, for the sequence's `decode` span.
    trace: telemetry::Context,
    tokens_tx: TokenTx,
    /// Taken by the Stream call.
    tokens_rx: Option<mpsc::UnboundedReceiver<TokenMsg>>,
}

pub struct DecodeService {
    pub(crate) handle: EngineHandle,
    pub(crate) registry: TransferRegistry,
    pub(crate) layout: engine::kv::cache::KvLayoutDesc,
    pub(crate) kv_endpoint: String,
    pub(crate) lease: Duration,
    pub(crate) info: v1::NodeInfo,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    next_seq: AtomicU64,
    /// Token streams in flight: a draining node waits for them.
    pub(crate) work: WorkTracker,
    pub(crate) cache_log: Arc<CacheEventLog>,
    /// Cancelled by the Drain RPC: the same path as SIGTERM.
    pub(crate) drain: CancellationToken,
}

impl DecodeService {
    pub(crate) fn new(
        handle: EngineHandle,
        registry: TransferRegistry,
        layout: engine::kv::cache::KvLayoutDesc,
        kv_endpoint: String,
        lease: Duration,
        info: v1::NodeInfo,
        cache_log: Arc<CacheEventLog>,
        drain: CancellationToken,
    ) -> Self {
        DecodeService {
            handle,
            registry,
            layout,
            kv_endpoint,
            lease,
            info,
            pending: Arc::new(Mutex::new(HashMap::new())),
            next_seq: AtomicU64::new(1),
            work: WorkTracker::default(),
            cache_log,
            drain,
        }
    }

    fn wire_layout(&self) -> WireLayout {
        node_common::kv::wire_layout(&self.layout)
    }

    /// Ends a reservation that will not be activated: frees its blocks, fences its KV writes
    /// and tells a waiting stream why.
    async fn abandon(
        pending: &Mutex<HashMap<u64, Pending>>,
        handle: &EngineHandle,
        registry: &TransferRegistry,
        xfer_id: u64,
        why: &str,
    ) -> bool {
        let p = pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&xfer_id);
        let Some(p) = p else {
            return false;
        };
        registry.deregister(xfer_id).await;
        handle.cancel(p.seq_id);
        let _ = p.tokens_tx.send(Err(why.to_string()));
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
        let r = request.into_inner();
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
            Err(e) => return Err(e.to_status()),
        };
        let xfer_id = seq_id.0;
        let epoch = 1;
        let block_ids: Vec<u32> = blocks.iter().map(|b: &BlockId| b.0).collect();
        self.registry
            .register(Reservation {
                xfer_id,
                epoch,
                block_ids: block_ids.clone().into(),
                num_layers: self.layout.num_layers as u32,
                layout: self.wire_layout(),
            })
            .await
            .map_err(|e| {
                self.handle.cancel(seq_id);
                ErrorCode::Internal.status(e.to_string())
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
                    trace,
                    tokens_tx,
                    tokens_rx: Some(tokens_rx),
                },
            );
        // The lease: nothing is held forever if the KV never comes.
        let (pending, handle, registry, lease) = (
            Arc::clone(&self.pending),
            self.handle.clone(),
            self.registry.clone(),
            self.lease,
        );
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            if DecodeService::abandon(
                &pending,
                &handle,
                &registry,
                xfer_id,
                "kv lease expired before the transfer completed",
            )
            .await
            {
                metrics::counter!("fission_decode_lease_expired_total").increment(1);
                tracing::warn!(xfer_id, "kv lease expired");
            }
        });
        tracing::debug!(request_id = %r.request_id, xfer_id, blocks = block_ids.len(), "reserved");
        Ok(Response::new(v1::ReserveResponse {
            result: Some(reserve_response::Result::Reserved(v1::Reserved {
                xfer_id,
                epoch,
                block_ids,
                kv_endpoint: self.kv_endpoint.clone(),
                lease_ms: self.lease.as_millis() as u32,
                layout: Some(node_common::kv::proto_layout(&self.layout)),
            })),
        }))
    }

    type StreamStream = TokenStream;

    async fn stream(
        &self,
        request: Request<v1::StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let span = stream_span(&request);
        let xfer_id = request.into_inner().xfer_id;
        let (seq_id, rx) = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let p = pending
                .get_mut(&xfer_id)
                .ok_or_else(|| ErrorCode::NotFound.status(format!("no reservation {xfer_id}")))?;
            let rx = p.tokens_rx.take().ok_or_else(|| {
                ErrorCode::Validation.status(format!("reservation {xfer_id} is already streamed"))
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
        };
        Ok(Response::new(Box::pin(EngineTokens {
            rx,
            guard,
            _work: self.work.begin(),
            span,
            tokens: 0,
        })))
    }

    type LocalGenerateStream = TokenStream;

    async fn local_generate(
        &self,
        request: Request<v1::LocalGenerateRequest>,
    ) -> Result<Response<Self::LocalGenerateStream>, Status> {
        let span = stream_span(&request);
        let r = request.into_inner();
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let req = convert::request(
            seq_id,
            r.prompt_ids,
            r.sampling.as_ref(),
            r.stopping.as_ref(),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        self.handle
            .generate(req, tx)
            .instrument(span.clone())
            .await
            .map_err(|e| e.to_status())?;
        metrics::counter!("fission_decode_local_prefill_total").increment(1);
        let guard = CancelOnDrop {
            handle: self.handle.clone(),
            seq_id,
            finished: false,
            on_drop: None,
        };
        Ok(Response::new(Box::pin(EngineTokens {
            rx,
            guard,
            _work: self.work.begin(),
            span,
            tokens: 0,
        })))
    }

    async fn done(
        &self,
        request: Request<v1::DoneRequest>,
    ) -> Result<Response<v1::DoneResponse>, Status> {
        let d = request.into_inner();
        let (seq_id, epoch, tokens_tx, trace) = {
            let pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let p = pending.get(&d.xfer_id).ok_or_else(|| {
                ErrorCode::NotFound.status(format!("no reservation {}", d.xfer_id))
            })?;
            (p.seq_id, p.epoch, p.tokens_tx.clone(), p.trace.clone())
        };
        if d.epoch != epoch {
            return Err(ErrorCode::Validation.status(format!(
                "done for xfer {} carries epoch {}, current is {epoch}",
                d.xfer_id, d.epoch
            )));
        }
        let first = d
            .first_token
            .as_ref()
            .ok_or_else(|| ErrorCode::Validation.status("done without first_token"))?;
        // Every layer must have landed with the checksum the sender computed.
        let progress = match self
            .registry
            .wait_complete(d.xfer_id, Duration::from_secs(5))
            .await
        {
            Ok(p) => p,
            Err(e) => {
                Self::abandon(
                    &self.pending,
                    &self.handle,
                    &self.registry,
                    d.xfer_id,
                    "kv transfer incomplete",
                )
                .await;
                return Err(ErrorCode::KvTransfer.status(e.to_string()));
            }
        };
        let received: Vec<u32> = progress
            .layer_crc32c
            .iter()
            .map(|c| c.unwrap_or(0))
            .collect();
        if !d.checksums.is_empty() && d.checksums != received {
            Self::abandon(
                &self.pending,
                &self.handle,
                &self.registry,
                d.xfer_id,
                "kv checksum mismatch",
            )
            .await;
            return Err(
                ErrorCode::KvTransfer.status(format!("checksums differ for xfer {}", d.xfer_id))
            );
        }
        // Fence: no write into these blocks runs after this returns.
        self.registry.deregister(d.xfer_id).await;
        metrics::counter!("fission_decode_kv_transfers_completed_total").increment(1);
        metrics::histogram!("fission_decode_kv_transfer_bytes")
            .record(progress.payload_bytes as f64);
        // The entry leaves `pending` now, so the lease can no longer fire for it.
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&d.xfer_id);
        match self
            .handle
            .activate(seq_id, convert::sampled(first), tokens_tx, trace)
            .await
        {
            Ok(_) => Ok(Response::new(v1::DoneResponse {})),
            Err(e) => Err(e.to_status()),
        }
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let c = request.into_inner();
        let found = Self::abandon(
            &self.pending,
            &self.handle,
            &self.registry,
            c.xfer_id,
            "cancelled",
        )
        .await;
        if !found {
            // Already activated: cancel the running sequence.
            self.handle.cancel(SeqId(c.xfer_id));
        }
        Ok(Response::new(v1::CancelResponse { found }))
    }

    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn drain(
        &self,
        _: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        Ok(Response::new(node_common::membership::request_drain(
            &self.drain,
            &self.info.node_id,
        )))
    }

    type CacheEventsStream = CacheEventStream;

    async fn cache_events(
        &self,
        _: Request<v1::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        Ok(Response::new(self.cache_log.stream()))
    }
}

/// Cancels the sequence when a stream is dropped before its final token: the client left.
struct CancelOnDrop {
    handle: EngineHandle,
    seq_id: SeqId,
    finished: bool,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
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
    span: tracing::Span,
    tokens: i64,
}

/// The `stream` span of a token stream, a child of the caller's span.
fn stream_span<T>(request: &Request<T>) -> tracing::Span {
    let span = tracing::info_span!("stream", tokens = tracing::field::Empty);
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
                let code = if why.contains("lease") {
                    ErrorCode::Timeout
                } else if why == "cancelled" {
                    ErrorCode::Cancelled
                } else {
                    ErrorCode::Internal
                };
                Poll::Ready(Some(Err(code.status(why))))
            }
            Poll::Ready(None) => {
                self.guard.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
