//! Paged attention on the GPU: the decode kernels (v1 and split-K v2) and the flash-style
//! prefill kernel, behind one call with the contract of [`crate::paged_attention`].

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{dtype_name, CudaKernels, CudaKvElem, PREFILL_QPW};
use crate::attention::validate_attention;
use crate::gpu_plan::{attention_smem_bytes, head_dim_bucket, plan_attention, WARPS};
use crate::{AttnOptions, CacheShape, KernelError, SeqAttn};

/// Keys per split-K part when [`AttentionKernel::Auto`] splits.
const AUTO_PARTITION_KEYS: usize = 512;

/// Which kernel runs an attention call. Every kernel computes the same result for any batch
/// (ragged prefill, decode, mixed); they differ only in how the work is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// Prefill when any sequence has more than one query row; for decode, split-K when the
    /// batch has too few blocks to fill the GPU and the longest context is long, else v1.
    #[default]
    Auto,
    /// `paged_attention_v1`: one block per tile over the whole context.
    Decode,
    /// `paged_attention_v2` and its reduce: the context is cut into parts of
    /// `partition_keys` keys (a positive multiple of 32).
    DecodeSplitK { partition_keys: usize },
    /// `flash_prefill`: 32 query vectors per block, so each staged K/V tile is reused 32 times.
    Prefill,
}

/// The kernels' only argument; mirrors `fission::AttnParams` in cuda/attention_tile.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnParams {
    k_cache: u64,
    v_cache: u64,
    q: u64,
    out: u64,
    tiles: u64,
    block_tables: u64,
    partial_out: u64,
    partial_ml: u64,
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    block_size: i32,
    group: i32,
    heads_per_tile: i32,
    partition_keys: i32,
    num_partitions: i32,
    scale_log2: f32,
    cap: i32,
    /// A sliding layer's window (keys `pos + 1 - window..=pos`); 0 for none.
    window: i32,
    /// Attention-logit soft-cap (Gemma 2); 0 for none.
    softcap: f32,
}

// SAFETY: a #[repr(C)] struct of integers and floats with the same field order and types as
// the C++ struct the kernels take by value.
unsafe impl DeviceRepr for AttnParams {}

/// Query vectors per warp of the decode kernel: a whole GQA group per block where it fits.
fn decode_qpw(group: usize) -> usize {
    match group {
        0..=4 => 1,
        5..=8 => 2,
        _ => 4,
    }
}

