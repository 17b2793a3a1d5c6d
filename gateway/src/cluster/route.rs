//! The routing decision for one request: rank the ready nodes of each role with the policy,
//! then serve colocated (short prompts, or no prefill node) or disaggregated.

use std::sync::Arc;

use super::backend::ClusterConfig;
use super::calls::colocated;
use super::discovery::Role;
use super::pool::{Node, Pools};
use super::retry::with_prefill_retries;
use super::routing::{Candidate, RoutingPolicy};
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

/// Routes `r` and starts it; see the module docs.
pub(crate) async fn route(
    pools: &Pools,
    config: &ClusterConfig,
    policy: &dyn RoutingPolicy,
    r: ValidRequest,
) -> Result<TokenStream, GatewayError> {
    let ready = pools.ready(Role::Decode);
    let Some(first) = ready.first() else {
        return Err(GatewayError::Unavailable {
            reason: "no decode node is ready".into(),
        });
    };
    let block_size = first.block_size();
    let hashes = prefix_hash::block_hashes(&r.prompt_ids, block_size);
    let rank_role = |role| rank(pools, policy, role, &r.prompt_ids, block_size, &hashes);
    let decodes = rank_role(Role::Decode);
    let prefills = rank_role(Role::Prefill);
    let span = tracing::Span::current();
    span.record("decode_reason", decodes.reason.as_str());
    let short = r.prompt_ids.len() < config.max_local_prefill_tokens;
    if prefills.nodes.is_empty() || short {
        let why = if short {
            "short_prompt"
        } else {
            "no_prefill_node"
        };
        metrics::counter!("fission_gateway_route_total", "mode" => "colocated", "reason" => why)
            .increment(1);
        span.record("mode", "colocated");
        span.record("prefill_reason", why);
        tracing::debug!(request_id = %r.request_id, mode = "colocated", reason = why, decode_reason = %decodes.reason, "route");
        return colocated(&decodes.nodes, &r).await;
    }
    metrics::counter!("fission_gateway_route_total", "mode" => "disaggregated", "reason" => "default").increment(1);
    span.record("mode", "disaggregated");
    span.record("prefill_reason", prefills.reason.as_str());
    tracing::debug!(
        request_id = %r.request_id,
        mode = "disaggregated",
        policy = policy.name(),
        decode_reason = %decodes.reason,
        prefill_reason = %prefills.reason,
        "route"
    );
    with_prefill_retries(&decodes.nodes, &prefills.nodes, &r).await
}
