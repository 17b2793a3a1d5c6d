//! The int8 KV cache: quantising rows as they are written, attention that reads the int8 rows
//! directly, and block export/import with the scales.
//!
//! Each token row of each kv head is `head_dim` signed bytes `q` and one f32 scale
//! `s = max |x| / 127`, read back as `q * s`. Scales sit beside the elements in a layer-wide
//! array of `num_slots * num_kv_heads` f32, indexed `slot * num_kv_heads + kv_head` (that is,
//! per block, per kv head, per token row). A row's bytes depend on that row alone, so a block
//! filled over many steps, on two nodes, or after a migration holds exactly the bytes one
//! colocated engine writes; a single scale per (block, kv head) would have to grow as later
//! rows arrive and requantise the earlier ones, which differs with how the block was filled.
//!
//! Attention widens each row to f32 in the kernels' staging step ([`crate::kv_rows`]), so the
//! int8 path is the same tiled, ISA-dispatched kernel as the float dtypes.

use crate::attention::AttentionArgs;
use crate::capped::run_checked;
use crate::copy::check_reshape;
use crate::kv_rows::KvRows;
use crate::layout::check_len;
use crate::pool;
use crate::tile::SharedOut;
use crate::{AttnOptions, CacheShape, KernelError, KvElem, SeqAttn};

/// Rows from which the quantising cache write spreads over the kernel threads.
const PARALLEL_SLOTS: usize = 16;

/// One layer's int8 K (or V): `layer_elems` bytes and `num_slots * num_kv_heads` scales.
#[derive(Clone, Copy, Debug)]
pub struct Int8Kv<'a> {
    pub data: &'a [i8],
    pub scales: &'a [f32],
}

impl<'a> Int8Kv<'a> {
    /// How the kernels read it.
    pub(crate) fn rows<T>(self, head_dim: usize) -> KvRows<'a, T> {
        KvRows::Int8 {
            data: self.data,
            scales: self.scales,
            head_dim,
        }
    }
}

/// [`Int8Kv`], writable.
#[derive(Debug)]
pub struct Int8KvMut<'a> {
    pub data: &'a mut [i8],
    pub scales: &'a mut [f32],
}

impl Int8KvMut<'_> {
    pub fn as_ref(&self) -> Int8Kv<'_> {
        Int8Kv {
            data: self.data,
            scales: self.scales,
        }
    }
}

/// Scales one layer's K (or V) holds: one per token slot and kv head.
fn scale_len(layout: &CacheShape) -> usize {
    layout.num_slots().saturating_mul(layout.num_kv_heads)
}

fn check_int8(layout: &CacheShape, what: &'static str, kv: Int8Kv<'_>) -> Result<(), KernelError> {
    layout.check_cache(what, kv.data.len())?;
    check_len("int8 cache scales", scale_len(layout), kv.scales.len())
}