impl CudaKernels {
    /// Paged attention for a ragged batch, with the contract of [`crate::paged_attention`]:
    /// `q`/`out` are `[num_tokens, num_heads, head_dim]` and `k_cache`/`v_cache` one layer's
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`, all on this kernels' device.
    /// Everything is checked on the host first; the launch is asynchronous on [`Self::stream`].
    /// Supports `head_dim <= 256`.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &impl DevicePtr<T>,
        v_cache: &impl DevicePtr<T>,
        q: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        num_heads: usize,
        seqs: &[SeqAttn<'_>],
        scale: f32,
        kernel: AttentionKernel,
    ) -> Result<(), KernelError> {
        let opts = AttnOptions {
            scale,
            window: None,
            softcap: None,
        };
        self.paged_attention_with(
            layout, k_cache, v_cache, q, out, num_heads, seqs, opts, kernel,
        )
    }

    /// [`Self::paged_attention`] with a sliding window and soft-capping as `opts` says, the
    /// contract of [`crate::paged_attention_with`]. Every kernel takes both (0 for none): a
    /// row skips the staged key tiles wholly before its window, so a window costs no reads.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_with<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &impl DevicePtr<T>,
        v_cache: &impl DevicePtr<T>,
        q: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        num_heads: usize,
        seqs: &[SeqAttn<'_>],
        opts: AttnOptions,
        kernel: AttentionKernel,
    ) -> Result<(), KernelError> {
        let AttnOptions {
            scale,
            window,
            softcap,
        } = opts;
        let window = match window {
            None => 0,
            Some(w) if w > 0 && w <= i32::MAX as usize => w as i32,
            Some(w) => return Err(KernelError::Invalid(format!("sliding window {w}"))),
        };
        let softcap = match softcap {
            None => 0.0,
            Some(c) if c.is_finite() && c > 0.0 => c,
            Some(c) => return Err(KernelError::Invalid(format!("soft-cap {c}"))),
        };
        let lens = [k_cache.len(), v_cache.len(), q.len(), out.len()];
        validate_attention(layout, lens, num_heads, seqs, scale)?;
        let bucket = head_dim_bucket(layout.head_dim)?;
        let group = num_heads / layout.num_kv_heads;
        let kernel = match kernel {
            AttentionKernel::Auto => self.auto_kernel(layout, group, seqs),
            chosen => chosen,
        };
        let dt = dtype_name(T::DTYPE);
        let (name, qpw, split) = match kernel {
            AttentionKernel::Prefill => {
                (format!("flash_prefill_{dt}_hd{bucket}"), PREFILL_QPW, None)
            }
            AttentionKernel::DecodeSplitK { partition_keys } => {
                let qpw = decode_qpw(group);
                let name = format!("paged_attention_v2_{dt}_hd{bucket}_q{qpw}");
                (name, qpw, Some(partition_keys))
            }
            AttentionKernel::Decode | AttentionKernel::Auto => {
                let qpw = decode_qpw(group);
                let name = format!("paged_attention_v1_{dt}_hd{bucket}_q{qpw}");
                (name, qpw, None)
            }
        };
        let plan = plan_attention(layout, num_heads, seqs, WARPS * qpw, split)?;
        if plan.num_tiles == 0 {
            return Ok(());
        }
        let too_big = |what: &str, n: usize, max: usize| {
            KernelError::Invalid(format!("{what} {n} exceeds the CUDA grid limit {max}"))
        };
        if plan.num_tiles > i32::MAX as usize {
            return Err(too_big("tiles", plan.num_tiles, i32::MAX as usize));
        }
        if layout.num_kv_heads > 65535 || plan.num_partitions > 65535 {
            return Err(too_big(
                "kv heads or split-K parts",
                layout.num_kv_heads.max(plan.num_partitions),
                65535,
            ));
        }

        let stream = &self.stream;
        let tiles = stream.clone_htod(&plan.tiles)?;
        let tables = stream.clone_htod(&plan.block_tables)?;
        let partial_vectors = plan.num_tiles * layout.num_kv_heads * plan.num_partitions * plan.cap;
        let (partial_out, partial_ml) = match split {
            Some(_) => (
                Some(stream.alloc_zeros::<f32>(partial_vectors * layout.head_dim)?),
                Some(stream.alloc_zeros::<f32>(partial_vectors * 2)?),
            ),
            None => (None, None),
        };
        let (k_ptr, _k_guard) = k_cache.device_ptr(stream);
        let (v_ptr, _v_guard) = v_cache.device_ptr(stream);
        let (q_ptr, _q_guard) = q.device_ptr(stream);
        let (out_ptr, _out_guard) = out.device_ptr_mut(stream);
        let (tiles_ptr, _tiles_guard) = tiles.device_ptr(stream);
        let (tables_ptr, _tables_guard) = tables.device_ptr(stream);
        let po = partial_out.as_ref().map(|p| p.device_ptr(stream));
        let pm = partial_ml.as_ref().map(|p| p.device_ptr(stream));
        let params = AttnParams {
            k_cache: k_ptr,
            v_cache: v_ptr,
            q: q_ptr,
            out: out_ptr,
            tiles: tiles_ptr,
            block_tables: tables_ptr,
            partial_out: po.as_ref().map_or(0, |p| p.0),
            partial_ml: pm.as_ref().map_or(0, |p| p.0),
            num_heads: num_heads as i32,
            num_kv_heads: layout.num_kv_heads as i32,
            head_dim: layout.head_dim as i32,
            block_size: layout.block_size as i32,
            group: group as i32,
            heads_per_tile: plan.heads_per_tile as i32,
            partition_keys: plan.partition_keys as i32,
            num_partitions: plan.num_partitions as i32,
            scale_log2: scale * std::f32::consts::LOG2_E,
            cap: plan.cap as i32,
            window,
            softcap,
        };
        let threads = (WARPS * 32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (
                plan.num_tiles as u32,
                layout.num_kv_heads as u32,
                plan.num_partitions as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: attention_smem_bytes(plan.cap, layout.head_dim) as u32,
        };
        let f = self.function(&name)?;
        // SAFETY: the arguments were validated against the layout above, the plan only
        // references rows, heads and blocks that validation admitted, and `params` matches the
        // kernel's parameter struct; the buffers outlive the launch in stream order (the
        // scratch buffers are freed asynchronously on this same stream).
        unsafe { stream.launch_builder(f).arg(&params).launch(cfg)? };
        if split.is_some() {
            let reduce = self.function(&format!("paged_attention_reduce_{dt}"))?;
            let cfg = LaunchConfig {
                grid_dim: (plan.num_tiles as u32, layout.num_kv_heads as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; the reduce reads only the parts the first launch wrote.
            unsafe { stream.launch_builder(reduce).arg(&params).launch(cfg)? };
        }
        Ok(())
    }

    fn auto_kernel(
        &self,
        layout: &CacheShape,
        group: usize,
        seqs: &[SeqAttn<'_>],
    ) -> AttentionKernel {
        if seqs.iter().any(|s| s.q_len > 1) {
            return AttentionKernel::Prefill;
        }
        let cap = WARPS * decode_qpw(group);
        let head_chunks = group.div_ceil(group.min(cap));
        let live = seqs.iter().filter(|s| s.q_len > 0);
        let blocks = live.clone().count() * layout.num_kv_heads * head_chunks;
        let longest = live.map(|s| s.context_len).max().unwrap_or(0);
        if longest >= 2 * AUTO_PARTITION_KEYS && blocks < 2 * self.num_sms {
            AttentionKernel::DecodeSplitK {
                partition_keys: AUTO_PARTITION_KEYS,
            }
        } else {
            AttentionKernel::Decode
        }
    }
}
