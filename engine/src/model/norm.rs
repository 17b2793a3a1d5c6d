//! RMSNorm as the architecture's [`NormStyle`] describes it, for both forward paths: the
//! tensor path calls [`RmsNorm::forward`], the host path reads `host` and `eps`.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use crate::config::{ModelConfig, NormStyle};
use crate::error::Result;

#[derive(Debug, Clone)]
pub(super) struct RmsNorm {
    pub(super) weight: Tensor,
    /// The weight in f32, for the host path whatever the checkpoint's dtype.
    pub(super) host: Vec<f32>,
    pub(super) eps: f32,
}

impl RmsNorm {
    /// `size` weights under `vb`, applied as the architecture's [`NormStyle`] says.
    pub(super) fn load(vb: VarBuilder, size: usize, cfg: &ModelConfig) -> Result<Self> {
        let raw = vb.get(size, "weight")?;
        // The scale in f32, as transformers computes Gemma's `1 + w`; the tensor path rounds it
        // to the load dtype.
        let scale = match cfg.arch.norm {
            NormStyle::Weight => raw.to_dtype(DType::F32)?,
            NormStyle::OnePlusWeight => (raw.to_dtype(DType::F32)? + 1.0)?,
        };
        Ok(RmsNorm {
            host: scale.to_vec1::<f32>()?,
            weight: scale.to_dtype(raw.dtype())?,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, &self.weight, self.eps)?)
    }
}
