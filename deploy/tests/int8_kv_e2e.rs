//! The int8 KV cache across real processes: `fission up` with 1 prefill and 1 decode node, both
//! `--kv-cache-dtype int8`, KV over QUIC. Greedy ids must equal the same engine's run
//! colocated with the int8 cache: each row's bytes depend on that row alone, so blocks that the
//! prefill node fills and the decode node finishes hold what one engine would have written.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use kvtransfer::KvDtype;
use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const NEW_TOKENS: usize = 24;

/// The reference prompts, and longer ones that span several blocks and end mid-block.
fn prompts() -> Vec<String> {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(stories_dir().join("reference_greedy.json")).expect("reference"),
    )
    .expect("json");
    let refs: Vec<String> = v["references"]
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["prompt"].as_str().expect("prompt").to_string())
        .collect();
    let long = (1..=3).map(|n| refs[..n].join(" ").repeat(n + 1));
    refs.iter().cloned().chain(long).collect()
}

/// Greedy ids of `prompt` from one in-process engine with the int8 cache.
fn colocated(model: &LoadedModel, engine: &mut Engine, id: u64, prompt: &str) -> Vec<u64> {
    let ids = model
        .tokenizer
        .encode(prompt, true)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let req = Request::greedy_fixed_length(SeqId(id), ids, NEW_TOKENS);
    let out = engine.generate(vec![req]).expect("generates");
    out[0].output_ids.iter().map(|&x| u64::from(x)).collect()
}

async fn generate_ids(client: &::reqwest::Client, url: &str, prompt: &str) -> Vec<u64> {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": true}}))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int8_cluster_serves_the_colocated_int8_tokens() {
    let model = LoadedModel::load(
        &ModelSource::Local(stories_dir()),
        None,
        &candle_core::Device::Cpu,
    )
    .expect("stories260K loads");
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            num_kv_blocks: Some(512),
            kv_cache_dtype: Some(KvDtype::Int8),
            ..Default::default()
        },
    )
    .expect("engine");
    assert_eq!(engine.cache_mut().dtype(), KvDtype::Int8);
    let prompts = prompts();
    let want: Vec<Vec<u64>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| colocated(&model, &mut engine, i as u64, p))
        .collect();

    let mut config = UpConfig::new(FISSION, 1, 1);
    config.node_args.push("--kv-cache-dtype=int8".into());
    let cluster = Up::start(&config);
    let client = ::reqwest::Client::new();
    // The first prompt alone: the decode node receives its blocks in int8, scales included.
    let first = generate_ids(&client, &cluster.url, &prompts[0]).await;
    assert!(want[0].starts_with(&first), "{first:?} vs {:?}", want[0]);
    let layout = engine.cache_mut().layout();
    assert_eq!(layout.dtype, KvDtype::Int8);
    let tokens = model
        .tokenizer
        .encode(prompts[0].as_str(), true)
        .unwrap()
        .len();
    let received = cluster.metric("decode-0", "fission_decode_kv_received_bytes_total");
    let per_block = layout.bytes_per_block_all_layers() as f64;
    assert_eq!(
        received,
        layout.blocks_for(tokens) as f64 * per_block,
        "{tokens} prompt tokens in int8 blocks of {per_block} bytes (all layers)"
    );
    // Each prompt twice: the second time the prefill node's prefix cache holds its blocks.
    for round in 0..2 {
        for (p, want) in prompts.iter().zip(&want) {
            let got = generate_ids(&client, &cluster.url, p).await;
            // The gateway stops at end of text; the colocated run does not.
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "round {round}, prompt {p:?}: cluster {got:?}, colocated {want:?}"
            );
            assert!(got.len() == want.len() || got.len() >= 8, "{got:?}");
        }
    }
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
