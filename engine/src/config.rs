//! `config.json` as transformers writes it (`LlamaConfig`), resolved into the plain [`ModelConfig`]
//! the model code reads. Resolution is where every default and every unsupported case is decided.

use std::path::Path;

use serde::Deserialize;

use crate::error::{EngineError, Result};

mod arch;
mod moe;

pub use arch::{Activation, ArchDefaults, ArchSpec, Architecture, NormStyle};
pub use moe::{MoeConfig, MoeFields, MoeLayout};

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
    /// transformers 5 moved `rope_theta` and the scaling type here (Gemma 3: one object per
    /// layer type).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
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
    /// Gemma's name for `hidden_act`.
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2/Qwen3 with `use_sliding_window`: layers from this one on slide.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// `"sliding_attention"` or `"full_attention"` per layer (transformers 5).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3's older spelling of `layer_types`: every n-th layer is global.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3's rope base of its sliding layers.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Gemma's attention scale is this to the power -0.5.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
    /// The fraction of each head that rope rotates (Phi-4-mini: 0.75); transformers 5 may
    /// keep it in `rope_parameters` instead.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Phi-3's pretraining context, outside `rope_scaling`; LongRoPE switches factors past it.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Absent: the architecture's default; `null`: none (Gemma 2 defaults to 50).
    #[serde(default, deserialize_with = "present")]
    pub attn_logit_softcapping: Option<Option<f64>>,
    /// Mixtral's and Qwen3-MoE's experts.
    #[serde(flatten)]
    pub moe: MoeFields,
    /// As `attn_logit_softcapping` (Gemma 2 defaults to 30).
    #[serde(default, deserialize_with = "present")]
    pub final_logit_softcapping: Option<Option<f64>>,
}

/// A field that is there, null or not: `Some(None)` for an explicit null, where a missing one
/// stays `None` (serde's default).
fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

