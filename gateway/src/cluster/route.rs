//! The way in for one request: the checks before it is placed and the route's metrics. The
//! request's driver ranks the decode nodes and places it ([`super::driver`]), as it does again
//! whenever the request moves; the route counts how it was sent (colocated: a short prompt, or
//! no prefill node; disaggregated otherwise).

use std::sync::Arc;

use super::config::ClusterConfig;
use super::discovery::Role;
use super::driver::Driver;
use super::placement::NotPlaced;
use super::pool::Pools;
use super::routing::RoutingPolicy;
use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Routes `r`: its driver places it on a decode node (holding room there: a reservation, or
/// its place in the node's queue) and serves it from there. Resolves once the request is
/// placed; everything after comes on the stream.
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
    let (driver, tokens) = Driver::new(pools, policy, config, r);
    // The prefill node is ranked when the prefill starts (the driver's `start_prefill`), once:
    // ranking it here too took a second round-robin turn per request, so that with two prefill
    // nodes every request went to the same one.
    let placement = driver.placement();
    let span = tracing::Span::current();
    span.record("decode_reason", placement.decodes.reason.as_str());
    let (mode, reason) = if !placement.local_prefill {
        ("disaggregated", "default")
    } else if driver.request().prompt_ids.len() < config.max_local_prefill_tokens {
        ("colocated", "short_prompt")
    } else {
        ("colocated", "no_prefill_node")
    };
    metrics::counter!("fission_gateway_route_total", "mode" => mode, "reason" => reason)
        .increment(1);
    span.record("mode", mode);
    tracing::debug!(request_id = %driver.request().request_id, mode, reason, decode_reason = %placement.decodes.reason, "route");
    // Each placement attempt counts (a queued request places again when room frees up).
    metrics::histogram!(crate::metrics::OVERHEAD)
        .record(driver.request().received_at.elapsed().as_secs_f64());
    driver
        .start(placement)
        .await
        .map_err(NotPlaced::into_error)?;
    Ok(tokens)
}
