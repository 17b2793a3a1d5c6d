//! The RPC sequences that start a request on the nodes.
//!
//! Colocated: `LocalGenerate` on the first decode node that accepts it.
//!
//! Disaggregated: `Reserve` on a decode node, open its token `Stream` (before the KV can
//! arrive, so no token is missed), then `Prefill` on the prefill node with the reserved blocks
//! as destination. The prefill response carries the first token, so time to first token does
//! not wait for the transfer's tail; the rest comes from the decode stream.

use std::sync::Arc;

use futures::StreamExt;
use proto::v1::{self, reserve_response};
use proto::ErrorCode;

use super::cancel::{Guarded, RemoteCancel};
use super::pool::{InFlight, Node};
use super::resume::{watch_push, Resume};
use super::retry::{decode_failed, node_failed, Attempt};
use super::wire::{generated, sampling, stopping, upstream};
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Generates `r` on the first of `decodes` that accepts it, prefilling there.
pub(crate) async fn colocated(
    decodes: &[Arc<Node>],
    r: &ValidRequest,
) -> Result<TokenStream, GatewayError> {
    let mut last = None;
    for node in decodes {
        let in_flight = InFlight::new(node);
        tracing::Span::current().record("decode_node", node.entry.node_id.as_str());
        let call = node
            .decode_client()
            .local_generate(telemetry::with_trace(v1::LocalGenerateRequest {
                request_id: r.request_id.to_string(),
                prompt_ids: r.prompt_ids.clone(),
                sampling: Some(sampling(r)),
                stopping: Some(stopping(r)),
            }))
            .await;
        match call {
            Ok(stream) => {
                let inner = stream
                    .into_inner()
                    .map(|t| t.map(generated).map_err(upstream));
                // Dropping the call's stream cancels the sequence on the node.
                return Ok(Box::pin(Guarded::new(
                    Box::pin(inner),
                    None,
                    false,
                    vec![in_flight],
                )));
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted => last = Some(s),
            Err(s) if node_failed(&s) => {
                node.quarantine();
                last = Some(s)
            }
            Err(s) => return Err(upstream(s)),
        }
    }
    Err(last.map(upstream).unwrap_or(GatewayError::Unavailable {
        reason: "no decode node accepted the request".into(),
    }))
}

/// A reservation on a decode node with its token stream open.
struct Reserved {
    node: Arc<Node>,
    res: v1::Reserved,
    cancel: RemoteCancel,
    tokens: tonic::Streaming<v1::Token>,
}

/// Reserves on the best-ranked of `decodes` that has room and opens its token stream. A node
/// that fails either call as a dead or draining node does is skipped for the next one.
async fn reserve(decodes: &[Arc<Node>], r: &ValidRequest) -> Result<Reserved, Attempt> {
    for node in decodes {
        let resp = node
            .decode_client()
            .reserve(telemetry::with_trace(v1::ReserveRequest {
                request_id: r.request_id.to_string(),
                prompt_ids: r.prompt_ids.clone(),
                sampling: Some(sampling(r)),
                stopping: Some(stopping(r)),
            }))
            .await;
        let res = match resp.map(|x| x.into_inner().result) {
            Ok(Some(reserve_response::Result::Reserved(res))) => res,
            Ok(Some(reserve_response::Result::Busy(why))) => {
                tracing::debug!(node_id = %node.entry.node_id, %why, "decode node busy");
                continue;
            }
            Ok(None) => {
                return Err(Attempt::Fail(GatewayError::backend(
                    ErrorCode::Internal,
                    "empty reserve response",
                )))
            }
            Err(s) if node_failed(&s) => {
                decode_failed(node, "reserve", &s);
                continue;
            }
            Err(s) => return Err(Attempt::Fail(upstream(s))),
        };
        let cancel = RemoteCancel::new(Arc::clone(node), res.xfer_id);
        let stream = node
            .decode_client()
            .stream(telemetry::with_trace(v1::StreamRequest {
                xfer_id: res.xfer_id,
            }))
            .await;
        match stream {
            Ok(tokens) => {
                return Ok(Reserved {
                    node: Arc::clone(node),
                    res,
                    cancel,
                    tokens: tokens.into_inner(),
                })
            }
            Err(s) if node_failed(&s) => {
                cancel.fire();
                decode_failed(node, "stream", &s);
            }
            Err(s) => {
                cancel.fire();
                return Err(Attempt::Fail(upstream(s)));
            }
        }
    }
    metrics::counter!("fission_gateway_no_capacity_total").increment(1);
    Err(Attempt::Fail(GatewayError::backend(
        ErrorCode::Overloaded,
        "every decode node is out of KV blocks",
    )))
}

/// One disaggregated attempt: reserve on a decode node, then prefill on `prefill` into it.
pub(crate) async fn disaggregated(
    decodes: &[Arc<Node>],
    prefill: &Arc<Node>,
    r: &ValidRequest,
) -> Result<TokenStream, Attempt> {
    let Reserved {
        node: decode,
        res,
        cancel,
        tokens,
    } = reserve(decodes, r).await?;
    let decode_guard = InFlight::new(&decode);
    let prefill_guard = InFlight::new(prefill);
    // Watched from before the call: the node may die the moment it has answered.
    let lost = prefill.watch_lost();
    let span = tracing::Span::current();
    span.record("decode_node", decode.entry.node_id.as_str());
    span.record("prefill_node", prefill.entry.node_id.as_str());
    tracing::debug!(
        request_id = %r.request_id,
        decode = %decode.entry.node_id,
        prefill = %prefill.entry.node_id,
        xfer_id = res.xfer_id,
        "route"
    );
    let resp = prefill
        .prefill_client()
        .prefill(telemetry::with_trace(v1::PrefillRequest {
            request_id: r.request_id.to_string(),
            prompt_ids: r.prompt_ids.clone(),
            sampling: Some(sampling(r)),
            stopping: Some(stopping(r)),
            dest: Some(v1::KvDestination {
                kv_endpoint: res.kv_endpoint.clone(),
                xfer_id: res.xfer_id,
                epoch: res.epoch,
                block_ids: res.block_ids.clone(),
                decode_endpoint: decode.entry.grpc_endpoint.clone(),
                layout: res.layout,
            }),
        }))
        .await;
    drop(prefill_guard);
    let first = match resp {
        Ok(p) => p.into_inner().first_token.map(generated),
        Err(s) => {
            cancel.fire();
            return Err(if node_failed(&s) {
                Attempt::Retry(upstream(s))
            } else {
                Attempt::Fail(upstream(s))
            });
        }
    };
    let Some(first) = first else {
        cancel.fire();
        return Err(Attempt::Fail(GatewayError::backend(
            ErrorCode::Internal,
            "prefill returned no first token",
        )));
    };
    let rest = tokens.map(|t| t.map(generated).map_err(upstream));
    if first.finish_reason.is_some() {
        // The decode node frees its blocks when it sees the first token end the request.
        cancel.fire();
        let once = futures::stream::once(async move { Ok(first) });
        return Ok(Box::pin(Guarded::new(
            Box::pin(once),
            None,
            true,
            vec![decode_guard],
        )));
    }
    let resume = Resume {
        decodes: decodes.to_vec(),
        request: r.clone(),
        first_id: first.id,
        cancel: cancel.clone(),
        prefill_node: prefill.entry.node_id.clone(),
    };
    let rest = watch_push(Box::pin(rest), lost, resume);
    let inner = futures::stream::once(async move { Ok(first) }).chain(rest);
    Ok(Box::pin(Guarded::new(
        Box::pin(inner),
        Some(cancel),
        false,
        vec![decode_guard],
    )))
}

#[cfg(test)]
mod tests {
    use crate::backend::Backend;
    use crate::cluster::fake_nodes::{self, drain, request, PrefillScript, ReserveScript};

    #[tokio::test]
    async fn a_full_or_failing_decode_node_is_skipped_for_the_next() {
        let full = fake_nodes::decode(ReserveScript::Busy, Some(3)).await;
        let dead = fake_nodes::decode(ReserveScript::Fail(tonic::Code::Unavailable), None).await;
        let good = fake_nodes::decode(ReserveScript::Reserve, Some(3)).await;
        let prefill = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let backend = fake_nodes::backend(&[&prefill], &[&full, &dead, &good]).await;

        let (ids, _, _) = drain(backend.generate(request()).await.expect("served")).await;
        assert_eq!(ids, vec![100, 201, 202, 203]);
        assert_eq!(full.calls.of("reserve").len(), 1);
        assert_eq!(dead.calls.of("reserve").len(), 1);
        assert_eq!(good.calls.of("stream"), vec!["1"]);
        assert!(full.calls.of("stream").is_empty());
    }

    #[tokio::test]
    async fn no_decode_node_with_room_is_overloaded() {
        let full = fake_nodes::decode(ReserveScript::Busy, None).await;
        let prefill = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let backend = fake_nodes::backend(&[&prefill], &[&full]).await;
        let err = match backend.generate(request()).await {
            Ok(_) => panic!("no room"),
            Err(e) => e,
        };
        assert_eq!(err.code(), proto::ErrorCode::Overloaded, "{err}");
        assert!(prefill.calls.of("prefill").is_empty());
    }
}
