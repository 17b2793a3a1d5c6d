//! Helpers shared by the engine's integration tests.
// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

pub mod agreement;
pub mod arch_refs;

use std::path::PathBuf;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use serde::Deserialize;

/// `../shared/models/NAME` beside the repository (or under `FISSION_SHARED_DIR`).
pub fn shared_model(name: &str) -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    let dir = root.join("models").join(name);
    assert!(dir.is_dir(), "shared model missing: {}", dir.display());
    dir
}

#[derive(Debug, Deserialize)]
pub struct Reference {
    pub prompt: String,
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub first_position_top5: Vec<TopLogit>,
}

#[derive(Debug, Deserialize)]
pub struct TopLogit {
    pub id: u32,
    pub logit: f32,
}

pub fn references() -> Vec<Reference> {
    #[derive(Deserialize)]
    struct File {
        references: Vec<Reference>,
    }
    let path = shared_model("stories260K").join("reference_greedy.json");
    let text = std::fs::read_to_string(&path).expect("reference_greedy.json readable");
    serde_json::from_str::<File>(&text)
        .expect("reference_greedy.json parses")
        .references
}

pub fn stories() -> LoadedModel {
    LoadedModel::load(
        &ModelSource::Local(shared_model("stories260K")),
        None,
        &candle_core::Device::Cpu,
    )
    .expect("stories260K loads")
}

pub fn engine(model: &LoadedModel, cfg: EngineConfig) -> Engine {
    Engine::new(model.clone(), cfg).expect("engine starts")
}

/// Greedy, no stop tokens: what the reference was generated with.
pub fn greedy(id: u64, prompt_ids: Vec<u32>, max_new_tokens: usize) -> Request {
    Request::greedy_fixed_length(SeqId(id), prompt_ids, max_new_tokens)
}
