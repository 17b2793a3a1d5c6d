//! The narrow path: each query vector kept whole, for decode-sized tiles.
//!
//! A decode step has one query row per sequence, so a tile holds only the group's few query
//! vectors; spreading them across lanes would leave most lanes idle. Here each score is a dot
//! product along `head_dim` with a tree reduction, the online softmax is per query vector, and
//! P·V accumulates natural-layout output rows from contiguous V rows.
//!
//! Layouts in [`Scratch`]: `q` and `o` are `[vector][head_dim]`, `p` is `[vector][LANES]`,
//! `row_max`, `row_sum` and `alpha` are `[vector]`.

use crate::simd::{dot, exp2, exp2_f32, Simd, IOTA, LANES};
use crate::tile::{for_runs, load_chunk, refill, AttnInputs, Scratch, SharedOut, Tile, MASKED};
use crate::KvElem;

/// Runs one tile on the narrow path and writes its output rows.
#[inline(always)]
pub(crate) fn attend_narrow<T: KvElem, S: Simd>(
    simd: S,
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &SharedOut<'_, T>,
) {
    let (d, g) = (inp.layout.head_dim, inp.group);
    let vectors = (tile.row_end - tile.row_begin) * g;
    let Scratch {
        q,
        o,
        row_max,
        row_sum,
        p,
        alpha,
        k_stage,
        v_stage,
        ..
    } = scratch;
    refill(q, vectors * d, 0.0);
    refill(o, vectors * d, 0.0);
    refill(row_max, vectors, MASKED);
    refill(row_sum, vectors, 0.0);
    refill(p, vectors * LANES, 0.0);
    refill(alpha, vectors, 1.0);

    for (i, dst) in (tile.row_begin..tile.row_end).zip(q.chunks_exact_mut(g * d)) {
        let at = tile.group_offset(i, inp.num_heads, g, d);
        T::to_f32_slice(&inp.q[at..at + g * d], dst);
        for x in dst.iter_mut() {
            *x *= inp.scale_log2;
        }
    }

    let iota = simd.load(&IOTA);
    let key_end = tile.key_end();
    let mut c0 = 0;
    while c0 < key_end {
        let n = LANES.min(key_end - c0);
        let chunk = load_chunk(inp, tile, c0, n, k_stage, v_stage);
        let m_start = (tile.first_live_row(c0) - tile.row_begin) * g;
        for m in m_start..vectors {
            let pos = tile.first_pos() + tile.row_begin + m / g;
            let valid = n.min(pos + 1 - c0);
            let qm = &q[m * d..][..d];
            let mut scores = [MASKED; LANES];
            for (sj, k) in scores.iter_mut().zip(&chunk.k).take(valid) {
                *sj = dot(simd, qm, k);
            }
            let s = simd.load(&scores);
            let new_max = row_max[m].max(simd.reduce_max(s));
            let a = exp2_f32(simd, row_max[m] - new_max);
            let e = exp2(simd, simd.sub(s, simd.splat(new_max)));
            // Lanes at or past `valid` are masked keys: probability zero.
            let pm = simd.select_le(iota, simd.splat(valid as f32 - 1.0), e, simd.splat(0.0));
            row_sum[m] = row_sum[m] * a + simd.reduce_add(pm);
            row_max[m] = new_max;
            alpha[m] = a;
            simd.store(&mut p[m * LANES..], pm);
        }
        for_runs(m_start, vectors, S::NARROW_ROWS, |m0, r| {
            let rows = PvRows {
                o: &mut o[m0 * d..],
                p: &p[m0 * LANES..],
                alpha: &alpha[m0..],
                v: &chunk.v,
                n,
                d,
            };
            match r {
                8 => pv_rows::<S, 8>(simd, rows),
                4 => pv_rows::<S, 4>(simd, rows),
                2 => pv_rows::<S, 2>(simd, rows),
                _ => pv_rows::<S, 1>(simd, rows),
            }
        });
        c0 += n;
    }

    for (i, acc) in (tile.row_begin..tile.row_end).zip(o.chunks_exact(g * d)) {
        // SAFETY: this tile alone writes its rows' columns of its kv head group (see attend_tile).
        let dst = unsafe { out.range_mut(tile.group_offset(i, inp.num_heads, g, d), g * d) };
        let m0 = (i - tile.row_begin) * g;
        for (gi, (y, x)) in dst.chunks_exact_mut(d).zip(acc.chunks_exact(d)).enumerate() {
            let inv = 1.0 / row_sum[m0 + gi];
            for (y, &x) in y.iter_mut().zip(x) {
                *y = T::from_f32(x * inv);
            }
        }
    }
}

/// A run of query vectors' output rows, probabilities and rescale factors, and the chunk's
/// `n` V rows of `d` elements.
struct PvRows<'s> {
    o: &'s mut [f32],
    p: &'s [f32],
    alpha: &'s [f32],
    v: &'s [&'s [f32]; LANES],
    n: usize,
    d: usize,
}

/// `o[r] = o[r] * alpha[r] + sum_j p[r][j] * V[j]` for `R` query vectors at once: each V
/// vector loaded feeds `R` independent FMA chains.
#[inline(always)]
fn pv_rows<S: Simd, const R: usize>(simd: S, rows: PvRows<'_>) {
    let PvRows {
        o,
        p,
        alpha,
        v,
        n,
        d,
    } = rows;
    let full = d - d % LANES;
    for c in (0..full).step_by(LANES) {
        // A loop, not `array::from_fn`: see `wide::pv_lanes`.
        let mut acc = [simd.splat(0.0); R];
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = simd.mul(simd.load(&o[r * d + c..]), simd.splat(alpha[r]));
        }
        for (j, vj) in v.iter().enumerate().take(n) {
            let vj = simd.load(&vj[c..]);
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = simd.mul_add(simd.splat(p[r * LANES + j]), vj, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            simd.store(&mut o[r * d + c..], *acc);
        }
    }
    if full < d {
        for r in 0..R {
            let row = &mut o[r * d + full..(r + 1) * d];
            for x in row.iter_mut() {
                *x *= alpha[r];
            }
            for (j, vj) in v.iter().enumerate().take(n) {
                let pj = p[r * LANES + j];
                for (x, &y) in row.iter_mut().zip(&vj[full..]) {
                    *x = simd.mul_add_f32(pj, y, *x);
                }
            }
        }
    }
}
