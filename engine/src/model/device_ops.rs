//! The paged-KV operations of the tensor path as candle ops, so the same call runs on whatever
//! device the tensors live on: the CPU side calls this crate's kernels (`kernels::*`), the
//! CUDA side (feature `cuda`) calls `kernels::cuda`. The host fast path does not use these.
//!
//! A layer's cache on a device is one contiguous tensor `[2, layer_elems]`, K then V, each half
//! laid out `[num_blocks, block_size, num_kv_heads, head_dim]` as [`CacheShape`] says. One
//! tensor rather than two because candle's in-place ops write a single destination, and the
//! kernels write K and V in one launch; each side splits it into its two halves.
//!
//! - [`reshape_and_cache`]: writes a step's new K/V rows into their slots;
//! - [`paged_attention`]: the step's queries against the cache;
//! - [`gather_blocks`] / [`scatter_blocks`]: blocks to and from a staging tensor laid out as
//!   the KV push sends them (`kernels::gather_blocks`: K of every block, then V), which is what
//!   a prefill node copies to host memory per layer and a decode node copies back.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, InplaceOp2, InplaceOp3, Layout, Shape, Tensor,
};
use kernels::{AttnOptions, CacheShape, KvElem, SeqAttn};

use crate::error::{EngineError, Result};

/// A sequence's view of the batch, owned so an op can hold it (`kernels::SeqAttn` borrows).
#[derive(Debug, Clone)]
pub struct SeqRows {
    pub q_start: usize,
    pub q_len: usize,
    pub context_len: usize,
    pub block_table: Vec<u32>,
}

impl SeqRows {
    fn attn(&self) -> SeqAttn<'_> {
        SeqAttn {
            q_start: self.q_start,
            q_len: self.q_len,
            context_len: self.context_len,
            block_table: &self.block_table,
        }
    }
}

/// A zeroed layer cache `[2, layer_elems]` on `device`.
pub fn layer_cache(
    layout: &CacheShape,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    Ok(Tensor::zeros((2, layout.layer_elems()), dtype, device)?)
}

/// Writes token `t`'s K and V rows (`k`, `v`: `[T, Hkv * D]`) into slot `slots[t]` of `kv`.
pub fn reshape_and_cache(
    kv: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &CacheShape,
    slots: &[u32],
) -> Result<()> {
    check_cache(kv, layout)?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    kv.inplace_op3(
        &k,
        &v,
        &ReshapeAndCache {
            layout: *layout,
            slots: slots.to_vec(),
        },
    )?;
    Ok(())
}

/// Attention of `q` (`[T, H * D]`) over `kv` for `seqs`; returns `[T, H * D]` in `q`'s dtype.
pub fn paged_attention(
    q: &Tensor,
    kv: &Tensor,
    layout: &CacheShape,
    num_heads: usize,
    seqs: &[SeqRows],
    opts: AttnOptions,
) -> Result<Tensor> {
    check_cache(kv, layout)?;
    let op = PagedAttention {
        layout: *layout,
        num_heads,
        seqs: seqs.to_vec(),
        opts,
    };
    Ok(q.contiguous()?.apply_op2_no_bwd(kv, &op)?)
}

/// Blocks `block_ids` of `kv` as one staging tensor on `kv`'s device,
/// `[2 * block_ids.len() * block_elems]` (K of every block, then V).
pub fn gather_blocks(kv: &Tensor, layout: &CacheShape, block_ids: &[u32]) -> Result<Tensor> {
    check_cache(kv, layout)?;
    let op = GatherBlocks {
        layout: *layout,
        block_ids: block_ids.to_vec(),
    };
    Ok(kv.apply_op1_no_bwd(&op)?)
}

/// Writes `staging` (as [`gather_blocks`] lays it out) into blocks `block_ids` of `kv`.
pub fn scatter_blocks(
    kv: &Tensor,
    staging: &Tensor,
    layout: &CacheShape,
    block_ids: &[u32],
) -> Result<()> {
    check_cache(kv, layout)?;
    let staging = staging.to_device(kv.device())?.contiguous()?;
    kv.inplace_op2(
        &staging,
        &ScatterBlocks {
            layout: *layout,
            block_ids: block_ids.to_vec(),
        },
    )?;
    Ok(())
}

fn check_cache(kv: &Tensor, layout: &CacheShape) -> Result<()> {
    if kv.dims() != [2, layout.layer_elems()] || !kv.is_contiguous() {
        return Err(EngineError::InvalidConfig {
            reason: format!(
                "a device layer cache is a contiguous [2, {}] tensor, given {:?}",
                layout.layer_elems(),
                kv.shape()
            ),
        });
    }
    Ok(())
}

/// The contiguous elements of `layout`'s range in `s`.
fn cpu_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("device op on a non-contiguous tensor".into()))?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The K and V halves of a CPU layer cache.
fn cpu_kv_mut<'a, T: KvElem>(
    s: &'a mut CpuStorage,
    l: &Layout,
    get: fn(&mut CpuStorage) -> Option<&mut Vec<T>>,
) -> candle_core::Result<(&'a mut [T], &'a mut [T])> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("device op on a non-contiguous cache".into()))?;
    let v = get(s).ok_or_else(|| candle_core::Error::Msg("cache dtype mismatch".into()))?;
    Ok(v[a..b].split_at_mut((b - a) / 2))
}

