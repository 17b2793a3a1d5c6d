//! The model's hyper-parameters from llama.cpp's metadata keys (`llama.block_count`,
//! `llama.attention.head_count_kv`, `llama.rope.freq_base`, ...), written as the transformers
//! `config.json` the engine already reads, so that one resolver decides every default.
//!
//! Where the file is silent, llama.cpp's own rules decide, not transformers' defaults: the
//! file means what llama.cpp runs. Gemma's attention scale is `1/sqrt(head_dim)` (the
//! converter writes no `query_pre_attn_scalar`; llama.cpp takes `hidden / heads` for the 27B
//! shapes only), Gemma 2's output is always the embedding, Gemma 3's window pattern defaults to
//! 6 and its local rope base to 10 000, Qwen3-MoE's top-k weights are always renormalised. Phi-3's
//! LongRoPE factors come from the `rope_factors_{short,long}` tensors.

use serde_json::{json, Value as Json};

use candle_core::quantized::gguf_file::Value;

use crate::arch::Arch;
use crate::error::{GgufError, Result};
use crate::file::{GgufFile, MetadataExt};

/// More layers than any model has; the bound on `block_count`.
const MAX_LAYERS: usize = 1 << 16;

/// The file's architecture.
pub fn arch(file: &GgufFile) -> Result<Arch> {
    let m = file.metadata();
    Arch::from_gguf(
        m.str("general.architecture")?,
        m.opt_u64("llama.expert_count")?,
    )
}

/// A rope factor tensor's values, each the shortest decimal that reads back as the same f32
/// (the number the checkpoint's config.json had, as for f32 metadata).
fn factors(file: &GgufFile, name: &str) -> Result<Option<Vec<f64>>> {
    if file.tensor_entry(name).is_none() {
        return Ok(None);
    }
    let t = file.tensor_f32(&mut file.reader()?, name)?;
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(Some(
        v.iter()
            .map(|x| x.to_string().parse().unwrap_or(f64::from(*x)))
            .collect(),
    ))
}

