//! Paged attention over a ragged batch: validation, work planning and the parallel driver.
//!
//! The batch is cut into tiles of (sequence, kv heads, run of query rows) and the kernel pool
//! runs the tiles. Tiles are what make both shapes of load use every core: a big decode batch
//! has one tile per sequence, a small one a tile per sequence and kv head, a long prefill is
//! additionally cut along its query rows, and a small decode batch with long contexts is cut
//! along its keys ([`crate::split`]).
//! The arithmetic lives in [`crate::tile`].

use std::cell::RefCell;

use crate::kv_rows::KvRows;
use crate::layout::check_len;
use crate::narrow::{Ahead, STEP_KEYS};
use crate::pool;
use crate::simd::Isa;
use crate::split;
use crate::tile::{AttnInputs, Outputs, Scratch, SharedOut, Tile};
use crate::tile_dispatch::attend_tile;
use crate::{CacheShape, KernelError, KvElem};

thread_local! {
    /// Each kernel thread's attention buffers, reused from op to op.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Query vectors (query rows times the kv head's group of query heads) in one prefill tile.
/// Large enough that each K/V row read is reused many times, small enough that a 512-token
/// prompt still gives every core several tiles and the causal mask wastes little.
const TILE_QUERY_VECTORS: usize = 96;
/// Sequences per core from which a decode batch takes one tile per sequence over all its kv
/// heads (see `plan_tiles`).
const MERGE_MIN_TILES_PER_THREAD: usize = 4;

/// Longest context the kernels accept: positions are compared as f32 inside SIMD lanes,
/// which is exact up to 2^24.
pub const MAX_CONTEXT_LEN: usize = 1 << 24;

/// One sequence of a ragged attention batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttn<'a> {
    /// First row of this sequence in `q` and `out`.
    pub q_start: usize,
    /// Query rows of this sequence: the prompt chunk in prefill, 1 in decode.
    pub q_len: usize,
    /// Keys visible to the last query row, including the query rows themselves.
    pub context_len: usize,
    /// Cache block of positions `j * block_size..(j + 1) * block_size`, for every `j` that
    /// `context_len` reaches.
    pub block_table: &'a [u32],
}

/// The read-only arguments of one attention call, shared by the kernel and the reference.
pub(crate) struct AttentionArgs<'a, T> {
    pub layout: &'a CacheShape,
    pub k_cache: KvRows<'a, T>,
    pub v_cache: KvRows<'a, T>,
    pub q: &'a [T],
    pub num_heads: usize,
    pub seqs: &'a [SeqAttn<'a>],
    pub scale: f32,
}

impl<T: KvElem> AttentionArgs<'_, T> {
    /// Checks every argument against the layout and against each other, so that the kernels
    /// can index without any check failing.
    pub(crate) fn validate(&self, out_len: usize) -> Result<(), KernelError> {
        validate_attention(
            self.layout,
            [
                self.k_cache.len(),
                self.v_cache.len(),
                self.q.len(),
                out_len,
            ],
            self.num_heads,
            self.seqs,
            self.scale,
        )
    }

    /// Runs validated attention on `isa` (one this CPU supports) with a sliding `window`, split-K
    /// planned for `threads` cores (tests pin it so the same work items come out anywhere).
    pub(crate) fn run_tiles(&self, isa: Isa, threads: usize, window: Option<usize>, out: &mut [T]) {
        let layout = *self.layout;
        let inputs = AttnInputs {
            layout,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            q: self.q,
            num_heads: self.num_heads,
            group: self.num_heads / layout.num_kv_heads,
            scale_log2: self.scale * std::f32::consts::LOG2_E,
        };
        let (group, d) = (inputs.group, layout.head_dim);
        let tiles = plan_tiles(layout.num_kv_heads, group, self.seqs, threads, window);
        let plan = split::plan(tiles, group, d, threads);
        let mut partials = vec![0.0f32; plan.partial_len];
        {
            let outputs = Outputs {
                out: SharedOut::new(out),
                partials: SharedOut::new(&mut partials),
            };
            let ahead = pool::threads();
            pool::run(plan.items.len(), &|i| {
                // The item this thread will most likely take next, when the threads keep pace:
                // its first keys come in while this one computes. A decode tile is often a
                // single step, so the step-ahead prefetch inside the tile has nothing to hide
                // behind. A wrong guess costs only the bandwidth.
                let mut next = match plan.items.get(i + ahead) {
                    Some(next) if !next.is_wide(group, d) => {
                        let keys = next
                            .key_end()
                            .min(next.keys_to)
                            .saturating_sub(next.keys_from);
                        Ahead::new(&inputs, next, next.keys_from, STEP_KEYS.min(keys))
                    }
                    _ => Ahead::NONE,
                };
                SCRATCH.with(|scratch| {
                    let scratch = &mut scratch.borrow_mut();
                    // SAFETY: validation made the sequences' rows disjoint, the tiles partition
                    // each sequence's (rows, kv head) pairs and split-K parts get slots of
                    // their own, so no two items write the same place; `isa` is supported by
                    // the caller's contract.
                    unsafe {
                        attend_tile(isa, &inputs, &plan.items[i], scratch, &outputs, &mut next)
                    };
                })
            });
        }
        if plan.merges.is_empty() {
            return;
        }
        let out = SharedOut::new(out);
        pool::run(plan.merges.len(), &|i| {
            // SAFETY: each split tile owns its rows' columns of its kv head group, as above.
            unsafe { plan.merges[i].write(&partials, self.num_heads, group, d, &out) };
        });
    }
}