fn f32_vec(s: &mut CpuStorage) -> Option<&mut Vec<f32>> {
    match s {
        CpuStorage::F32(v) => Some(v),
        _ => None,
    }
}

fn bf16_vec(s: &mut CpuStorage) -> Option<&mut Vec<half::bf16>> {
    match s {
        CpuStorage::BF16(v) => Some(v),
        _ => None,
    }
}

fn f16_vec(s: &mut CpuStorage) -> Option<&mut Vec<half::f16>> {
    match s {
        CpuStorage::F16(v) => Some(v),
        _ => None,
    }
}

fn kernel_err(e: kernels::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(format!("kernel: {e}"))
}

/// Calls `$body` with `$t` bound to the Rust type of a float storage's dtype.
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$t:ident, $vec:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                let $vec = f32_vec;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                let $vec = bf16_vec;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                let $vec = f16_vec;
                $body
            }
            other => candle_core::bail!("{}: no {other:?} KV cache on a device", $op),
        }
    };
}

struct ReshapeAndCache {
    layout: CacheShape,
    slots: Vec<u32>,
}

impl InplaceOp3 for ReshapeAndCache {
    fn name(&self) -> &'static str {
        "reshape-and-cache"
    }

    fn cpu_fwd(
        &self,
        kv: &mut CpuStorage,
        kv_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        by_dtype!(kv.dtype(), self.name(), |T, vec| {
            let (k, v) = (cpu_slice::<T>(k, k_l)?, cpu_slice::<T>(v, v_l)?);
            let (kc, vc) = cpu_kv_mut::<T>(kv, kv_l, vec)?;
            kernels::reshape_and_cache(&self.layout, kc, vc, k, v, &self.slots).map_err(kernel_err)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &mut candle_core::CudaStorage,
        kv_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        cuda::reshape_and_cache(self, kv, kv_l, k, k_l, v, v_l)
    }
}

struct PagedAttention {
    layout: CacheShape,
    num_heads: usize,
    seqs: Vec<SeqRows>,
    opts: AttnOptions,
}

impl CustomOp2 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        kv: &CpuStorage,
        kv_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let seqs: Vec<SeqAttn<'_>> = self.seqs.iter().map(SeqRows::attn).collect();
        by_dtype!(q.dtype(), self.name(), |T, _vec| {
            let q = cpu_slice::<T>(q, q_l)?;
            let kv = cpu_slice::<T>(kv, kv_l)?;
            let (k, v) = kv.split_at(kv.len() / 2);
            let mut out = vec![T::default(); q.len()];
            kernels::paged_attention_with(
                &self.layout,
                k,
                v,
                q,
                &mut out,
                self.num_heads,
                &seqs,
                self.opts,
            )
            .map_err(kernel_err)?;
            Ok((
                candle_core::WithDType::to_cpu_storage_owned(out),
                q_l.shape().clone(),
            ))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        kv: &candle_core::CudaStorage,
        kv_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::paged_attention(self, q, q_l, kv, kv_l)
    }
}

struct GatherBlocks {
    layout: CacheShape,
    block_ids: Vec<u32>,
}

impl CustomOp1 for GatherBlocks {
    fn name(&self) -> &'static str {
        "gather-blocks"
    }

    fn cpu_fwd(&self, kv: &CpuStorage, kv_l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = 2 * self.block_ids.len() * self.layout.block_elems();
        by_dtype!(kv.dtype(), self.name(), |T, _vec| {
            let kv = cpu_slice::<T>(kv, kv_l)?;
            let (k, v) = kv.split_at(kv.len() / 2);
            let mut out = vec![T::default(); n];
            kernels::gather_blocks(&self.layout, k, v, &self.block_ids, &mut out)
                .map_err(kernel_err)?;
            Ok((candle_core::WithDType::to_cpu_storage_owned(out), n.into()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &candle_core::CudaStorage,
        kv_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::gather_blocks(self, kv, kv_l)
    }
}

struct ScatterBlocks {
    layout: CacheShape,
    block_ids: Vec<u32>,
}

impl InplaceOp2 for ScatterBlocks {
    fn name(&self) -> &'static str {
        "scatter-blocks"
    }

    fn cpu_fwd(
        &self,
        kv: &mut CpuStorage,
        kv_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        by_dtype!(kv.dtype(), self.name(), |T, vec| {
            let src = cpu_slice::<T>(src, src_l)?;
            let (kc, vc) = cpu_kv_mut::<T>(kv, kv_l, vec)?;
            kernels::scatter_blocks(&self.layout, kc, vc, &self.block_ids, src).map_err(kernel_err)
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &mut candle_core::CudaStorage,
        kv_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        cuda::scatter_blocks(self, kv, kv_l, src, src_l)
    }
}

#[cfg(feature = "cuda")]
#[path = "device_ops_cuda.rs"]
mod cuda;
/// The kernels of a candle CUDA stream (the push's copy stream shares them).
#[cfg(feature = "cuda")]
pub(crate) use cuda::kernels_for;

#[cfg(test)]
#[path = "device_ops_tests.rs"]
mod tests;
