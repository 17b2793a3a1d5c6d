//! The wide path: a tile's query vectors laid across SIMD lanes, for prefill-sized tiles.
//!
//! The tile's query vectors (rows times group heads) are cut into blocks of [`LANES`]; within a
//! block, lane `l` is one query vector. A key's scores for the whole block are then one vector,
//! `s[j] = sum_d K[j][d] * Qt[d]`, built from broadcasts of the cached K row, and the online
//! softmax runs lane-wise (max and sum across the chunk's keys are vertical), so the hot loops
//! contain no horizontal reductions and no transposes of K or V. The output accumulates transposed the
//! same way, `Ot[d] += V[j][d] * p[j]`, and is transposed back once per tile.
//!
//! Layouts in [`Scratch`]: `q` and `o` are `[block][head_dim][LANES]`; `row_max`, `row_sum`
//! and `pos` are `[block][LANES]`, with padding lanes at position -1 so they see no key;
//! `k_rows` and `v_rows` hold the chunk's rows at a fixed stride, so that every broadcast in
//! the hot loops is one instruction with a constant offset; `chunk` holds a chunk's scores
//! when they are more than the registers take (`[key][LANES]`).
//!
//! Chunks that every lane of a block sees whole (most of a long prompt's) skip the causal
//! mask.

use crate::simd::{exp2, Simd, LANES};
use crate::tile::{
    chunk_starts, for_runs, refill, AttnInputs, Outputs, Scratch, Tile, MASKED, STAGE_STRIDE,
    WIDE_MAX_HEAD_DIM,
};
use crate::KvElem;

/// A chunk's staged rows, one fixed-stride row per key.
type Staged<const KC: usize> = [[f32; STAGE_STRIDE]; KC];

/// One block of lanes' running state, borrowed from the tile's scratch.
struct LaneBlock<'s> {
    qt: &'s [f32],
    ot: &'s mut [f32],
    row_max: &'s mut [f32],
    row_sum: &'s mut [f32],
    pos: &'s [f32],
}

/// Runs one tile on the wide path with chunks of `KC` keys, scored `G` at a time, and writes
/// its output rows.
#[inline(always)]
pub(crate) fn attend_wide<T: KvElem, S: Simd, const KC: usize, const G: usize>(
    simd: S,
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
) {
    // Split-K only cuts narrow tiles.
    debug_assert!(tile.partial.is_none() && tile.keys_from == 0);
    let (d, g) = (inp.layout.head_dim, inp.group);
    debug_assert_eq!(tile.kv_heads, 1, "a wide tile covers one kv head");
    let vectors = tile.vectors(g);
    let blocks = vectors.div_ceil(LANES);
    let Scratch {
        q: qt,
        o: ot,
        row_max,
        row_sum,
        pos,
        k_rows,
        v_rows,
        chunk,
        ..
    } = scratch;
    // Every chunk writes the first `d` elements of all KC rows before they are read.
    k_rows.resize(KC, [0.0; STAGE_STRIDE]);
    v_rows.resize(KC, [0.0; STAGE_STRIDE]);
    chunk.resize(KC, [0.0; LANES]);
    let sc: &mut [[f32; LANES]; KC] = (&mut chunk[..KC]).try_into().expect("KC score rows");
    refill(qt, blocks * d * LANES, 0.0);
    refill(ot, blocks * d * LANES, 0.0);
    refill(row_max, blocks * LANES, MASKED);
    refill(row_sum, blocks * LANES, 0.0);
    refill(pos, blocks * LANES, -1.0);

    // Transpose the group's scaled queries into lanes, once per tile.
    for i in tile.row_begin..tile.row_end {
        let src = &inp.q[tile.group_offset(i, inp.num_heads, g, d)..][..g * d];
        for (gi, head) in src.chunks_exact(d).enumerate() {
            let m = (i - tile.row_begin) * g + gi;
            let (b, l) = (m / LANES, m % LANES);
            // Exact: validation bounds positions by 2^24.
            pos[m] = (tile.first_pos() + i) as f32;
            let block = &mut qt[b * d * LANES..][..d * LANES];
            for (dd, &x) in head.iter().enumerate() {
                block[dd * LANES + l] = x.to_f32() * inp.scale_log2;
            }
        }
    }

    let key_end = tile.key_end();
    let mut c0 = 0;
    while c0 < key_end {
        let n = KC.min(key_end - c0);
        // Stage the chunk once for every block (a copy for f32, a conversion otherwise).
        let starts: [usize; KC] = chunk_starts(inp, tile, c0, n);
        let ks: &mut Staged<KC> = (&mut k_rows[..KC]).try_into().expect("KC staged rows");
        let vs: &mut Staged<KC> = (&mut v_rows[..KC]).try_into().expect("KC staged rows");
        for ((k, v), &st) in ks.iter_mut().zip(vs.iter_mut()).zip(&starts) {
            inp.k_cache.row_to_f32(st, &mut k[..d]);
            inp.v_cache.row_to_f32(st, &mut v[..d]);
        }
        // Blocks whose every lane is causally finished skip the chunk.
        let b_first = (tile.first_live_row(c0) - tile.row_begin) * g / LANES;
        for b in b_first..blocks {
            let block = LaneBlock {
                qt: &qt[b * d * LANES..][..d * LANES],
                ot: &mut ot[b * d * LANES..][..d * LANES],
                row_max: &mut row_max[b * LANES..][..LANES],
                row_sum: &mut row_sum[b * LANES..][..LANES],
                pos: &pos[b * LANES..][..LANES],
            };
            // Most chunks of a long prompt lie wholly before every lane's position: those
            // skip the causal mask (two compares and blends per score vector). A block with
            // padding lanes (position -1) always takes the masked path.
            let lowest = tile.first_pos() + tile.row_begin + b * LANES / g;
            let mask = (b + 1) * LANES > vectors || c0 + KC > lowest + 1;
            block_chunk::<S, KC, G>(simd, block, ks, vs, sc, c0, mask);
        }
        c0 += n;
    }

    for i in tile.row_begin..tile.row_end {
        // SAFETY: this tile alone writes its rows' columns of its kv head group (see attend_tile).
        let dst = unsafe {
            out.out
                .range_mut(tile.group_offset(i, inp.num_heads, g, d), g * d)
        };
        for (gi, head) in dst.chunks_exact_mut(d).enumerate() {
            let m = (i - tile.row_begin) * g + gi;
            let (b, l) = (m / LANES, m % LANES);
            let inv = 1.0 / row_sum[m];
            let block = &ot[b * d * LANES..][..d * LANES];
            for (dd, y) in head.iter_mut().enumerate() {
                *y = T::from_f32(block[dd * LANES + l] * inv);
            }
        }
    }
}

