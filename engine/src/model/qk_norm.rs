//! The per-head RMSNorm on q and k that [`ArchSpec::qk_norm`](crate::config::ArchSpec) asks
//! for (Qwen3, and Gemma 3 with its `1 + w` norms): one head_dim-wide weight for all query
//! heads and one for all KV heads, applied after the fused projection and before rope. Both
//! forward paths call it on the fused `[T, (H + 2 * Hkv) * D]` rows; v is left alone.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::norm::RmsNorm;
use super::ops::{self, AttnDims};
use crate::config::ModelConfig;
use crate::error::Result;

/// Token rows from which the host path spreads the norms over the kernel threads.
const PARALLEL_ROWS: usize = 16;

#[derive(Debug, Clone)]
pub(super) struct QkNorm {
    q: RmsNorm,
    k: RmsNorm,
}

impl QkNorm {
    /// `self_attn.q_norm` and `self_attn.k_norm` when the architecture has them, else `None`.
    pub(super) fn load(att: &VarBuilder, cfg: &ModelConfig) -> Result<Option<Self>> {
        if !cfg.arch.qk_norm {
            return Ok(None);
        }
        Ok(Some(QkNorm {
            q: RmsNorm::load(att.pp("q_norm"), cfg.head_dim, cfg)?,
            k: RmsNorm::load(att.pp("k_norm"), cfg.head_dim, cfg)?,
        }))
    }

    /// The tensor path: `qkv` with each q and k head normalised.
    pub(super) fn forward(&self, qkv: &Tensor, dims: AttnDims) -> Result<Tensor> {
        let AttnDims {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        } = dims;
        let t = qkv.dim(0)?;
        // candle's rms_norm runs over the last dimension: one head per row.
        let per_head = |start: usize, heads: usize, norm: &RmsNorm| -> Result<Tensor> {
            let x = qkv.narrow(1, start, heads * d)?.reshape((t * heads, d))?;
            Ok(norm.forward(&x)?.reshape((t, heads * d))?)
        };
        let q = per_head(0, h, &self.q)?;
        let k = per_head(h * d, hkv, &self.k)?;
        let v = qkv.narrow(1, (h + hkv) * d, hkv * d)?;
        Ok(Tensor::cat(&[q, k, v], 1)?)
    }

    /// The host path: the `t` rows of `qkv`, in place.
    pub(super) fn forward_host(&self, qkv: &mut [f32], t: usize, dims: AttnDims) {
        let AttnDims {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
        } = dims;
        let width = (h + 2 * hkv) * d;
        let body = |_row: usize, r: &mut [f32]| {
            let mut head_in = vec![0f32; d];
            for (head, x) in r[..(h + hkv) * d].chunks_mut(d).enumerate() {
                let norm = if head < h { &self.q } else { &self.k };
                head_in.copy_from_slice(x);
                kernels::rms_norm(&head_in, &norm.host, norm.eps, x);
            }
        };
        ops::for_rows(&mut qkv[..t * width], t, width, PARALLEL_ROWS, &body);
    }
}
