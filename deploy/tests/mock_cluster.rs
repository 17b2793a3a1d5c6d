//! `fission up --engine mock`: a cluster of real processes whose forward passes sleep the time
//! a cost profile predicts. Under concurrent load its tokens are deterministic across decode
//! nodes and batches, its steps take the profile's time, its KV crosses the real transfer, and
//! every block is given back.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const NEW_TOKENS: usize = 32;

async fn generate(client: &reqwest::Client, url: &str, prompt: &str) -> (Vec<u64>, Duration) {
    let started = Instant::now();
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": true}}))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let ids = resp["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("details in {resp}"))
        .iter()
        .map(|t| t["id"].as_u64().expect("id"))
        .collect();
    (ids, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_cluster_serves_deterministic_tokens_at_the_profiles_speed() {
    let (prefill, decode) = (2, 4);
    let mut config = UpConfig::new(FISSION, prefill, decode);
    config.args = ["--engine", "mock", "--cost-profile", "h100-llama8b"]
        .map(String::from)
        .to_vec();
    let cluster = Up::start(&config);
    let client = reqwest::Client::new();
    let prompts = [
        "Once upon a time",
        "The little dog ran to the park and",
        "Lily had a red ball",
    ];
    // 24 requests at once: each prompt is served by several decode nodes, in different batches.
    let jobs: Vec<_> = (0..24)
        .map(|i| {
            let (client, url) = (client.clone(), cluster.url.clone());
            let prompt = prompts[i % prompts.len()];
            tokio::spawn(async move { (prompt, generate(&client, &url, prompt).await) })
        })
        .collect();
    let mut outputs: HashMap<&str, Vec<Vec<u64>>> = HashMap::new();
    for j in jobs {
        let (prompt, (ids, took)) = j.await.expect("join");
        assert_eq!(
            ids.len(),
            NEW_TOKENS,
            "{prompt}: runs to max_new_tokens, never EOS"
        );
        // The H100 profile's decode step for Llama-3-8B is at least 6.39 ms (the weights at
        // 75% of 3.35 TB/s): 31 decode steps follow the first token.
        assert!(
            took >= Duration::from_secs_f64(31.0 * 6.3e-3),
            "{prompt}: {took:?} is faster than the profile"
        );
        outputs.entry(prompt).or_default().push(ids);
    }
    for (prompt, runs) in &outputs {
        assert!(
            runs.iter().all(|r| r == &runs[0]),
            "{prompt}: the same tokens on every node and in every batch: {runs:?}"
        );
    }
    assert_ne!(outputs[prompts[0]], outputs[prompts[1]]);
    let node = |role: &str, i: usize| format!("{role}-{i}");
    let sum = |role: &str, n: usize, name: &str| -> f64 {
        (0..n).map(|i| cluster.metric(&node(role, i), name)).sum()
    };
    let per_node: Vec<f64> = (0..decode)
        .map(|i| {
            cluster.metric(
                &node("decode", i),
                "fission_decode_kv_transfers_completed_total",
            )
        })
        .collect();
    eprintln!("KV transfers per decode node: {per_node:?}");
    assert!(
        per_node.iter().filter(|&&n| n > 0.0).count() >= 2,
        "the load spread over several decode nodes: {per_node:?}"
    );
    assert!(sum("decode", decode, "fission_decode_kv_received_bytes_total") > 0.0);
    wait_until_async("every KV block given back", Duration::from_secs(5), || {
        let held = sum("decode", decode, "fission_decode_kv_blocks_used")
            + sum("decode", decode, "fission_decode_kv_blocks_reserved")
            + sum("prefill", prefill, "fission_prefill_kv_blocks_used");
        async move { held == 0.0 }
    })
    .await;
}
