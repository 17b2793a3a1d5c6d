//! The push from device memory through a real cluster (issue 35): `fission up` with 1 prefill
//! and 1 decode node, both on `--device cpu --path tensor`, so each node's KV cache is a device
//! tensor a layer (the log says so) and the push runs the device path end to end: the prefill
//! node's engine stages each finished layer's blocks (two alternating buffers; pinned memory
//! on a copy stream on a GPU) and hands the layer to the push once the next one is computed,
//! the push sends the staged bytes, and the decode node uploads them and scatters them into
//! its blocks. Every stories260K reference comes back with
//! transformers' ids, twice (the second round from the prefill node's prefix cache), every
//! transfer completes with the checksums the prefill node computed, and every KV gauge
//! returns to 0.
//!
//! That the staged bytes are bit for bit the host cache's export is
//! `engine/tests/device_cache.rs`, and that the staging hands layers over one late and serves
//! the direct gather's bytes is `engine/tests/push_staging.rs`; this test is the same code
//! under the nodes.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use testkit::cluster_builder::ClusterBuilder;
use testkit::references::{generate_ids, references};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1p_1d_cluster_on_the_device_path_serves_the_references() {
    let refs = references();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("up.log");
    let cluster = ClusterBuilder::new(FISSION)
        .arg("--device=cpu")
        .arg("--path=tensor")
        .node_arg("--dtype=f32")
        // Plain text, for the log lines read below.
        .env("NO_COLOR", "1")
        .log(&log)
        .start();
    let client = reqwest::Client::new();
    let mut served = 0;
    for round in 0..2 {
        for (i, r) in refs.iter().enumerate() {
            let want = &r.output_ids;
            let got = generate_ids(&client, &cluster.url, &r.prompt, want.len()).await;
            // The gateway stops at end of text, where the reference runs on.
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "round {round} prompt {i}: cluster {got:?}, transformers {want:?}"
            );
            served += 1;
        }
    }
    let completed = cluster.metric("decode-0", "fission_decode_kv_transfers_completed_total");
    // At least the first round's: a delta push may send a repeated prompt's KV as a suffix.
    assert!(
        completed >= refs.len() as f64,
        "{completed} transfers completed with matching checksums for {served} requests"
    );
    cluster.wait_kv_released(Duration::from_secs(5)).await;
    drop(cluster);
    let log = std::fs::read_to_string(&log).unwrap();
    let allocated: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("kv cache allocated"))
        .collect();
    assert_eq!(allocated.len(), 2, "one cache a node:\n{log}");
    for line in allocated {
        assert!(line.contains("kv_on_device=true"), "{line}");
    }
}
