//! The architectures this crate maps, by llama.cpp's `general.architecture` name, and each
//! one's tensor names: llama.cpp's (`blk.N.attn_q`, `blk.N.ffn_gate_exps`, ...) to the
//! transformers names the engine loads.
//!
//! llama.cpp names some models after another: Mistral is `llama` (its converter drops the
//! sliding window), Mixtral is `llama` with `llama.expert_count`. Gemma's norms are stored
//! with transformers' `1 +` folded in by the converter, Phi-3's projections fused
//! (`attn_qkv`, and `ffn_up` holding gate then up), and the experts of a mixture as one 3-D
//! tensor per projection, `[experts, out, in]`.

use crate::error::{GgufError, Result};

/// An architecture this crate maps: llama.cpp's name and transformers' class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama, and Mistral (the same file: llama.cpp has no Mistral of its own).
    Llama,
    /// `llama` with experts.
    Mixtral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma2,
    Gemma3,
    /// Phi-3 and Phi-4-mini.
    Phi3,
}

/// A projection of a mixture's experts, stored as one `[experts, out, in]` tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

/// Where a llama.cpp tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One transformers tensor.
    One(String),
    /// Layer `layer`'s experts: each expert's slice of the 3-D tensor is its own tensor,
    /// named by [`Arch::expert_name`].
    Experts { layer: usize, part: ExpertPart },
}

impl Arch {
    /// From `general.architecture` and, for `llama`, `llama.expert_count`.
    pub fn from_gguf(name: &str, expert_count: Option<u64>) -> Result<Self> {
        match name {
            "llama" if expert_count.unwrap_or(0) > 0 => Ok(Arch::Mixtral),
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gemma2" => Ok(Arch::Gemma2),
            "gemma3" => Ok(Arch::Gemma3),
            "phi3" => Ok(Arch::Phi3),
            other => Err(GgufError::UnsupportedArchitecture {
                architecture: other.to_string(),
            }),
        }
    }

