//! Which failures cost a retry, and the retry of a disaggregated request across prefill nodes:
//! a prefill node that fails as a dead or draining one does is quarantined and the next one is
//! tried with a fresh reservation (the failed push may have written part of the old). When
//! every prefill node tried has failed, the decode node prefills the prompt itself.

use std::sync::Arc;

use super::calls::{colocated, disaggregated};
use super::pool::Node;
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Prefill nodes tried for one request before falling back to the decode node.
pub(crate) const MAX_PREFILL_ATTEMPTS: usize = 3;

/// The outcome of one disaggregated attempt that did not produce a stream.
pub(crate) enum Attempt {
    /// The prefill node failed as a dead or unreachable node does: try another.
    Retry(GatewayError),
    Fail(GatewayError),
}

/// Codes a dead, restarting or draining node produces; the request itself was fine.
pub(crate) fn node_failed(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

/// A decode node failed a call as a dead or draining node does: skip it for a while.
pub(crate) fn decode_failed(node: &Node, call: &str, s: &tonic::Status) {
    tracing::info!(node_id = %node.entry.node_id, call, code = ?s.code(), message = s.message(), "decode node failed a call; trying the next one");
    node.quarantine();
}

/// Serves `r` on the ranked `decodes` with the ranked `prefills`, retrying past failed
/// prefill nodes and falling back to colocated prefill.
pub(crate) async fn with_prefill_retries(
    decodes: &[Arc<Node>],
    prefills: &[Arc<Node>],
    r: &ValidRequest,
) -> Result<TokenStream, GatewayError> {
    let span = tracing::Span::current();
    for (attempt, prefill) in prefills.iter().take(MAX_PREFILL_ATTEMPTS).enumerate() {
        span.record("attempts", attempt as i64 + 1);
        match disaggregated(decodes, prefill, r).await {
            Ok(stream) => return Ok(stream),
            Err(Attempt::Retry(e)) => {
                prefill.quarantine();
                metrics::counter!("fission_gateway_prefill_retries_total").increment(1);
                tracing::info!(
                    request_id = %r.request_id,
                    attempt = attempt as i64 + 1,
                    prefill_node = %prefill.entry.node_id,
                    error = %e,
                    "prefill attempt failed; trying the next prefill node"
                );
            }
            Err(Attempt::Fail(e)) => return Err(e),
        }
    }
    // Every prefill node tried has failed (a pool that just lost its only node, say): the
    // decode node can still prefill the prompt itself, which beats failing the request.
    metrics::counter!("fission_gateway_route_total", "mode" => "colocated", "reason" => "prefill_failed")
        .increment(1);
    span.record("mode", "colocated");
    span.record("prefill_reason", "prefill_failed");
    tracing::info!(request_id = %r.request_id, "no prefill node answered; prefilling on the decode node");
    colocated(decodes, r).await
}

#[cfg(test)]
mod tests {
    use crate::backend::Backend;
    use crate::cluster::fake_nodes::{self, drain, request, PrefillScript, ReserveScript};
    use crate::request::FinishReason;

    #[tokio::test]
    async fn a_prefill_node_that_fails_like_a_dead_one_costs_a_retry_not_the_request() {
        let dead = fake_nodes::prefill(PrefillScript::Fail(tonic::Code::Unavailable)).await;
        let good = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let decode = fake_nodes::decode(ReserveScript::Reserve, Some(3)).await;
        let backend = fake_nodes::backend(&[&dead, &good], &[&decode]).await;

        let stream = backend.generate(request()).await.expect("served");
        let (ids, indices, finish) = drain(stream).await;
        assert_eq!(ids, vec![100, 201, 202, 203]);
        assert_eq!(indices, vec![0, 1, 2, 3]);
        assert_eq!(finish, Some(FinishReason::Length));
        // One attempt each; the failed attempt's reservation was given back, and a fresh one
        // went to the second prefill node.
        assert_eq!(dead.calls.of("prefill"), vec!["1"]);
        assert_eq!(good.calls.of("prefill"), vec!["2"]);
        assert_eq!(decode.calls.of("reserve").len(), 2);
        testkit::wait_until_async(
            "the failed attempt's cancel",
            std::time::Duration::from_secs(5),
            || {
                let cancels = decode.calls.of("cancel");
                async move { cancels == ["1"] }
            },
        )
        .await;
        assert!(decode.calls.of("local_generate").is_empty());
        // The dead node is skipped for a while.
        let info = backend.describe();
        let ready: Vec<bool> = info["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .filter(|n| n["role"] == "prefill")
            .map(|n| n["ready"].as_bool().expect("ready"))
            .collect();
        assert_eq!(ready, vec![false, true], "{info}");
    }

    #[tokio::test]
    async fn a_prompt_the_prefill_node_rejects_is_not_retried() {
        let strict = fake_nodes::prefill(PrefillScript::Fail(tonic::Code::InvalidArgument)).await;
        let other = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let decode = fake_nodes::decode(ReserveScript::Reserve, Some(3)).await;
        let backend = fake_nodes::backend(&[&strict, &other], &[&decode]).await;

        let err = match backend.generate(request()).await {
            Ok(_) => panic!("a rejected prompt fails"),
            Err(e) => e,
        };
        assert_eq!(err.code(), proto::ErrorCode::Validation, "{err}");
        assert!(other.calls.of("prefill").is_empty(), "no retry");
        assert!(decode.calls.of("local_generate").is_empty());
    }

    #[tokio::test]
    async fn when_every_prefill_node_fails_the_decode_node_prefills() {
        let dead = fake_nodes::prefill(PrefillScript::Fail(tonic::Code::Unavailable)).await;
        let decode = fake_nodes::decode(ReserveScript::Reserve, Some(3)).await;
        let backend = fake_nodes::backend(&[&dead], &[&decode]).await;

        let (ids, _, finish) = drain(backend.generate(request()).await.expect("served")).await;
        assert_eq!(ids, vec![200, 201, 202, 203]);
        assert_eq!(finish, Some(FinishReason::Length));
        assert_eq!(decode.calls.of("local_generate"), vec!["11,12,13,14,15"]);
    }
}
