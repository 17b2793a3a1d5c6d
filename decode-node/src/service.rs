//! The decode node's gRPC service: `Generate` (one stream per request, served by a
//! [`Session`]), and `Done` and `Renew` from the prefill nodes that fill its reservations.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use engine::ids::SeqId;
use futures::Stream;
use kv_types::TransferId;
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::{refuse_if_draining, WorkTracker};
use proto::v1::decode_server::Decode;
use proto::v1::{self, generate_up};
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Span;

use crate::metrics::ERRORS;
use crate::session::{Session, SessionCtx};
use crate::session_event::SessionEvent;

/// How long a new Generate stream may take to send its GenerateStart.
const START_TIMEOUT: Duration = Duration::from_secs(5);

pub struct DecodeService {
    pub(crate) ctx: Arc<SessionCtx>,
    pub(crate) info: v1::NodeInfo,
    pub(crate) next_seq: Arc<AtomicU64>,
    /// Sessions in flight: a draining node waits for them.
    pub(crate) work: WorkTracker,
    /// Cancelled by the drain (SIGTERM or the Drain RPC). Once it is, new work is refused.
    pub(crate) drain: CancellationToken,
}

type DownStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateDown, Status>> + Send>>;

#[tonic::async_trait]
impl Decode for DecodeService {
    type GenerateStream = DownStream;

    async fn generate(
        &self,
        request: Request<Streaming<v1::GenerateUp>>,
    ) -> Result<Response<DownStream>, Status> {
        let span = stream_span(&request);
        let trace = telemetry::extract_grpc(request.metadata());
        self.generate_in(request.into_inner(), trace, span.clone())
            .await
            .map_err(|f| ERRORS.report(f, &span))
    }

    async fn done(
        &self,
        request: Request<v1::DoneRequest>,
    ) -> Result<Response<v1::DoneResponse>, Status> {
        let done = request.into_inner();
        let xfer_id = TransferId(done.xfer_id);
        self.ask(xfer_id, |reply| SessionEvent::Done { done, reply })
            .await
            .map(|()| Response::new(v1::DoneResponse {}))
            .map_err(|f| ERRORS.report(f, &Span::none()))
    }

    async fn renew(
        &self,
        request: Request<v1::RenewRequest>,
    ) -> Result<Response<v1::RenewResponse>, Status> {
        let r = request.into_inner();
        self.ask(TransferId(r.xfer_id), |reply| SessionEvent::Renew {
            epoch: r.epoch,
            reply,
        })
        .await
        .map(|()| Response::new(v1::RenewResponse {}))
        .map_err(|f| ERRORS.report(f, &Span::none()))
    }
}

impl DecodeService {
    /// Hands an event to the session waiting for `xfer_id` and returns its answer.
    async fn ask<T>(
        &self,
        xfer_id: TransferId,
        event: impl FnOnce(oneshot::Sender<Result<T, Failure>>) -> SessionEvent,
    ) -> Result<T, Failure> {
        let gone = || Failure::new(ErrorCode::NotFound, format!("no reservation {xfer_id}"));
        let session = self.ctx.transfers.session(xfer_id).ok_or_else(gone)?;
        let (reply, answer) = oneshot::channel();
        session.send(event(reply)).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    async fn generate_in(
        &self,
        mut up: Streaming<v1::GenerateUp>,
        trace: telemetry::Context,
        span: Span,
    ) -> Result<Response<DownStream>, Failure> {
        let first = tokio::time::timeout(START_TIMEOUT, up.message())
            .await
            .map_err(|_| Failure::new(ErrorCode::Timeout, "no GenerateStart within 5 s"))?
            .map_err(|s| Failure::new(ErrorCode::Cancelled, s.message().to_string()))?;
        let Some(v1::GenerateUp {
            msg: Some(generate_up::Msg::Start(start)),
        }) = first
        else {
            return Err(Failure::new(
                ErrorCode::Validation,
                "a Generate stream starts with GenerateStart",
            ));
        };
        let spec = start
            .spec
            .ok_or_else(|| Failure::new(ErrorCode::Validation, "GenerateStart without spec"))?;
        span.record("request_id", spec.request_id.as_str());
        refuse_if_draining(&self.drain, &self.info, "requests")?;
        let seq_id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        let request_id = spec.request_id.clone();
        let (tokens_tx, tokens_rx) = mpsc::unbounded_channel();
        // Backpressure: a gateway that stops reading stops the session at the next send.
        let (down, down_rx) = mpsc::channel(64);
        let mut session = Session {
            ctx: Arc::clone(&self.ctx),
            request: convert::request(seq_id, spec),
            request_id,
            trace,
            span,
            up,
            down,
            events: None,
            tokens_tx,
            tokens_rx,
            next_seq: Arc::clone(&self.next_seq),
            work: self.work.begin(),
        };
        let stage = if start.local_prefill {
            session.generate_here().await?
        } else {
            session.reserve(start.epoch.max(1)).await?
        };
        tokio::spawn(session.run(stage));
        Ok(Response::new(Box::pin(ReceiverStream::new(down_rx))))
    }
}

/// The `stream` span of a Generate call, a child of the caller's span.
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