/// The checks of [`AttentionArgs::validate`] on buffer lengths alone (`[k_cache, v_cache, q,
/// out]`), so that the CUDA wrappers, whose buffers live on the device, share them.
pub(crate) fn validate_attention(
    layout: &CacheShape,
    [k_len, v_len, q_len, out_len]: [usize; 4],
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    scale: f32,
) -> Result<(), KernelError> {
    layout.validate()?;
    layout.check_cache("k_cache", k_len)?;
    layout.check_cache("v_cache", v_len)?;
    if num_heads == 0 || !num_heads.is_multiple_of(layout.num_kv_heads) {
        return Err(KernelError::HeadsNotDivisible {
            num_heads,
            num_kv_heads: layout.num_kv_heads,
        });
    }
    if !scale.is_finite() {
        return Err(KernelError::Invalid(format!(
            "scale {} is not finite",
            scale
        )));
    }
    // Saturating: an overflowed count never equals a real slice length.
    let num_tokens = seqs.iter().fold(0usize, |n, s| n.saturating_add(s.q_len));
    let expected = num_tokens.saturating_mul(num_heads.saturating_mul(layout.head_dim));
    check_len("q", expected, q_len)?;
    check_len("out", expected, out_len)?;
    for (i, s) in seqs.iter().enumerate() {
        validate_seq(layout, i, s, num_tokens)?;
    }

    // Tiles of different sequences write `out` concurrently, so rows must not overlap.
    let mut order: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].q_len > 0).collect();
    order.sort_unstable_by_key(|&i| seqs[i].q_start);
    for pair in order.windows(2) {
        let (a, b) = (&seqs[pair[0]], &seqs[pair[1]]);
        if a.q_start + a.q_len > b.q_start {
            return Err(KernelError::OverlappingQueryRows {
                first: pair[0].min(pair[1]),
                second: pair[0].max(pair[1]),
            });
        }
    }
    Ok(())
}

/// Checks one sequence: causal shape, its rows inside the batch, its block table.
fn validate_seq(
    layout: &CacheShape,
    i: usize,
    s: &SeqAttn<'_>,
    num_tokens: usize,
) -> Result<(), KernelError> {
    if s.q_len > s.context_len {
        return Err(KernelError::QueryLongerThanContext {
            seq: i,
            q_len: s.q_len,
            context_len: s.context_len,
        });
    }
    if s.context_len > MAX_CONTEXT_LEN {
        return Err(KernelError::Invalid(format!(
            "sequence {i}: context_len {} exceeds {MAX_CONTEXT_LEN}",
            s.context_len
        )));
    }
    if s.q_start > num_tokens || s.q_len > num_tokens - s.q_start {
        return Err(KernelError::QueryRowsOutOfRange {
            seq: i,
            q_start: s.q_start,
            q_end: s.q_start.saturating_add(s.q_len),
            num_tokens,
        });
    }
    let needed = layout.blocks_for(s.context_len);
    if s.block_table.len() < needed {
        return Err(KernelError::BlockTableTooShort {
            seq: i,
            context_len: s.context_len,
            needed,
            given: s.block_table.len(),
        });
    }
    for &block_id in &s.block_table[..needed] {
        layout.check_block(block_id)?;
    }
    Ok(())
}

