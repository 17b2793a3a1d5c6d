//! The routing decision for one request: rank the ready nodes of each role with the policy,
//! then serve colocated (short prompts, or no prefill node) or disaggregated.

use std::sync::Arc;

use proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::config::ClusterConfig;
use super::discovery::Role;
use super::driver::Driver;
use super::placement::{place, NotPlaced};
use super::pool::Pools;
use super::rank::rank;
use super::routing::RoutingPolicy;
use super::wire::spec;
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Routes `r`: places it on a decode node (holding room there: a reservation, or its place in
/// the node's queue) and starts the driver that serves it from there. Resolves once the
/// request is placed; everything after comes on the stream.
pub(crate) async fn route(
    pools: &Arc<Pools>,
    config: &ClusterConfig,
    policy: &Arc<dyn RoutingPolicy>,
    r: ValidRequest,
) -> Result<TokenStream, GatewayError> {
    if pools.ready(Role::Decode).is_empty() {
        return Err(GatewayError::Unavailable {
            reason: "no decode node is ready".into(),
        });
    }
    // Room for every token the request may produce and an error, so that the driver never
    // waits on a slow client: it reads the node's stream at once. Tokens a driver left unread
    // stay in h2's buffers, where ~10,000 small frames over a connection (its budget for
    // them) close it with GOAWAY ENHANCE_YOUR_CALM, failing every request on it.
    let (out, tokens) = mpsc::channel(r.stopping.max_new_tokens + 2);
    let driver = Driver {
        pools: Arc::clone(pools),
        policy: Arc::clone(policy),
        config: config.clone(),
        request: r,
        emitted: Vec::new(),
        epoch: 1,
        migrations: 0,
        prefill_attempts: 0,
        next_prefill: None,
        bound: Vec::new(),
        out,
    };
    let span = tracing::Span::current();
    let prompt = &driver.request.prompt_ids;
    let block_size = pools.ready(Role::Decode)[0].block_size();
    let hashes = prefix_hash::block_hashes(prompt, block_size);
    let decodes = rank(
        pools,
        policy.as_ref(),
        Role::Decode,
        prompt,
        block_size,
        &hashes,
    );
    span.record("decode_reason", decodes.reason.as_str());
    let local = driver.prefill_locally();
    // The prefill node is ranked when the prefill starts (`start_prefill`), once: ranking it
    // here too took a second round-robin turn per request, so that with two prefill nodes
    // every request went to the same one.
    let (mode, reason) = if !local {
        ("disaggregated", "default")
    } else if prompt.len() < config.max_local_prefill_tokens {
        ("colocated", "short_prompt")
    } else {
        ("colocated", "no_prefill_node")
    };
    metrics::counter!("fission_gateway_route_total", "mode" => mode, "reason" => reason)
        .increment(1);
    span.record("mode", mode);
    tracing::debug!(request_id = %driver.request.request_id, mode, reason, decode_reason = %decodes.reason, "route");
    let start = v1::GenerateStart {
        spec: Some(spec(&driver.request, &[])),
        local_prefill: local,
        epoch: driver.epoch,
    };
    // Each placement attempt counts (a queued request places again when room frees up).
    metrics::histogram!(crate::metrics::OVERHEAD)
        .record(driver.request.received_at.elapsed().as_secs_f64());
    let call = place(&decodes.nodes, start, config.max_stall)
        .await
        .map_err(NotPlaced::into_error)?;
    span.record("decode_node", call.node.entry.node_id.as_str());
    tokio::spawn(driver.run(call).instrument(span));
    Ok(Box::pin(ReceiverStream::new(tokens)))
}
