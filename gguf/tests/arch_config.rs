//! config.json from each architecture's llama.cpp keys, where the file is silent as llama.cpp
//! reads it, and clear errors for what neither llama.cpp nor the engine runs. (The fixtures of
//! `tests/fixtures/arch`, written on first use byte for byte as llama.cpp's converter wrote
//! them, check real converted files end to end: engine/tests/gguf_arch.rs.)

use gguf::test_bytes::GgufBuilder;
use serde_json::{json, Value};

const F32: u32 = 0;

/// A file of `arch` with the shape keys every model has, and its token embedding.
fn base(arch: &str, layers: u32, hidden: u32, heads: u32, head_dim: u32) -> GgufBuilder {
    let k = |s: &str| format!("{arch}.{s}");
    GgufBuilder::new()
        .string("general.architecture", arch)
        .u32(&k("block_count"), layers)
        .u32(&k("embedding_length"), hidden)
        .u32(&k("feed_forward_length"), 4 * hidden)
        .u32(&k("attention.head_count"), heads)
        .u32(&k("attention.head_count_kv"), 1)
        .u32(&k("attention.key_length"), head_dim)
        .u32(&k("attention.value_length"), head_dim)
        .tensor("token_embd.weight", &[u64::from(hidden), 16], F32)
}

fn config(b: &GgufBuilder) -> gguf::Result<Value> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, b.build()).expect("write");
    gguf::hf_config(&gguf::GgufFile::open(&path)?)
}

#[test]
fn gemma3_takes_llama_cpps_defaults() {
    let c = config(&base("gemma3", 6, 64, 4, 16).u32("gemma3.attention.sliding_window", 10))
        .expect("config");
    assert_eq!(c["architectures"], json!(["Gemma3ForCausalLM"]));
    assert_eq!(c["model_type"], "gemma3_text");
    assert_eq!(c["hidden_activation"], "gelu_pytorch_tanh");
    assert_eq!(c["query_pre_attn_scalar"], 16);
    assert_eq!(c["sliding_window"], 10);
    let s = "sliding_attention";
    assert_eq!(c["layer_types"], json!([s, s, s, s, s, "full_attention"]));
    assert_eq!(c["rope_local_base_freq"], 10_000.0);
    assert_eq!(c["attn_logit_softcapping"], Value::Null);
    assert_eq!(c["final_logit_softcapping"], Value::Null);
    assert_eq!(c["tie_word_embeddings"], true);
    // The pattern as a count, and as a flag per layer; no window: no sliding layer.
    let c = config(
        &base("gemma3", 6, 64, 4, 16)
            .u32("gemma3.attention.sliding_window", 10)
            .u32("gemma3.attention.sliding_window_pattern", 3)
            .f32("gemma3.rope.freq_base_swa", 5000.0),
    )
    .expect("config");
    let f = "full_attention";
    assert_eq!(c["layer_types"], json!([s, s, f, s, s, f]));
    assert_eq!(c["rope_local_base_freq"], 5000.0);
    let flags = [true, false, true, true, false, true];
    let c = config(
        &base("gemma3", 6, 64, 4, 16)
            .u32("gemma3.attention.sliding_window", 10)
            .bool_array("gemma3.attention.sliding_window_pattern", &flags),
    )
    .expect("config");
    assert_eq!(c["layer_types"], json!([s, f, s, s, f, s]));
    let c = config(&base("gemma3", 6, 64, 4, 16)).expect("config");
    assert_eq!(c["sliding_window"], Value::Null);
    let err = config(
        &base("gemma3", 6, 64, 4, 16)
            .u32("gemma3.attention.sliding_window", 10)
            .bool_array("gemma3.attention.sliding_window_pattern", &flags[..4]),
    )
    .expect_err("4 flags for 6 layers");
    assert!(err.to_string().contains("4 entries for 6 layers"), "{err}");
}