/// Cuts every sequence into tiles: one per kv head and run of at most
/// `TILE_QUERY_VECTORS / group` query rows.
///
/// A batch of many decode-sized sequences (at least `MERGE_MIN_TILES_PER_THREAD` per core)
/// gets one narrow tile per sequence over all its kv heads instead: a cache row holds every kv
/// head side by side, so one tile then reads each block's K and V as one contiguous run, where
/// a tile per head read a `head_dim` slice of every row and left the rest of each row to
/// another tile, later, from memory again. Fewer sequences keep a tile per head, so that every
/// core still has work.
///
/// With a sliding `window`, only the rows whose window reaches key 0 are cut that way; every
/// later row is a one-row tile whose keys start at its window.
fn plan_tiles<'a>(
    num_kv_heads: usize,
    group: usize,
    seqs: &[SeqAttn<'a>],
    threads: usize,
    window: Option<usize>,
) -> Vec<Tile<'a>> {
    let rows_per_tile = (TILE_QUERY_VECTORS / group).max(1);
    let many = seqs.len() >= MERGE_MIN_TILES_PER_THREAD * threads.max(1);
    let mut tiles = Vec::new();
    for s in seqs {
        let first_pos = s.context_len - s.q_len;
        // Row i sits at first_pos + i and sees back to key 0 while first_pos + i < window.
        let whole = window.map_or(s.q_len, |w| s.q_len.min(w.saturating_sub(first_pos)));
        let runs = (0..whole)
            .step_by(rows_per_tile)
            .map(|b| (b, (b + rows_per_tile).min(whole), 0))
            .chain((whole..s.q_len).map(|i| (i, i + 1, first_pos + i + 1 - window.unwrap_or(0))));
        for (row_begin, row_end, keys_from) in runs {
            let tile = Tile {
                block_table: s.block_table,
                context_len: s.context_len,
                q_len: s.q_len,
                q_start: s.q_start,
                kv_head: 0,
                kv_heads: 1,
                row_begin,
                row_end,
                keys_from,
                keys_to: s.context_len,
                partial: None,
            };
            if many && Tile::narrow_rows(row_end - row_begin, group) {
                tiles.push(Tile {
                    kv_heads: num_kv_heads,
                    ..tile
                });
                continue;
            }
            for kv_head in 0..num_kv_heads {
                tiles.push(Tile { kv_head, ..tile });
            }
        }
    }
    // Longest tiles first, so the last tiles handed out are short and the cores finish together.
    tiles.sort_by_key(|t| std::cmp::Reverse(t.first_pos() + t.row_end));
    tiles
}

#[cfg(test)]
mod tests {
    use crate::paged_attention;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::reference::paged_attention_reference;

    /// A random batch: caches, queries and non-contiguous block tables.
    struct Batch<T> {
        layout: CacheShape,
        num_heads: usize,
        k: Vec<T>,
        v: Vec<T>,
        q: Vec<T>,
        /// (q_start, q_len, context_len, block table) per sequence.
        seqs: Vec<(usize, usize, usize, Vec<u32>)>,
        scale: f32,
    }

    impl<T: KvElem> Batch<T> {
        /// `shapes` holds (q_len, context_len) per sequence; one or two kv heads.
        fn new(
            seed: u64,
            group: usize,
            head_dim: usize,
            block_size: usize,
            shapes: &[(usize, usize)],
        ) -> Self {
            let num_kv_heads = StdRng::seed_from_u64(seed ^ 0x5eed).random_range(1..=2);
            Self::with_kv_heads(seed, num_kv_heads, group, head_dim, block_size, shapes)
        }