/// `rope_parameters`: one object, or Gemma 3's one per layer type.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RopeParameters {
    PerLayerType {
        full_attention: RopeScalingConfig,
        #[serde(default)]
        sliding_attention: Option<RopeScalingConfig>,
    },
    Flat(RopeScalingConfig),
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
    /// LongRoPE: per-frequency divisors within and beyond the original context.
    #[serde(default)]
    pub short_factor: Option<Vec<f64>>,
    #[serde(default)]
    pub long_factor: Option<Vec<f64>>,
    /// LongRoPE's multiplier on cos and sin; derived from the context growth when absent.
    #[serde(default)]
    pub attention_factor: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
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
    /// Phi-3's LongRoPE: frequency `i` divided by `short_factor[i]` at positions within
    /// `original_max_position_embeddings`, by `long_factor[i]` beyond it, and cos and sin
    /// multiplied by `attention_factor` (see `model/rope.rs` for which positions take which).
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
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
    /// The leading dims of each head that rope rotates (rotate-half among them): head_dim, or
    /// head_dim × `partial_rotary_factor` (Phi-4-mini: 0.75).
    pub rotary_dim: usize,
    /// The longest context served: max_position_embeddings.
    pub max_context: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// The sliding layers' rope base when it is not `rope_theta` (Gemma 3); their rope is
    /// unscaled.
    pub local_rope_theta: Option<f64>,
    /// Multiplies q·k: 1/sqrt(head_dim), or `query_pre_attn_scalar`^-0.5 (Gemma).
    pub attn_scale: f32,
    /// Attention-logit soft-capping (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Final-logit soft-capping: `cap * tanh(logit / cap)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Each layer's sliding window (its queries see their last `w` keys), `None` for a full
    /// attention layer.
    pub layer_windows: Vec<Option<usize>>,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in, if it says.
    pub checkpoint_dtype: Option<String>,
    /// The mixture of experts, when the architecture has one and some layer is sparse.
    pub moe: Option<MoeConfig>,
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

    /// transformers' `int(head_dim * partial_rotary_factor)`, which must be even and within
    /// the head.
    fn rotary_dim(&self, head_dim: usize, params: &RopeScalingConfig) -> Result<usize> {
        let factor = self
            .partial_rotary_factor
            .or(params.partial_rotary_factor)
            .or(self
                .rope_scaling
                .as_ref()
                .and_then(|s| s.partial_rotary_factor))
            .unwrap_or(1.0);
        let dim = (head_dim as f64 * factor) as usize;
        if !(factor > 0.0 && factor <= 1.0) || dim == 0 || !dim.is_multiple_of(2) {
            return Err(EngineError::InvalidConfig {
                reason: format!(
                    "partial_rotary_factor {factor} gives {dim} rotary dims of head_dim \
                     {head_dim}; they must be even and > 0"
                ),
            });
        }
        Ok(dim)
    }

    /// Each layer's window: `layer_types` when config.json has them, else the architecture's
    /// pattern (Gemma), else every layer slides when there is a window (Mistral).
    fn layer_windows(
        &self,
        arch: Architecture,
        defaults: &ArchDefaults,
    ) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let window = match arch {
            // Qwen's configs carry a sliding_window that applies only when use_sliding_window
            // says, and then from max_window_layers on.
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                if self.use_sliding_window != Some(true) {
                    return Ok(vec![None; n]);
                }
                let from = self.max_window_layers.unwrap_or(28);
                let w = self.sliding_window.or(Some(4096));
                return Ok((0..n).map(|i| if i >= from { w } else { None }).collect());
            }
            _ => self.sliding_window.or(defaults.sliding_window),
        };
        let Some(window) = window.filter(|&w| w > 0) else {
            return Ok(vec![None; n]);
        };
        if let Some(types) = &self.layer_types {
            if types.len() != n {
                return Err(EngineError::InvalidConfig {
                    reason: format!("layer_types has {} entries for {n} layers", types.len()),
                });
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(Some(window)),
                    "full_attention" => Ok(None),
                    other => Err(EngineError::InvalidConfig {
                        reason: format!(
                            "layer type {other:?} is not supported (only sliding_attention and \
                             full_attention)"
                        ),
                    }),
                })
                .collect();
        }
        let pattern = self
            .sliding_window_pattern
            .or(defaults.sliding_window_pattern);
        Ok((0..n)
            .map(|i| match pattern {
                Some(p) if p > 0 && (i + 1) % p == 0 => None,
                _ => Some(window),
            })
            .collect())
    }

    pub fn resolve(&self) -> Result<ModelConfig> {
        let architecture = self.architecture()?;
        let defaults = architecture.defaults();
        let activation = self
            .hidden_activation
            .as_deref()
            .or(self.hidden_act.as_deref())
            .map(Activation::from_name)
            .transpose()?;
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
        let (params, local_params) = match self.rope_parameters.clone() {
            Some(RopeParameters::PerLayerType {
                full_attention,
                sliding_attention,
            }) => (full_attention, sliding_attention),
            Some(RopeParameters::Flat(p)) => (p, None),
            None => (RopeScalingConfig::default(), None),
        };
        let rope_theta = self
            .rope_theta
            .or(params.rope_theta)
            .or(self.rope_scaling.as_ref().and_then(|s| s.rope_theta))
            .unwrap_or(defaults.rope_theta);
        let local_rope_theta = defaults.local_rope_theta.map(|d| {
            self.rope_local_base_freq
                .or(local_params.as_ref().and_then(|p| p.rope_theta))
                .unwrap_or(d)
        });
        if let Some(t) = local_params.as_ref().and_then(|p| p.rope_type.as_deref()) {
            if t != "default" {
                return Err(EngineError::UnsupportedRopeScaling {
                    rope_type: format!("{t} (sliding layers)"),
                });
            }
        }
        let rotary_dim = self.rotary_dim(head_dim, &params)?;
        // transformers 5 puts the scaling type in rope_parameters; older configs in rope_scaling.
        let scaling_src = match &self.rope_scaling {
            Some(s) => s.clone(),
            None => params,
        };
        let rope_scaling = self.resolve_rope_scaling(architecture, &scaling_src, rotary_dim)?;
        let attn_scale = match self
            .query_pre_attn_scalar
            .or(defaults.query_pre_attn_scalar)
        {
            Some(s) if s > 0.0 => s.powf(-0.5) as f32,
            Some(s) => {
                return Err(EngineError::InvalidConfig {
                    reason: format!("query_pre_attn_scalar must be > 0, given {s}"),
                })
            }
            None => 1.0 / (head_dim as f32).sqrt(),
        };
        let cap = |field: &str, given: Option<Option<f64>>, default: Option<f64>| match given
            .unwrap_or(default)
        {
            Some(c) if !(c.is_finite() && c > 0.0) => Err(EngineError::InvalidConfig {
                reason: format!("{field} must be > 0, given {c}"),
            }),
            c => Ok(c.map(|c| c as f32)),
        };
        let attn_softcap = cap(
            "attn_logit_softcapping",
            self.attn_logit_softcapping,
            defaults.attn_logit_softcapping,
        )?;
        let final_softcap = cap(
            "final_logit_softcapping",
            self.final_logit_softcapping,
            defaults.final_logit_softcapping,
        )?;
        let layer_windows = self.layer_windows(architecture, &defaults)?;
        let arch = ArchSpec::resolve(architecture, self.attention_bias, activation);
        Ok(ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            max_context: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            local_rope_theta,
            attn_scale,
            attn_softcap,
            final_softcap,
            layer_windows,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            bos_token_id: self.bos_token_id.as_ref().and_then(first_id),
            eos_token_ids: self.eos_token_id.as_ref().map(ids).unwrap_or_default(),
            checkpoint_dtype: self.dtype.clone().or_else(|| self.torch_dtype.clone()),
            moe: self
                .moe
                .resolve(arch.moe, self.intermediate_size, self.num_hidden_layers)?,
        })
    }
}

