//! The writer's own checks: config keys, tensors per architecture, fingerprints.

use super::*;

#[test]
fn config_json_keys_are_sorted_whatever_serde_jsons_features() {
    // The workspace turns on serde_json's `preserve_order` (through llguidance), which
    // would write keys in insertion order and change every fingerprint.
    let tok = tokenizer_dir();
    let out = tempfile::tempdir().expect("tempdir");
    write_model(out.path(), &ModelSpec::tiny(), tok.path()).expect("writes");
    let text = std::fs::read_to_string(out.path().join("config.json")).expect("reads");
    let keys: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("  \""))
        .filter_map(|l| l.split('"').next())
        .collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert!(keys.len() > 10, "{text}");
    assert_eq!(keys, sorted);
}

/// A minimal tokenizer.json: all `pad_tokenizer` reads.
fn tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = json!({"model": {"vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}},
                     "added_tokens": [{"id": 1, "content": "<s>"}]});
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).expect("write");
    dir
}

fn small(seed: u64) -> ModelSpec {
    ModelSpec {
        vocab: 32,
        seed,
        ..ModelSpec::tiny()
    }
}

fn write(spec: &ModelSpec) -> tempfile::TempDir {
    let tok = tokenizer_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    write_model(dir.path(), spec, tok.path()).expect("writes");
    dir
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).expect("loads")
}

#[test]
fn same_seed_writes_identical_files() {
    let (a, b, c) = (write(&small(7)), write(&small(7)), write(&small(8)));
    let bytes = |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors"));
    assert_eq!(bytes(&a).expect("a"), bytes(&b).expect("b"));
    assert_eq!(
        fingerprint(a.path()).expect("a"),
        fingerprint(b.path()).expect("b")
    );
    assert_ne!(
        fingerprint(a.path()).expect("a"),
        fingerprint(c.path()).expect("c")
    );
}

