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
use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::stories_dir;
use testkit::references::{generate_ids, reference_prompts};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const NEW_TOKENS: usize = 24;

/// The reference prompts, and longer ones that span several blocks and end mid-block.
fn prompts() -> Vec<String> {
    let refs = reference_prompts();
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

    let cluster = ClusterBuilder::new(FISSION).kv_dtype("int8").start();
    let client = ::reqwest::Client::new();
    // The first prompt alone: the decode node receives its blocks in int8, scales included.
    let first = generate_ids(&client, &cluster.url, &prompts[0], NEW_TOKENS).await;
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
            let got = generate_ids(&client, &cluster.url, p, NEW_TOKENS).await;
            // The gateway stops at end of text; the colocated run does not.
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "round {round}, prompt {p:?}: cluster {got:?}, colocated {want:?}"
            );
            assert!(got.len() == want.len() || got.len() >= 8, "{got:?}");
        }
    }
    cluster.wait_kv_released(Duration::from_secs(2)).await;
}
