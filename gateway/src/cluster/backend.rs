//! The real [`Backend`]: routes each request to a decode node (and, unless it is short or no
//! prefill node is up, a prefill node) and streams the tokens back. The checks and the route's
//! metrics are [`super::route`]'s; the request's life from its first placement (ranking and
//! placing it, prefill attempts, stall deadlines, migration) [`super::driver`]'s, opening it on
//! a decode node [`super::placement`]'s, which failures are retried [`super::retry`]'s, and the
//! wire conversions [`super::wire`]'s.

use std::sync::Arc;

use futures::future::BoxFuture;
use tracing::Instrument;

use super::config::ClusterConfig;
use super::discovery::Role;
use super::pool::Pools;
use super::route::route;
use super::routing::RoutingPolicy;
use crate::backend::Backend;
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

pub struct ClusterBackend {
    pools: Arc<Pools>,
    config: ClusterConfig,
    policy: Arc<dyn RoutingPolicy>,
}

impl ClusterBackend {
    pub fn new(pools: Arc<Pools>, config: ClusterConfig, policy: Box<dyn RoutingPolicy>) -> Self {
        ClusterBackend {
            pools,
            config,
            policy: Arc::from(policy),
        }
    }
}

impl Backend for ClusterBackend {
    fn generate(
        &self,
        request: ValidRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>> {
        let pools = Arc::clone(&self.pools);
        let config = self.config.clone();
        let policy = Arc::clone(&self.policy);
        let span = tracing::info_span!(
            "route",
            policy = policy.name(),
            mode = tracing::field::Empty,
            decode_node = tracing::field::Empty,
            prefill_node = tracing::field::Empty,
            decode_reason = tracing::field::Empty,
            prefill_reason = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        Box::pin(async move { route(&pools, &config, &policy, request).await }.instrument(span))
    }

    fn is_ready(&self) -> bool {
        !self.pools.ready(Role::Decode).is_empty()
    }

    fn max_context(&self) -> Option<usize> {
        self.pools
            .all()
            .iter()
            .filter(|n| n.is_ready())
            .filter_map(|n| n.info().map(|i| i.max_context as usize))
            .filter(|&c| c > 0)
            .min()
    }

    fn model_types(&self) -> Option<crate::backend::ModelTypes> {
        self.pools
            .all()
            .iter()
            .filter(|n| n.is_ready())
            .find_map(|n| n.info().as_ref().and_then(crate::backend::ModelTypes::of))
    }

    fn describe(&self) -> serde_json::Value {
        let nodes: Vec<serde_json::Value> = self
            .pools
            .all()
            .iter()
            .map(|n| {
                serde_json::json!({
                    "node_id": n.entry.node_id,
                    "role": n.entry.role.as_str(),
                    "endpoint": n.entry.grpc_endpoint,
                    "ready": n.is_ready(),
                    "draining": n.entry.draining,
                    "registered": n.registered,
                    "in_flight": n.in_flight(),
                    "max_context": n.info().map(|i| i.max_context),
                    "model_types": n.info().as_ref().and_then(crate::backend::ModelTypes::of),
                    "cached_blocks": self.pools.cached_blocks(n),
                    "load": self.pools.load(n).map(|l| serde_json::json!({
                        "free_blocks": l.free_blocks,
                        "queued_prefill_tokens": l.queued_prefill_tokens,
                        "running_sequences": l.running_sequences,
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "kind": "cluster",
            "max_local_prefill_tokens": self.config.max_local_prefill_tokens,
            "routing": self.policy.name(),
            "nodes": nodes,
            // Prefill→decode pairs routed around for now (see `super::pairs`).
            "bad_pairs": self.pools.pairs().bad_pairs(),
            "pair_failures_to_mark": self.pools.pairs().config().failures_to_mark,
            "pair_cool_off_ms": self.pools.pairs().config().cool_off.as_millis() as u64,
        })
    }
}
