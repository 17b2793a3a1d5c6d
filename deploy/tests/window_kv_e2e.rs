//! Sliding-window KV across real processes (issue 32): `fission up` with 1 prefill and 1 decode
//! node on a random Gemma-3-shaped model (5 sliding layers of a 32-token window to 1 global).
//! The prefill node pushes every block; the decode node keeps, for its sliding layers, only the
//! blocks of the first decode query's window, and frees the rest of each window's past as it
//! decodes. Greedy ids must equal one in-process engine's (which frees its windows too), and
//! every block must come back.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use random_model::ModelSpec;
use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const NEW_TOKENS: usize = 24;
const WINDOW: usize = 32;

/// The engine tests' Gemma 3 spec, with 6 layers (every sixth global) and a 32-token window.
fn gemma3_shaped(dir: &std::path::Path) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/reference/arch_refs.json"
    );
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let spec = refs["variants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "gemma3")
        .unwrap()["spec"]
        .clone();
    let mut spec: ModelSpec = serde_json::from_value(spec).unwrap();
    spec.layers = 6;
    spec.sliding_window = Some(WINDOW);
    spec.sliding_window_pattern = Some(6);
    spec.max_pos = 1024;
    random_model::write_model(dir, &spec, &stories_dir()).unwrap();
}

/// Prompts of several windows' length, ending mid-block.
fn prompts() -> Vec<String> {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(stories_dir().join("reference_greedy.json")).unwrap(),
    )
    .unwrap();
    let refs: Vec<String> = v["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["prompt"].as_str().unwrap().to_string())
        .collect();
    (1..=3)
        .map(|n| refs[..n].join(" ").repeat(22 / n))
        .collect()
}

async fn generate_ids(client: &::reqwest::Client, url: &str, prompt: &str) -> Vec<u64> {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": true}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    resp["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("details in {resp}"))
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_model_serves_the_colocated_tokens_through_1p_1d() {
    let dir = tempfile::tempdir().unwrap();
    gemma3_shaped(dir.path());
    let model = LoadedModel::load(
        &ModelSource::Local(dir.path().into()),
        None,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            num_kv_blocks: Some(512),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        engine.kv_usage().len(),
        2,
        "one sliding group beside the global one"
    );
    let prompts = prompts();
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = model
            .tokenizer
            .encode(p.as_str(), true)
            .unwrap()
            .get_ids()
            .to_vec();
        assert!(ids.len() > 3 * WINDOW, "{} tokens", ids.len());
        let req = Request::greedy_fixed_length(SeqId(i as u64), ids, NEW_TOKENS);
        let out = engine.generate(vec![req]).unwrap();
        want.push(
            out[0]
                .output_ids
                .iter()
                .map(|&x| u64::from(x))
                .collect::<Vec<_>>(),
        );
    }

    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = dir.path().to_path_buf();
    let cluster = Up::start(&config);
    let client = ::reqwest::Client::new();
    for round in 0..2 {
        for (p, want) in prompts.iter().zip(&want) {
            let got = generate_ids(&client, &cluster.url, p).await;
            // The gateway stops at end of text; the colocated run does not.
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "round {round}, prompt {p:?}: cluster {got:?}, colocated {want:?}"
            );
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
