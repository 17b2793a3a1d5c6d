//! The UCX KV transport across real processes: `fission up --kv-transport ucx` with 1 prefill
//! and 1 decode node serves the reference tokens, with each layer put by UCX over its TCP
//! transport into memory the decode node registered (every push counted under
//! `transport="ucx"`), and gives every block back (issue 34).
//! Needs libucx0 (deploy/install-test-tools.sh installs it).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

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

fn expected(r: &Value, n: usize) -> Vec<u64> {
    r["output_ids"].as_array().expect("ids")[..n]
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

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
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.kv_transport = "ucx".into();
    config.log = Some(dir.path().join("cluster.log"));
    let cluster = Up::start(&config);
    let client = reqwest::Client::new();
    let refs = references();
    let jobs: Vec<_> = (0..8)
        .map(|i| {
            let r = refs[i % refs.len()].clone();
            let n = 8 + (i * 7) % 25;
            let (client, url) = (client.clone(), cluster.url.clone());
            tokio::spawn(async move {
                let ids =
                    generate_ids(&client, &url, r["prompt"].as_str().expect("prompt"), n).await;
                (ids, expected(&r, n))
            })
        })
        .collect();
    for j in jobs {
        let (got, want) = j.await.expect("join");
        assert_eq!(got, want);
    }
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    // The prefill node dialled the decode node's UCX server, which admitted it (same user)
    // and named it a registered region.
    let log = std::fs::read_to_string(dir.path().join("cluster.log")).unwrap();
    assert!(log.contains("kv ucx server listening"), "{log}");
    assert!(log.contains("kv ucx connection ready"), "{log}");
    // Every push went over UCX: none through shared memory beside it.
    let pushes = |transport: &str| {
        cluster.metric(
            "prefill-0",
            &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
        )
    };
    assert!(pushes("ucx") > 0.0, "{}", pushes("ucx"));
    assert_eq!(pushes("shm"), 0.0);
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
}
