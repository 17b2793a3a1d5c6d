//! Ranking the ready nodes of one role for a request with the routing policy, from their
//! published load, in-flight counts and cached prefix blocks. The driver ranks the decode nodes
//! at each placement of a request, the prefill nodes when it starts a prefill.

use std::sync::Arc;

use super::discovery::Role;
use super::pool::{Node, Pools};
use super::routing::{Candidate, RoutingPolicy};

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
