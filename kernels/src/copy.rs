//! Moving rows and blocks in and out of one layer's paged KV storage.
//!
//! These are plain memory copies: they never convert dtypes, so every round trip is bit-exact.
//! Each function validates every argument before writing anything, so an error leaves the
//! cache untouched.

use crate::layout::check_len;
use crate::pool;
use crate::tile::SharedOut;
use crate::{CacheShape, KernelError, KvElem};

/// Rows from which reshape-and-cache spreads its copies over the kernel threads.
const PARALLEL_SLOTS: usize = 16;

/// The argument checks of reshape-and-cache, shared by the CPU kernel and the CUDA one:
/// `cache_lens` are K's and V's storage lengths, `row_lens` the lengths of the K and V rows
/// given for `slots`.
pub(crate) fn check_reshape(
    layout: &CacheShape,
    cache_lens: [usize; 2],
    row_lens: [usize; 2],
    slots: &[u32],
) -> Result<(), KernelError> {
    layout.validate()?;
    layout.check_cache("k_cache", cache_lens[0])?;
    layout.check_cache("v_cache", cache_lens[1])?;
    let rows = slots.len().saturating_mul(layout.row_elems());
    check_len("k", rows, row_lens[0])?;
    check_len("v", rows, row_lens[1])?;
    let num_slots = layout.num_slots();
    if let Some(&slot) = slots.iter().find(|&&s| s as usize >= num_slots) {
        return Err(KernelError::SlotOutOfRange { slot, num_slots });
    }
    Ok(())
}

/// reshape-and-cache: writes token rows into cache slots.
///
/// `k` and `v` are `[num_tokens, num_kv_heads, head_dim]` and `slots.len() == num_tokens`;
/// token `t` lands in slot `slots[t]`. When a slot repeats, the last token wins.
pub fn reshape_and_cache<T: KvElem>(
    layout: &CacheShape,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k: &[T],
    v: &[T],
    slots: &[u32],
) -> Result<(), KernelError> {
    check_reshape(
        layout,
        [k_cache.len(), v_cache.len()],
        [k.len(), v.len()],
        slots,
    )?;
    let row = layout.row_elems();
    if slots.len() < PARALLEL_SLOTS {
        for ((&slot, k_row), v_row) in slots
            .iter()
            .zip(k.chunks_exact(row))
            .zip(v.chunks_exact(row))
        {
            let at = slot as usize * row;
            k_cache[at..at + row].copy_from_slice(k_row);
            v_cache[at..at + row].copy_from_slice(v_row);
        }
        return Ok(());
    }
    // Each row lands on lines of its own that are rarely cached, so one thread spends the copy
    // waiting on memory; several threads wait in parallel. A task takes the slots of one
    // residue class, in token order, so a repeated slot is always written by the same task
    // and the last token still wins.
    let tasks = pool::threads();
    let (kc, vc) = (SharedOut::new(k_cache), SharedOut::new(v_cache));
    pool::run(tasks, &|task| {
        for (t, &slot) in slots.iter().enumerate() {
            if slot as usize % tasks != task {
                continue;
            }
            let at = slot as usize * row;
            // SAFETY: slots were checked to lie in the cache, and only this task writes slots
            // of its residue class.
            unsafe {
                kc.range_mut(at, row)
                    .copy_from_slice(&k[t * row..(t + 1) * row]);
                vc.range_mut(at, row)
                    .copy_from_slice(&v[t * row..(t + 1) * row]);
            }
        }
    });
    Ok(())
}

