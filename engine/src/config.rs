//! `config.json` as transformers writes it (`LlamaConfig`), resolved into the plain [`ModelConfig`]
//! the model code reads. Resolution is where every default and every unsupported case is decided.

use std::path::Path;

use serde::Deserialize;

use crate::error::{EngineError, Result};

mod arch;

pub use arch::{Activation, ArchSpec, Architecture, NormStyle};

/// The subset of a transformers config.json that the Llama family uses.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeScalingConfig>,
    /// transformers 5 moved `rope_theta` and the scaling type here.
    #[serde(default)]
    pub rope_parameters: Option<RopeScalingConfig>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
    /// Read only to refuse: Phi-3's partial rotary is not yet supported.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Read only to refuse: Gemma 2's soft-capping is not yet supported.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Read only to refuse: Gemma's soft-capping is not yet supported.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
}

fn default_max_pos() -> usize {
    4096
}

fn default_eps() -> f64 {
    1e-6
}

/// `rope_scaling` or transformers 5's `rope_parameters`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeScalingConfig {
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

/// How rotary frequencies are adjusted for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// Everything the model needs, with every default applied.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// What the architecture changes in the layer; both forward paths read it.
    pub arch: ArchSpec,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The longest context served: max_position_embeddings, or the sliding window when it is
    /// smaller, since full attention beyond the window would not match the reference.
    pub max_context: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in, if it says.
    pub checkpoint_dtype: Option<String>,
}

impl LlamaConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        read_json(path)
    }

    fn architecture(&self) -> Result<Architecture> {
        let name = self
            .architectures
            .first()
            .cloned()
            .or_else(|| self.model_type.clone())
            .unwrap_or_default();
        Architecture::from_name(&name)
    }

    /// Refuses what [`ArchSpec`] cannot yet describe, naming the field and its value, rather
    /// than serving a model that silently differs from its reference.
    fn refuse_unsupported(&self) -> Result<()> {
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(EngineError::InvalidConfig {
                    reason: format!("hidden_act {act:?} is not supported (only silu)"),
                });
            }
        }
        if let Some(f) = self.partial_rotary_factor.filter(|&f| f != 1.0) {
            return Err(EngineError::InvalidConfig {
                reason: format!("partial_rotary_factor {f} is not supported (only 1.0)"),
            });
        }
        for (field, v) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            if let Some(v) = v {
                return Err(EngineError::InvalidConfig {
                    reason: format!(
                        "{field} {v} is not supported (soft-capping is not yet implemented)"
                    ),
                });
            }
        }
        Ok(())
    }

    pub fn resolve(&self) -> Result<ModelConfig> {
        let architecture = self.architecture()?;
        self.refuse_unsupported()?;
        if self.num_attention_heads == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return Err(EngineError::InvalidConfig {
                reason: "num_attention_heads, hidden_size and num_hidden_layers must be > 0".into(),
            });
        }
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(EngineError::InvalidConfig {
                reason: format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, num_kv_heads
                ),
            });
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(EngineError::InvalidConfig {
                reason: format!("head_dim must be even and > 0, given {head_dim}"),
            });
        }
        let params = self.rope_parameters.clone().unwrap_or_default();
        let rope_theta = self
            .rope_theta
            .or(params.rope_theta)
            .or(self.rope_scaling.as_ref().and_then(|s| s.rope_theta))
            .unwrap_or(10_000.0);
        // transformers 5 puts the scaling type in rope_parameters; older configs in rope_scaling.
        let scaling_src = match &self.rope_scaling {
            Some(s) => s.clone(),
            None => params,
        };
        let rope_scaling = resolve_rope_scaling(&scaling_src, self.max_position_embeddings)?;
        // Qwen's configs carry a sliding_window that applies only when use_sliding_window says.
        let sliding = match (architecture, self.use_sliding_window) {
            (Architecture::Qwen2 | Architecture::Qwen3, Some(false) | None) => None,
            _ => self.sliding_window,
        };
        let max_context = match sliding {
            Some(w) if w > 0 && w < self.max_position_embeddings => w,
            _ => self.max_position_embeddings,
        };
        Ok(ModelConfig {
            arch: ArchSpec::resolve(architecture, self.attention_bias),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            max_context,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            bos_token_id: self.bos_token_id.as_ref().and_then(first_id),
            eos_token_ids: self.eos_token_id.as_ref().map(ids).unwrap_or_default(),
            checkpoint_dtype: self.dtype.clone().or_else(|| self.torch_dtype.clone()),
        })
    }
}

