//! A mixture of experts' settings: what config.json says (Mixtral's `num_local_experts`,
//! Qwen3-MoE's `num_experts`, `num_experts_per_tok`, `norm_topk_prob`,
//! `moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`), resolved with the
//! defaults of transformers' config classes into the [`MoeConfig`] the model reads.

use serde::Deserialize;

use crate::error::{EngineError, Result};

/// Where a checkpoint keeps a layer's router and experts; the routing rule that goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeLayout {
    /// `block_sparse_moe.gate` and `block_sparse_moe.experts.N.{w1,w3,w2}` (gate, up, down);
    /// the top-k weights are always renormalised.
    Mixtral,
    /// `mlp.gate` and `mlp.experts.N.{gate,up,down}_proj`; renormalised only with
    /// `norm_topk_prob`.
    Qwen,
}

/// config.json's MoE fields, flattened into [`LlamaConfig`](crate::config::LlamaConfig).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MoeFields {
    /// Mixtral's expert count.
    #[serde(default)]
    pub num_local_experts: Option<usize>,
    /// Qwen3-MoE's expert count.
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// Each expert's intermediate size (Qwen3-MoE; Mixtral's is `intermediate_size`).
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE: layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0`...
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// ...and it is not listed here.
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
}

/// A model's experts, every default applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    pub layout: MoeLayout,
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// The top-k softmax weights are divided by their sum.
    pub norm_topk_prob: bool,
    /// Each expert's intermediate size.
    pub expert_ffn: usize,
    /// Which layers run the experts; the others run one dense MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
}

impl MoeConfig {
    /// Whether layer `i` runs the experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.sparse_layers.get(i).copied().unwrap_or(false)
    }
}

impl MoeFields {
    /// The experts of a `layout` model of `num_layers` layers, with the defaults of
    /// transformers' `MixtralConfig` and `Qwen3MoeConfig`; `None` when the model has no
    /// sparse layer.
    pub(crate) fn resolve(
        &self,
        layout: Option<MoeLayout>,
        intermediate_size: usize,
        num_layers: usize,
    ) -> Result<Option<MoeConfig>> {
        let Some(layout) = layout else {
            return Ok(None);
        };
        let invalid = |reason: String| Err(EngineError::InvalidConfig { reason });
        let cfg = match layout {
            MoeLayout::Mixtral => MoeConfig {
                layout,
                num_experts: self.num_local_experts.unwrap_or(8),
                top_k: self.num_experts_per_tok.unwrap_or(2),
                norm_topk_prob: true,
                expert_ffn: intermediate_size,
                sparse_layers: vec![true; num_layers],
            },
            MoeLayout::Qwen => {
                let step = self.decoder_sparse_step.unwrap_or(1);
                if step == 0 {
                    return invalid("decoder_sparse_step must be > 0".into());
                }
                let dense = self.mlp_only_layers.clone().unwrap_or_default();
                let experts = self.num_experts.unwrap_or(128);
                MoeConfig {
                    layout,
                    num_experts: experts,
                    top_k: self.num_experts_per_tok.unwrap_or(8),
                    norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
                    expert_ffn: self.moe_intermediate_size.unwrap_or(768),
                    sparse_layers: (0..num_layers)
                        .map(|i| experts > 0 && !dense.contains(&i) && (i + 1).is_multiple_of(step))
                        .collect(),
                }
            }
        };
        if !cfg.sparse_layers.contains(&true) {
            return Ok(None);
        }
        if cfg.top_k == 0 || cfg.top_k > cfg.num_experts || cfg.expert_ffn == 0 {
            return invalid(format!(
                "num_experts_per_tok {} must be within 1..={} experts, and the experts' \
                 intermediate size {} > 0",
                cfg.top_k, cfg.num_experts, cfg.expert_ffn
            ));
        }
        Ok(Some(cfg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> MoeFields {
        serde_json::from_str(json).expect("valid test json")
    }

    #[test]
    fn mixtral_defaults_to_eight_experts_top_two_renormalised_everywhere() {
        let c = fields("{}")
            .resolve(Some(MoeLayout::Mixtral), 96, 3)
            .expect("resolves")
            .expect("sparse");
        assert_eq!((c.num_experts, c.top_k, c.expert_ffn), (8, 2, 96));
        assert!(c.norm_topk_prob);
        assert_eq!(c.sparse_layers, vec![true; 3]);
    }

    #[test]
    fn qwen3_moe_reads_its_sparse_step_dense_layers_and_norm() {
        let c = fields(
            r#"{"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}"#,
        )
        .resolve(Some(MoeLayout::Qwen), 96, 6)
        .expect("resolves")
        .expect("sparse");
        assert_eq!((c.num_experts, c.top_k, c.expert_ffn), (6, 3, 32));
        assert!(!c.norm_topk_prob);
        assert_eq!(
            c.sparse_layers,
            vec![false, true, false, false, false, true]
        );
        let err = fields(r#"{"num_experts": 2, "num_experts_per_tok": 3}"#)
            .resolve(Some(MoeLayout::Qwen), 96, 1)
            .expect_err("top-3 of 2");
        assert!(err.to_string().contains("num_experts_per_tok 3"), "{err}");
        assert_eq!(fields("{}").resolve(None, 96, 2).expect("dense"), None);
    }
}
