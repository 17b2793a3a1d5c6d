//! Moving rows and blocks in and out of one layer's paged KV storage.
//!
//! These are plain memory copies: they never convert dtypes, so every round trip is bit-exact.
//! Each function validates every argument before writing anything, so an error leaves the
//! cache untouched.

use rayon::prelude::*;

use crate::layout::check_len;
use crate::{KernelError, KvElem, KvLayout};

/// Below this many elements a gather or scatter stays on the calling thread: the copy is over
/// before rayon would have handed out the work.
const PARALLEL_COPY_MIN_ELEMS: usize = 1 << 18;

/// reshape-and-cache: writes token rows into cache slots.
///
/// `k` and `v` are `[num_tokens, num_kv_heads, head_dim]` and `slots.len() == num_tokens`;
/// token `t` lands in slot `slots[t]`. When a slot repeats, the last token wins.
pub fn reshape_and_cache<T: KvElem>(
    layout: &KvLayout,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k: &[T],
    v: &[T],
    slots: &[u32],
) -> Result<(), KernelError> {
    layout.validate()?;
    layout.check_cache("k_cache", k_cache.len())?;
    layout.check_cache("v_cache", v_cache.len())?;
    let row = layout.row_elems();
    check_len("k", slots.len() * row, k.len())?;
    check_len("v", slots.len() * row, v.len())?;
    let num_slots = layout.num_slots();
    if let Some(&slot) = slots.iter().find(|&&s| s as usize >= num_slots) {
        return Err(KernelError::SlotOutOfRange { slot, num_slots });
    }

    for ((&slot, k_row), v_row) in slots.iter().zip(k.chunks_exact(row)).zip(v.chunks_exact(row)) {
        let at = slot as usize * row;
        k_cache[at..at + row].copy_from_slice(k_row);
        v_cache[at..at + row].copy_from_slice(v_row);
    }
    Ok(())
}

/// Gathers blocks of one layer into `dst`, laid out as `[K block_ids[0], ..., K block_ids[n-1],
/// V block_ids[0], ..., V block_ids[n-1]]`, each `layout.block_elems()` long.
///
/// This is the wire layout of KV transfer: a receiver that knows the layout and the block
/// count can split it without any header.
pub fn gather_blocks<T: KvElem>(
    layout: &KvLayout,
    k_cache: &[T],
    v_cache: &[T],
    block_ids: &[u32],
    dst: &mut [T],
) -> Result<(), KernelError> {
    check_transfer(layout, k_cache.len(), v_cache.len(), block_ids, "dst", dst.len())?;
    let block = layout.block_elems();
    if block == 0 || block_ids.is_empty() {
        return Ok(());
    }
    // Chunk i of dst is K block i for i < n and V block i - n after that.
    let n = block_ids.len();
    let copy = |(i, out): (usize, &mut [T])| {
        let (id, cache) = if i < n {
            (block_ids[i], k_cache)
        } else {
            (block_ids[i - n], v_cache)
        };
        let at = id as usize * block;
        out.copy_from_slice(&cache[at..at + block]);
    };
    if dst.len() >= PARALLEL_COPY_MIN_ELEMS {
        dst.par_chunks_mut(block).enumerate().for_each(copy);
    } else {
        dst.chunks_mut(block).enumerate().for_each(copy);
    }
    Ok(())
}

/// Scatters `src` (laid out as [`gather_blocks`] writes it) back into the named blocks.
///
/// When a block id repeats, the last copy wins.
pub fn scatter_blocks<T: KvElem>(
    layout: &KvLayout,
    k_cache: &mut [T],
    v_cache: &mut [T],
    block_ids: &[u32],
    src: &[T],
) -> Result<(), KernelError> {
    check_transfer(layout, k_cache.len(), v_cache.len(), block_ids, "src", src.len())?;
    let block = layout.block_elems();
    if block == 0 || block_ids.is_empty() {
        return Ok(());
    }
    let (k_src, v_src) = src.split_at(block_ids.len() * block);
    for (cache, half) in [(k_cache, k_src), (v_cache, v_src)] {
        for (&id, from) in block_ids.iter().zip(half.chunks_exact(block)) {
            let at = id as usize * block;
            cache[at..at + block].copy_from_slice(from);
        }
    }
    Ok(())
}

/// Copies whole blocks inside the cache (copy-on-write), K and V, for each `(src, dst)` pair
/// in order, so a later pair sees the effect of an earlier one.
pub fn copy_blocks<T: KvElem>(
    layout: &KvLayout,
    k_cache: &mut [T],
    v_cache: &mut [T],
    pairs: &[(u32, u32)],
) -> Result<(), KernelError> {
    layout.validate()?;
    layout.check_cache("k_cache", k_cache.len())?;
    layout.check_cache("v_cache", v_cache.len())?;
    for &(src, dst) in pairs {
        layout.check_block(src)?;
        layout.check_block(dst)?;
    }
    let block = layout.block_elems();
    for &(src, dst) in pairs {
        let (from, to) = (src as usize * block, dst as usize * block);
        k_cache.copy_within(from..from + block, to);
        v_cache.copy_within(from..from + block, to);
    }
    Ok(())
}

/// Shared validation of gather and scatter: layout, cache sizes, block ids, buffer size.
fn check_transfer(
    layout: &KvLayout,
    k_len: usize,
    v_len: usize,
    block_ids: &[u32],
    what: &'static str,
    buf_len: usize,
) -> Result<(), KernelError> {
    layout.validate()?;
    layout.check_cache("k_cache", k_len)?;
    layout.check_cache("v_cache", v_len)?;
    for &id in block_ids {
        layout.check_block(id)?;
    }
    check_len(what, 2 * block_ids.len() * layout.block_elems(), buf_len)
}