/// One chunk of keys against one block of lanes: scores, online softmax update, P·V.
/// Without `mask`, every key of the chunk must be visible to every lane.
#[inline(always)]
fn block_chunk<S: Simd, const KC: usize, const G: usize>(
    simd: S,
    block: LaneBlock<'_>,
    ks: &Staged<KC>,
    vs: &Staged<KC>,
    sc: &mut [[f32; LANES]; KC],
    c0: usize,
    mask: bool,
) {
    // The wide path only runs for heads up to WIDE_MAX_HEAD_DIM; saying so lets LLVM drop
    // the bounds checks on the staged rows.
    let d = (block.qt.len() / LANES).min(WIDE_MAX_HEAD_DIM);
    let qt = block.qt;
    if KC == G {
        // One group is the whole chunk (AVX-512's 16 keys): the scores stay in registers.
        let acc: [S::V; G] = scores::<S, G>(simd, qt, ks_group(ks, 0), d);
        let mut s = InRegs([simd.splat(0.0); KC]);
        s.0.copy_from_slice(&acc);
        softmax_pv::<S, KC, _>(simd, &mut s, block, vs, c0, mask);
    } else {
        // Scores, `G` keys at a time, then wait in `sc` (L1) for the softmax and P·V. In a
        // local array LLVM kept finished groups in registers and spilled the next group's
        // accumulators instead (AVX2 attention ran 20% slower).
        for (gi, group) in sc.chunks_exact_mut(G).enumerate() {
            let acc: [S::V; G] = scores::<S, G>(simd, qt, ks_group(ks, gi * G), d);
            for (row, v) in group.iter_mut().zip(acc) {
                simd.store(row, v);
            }
        }
        softmax_pv::<S, KC, _>(simd, &mut InL1(sc), block, vs, c0, mask);
    }
}

/// Staged rows `from..from + G`.
#[inline(always)]
fn ks_group<const KC: usize, const G: usize>(
    ks: &Staged<KC>,
    from: usize,
) -> &[[f32; STAGE_STRIDE]; G] {
    ks[from..from + G].try_into().expect("G staged rows")
}

/// Where a chunk's score vectors, then its probabilities, wait between the steps of one
/// block's chunk.
trait ChunkScores<S: Simd> {
    fn get(&self, simd: S, j: usize) -> S::V;
    fn set(&mut self, simd: S, j: usize, v: S::V);
}

/// In registers, when they fit.
struct InRegs<S: Simd, const KC: usize>([S::V; KC]);

impl<S: Simd, const KC: usize> ChunkScores<S> for InRegs<S, KC> {
    #[inline(always)]
    fn get(&self, _: S, j: usize) -> S::V {
        self.0[j]
    }
    #[inline(always)]
    fn set(&mut self, _: S, j: usize, v: S::V) {
        self.0[j] = v;
    }
}

/// In the tile's scratch (L1).
struct InL1<'s, const KC: usize>(&'s mut [[f32; LANES]; KC]);

impl<S: Simd, const KC: usize> ChunkScores<S> for InL1<'_, KC> {
    #[inline(always)]
    fn get(&self, simd: S, j: usize) -> S::V {
        simd.load(&self.0[j])
    }
    #[inline(always)]
    fn set(&mut self, simd: S, j: usize, v: S::V) {
        simd.store(&mut self.0[j], v);
    }
}

