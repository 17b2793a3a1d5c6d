//! The prefill node's gRPC service: one `Prefill` call per prompt attempt, answered with the
//! events of a [`Prompt`] task.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use engine::ids::SeqId;
use futures::Stream;
use kv_types::{KvLayout, TransferId};
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::{refuse_if_draining, WorkTracker};
use proto::v1;
use proto::v1::prefill_server::Prefill;
use proto::ErrorCode;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::actor::{Arrival, EngineHandle};
use crate::metrics::ERRORS;
use crate::prompt::{Destination, Prompt};
use crate::push::{DecodeClients, PushJob, Transport};

pub struct PrefillService {
    pub(crate) handle: EngineHandle,
    pub(crate) transport: Arc<Transport>,
    pub(crate) clients: DecodeClients,
    pub(crate) layout: KvLayout,
    pub(crate) info: v1::NodeInfo,
    pub(crate) next_seq: AtomicU64,
    /// Prompts and their KV pushes in flight: a draining node waits for them.
    pub(crate) work: WorkTracker,
    /// Cancelled by the drain (SIGTERM or the Drain RPC). Once it is, new prompts are refused.
    pub(crate) drain: CancellationToken,
    /// Cancelled when the drain is over: prompts still in flight end.
    pub(crate) stop_streams: CancellationToken,
    /// How long a prompt's call may say nothing before it sends a heartbeat.
    pub(crate) heartbeat: Duration,
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

impl PrefillService {
    /// The first block of the prompt to push: the decode node holds `cached_tokens` tokens of
    /// it already, whole blocks and never the last one.
    fn push_from(&self, cached_tokens: u32, num_tokens: usize) -> Result<usize, Failure> {
        let block_size = self.layout.block_size.max(1);
        let cached = cached_tokens as usize;
        if !cached_tokens.is_multiple_of(block_size) || (cached > 0 && cached >= num_tokens) {
            return Err(Failure::new(
                ErrorCode::Validation,
                format!(
                    "the decode node holds {cached_tokens} cached tokens of a {num_tokens}-token \
                     prompt: not whole blocks of {block_size} short of its end"
                ),
            ));
        }
        Ok((cached_tokens / block_size) as usize)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<v1::PrefillEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Prefill for PrefillService {
    type PrefillStream = EventStream;

    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let arrived = Instant::now();
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
            .map_err(|f| ERRORS.report(f, &span))
    }
}

impl PrefillService {
    fn prefill_in(
        &self,
        r: v1::PrefillRequest,
        arrival: Arrival,
    ) -> Result<Response<EventStream>, Failure> {
        let spec = r
            .spec
            .ok_or_else(|| Failure::new(ErrorCode::Validation, "PrefillRequest without spec"))?;
        let span = arrival.span.clone();
        span.record("request_id", spec.request_id.as_str());
        refuse_if_draining(&self.drain, &self.info, "prompts")?;
        let num_tokens = spec.prompt_ids.len();
        span.record("prompt_tokens", num_tokens as i64);
        let request_id = spec.request_id.clone();
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let dest = match r.dest {
            Some(v1::KvDestination {
                decode_endpoint,
                reserved,
            }) => {
                let dest = reserved.ok_or_else(|| {
                    Failure::new(
                        ErrorCode::Validation,
                        "KvDestination without its reservation",
                    )
                })?;
                self.check_layout(dest.layout.as_ref())?;
                let push_from = self.push_from(dest.cached_tokens, num_tokens)?;
                let needed = self.layout.blocks_for(num_tokens) - push_from;
                if dest.block_ids.len() != needed {
                    return Err(Failure::new(
                        ErrorCode::Validation,
                        format!(
                            "destination has {} blocks, the prompt needs {needed} after the \
                             {} tokens the decode node holds",
                            dest.block_ids.len(),
                            dest.cached_tokens
                        ),
                    ));
                }
                let lease = Duration::from_millis(u64::from(dest.lease_ms.max(1)));
                Some(Destination {
                    lease,
                    push_from,
                    job: PushJob {
                        transport: Arc::clone(&self.transport),
                        clients: self.clients.clone(),
                        xfer_id: TransferId(dest.xfer_id),
                        dest,
                        decode_endpoint,
                        layout: self.layout,
                        request_id,
                    },
                })
            }
            None => None,
        };
        let (events, events_rx) = mpsc::channel(16);
        let cancelled = self.stop_streams.child_token();
        let prompt = Prompt {
            handle: self.handle.clone(),
            clients: self.clients.clone(),
            request: convert::request(seq_id, spec),
            arrival,
            dest,
            heartbeat: self.heartbeat,
            events,
            cancelled: cancelled.clone(),
            work: self.work.begin(),
        };
        tokio::spawn(prompt.run());
        Ok(Response::new(Box::pin(Events {
            rx: events_rx,
            _cancel: cancelled.drop_guard(),
        })))
    }
}

/// A prompt's events; dropping it (the gateway gave up on the attempt) cancels the prompt.
struct Events {
    rx: mpsc::Receiver<Result<v1::PrefillEvent, Status>>,
    _cancel: tokio_util::sync::DropGuard,
}

impl Stream for Events {
    type Item = Result<v1::PrefillEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}