    /// llama.cpp's name: the prefix of the model's metadata keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama | Arch::Mixtral => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    /// transformers' class, which config.json's `architectures` names.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Gemma2 => "Gemma2ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Phi3 => "Phi3ForCausalLM",
        }
    }

    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3_text",
            Arch::Phi3 => "phi3",
        }
    }

    /// llama.cpp's converter permutes q and k rows of Llama-family checkpoints for its own
    /// rope layout (interleaved pairs); the others use rotate-half (NEOX) and are stored as
    /// transformers has them.
    pub fn permutes_qk(self) -> bool {
        matches!(self, Arch::Llama | Arch::Mixtral)
    }

    /// The converter stores Gemma's norm weights as transformers' `1 + w`: every tensor whose
    /// name ends in `norm.weight`.
    pub fn norms_store_one_plus(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// Gemma's four norms a layer (llama.cpp's `ffn_norm` is the one before the MLP).
    fn sandwich_norms(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// Where the router and experts of a mixture live, and each expert projection's name.
    fn moe_names(self) -> Option<(&'static str, [&'static str; 3])> {
        match self {
            Arch::Mixtral => Some(("block_sparse_moe", ["w1", "w3", "w2"])),
            Arch::Qwen3Moe => Some(("mlp", ["gate_proj", "up_proj", "down_proj"])),
            _ => None,
        }
    }

    /// The transformers name of expert `expert`'s `part` in `layer`.
    pub fn expert_name(self, layer: usize, part: ExpertPart, expert: usize) -> String {
        let (block, [gate, up, down]) = self
            .moe_names()
            .unwrap_or(("mlp", ["gate_proj", "up_proj", "down_proj"]));
        let p = match part {
            ExpertPart::Gate => gate,
            ExpertPart::Up => up,
            ExpertPart::Down => down,
        };
        format!("model.layers.{layer}.{block}.experts.{expert}.{p}.weight")
    }

    /// Where the llama.cpp tensor `gguf` goes; `None` for tensors the engine does not load
    /// (rope factor tensors are read into the config instead; Gemma 2's `output` is unused by
    /// llama.cpp, which always ties it).
    pub fn target(self, gguf: &str) -> Option<Target> {
        let whole = match gguf {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "output.weight" if self != Arch::Gemma2 => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(n) = whole {
            return Some(Target::One(n.to_string()));
        }
        let rest = gguf.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (part, suffix) = rest.rsplit_once('.')?;
        if let Some((block, _)) = self.moe_names() {
            let expert = match part {
                "ffn_gate_exps" => Some(ExpertPart::Gate),
                "ffn_up_exps" => Some(ExpertPart::Up),
                "ffn_down_exps" => Some(ExpertPart::Down),
                _ => None,
            };
            if let Some(part) = expert {
                return (suffix == "weight").then_some(Target::Experts { layer, part });
            }
            if part == "ffn_gate_inp" {
                return Some(Target::One(format!(
                    "model.layers.{layer}.{block}.gate.{suffix}"
                )));
            }
        }
        let hf = match part {
            "attn_norm" => "input_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_qkv" if self == Arch::Phi3 => "self_attn.qkv_proj",
            "attn_output" => "self_attn.o_proj",
            "attn_q_norm" => "self_attn.q_norm",
            "attn_k_norm" => "self_attn.k_norm",
            "post_attention_norm" if self.sandwich_norms() => "post_attention_layernorm",
            "ffn_norm" if self.sandwich_norms() => "pre_feedforward_layernorm",
            "post_ffw_norm" if self.sandwich_norms() => "post_feedforward_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "ffn_gate" => "mlp.gate_proj",
            // Phi-3's `ffn_up` is its fused gate_up_proj: gate's rows, then up's.
            "ffn_up" if self == Arch::Phi3 => "mlp.gate_up_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            _ => return None,
        };
        Some(Target::One(format!("model.layers.{layer}.{hf}.{suffix}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(arch: Arch, gguf: &str) -> Option<String> {
        match arch.target(gguf) {
            Some(Target::One(n)) => Some(n),
            _ => None,
        }
    }

    #[test]
    fn each_architecture_maps_its_own_names() {
        assert_eq!(
            one(Arch::Gemma2, "blk.1.ffn_norm.weight").as_deref(),
            Some("model.layers.1.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            one(Arch::Gemma3, "blk.0.post_ffw_norm.weight").as_deref(),
            Some("model.layers.0.post_feedforward_layernorm.weight")
        );
        assert_eq!(
            one(Arch::Llama, "blk.1.ffn_norm.weight").as_deref(),
            Some("model.layers.1.post_attention_layernorm.weight")
        );
        assert_eq!(one(Arch::Llama, "blk.0.post_ffw_norm.weight"), None);
        assert_eq!(one(Arch::Gemma2, "output.weight"), None);
        assert_eq!(
            one(Arch::Gemma3, "output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            one(Arch::Phi3, "blk.0.attn_qkv.weight").as_deref(),
            Some("model.layers.0.self_attn.qkv_proj.weight")
        );
        assert_eq!(
            one(Arch::Phi3, "blk.0.ffn_up.weight").as_deref(),
            Some("model.layers.0.mlp.gate_up_proj.weight")
        );
        assert_eq!(one(Arch::Llama, "blk.0.attn_qkv.weight"), None);
        assert_eq!(one(Arch::Phi3, "rope_factors_long.weight"), None);
        assert_eq!(
            one(Arch::Mixtral, "blk.2.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.2.block_sparse_moe.gate.weight")
        );
        assert_eq!(
            one(Arch::Qwen3Moe, "blk.2.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.2.mlp.gate.weight")
        );
        assert_eq!(
            Arch::Mixtral.target("blk.3.ffn_down_exps.weight"),
            Some(Target::Experts {
                layer: 3,
                part: ExpertPart::Down
            })
        );
        assert_eq!(Arch::Llama.target("blk.3.ffn_down_exps.weight"), None);
        assert_eq!(
            Arch::Mixtral.expert_name(1, ExpertPart::Up, 5),
            "model.layers.1.block_sparse_moe.experts.5.w3.weight"
        );
        assert_eq!(
            Arch::Qwen3Moe.expert_name(0, ExpertPart::Down, 2),
            "model.layers.0.mlp.experts.2.down_proj.weight"
        );
    }

    #[test]
    fn llama_with_experts_is_mixtral() {
        assert_eq!(Arch::from_gguf("llama", Some(8)).ok(), Some(Arch::Mixtral));
        assert_eq!(Arch::from_gguf("llama", Some(0)).ok(), Some(Arch::Llama));
        assert_eq!(Arch::from_gguf("llama", None).ok(), Some(Arch::Llama));
        assert!(Arch::from_gguf("gpt2", None).is_err());
        assert!(Arch::Mixtral.permutes_qk() && !Arch::Phi3.permutes_qk());
    }
}
