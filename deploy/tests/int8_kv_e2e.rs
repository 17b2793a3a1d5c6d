//! The int8 KV cache across real processes: `fission up` with 1 prefill and 1 decode node, both
//! `--kv-cache-dtype int8`, KV over QUIC. Greedy ids must equal the same engine's run
//! colocated with the int8 cache: each row's bytes depend on that row alone, so blocks that the
//! prefill node fills and the decode node finishes hold what one engine would have written.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

#[path = "support/in_process.rs"]
mod in_process;

use in_process::InProcess;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int8_cluster_serves_the_colocated_int8_tokens() {
    let mut colocated = InProcess::load(&stories_dir(), Some(KvDtype::Int8));
    assert_eq!(colocated.engine.cache_mut().dtype(), KvDtype::Int8);
    let prompts = prompts();
    let want: Vec<Vec<u64>> = prompts
        .iter()
        .map(|p| colocated.greedy_text(p, NEW_TOKENS))
        .collect();

    let cluster = ClusterBuilder::new(FISSION).kv_dtype("int8").start();
    let client = ::reqwest::Client::new();
    // The first prompt alone: the decode node receives its blocks in int8, scales included.
    let first = generate_ids(&client, &cluster.url, &prompts[0], NEW_TOKENS).await;
    assert!(want[0].starts_with(&first), "{first:?} vs {:?}", want[0]);
    let layout = colocated.engine.cache_mut().layout();
    assert_eq!(layout.dtype, KvDtype::Int8);
    let tokens = colocated.tokenize(&prompts[0]).len();
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