/// The transformers `config.json` for the model in `file`.
pub fn hf_config(file: &GgufFile) -> Result<Json> {
    let m = file.metadata();
    let arch = arch(file)?;
    let k = |s: &str| format!("{}.{s}", arch.gguf_name());
    let heads = m.usize(&k("attention.head_count"))?;
    let kv_heads = m
        .opt_u64(&k("attention.head_count_kv"))?
        .map(|v| v as usize)
        .unwrap_or(heads);
    let hidden = m.usize(&k("embedding_length"))?;
    let layers = m.usize(&k("block_count"))?;
    if layers > MAX_LAYERS {
        // Per-layer lists are built from it: an untrusted file must not size them.
        return Err(GgufError::BadMetadata {
            key: k("block_count"),
            reason: format!("{layers} exceeds {MAX_LAYERS} layers"),
        });
    }
    let head_dim = match m.opt_u64(&k("attention.key_length"))? {
        Some(d) => d as usize,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    if let Some(v) = m.opt_u64(&k("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(GgufError::BadMetadata {
                key: k("attention.value_length"),
                reason: format!(
                    "{v} differs from the key length {head_dim}, which is not supported"
                ),
            });
        }
    }
    let mut partial_rotary = Json::Null;
    if let Some(r) = m.opt_u64(&k("rope.dimension_count"))? {
        let r = r as usize;
        if r != head_dim {
            if arch != Arch::Phi3 || r == 0 || r > head_dim {
                return Err(GgufError::BadMetadata {
                    key: k("rope.dimension_count"),
                    reason: format!(
                        "{r}: partial rotary (head_dim {head_dim}) is supported for phi3 only"
                    ),
                });
            }
            partial_rotary = json!(r as f64 / head_dim as f64);
        }
    }
    if file.tensor_entry("rope_freqs.weight").is_some() {
        return Err(GgufError::BadTensor {
            name: "rope_freqs.weight".into(),
            reason: "per-frequency rope factors (Llama 3.1+ rope scaling) are not yet supported from GGUF".into(),
        });
    }
    let original_ctx = m.opt_u64(&k("rope.scaling.original_context_length"))?;
    let rope_scaling =
        match (
            factors(file, "rope_factors_short.weight")?,
            factors(file, "rope_factors_long.weight")?,
        ) {
            (Some(short), Some(long)) if arch == Arch::Phi3 => {
                let mut s =
                    json!({"rope_type": "longrope", "short_factor": short, "long_factor": long});
                // The converter derives the attention factor from the context growth, as the
                // engine does when it is absent; a file that says otherwise is followed.
                let max_pos = m.opt_u64(&k("context_length"))?.unwrap_or(4096) as f64;
                let orig = original_ctx.unwrap_or(4096) as f64;
                let scale = max_pos / orig;
                let derived = if scale > 1.0 {
                    (1.0 + scale.ln() / orig.ln()).sqrt()
                } else {
                    1.0
                };
                if let Some(a) = m.opt_f64(&k("rope.scaling.attn_factor"))? {
                    if (a - derived).abs() > 1e-6 * derived {
                        s["attention_factor"] = json!(a);
                    }
                }
                s
            }
            (None, None) => match m.opt_str(&k("rope.scaling.type"))? {
                None | Some("none") => Json::Null,
                Some("linear") => json!({
                    "rope_type": "linear",
                    "factor": m.opt_f64(&k("rope.scaling.factor"))?.unwrap_or(1.0),
                }),
                Some(other) => {
                    return Err(GgufError::BadMetadata {
                        key: k("rope.scaling.type"),
                        reason: format!("{other:?} is not supported (none and linear are)"),
                    })
                }
            },
            _ => return Err(GgufError::BadTensor {
                name: "rope_factors_short.weight".into(),
                reason:
                    "LongRoPE needs both rope_factors_short and rope_factors_long, in phi3 files"
                        .into(),
            }),
        };
    let embd = file
        .tensor_entry("token_embd.weight")
        .ok_or_else(|| GgufError::BadTensor {
            name: "token_embd.weight".into(),
            reason: "missing".into(),
        })?;
    let vocab = match m.opt_u64(&k("vocab_size"))? {
        Some(v) => v as usize,
        None => embd.dims.get(1).copied().unwrap_or(0) as usize,
    };
    let expert_ffn = m.opt_u64(&k("expert_feed_forward_length"))?;
    let ffn = match m.opt_u64(&k("feed_forward_length"))? {
        Some(f) => f as usize,
        None => expert_ffn
            .map(|f| f as usize)
            .ok_or_else(|| GgufError::MissingMetadata {
                key: k("feed_forward_length"),
            })?,
    };
    let mut cfg = json!({
        "architectures": [arch.hf_class()],
        "model_type": arch.model_type(),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": m.opt_u64(&k("context_length"))?.unwrap_or(4096),
        "rms_norm_eps": m.opt_f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        "rope_theta": m.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
        "rope_scaling": rope_scaling,
        "attention_bias": file.tensor_entry("blk.0.attn_q.bias").is_some(),
        "tie_word_embeddings": arch == Arch::Gemma2 || file.tensor_entry("output.weight").is_none(),
        "hidden_act": "silu",
        "bos_token_id": m.opt_u64("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": m.opt_u64("tokenizer.ggml.eos_token_id")?,
        "torch_dtype": "float32",
    });
    let mut set = |key: &str, v: Json| {
        cfg[key] = v;
    };
    match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => {}
        Arch::Mixtral | Arch::Qwen3Moe => {
            let experts = m.usize(&k("expert_count"))?;
            let used = m.usize(&k("expert_used_count"))?;
            if arch == Arch::Mixtral {
                set("num_local_experts", json!(experts));
            } else {
                // Every layer sparse: llama.cpp's qwen3moe has no dense layers.
                let names: std::collections::HashSet<&str> =
                    file.tensors().iter().map(|t| t.name.as_str()).collect();
                for l in 0..layers {
                    if !names.contains(format!("blk.{l}.ffn_gate_exps.weight").as_str()) {
                        return Err(GgufError::BadTensor {
                            name: format!("blk.{l}.ffn_gate_exps.weight"),
                            reason: "missing: qwen3moe layers without experts are not supported"
                                .into(),
                        });
                    }
                }
                set("num_experts", json!(experts));
                set(
                    "moe_intermediate_size",
                    json!(expert_ffn.unwrap_or(ffn as u64)),
                );
                set("norm_topk_prob", json!(true));
                set("decoder_sparse_step", json!(1));
                set("mlp_only_layers", json!([]));
            }
            set("num_experts_per_tok", json!(used));
        }
        Arch::Gemma2 | Arch::Gemma3 => {
            set("hidden_act", Json::Null);
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            // llama.cpp's scale: the 27B shapes (46 or 62 layers) take hidden / heads.
            let big = matches!((arch, layers), (Arch::Gemma2, 46) | (Arch::Gemma3, 62));
            let scalar = if big && heads > 0 {
                hidden / heads
            } else {
                head_dim
            };
            set("query_pre_attn_scalar", json!(scalar));
            let gemma2 = arch == Arch::Gemma2;
            let window = m.opt_u64(&k("attention.sliding_window"))?;
            let window = if gemma2 {
                Some(window.unwrap_or(4096))
            } else {
                window
            };
            match window.filter(|&w| w > 0) {
                Some(w) => {
                    set("sliding_window", json!(w));
                    set(
                        "layer_types",
                        json!(layer_types(m, &k, layers, if gemma2 { 2 } else { 6 })?),
                    );
                }
                None => set("sliding_window", Json::Null),
            }
            let local = m.opt_f64(&k("rope.freq_base_swa"))?;
            if gemma2 {
                // Gemma 2's sliding layers share the global base (the engine has no other).
                if local.is_some_and(|l| Some(l) != cfg["rope_theta"].as_f64()) {
                    return Err(GgufError::BadMetadata {
                        key: k("rope.freq_base_swa"),
                        reason: "a local rope base apart from the global one is not supported for gemma2".into(),
                    });
                }
            } else {
                cfg["rope_local_base_freq"] = json!(local.unwrap_or(10_000.0));
            }
            let caps = |cfg: &mut Json, name: &str, default: Option<f64>| -> Result<()> {
                cfg[name] = json!(m.opt_f64(&k(name))?.or(default));
                Ok(())
            };
            if gemma2 {
                caps(&mut cfg, "attn_logit_softcapping", Some(50.0))?;
                caps(&mut cfg, "final_logit_softcapping", Some(30.0))?;
            } else {
                cfg["attn_logit_softcapping"] = Json::Null;
                caps(&mut cfg, "final_logit_softcapping", None)?;
            }
        }
        Arch::Phi3 => {
            set("partial_rotary_factor", partial_rotary);
            if let Some(o) = original_ctx {
                set("original_max_position_embeddings", json!(o));
            }
            // 0: no window (the converter's mark for Phi-4). llama.cpp itself runs Phi-3
            // without its window for now; transformers applies it, and so does the engine.
            let window = m
                .opt_u64(&k("attention.sliding_window"))?
                .filter(|&w| w > 0);
            set("sliding_window", json!(window));
        }
    }
    Ok(cfg)
}

/// Each layer's attention type from `ARCH.attention.sliding_window_pattern`: a bool per
/// layer (sliding where true), or `n` (every n-th layer global), else `default_pattern`.
fn layer_types(
    m: &crate::file::Metadata,
    k: &dyn Fn(&str) -> String,
    layers: usize,
    default_pattern: usize,
) -> Result<Vec<&'static str>> {
    let key = k("attention.sliding_window_pattern");
    let sliding: Vec<bool> = match m.get(&key) {
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(GgufError::BadMetadata {
                    key,
                    reason: format!("{} entries for {layers} layers", a.len()),
                });
            }
            a.iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    other => Err(GgufError::BadMetadata {
                        key: key.clone(),
                        reason: format!("expected bools, found {:?}", other.value_type()),
                    }),
                })
                .collect::<Result<_>>()?
        }
        _ => {
            let n = m
                .opt_u64(&key)?
                .map(|n| n as usize)
                .unwrap_or(default_pattern);
            // llama.cpp's set_swa_pattern: layer i slides unless (i + 1) is a multiple of n;
            // n = 0 slides every layer.
            (0..layers).map(|i| n == 0 || (i + 1) % n != 0).collect()
        }
    };
    Ok(sliding
        .into_iter()
        .map(|s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect())
}
