//! The prefill node's gRPC service.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use engine::ids::SeqId;
use kv_types::{KvLayout, TransferId};
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::{refuse_if_draining, WorkTracker};
use proto::v1::prefill_server::Prefill;
use proto::v1::{self};
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::actor::{Arrival, EngineHandle};
use crate::metrics::ERRORS;
use crate::push::{run_push_task, DecodeClients, PushJob, Transport};

pub struct PrefillService {
    pub(crate) handle: EngineHandle,
    pub(crate) transport: Arc<Transport>,
    pub(crate) clients: DecodeClients,
    pub(crate) layout: KvLayout,
    pub(crate) info: v1::NodeInfo,
    pub(crate) next_seq: AtomicU64,
    /// Prefill calls and their KV pushes in flight: a draining node waits for them.
    pub(crate) work: WorkTracker,
    /// Cancelled by the drain (SIGTERM or the Drain RPC). Once it is, new prompts are refused.
    pub(crate) drain: CancellationToken,
}

impl PrefillService {
    fn check_layout(&self, l: Option<&v1::KvLayout>) -> Result<(), Failure> {
        match proto::convert::layout(l) {
            Ok(theirs) if theirs == self.layout => Ok(()),
            Ok(theirs) => Err(Failure::new(
                ErrorCode::Validation,
                format!(
                    "KV layout mismatch: this node has {}, the destination {theirs}",
                    self.layout
                ),
            )),
            Err(e) => Err(Failure::new(
                ErrorCode::Validation,
                format!("destination: {e}"),
            )),
        }
    }
}

#[tonic::async_trait]
impl Prefill for PrefillService {
    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let arrived = Instant::now();
        let _work = self.work.begin();
        let span = tracing::info_span!(
            "prefill",
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            chunks = tracing::field::Empty,
            compute_ms = tracing::field::Empty,
            error_type = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        telemetry::set_parent(&span, telemetry::extract_grpc(request.metadata()));
        // After set_parent: a child made earlier would fix the parent's context too soon.
        let arrival = Arrival {
            at: arrived,
            span: span.clone(),
            queue_wait: tracing::info_span!(parent: &span, "queue_wait"),
        };
        self.prefill_in(request.into_inner(), arrival)
            .instrument(span.clone())
            .await
            .map_err(|f| ERRORS.report(f, &span))
    }
}

impl PrefillService {
    async fn prefill_in(
        &self,
        r: v1::PrefillRequest,
        arrival: Arrival,
    ) -> Result<Response<v1::PrefillResponse>, Failure> {
        let span = arrival.span.clone();
        span.record("request_id", r.request_id.as_str());
        refuse_if_draining(&self.drain, &self.info, "prompts")?;
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let num_tokens = r.prompt_ids.len();
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
                let needed = self.layout.blocks_for(num_tokens);
                if dest.block_ids.len() != needed {
                    return Err(Failure::new(
                        ErrorCode::Validation,
                        format!(
                            "destination has {} blocks, the prompt needs {needed}",
                            dest.block_ids.len()
                        ),
                    ));
                }
                let (ltx, lrx) = mpsc::unbounded_channel();
                let (ftx, frx) = oneshot::channel();
                first_tx = Some(ftx);
                let push_work = self.work.begin();
                let kv_span = tracing::info_span!(
                    "kv_transfer",
                    request_id = r.request_id.as_str(),
                    xfer_id = dest.xfer_id as i64,
                    kv_endpoint = %dest.kv_endpoint,
                    layers = i64::from(self.layout.num_layers),
                    bytes = tracing::field::Empty,
                    tail_ms = tracing::field::Empty,
                    error_type = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                );
                let push = run_push_task(
                    PushJob {
                        transport: Arc::clone(&self.transport),
                        clients: self.clients.clone(),
                        xfer_id: TransferId(dest.xfer_id),
                        dest,
                        layout: self.layout,
                        num_tokens: num_tokens as u32,
                        request_id: r.request_id.clone(),
                    },
                    lrx,
                    frx,
                );
                tokio::spawn(
                    async move {
                        // run_push_task counts its own failures and marks its span.
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
        let outcome = self.handle.prefill(req, layers_tx, arrival).await;
        let mut guard = guard;
        guard.armed = false;
        let outcome = outcome?;
        let token = convert::token(&outcome.first);
        if let Some(tx) = first_tx {
            let _ = tx.send(token.clone());
        }
        // From the RPC's arrival: queueing on the engine thread is part of this node's TTFT.
        metrics::histogram!("fission_prefill_time_to_first_token_seconds")
            .record(outcome.elapsed.as_secs_f64());
        span.record("compute_ms", outcome.compute.as_secs_f64() * 1e3);
        metrics::counter!("fission_prefill_tokens_total").increment(num_tokens as u64);
        Ok(Response::new(v1::PrefillResponse {
            first_token: Some(token),
            num_tokens: num_tokens as u32,
            cached_tokens: outcome.cached_tokens as u32,
            prefill_us: outcome.compute.as_micros() as u64,
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
