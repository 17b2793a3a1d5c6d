//! Shared memory picked with no flag (issue 34): `fission up` with 1 prefill and 1 decode node
//! on one host, on the default (QUIC, mutual TLS) transport and no `--insecure`, moves every
//! prompt's KV through shared memory (the prefill node's `fission_prefill_kv_pushes_total`
//! counts each push by the transport it picked), serves the reference tokens and gives every
//! block back. With `--kv-same-host-shm false` the same cluster pushes over QUIC.
//! (`multi_host.rs` checks that nodes on different hosts push over the network.)

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const PROMPTS: usize = 6;

fn references() -> Vec<Value> {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(stories_dir().join("reference_greedy.json")).expect("reference"),
    )
    .expect("json");
    v["references"].as_array().expect("array").clone()
}

async fn generate_ids(client: &reqwest::Client, url: &str, prompt: &str, n: usize) -> Vec<u64> {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": n, "details": true}}))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    resp["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("details in {resp}"))
        .iter()
        .map(|t| t["id"].as_u64().expect("id"))
        .collect()
}

fn pushes(cluster: &Up, transport: &str) -> f64 {
    cluster.metric(
        "prefill-0",
        &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
    )
}

/// Serves the reference prompts on a 1P+1D cluster started with `node_args`, checks the ids
/// and that every block comes back; returns the cluster for its counters.
async fn serve_references(node_args: &[&str]) -> Up {
    let mut config = UpConfig::new(FISSION, 1, 1);
    config
        .node_args
        .extend(node_args.iter().map(|s| s.to_string()));
    let cluster = Up::start(&config);
    let client = reqwest::Client::new();
    let refs = references();
    for i in 0..PROMPTS {
        let r = &refs[i % refs.len()];
        let n = 8 + (i * 7) % 17;
        let got = generate_ids(&client, &cluster.url, r["prompt"].as_str().unwrap(), n).await;
        let want: Vec<u64> = r["output_ids"].as_array().unwrap()[..n]
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(got, want, "{}", r["prompt"]);
    }
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    wait_until_async(
        "every block given back within 2 s",
        Duration::from_secs(2),
        || {
            let held = [
                ("decode-0", "fission_decode_kv_blocks_used"),
                ("decode-0", "fission_decode_kv_blocks_reserved"),
                ("prefill-0", "fission_prefill_kv_blocks_used"),
            ]
            .iter()
            .map(|(node, name)| cluster.metric(node, name))
            .sum::<f64>();
            async move { held == 0.0 }
        },
    )
    .await;
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_one_host_pick_shared_memory_with_no_flag() {
    let cluster = serve_references(&[]).await;
    // At least one push each way (a repeated prompt may find its prefix on the decode node).
    assert!(pushes(&cluster, "shm") >= 1.0);
    assert_eq!(pushes(&cluster, "quic"), 0.0);
    drop(cluster);

    let cluster = serve_references(&["--kv-same-host-shm=false"]).await;
    assert!(pushes(&cluster, "quic") >= 1.0);
    assert_eq!(pushes(&cluster, "shm"), 0.0);
}
