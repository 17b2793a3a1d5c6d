//! One work item of paged attention: a tile of query rows of one sequence against one kv head.
//!
//! A tile holds every query head of its kv head's group for each of its query rows, so each
//! K/V row it reads from the cache is reused by the whole group and the whole tile. Keys are
//! walked in chunks of a few dozen positions straight through the block table; nothing is
//! gathered beyond the one chunk being worked on (the wide path stages it at a fixed stride,
//! the narrow path reads f32 rows in place and converts only bf16/f16).
//!
//! This file holds what both paths share (the work item, the inputs, the scratch buffers and
//! where results go) and imports neither: `tile_dispatch.rs` sits above them and picks one per
//! tile ([`Tile::is_wide`]).

use std::marker::PhantomData;

use crate::kv_rows::KvRows;
use crate::simd::LANES;
use crate::CacheShape;

/// A score no key can have, standing in for minus infinity. Being finite, it keeps
/// `score - max` finite for masked keys and for rows that have seen no key yet.
pub(crate) const MASKED: f32 = -1.0e30;

/// Widest head the wide path stages; wider heads take the narrow path.
pub(crate) const WIDE_MAX_HEAD_DIM: usize = 256;

/// Row stride of the wide path's staged K and V rows: room for the widest head, plus 16 floats
/// so the rows of a chunk do not all fall into the same L1 sets.
pub(crate) const STAGE_STRIDE: usize = WIDE_MAX_HEAD_DIM + 16;

/// Below this many query vectors (rows times group heads) a tile takes the narrow path:
/// the wide path pays for a full vector of lanes per key whether or not it fills them.
/// Measured on AVX-512: narrow wins up to about 9 vectors, wide from 12.
const WIDE_MIN_VECTORS: usize = 12;

/// What every tile of one call shares.
pub(crate) struct AttnInputs<'a, T> {
    pub layout: CacheShape,
    pub k_cache: KvRows<'a, T>,
    pub v_cache: KvRows<'a, T>,
    pub q: &'a [T],
    pub num_heads: usize,
    /// Query heads per kv head.
    pub group: usize,
    /// The softmax scale times log2(e): scores come out in base 2, so the kernels use exp2.
    pub scale_log2: f32,
}

/// One work item: query rows `row_begin..row_end` of one sequence, for one kv head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile<'a> {
    pub block_table: &'a [u32],
    pub context_len: usize,
    pub q_len: usize,
    /// Absolute index (in `q` and `out`) of the sequence's first query row.
    pub q_start: usize,
    pub kv_head: usize,
    /// How many kv heads from `kv_head` on: more than one only on the narrow path, where the
    /// tile then reads each cache row's heads as one contiguous run (see `plan_tiles`).
    pub kv_heads: usize,
    pub row_begin: usize,
    pub row_end: usize,
    /// The keys this work item covers: all of `0..key_end()` unless split-K cut the tile.
    pub keys_from: usize,
    pub keys_to: usize,
    /// Where a split-K part leaves its unnormalized result (see `crate::split`): `None`
    /// writes the final rows to `out`.
    pub partial: Option<usize>,
}

impl Tile<'_> {
    /// Absolute position of the sequence's first query row; row `i` sits at `first_pos() + i`.
    #[inline(always)]
    pub(crate) fn first_pos(&self) -> usize {
        self.context_len - self.q_len
    }

    /// One past the last key any row of this tile may see.
    #[inline(always)]
    pub(crate) fn key_end(&self) -> usize {
        self.first_pos() + self.row_end
    }

    /// The first row (relative to the sequence) that can still see keys at `c0` or later:
    /// rows before it are causally finished.
    #[inline(always)]
    pub(crate) fn first_live_row(&self, c0: usize) -> usize {
        self.row_begin.max(c0.saturating_sub(self.first_pos()))
    }

    /// Query vectors (rows times group heads) of this tile.
    #[inline(always)]
    pub(crate) fn vectors(&self, group: usize) -> usize {
        (self.row_end - self.row_begin) * self.row_vectors(group)
    }

    /// Query vectors of one row of this tile: the groups of all its kv heads, in head order.
    #[inline(always)]
    pub(crate) fn row_vectors(&self, group: usize) -> usize {
        group * self.kv_heads
    }

    /// Whether this tile runs on the wide path (else the narrow one). The wide path lays one kv
    /// head's vectors across lanes, so a tile of several kv heads is always narrow.
    pub(crate) fn is_wide(&self, group: usize, head_dim: usize) -> bool {
        self.kv_heads == 1
            && self.vectors(group) >= WIDE_MIN_VECTORS
            && head_dim <= WIDE_MAX_HEAD_DIM
    }

    /// Whether `rows` query rows of `group` heads per kv head would take the narrow path: only
    /// such tiles may cover several kv heads.
    pub(crate) fn narrow_rows(rows: usize, group: usize) -> bool {
        rows * group < WIDE_MIN_VECTORS
    }

    /// Offset in `q` (and `out`) of the group's first head for sequence row `i`.
    #[inline(always)]
    pub(crate) fn group_offset(&self, i: usize, num_heads: usize, group: usize, d: usize) -> usize {
        ((self.q_start + i) * num_heads + self.kv_head * group) * d
    }
}