#[test]
fn untied_bias_model_has_lm_head_and_biases() {
    let spec = ModelSpec {
        architecture: Architecture::Qwen2,
        attention_bias: true,
        tie_word_embeddings: false,
        head_dim: 32,
        ..small(1)
    };
    let dir = write(&spec);
    let t = tensors(dir.path());
    assert_eq!(t["lm_head.weight"].dims(), &[32, 64]);
    assert_eq!(
        t["model.layers.1.self_attn.q_proj.weight"].dims(),
        &[128, 64]
    );
    assert_eq!(
        t["model.layers.1.self_attn.o_proj.weight"].dims(),
        &[64, 128]
    );
    assert_eq!(t["model.layers.0.self_attn.k_proj.bias"].dims(), &[64]);
    let cfg = config_json(&spec);
    assert_eq!(cfg["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(cfg["use_sliding_window"], false);
    assert!(cfg.get("attention_bias").is_none(), "qwen2 configs omit it");
}

#[test]
fn qwen3_has_per_head_qk_norms_and_says_its_bias() {
    let spec = ModelSpec {
        architecture: Architecture::Qwen3,
        head_dim: 32,
        ..small(1)
    };
    let t = tensors(write(&spec).path());
    assert_eq!(t["model.layers.1.self_attn.q_norm.weight"].dims(), &[32]);
    assert_eq!(t["model.layers.0.self_attn.k_norm.weight"].dims(), &[32]);
    assert!(!t.contains_key("model.layers.0.self_attn.q_proj.bias"));
    let cfg = config_json(&spec);
    assert_eq!(cfg["model_type"], "qwen3");
    assert_eq!(cfg["attention_bias"], false);
    assert_eq!(cfg["use_sliding_window"], false);
    // A plain Llama of the same seed has no q/k norms.
    let t = tensors(write(&small(1)).path());
    assert!(!t.contains_key("model.layers.0.self_attn.q_norm.weight"));
}

#[test]
fn gemma_has_four_norms_a_layer_and_says_its_caps() {
    let gemma2 = ModelSpec {
        architecture: Architecture::Gemma2,
        head_dim: 32,
        sliding_window: Some(8),
        query_pre_attn_scalar: Some(24),
        attn_logit_softcapping: Some(1.0),
        ..small(1)
    };
    let t = tensors(write(&gemma2).path());
    for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
        assert_eq!(t[&format!("model.layers.1.{name}.weight")].dims(), &[64]);
    }
    assert!(!t.contains_key("model.layers.0.self_attn.q_norm.weight"));
    let cfg = config_json(&gemma2);
    assert_eq!(cfg["model_type"], "gemma2");
    assert_eq!(cfg["hidden_activation"], "gelu_pytorch_tanh");
    assert!(cfg.get("hidden_act").is_none());
    assert_eq!(cfg["final_logit_softcapping"], Value::Null);
    assert_eq!(cfg["attn_logit_softcapping"], 1.0);
    let gemma3 = ModelSpec {
        architecture: Architecture::Gemma3,
        sliding_window_pattern: Some(3),
        rope_local_base_freq: Some(10_000.0),
        ..gemma2.clone()
    };
    let t = tensors(write(&gemma3).path());
    assert_eq!(t["model.layers.0.self_attn.k_norm.weight"].dims(), &[32]);
    assert_eq!(config_json(&gemma3)["sliding_window_pattern"], 3);
    let err = ModelSpec {
        rope_local_base_freq: Some(1.0),
        ..gemma2
    }
    .validate()
    .expect_err("gemma 2 has no local base");
    assert!(err.to_string().contains("rope_local_base_freq"), "{err}");
}

#[test]
fn phi3_stores_fused_projections_of_its_llama_twin() {
    let phi3 = ModelSpec {
        architecture: Architecture::Phi3,
        partial_rotary_factor: Some(0.75),
        original_max_position_embeddings: Some(16),
        sliding_window: Some(9),
        ..small(1)
    };
    let t = tensors(write(&phi3).path());
    let llama = tensors(write(&small(1)).path());
    assert!(!t.contains_key("model.layers.0.self_attn.q_proj.weight"));
    let qkv = &t["model.layers.1.self_attn.qkv_proj.weight"];
    assert_eq!(qkv.dims(), &[64 + 2 * 32, 64]);
    let want = Tensor::cat(
        &["q_proj", "k_proj", "v_proj"]
            .map(|p| llama[&format!("model.layers.1.self_attn.{p}.weight")].clone()),
        0,
    )
    .expect("cat");
    let diff = (qkv - want)
        .and_then(|d| d.abs())
        .and_then(|d| d.max_all())
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff");
    assert_eq!(diff, 0.0);
    assert_eq!(
        t["model.layers.0.mlp.gate_up_proj.weight"].dims(),
        &[256, 64]
    );
    let cfg = config_json(&phi3);
    assert_eq!(cfg["model_type"], "phi3");
    assert_eq!(cfg["partial_rotary_factor"], 0.75);
    assert_eq!(cfg["original_max_position_embeddings"], 16);
    assert_eq!(cfg["sliding_window"], 9);
    let err = ModelSpec {
        partial_rotary_factor: Some(0.5),
        ..small(1)
    }
    .validate()
    .expect_err("llama has no partial rotary here");
    assert!(err.to_string().contains("partial_rotary_factor"), "{err}");
}

#[test]
fn moe_layers_store_a_router_and_per_expert_weights_under_real_checkpoint_names() {
    let moe = MoeSpec {
        experts: 4,
        top_k: 2,
        expert_ffn: Some(24),
        norm_topk_prob: false,
        decoder_sparse_step: 2,
        mlp_only_layers: vec![],
        router_std: 0.5,
    };
    let qwen = ModelSpec {
        architecture: Architecture::Qwen3Moe,
        moe: Some(moe.clone()),
        ..small(1)
    };
    let t = tensors(write(&qwen).path());
    // Layer 0 is dense (step 2), layer 1 sparse.
    assert_eq!(t["model.layers.0.mlp.gate_proj.weight"].dims(), &[128, 64]);
    assert_eq!(t["model.layers.1.mlp.gate.weight"].dims(), &[4, 64]);
    assert_eq!(
        t["model.layers.1.mlp.experts.3.down_proj.weight"].dims(),
        &[64, 24]
    );
    assert!(t.contains_key("model.layers.1.self_attn.q_norm.weight"));
    let cfg = config_json(&qwen);
    assert_eq!(
        (
            cfg["num_experts"].clone(),
            cfg["moe_intermediate_size"].clone()
        ),
        (json!(4), json!(24))
    );
    let mixtral = ModelSpec {
        architecture: Architecture::Mixtral,
        moe: Some(MoeSpec {
            expert_ffn: None,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            ..moe
        }),
        ..small(1)
    };
    let t = tensors(write(&mixtral).path());
    assert_eq!(
        t["model.layers.0.block_sparse_moe.experts.2.w3.weight"].dims(),
        &[128, 64]
    );
    assert_eq!(config_json(&mixtral)["num_local_experts"], 4);
    let err = ModelSpec {
        architecture: Architecture::Mixtral,
        ..small(1)
    }
    .validate()
    .expect_err("no experts");
    assert!(err.to_string().contains("give moe"), "{err}");
}

#[test]
fn tied_model_has_no_lm_head_and_bf16_is_stored_as_bf16() {
    let dir = write(&ModelSpec {
        dtype: WeightDtype::BF16,
        ..small(1)
    });
    let t = tensors(dir.path());
    assert!(!t.contains_key("lm_head.weight"));
    assert!(t.values().all(|x| x.dtype() == DType::BF16));
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("config.json")).expect("config"),
    )
    .expect("json");
    assert_eq!(cfg["torch_dtype"], "bfloat16");
}

