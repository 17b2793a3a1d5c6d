//! The routing decision for one request: rank the ready nodes of each role with the policy,
//! then serve colocated (short prompts, or no prefill node) or disaggregated.

use std::sync::Arc;

use proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::backend::ClusterConfig;
use super::discovery::Role;
use super::driver::Driver;
use super::placement::{place, NotPlaced};
use super::pool::{Node, Pools};
use super::routing::{Candidate, RoutingPolicy};
use super::wire::spec;
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Ready nodes of one role in the order the policy ranks them, and why.
pub(crate) struct Ranked {
    pub(crate) nodes: Vec<Arc<Node>>,
    pub(crate) reason: String,
}

pub(crate) fn rank(
    pools: &Pools,
    policy: &dyn RoutingPolicy,
    role: Role,
    prompt_ids: &[u32],
    block_size: usize,
    hashes: &[u64],
) -> Ranked {
    let nodes = pools.ready(role);
    let candidates: Vec<Candidate> = nodes
        .iter()
        .map(|n| {
            let load = pools.load(n);
            let total = n.total_blocks();
            Candidate {
                node_id: n.entry.node_id.clone(),
                // Without published load (static clusters) a node counts as empty: in-flight
                // counts still spread the work.
                free_blocks: load.map_or(total, |l| l.free_blocks),
                total_blocks: total,
                running_sequences: load.map_or(0, |l| l.running_sequences),
                queued_prefill_tokens: load.map_or(0, |l| l.queued_prefill_tokens),
                in_flight: n.in_flight() as u64,
                cached_prefix_blocks: pools.overlap_blocks(n, hashes),
            }
        })
        .collect();
    let ranking = match role {
        Role::Decode => policy.rank_decode(prompt_ids.len(), block_size, &candidates),
        Role::Prefill => policy.rank_prefill(prompt_ids.len(), block_size, &candidates),
    };
    Ranked {
        nodes: ranking
            .order
            .iter()
            .map(|&i| Arc::clone(&nodes[i]))
            .collect(),
        reason: ranking.reason,
    }
}

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
