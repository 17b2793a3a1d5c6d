//! Mixtures of experts against transformers on tiny random models: Mixtral (8 experts, top-2
//! renormalised, every layer sparse), Qwen3-MoE with `norm_topk_prob` false (top-3 of 6, a
//! dense layer by `mlp_only_layers`) and true (top-4 of 8, dense layers by
//! `decoder_sparse_step` 2). Each runs on the host path and on the tensor path
//! (`tensor_path::*`), alone, batched with the other prompts, and in 16-token prefill chunks
//! (`common::arch_refs::check_variant`). The routers' weights are wide enough that tokens pick
//! different experts: a model routed to fewer experts, or renormalised otherwise, generates
//! other tokens.
//!
//! The references are the `suite: "moe"` entries of `tests/reference/arch_refs.json`, made by
//! `tests/reference/make_refs.py`.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::arch_refs::{
    first_position_logits, load, materialize, small, variant, Variant, F32_LOGIT_TOL,
};
use common::{engine, greedy};
use engine::engine::EngineConfig;
use engine::model::LoadedModel;

variant_tests!(mixtral, qwen3_moe, qwen3_moe_norm);

#[test]
fn every_moe_reference_variant_has_a_test() {
    common::arch_refs::assert_suite_tested(Some("moe"), TESTED_VARIANTS);
}

/// The variant's model with `field` of config.json set to `value`.
fn with_config(name: &str, field: &str, value: serde_json::Value) -> (Variant, LoadedModel) {
    let v = variant(name);
    let dir = materialize(&v);
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    cfg[field] = value;
    std::fs::write(&path, cfg.to_string()).expect("write config");
    let model = load(dir.path(), None);
    (v, model)
}

/// [`with_config`] generates other tokens than the references on at least one prompt.
fn with_config_generates_otherwise(name: &str, field: &str, value: serde_json::Value) {
    let (v, model) = with_config(name, field, value);
    let differ = v.references.iter().any(|r| {
        let mut e = engine(&model, small(EngineConfig::default()));
        let out = e
            .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
            .expect("generates");
        out[0].output_ids != r.output_ids
    });
    assert!(differ, "{name} with {field} changed gives its references");
}

/// Top-1 instead of top-2: the second expert's share shapes Mixtral's references.
#[test]
fn mixtral_routed_to_one_expert_generates_otherwise() {
    with_config_generates_otherwise("mixtral", "num_experts_per_tok", 1.into());
}

/// `norm_topk_prob` is read both ways: flipped, either Qwen3-MoE variant's first-position
/// logits move by far more than the variant tests' tolerance. (Their greedy tokens survive it:
/// the chosen experts' weights already sum to nearly 1, so renormalising rescales the block's
/// output only a little.)
#[test]
fn qwen3_moe_renormalised_otherwise_is_caught() {
    for (name, flipped) in [("qwen3_moe", true), ("qwen3_moe_norm", false)] {
        let (v, model) = with_config(name, "norm_topk_prob", flipped.into());
        let worst = v
            .references
            .iter()
            .flat_map(|r| {
                let row = first_position_logits(&model, &r.input_ids);
                r.first_position_top5
                    .iter()
                    .map(move |t| (row[t.id as usize] - t.logit).abs())
            })
            .fold(0f32, f32::max);
        assert!(
            worst > 100.0 * F32_LOGIT_TOL,
            "{name}: renormalising otherwise moves the logits by only {worst}"
        );
    }
}

/// transformers 5 holds the experts packed (`mlp.experts.gate_up_proj` `[E, 2F, H]`,
/// `mlp.experts.down_proj` `[E, H, F]`): a checkpoint in that form loads to the same tokens.
#[test]
fn packed_experts_load_as_the_per_expert_tensors() {
    use candle_core::{Device, Tensor};
    let v = variant("qwen3_moe");
    let dir = materialize(&v);
    let file = dir.path().join("model.safetensors");
    let mut t = candle_core::safetensors::load(&file, &Device::Cpu).expect("loads");
    let moe = v.spec.moe.as_ref().expect("moe spec");
    for layer in 0..v.spec.layers {
        if !moe.is_sparse(v.spec.architecture, layer) {
            continue;
        }
        let p = format!("model.layers.{layer}.mlp.experts");
        let mut take = |e: usize, w: &str| t.remove(&format!("{p}.{e}.{w}.weight")).unwrap();
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..moe.experts {
            let (g, u) = (take(e, "gate_proj"), take(e, "up_proj"));
            gate_up.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(take(e, "down_proj"));
        }
        t.insert(
            format!("{p}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        t.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    candle_core::safetensors::save(&t, &file).expect("saves");
    let model = load(dir.path(), None);
    for r in &v.references {
        let mut e = engine(&model, small(EngineConfig::default()));
        let out = e
            .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
            .expect("generates");
        assert_eq!(out[0].output_ids, r.output_ids);
    }
}
