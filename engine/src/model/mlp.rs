//! A layer's feed-forward, for both forward paths: one gated MLP, or a mixture of experts
//! ([`MoeBlock`]) in the layers [`MoeConfig`](crate::config::MoeConfig) makes sparse.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::linear::Linear;
use super::moe::MoeBlock;
use super::ops;
use crate::config::{Activation, ModelConfig};
use crate::error::Result;
use crate::quantize::Quantize;

#[derive(Debug, Clone)]
pub(super) enum Mlp {
    /// `down(act(gate) * up)`, gate and up fused into one projection.
    Dense {
        gate_up: Linear,
        down: Linear,
    },
    Experts(MoeBlock),
}

impl Mlp {
    /// Layer `index`'s feed-forward, under the layer's `vb`.
    pub(super) fn load(
        vb: &VarBuilder,
        cfg: &ModelConfig,
        quantize: Quantize,
        index: usize,
    ) -> Result<Self> {
        if let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_sparse(index)) {
            return Ok(Mlp::Experts(MoeBlock::load(vb, cfg, moe, quantize)?));
        }
        let (hid, f) = (cfg.hidden_size, cfg.intermediate_size);
        let mlp = vb.pp("mlp");
        let gate_up = if cfg.arch.fused_checkpoint {
            // Phi-3: already fused, in the engine's order.
            mlp.pp("gate_up_proj").get((2 * f, hid), "weight")?
        } else {
            Tensor::cat(
                &[
                    mlp.pp("gate_proj").get((f, hid), "weight")?,
                    mlp.pp("up_proj").get((f, hid), "weight")?,
                ],
                0,
            )?
        };
        Ok(Mlp::Dense {
            gate_up: Linear::quantized(gate_up, None, quantize)?,
            down: Linear::quantized(mlp.pp("down_proj").get((hid, f), "weight")?, None, quantize)?,
        })
    }

    /// Whether every weight is packed, so the host path can run it.
    pub(super) fn is_packed(&self) -> bool {
        match self {
            Mlp::Dense { gate_up, down } => gate_up.is_packed() && down.is_packed(),
            Mlp::Experts(moe) => moe.is_packed(),
        }
    }

    /// The tensor path: the feed-forward of every row of `h`.
    pub(super) fn forward(&self, h: &Tensor, act: Activation) -> Result<Tensor> {
        match self {
            Mlp::Dense { gate_up, down } => {
                down.forward(&ops::gate_mul(&gate_up.forward(h)?, act)?)
            }
            Mlp::Experts(moe) => moe.forward(h, act),
        }
    }
}
