//! The CUDA side of [`super`]'s ops: each splits the layer cache into its K and V halves as
//! device views and launches `kernels::cuda` on the stream candle uses for that device, so
//! the launches order with candle's own kernels without any synchronisation.
//!
//! Not yet run on a GPU: `deploy/gpu-check.sh` is the check (its kernel tests run the same
//! `kernels::cuda` functions against their CPU references).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, DType, Layout, Shape};
use kernels::cuda::{AttentionKernel, CudaKernels, CudaKvElem};
use kernels::SeqAttn;

use super::{GatherBlocks, PagedAttention, ReshapeAndCache, ScatterBlocks, SeqRows};

/// The kernels loaded into each candle device's stream, once per process.
pub(crate) fn kernels_for(stream: &Arc<CudaStream>) -> candle_core::Result<CudaKernels> {
    static LOADED: OnceLock<Mutex<HashMap<usize, CudaKernels>>> = OnceLock::new();
    let key = Arc::as_ptr(stream) as usize;
    let mut map = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(k) = map.get(&key) {
        return Ok(k.clone());
    }
    let k = CudaKernels::new(stream.clone()).map_err(err)?;
    map.insert(key, k.clone());
    Ok(k)
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA kernel: {e}"))
}

fn offsets(l: &Layout) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("device op on a non-contiguous tensor".into()))
}

macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: no {other:?} KV cache on a device", $op),
        }
    };
}

pub(super) fn reshape_and_cache(
    op: &ReshapeAndCache,
    kv: &mut CudaStorage,
    kv_l: &Layout,
    k: &CudaStorage,
    k_l: &Layout,
    v: &CudaStorage,
    v_l: &Layout,
) -> candle_core::Result<()> {
    fn typed<T: CudaKvElem + CudaDType>(
        op: &ReshapeAndCache,
        kv: &mut CudaStorage,
        kv_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let kernels = kernels_for(&kv.device.cuda_stream())?;
        let ((ka, kb), (va, vb), (a, b)) = (offsets(k_l)?, offsets(v_l)?, offsets(kv_l)?);
        let k = k.as_cuda_slice::<T>()?.slice(ka..kb);
        let v = v.as_cuda_slice::<T>()?.slice(va..vb);
        let cache: &mut CudaSlice<T> = kv.as_cuda_slice_mut::<T>()?;
        let mut cache = cache.slice_mut(a..b);
        let (mut kc, mut vc) = cache.split_at_mut((b - a) / 2);
        kernels
            .reshape_and_cache(&op.layout, &mut kc, &mut vc, &k, &v, &op.slots)
            .map_err(err)
    }
    by_dtype!(kv.dtype(), "reshape-and-cache", |T| typed::<T>(
        op, kv, kv_l, k, k_l, v, v_l
    ))
}

pub(super) fn paged_attention(
    op: &PagedAttention,
    q: &CudaStorage,
    q_l: &Layout,
    kv: &CudaStorage,
    kv_l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    fn typed<T: CudaKvElem + CudaDType>(
        op: &PagedAttention,
        q: &CudaStorage,
        q_l: &Layout,
        kv: &CudaStorage,
        kv_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let stream = kv.device.cuda_stream();
        let kernels = kernels_for(&stream)?;
        let ((qa, qb), (a, b)) = (offsets(q_l)?, offsets(kv_l)?);
        let q_view = q.as_cuda_slice::<T>()?.slice(qa..qb);
        let cache = kv.as_cuda_slice::<T>()?;
        let half = (b - a) / 2;
        let (k, v) = (cache.slice(a..a + half), cache.slice(a + half..b));
        let mut out = stream.alloc_zeros::<T>(qb - qa).map_err(err)?;
        let seqs: Vec<SeqAttn<'_>> = op.seqs.iter().map(SeqRows::attn).collect();
        kernels
            .paged_attention_with(
                &op.layout,
                &k,
                &v,
                &q_view,
                &mut out,
                op.num_heads,
                &seqs,
                op.opts,
                AttentionKernel::Auto,
            )
            .map_err(err)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, kv.device.clone()),
            q_l.shape().clone(),
        ))
    }
    by_dtype!(q.dtype(), "paged-attention", |T| typed::<T>(
        op, q, q_l, kv, kv_l
    ))
}

pub(super) fn gather_blocks(
    op: &GatherBlocks,
    kv: &CudaStorage,
    kv_l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    fn typed<T: CudaKvElem + CudaDType>(
        op: &GatherBlocks,
        kv: &CudaStorage,
        kv_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let stream = kv.device.cuda_stream();
        let kernels = kernels_for(&stream)?;
        let (a, b) = offsets(kv_l)?;
        let cache = kv.as_cuda_slice::<T>()?;
        let half = (b - a) / 2;
        let (k, v) = (cache.slice(a..a + half), cache.slice(a + half..b));
        let n = 2 * op.block_ids.len() * op.layout.block_elems();
        let mut out = stream.alloc_zeros::<T>(n).map_err(err)?;
        kernels
            .gather_blocks(&op.layout, &k, &v, &op.block_ids, &mut out)
            .map_err(err)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, kv.device.clone()),
            n.into(),
        ))
    }
    by_dtype!(kv.dtype(), "gather-blocks", |T| typed::<T>(op, kv, kv_l))
}

pub(super) fn scatter_blocks(
    op: &ScatterBlocks,
    kv: &mut CudaStorage,
    kv_l: &Layout,
    src: &CudaStorage,
    src_l: &Layout,
) -> candle_core::Result<()> {
    fn typed<T: CudaKvElem + CudaDType>(
        op: &ScatterBlocks,
        kv: &mut CudaStorage,
        kv_l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let kernels = kernels_for(&kv.device.cuda_stream())?;
        let ((sa, sb), (a, b)) = (offsets(src_l)?, offsets(kv_l)?);
        let src = src.as_cuda_slice::<T>()?.slice(sa..sb);
        let cache: &mut CudaSlice<T> = kv.as_cuda_slice_mut::<T>()?;
        let mut cache = cache.slice_mut(a..b);
        let (mut kc, mut vc) = cache.split_at_mut((b - a) / 2);
        kernels
            .scatter_blocks(&op.layout, &mut kc, &mut vc, &op.block_ids, &src)
            .map_err(err)
    }
    by_dtype!(kv.dtype(), "scatter-blocks", |T| typed::<T>(
        op, kv, kv_l, src, src_l
    ))
}
