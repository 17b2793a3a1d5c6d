//! Host-side planning of the CUDA kernel launches: plain Rust, so that CPU-only CI tests it.
//!
//! The CUDA attention kernels (`cuda/attention_tile.cuh`) take a table of *tiles*, each a run
//! of query rows of one sequence times a run of query heads of one GQA group, and the block
//! tables of all sequences concatenated. This module builds those tables, and the host-side
//! rewrites that keep the copy kernels' results equal to the CPU kernels' where the CPU runs in
//! order and the GPU does not (repeated slots and ids, chained block copies). The tests at the
//! bottom replay the tile kernel's arithmetic on the CPU against the reference.

use std::collections::HashSet;

use crate::{CacheShape, KernelError, SeqAttn};

/// Warps per thread block of the attention kernels (`WARPS` in attention_tile.cuh).
// Read by the CUDA launchers only; CPU-only test builds compile this module without them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const WARPS: usize = 4;
/// Keys staged in shared memory per step (`TILE_KEYS`).
pub(crate) const TILE_KEYS: usize = 32;
/// Ints per tile-table entry (`TILE_INTS`).
pub(crate) const TILE_INTS: usize = 6;
/// Largest head_dim the kernels are instantiated for (`32 * VEC`, VEC <= 8).
pub(crate) const MAX_HEAD_DIM: usize = 256;
/// Block id that the scatter kernel skips (`SKIP` in block_copy.cu).
pub(crate) const SKIP_ID: u32 = u32::MAX;

/// Launch shape of one attention call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AttnPlan {
    /// `[num_tiles][TILE_INTS]`: q_row, n_rows, pos0, head_begin, table_offset, 0.
    pub tiles: Vec<i32>,
    /// Each sequence's needed blocks, concatenated; tiles point into it.
    pub block_tables: Vec<u32>,
    pub num_tiles: usize,
    /// Query vectors per tile: `WARPS * qpw` of the kernel that runs the plan.
    pub cap: usize,
    pub heads_per_tile: usize,
    /// 1 without split-K.
    pub num_partitions: usize,
    /// Keys per split-K part; 0 without split-K.
    pub partition_keys: usize,
}

/// Smallest instantiated head-dim bucket that holds `head_dim` (the kernels mask the rest).
pub(crate) fn head_dim_bucket(head_dim: usize) -> Result<usize, KernelError> {
    [32, 64, 128, 256]
        .into_iter()
        .find(|&b| head_dim <= b)
        .ok_or_else(|| {
            KernelError::Invalid(format!(
                "head_dim {head_dim} exceeds {MAX_HEAD_DIM}, the largest the CUDA kernels support"
            ))
        })
}

/// Dynamic shared memory of one attention block: staged queries, padded K and V, in f32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn attention_smem_bytes(cap: usize, head_dim: usize) -> usize {
    (cap * head_dim + TILE_KEYS * (head_dim | 1) + TILE_KEYS * head_dim) * 4
}

