//! The UCX KV transport across real processes: `fission up --kv-transport ucx` with 1 prefill
//! and 1 decode node serves the reference tokens, with each layer put by UCX over its TCP
//! transport into memory the decode node registered (every push counted under
//! `transport="ucx"`), and gives every block back (issue 34).
//! Needs libucx0 (deploy/install-test-tools.sh installs it).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use testkit::cluster_builder::ClusterBuilder;
use testkit::references::assert_concurrent_references;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

#[test]
fn a_cluster_over_ucx_serves_reference_tokens() {
    // Before any other thread runs: the processes `fission up` starts inherit these. UCX over
    // TCP, what runs between hosts without RDMA hardware; and no shared memory beside it, so
    // the prefill node cannot pick shm for its same-host decode node.
    std::env::set_var("UCX_TLS", "tcp");
    std::env::set_var("FISSION_KV_SAME_HOST_SHM", "false");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(serves_reference_tokens());
}

async fn serves_reference_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ClusterBuilder::new(FISSION)
        .transport("ucx")
        .log(dir.path().join("cluster.log"))
        .start();
    assert_concurrent_references(&cluster.url, 8, |i| 8 + (i * 7) % 25).await;
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    // The prefill node dialled the decode node's UCX server, which admitted it (same user)
    // and named it a registered region.
    let log = std::fs::read_to_string(dir.path().join("cluster.log")).unwrap();
    assert!(log.contains("kv ucx server listening"), "{log}");
    assert!(log.contains("kv ucx connection ready"), "{log}");
    // Every push went over UCX: none through shared memory beside it.
    let ucx = cluster.kv_pushes("prefill-0", "ucx");
    assert!(ucx > 0.0, "{ucx}");
    assert_eq!(cluster.kv_pushes("prefill-0", "shm"), 0.0);
    cluster.wait_kv_released(Duration::from_secs(2)).await;
}
