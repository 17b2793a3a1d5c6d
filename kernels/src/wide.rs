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
//! the hot loops is one instruction with a constant offset.

use crate::simd::{exp2, Simd, LANES};
use crate::tile::{chunk_starts, for_runs, refill, AttnInputs, Outputs, Scratch, Tile, MASKED};
use crate::KvElem;

/// Widest head the wide path stages; wider heads take the narrow path.
pub(crate) const WIDE_MAX_HEAD_DIM: usize = 256;

/// Row stride of the staged K and V rows: room for the widest head, plus 16 floats so the
/// rows of a chunk do not all fall into the same L1 sets.
pub(crate) const STAGE_STRIDE: usize = WIDE_MAX_HEAD_DIM + 16;

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

/// Runs one tile on the wide path with chunks of `KC` keys and writes its output rows.
#[inline(always)]
pub(crate) fn attend_wide<T: KvElem, S: Simd, const KC: usize>(
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
        ..
    } = scratch;
    // Every chunk writes the first `d` elements of all KC rows before they are read.
    k_rows.resize(KC, [0.0; STAGE_STRIDE]);
    v_rows.resize(KC, [0.0; STAGE_STRIDE]);
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
            T::to_f32_slice(&inp.k_cache[st..st + d], &mut k[..d]);
            T::to_f32_slice(&inp.v_cache[st..st + d], &mut v[..d]);
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
            block_chunk::<S, KC>(simd, block, ks, vs, c0);
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
#[inline(always)]
fn block_chunk<S: Simd, const KC: usize>(
    simd: S,
    block: LaneBlock<'_>,
    ks: &Staged<KC>,
    vs: &Staged<KC>,
    c0: usize,
) {
    let LaneBlock {
        qt,
        ot,
        row_max,
        row_sum,
        pos,
    } = block;
    // The wide path only runs for heads up to WIDE_MAX_HEAD_DIM; saying so lets LLVM drop
    // the bounds checks on the staged rows.
    let d = (qt.len() / LANES).min(WIDE_MAX_HEAD_DIM);

    // Scores: KC independent accumulators, each FMA a broadcast K element times a Q vector.
    // The dd loop stays a run-time loop on purpose: fully unrolled, LLVM hoists all d * KC
    // broadcasts out of the block loop and spills them.
    let mut s = [simd.splat(0.0); KC];
    for dd in 0..d {
        let q = simd.load(&qt[dd * LANES..]);
        for (acc, row) in s.iter_mut().zip(ks) {
            *acc = simd.mul_add(simd.splat(row[dd]), q, *acc);
        }
    }

    // Causal mask (key c0 + j is visible to a lane iff it is at or before the lane's
    // position; padding lanes sit at -1) and the chunk's max per lane.
    let pos = simd.load(pos);
    let masked = simd.splat(MASKED);
    let mut chunk_max = masked;
    for (j, sj) in s.iter_mut().enumerate() {
        let key = simd.splat((c0 + j) as f32);
        *sj = simd.select_le(key, pos, *sj, masked);
        chunk_max = simd.max(chunk_max, *sj);
    }
    let old_max = simd.load(row_max);
    let new_max = simd.max(old_max, chunk_max);
    let alpha = exp2(simd, simd.sub(old_max, new_max));
    let zero = simd.splat(0.0);
    let mut sum = zero;
    for (j, sj) in s.iter_mut().enumerate() {
        let key = simd.splat((c0 + j) as f32);
        let e = exp2(simd, simd.sub(*sj, new_max));
        *sj = simd.select_le(key, pos, e, zero);
        sum = simd.add(sum, *sj);
    }
    let new_sum = simd.mul_add(simd.load(row_sum), alpha, sum);
    simd.store(row_sum, new_sum);
    simd.store(row_max, new_max);

    // P·V into the transposed output, rescaling by alpha on the way.
    let pv = WidePv {
        p: &s,
        alpha,
        v: vs,
    };
    for_runs!(0, d, S::WIDE_DIMS, |d0, r| match r {
        8 => pv_lanes::<S, KC, 8>(simd, &pv, ot, d0),
        4 => pv_lanes::<S, KC, 4>(simd, &pv, ot, d0),
        2 => pv_lanes::<S, KC, 2>(simd, &pv, ot, d0),
        _ => {
            for d0 in d0..d0 + r {
                pv_lanes::<S, KC, 1>(simd, &pv, ot, d0);
            }
        }
    });
}

/// The inputs of one chunk's P·V on the wide path.
struct WidePv<'a, S: Simd, const KC: usize> {
    p: &'a [S::V; KC],
    alpha: S::V,
    v: &'a Staged<KC>,
}

/// `Ot[d0 + r] = Ot[d0 + r] * alpha + sum_j V[j][d0 + r] * p[j]` for `R` output dims at once,
/// which gives `R` independent FMA chains per key.
#[inline(always)]
fn pv_lanes<S: Simd, const KC: usize, const R: usize>(
    simd: S,
    pv: &WidePv<'_, S, KC>,
    ot: &mut [f32],
    d0: usize,
) {
    // Plain loops rather than `array::from_fn`: a closure would be compiled without the
    // wrapper's target features and call the intrinsics out of line.
    let mut acc = [pv.alpha; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        *acc = simd.mul(simd.load(&ot[(d0 + r) * LANES..]), pv.alpha);
    }
    for (pj, vj) in pv.p.iter().zip(pv.v) {
        let vj = &vj[d0..d0 + R];
        for (acc, &x) in acc.iter_mut().zip(vj) {
            *acc = simd.mul_add(simd.splat(x), *pj, *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        simd.store(&mut ot[(d0 + r) * LANES..], *acc);
    }
}