/// Gathers blocks of one layer into `dst`, laid out as `[K block_ids[0], ..., K block_ids[n-1],
/// V block_ids[0], ..., V block_ids[n-1]]`, each `layout.block_elems()` long.
///
/// This is the wire layout of KV transfer: a receiver that knows the layout and the block
/// count can split it without any header.
pub fn gather_blocks<T: KvElem>(
    layout: &CacheShape,
    k_cache: &[T],
    v_cache: &[T],
    block_ids: &[u32],
    dst: &mut [T],
) -> Result<(), KernelError> {
    check_transfer(
        layout,
        k_cache.len(),
        v_cache.len(),
        block_ids,
        "dst",
        dst.len(),
    )?;
    let block = layout.block_elems();
    if block_ids.is_empty() {
        return Ok(());
    }
    // Sequential on purpose: a gather is a memcpy of whole blocks, and splitting it across
    // rayon threads measured no faster on two cores (the copy is bandwidth-bound).
    let (k_dst, v_dst) = dst.split_at_mut(block_ids.len() * block);
    for (cache, half) in [(k_cache, k_dst), (v_cache, v_dst)] {
        for (&id, to) in block_ids.iter().zip(half.chunks_exact_mut(block)) {
            let at = id as usize * block;
            to.copy_from_slice(&cache[at..at + block]);
        }
    }
    Ok(())
}

