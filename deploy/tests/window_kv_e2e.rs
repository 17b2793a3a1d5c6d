//! Sliding-window KV across real processes (issue 32): `fission up` with 1 prefill and 1 decode
//! node on a random Gemma-3-shaped model (5 sliding layers of a 32-token window to 1 global).
//! The prefill node frees its sliding layers' past as it computes, and pushes, for each sliding
//! layer, only the blocks of the first decode query's window; the decode node keeps those and
//! frees the rest of each window's past as it decodes. Greedy ids must equal one in-process
//! engine's (which frees its windows too), the prefill node's byte counter must read the
//! windowed amount the layout gives (not full attention's), and every block must come back.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

// The fault suite's cluster of separate processes, so one decode node can be killed; this
// file uses only part of it.
#[allow(dead_code)]
#[path = "fault_suite/harness.rs"]
mod harness;
#[path = "support/in_process.rs"]
mod in_process;
#[path = "fault_suite/migration.rs"]
mod migration;

use std::time::Duration;

use engine::kv::groups::first_pushed_block;
use in_process::InProcess;
use random_model::ModelSpec;
use serde_json::{json, Value};
use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::stories_dir;
use testkit::references::{arch_variant, generate_ids, reference_prompts};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const NEW_TOKENS: usize = 24;
const WINDOW: usize = 32;

/// The engine tests' Gemma 3 spec, with 6 layers (every sixth global) and a 32-token window.
fn gemma3_shaped(dir: &std::path::Path) {
    gemma3_with(dir, WINDOW, 6, 1024);
}

/// The Gemma 3 spec with 6 layers, every `pattern`-th global (1: every layer), a `window`.
fn gemma3_with(dir: &std::path::Path, window: usize, pattern: usize, max_pos: usize) {
    let spec = arch_variant("gemma3")["spec"].clone();
    let mut spec: ModelSpec = serde_json::from_value(spec).unwrap();
    spec.layers = 6;
    spec.sliding_window = Some(window);
    spec.sliding_window_pattern = Some(pattern);
    spec.max_pos = max_pos;
    random_model::write_model(dir, &spec, &stories_dir()).unwrap();
}

/// Prompts of several windows' length, ending mid-block.
fn prompts() -> Vec<String> {
    let refs = reference_prompts();
    (1..=3)
        .map(|n| refs[..n].join(" ").repeat(22 / n))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_model_serves_the_colocated_tokens_through_1p_1d() {
    let dir = tempfile::tempdir().unwrap();
    gemma3_shaped(dir.path());
    let mut colocated = InProcess::load(dir.path(), None);
    assert_eq!(
        colocated.engine.kv_usage().len(),
        2,
        "one sliding group beside the global one"
    );
    let prompts = prompts();
    let mut want = Vec::new();
    // What the pushes of one round carry, from the layout: every block of the global layer,
    // the window's blocks of each sliding one; and what full attention would push.
    let layout = colocated.engine.cache().layout();
    let (bs, layer_block) = (
        layout.block_size as usize,
        2 * layout.block_bytes() as usize,
    );
    let groups = colocated.engine.cache().groups().clone();
    let (mut windowed, mut full) = (0usize, 0usize);
    for p in &prompts {
        let ids = colocated.tokenize(p);
        assert!(ids.len() > 3 * WINDOW, "{} tokens", ids.len());
        let n = ids.len().div_ceil(bs);
        let live = n - first_pushed_block(ids.len(), WINDOW, bs);
        for layer in 0..6 {
            windowed += layer_block * if groups.group_of(layer) == 0 { n } else { live };
        }
        full += 6 * n * layer_block;
        want.push(
            colocated
                .greedy(ids, NEW_TOKENS)
                .into_iter()
                .map(u64::from)
                .collect::<Vec<_>>(),
        );
    }

    let cluster = ClusterBuilder::new(FISSION).model(dir.path()).start();
    let client = ::reqwest::Client::new();
    for round in 0..2 {
        for (p, want) in prompts.iter().zip(&want) {
            let got = generate_ids(&client, &cluster.url, p, NEW_TOKENS).await;
            // The gateway stops at end of text; the colocated run does not.
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "round {round}, prompt {p:?}: cluster {got:?}, colocated {want:?}"
            );
        }
    }
    // Every prompt was pushed (none prefilled on the decode node), each carrying the window.
    let pushes = 2 * prompts.len();
    wait_until_async(
        "the prefill node counts every push within 2 s",
        Duration::from_secs(2),
        || {
            let n = cluster.metric("prefill-0", "fission_prefill_kv_transfers_total");
            async move { n == pushes as f64 }
        },
    )
    .await;
    let pushed = cluster.metric("prefill-0", "fission_prefill_kv_transfer_bytes_total");
    assert_eq!(
        pushed,
        (2 * windowed) as f64,
        "full attention: {}",
        2 * full
    );
    assert!(windowed * 2 < full, "{windowed} of {full}");
    eprintln!(
        "pushed {pushed} B for {pushes} prompts; full attention {} B: {:.3}",
        2 * full,
        pushed / (2 * full) as f64
    );
    // Every layer group's gauges, the sliding windows' included, each checked to be exported.
    cluster.wait_kv_released(Duration::from_secs(2)).await;
}

