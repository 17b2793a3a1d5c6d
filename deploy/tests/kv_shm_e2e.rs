//! The shared-memory KV transport across real processes: `fission up --kv-transport shm` with
//! 1 prefill and 1 decode node on one host serves the reference tokens, with the KV moved
//! through memory both nodes map, and gives every block back (issue 34).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use testkit::cluster_builder::ClusterBuilder;
use testkit::references::assert_concurrent_references;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_shared_memory_serves_reference_tokens() {
    let cluster = ClusterBuilder::new(FISSION).transport("shm").start();
    assert_concurrent_references(&cluster.url, 8, |i| 8 + (i * 7) % 25).await;
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    cluster.wait_kv_released(Duration::from_secs(2)).await;
}
