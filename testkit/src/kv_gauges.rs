//! The KV gauges every cluster test checks at its end: each block, reservation and byte a node
//! holds for a request must be given back once the request is over. One list of them per
//! role, so that every test checks the same ones, and a wait on a `fission up` cluster.

use std::time::Duration;

use crate::fission::{http_get, metric, Up};
use crate::wait::wait_until_async;

/// A decode node's: blocks in use (the full-attention group's), blocks reserved for pushes,
/// bytes of every layer group, and reservations not yet released.
pub const DECODE: &[&str] = &[
    "fission_decode_kv_blocks_used",
    "fission_decode_kv_blocks_reserved",
    "fission_decode_kv_bytes_in_use",
    "fission_decode_reservations_outstanding",
];

/// A prefill node's: blocks in use and bytes of every layer group.
pub const PREFILL: &[&str] = &[
    "fission_prefill_kv_blocks_used",
    "fission_prefill_kv_bytes_in_use",
];

/// The gauges of a node named `node_id` (`decode-...` or `prefill-...`).
pub fn for_node(node_id: &str) -> &'static [&'static str] {
    if node_id.starts_with("decode") {
        DECODE
    } else {
        PREFILL
    }
}

/// What the node at `metrics_url` holds, summed over its gauges (an absent gauge reads 0).
pub fn held(node_id: &str, metrics_url: &str) -> f64 {
    for_node(node_id)
        .iter()
        .map(|g| metric(metrics_url, g))
        .sum()
}

/// The gauges of `node_id` missing from the exposition at `metrics_url`.
pub fn missing(node_id: &str, metrics_url: &str) -> Vec<&'static str> {
    let page = http_get(metrics_url).unwrap_or_default();
    for_node(node_id)
        .iter()
        .copied()
        .filter(|g| !page.lines().any(|l| l.split_whitespace().next() == Some(g)))
        .collect()
}

impl Up {
    /// Waits up to `within` for every KV gauge of every node to read 0, then checks each
    /// gauge is exported at all (an absent one would read 0 above).
    pub async fn wait_kv_released(&self, within: Duration) {
        wait_until_async("every KV gauge of every node back to 0", within, || {
            let total: f64 = self.metrics.iter().map(|(node, url)| held(node, url)).sum();
            async move { total == 0.0 }
        })
        .await;
        for (node, url) in &self.metrics {
            let missing = missing(node, url);
            assert!(missing.is_empty(), "{node} exports no {missing:?}");
        }
    }
}