        fn with_kv_heads(
            seed: u64,
            num_kv_heads: usize,
            group: usize,
            head_dim: usize,
            block_size: usize,
            shapes: &[(usize, usize)],
        ) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            let needed: usize = shapes.iter().map(|s| s.1.div_ceil(block_size)).sum();
            let layout = CacheShape {
                num_blocks: needed + 3,
                block_size,
                num_kv_heads,
                head_dim,
            };
            let mut ids: Vec<u32> = (0..layout.num_blocks as u32).collect();
            ids.shuffle(&mut rng);
            let mut ids = ids.into_iter();
            let num_heads = group * num_kv_heads;
            let mut seqs = Vec::new();
            let mut q_start = 0;
            for &(q_len, context_len) in shapes {
                let table = ids
                    .by_ref()
                    .take(context_len.div_ceil(block_size))
                    .collect();
                seqs.push((q_start, q_len, context_len, table));
                q_start += q_len;
            }
            // Sequences need not appear in row order.
            seqs.shuffle(&mut rng);
            let mut fill = |n: usize| -> Vec<T> {
                (0..n)
                    .map(|_| T::from_f32(rng.random_range(-1.0..1.0)))
                    .collect()
            };
            let k = fill(layout.layer_elems());
            let v = fill(layout.layer_elems());
            let q = fill(q_start * num_heads * head_dim);
            // Sometimes a large scale, so the softmax is peaked and the running max moves.
            let scale = if seed.is_multiple_of(3) {
                1.5
            } else {
                1.0 / (head_dim as f32).sqrt()
            };
            Batch {
                layout,
                num_heads,
                k,
                v,
                q,
                seqs,
                scale,
            }
        }

