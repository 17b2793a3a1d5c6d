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

use std::collections::HashMap;
use std::time::Duration;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use random_model::{fingerprint, write_model, ModelSpec};
use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

struct Reference {
    input_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

fn variant(name: &str) -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/reference/arch_refs.json"
    );
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    refs["variants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("arch_refs.json has no variant {name:?}"))
        .clone()
}

/// Writes `name`'s model into `dir`, checks it is the one the references came from, and
/// returns its references.
fn materialize(name: &str, dir: &std::path::Path) -> Vec<Reference> {
    let v = &variant(name);
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

/// `/generate` with `details`: the generated ids (the gateway stops at end of text).
async fn generate_ids(client: &::reqwest::Client, url: &str, prompt: &str, n: usize) -> Vec<u32> {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": n, "details": true}}))
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
        .map(|t| u32::try_from(t["id"].as_u64().unwrap()).unwrap())
        .collect()
}

/// Serves `name`'s references twice through 1P+1D (the second round hits the prefix cache),
/// then waits for every KV gauge to return to 0.
async fn serves_the_references(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let refs = materialize(name, dir.path());
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
    let tokenizer = &model.tokenizer;
    // The text prompts and the in-process engine's ids for them, the engine first checked on
    // the references' id prompts.
    let mut text_prompts = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let n = r.output_ids.len();
        let out = engine
            .generate(vec![Request::greedy_fixed_length(
                SeqId(i as u64),
                r.input_ids.clone(),
                n,
            )])
            .unwrap();
        assert_eq!(
            out[0].output_ids, r.output_ids,
            "{name} prompt {i}: the in-process engine is not transformers"
        );
        let text = tokenizer.decode(&r.input_ids, true).unwrap();
        let ids = tokenizer
            .encode(text.as_str(), true)
            .unwrap()
            .get_ids()
            .to_vec();
        let out = engine
            .generate(vec![Request::greedy_fixed_length(
                SeqId(100 + i as u64),
                ids,
                n,
            )])
            .unwrap();
        text_prompts.push((text, out[0].output_ids.clone()));
    }
    let mut ids_of_text: HashMap<String, Vec<u32>> = HashMap::new();
    for id in 0..u32::try_from(tokenizer.get_vocab_size(true)).unwrap() {
        ids_of_text
            .entry(tokenizer.decode(&[id], false).unwrap())
            .or_default()
            .push(id);
    }

    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = dir.path().to_path_buf();
    let cluster = Up::start(&config);
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

const STREAMS: usize = 4;
const STREAM_TOKENS: usize = 200;

fn stream_body(client: usize) -> Value {
    harness::body(
        &format!("Stream {client}: the little dog ran to the park"),
        STREAM_TOKENS,
    )
}

#[test]
fn a_mixture_of_experts_keeps_its_ids_across_a_decode_migration_mid_stream() {
    // Slow steps, so the kill lands mid-stream (read by the node processes started below).
    std::env::set_var("FISSION_DEBUG_STEP_DELAY_MS", "10");
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("qwen3-moe");
    let mut spec: ModelSpec = serde_json::from_value(variant("qwen3_moe")["spec"].clone()).unwrap();
    spec.max_pos = 1024;
    write_model(&model_dir, &spec, &stories_dir()).unwrap();
    let model = LoadedModel::load(
        &ModelSource::Local(model_dir.clone()),
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
    let want: Vec<Vec<u64>> = (0..STREAMS)
        .map(|i| {
            let text = stream_body(i)["inputs"].as_str().unwrap().to_string();
            let ids = model
                .tokenizer
                .encode(text.as_str(), true)
                .unwrap()
                .get_ids()
                .to_vec();
            let out = engine
                .generate(vec![Request::greedy_fixed_length(
                    SeqId(i as u64),
                    ids,
                    STREAM_TOKENS,
                )])
                .unwrap();
            out[0].output_ids.iter().map(|&x| u64::from(x)).collect()
        })
        .collect();

    let mut c = harness::Cluster::start(
        dir.path(),
        &model_dir,
        vec![
            harness::node("prefill", "prefill-0", &[]),
            harness::node("decode", "decode-0", &[]),
            harness::node("decode", "decode-1", &[]),
        ],
        &[],
    );
    let url = c.url.clone();
    let load = std::thread::spawn(move || {
        testkit::streams::run(&url, STREAMS, 1, Duration::from_secs(60), |client, _| {
            stream_body(client)
        })
    });
    let m = c.node("decode-0").metrics.clone();
    testkit::wait_until("decode-0 generating", Duration::from_secs(30), || {
        testkit::fission::metric(&m, "fission_decode_generated_tokens_total") >= 20.0
            && testkit::fission::metric(&m, "fission_decode_running_sequences") >= 1.0
    });
    c.node("decode-0").signal(libc::SIGKILL);
    let mut records = load.join().unwrap();
    records.sort_by_key(|r| r.client);
    harness::assert_all_ok(&records, "across decode-0's death");
    for (r, want) in records.iter().zip(&want) {
        assert_eq!(
            r.token_ids.len(),
            STREAM_TOKENS,
            "no token twice, none missing"
        );
        assert_eq!(
            &r.token_ids, want,
            "stream {}: the in-process engine's ids across the migration",
            r.client
        );
    }
    let migrations = c.gateway_metric("fission_gateway_migrations_total");
    assert!(migrations >= 1.0, "the gateway migrated nothing");
    c.assert_kv_released();
    println!("qwen3_moe on 1P+2D, decode-0 killed mid-stream: {migrations} migrations, {STREAMS} streams of {STREAM_TOKENS} ids equal to the in-process engine's");
}
