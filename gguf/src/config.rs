//! The model's hyper-parameters from llama.cpp's metadata keys (`llama.block_count`,
//! `llama.attention.head_count_kv`, `llama.rope.freq_base`, ...), written as the transformers
//! `config.json` the engine already reads, so that one resolver decides every default.

use serde_json::{json, Value as Json};

use crate::error::{GgufError, Result};
use crate::file::{GgufFile, MetadataExt};

/// An architecture this crate maps: llama.cpp's name and transformers' class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn from_gguf(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(GgufError::UnsupportedArchitecture {
                architecture: other.to_string(),
            }),
        }
    }

    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// llama.cpp's converter permutes q and k rows of Llama checkpoints for its own rope
    /// layout (interleaved pairs); Qwen's are stored as transformers has them.
    pub fn permutes_qk(self) -> bool {
        self == Arch::Llama
    }
}

/// The file's architecture.
pub fn arch(file: &GgufFile) -> Result<Arch> {
    Arch::from_gguf(file.metadata().str("general.architecture")?)
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
    if let Some(r) = m.opt_u64(&k("rope.dimension_count"))? {
        if r as usize != head_dim {
            return Err(GgufError::BadMetadata {
                key: k("rope.dimension_count"),
                reason: format!("{r}: partial rotary (head_dim {head_dim}) is not supported"),
            });
        }
    }
    if file.tensor_entry("rope_freqs.weight").is_some() {
        return Err(GgufError::BadTensor {
            name: "rope_freqs.weight".into(),
            reason: "per-frequency rope factors (Llama 3.1+ rope scaling) are not yet supported from GGUF".into(),
        });
    }
    let rope_scaling = match m.opt_str(&k("rope.scaling.type"))? {
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
    Ok(json!({
        "architectures": [arch.hf_class()],
        "model_type": arch.gguf_name(),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": m.usize(&k("feed_forward_length"))?,
        "num_hidden_layers": m.usize(&k("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": m.opt_u64(&k("context_length"))?.unwrap_or(4096),
        "rms_norm_eps": m.opt_f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        "rope_theta": m.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
        "rope_scaling": rope_scaling,
        "attention_bias": file.tensor_entry("blk.0.attn_q.bias").is_some(),
        "tie_word_embeddings": file.tensor_entry("output.weight").is_none(),
        "hidden_act": "silu",
        "bos_token_id": m.opt_u64("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": m.opt_u64("tokenizer.ggml.eos_token_id")?,
        "torch_dtype": "float32",
    }))
}