/// Reusable per-thread buffers, so a call allocates once per rayon job rather than per tile.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Scaled queries (layout depends on the path).
    pub q: Vec<f32>,
    /// Output accumulators (layout depends on the path).
    pub o: Vec<f32>,
    /// Running max of each query vector, in base-2 score units.
    pub row_max: Vec<f32>,
    /// Running softmax denominator of each query vector.
    pub row_sum: Vec<f32>,
    /// Per query vector: its position as f32, exact below 2^24 (wide path; padding lanes
    /// hold -1 so they see no key).
    pub pos: Vec<f32>,
    /// Probabilities of the current step's keys, per query vector (narrow path).
    pub p: Vec<f32>,
    /// Per query vector: the rescale factor of the current step (narrow path).
    pub alpha: Vec<f32>,
    /// The current chunk's K and V rows at a fixed stride (wide path).
    pub k_rows: Vec<[f32; STAGE_STRIDE]>,
    pub v_rows: Vec<[f32; STAGE_STRIDE]>,
    /// The current chunk's scores, then probabilities, per key (wide path).
    pub chunk: Vec<[f32; LANES]>,
    /// f32 copies of the current chunk's K and V rows when the cache is not f32.
    pub k_stage: Vec<f32>,
    pub v_stage: Vec<f32>,
}

/// Resizes `v` to `n` elements, all `value`, reusing its allocation.
pub(crate) fn refill<X: Copy>(v: &mut Vec<X>, n: usize, value: X) {
    v.clear();
    v.resize(n, value);
}

/// Element offsets (in the cache) of the rows of keys `c0..c0 + n` for the tile's kv head,
/// found through the block table. Entries at `n` and beyond repeat the first, so kernels
/// may read a full chunk and mask the rest.
#[inline(always)]
pub(crate) fn chunk_starts<T, const N: usize>(
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    c0: usize,
    n: usize,
) -> [usize; N] {
    let layout = &inp.layout;
    let bs = layout.block_size;
    let (row, head) = (layout.row_elems(), tile.kv_head * layout.head_dim);
    // Walk the table incrementally: one division per chunk, not one per key.
    let mut starts = [0usize; N];
    let (mut blk, mut off) = (c0 / bs, c0 % bs);
    for st in starts.iter_mut().take(n) {
        *st = (tile.block_table[blk] as usize * bs + off) * row + head;
        off += 1;
        if off == bs {
            off = 0;
            blk += 1;
        }
    }
    let first = starts[0];
    starts[n..].fill(first);
    starts
}

/// Runs `$body` for `($at, $n)` over `$begin..$end` in runs of `$max`, the last run shorter,
/// so micro-kernels can take `$n` as a const generic (the body matches on it).
///
/// A macro rather than a function taking a closure: closures are compiled without the
/// `#[target_feature]`s of the kernel they sit in, and when LLVM declines to inline one, every
/// SIMD intrinsic inside it becomes an out-of-line call (measured: 5x slower).
macro_rules! for_runs {
    ($begin:expr, $end:expr, $max:expr, |$at:ident, $n:ident| $body:expr) => {{
        let (end, max) = ($end, $max);
        let mut $at = $begin;
        while $at < end {
            let $n = max.min(end - $at);
            $body;
            $at += $n;
        }
    }};
}
pub(crate) use for_runs;

/// Where tiles leave their results: final rows in `out`, split-K parts in `partials`.
pub(crate) struct Outputs<'a, T> {
    pub out: SharedOut<'a, T>,
    pub partials: SharedOut<'a, f32>,
}

/// `out` shared between tiles that each write a disjoint part of it.
pub(crate) struct SharedOut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a SharedOut is a `&mut [T]` whose disjoint pieces are handed to different threads;
// sending `&mut T` between threads needs exactly `T: Send`.
unsafe impl<T: Send> Send for SharedOut<'_, T> {}
// SAFETY: as above; shared access only ever hands out disjoint `&mut` ranges.
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T> SharedOut<'a, T> {
    pub(crate) fn new(out: &'a mut [T]) -> Self {
        SharedOut {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _borrow: PhantomData,
        }
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// No other reference into this range may be live while the returned one is.
    // `inline`: the kernels call it once per output row from another module, where LLVM left
    // it out of line (it was inlined while the kernels' dispatch sat in this file).
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(&self, start: usize, len: usize) -> &mut [T] {
        assert!(
            start <= self.len && len <= self.len - start,
            "output range {start}+{len} past {} elements",
            self.len
        );
        // SAFETY: in bounds by the assert; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_the_range() {
        let mut seen = Vec::new();
        for_runs!(3, 3 + 8 + 8 + 5, 8, |at, n| seen.push((at, n)));
        assert_eq!(seen, vec![(3, 8), (11, 8), (19, 5)]);
        seen.clear();
        for_runs!(5, 5, 4, |at, n| seen.push((at, n)));
        assert!(seen.is_empty());
    }

    #[test]
    fn shared_out_hands_out_ranges() {
        let mut buf = vec![0u32; 8];
        let shared = SharedOut::new(&mut buf);
        // SAFETY: the two ranges do not overlap and nothing else borrows `buf`.
        unsafe {
            shared.range_mut(0, 4).fill(1);
            shared.range_mut(4, 4).fill(2);
        }
        assert_eq!(buf, [1, 1, 1, 1, 2, 2, 2, 2]);
    }
}