#[test]
fn rope_parameters_layout_has_no_top_level_theta() {
    let spec = ModelSpec {
        rope_layout: RopeLayout::RopeParameters,
        rope_theta: 50_000.0,
        rope_scaling: Some(json!({"rope_type": "linear", "factor": 2.0})),
        ..small(1)
    };
    let cfg = config_json(&spec);
    assert!(cfg.get("rope_theta").is_none());
    assert!(cfg.get("rope_scaling").is_none());
    assert_eq!(
        cfg["rope_parameters"],
        json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})
    );
}

#[test]
fn tokenizer_is_padded_to_the_vocab() {
    let dir = write(&small(1));
    let tok: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer.json")).expect("tokenizer"),
    )
    .expect("json");
    let added = tok["added_tokens"].as_array().expect("added");
    assert_eq!(added.last().expect("padded")["id"], 31);
    assert_eq!(added.last().expect("padded")["content"], "<extra_31>");
}

#[test]
fn specs_round_trip_through_json_and_bad_ones_are_named() {
    let spec = ModelSpec {
        architecture: Architecture::Mistral,
        sliding_window: Some(4096),
        ..small(3)
    };
    let text = serde_json::to_string(&spec).expect("serializes");
    assert!(text.contains("\"MistralForCausalLM\""), "{text}");
    assert_eq!(
        serde_json::from_str::<ModelSpec>(&text).expect("parses"),
        spec
    );
    let err = ModelSpec {
        architecture: Architecture::Qwen2,
        ..small(1)
    }
    .validate()
    .expect_err("qwen2 without bias");
    assert!(err.to_string().contains("attention_bias"), "{err}");
    let err = ModelSpec {
        kv_heads: 3,
        ..small(1)
    }
    .validate()
    .expect_err("4 heads over 3 kv heads");
    assert!(err.to_string().contains("kv_heads 3"), "{err}");
    let tok = tokenizer_dir();
    let out = tempfile::tempdir().expect("tempdir");
    let err = write_model(
        out.path(),
        &ModelSpec {
            vocab: 3,
            ..small(1)
        },
        tok.path(),
    )
    .expect_err("tokenizer larger than vocab");
    assert!(err.to_string().contains("vocab of 3"), "{err}");
}