impl LlamaConfig {
    fn resolve_rope_scaling(
        &self,
        arch: Architecture,
        s: &RopeScalingConfig,
        rotary_dim: usize,
    ) -> Result<RopeScaling> {
        let max_pos = self.max_position_embeddings;
        let longrope = match s.rope_type.as_deref() {
            Some("longrope" | "su") => true,
            // Phi3Config reads its older "yarn" as longrope.
            Some("yarn") => arch == Architecture::Phi3,
            _ => false,
        };
        if !longrope {
            return resolve_rope_scaling(s, max_pos);
        }
        // Phi3Config's own original_max_position_embeddings (4096 when config.json is
        // silent) wins over the rope object's, as transformers' standardize_rope_params says.
        let original = match arch {
            Architecture::Phi3 => Some(self.original_max_position_embeddings.unwrap_or(4096)),
            _ => self
                .original_max_position_embeddings
                .or(s.original_max_position_embeddings),
        }
        .unwrap_or(max_pos);
        let factors = |name: &str, f: &Option<Vec<f64>>| match f {
            Some(f) if f.len() == rotary_dim / 2 => Ok(f.clone()),
            other => Err(EngineError::InvalidConfig {
                reason: format!(
                    "longrope {name} must hold {} numbers (rotary_dim / 2), given {:?}",
                    rotary_dim / 2,
                    other.as_ref().map(Vec::len)
                ),
            }),
        };
        if original == 0 {
            return Err(EngineError::InvalidConfig {
                reason: "original_max_position_embeddings must be > 0".into(),
            });
        }
        // transformers' _compute_longrope_parameters.
        let factor = s.factor.unwrap_or(max_pos as f64 / original as f64);
        let attention_factor = s.attention_factor.unwrap_or(if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt()
        });
        Ok(RopeScaling::LongRope {
            short_factor: factors("short_factor", &s.short_factor)?,
            long_factor: factors("long_factor", &s.long_factor)?,
            original_max_position_embeddings: original,
            attention_factor,
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
                r#""partial_rotary_factor": 0.1"#,
                "partial_rotary_factor 0.1",
            ),
            (r#""hidden_act": "gelu""#, "\"gelu\""),
            (
                r#""layer_types": ["full_attention", "chunked_attention"], "sliding_window": 8"#,
                "chunked_attention",
            ),
        ] {
            let c = parse(&format!(
                r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, {extra}}}"#
            ));
            let err = c.resolve().expect_err("refused").to_string();
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn phi3_reads_partial_rotary_and_longrope() {
        // Phi-4-mini's shape: original context outside rope_scaling, "type" spelling.
        let c = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "head_dim": 16,
            "partial_rotary_factor": 0.75, "max_position_embeddings": 256,
            "original_max_position_embeddings": 16, "tie_word_embeddings": true,
            "sliding_window": 262144,
            "rope_scaling": {{"type": "longrope", "short_factor": [1, 1, 1, 1, 1, 2],
              "long_factor": [1, 2, 3, 4, 5, 6]}}}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert!(r.arch.fused_checkpoint && !r.arch.qkv_bias);
        assert_eq!((r.head_dim, r.rotary_dim), (16, 12));
        assert!(r.tie_word_embeddings);
        assert_eq!(r.layer_windows, vec![Some(262144); 2]);
        let RopeScaling::LongRope {
            long_factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } = r.rope_scaling
        else {
            panic!("longrope: {:?}", r.rope_scaling);
        };
        assert_eq!(
            (long_factor[5], original_max_position_embeddings),
            (6.0, 16)
        );
        // factor 256 / 16 = 16: sqrt(1 + ln 16 / ln 16).
        assert!((attention_factor - 2f64.sqrt()).abs() < 1e-12);
        // Factor lists must cover rotary_dim / 2 frequencies.
        let c = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE},
            "rope_scaling": {{"type": "longrope", "short_factor": [1], "long_factor": [1]}}}}"#
        ));
        let err = c.resolve().expect_err("short lists").to_string();
        assert!(err.contains("short_factor must hold 4"), "{err}");
    }

    #[test]
    fn mistral_sliding_window_applies_to_every_layer_and_not_the_context() {
        let c = parse(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": 1024, "max_position_embeddings": 32768}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.max_context, 32768);
        assert_eq!(r.layer_windows, vec![Some(1024); 2]);
    }

    /// BASE with `n` layers.
    fn layers(n: usize) -> String {
        BASE.replace(
            r#""num_hidden_layers": 2"#,
            &format!(r#""num_hidden_layers": {n}"#),
        )
    }

    #[test]
    fn gemma2_defaults_alternate_windows_and_cap() {
        let c = parse(&format!(
            r#"{{"architectures": ["Gemma2ForCausalLM"], {}, "head_dim": 16,
            "hidden_activation": "gelu_pytorch_tanh"}}"#,
            layers(4)
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.arch.norm, NormStyle::OnePlusWeight);
        assert_eq!(r.arch.activation, Activation::GeluTanh);
        assert!(r.arch.sandwich_norms && r.arch.embed_scale && !r.arch.qk_norm);
        assert_eq!(r.layer_windows, vec![Some(4096), None, Some(4096), None]);
        assert_eq!((r.attn_softcap, r.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(r.attn_scale, 1.0 / 16.0);
        assert_eq!((r.rope_theta, r.local_rope_theta), (10_000.0, None));
        // An explicit null turns a default cap off.
        let c = parse(&format!(
            r#"{{"architectures": ["Gemma2ForCausalLM"], {BASE}, "attn_logit_softcapping": null,
            "final_logit_softcapping": 15.0, "query_pre_attn_scalar": 64}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!((r.attn_softcap, r.final_softcap), (None, Some(15.0)));
        assert_eq!(r.attn_scale, 0.125);
    }

    #[test]
    fn gemma3_reads_its_pattern_layer_types_and_local_rope() {
        let c = parse(&format!(
            r#"{{"architectures": ["Gemma3ForCausalLM"], {}, "sliding_window": 512,
            "rope_theta": 1000000.0, "rope_local_base_freq": 20000.0}}"#,
            layers(7)
        ));
        let r = c.resolve().expect("resolves");
        assert!(r.arch.qk_norm);
        let mut want = vec![Some(512); 7];
        want[5] = None;
        assert_eq!(r.layer_windows, want);
        assert_eq!((r.rope_theta, r.local_rope_theta), (1e6, Some(20_000.0)));
        assert_eq!((r.attn_softcap, r.final_softcap), (None, None));
        // transformers 5: layer_types and rope_parameters per layer type.
        let c = parse(&format!(
            r#"{{"architectures": ["Gemma3ForCausalLM"], {BASE}, "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"],
            "rope_parameters": {{"full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
              "sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}}}}}}"#
        ));
        let r = c.resolve().expect("resolves");
        assert_eq!(r.layer_windows, vec![None, Some(8)]);
        assert_eq!(r.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((r.rope_theta, r.local_rope_theta), (1e6, Some(10_000.0)));
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
