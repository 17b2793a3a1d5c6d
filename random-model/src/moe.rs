//! Mixtures of experts (Mixtral, Qwen3-MoE): which layers are sparse, their config.json
//! fields, and their router and expert tensors under the names real checkpoints use
//! (Mixtral's `block_sparse_moe.experts.N.w1`, Qwen3-MoE's `mlp.experts.N.gate_proj`), which
//! transformers 5 also writes when it saves (it packs them into 3-D tensors only in memory).

use anyhow::ensure;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::Architecture;

/// A spec's experts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// Qwen3-MoE's `moe_intermediate_size`; Mixtral's experts are `ffn` wide.
    #[serde(default)]
    pub expert_ffn: Option<usize>,
    /// Qwen3-MoE: renormalise the top-k weights (Mixtral always does).
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Qwen3-MoE: layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0`...
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// ...and it is not listed here.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// Standard deviation of the router weights: wide enough that different tokens pick
    /// different experts.
    pub router_std: f32,
}

fn one() -> usize {
    1
}

impl MoeSpec {
    /// Whether layer `i` of an `arch` model runs the experts, as transformers decides.
    pub fn is_sparse(&self, arch: Architecture, i: usize) -> bool {
        match arch {
            Architecture::Qwen3Moe => {
                !self.mlp_only_layers.contains(&i)
                    && (i + 1).is_multiple_of(self.decoder_sparse_step)
            }
            _ => true,
        }
    }

    /// Each expert's intermediate size in a model whose dense MLP is `ffn` wide.
    pub fn expert_ffn(&self, ffn: usize) -> usize {
        self.expert_ffn.unwrap_or(ffn)
    }

    pub(crate) fn validate(&self, arch: Architecture) -> anyhow::Result<()> {
        ensure!(
            matches!(arch, Architecture::Mixtral | Architecture::Qwen3Moe),
            "moe is only written for Mixtral and Qwen3-MoE"
        );
        ensure!(
            self.experts > 0 && (1..=self.experts).contains(&self.top_k),
            "moe top_k {} must be within 1..={} experts",
            self.top_k,
            self.experts
        );
        ensure!(
            self.decoder_sparse_step > 0,
            "decoder_sparse_step must be > 0"
        );
        if arch == Architecture::Mixtral {
            ensure!(
                self.expert_ffn.is_none()
                    && self.norm_topk_prob
                    && self.decoder_sparse_step == 1
                    && self.mlp_only_layers.is_empty(),
                "Mixtral's experts are ffn wide, renormalised (norm_topk_prob true), in every \
                 layer"
            );
        }
        ensure!(
            self.router_std.is_finite() && self.router_std > 0.0,
            "router_std must be > 0"
        );
        Ok(())
    }

    /// config.json's fields for the experts.
    pub(crate) fn config(&self, arch: Architecture, ffn: usize, obj: &mut Map<String, Value>) {
        obj.insert("num_experts_per_tok".into(), json!(self.top_k));
        match arch {
            Architecture::Qwen3Moe => {
                obj.insert("num_experts".into(), json!(self.experts));
                obj.insert("moe_intermediate_size".into(), json!(self.expert_ffn(ffn)));
                obj.insert("norm_topk_prob".into(), json!(self.norm_topk_prob));
                obj.insert(
                    "decoder_sparse_step".into(),
                    json!(self.decoder_sparse_step),
                );
                obj.insert("mlp_only_layers".into(), json!(self.mlp_only_layers));
            }
            _ => {
                obj.insert("num_local_experts".into(), json!(self.experts));
                obj.insert("router_jitter_noise".into(), json!(0.0));
            }
        }
    }

    /// The names of layer prefix `p`'s router and of expert `e`'s gate, up and down weights.
    pub(crate) fn names(arch: Architecture, p: &str, e: usize) -> (String, [String; 3]) {
        match arch {
            Architecture::Mixtral => {
                let m = format!("{p}.block_sparse_moe");
                (
                    format!("{m}.gate.weight"),
                    ["w1", "w3", "w2"].map(|w| format!("{m}.experts.{e}.{w}.weight")),
                )
            }
            _ => (
                format!("{p}.mlp.gate.weight"),
                ["gate_proj", "up_proj", "down_proj"]
                    .map(|w| format!("{p}.mlp.experts.{e}.{w}.weight")),
            ),
        }
    }
}