        fn seq_attn(&self) -> Vec<SeqAttn<'_>> {
            self.seqs
                .iter()
                .map(|(q_start, q_len, context_len, table)| SeqAttn {
                    q_start: *q_start,
                    q_len: *q_len,
                    context_len: *context_len,
                    block_table: table,
                })
                .collect()
        }

        fn reference(&self) -> Vec<f32> {
            let mut out = vec![T::default(); self.q.len()];
            paged_attention_reference(
                &self.layout,
                &self.k,
                &self.v,
                &self.q,
                &mut out,
                self.num_heads,
                &self.seq_attn(),
                self.scale,
            )
            .expect("valid batch");
            out.iter().map(|x| x.to_f32()).collect()
        }

        fn fast(&self, isa: Isa) -> Vec<f32> {
            let seqs = self.seq_attn();
            let args = AttentionArgs {
                layout: &self.layout,
                k_cache: crate::kv_rows::KvRows::Plain(&self.k),
                v_cache: crate::kv_rows::KvRows::Plain(&self.v),
                q: &self.q,
                num_heads: self.num_heads,
                seqs: &seqs,
                scale: self.scale,
            };
            let mut out = vec![T::default(); self.q.len()];
            args.validate(out.len()).expect("valid batch");
            // Plan split-K for four cores whatever this machine has, so every machine tests
            // the same work items.
            args.run_tiles(isa, 4, None, &mut out);
            out.iter().map(|x| x.to_f32()).collect()
        }

        /// Every ISA this CPU has, against the reference.
        fn check(&self, tolerance: f32) {
            let want = self.reference();
            for isa in Isa::available() {
                let got = self.fast(isa);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= tolerance * (1.0 + w.abs()),
                        "{isa:?} element {i}: got {g}, want {w}"
                    );
                }
            }
        }
    }

    fn check_all_dtypes(
        seed: u64,
        group: usize,
        head_dim: usize,
        block_size: usize,
        shapes: &[(usize, usize)],
    ) {
        Batch::<f32>::new(seed, group, head_dim, block_size, shapes).check(1e-5);
        Batch::<bf16>::new(seed, group, head_dim, block_size, shapes).check(1.6e-2);
        Batch::<f16>::new(seed, group, head_dim, block_size, shapes).check(2e-3);
    }

    #[test]
    fn decode_batch_matches_reference() {
        let shapes: Vec<(usize, usize)> = (0..9).map(|i| (1, 1 + i * 23)).collect();
        for group in 1..=4 {
            check_all_dtypes(group as u64, group, 64, 16, &shapes);
        }
    }

    #[test]
    fn big_decode_batches_take_one_tile_per_sequence_and_match_reference() {
        // 20 sequences: more than 4 per planned core, so narrow tiles cover all kv heads. Some
        // rows come two or three at a time, one context is long enough to be cut by split-K,
        // and odd head dims leave tails in every pass.
        let mut shapes: Vec<(usize, usize)> = (0..18).map(|i| (1 + i % 3, 3 + i * 17)).collect();
        shapes.push((1, 1));
        shapes.push((1, 6000));
        for (group, head_dim) in [(1, 64), (3, 64), (2, 40), (4, 72)] {
            let seed = (group * 100 + head_dim) as u64;
            let f32s = Batch::<f32>::with_kv_heads(seed, 3, group, head_dim, 16, &shapes);
            let tiles = plan_tiles(3, group, &f32s.seq_attn(), 4, None);
            assert!(tiles.iter().any(|t| t.kv_heads == 3), "group {group}");
            let plan = split::plan(tiles, group, head_dim, 4);
            assert!(plan.merges.iter().any(|m| m.tile.kv_heads == 3));
            f32s.check(1e-5);
            Batch::<bf16>::with_kv_heads(seed, 3, group, head_dim, 16, &shapes).check(1.6e-2);
            Batch::<f16>::with_kv_heads(seed, 3, group, head_dim, 16, &shapes).check(2e-3);
        }
        // Fewer sequences than that keep a tile per kv head.
        let few = Batch::<f32>::with_kv_heads(1, 3, 3, 64, 16, &shapes[..8]);
        assert!(plan_tiles(3, 3, &few.seq_attn(), 4, None)
            .iter()
            .all(|t| t.kv_heads == 1));
        few.check(1e-5);
    }

    #[test]
    fn lone_long_decodes_are_split_and_merged() {
        // One sequence: three kv heads at most, so split-K cuts the keys.
        check_all_dtypes(40, 3, 64, 16, &[(1, 2500)]);
        check_all_dtypes(41, 1, 8, 7, &[(1, 1500), (2, 1100)]);
    }

    #[test]
    fn long_prefill_spans_many_tiles() {
        for group in [1, 3] {
            check_all_dtypes(7 + group as u64, group, 64, 16, &[(300, 300)]);
        }
    }

    #[test]
    fn prefill_after_cached_prefix_matches_reference() {
        check_all_dtypes(11, 2, 64, 16, &[(70, 200), (5, 40), (33, 33)]);
        check_all_dtypes(12, 3, 8, 4, &[(40, 41), (1, 90), (17, 64)]);
        // A few query rows per sequence: the narrow path with a causal mask inside a step.
        check_all_dtypes(13, 1, 64, 16, &[(2, 70), (3, 3), (7, 100), (5, 130)]);
        check_all_dtypes(14, 2, 64, 16, &[(3, 67), (2, 2)]);
    }

    #[test]
    fn odd_head_dims_and_block_sizes_match_reference() {
        for (i, (head_dim, block_size)) in [
            (24, 5),
            (40, 1),
            (8, 32),
            (72, 3),
            (20, 16),
            (9, 2),
            (80, 16),
            (128, 8),
            (264, 16),
        ]
        .into_iter()
        .enumerate()
        {
            check_all_dtypes(
                20 + i as u64,
                2,
                head_dim,
                block_size,
                &[(1, 37), (19, 50), (3, 3)],
            );
        }
    }

    #[test]
    fn empty_batch_and_empty_sequences_are_fine() {
        check_all_dtypes(30, 2, 8, 4, &[]);
        check_all_dtypes(31, 2, 8, 4, &[(0, 0), (0, 9), (2, 2)]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn mixed_batches_match_reference(
            seed in any::<u64>(),
            group in 1usize..=4,
            head_dim in prop::sample::select(vec![8usize, 20, 64]),
            block_size in prop::sample::select(vec![1usize, 4, 16, 7]),
            shapes in prop::collection::vec((1usize..40, 0usize..60), 1..6),
        ) {
            // (q_len, extra prefix) into (q_len, context_len); about half the rows decode.
            let shapes: Vec<(usize, usize)> = shapes
                .into_iter()
                .enumerate()
                .map(|(i, (q, prefix))| if i % 2 == 0 { (1, 1 + prefix) } else { (q, q + prefix) })
                .collect();
            Batch::<f32>::new(seed, group, head_dim, block_size, &shapes).check(1e-5);
            Batch::<bf16>::new(seed, group, head_dim, block_size, &shapes).check(1.6e-2);
        }
    }

    /// A small valid call whose pieces the error tests break one at a time.
    struct Call {
        layout: CacheShape,
        k: Vec<f32>,
        v: Vec<f32>,
        q: Vec<f32>,
        out: Vec<f32>,
        num_heads: usize,
        table: Vec<u32>,
    }

    impl Call {
        fn new() -> Self {
            let layout = CacheShape {
                num_blocks: 4,
                block_size: 2,
                num_kv_heads: 2,
                head_dim: 4,
            };
            Call {
                layout,
                k: vec![0.5; layout.layer_elems()],
                v: vec![0.5; layout.layer_elems()],
                q: vec![1.0; 3 * 4 * 4],
                out: vec![0.0; 3 * 4 * 4],
                num_heads: 4,
                table: vec![3, 1],
            }
        }

        fn run(&mut self, seqs: &[SeqAttn<'_>]) -> Result<(), KernelError> {
            paged_attention(
                &self.layout,
                &self.k,
                &self.v,
                &self.q,
                &mut self.out,
                self.num_heads,
                seqs,
                0.5,
            )
        }

        fn seq(&self, q_start: usize, q_len: usize, context_len: usize) -> SeqAttn<'static> {
            SeqAttn {
                q_start,
                q_len,
                context_len,
                block_table: Vec::leak(self.table.clone()),
            }
        }
    }

    #[test]
    fn valid_small_call_succeeds() {
        let mut call = Call::new();
        let seqs = [call.seq(0, 2, 4), call.seq(2, 1, 3)];
        call.run(&seqs).expect("valid call");
        // Every V element is 0.5, so every output is 0.5.
        assert!(call.out.iter().all(|&x| (x - 0.5).abs() < 1e-6));
    }

    #[test]
    fn bad_arguments_are_rejected() {
        let mut call = Call::new();
        let ok = [call.seq(0, 2, 4), call.seq(2, 1, 3)];

        let mut c = Call::new();
        c.k.pop();
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::BadLength {
                what: "k_cache",
                ..
            })
        ));
        let mut c = Call::new();
        c.v.push(0.0);
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::BadLength {
                what: "v_cache",
                ..
            })
        ));
        let mut c = Call::new();
        c.q.pop();
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::BadLength { what: "q", .. })
        ));
        let mut c = Call::new();
        c.out.pop();
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::BadLength { what: "out", .. })
        ));
        let mut c = Call::new();
        c.num_heads = 3;
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::HeadsNotDivisible {
                num_heads: 3,
                num_kv_heads: 2
            })
        ));
        let mut c = Call::new();
        c.num_heads = usize::MAX - 1;
        assert!(matches!(
            c.run(&ok),
            Err(KernelError::BadLength { what: "q", .. })
        ));
        let mut c = Call::new();
        c.layout.head_dim = 0;
        assert!(matches!(c.run(&ok), Err(KernelError::Invalid(_))));

        let long_q = [call.seq(0, 2, 1), call.seq(2, 1, 3)];
        assert!(matches!(
            call.run(&long_q),
            Err(KernelError::QueryLongerThanContext {
                seq: 0,
                q_len: 2,
                context_len: 1
            })
        ));
        let short_table = [call.seq(0, 2, 5), call.seq(2, 1, 3)];
        assert!(matches!(
            call.run(&short_table),
            Err(KernelError::BlockTableTooShort {
                seq: 0,
                needed: 3,
                given: 2,
                ..
            })
        ));
        let outside = [call.seq(0, 2, 4), call.seq(5, 1, 3)];
        assert!(matches!(
            call.run(&outside),
            Err(KernelError::QueryRowsOutOfRange {
                seq: 1,
                q_start: 5,
                ..
            })
        ));
        let overlap = [call.seq(0, 2, 4), call.seq(1, 1, 3)];
        assert!(matches!(
            call.run(&overlap),
            Err(KernelError::OverlappingQueryRows {
                first: 0,
                second: 1
            })
        ));
        let mut bad_block = call.seq(0, 2, 4);
        bad_block.block_table = &[3, 9];
        assert!(matches!(
            call.run(&[bad_block, call.seq(2, 1, 3)]),
            Err(KernelError::BlockOutOfRange {
                block_id: 9,
                num_blocks: 4
            })
        ));
        let huge = [call.seq(0, 2, MAX_CONTEXT_LEN + 1), call.seq(2, 1, 3)];
        assert!(matches!(
            call.run(&huge),
            Err(KernelError::BlockTableTooShort { .. }) | Err(KernelError::Invalid(_))
        ));
        let nan_scale = paged_attention(
            &call.layout,
            &call.k,
            &call.v,
            &call.q,
            &mut call.out,
            4,
            &ok,
            f32::NAN,
        );
        assert!(matches!(nan_scale, Err(KernelError::Invalid(_))));
        // The reference validates identically.
        let mut out = vec![0.0f32; call.q.len()];
        let r = paged_attention_reference(
            &call.layout,
            &call.k,
            &call.v,
            &call.q,
            &mut out,
            4,
            &overlap,
            0.5,
        );
        assert!(matches!(r, Err(KernelError::OverlappingQueryRows { .. })));
    }
}
