//! Placing a request on a decode node: open its `Generate` stream and read the node's first
//! answer. Remote prefill: the reservation. Local prefill: the first heartbeat or token. A node
//! without room answers RESOURCE_EXHAUSTED; a dead or draining one fails the call, and is
//! skipped for the next. A live node answers at once, so one that answers nothing within the
//! stall deadline is hung or cut off: it is marked suspect and the next one is tried. Without
//! that deadline a request placed on a stopped node waited out the whole fault (20 s of
//! SIGSTOP, 10 s of a cut link) before its first token.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{self, generate_down, generate_up};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use super::pool::{InFlight, Node};
use super::retry::node_failed;
use super::wire::upstream;
use crate::error::GatewayError;

/// Placements a decode node did not answer within the stall deadline.
pub(crate) const PLACEMENT_TIMEOUTS: &str = "fission_gateway_placement_timeouts_total";

/// A request's open stream on one decode node.
pub(crate) struct DecodeCall {
    pub(crate) node: Arc<Node>,
    /// Reprefill goes up here; dropping it ends the request on the node (its blocks are freed).
    pub(crate) up: mpsc::Sender<v1::GenerateUp>,
    pub(crate) down: Streaming<v1::GenerateDown>,
    /// Remote prefill: where to push, at which epoch. `None` for local prefill.
    pub(crate) reserved: Option<v1::Reserved>,
    /// A token or heartbeat the node sent first (local prefill), to handle before the rest.
    pub(crate) first: Option<v1::GenerateDown>,
    /// Counts the request against the node from the moment it was chosen: placements run
    /// concurrently, and a node that counted its requests only once placed drew every request
    /// of a burst (24 of 24 on one of 4 nodes) while the first ones were still opening.
    _in_flight: InFlight,
}

impl DecodeCall {
    /// The last token is out: the request ends on the node (its side of the stream closes
    /// with `up`), and the node's trailers are read off the request's path.
    pub(crate) fn finish(self) {
        drain_to_end(self.down);
    }
}

/// Why no decode node took the request.
pub(crate) enum NotPlaced {
    /// Every node is out of room: the request waits in the queue.
    NoRoom,
    /// Every node failed or none is ready.
    Failed(GatewayError),
    /// The node refused the request itself (a validation error): no other node would take it.
    Refused(GatewayError),
}

impl NotPlaced {
    pub(crate) fn into_error(self) -> GatewayError {
        match self {
            NotPlaced::NoRoom => {
                metrics::counter!("fission_gateway_no_capacity_total").increment(1);
                GatewayError::backend(
                    proto::ErrorCode::Overloaded,
                    "every decode node is out of KV blocks",
                )
            }
            NotPlaced::Failed(e) | NotPlaced::Refused(e) => e,
        }
    }
}

/// Opens `start` on the first of `decodes` that takes it, giving each `max_stall` to answer.
pub(crate) async fn place(
    decodes: &[Arc<Node>],
    start: v1::GenerateStart,
    max_stall: Duration,
) -> Result<DecodeCall, NotPlaced> {
    let mut no_room = false;
    let mut last_failure = None;
    for node in decodes {
        let Ok(opened) = tokio::time::timeout(max_stall, open(node, start.clone())).await else {
            // Dropping the call resets its stream: should the node wake, it frees what it
            // reserved for it.
            tracing::warn!(node_id = %node.entry.node_id, ?max_stall, "decode node did not answer a new request; trying the next one");
            node.suspect("did not answer a new request");
            metrics::counter!(PLACEMENT_TIMEOUTS).increment(1);
            last_failure = Some(GatewayError::Unavailable {
                reason: format!(
                    "decode node {} did not answer within {max_stall:?}",
                    node.entry.node_id
                ),
            });
            continue;
        };
        match opened {
            Ok(call) => return Ok(call),
            // Before the RESOURCE_EXHAUSTED arm: a broken connection reads as one too.
            Err(s) if node_failed(&s) => {
                tracing::info!(node_id = %node.entry.node_id, code = ?s.code(), message = s.message(), "decode node failed to take the request; trying the next one");
                node.quarantine();
                last_failure = Some(upstream(s));
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted => no_room = true,
            Err(s) => return Err(NotPlaced::Refused(upstream(s))),
        }
    }
    if no_room {
        return Err(NotPlaced::NoRoom);
    }
    Err(NotPlaced::Failed(last_failure.unwrap_or(
        GatewayError::Unavailable {
            reason: "no decode node is ready".into(),
        },
    )))
}

async fn open(node: &Arc<Node>, start: v1::GenerateStart) -> Result<DecodeCall, tonic::Status> {
    // Before the first await: the next request's ranking already sees it.
    let in_flight = InFlight::new(node);
    let (up, up_rx) = mpsc::channel(4);
    up.send(v1::GenerateUp {
        msg: Some(generate_up::Msg::Start(start)),
    })
    .await
    .map_err(|_| tonic::Status::internal("the up stream closed"))?;
    let mut down = node
        .decode_client()
        .generate(telemetry::with_trace(ReceiverStream::new(up_rx)))
        .await?
        .into_inner();
    let first = down
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unavailable("the decode node ended the stream at once"))?;
    let (reserved, first) = match first.msg {
        Some(generate_down::Msg::Reserved(r)) => (Some(r), None),
        _ => (None, Some(first)),
    };
    Ok(DecodeCall {
        node: Arc::clone(node),
        up,
        down,
        reserved,
        first,
        _in_flight: in_flight,
    })
}

/// How long a finished call's stream may take to end before it is reset.
const STREAM_END_WAIT: Duration = Duration::from_secs(5);

/// Reads a finished call's stream to its end on a task of its own. Dropping the stream
/// instead resets it, and a loaded node's last frames (its trailers, a heartbeat) then reach
/// a stream h2 has forgotten (it remembers 50 resets for a second): h2 counts each such frame,
/// and at 1,024 over the connection's life failed every request on it with GOAWAY
/// ENHANCE_YOUR_CALM (two requests of 15,000 in the fault suite's etcd outage).
pub(crate) fn drain_to_end<T: Send + 'static>(mut stream: Streaming<T>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(STREAM_END_WAIT, async {
            while let Ok(Some(_)) = stream.message().await {}
        })
        .await;
    });
}