/// Quantises one kv head's row: writes `round(x / s)` into `dst` and returns `s`, the row's
/// largest magnitude over 127 (0 for an all-zero row, whose bytes are then all 0).
/// Deterministic: the result depends on `src` alone.
#[inline]
pub fn quantize_row_int8(src: &[f32], dst: &mut [i8]) -> f32 {
    let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
    if amax == 0.0 {
        dst.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = (x * inv).round().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

/// Quantises one token's K (or V) row, every kv head, into slot `slot`.
fn write_row<T: KvElem>(
    layout: &CacheShape,
    src: &[T],
    data: &mut [i8],
    scales: &mut [f32],
    buf: &mut [f32],
) {
    let d = layout.head_dim;
    T::to_f32_slice(src, buf);
    for ((x, q), s) in buf
        .chunks_exact(d)
        .zip(data.chunks_exact_mut(d))
        .zip(scales.iter_mut())
    {
        *s = quantize_row_int8(x, q);
    }
}

/// [`crate::reshape_and_cache`] into an int8 cache: token `t`'s rows of `k` and `v`
/// (`[num_tokens, num_kv_heads, head_dim]`) are quantised into slot `slots[t]`, a scale per
/// kv head. When a slot repeats, the last token wins.
pub fn reshape_and_cache_int8<T: KvElem>(
    layout: &CacheShape,
    k_cache: Int8KvMut<'_>,
    v_cache: Int8KvMut<'_>,
    k: &[T],
    v: &[T],
    slots: &[u32],
) -> Result<(), KernelError> {
    check_reshape(
        layout,
        [k_cache.data.len(), v_cache.data.len()],
        [k.len(), v.len()],
        slots,
    )?;
    check_int8(layout, "k_cache", k_cache.as_ref())?;
    check_int8(layout, "v_cache", v_cache.as_ref())?;
    let (row, hkv) = (layout.row_elems(), layout.num_kv_heads);
    let tasks = if slots.len() < PARALLEL_SLOTS {
        1
    } else {
        pool::threads()
    };
    let (kd, ks) = (SharedOut::new(k_cache.data), SharedOut::new(k_cache.scales));
    let (vd, vs) = (SharedOut::new(v_cache.data), SharedOut::new(v_cache.scales));
    let body = |task: usize| {
        let mut buf = vec![0f32; row];
        for (t, &slot) in slots.iter().enumerate() {
            // A task takes the slots of one residue class, in token order, so a repeated slot
            // is always written by the same task and the last token still wins.
            if slot as usize % tasks != task {
                continue;
            }
            let (at, sat) = (slot as usize * row, slot as usize * hkv);
            let src = t * row..(t + 1) * row;
            // SAFETY: slots were checked to lie in the cache (data and scales), and only this
            // task writes slots of its residue class.
            unsafe {
                write_row(
                    layout,
                    &k[src.clone()],
                    kd.range_mut(at, row),
                    ks.range_mut(sat, hkv),
                    &mut buf,
                );
                write_row(
                    layout,
                    &v[src],
                    vd.range_mut(at, row),
                    vs.range_mut(sat, hkv),
                    &mut buf,
                );
            }
        }
    };
    if tasks == 1 {
        body(0);
    } else {
        pool::run(tasks, &body);
    }
    Ok(())
}

/// [`crate::paged_attention_with`] over an int8 cache: the same kernels, each K and V row
/// widened to f32 as it is staged. `q` and `out` keep the model's float type.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_int8<T: KvElem>(
    layout: &CacheShape,
    k_cache: Int8Kv<'_>,
    v_cache: Int8Kv<'_>,
    q: &[T],
    out: &mut [T],
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    opts: AttnOptions,
) -> Result<(), KernelError> {
    layout.validate()?;
    check_int8(layout, "k_cache", k_cache)?;
    check_int8(layout, "v_cache", v_cache)?;
    let args = AttentionArgs {
        layout,
        k_cache: k_cache.rows(layout.head_dim),
        v_cache: v_cache.rows(layout.head_dim),
        q,
        num_heads,
        seqs,
        scale: opts.scale,
    };
    run_checked(&args, opts, out)
}

/// Bytes [`gather_blocks_int8`] writes for `n` blocks: per K and V, the blocks' elements,
/// then their scales (native-endian f32), which is `kv_types::KvLayout::layer_payload_bytes`.
pub fn int8_payload_bytes(layout: &CacheShape, n: usize) -> usize {
    let block_scales = layout.block_size * layout.num_kv_heads;
    2 * n * (layout.block_elems() + 4 * block_scales)
}

/// Copies the named blocks of one layer into `dst` as `[K elements of every block, K scales of
/// every block, V elements, V scales]`, in `block_ids` order.
pub fn gather_blocks_int8(
    layout: &CacheShape,
    k_cache: Int8Kv<'_>,
    v_cache: Int8Kv<'_>,
    block_ids: &[u32],
    dst: &mut [u8],
) -> Result<(), KernelError> {
    check_transfer_int8(layout, [k_cache, v_cache], block_ids, "dst", dst.len())?;
    let (be, bs) = (
        layout.block_elems(),
        layout.block_size * layout.num_kv_heads,
    );
    let mut at = 0;
    for c in [k_cache, v_cache] {
        for &id in block_ids {
            let src = &c.data[id as usize * be..][..be];
            for (d, &x) in dst[at..at + be].iter_mut().zip(src) {
                *d = x as u8;
            }
            at += be;
        }
        for &id in block_ids {
            let src = &c.scales[id as usize * bs..][..bs];
            for (d, x) in dst[at..at + 4 * bs].chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&x.to_ne_bytes());
            }
            at += 4 * bs;
        }
    }
    Ok(())
}

/// The inverse of [`gather_blocks_int8`].
pub fn scatter_blocks_int8(
    layout: &CacheShape,
    k_cache: Int8KvMut<'_>,
    v_cache: Int8KvMut<'_>,
    block_ids: &[u32],
    src: &[u8],
) -> Result<(), KernelError> {
    check_transfer_int8(
        layout,
        [k_cache.as_ref(), v_cache.as_ref()],
        block_ids,
        "src",
        src.len(),
    )?;
    let (be, bs) = (
        layout.block_elems(),
        layout.block_size * layout.num_kv_heads,
    );
    let mut at = 0;
    for c in [k_cache, v_cache] {
        for &id in block_ids {
            let dst = &mut c.data[id as usize * be..][..be];
            for (d, &x) in dst.iter_mut().zip(&src[at..at + be]) {
                *d = x as i8;
            }
            at += be;
        }
        for &id in block_ids {
            let dst = &mut c.scales[id as usize * bs..][..bs];
            // The bytes come off the network unaligned for f32.
            for (d, b) in dst.iter_mut().zip(src[at..at + 4 * bs].chunks_exact(4)) {
                *d = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            at += 4 * bs;
        }
    }
    Ok(())
}

fn check_transfer_int8(
    layout: &CacheShape,
    caches: [Int8Kv<'_>; 2],
    block_ids: &[u32],
    what: &'static str,
    len: usize,
) -> Result<(), KernelError> {
    layout.validate()?;
    check_int8(layout, "k_cache", caches[0])?;
    check_int8(layout, "v_cache", caches[1])?;
    for &id in block_ids {
        layout.check_block(id)?;
    }
    check_len(what, int8_payload_bytes(layout, block_ids.len()), len)
}

#[cfg(test)]
#[path = "kv_int8_tests.rs"]
mod tests;