fn resolve_rope_scaling(s: &RopeScalingConfig, max_pos: usize) -> Result<RopeScaling> {
    match s.rope_type.as_deref() {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: s.factor.unwrap_or(1.0),
        }),
        Some("llama3") => Ok(RopeScaling::Llama3 {
            factor: s.factor.unwrap_or(8.0),
            low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
            high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
            original_max_position_embeddings: s.original_max_position_embeddings.unwrap_or(max_pos),
        }),
        Some(other) => Err(EngineError::UnsupportedRopeScaling {
            rope_type: other.to_string(),
        }),
    }
}

/// A token id field may be a number or a list (generation_config's eos_token_id often is).
pub(crate) fn ids(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn first_id(v: &serde_json::Value) -> Option<u32> {
    ids(v).first().copied()
}

/// A JSON file of the model's, parsed; errors name the file.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| EngineError::Json {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> LlamaConfig {
        serde_json::from_str(s).expect("valid test json")
    }

    const BASE: &str = r#""vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2"#;

    #[test]
    fn reads_transformers5_rope_parameters() {
        let c = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE},
            "rope_parameters": {{"rope_theta": 500000.0, "rope_type": "default"}}}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.rope_theta, 500000.0);
        assert_eq!(r.rope_scaling, RopeScaling::None);
        assert_eq!(r.head_dim, 8);
        assert_eq!(r.num_kv_heads, 2);
    }

    #[test]
    fn reads_llama3_scaling_and_head_dim_override() {
        let c = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "head_dim": 16, "rope_theta": 500000.0,
            "rope_scaling": {{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
            "eos_token_id": [128001, 128009]}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.head_dim, 16);
        assert_eq!(r.eos_token_ids, vec![128001, 128009]);
        assert!(matches!(r.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
    }

    #[test]
    fn qwen2_defaults_to_attention_bias() {
        let c = parse(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}, "sliding_window": 16, "use_sliding_window": false}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert!(r.arch.qkv_bias);
        assert!(!r.arch.qk_norm);
        assert_eq!(r.max_context, 4096);
    }

    #[test]
    fn qwen3_has_qk_norm_and_no_bias_and_its_own_head_dim() {
        let c = parse(&format!(
            r#"{{"architectures": ["Qwen3ForCausalLM"], {BASE}, "head_dim": 32,
            "sliding_window": null, "use_sliding_window": false}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.arch.architecture, Architecture::Qwen3);
        assert!(r.arch.qk_norm);
        assert!(!r.arch.qkv_bias);
        assert_eq!(r.head_dim, 32);
    }

    #[test]
    fn features_not_yet_described_are_refused_by_name() {
        for (extra, field) in [
            (
                r#""partial_rotary_factor": 0.75"#,
                "partial_rotary_factor 0.75",
            ),
            (
                r#""final_logit_softcapping": 30.0"#,
                "final_logit_softcapping 30",
            ),
            (
                r#""attn_logit_softcapping": 50.0"#,
                "attn_logit_softcapping 50",
            ),
            (r#""hidden_act": "gelu_pytorch_tanh""#, "gelu_pytorch_tanh"),
        ] {
            let c = parse(&format!(
                r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, {extra}}}"#
            ));
            let err = c.resolve().expect_err("refused").to_string();
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn mistral_sliding_window_caps_context() {
        let c = parse(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": 1024, "max_position_embeddings": 32768}}"#
        ));
        assert_eq!(c.resolve().expect("resolves").max_context, 1024);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let c = parse(&format!(
            r#"{{"architectures": ["GPT2LMHeadModel"], {BASE}}}"#
        ));
        let err = c.resolve().expect_err("gpt2 is not llama").to_string();
        assert!(err.contains("GPT2LMHeadModel"), "{err}");
        for name in Architecture::SUPPORTED {
            assert!(err.contains(name), "{err} does not list {name}");
        }
    }

    #[test]
    fn unsupported_rope_type_is_named() {
        let c = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"type": "yarn", "factor": 4.0}}}}"#
        ));
        let err = c.resolve().expect_err("yarn unsupported");
        assert!(err.to_string().contains("yarn"), "{err}");
    }
}