/// Scatters `src` (laid out as [`gather_blocks`] writes it) back into the named blocks.
///
/// When a block id repeats, the last copy wins.
pub fn scatter_blocks<T: KvElem>(
    layout: &CacheShape,
    k_cache: &mut [T],
    v_cache: &mut [T],
    block_ids: &[u32],
    src: &[T],
) -> Result<(), KernelError> {
    check_transfer(
        layout,
        k_cache.len(),
        v_cache.len(),
        block_ids,
        "src",
        src.len(),
    )?;
    let block = layout.block_elems();
    if block_ids.is_empty() {
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
    layout: &CacheShape,
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
pub(crate) fn check_transfer(
    layout: &CacheShape,
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
    let expected = block_ids.len().saturating_mul(layout.block_elems());
    check_len(what, expected.saturating_mul(2), buf_len)
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use proptest::prelude::*;

    use super::*;

    fn layout() -> CacheShape {
        CacheShape {
            num_blocks: 6,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 3,
        }
    }

    /// A cache whose every element is distinct, so any misplaced copy shows.
    fn numbered<T: KvElem>(layout: &CacheShape, base: f32) -> Vec<T> {
        (0..layout.layer_elems())
            .map(|i| T::from_f32(base + i as f32))
            .collect()
    }

    #[test]
    fn reshape_and_cache_writes_rows_at_slots() {
        let l = layout();
        let mut kc = vec![0.0f32; l.layer_elems()];
        let mut vc = vec![0.0f32; l.layer_elems()];
        let row = l.row_elems();
        let k: Vec<f32> = (0..2 * row).map(|i| i as f32 + 1.0).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        reshape_and_cache(&l, &mut kc, &mut vc, &k, &v, &[9, 2]).expect("valid");
        assert_eq!(&kc[9 * row..10 * row], &k[..row]);
        assert_eq!(&kc[2 * row..3 * row], &k[row..]);
        assert_eq!(&vc[9 * row..10 * row], &v[..row]);
        assert_eq!(kc.iter().filter(|&&x| x != 0.0).count(), 2 * row);
    }

    proptest! {
        #[test]
        fn reshape_and_cache_lets_the_last_token_of_a_slot_win(
            slots in prop::collection::vec(0u32..24, 0..40),
        ) {
            // Past PARALLEL_SLOTS rows the copies run on several threads; repeats included.
            let l = layout();
            let row = l.row_elems();
            let k: Vec<f32> = (0..slots.len() * row).map(|i| i as f32 + 1.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            let (mut kc, mut vc) = (numbered::<f32>(&l, 0.0), numbered::<f32>(&l, 0.5));
            let (mut want_k, mut want_v) = (kc.clone(), vc.clone());
            for (t, &slot) in slots.iter().enumerate() {
                let at = slot as usize * row;
                want_k[at..at + row].copy_from_slice(&k[t * row..(t + 1) * row]);
                want_v[at..at + row].copy_from_slice(&v[t * row..(t + 1) * row]);
            }
            reshape_and_cache(&l, &mut kc, &mut vc, &k, &v, &slots).expect("valid");
            prop_assert_eq!(kc, want_k);
            prop_assert_eq!(vc, want_v);
        }

        #[test]
        fn cache_gather_scatter_round_trip_is_bit_exact(
            slots in prop::collection::vec(0u32..24, 0..24),
            ids in prop::collection::vec(0u32..6, 0..6),
        ) {
            let l = layout();
            let row = l.row_elems();
            let mut kc: Vec<bf16> = numbered(&l, 0.0);
            let mut vc: Vec<bf16> = numbered(&l, 0.5);
            let k: Vec<bf16> = (0..slots.len() * row).map(|i| bf16::from_f32(-(i as f32))).collect();
            let v: Vec<bf16> = k.iter().map(|x| bf16::from_f32(x.to_f32() - 0.25)).collect();
            reshape_and_cache(&l, &mut kc, &mut vc, &k, &v, &slots).expect("valid");

            let mut buf = vec![bf16::ZERO; 2 * ids.len() * l.block_elems()];
            gather_blocks(&l, &kc, &vc, &ids, &mut buf).expect("valid");
            let n = ids.len() * l.block_elems();
            for (i, &id) in ids.iter().enumerate() {
                let at = id as usize * l.block_elems();
                let block = i * l.block_elems()..(i + 1) * l.block_elems();
                prop_assert_eq!(&buf[block.clone()], &kc[at..at + l.block_elems()]);
                prop_assert_eq!(&buf[n + block.start..n + block.end], &vc[at..at + l.block_elems()]);
            }

            // Scatter into a fresh cache and gather again: the same bits come back.
            let mut k2 = vec![bf16::ZERO; l.layer_elems()];
            let mut v2 = vec![bf16::ZERO; l.layer_elems()];
            scatter_blocks(&l, &mut k2, &mut v2, &ids, &buf).expect("valid");
            let mut again = vec![bf16::ZERO; buf.len()];
            gather_blocks(&l, &k2, &v2, &ids, &mut again).expect("valid");
            let bits = |b: &[bf16]| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&again), bits(&buf));
        }
    }

    #[test]
    fn large_gathers_round_trip() {
        let l = CacheShape {
            num_blocks: 64,
            block_size: 16,
            num_kv_heads: 4,
            head_dim: 64,
        };
        let kc: Vec<f32> = numbered(&l, 0.0);
        let vc: Vec<f32> = numbered(&l, 0.5);
        let ids: Vec<u32> = (0..64).rev().collect();
        let mut buf = vec![0.0f32; 2 * ids.len() * l.block_elems()];
        gather_blocks(&l, &kc, &vc, &ids, &mut buf).expect("valid");
        let mut k2 = vec![0.0f32; l.layer_elems()];
        let mut v2 = vec![0.0f32; l.layer_elems()];
        scatter_blocks(&l, &mut k2, &mut v2, &ids, &buf).expect("valid");
        assert_eq!(k2, kc);
        assert_eq!(v2, vc);
    }

    #[test]
    fn copy_blocks_applies_pairs_in_order() {
        let l = layout();
        let mut kc: Vec<f32> = numbered(&l, 0.0);
        let mut vc: Vec<f32> = numbered(&l, 1000.0);
        let orig_k = kc.clone();
        let orig_v = vc.clone();
        let b = l.block_elems();
        // 1 -> 4, then 4 -> 5: block 5 ends up with block 1's original contents.
        copy_blocks(&l, &mut kc, &mut vc, &[(1, 4), (4, 5)]).expect("valid");
        assert_eq!(&kc[4 * b..5 * b], &orig_k[b..2 * b]);
        assert_eq!(&kc[5 * b..6 * b], &orig_k[b..2 * b]);
        assert_eq!(&vc[5 * b..6 * b], &orig_v[b..2 * b]);
        assert_eq!(&kc[..4 * b], &orig_k[..4 * b]);
        copy_blocks(&l, &mut kc, &mut vc, &[(2, 2)]).expect("a self copy is a no-op");
        assert_eq!(&kc[..4 * b], &orig_k[..4 * b]);
    }

    #[test]
    fn bad_arguments_are_rejected_and_leave_the_cache_alone() {
        let l = layout();
        let row = l.row_elems();
        let mut kc = vec![0.0f32; l.layer_elems()];
        let mut vc = vec![0.0f32; l.layer_elems()];
        let rows = vec![1.0f32; 2 * row];

        let r = reshape_and_cache(&l, &mut kc, &mut vc, &rows, &rows, &[0, 24]);
        assert!(matches!(
            r,
            Err(KernelError::SlotOutOfRange {
                slot: 24,
                num_slots: 24
            })
        ));
        assert!(
            kc.iter().all(|&x| x == 0.0),
            "nothing written before the bad slot"
        );
        let r = reshape_and_cache(&l, &mut kc, &mut vc, &rows[1..], &rows, &[0, 1]);
        assert!(matches!(r, Err(KernelError::BadLength { what: "k", .. })));
        let r = reshape_and_cache(&l, &mut kc, &mut vc, &rows, &rows[1..], &[0, 1]);
        assert!(matches!(r, Err(KernelError::BadLength { what: "v", .. })));
        let r = reshape_and_cache(&l, &mut kc[1..], &mut vc, &rows, &rows, &[0, 1]);
        assert!(matches!(
            r,
            Err(KernelError::BadLength {
                what: "k_cache",
                ..
            })
        ));
        let zero = CacheShape { block_size: 0, ..l };
        let r = reshape_and_cache(&zero, &mut kc, &mut vc, &rows, &rows, &[0, 1]);
        assert!(matches!(r, Err(KernelError::Invalid(_))));

        let mut buf = vec![0.0f32; 2 * 2 * l.block_elems()];
        let r = gather_blocks(&l, &kc, &vc, &[0, 6], &mut buf);
        assert!(matches!(
            r,
            Err(KernelError::BlockOutOfRange {
                block_id: 6,
                num_blocks: 6
            })
        ));
        let r = gather_blocks(&l, &kc, &vc, &[0], &mut buf);
        assert!(matches!(r, Err(KernelError::BadLength { what: "dst", .. })));
        let r = gather_blocks(&l, &kc, &vc[1..], &[0, 1], &mut buf);
        assert!(matches!(
            r,
            Err(KernelError::BadLength {
                what: "v_cache",
                ..
            })
        ));
        buf.fill(7.0);
        let r = scatter_blocks(&l, &mut kc, &mut vc, &[1, 6], &buf);
        assert!(matches!(
            r,
            Err(KernelError::BlockOutOfRange { block_id: 6, .. })
        ));
        let r = scatter_blocks(&l, &mut kc, &mut vc, &[1, 2, 3], &buf);
        assert!(matches!(r, Err(KernelError::BadLength { what: "src", .. })));
        assert!(
            kc.iter().all(|&x| x == 0.0),
            "failed scatters write nothing"
        );

        let r = copy_blocks(&l, &mut kc, &mut vc, &[(0, 1), (7, 0)]);
        assert!(matches!(
            r,
            Err(KernelError::BlockOutOfRange { block_id: 7, .. })
        ));
        let r = copy_blocks(&l, &mut kc, &mut vc, &[(0, 6)]);
        assert!(matches!(
            r,
            Err(KernelError::BlockOutOfRange { block_id: 6, .. })
        ));
        let r = copy_blocks(&l, &mut kc, &mut vc[2..], &[(0, 1)]);
        assert!(matches!(
            r,
            Err(KernelError::BadLength {
                what: "v_cache",
                ..
            })
        ));
    }
}