/// Tiles an already validated batch for a kernel holding `cap` query vectors per block.
///
/// A block takes as much of a GQA group as fits (`heads_per_tile = min(group, cap)`) and as many
/// rows as then fit, so decode with `group <= cap` reads each K/V row once for the whole
/// group. `partition_keys` turns on split-K.
pub(crate) fn plan_attention(
    layout: &CacheShape,
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    cap: usize,
    partition_keys: Option<usize>,
) -> Result<AttnPlan, KernelError> {
    let group = num_heads / layout.num_kv_heads;
    let heads_per_tile = group.min(cap);
    let rows_per_tile = cap / heads_per_tile;
    let to_i32 = |what: &str, x: usize| {
        i32::try_from(x).map_err(|_| {
            KernelError::Invalid(format!(
                "{what} {x} does not fit the kernels' 32-bit indices"
            ))
        })
    };
    let mut plan = AttnPlan {
        tiles: Vec::new(),
        block_tables: Vec::new(),
        num_tiles: 0,
        cap,
        heads_per_tile,
        num_partitions: 1,
        partition_keys: 0,
    };
    let mut longest = 0;
    for s in seqs.iter().filter(|s| s.q_len > 0) {
        let table_offset = to_i32("block table offset", plan.block_tables.len())?;
        plan.block_tables
            .extend_from_slice(&s.block_table[..layout.blocks_for(s.context_len)]);
        to_i32("query row", s.q_start + s.q_len)?;
        longest = longest.max(s.context_len);
        for row_begin in (0..s.q_len).step_by(rows_per_tile) {
            for head_begin in (0..group).step_by(heads_per_tile) {
                let entry: [i32; TILE_INTS] = [
                    (s.q_start + row_begin) as i32,
                    rows_per_tile.min(s.q_len - row_begin) as i32,
                    (s.context_len - s.q_len + row_begin) as i32,
                    head_begin as i32,
                    table_offset,
                    0,
                ];
                plan.tiles.extend_from_slice(&entry);
                plan.num_tiles += 1;
            }
        }
    }
    if let Some(keys) = partition_keys {
        if keys == 0 || !keys.is_multiple_of(TILE_KEYS) {
            return Err(KernelError::Invalid(format!(
                "partition_keys {keys} must be a positive multiple of {TILE_KEYS}"
            )));
        }
        plan.partition_keys = keys;
        plan.num_partitions = longest.div_ceil(keys).max(1);
    }
    Ok(plan)
}

/// reshape-and-cache slots with every token that a later token overwrites set to -1, so the
/// unordered GPU copy leaves what the CPU's in-order copy leaves (the last token wins).
pub(crate) fn last_wins_slots(slots: &[u32]) -> Vec<i64> {
    let mut seen = HashSet::with_capacity(slots.len());
    let mut out = vec![-1i64; slots.len()];
    for (i, &slot) in slots.iter().enumerate().rev() {
        if seen.insert(slot) {
            out[i] = i64::from(slot);
        }
    }
    out
}

/// Scatter ids with every earlier copy of a repeated id set to [`SKIP_ID`] (the last copy wins).
pub(crate) fn last_wins_ids(ids: &[u32]) -> Vec<u32> {
    let mut seen = HashSet::with_capacity(ids.len());
    let mut out = vec![SKIP_ID; ids.len()];
    for (i, &id) in ids.iter().enumerate().rev() {
        if seen.insert(id) {
            out[i] = id;
        }
    }
    out
}