/// 1 prefill and 2 decode nodes; decode-0 is killed mid-stream. The gateway prefills each
/// stream's prompt and the tokens already sent again (more than a window by then), the prefill
/// node pushes its sliding layers' windows to decode-1, and the streams carry the in-process
/// engine's ids throughout.
#[test]
fn a_sliding_window_model_keeps_its_ids_across_a_decode_migration_mid_stream() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("gemma3");
    gemma3_shaped(&model_dir);
    let migrations =
        migration::ids_survive_a_decode_kill(dir.path(), &model_dir, 2.0 * WINDOW as f64);
    println!(
        "gemma3-shaped (window {WINDOW}) on 1P+2D, decode-0 killed mid-stream: {migrations} \
         migrations, {} streams of {} ids equal to the in-process engine's",
        migration::STREAMS,
        migration::STREAM_TOKENS
    );
}

/// The figure of `benchmarks/history/2026-11-29-window-push.md`: the KV bytes a prefill node
/// pushes, by its own counter, for one 4,096-token prompt on Gemma 3's shape (5 sliding layers
/// of a 512-token window to 1 global), against the same model with every layer global (full
/// attention), each on its own `fission up` 1P+1D. Both must be what the layout gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test --release -p deploy --test window_kv_e2e -- --ignored --nocapture"]
async fn measure_the_push_of_a_4096_token_prompt() {
    const PROMPT: usize = 4096;
    let mut pushed = Vec::new();
    for (name, pattern) in [("windowed", 6), ("full attention", 1)] {
        let dir = tempfile::tempdir().unwrap();
        gemma3_with(dir.path(), 512, pattern, 8192);
        let reference = InProcess::load(dir.path(), None);
        let (vocab, engine) = (reference.model.config().vocab_size, &reference.engine);
        let layout = engine.cache().layout();
        let (bs, layer_block) = (
            layout.block_size as usize,
            2 * layout.block_bytes() as usize,
        );
        let n = PROMPT.div_ceil(bs);
        let expected: usize = (0..6)
            .map(|layer| match engine.cache().groups().group_of(layer) {
                0 => n * layer_block,
                _ => (n - first_pushed_block(PROMPT, 512, bs)) * layer_block,
            })
            .sum();

        let cluster = ClusterBuilder::new(FISSION)
            .model(dir.path())
            .env("MAX_INPUT_TOKENS", "8000")
            .env("MAX_TOTAL_TOKENS", "8192")
            .start();
        let prompt: Vec<u32> = (0..PROMPT)
            .map(|i| ((i * 7919 + 13) % (vocab - 3) + 3) as u32)
            .collect();
        let resp: Value = ::reqwest::Client::new()
            .post(format!("{}/v1/completions", cluster.url))
            .json(
                &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(resp["usage"]["prompt_tokens"], PROMPT, "{resp}");
        wait_until_async("the push counted", Duration::from_secs(5), || {
            let n = cluster.metric("prefill-0", "fission_prefill_kv_transfers_total");
            async move { n == 1.0 }
        })
        .await;
        let bytes = cluster.metric("prefill-0", "fission_prefill_kv_transfer_bytes_total");
        let received = cluster.metric("decode-0", "fission_decode_kv_received_bytes_total");
        assert_eq!(
            (bytes, received),
            (expected as f64, expected as f64),
            "{name}"
        );
        eprintln!("{name}: pushed {bytes} B, received {received} B for {PROMPT} tokens");
        pushed.push(bytes);
        cluster.wait_kv_released(Duration::from_secs(5)).await;
    }
    eprintln!(
        "pushed, windowed / full attention: {} / {} = {:.3}",
        pushed[0],
        pushed[1],
        pushed[0] / pushed[1]
    );
    assert!(pushed[0] / pushed[1] <= 0.40);
}
