//! Shared memory picked with no flag (issue 34): `fission up` with 1 prefill and 1 decode node
//! on one host, on the default (QUIC, mutual TLS) transport and no `--insecure`, moves every
//! prompt's KV through shared memory (the prefill node's `fission_prefill_kv_pushes_total`
//! counts each push by the transport it picked), serves the reference tokens and gives every
//! block back. With `--kv-same-host-shm false` the same cluster pushes over QUIC.
//! (`multi_host.rs` checks that nodes on different hosts push over the network.)

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::Up;
use testkit::references::{generate_ids, references};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const PROMPTS: usize = 6;

/// Serves the reference prompts on a 1P+1D cluster started with `node_args`, checks the ids
/// and that every block comes back; returns the cluster for its counters.
async fn serve_references(node_args: &[&str]) -> Up {
    let cluster = node_args
        .iter()
        .fold(ClusterBuilder::new(FISSION), |b, a| b.node_arg(*a))
        .start();
    let client = reqwest::Client::new();
    let refs = references();
    for i in 0..PROMPTS {
        let r = &refs[i % refs.len()];
        let n = 8 + (i * 7) % 17;
        let got = generate_ids(&client, &cluster.url, &r.prompt, n).await;
        assert_eq!(got, r.expected(n), "{}", r.prompt);
    }
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    cluster.wait_kv_released(Duration::from_secs(2)).await;
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_one_host_pick_shared_memory_with_no_flag() {
    let cluster = serve_references(&[]).await;
    // At least one push each way (a repeated prompt may find its prefix on the decode node).
    assert!(cluster.kv_pushes("prefill-0", "shm") >= 1.0);
    assert_eq!(cluster.kv_pushes("prefill-0", "quic"), 0.0);
    drop(cluster);

    let cluster = serve_references(&["--kv-same-host-shm=false"]).await;
    assert!(cluster.kv_pushes("prefill-0", "quic") >= 1.0);
    assert_eq!(cluster.kv_pushes("prefill-0", "shm"), 0.0);
}