#[test]
fn gemma2_ties_and_scales_as_llama_cpp_does() {
    let c = config(
        &base("gemma2", 3, 64, 4, 32)
            .f32("gemma2.attn_logit_softcapping", 2.0)
            .tensor("output.weight", &[64, 16], F32),
    )
    .expect("config");
    assert_eq!(
        c["tie_word_embeddings"], true,
        "llama.cpp never reads output"
    );
    assert_eq!(c["query_pre_attn_scalar"], 32);
    assert_eq!(c["attn_logit_softcapping"], 2.0);
    assert_eq!(c["final_logit_softcapping"], 30.0);
    assert_eq!(c["sliding_window"], 4096);
    let s = "sliding_attention";
    assert_eq!(c["layer_types"], json!([s, "full_attention", s]));
    // The 27B shape (46 layers): hidden / heads.
    let c = config(&base("gemma2", 46, 4608, 32, 128)).expect("config");
    assert_eq!(c["query_pre_attn_scalar"], 144);
}

#[test]
fn phi3_partial_rotary_and_longrope() {
    let factors = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let c = config(
        &base("phi3", 2, 64, 4, 16)
            .u32("phi3.rope.dimension_count", 12)
            .u32("phi3.context_length", 1024)
            .u32("phi3.rope.scaling.original_context_length", 256)
            .u32("phi3.attention.sliding_window", 0)
            .tensor_data(
                "rope_factors_short.weight",
                &[6],
                F32,
                factors(&[1.0, 1.1, 1.3, 1.6, 2.0, 2.5]),
            )
            .tensor_data(
                "rope_factors_long.weight",
                &[6],
                F32,
                factors(&[1.0, 1.5, 3.0, 6.0, 12.0, 24.0]),
            ),
    )
    .expect("config");
    assert_eq!(c["partial_rotary_factor"], 0.75);
    assert_eq!(c["original_max_position_embeddings"], 256);
    assert_eq!(c["sliding_window"], Value::Null);
    assert_eq!(
        c["rope_scaling"],
        json!({"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
               "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]})
    );
    let err = config(&base("phi3", 2, 64, 4, 16).tensor_data(
        "rope_factors_long.weight",
        &[8],
        F32,
        factors(&[1.0; 8]),
    ))
    .expect_err("one factor set");
    assert!(err.to_string().contains("rope_factors_short"), "{err}");
    let err = config(&base("llama", 2, 64, 4, 16).u32("llama.rope.dimension_count", 12))
        .expect_err("partial rotary outside phi3");
    assert!(err.to_string().contains("phi3 only"), "{err}");
}

#[test]
fn experts_from_llama_and_qwen3moe() {
    let c = config(
        &base("llama", 2, 64, 4, 16)
            .u32("llama.expert_count", 8)
            .u32("llama.expert_used_count", 2),
    )
    .expect("config");
    assert_eq!(c["architectures"], json!(["MixtralForCausalLM"]));
    assert_eq!(c["num_local_experts"], 8);
    assert_eq!(c["num_experts_per_tok"], 2);
    let moe = |layers: &[u32]| {
        let mut b = base("qwen3moe", 2, 64, 4, 16)
            .u32("qwen3moe.expert_count", 4)
            .u32("qwen3moe.expert_used_count", 2)
            .u32("qwen3moe.expert_feed_forward_length", 32);
        for l in layers {
            b = b.tensor(&format!("blk.{l}.ffn_gate_exps.weight"), &[64, 32, 4], F32);
        }
        b
    };
    let c = config(&moe(&[0, 1])).expect("config");
    assert_eq!(c["architectures"], json!(["Qwen3MoeForCausalLM"]));
    assert_eq!(c["num_experts"], 4);
    assert_eq!(c["moe_intermediate_size"], 32);
    assert_eq!(c["norm_topk_prob"], true, "llama.cpp always renormalises");
    let err = config(&moe(&[0])).expect_err("a dense layer");
    assert!(err.to_string().contains("blk.1.ffn_gate_exps"), "{err}");
}

/// Per-layer lists are sized by `block_count`: an absurd one is refused before any is built.
#[test]
fn an_absurd_layer_count_is_refused() {
    let err =
        config(&base("gemma3", u32::MAX, 64, 4, 16).u32("gemma3.attention.sliding_window", 10))
            .expect_err("4 billion layers");
    assert!(err.to_string().contains("block_count"), "{err}");
}
