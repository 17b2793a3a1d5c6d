//! A model whose weights come through `model.safetensors.index.json` loads the same as the
//! single-file one.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, references, shared_model};
use engine::engine::EngineConfig;
use engine::loader::ModelSource;
use engine::model::LoadedModel;

#[test]
fn sharded_index_loads_and_matches_reference() {
    let src = shared_model("stories260K");
    let dir = tempfile::tempdir().expect("tempdir");
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
    }
    let shard = "model-00001-of-00001.safetensors";
    std::fs::copy(src.join("model.safetensors"), dir.path().join(shard)).expect("copy weights");
    // Every tensor name maps to the one shard.
    let header_len = {
        let bytes = std::fs::read(dir.path().join(shard)).expect("read");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
        header
            .as_object()
            .expect("object")
            .keys()
            .filter(|k| *k != "__metadata__")
            .map(|k| (k.clone(), serde_json::Value::from(shard)))
            .collect::<serde_json::Map<_, _>>()
    };
    let index = serde_json::json!({"metadata": {}, "weight_map": header_len});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    let model = LoadedModel::load(
        &ModelSource::Local(dir.path().to_path_buf()),
        None,
        &candle_core::Device::Cpu,
    )
    .expect("sharded model loads");
    assert_eq!(model.files.weights.len(), 1);
    assert!(model.files.weights[0].ends_with(shard));
    let r = &references()[0];
    let out = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(64),
            ..Default::default()
        },
    )
    .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
    .expect("generates");
    assert_eq!(out[0].output_ids, r.output_ids);
    // A missing shard is named.
    std::fs::remove_file(dir.path().join(shard)).expect("remove");
    let err = LoadedModel::load(
        &ModelSource::Local(dir.path().to_path_buf()),
        None,
        &candle_core::Device::Cpu,
    )
    .err()
    .expect("missing shard fails");
    assert!(err.to_string().contains(shard), "{err}");
}
