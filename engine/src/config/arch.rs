//! What each supported architecture changes in the one decoder layer the engine runs, written
//! down once as an [`ArchSpec`]. The host path (`model/host.rs`) and the tensor path
//! (`model/llama.rs`) both read it, and neither names an architecture: a new one is a new row in
//! [`ArchSpec::resolve`], plus an op where it needs one the layer lacks.
//!
//! Supported: Llama, Mistral (its `sliding_window` applied to every layer), Qwen2 (q/k/v
//! biases; `use_sliding_window` windows the layers from `max_window_layers` on), Qwen3 dense
//! (per-head q/k RMSNorm, no biases by default), Gemma 2 and Gemma 3 text: embeddings scaled
//! by sqrt(hidden), `(1 + w)` norms, a norm after attention and after the MLP as well as before
//! each ([`ArchSpec::sandwich_norms`]), tanh-GELU gating, `query_pre_attn_scalar`,
//! attention-logit and final-logit soft-capping, sliding-window layers interleaved with
//! global ones (`layer_types`, else Gemma 2's alternation or Gemma 3's
//! `sliding_window_pattern`), and Gemma 3's q/k norms and local RoPE base
//! (`rope_local_base_freq`). Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): fused `qkv_proj` and
//! `gate_up_proj` tensors ([`ArchSpec::fused_checkpoint`]), `partial_rotary_factor` (rope on
//! the first `rotary_dim` of each head, rotate-half within them), LongRoPE (`longrope`, short
//! and long factors, the attention factor on cos and sin), `sliding_window` on every layer as
//! transformers applies it, tied or untied embeddings. The per-layer numbers (window, scale,
//! caps, rope bases, rotary width) are in [`ModelConfig`](crate::config::ModelConfig),
//! resolved in `config.rs`. Mixtures of experts ([`ArchSpec::moe`]): Mixtral
//! (softmax over the experts, top-k, renormalised) and Qwen3-MoE (Qwen3's layer; top-k
//! renormalised only with `norm_topk_prob`; dense layers where `decoder_sparse_step` and
//! `mlp_only_layers` say), their numbers in [`MoeConfig`](crate::config::MoeConfig) and the
//! block in `model/moe.rs`.
//!
//! LongRoPE differs from transformers past `original_max_position_embeddings` (see
//! `model/rope.rs`): transformers picks one factor set for a whole forward from its sequence
//! length, and its `generate` recomputes the whole sequence once it outgrows the original
//! context; the engine rotates each position by its own side of that length, so a block's KV
//! depends only on its tokens (chunking, batching, the prefix cache, migration and the
//! prefill/decode split stay exact). Sequences that stay within it are transformers' exactly.
//!
//! A sliding window also bounds the KV an engine holds (`kv/groups.rs`): the layers of one
//! window share a block table per sequence, and the blocks wholly before the window are freed
//! after each step, exactly, prefix cache included; a decode node keeps only the window of a
//! pushed sliding layer (`Engine::import_layer`). A prefill node frees its windows' past too,
//! and pushes a sliding layer's window only (`LayerDone::pushed_blocks`; the decode registry
//! takes that suffix of the reservation). The KV layout carries the windows (`windows`), so
//! nodes that cut them differently are refused (benchmarks/history/2026-11-29-window-kv.md,
//! 2026-11-29-window-push.md).
//!
//! Not yet supported, and refused when config.json asks for them (see `resolve` in
//! `config.rs`): any other `hidden_act`, rope types other than linear, llama3 and longrope.
//! Each has its place here: a variant of [`NormStyle`] or [`Activation`], or a field of
//! `ArchSpec`, so that matching on it exhaustively in both paths forces both to handle it.
//! Every architecture here also loads from GGUF: the `gguf` crate writes llama.cpp's keys and
//! tensors in this checkpoint layout (`gguf/src/arch.rs`).

use super::moe::MoeLayout;
use crate::error::{EngineError, Result};

/// Which transformers class the checkpoint was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    /// Mistral's layer with a mixture of experts for its MLP (`block_sparse_moe`).
    Mixtral,
    /// Qwen3's layer (q/k norms) with a mixture of experts in its sparse layers.
    Qwen3Moe,
}

impl Architecture {
    /// Every supported architecture, as config.json's `architectures` names it.
    pub const SUPPORTED: &'static [&'static str] = &[
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ];

    /// From config.json's `architectures[0]`, or its `model_type` when that is missing.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" | "llama" => Ok(Architecture::Llama),
            "MistralForCausalLM" | "mistral" => Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => Ok(Architecture::Qwen2),
            "Qwen3ForCausalLM" | "qwen3" => Ok(Architecture::Qwen3),
            "Gemma2ForCausalLM" | "gemma2" => Ok(Architecture::Gemma2),
            "Gemma3ForCausalLM" | "gemma3_text" => Ok(Architecture::Gemma3),
            "Phi3ForCausalLM" | "phi3" => Ok(Architecture::Phi3),
            "MixtralForCausalLM" | "mixtral" => Ok(Architecture::Mixtral),
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Ok(Architecture::Qwen3Moe),
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
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Phi3 => "phi3",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The defaults transformers' config class applies for what config.json leaves out.
    pub fn defaults(self) -> ArchDefaults {
        let none = ArchDefaults {
            rope_theta: 10_000.0,
            local_rope_theta: None,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window: None,
            sliding_window_pattern: None,
        };
        match self {
            Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 => none,
            Architecture::Qwen3 | Architecture::Phi3 => none,
            Architecture::Mixtral | Architecture::Qwen3Moe => none,
            // Gemma2Config: layers alternate sliding, full, sliding, ...
            Architecture::Gemma2 => ArchDefaults {
                query_pre_attn_scalar: Some(256.0),
                attn_logit_softcapping: Some(50.0),
                final_logit_softcapping: Some(30.0),
                sliding_window: Some(4096),
                sliding_window_pattern: Some(2),
                ..none
            },
            // Gemma3TextConfig: five sliding layers, then a full one; global rope base 1e6,
            // local 1e4.
            Architecture::Gemma3 => ArchDefaults {
                rope_theta: 1_000_000.0,
                local_rope_theta: Some(10_000.0),
                query_pre_attn_scalar: Some(256.0),
                sliding_window: Some(4096),
                sliding_window_pattern: Some(6),
                ..none
            },
        }
    }
}

