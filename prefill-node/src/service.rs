//! The prefill node's gRPC service.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine::ids::SeqId;
use engine::kv::cache::KvLayoutDesc;
use node_common::cache_events::{CacheEventLog, CacheEventStream};
use node_common::convert;
use node_common::membership::WorkTracker;
use proto::v1::prefill_server::Prefill;
use proto::v1::{self};
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::actor::EngineHandle;
use crate::push::{run_push_task, DecodeClients, Transport};

pub struct PrefillService {
    pub(crate) handle: EngineHandle,
    pub(crate) transport: Arc<Transport>,
    pub(crate) clients: DecodeClients,
    pub(crate) layout: KvLayoutDesc,
    pub(crate) info: v1::NodeInfo,
    pub(crate) next_seq: AtomicU64,
    /// Prefill calls and their KV pushes in flight: a draining node waits for them.
    pub(crate) work: WorkTracker,
    pub(crate) cache_log: Arc<CacheEventLog>,
    /// Cancelled by the Drain RPC: the same path as SIGTERM.
    pub(crate) drain: CancellationToken,
}

impl PrefillService {
    fn check_layout(&self, l: Option<&v1::KvLayout>) -> Result<(), Status> {
        let ours = node_common::kv::proto_layout(&self.layout);
        match l {
            Some(l) if *l == ours => Ok(()),
            other => Err(ErrorCode::Validation.status(format!(
                "KV layout mismatch: this node has {ours:?}, the destination {other:?}"
            ))),
        }
    }
}

#[tonic::async_trait]
impl Prefill for PrefillService {
    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let _work = self.work.begin();
        let span = tracing::info_span!(
            "prefill",
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            chunks = tracing::field::Empty,
            compute_ms = tracing::field::Empty,
        );
        telemetry::set_parent(&span, telemetry::extract_grpc(request.metadata()));
        self.prefill_in(request.into_inner(), span.clone())
            .instrument(span)
            .await
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let _ = request;
        Ok(Response::new(v1::CancelResponse { found: false }))
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

impl PrefillService {
    async fn prefill_in(
        &self,
        r: v1::PrefillRequest,
        span: tracing::Span,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let num_tokens = r.prompt_ids.len();
        span.record("request_id", r.request_id.as_str());
        span.record("prompt_tokens", num_tokens as i64);
        let req = convert::request(
            seq_id,
            r.prompt_ids,
            r.sampling.as_ref(),
            r.stopping.as_ref(),
        );
        let mut first_tx = None;
        let layers_tx = match r.dest {
            Some(dest) => {
                self.check_layout(dest.layout.as_ref())?;
                let needed = num_tokens.div_ceil(self.layout.block_size);
                if dest.block_ids.len() != needed {
                    return Err(ErrorCode::Validation.status(format!(
                        "destination has {} blocks, the prompt needs {needed}",
                        dest.block_ids.len()
                    )));
                }
                let (ltx, lrx) = mpsc::unbounded_channel();
                let (ftx, frx) = oneshot::channel();
                first_tx = Some(ftx);
                let wire = node_common::kv::wire_layout(&self.layout);
                let push_work = self.work.begin();
                let kv_span = tracing::info_span!(
                    "kv_transfer",
                    xfer_id = dest.xfer_id as i64,
                    kv_endpoint = %dest.kv_endpoint,
                    layers = self.layout.num_layers as i64,
                    bytes = tracing::field::Empty,
                    tail_ms = tracing::field::Empty,
                );
                let push = run_push_task(
                    Arc::clone(&self.transport),
                    self.clients.clone(),
                    dest,
                    self.layout.num_layers as u32,
                    wire,
                    lrx,
                    frx,
                    num_tokens as u32,
                );
                tokio::spawn(
                    async move {
                        // run_push_task logs and counts its own failures.
                        let _ = push.await;
                        drop(push_work);
                    }
                    .instrument(kv_span),
                );
                Some(ltx)
            }
            None => None,
        };
        // If this call is dropped (the gateway gave up), stop computing the prompt.
        let guard = CancelGuard {
            handle: self.handle.clone(),
            seq_id,
            armed: true,
        };
        let outcome = self.handle.prefill(req, layers_tx).await;
        let mut guard = guard;
        guard.armed = false;
        let outcome = outcome.map_err(|e| e.to_status())?;
        let token = convert::token(&outcome.first);
        if let Some(tx) = first_tx {
            let _ = tx.send(token.clone());
        }
        metrics::histogram!("fission_prefill_time_to_first_token_seconds")
            .record(outcome.elapsed.as_secs_f64());
        span.record("compute_ms", outcome.elapsed.as_secs_f64() * 1e3);
        metrics::counter!("fission_prefill_tokens_total").increment(num_tokens as u64);
        Ok(Response::new(v1::PrefillResponse {
            first_token: Some(token),
            num_tokens: num_tokens as u32,
            cached_tokens: 0,
            prefill_us: outcome.elapsed.as_micros() as u64,
            transfer_tail_us: 0,
            kv_bytes: 0,
        }))
    }
}

struct CancelGuard {
    handle: EngineHandle,
    seq_id: SeqId,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.handle.cancel(self.seq_id);
        }
    }
}