/// Cuts copy-on-write pairs into launches whose pairs touch no block another pair of the same
/// launch writes, so running each launch in parallel and the launches in order gives the
/// CPU kernel's strictly sequential result.
pub(crate) fn copy_waves(pairs: &[(u32, u32)]) -> Vec<Vec<(u32, u32)>> {
    let mut waves = Vec::new();
    let mut wave: Vec<(u32, u32)> = Vec::new();
    let (mut reads, mut writes) = (HashSet::new(), HashSet::new());
    for &(src, dst) in pairs {
        let conflict = writes.contains(&src) || writes.contains(&dst) || reads.contains(&dst);
        if conflict {
            waves.push(std::mem::take(&mut wave));
            reads.clear();
            writes.clear();
        }
        reads.insert(src);
        writes.insert(dst);
        wave.push((src, dst));
    }
    if !wave.is_empty() {
        waves.push(wave);
    }
    waves
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::reference::paged_attention_reference;

    /// The CUDA tile kernel (attention_tile.cuh) and its split-K reduce, replayed one query
    /// vector at a time on the CPU over a plan, with the same index arithmetic.
    fn emulate(
        layout: &CacheShape,
        k: &[f32],
        v: &[f32],
        q: &[f32],
        num_heads: usize,
        scale: f32,
        plan: &AttnPlan,
    ) -> Vec<f32> {
        let (hd, group, h) = (
            layout.head_dim,
            num_heads / layout.num_kv_heads,
            plan.heads_per_tile,
        );
        let parts = plan.num_partitions;
        let mut out = vec![f32::NAN; q.len()];
        for tile in plan.tiles.chunks_exact(TILE_INTS) {
            let [q_row, n_rows, pos0, head_begin, table_offset, _] =
                [0, 1, 2, 3, 4, 5].map(|i| tile[i] as usize);
            let table = &plan.block_tables[table_offset..];
            let key_end = pos0 + n_rows;
            for kvh in 0..layout.num_kv_heads {
                for vec_ in 0..plan.cap {
                    let (r, hh) = (vec_ / h, head_begin + vec_ % h);
                    if r >= n_rows || hh >= group {
                        continue;
                    }
                    let head = kvh * group + hh;
                    let at = ((q_row + r) * num_heads + head) * hd;
                    let qv: Vec<f32> = q[at..at + hd]
                        .iter()
                        .map(|x| x * scale * std::f32::consts::LOG2_E)
                        .collect();
                    let pos = pos0 + r;
                    // (o, m, l) per split-K part, as the partial buffers hold them.
                    let mut states = Vec::new();
                    let part_keys = if parts > 1 {
                        plan.partition_keys
                    } else {
                        key_end
                    };
                    for from in (0..key_end).step_by(part_keys.max(1)) {
                        let to = (from + part_keys).min(key_end).min(pos + 1);
                        let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; hd]);
                        for key in from..to {
                            let slot = table[key / layout.block_size] as usize * layout.block_size
                                + key % layout.block_size;
                            let row = slot * layout.row_elems() + kvh * hd;
                            let s: f32 = qv.iter().zip(&k[row..row + hd]).map(|(a, b)| a * b).sum();
                            let m_new = m.max(s);
                            let (p, corr) = ((s - m_new).exp2(), (m - m_new).exp2());
                            l = l * corr + p;
                            m = m_new;
                            for (a, x) in o.iter_mut().zip(&v[row..row + hd]) {
                                *a = *a * corr + p * x;
                            }
                        }
                        states.push((o, m, l));
                    }
                    let mx = states.iter().fold(f32::NEG_INFINITY, |a, s| a.max(s.1));
                    let den: f32 = states.iter().map(|s| s.2 * (s.1 - mx).exp2()).sum();
                    for d in 0..hd {
                        let num: f32 = states.iter().map(|s| s.0[d] * (s.1 - mx).exp2()).sum();
                        out[at + d] = num / den;
                    }
                }
            }
        }
        out
    }

    /// A random ragged batch over shuffled blocks: (layout, num_heads, k, v, q, seqs).
    #[allow(clippy::type_complexity)]
    fn batch(
        seed: u64,
        group: usize,
        head_dim: usize,
        shapes: &[(usize, usize)],
    ) -> (
        CacheShape,
        usize,
        Vec<f32>,
        Vec<f32>,
        Vec<f32>,
        Vec<(usize, usize, usize, Vec<u32>)>,
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let block_size = [1, 4, 16][rng.random_range(0..3)];
        let num_kv_heads = rng.random_range(1..=3);
        let needed: usize = shapes.iter().map(|s| s.1.div_ceil(block_size)).sum();
        let layout = CacheShape {
            num_blocks: needed + 2,
            block_size,
            num_kv_heads,
            head_dim,
        };
        let mut ids: Vec<u32> = (0..layout.num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut ids = ids.into_iter();
        let mut seqs = Vec::new();
        let mut q_start = 0;
        for &(q_len, ctx) in shapes {
            let table = ids.by_ref().take(ctx.div_ceil(block_size)).collect();
            seqs.push((q_start, q_len, ctx, table));
            q_start += q_len;
        }
        seqs.shuffle(&mut rng);
        let num_heads = group * num_kv_heads;
        let mut fill =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let k = fill(layout.layer_elems());
        let v = fill(layout.layer_elems());
        let q = fill(q_start * num_heads * head_dim);
        (layout, num_heads, k, v, q, seqs)
    }

    fn check(seed: u64, group: usize, head_dim: usize, shapes: &[(usize, usize)]) {
        let (layout, num_heads, k, v, q, seqs) = batch(seed, group, head_dim, shapes);
        let seqs: Vec<SeqAttn<'_>> = seqs
            .iter()
            .map(|(q_start, q_len, context_len, table)| SeqAttn {
                q_start: *q_start,
                q_len: *q_len,
                context_len: *context_len,
                block_table: table,
            })
            .collect();
        let scale = if seed.is_multiple_of(2) { 1.5 } else { 0.125 };
        let mut want = vec![0.0f32; q.len()];
        paged_attention_reference(&layout, &k, &v, &q, &mut want, num_heads, &seqs, scale)
            .expect("valid batch");
        // Every kernel the wrapper can pick: decode q1/q2/q4, prefill, each with and without split-K.
        for cap in [4, 8, 16, 32] {
            for split in [None, Some(32), Some(64)] {
                let plan = plan_attention(&layout, num_heads, &seqs, cap, split).expect("plan");
                let got = emulate(&layout, &k, &v, &q, num_heads, scale, &plan);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "cap {cap} split {split:?} element {i}: got {g}, want {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn plans_cover_decode_prefill_and_mixed_batches() {
        check(1, 4, 64, &[(1, 1), (1, 37), (1, 130)]);
        check(2, 1, 8, &[(5, 5), (3, 40), (1, 9)]);
        check(3, 8, 33, &[(17, 100), (1, 64)]);
        check(4, 20, 16, &[(2, 70), (0, 3), (4, 4)]);
        check(5, 2, 128, &[(40, 40)]);
    }

    #[test]
    fn tiles_hold_a_whole_group_where_it_fits() {
        let table = [0u32, 1, 2];
        let seqs = [SeqAttn {
            q_start: 0,
            q_len: 5,
            context_len: 40,
            block_table: &table,
        }];
        let layout = CacheShape {
            num_blocks: 3,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let plan = plan_attention(&layout, 8, &seqs, 8, Some(32)).expect("plan");
        assert_eq!(plan.heads_per_tile, 4);
        // Two rows per tile: rows 0-1, 2-3, 4.
        assert_eq!(plan.num_tiles, 3);
        assert_eq!(&plan.tiles[12..18], &[4, 1, 39, 0, 0, 0]);
        assert_eq!(plan.num_partitions, 2);
        assert!(plan_attention(&layout, 8, &seqs, 8, Some(20)).is_err());
        assert_eq!(head_dim_bucket(80).expect("fits"), 128);
        assert!(head_dim_bucket(257).is_err());
    }

    #[test]
    fn later_duplicates_win() {
        assert_eq!(last_wins_slots(&[3, 5, 3, 7]), vec![-1, 5, 3, 7]);
        assert_eq!(last_wins_ids(&[2, 2, 1]), vec![SKIP_ID, 2, 1]);
    }

    /// Copies pairs on a toy cache of one value per block.
    fn run_pairs(cache: &mut [u32], pairs: &[(u32, u32)]) {
        for &(s, d) in pairs {
            cache[d as usize] = cache[s as usize];
        }
    }

    proptest! {
        #[test]
        fn copy_waves_match_sequential_copies(
            pairs in prop::collection::vec((0u32..6, 0u32..6), 0..12),
        ) {
            let mut want: Vec<u32> = (0..6).collect();
            run_pairs(&mut want, &pairs);
            let mut got: Vec<u32> = (0..6).collect();
            for wave in copy_waves(&pairs) {
                // Inside a wave, every pair reads the state from before the wave.
                let before = got.clone();
                for &(s, d) in &wave {
                    got[d as usize] = before[s as usize];
                }
            }
            prop_assert_eq!(got, want);
        }
    }
}