/// What an architecture's transformers config class assumes when config.json is silent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchDefaults {
    pub rope_theta: f64,
    /// The sliding layers' own rope base, when the architecture has one (Gemma 3).
    pub local_rope_theta: Option<f64>,
    pub query_pre_attn_scalar: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub sliding_window: Option<usize>,
    /// Layer `i` slides unless `(i + 1)` is a multiple of this; `None`: every layer slides when
    /// there is a window.
    pub sliding_window_pattern: Option<usize>,
}

/// How a norm applies its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// `x / rms(x) * w`.
    Weight,
    /// `x / rms(x) * (1 + w)`, the `1 + w` in f32 (Gemma).
    OnePlusWeight,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up`.
    Silu,
    /// `gelu_tanh(gate) * up`: torch's `gelu(approximate="tanh")`, transformers'
    /// `gelu_pytorch_tanh` (Gemma's GeGLU).
    GeluTanh,
}

impl Activation {
    /// From config.json's `hidden_act` / `hidden_activation`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            other => Err(EngineError::InvalidConfig {
                reason: format!(
                    "hidden_act {other:?} is not supported (only silu and gelu_pytorch_tanh)"
                ),
            }),
        }
    }
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
    /// Gemma's four norms a layer: `input_layernorm` before attention,
    /// `post_attention_layernorm` on attention's output before its residual add,
    /// `pre_feedforward_layernorm` before the MLP and `post_feedforward_layernorm` on its
    /// output. Without them, `post_attention_layernorm` is the norm before the MLP (Llama).
    pub sandwich_norms: bool,
    /// The embeddings are multiplied by sqrt(hidden), rounded to the embedding dtype (Gemma).
    pub embed_scale: bool,
    /// The checkpoint stores q, k and v as one `self_attn.qkv_proj` and gate and up as one
    /// `mlp.gate_up_proj` (Phi-3), in the order the engine fuses them (q, k, v; gate, up):
    /// loaded as they are, where the others' separate tensors are concatenated.
    pub fused_checkpoint: bool,
    /// The MLP is a mixture of experts (in every layer, or in the sparse ones that
    /// [`MoeConfig`](crate::config::MoeConfig) names), its router and experts stored as this
    /// layout says; `None`: one dense MLP a layer.
    pub moe: Option<MoeLayout>,
}

impl ArchSpec {
    /// The spec of `architecture`; `attention_bias` and `activation` are config.json's, when
    /// it says.
    pub fn resolve(
        architecture: Architecture,
        attention_bias: Option<bool>,
        activation: Option<Activation>,
    ) -> Self {
        let llama = ArchSpec {
            architecture,
            qkv_bias: false,
            qk_norm: false,
            norm: NormStyle::Weight,
            activation: Activation::Silu,
            sandwich_norms: false,
            embed_scale: false,
            fused_checkpoint: false,
            moe: None,
        };
        let gemma = ArchSpec {
            norm: NormStyle::OnePlusWeight,
            activation: Activation::GeluTanh,
            sandwich_norms: true,
            embed_scale: true,
            ..llama
        };
        let spec = match architecture {
            Architecture::Llama | Architecture::Mistral => llama,
            // Qwen2's config never says: its attention always has biases.
            Architecture::Qwen2 => ArchSpec {
                qkv_bias: true,
                ..llama
            },
            Architecture::Qwen3 => ArchSpec {
                qk_norm: true,
                ..llama
            },
            Architecture::Gemma2 => gemma,
            Architecture::Gemma3 => ArchSpec {
                qk_norm: true,
                ..gemma
            },
            // Phi-3 and Phi-4-mini: Llama's layer from fused tensors. Their partial rotary and
            // LongRoPE are numbers of the model (`rotary_dim`, `RopeScaling::LongRope`).
            Architecture::Phi3 => ArchSpec {
                fused_checkpoint: true,
                ..llama
            },
            Architecture::Mixtral => ArchSpec {
                moe: Some(MoeLayout::Mixtral),
                ..llama
            },
            Architecture::Qwen3Moe => ArchSpec {
                qk_norm: true,
                moe: Some(MoeLayout::Qwen),
                ..llama
            },
        };
        ArchSpec {
            qkv_bias: attention_bias.unwrap_or(spec.qkv_bias),
            activation: activation.unwrap_or(spec.activation),
            ..spec
        }
    }

    /// Plain Llama: what the mock model and cost profiles describe.
    pub fn llama() -> Self {
        Self::resolve(Architecture::Llama, None, None)
    }
}
