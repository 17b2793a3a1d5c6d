//! The tensor path's attention over a layer cache that lives on the model's device: rope as
//! tensor ops, then the paged-KV device ops (`device_ops`). Every step is a candle op, so the
//! same code runs on the CPU (what CI checks) and on a GPU.
//!
//! Rope is computed in f32 from the step's host tables and rounded once to the cache dtype,
//! each product and sum in the order [`RopeTables::apply`] takes, so Q, K and V come out
//! bit for bit as the host-slice route (`ops::rope_split`) makes them, and so does the cache.

use candle_core::{DType, Device, Tensor};

use super::batch::ForwardBatch;
use super::device_ops::{self, SeqRows};
use super::ops::LayerAttn;
use super::rope::RopeTables;
use crate::error::Result;

/// One step's rope tables on the device, `[T, 1, half_dim]` f32 each.
pub(super) struct DeviceRope {
    cos: Tensor,
    sin: Tensor,
    half_dim: usize,
}

impl DeviceRope {
    pub(super) fn new(tables: &RopeTables, device: &Device) -> Result<Self> {
        let h = tables.half_dim;
        let t = tables.cos.len() / h.max(1);
        Ok(DeviceRope {
            cos: Tensor::from_slice(&tables.cos, (t, 1, h), device)?,
            sin: Tensor::from_slice(&tables.sin, (t, 1, h), device)?,
            half_dim: h,
        })
    }

    /// `x` (`[T, heads * d]`, f32) rotated: rotate-half over the first `2 * half_dim` dims of
    /// each head, the rest passed through.
    fn apply(&self, x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
        let (t, h) = (x.dim(0)?, self.half_dim);
        let x = x.reshape((t, heads, d))?;
        let (x1, x2) = (x.narrow(2, 0, h)?, x.narrow(2, h, h)?);
        let a = (x1.broadcast_mul(&self.cos)? - x2.broadcast_mul(&self.sin)?)?;
        let b = (x2.broadcast_mul(&self.cos)? + x1.broadcast_mul(&self.sin)?)?;
        let mut parts = vec![a, b];
        if 2 * h < d {
            parts.push(x.narrow(2, 2 * h, d - 2 * h)?);
        }
        Ok(Tensor::cat(&parts, 2)?.reshape((t, heads * d))?)
    }
}

/// The step's sequences as the device ops take them, for one KV group's view of the batch.
pub(super) fn seq_rows(batch: &ForwardBatch) -> Vec<SeqRows> {
    batch
        .seqs
        .iter()
        .map(|s| SeqRows {
            q_start: s.q_start,
            q_len: s.q_len,
            context_len: s.context_len,
            block_table: s.block_table.clone(),
        })
        .collect()
}

/// Splits fused `qkv` rows (`[T, (H + 2 * Hkv) * D]`), ropes Q and K, writes K and V into
/// `kv` (a `device_ops` layer cache) at the step's slots and attends over it. Returns
/// `[T, H * D]` in `qkv`'s dtype.
pub(super) fn attention(
    qkv: &Tensor,
    at: &LayerAttn<'_>,
    rope: &DeviceRope,
    seqs: &[SeqRows],
    kv: &Tensor,
) -> Result<Tensor> {
    let (h, hkv, d) = (at.dims.num_heads, at.dims.num_kv_heads, at.dims.head_dim);
    let cache = kv.dtype();
    // Q and K rotate together: one set of ops over their H + Hkv heads.
    let qk = qkv.narrow(1, 0, (h + hkv) * d)?.to_dtype(DType::F32)?;
    let qk = rope.apply(&qk, h + hkv, d)?.to_dtype(cache)?;
    let q = qk.narrow(1, 0, h * d)?;
    let k = qk.narrow(1, h * d, hkv * d)?;
    let v = qkv.narrow(1, (h + hkv) * d, hkv * d)?.to_dtype(cache)?;
    device_ops::reshape_and_cache(kv, &k, &v, at.layout, &at.batch.slots)?;
    let out = device_ops::paged_attention(&q, kv, at.layout, h, seqs, at.opts)?;
    Ok(out.to_dtype(qkv.dtype())?)
}