/// The online softmax update of one block over a scored chunk, then its P·V into `ot`.
#[inline(always)]
fn softmax_pv<S: Simd, const KC: usize, C: ChunkScores<S>>(
    simd: S,
    s: &mut C,
    block: LaneBlock<'_>,
    vs: &Staged<KC>,
    c0: usize,
    mask: bool,
) {
    let LaneBlock {
        ot,
        row_max,
        row_sum,
        pos,
        ..
    } = block;
    let d = (ot.len() / LANES).min(WIDE_MAX_HEAD_DIM);
    // Causal mask (key c0 + j is visible to a lane iff it is at or before the lane's
    // position; padding lanes sit at -1) and the chunk's max per lane.
    let pos = simd.load(pos);
    let masked = simd.splat(MASKED);
    let mut chunk_max = masked;
    for j in 0..KC {
        let mut sj = s.get(simd, j);
        if mask {
            let key = simd.splat((c0 + j) as f32);
            sj = simd.select_le(key, pos, sj, masked);
            s.set(simd, j, sj);
        }
        chunk_max = simd.max(chunk_max, sj);
    }
    let old_max = simd.load(row_max);
    let new_max = simd.max(old_max, chunk_max);
    let alpha = exp2(simd, simd.sub(old_max, new_max));
    let zero = simd.splat(0.0);
    let mut sum = zero;
    for j in 0..KC {
        let e = exp2(simd, simd.sub(s.get(simd, j), new_max));
        let pj = if mask {
            // A lane that has seen no key yet has new_max == MASKED, where exp2 gives 1.
            let key = simd.splat((c0 + j) as f32);
            simd.select_le(key, pos, e, zero)
        } else {
            e
        };
        s.set(simd, j, pj);
        sum = simd.add(sum, pj);
    }
    let new_sum = simd.mul_add(simd.load(row_sum), alpha, sum);
    simd.store(row_sum, new_sum);
    simd.store(row_max, new_max);

    // P·V into the transposed output, rescaling by alpha on the way.
    let pv = WidePv {
        p: &*s,
        alpha,
        v: vs,
    };
    for_runs!(0, d, S::WIDE_DIMS, |d0, r| match r {
        8 => pv_lanes::<S, KC, 8, C>(simd, &pv, ot, d0),
        6 => pv_lanes::<S, KC, 6, C>(simd, &pv, ot, d0),
        4 => pv_lanes::<S, KC, 4, C>(simd, &pv, ot, d0),
        2 => pv_lanes::<S, KC, 2, C>(simd, &pv, ot, d0),
        _ => {
            for d0 in d0..d0 + r {
                pv_lanes::<S, KC, 1, C>(simd, &pv, ot, d0);
            }
        }
    });
}

/// `G` keys' scores against one block of lanes: `s[j] = sum_dd K[j][dd] * Qt[dd]`.
///
/// The dd loop stays a run-time loop on purpose: fully unrolled, LLVM hoists all d * G
/// broadcasts out of the block loop and spills them.
#[inline(always)]
fn scores<S: Simd, const G: usize>(
    simd: S,
    qt: &[f32],
    rows: &[[f32; STAGE_STRIDE]; G],
    d: usize,
) -> [S::V; G] {
    let mut s = [simd.splat(0.0); G];
    for dd in 0..d {
        let q = simd.load(&qt[dd * LANES..]);
        for (acc, row) in s.iter_mut().zip(rows) {
            *acc = simd.mul_add(simd.splat(row[dd]), q, *acc);
        }
    }
    s
}

/// The inputs of one chunk's P·V on the wide path.
struct WidePv<'a, S: Simd, const KC: usize, C> {
    p: &'a C,
    alpha: S::V,
    v: &'a Staged<KC>,
}

/// `Ot[d0 + r] = Ot[d0 + r] * alpha + sum_j V[j][d0 + r] * p[j]` for `R` output dims at once,
/// which gives `R` independent FMA chains per key.
#[inline(always)]
fn pv_lanes<S: Simd, const KC: usize, const R: usize, C: ChunkScores<S>>(
    simd: S,
    pv: &WidePv<'_, S, KC, C>,
    ot: &mut [f32],
    d0: usize,
) {
    // Plain loops rather than `array::from_fn`: a closure would be compiled without the
    // wrapper's target features and call the intrinsics out of line.
    let mut acc = [pv.alpha; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        *acc = simd.mul(simd.load(&ot[(d0 + r) * LANES..]), pv.alpha);
    }
    for (j, vj) in pv.v.iter().enumerate() {
        let pj = pv.p.get(simd, j);
        let vj = &vj[d0..d0 + R];
        for (acc, &x) in acc.iter_mut().zip(vj) {
            *acc = simd.mul_add(simd.splat(x), pj, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        simd.store(&mut ot[(d0 + r) * LANES..], *acc);
    }
}
