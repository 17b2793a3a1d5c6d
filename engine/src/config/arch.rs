//! What each supported architecture changes in the one decoder layer the engine runs, written
//! down once as an [`ArchSpec`]. The host path (`model/host.rs`) and the tensor path
//! (`model/llama.rs`) both read it, and neither names an architecture: a new one is a new row in
//! [`ArchSpec::resolve`], plus an op where it needs one the layer lacks.
//!
//! Supported: Llama, Mistral (a `sliding_window` caps the served context rather than being
//! applied per layer), Qwen2 (q/k/v biases) and Qwen3 dense (per-head q/k RMSNorm, no biases by
//! default).
//!
//! Not yet supported, and refused when config.json asks for them (see `resolve` in
//! `config.rs`): any `hidden_act` but SiLU (Gemma's tanh GELU), `(1 + w)` norms, the extra
//! post-attention and post-MLP norms, embedding scaling, `query_pre_attn_scalar`, attention
//! and final-logit soft-capping, per-layer sliding windows and rope bases (`layer_types`),
//! fused `qkv_proj`/`gate_up_proj` checkpoint tensors with `partial_rotary_factor` and LongRoPE
//! (Phi-3), and mixtures of experts (Mixtral, Qwen3-MoE). Each has its place here: a variant of
//! [`NormStyle`] or [`Activation`], or a field of `ArchSpec`, so that matching on it
//! exhaustively in both paths forces both to handle it.

use crate::error::{EngineError, Result};

/// Which transformers class the checkpoint was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    /// Every supported architecture, as config.json's `architectures` names it.
    pub const SUPPORTED: &'static [&'static str] = &[
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ];

    /// From config.json's `architectures[0]`, or its `model_type` when that is missing.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" | "llama" => Ok(Architecture::Llama),
            "MistralForCausalLM" | "mistral" => Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => Ok(Architecture::Qwen2),
            "Qwen3ForCausalLM" | "qwen3" => Ok(Architecture::Qwen3),
            _ => Err(EngineError::UnsupportedArchitecture {
                architecture: name.to_string(),
                supported: Architecture::SUPPORTED,
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }
}

/// How a norm applies its weight. Gemma's `x * (1 + w)` will be a second variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// `x / rms(x) * w`.
    Weight,
}

/// The MLP's gate activation. Gemma's tanh-approximated GELU will be a second variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up`.
    Silu,
}

/// What the architecture changes in the decoder layer, with every default applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchSpec {
    pub architecture: Architecture,
    /// q, k and v projections carry biases (`self_attn.{q,k,v}_proj.bias`).
    pub qkv_bias: bool,
    /// An RMSNorm over each head of q and of k (`self_attn.q_norm.weight`,
    /// `self_attn.k_norm.weight`, head_dim wide, shared by the heads), after the projection and
    /// before rope.
    pub qk_norm: bool,
    /// Every RMSNorm's weight: the layer's two, the q/k norms and the final one.
    pub norm: NormStyle,
    pub activation: Activation,
}

impl ArchSpec {
    /// The spec of `architecture`; `attention_bias` is config.json's, when it says.
    pub fn resolve(architecture: Architecture, attention_bias: Option<bool>) -> Self {
        let (default_bias, qk_norm) = match architecture {
            Architecture::Llama | Architecture::Mistral => (false, false),
            // Qwen2's config never says: its attention always has biases.
            Architecture::Qwen2 => (true, false),
            Architecture::Qwen3 => (false, true),
        };
        ArchSpec {
            architecture,
            qkv_bias: attention_bias.unwrap_or(default_bias),
            qk_norm,
            norm: NormStyle::Weight,
            activation: Activation::Silu,
        }
    }

    /// Plain Llama: what the mock model and cost profiles describe.
    pub fn llama() -> Self {
        Self::resolve(Architecture::Llama, None)
    }
}
