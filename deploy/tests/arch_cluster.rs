//! Architectures through a real cluster (issue 32): `fission up` with 1 prefill and 1 decode
//! node on the models of `engine/tests/reference/arch_refs.json` (same fingerprint), for a
//! sliding-window variant (`gemma3`: windows of 10 tokens on 2 of 3 layers) and a mixture of
//! experts (`qwen3_moe`); every KV block comes back afterwards.
//!
//! Two checks, because the gateway takes ids in only on `/v1/completions`, which reports no ids
//! out, and gives ids out only on `/generate`, which takes text in:
//! - the references' own id prompts on `/v1/completions` (`ignore_eos`): each token's text (its
//!   `top_logprobs` key, `decode(&[id])`) must be that of transformers' id;
//! - the same prompts as text on `/generate` with `details`: the ids must equal an in-process
//!   engine's on the tokenized text, that engine having given transformers' ids on the
//!   references first.
//!
//! Then the MoE model on 1 prefill and 2 decode nodes: decode-0 is killed mid-stream, and the
//! streams the gateway migrates to decode-1 must still carry the in-process engine's ids.

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

use std::collections::HashMap;
use std::time::Duration;

use in_process::InProcess;
use random_model::{fingerprint, write_model, ModelSpec};
use serde_json::{json, Value};
use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::stories_dir;
use testkit::references::{arch_variant, generate_ids};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

struct Reference {
    input_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

/// Writes `name`'s model into `dir`, checks it is the one the references came from, and
/// returns its references.
fn materialize(name: &str, dir: &std::path::Path) -> Vec<Reference> {
    let v = &arch_variant(name);
    let spec: ModelSpec = serde_json::from_value(v["spec"].clone()).unwrap();
    write_model(dir, &spec, &stories_dir()).unwrap();
    assert_eq!(
        fingerprint(dir).unwrap(),
        v["fingerprint"].as_str().unwrap(),
        "{name}: not the model the references were made from"
    );
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|i| u32::try_from(i.as_u64().unwrap()).unwrap())
            .collect()
    };
    v["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Reference {
            input_ids: ids(&r["input_ids"]),
            output_ids: ids(&r["output_ids"]),
        })
        .collect()
}

/// Each generated token's text, from the top-1 alternative the gateway reports for it.
async fn completion_token_texts(
    client: &::reqwest::Client,
    url: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Vec<String> {
    let resp: Value = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "ignore_eos": true,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let top = resp["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs in {resp}"));
    top.iter()
        .map(|alts| {
            let alts = alts.as_object().unwrap();
            // Greedy: the best alternative is the token chosen.
            alts.iter()
                .max_by(|a, b| a.1.as_f64().unwrap().total_cmp(&b.1.as_f64().unwrap()))
                .map(|(text, _)| text.clone())
                .unwrap_or_else(|| panic!("an empty top_logprobs entry in {resp}"))
        })
        .collect()
}

/// Serves `name`'s references twice through 1P+1D (the second round hits the prefix cache),
/// then waits for every KV gauge to return to 0.
async fn serves_the_references(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let refs = materialize(name, dir.path());
    let mut reference = InProcess::load(dir.path(), None);
    // The text prompts and the in-process engine's ids for them, the engine first checked on
    // the references' id prompts.
    let mut text_prompts = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let n = r.output_ids.len();
        assert_eq!(
            reference.greedy(r.input_ids.clone(), n),
            r.output_ids,
            "{name} prompt {i}: the in-process engine is not transformers"
        );
        let text = reference
            .model
            .tokenizer
            .decode(&r.input_ids, true)
            .unwrap();
        let want = reference.greedy_text(&text, n);
        text_prompts.push((text, want));
    }
    let tokenizer = &reference.model.tokenizer;
    let mut ids_of_text: HashMap<String, Vec<u32>> = HashMap::new();
    for id in 0..u32::try_from(tokenizer.get_vocab_size(true)).unwrap() {
        ids_of_text
            .entry(tokenizer.decode(&[id], false).unwrap())
            .or_default()
            .push(id);
    }

    let cluster = ClusterBuilder::new(FISSION).model(dir.path()).start();
    let client = ::reqwest::Client::new();
    let mut exact = 0;
    for round in 0..2 {
        for (i, r) in refs.iter().enumerate() {
            let got =
                completion_token_texts(&client, &cluster.url, &r.input_ids, r.output_ids.len())
                    .await;
            assert_eq!(
                got.len(),
                r.output_ids.len(),
                "{name} round {round} prompt {i}"
            );
            for (pos, (text, &want)) in got.iter().zip(&r.output_ids).enumerate() {
                let ids = ids_of_text.get(text).cloned().unwrap_or_default();
                assert!(
                    ids.contains(&want),
                    "{name} round {round} prompt {i} token {pos}: cluster gave {text:?} \
                     (ids {ids:?}), transformers {want}; cluster {got:?}, reference {:?}",
                    r.output_ids
                );
                exact += usize::from(ids.len() == 1);
            }
        }
    }
    let total: usize = 2 * refs.iter().map(|r| r.output_ids.len()).sum::<usize>();
    let mut by_id = 0;
    for round in 0..2 {
        for (i, (text, want)) in text_prompts.iter().enumerate() {
            let got = generate_ids(&client, &cluster.url, text, want.len()).await;
            assert!(
                !got.is_empty() && want.starts_with(&got),
                "{name} round {round} text prompt {i}: cluster {got:?}, in-process {want:?}"
            );
            by_id += got.len();
        }
    }
    assert!(
        cluster.metric("prefill-0", "fission_prefill_prompts_total") >= 1.0,
        "{name}: the prefill node prefilled nothing"
    );
    assert!(
        cluster.metric("decode-0", "fission_decode_generated_tokens_total") >= 1.0,
        "{name}: the decode node generated nothing"
    );
    cluster.wait_kv_released(Duration::from_secs(2)).await;
    println!(
        "{name} through 1P+1D: {total} tokens of transformers' text ({exact} of a text only \
         their id has), {by_id} ids equal to the in-process engine's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_variant_serves_the_transformers_ids_through_1p_1d() {
    serves_the_references("gemma3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixture_of_experts_serves_the_transformers_ids_through_1p_1d() {
    serves_the_references("qwen3_moe").await;
}

#[test]
fn a_mixture_of_experts_keeps_its_ids_across_a_decode_migration_mid_stream() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("qwen3-moe");
    let mut spec: ModelSpec =
        serde_json::from_value(arch_variant("qwen3_moe")["spec"].clone()).unwrap();
    spec.max_pos = 1024;
    write_model(&model_dir, &spec, &stories_dir()).unwrap();
    let migrations = migration::ids_survive_a_decode_kill(dir.path(), &model_dir, 20.0);
    println!(
        "qwen3_moe on 1P+2D, decode-0 killed mid-stream: {migrations} migrations, {} streams \
         of {} ids equal to the in-process engine's",
        migration::STREAMS,
        migration::STREAM_TOKENS
    );
}
