//! Split-K for decode: cutting long key ranges so that a small batch still uses every core.
//!
//! A decode batch of one sequence has one tile per kv head, which leaves cores idle however
//! long the context is. When a narrow tile holds more than its fair share of the call's work,
//! its key range is cut into parts that run as separate work items. Each part leaves its
//! unnormalized state (output rows, running max, running sum) in a slot of a scratch buffer,
//! and a merge rescales the parts to a common max and writes the final rows:
//! `out = sum_p o_p 2^(m_p - m) / sum_p l_p 2^(m_p - m)` with `m = max_p m_p`.

use crate::narrow::STEP_KEYS;
use crate::tile::{SharedOut, Tile};
use crate::KvElem;

/// Fewest keys worth a part of their own: below this the merge costs more than it saves.
const SPLIT_MIN_KEYS: usize = 512;

/// The work items of one call, and what to merge afterwards.
pub(crate) struct SplitPlan<'a> {
    pub items: Vec<Tile<'a>>,
    pub merges: Vec<Merge<'a>>,
    /// Elements of the partial-results buffer the parts write into.
    pub partial_len: usize,
}

/// One split tile: its parts' slots, `slot_len` apart from `first_slot`.
pub(crate) struct Merge<'a> {
    pub tile: Tile<'a>,
    pub first_slot: usize,
    pub parts: usize,
    pub slot_len: usize,
}

/// Cuts the narrow tiles whose work exceeds a fair share of `threads` cores (counting two work
/// items per core, so that uneven items still balance).
pub(crate) fn plan<'a>(
    tiles: Vec<Tile<'a>>,
    group: usize,
    head_dim: usize,
    threads: usize,
) -> SplitPlan<'a> {
    // A sliding window's tile starts at `keys_from`: its work and its parts begin there.
    let work = |t: &Tile<'_>| (t.key_end() - t.keys_from) * t.vectors(group);
    let total: usize = tiles.iter().map(work).sum();
    let fair_share = total.div_ceil(2 * threads.max(1)).max(1);
    let mut plan = SplitPlan {
        items: Vec::with_capacity(tiles.len()),
        merges: Vec::new(),
        partial_len: 0,
    };
    for tile in tiles {
        let keys = tile.key_end() - tile.keys_from;
        let parts = work(&tile)
            .div_ceil(fair_share)
            .min(keys / SPLIT_MIN_KEYS)
            .max(1);
        if parts == 1 || tile.is_wide(group, head_dim) {
            plan.items.push(tile);
            continue;
        }
        let part_keys = keys.div_ceil(parts).next_multiple_of(STEP_KEYS);
        let slot_len = tile.vectors(group) * (head_dim + 2);
        let first_slot = plan.partial_len;
        let mut parts = 0;
        for keys_from in (tile.keys_from..tile.key_end()).step_by(part_keys) {
            plan.items.push(Tile {
                keys_from,
                keys_to: (keys_from + part_keys).min(tile.key_end()),
                partial: Some(plan.partial_len),
                ..tile
            });
            plan.partial_len += slot_len;
            parts += 1;
        }
        plan.merges.push(Merge {
            tile,
            first_slot,
            parts,
            slot_len,
        });
    }
    plan
}

impl Merge<'_> {
    /// Combines the parts' slots of `partials` and writes the tile's final rows of `out`.
    ///
    /// # Safety
    /// No other thread may be writing this tile's part of `out`.
    pub(crate) unsafe fn write<T: KvElem>(
        &self,
        partials: &[f32],
        num_heads: usize,
        group: usize,
        head_dim: usize,
        out: &SharedOut<'_, T>,
    ) {
        let (tile, d) = (&self.tile, head_dim);
        let vectors = tile.vectors(group);
        let slot = |p: usize| &partials[self.first_slot + p * self.slot_len..][..self.slot_len];
        let mut acc = vec![0.0f32; d];
        for i in tile.row_begin..tile.row_end {
            // SAFETY: the caller's contract; the rows are this tile's alone.
            let per_row = tile.row_vectors(group);
            let dst =
                unsafe { out.range_mut(tile.group_offset(i, num_heads, group, d), per_row * d) };
            for (gi, y) in dst.chunks_exact_mut(d).enumerate() {
                let m = (i - tile.row_begin) * per_row + gi;
                let row_max = (0..self.parts)
                    .map(|p| slot(p)[vectors * d + m])
                    .fold(f32::NEG_INFINITY, f32::max);
                acc.fill(0.0);
                let mut sum = 0.0f32;
                for p in 0..self.parts {
                    let s = slot(p);
                    // Parts that saw no key of this row carry the MASKED max and weigh 0.
                    let w = (s[vectors * d + m] - row_max).exp2();
                    sum += w * s[vectors * (d + 1) + m];
                    for (a, &x) in acc.iter_mut().zip(&s[m * d..(m + 1) * d]) {
                        *a += w * x;
                    }
                }
                for (y, a) in y.iter_mut().zip(&acc) {
                    *y = T::from_f32(a / sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_tile(table: &[u32], context_len: usize, kv_head: usize) -> Tile<'_> {
        Tile {
            block_table: table,
            context_len,
            q_len: 1,
            q_start: 0,
            kv_head,
            kv_heads: 1,
            row_begin: 0,
            row_end: 1,
            keys_from: 0,
            keys_to: context_len,
            partial: None,
        }
    }

    #[test]
    fn a_lone_long_decode_is_cut_and_a_big_batch_is_not() {
        let table = [0u32; 1];
        let one: Vec<Tile<'_>> = (0..3).map(|h| decode_tile(&table, 8192, h)).collect();
        let plan = plan(one, 3, 64, 2);
        assert_eq!(plan.merges.len(), 3);
        assert!(plan.items.len() >= 6);
        // Parts cover each tile's keys exactly once, in step-aligned pieces.
        for m in &plan.merges {
            let parts: Vec<_> = plan
                .items
                .iter()
                .filter(|t| t.kv_head == m.tile.kv_head)
                .map(|t| (t.keys_from, t.keys_to))
                .collect();
            assert_eq!(parts.len(), m.parts);
            assert_eq!(parts[0].0, 0);
            assert_eq!(parts[parts.len() - 1].1, 8192);
            for w in parts.windows(2) {
                assert_eq!(w[0].1, w[1].0);
                assert_eq!(w[1].0 % STEP_KEYS, 0);
            }
        }
        assert_eq!(plan.partial_len, plan.items.len() * 3 * (64 + 2));

        let batch: Vec<Tile<'_>> = (0..96).map(|h| decode_tile(&table, 512, h % 3)).collect();
        let plan = super::plan(batch, 3, 64, 2);
        assert!(plan.merges.is_empty());
        assert_eq!(plan.items.len(), 96);
    }
}
