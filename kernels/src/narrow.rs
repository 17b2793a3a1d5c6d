//! The narrow path: each query vector kept whole, for decode-sized tiles.
//!
//! A decode step has one query row per sequence, so a tile holds only the group's few query
//! vectors; spreading them across lanes would leave most lanes idle. Here the scores of 16
//! keys come out as one vector per query vector (dot-product accumulators, then one
//! transpose-and-add), for up to three vectors of a kv head at once where the instruction set
//! can share each K row's loads between them (a GQA group); the online softmax is per query
//! vector, and P·V accumulates natural-layout output rows from contiguous V rows. Keys go in
//! steps of [`STEP_KEYS`], so the serial part of the softmax (max, rescale factor) is paid once
//! per 64 keys rather than once per 16.
//!
//! Layouts in [`Scratch`]: `q` and `o` are `[vector][head_dim]`, `p` is
//! `[vector][STEP_KEYS]` (raw scores, then probabilities), `row_max`, `row_sum` and `alpha` are
//! `[vector]`.

use crate::kv_rows::KvRows;
use crate::simd::{exp2, exp2_f32, prefetch_l2, Simd, IOTA, LANES};
use crate::tile::{chunk_starts, for_runs, refill, AttnInputs, Outputs, Scratch, Tile, MASKED};
use crate::KvElem;

/// Score vectors per step.
const STEP_VECTORS: usize = 4;

/// Query vectors scored together, at most (see [`Simd::dot_group`]).
const SCORE_ROWS: usize = 3;

/// Keys per step; split-K cuts key ranges at multiples of it.
pub(crate) const STEP_KEYS: usize = STEP_VECTORS * LANES;

/// The f32 K and V rows of one step's keys: `head_dim` for each of the tile's kv heads.
struct StepRows<'c> {
    k: [&'c [f32]; STEP_KEYS],
    v: [&'c [f32]; STEP_KEYS],
}

/// Runs one tile on the narrow path and writes its output rows.
#[inline(always)]
pub(crate) fn attend_narrow<T: KvElem, S: Simd>(
    simd: S,
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
    next: &mut Ahead,
) {
    let (d, g) = (inp.layout.head_dim, inp.group);
    let vectors = tile.vectors(g);
    // A row's query vectors: its `kv_heads` groups, each against its own part of a cache row.
    let (per_row, heads) = (tile.row_vectors(g), tile.kv_heads);
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
    refill(p, vectors * STEP_KEYS, 0.0);
    refill(alpha, vectors, 1.0);

    for (i, dst) in (tile.row_begin..tile.row_end).zip(q.chunks_exact_mut(per_row * d)) {
        let at = tile.group_offset(i, inp.num_heads, g, d);
        T::to_f32_slice(&inp.q[at..at + per_row * d], dst);
        for x in dst.iter_mut() {
            *x *= inp.scale_log2;
        }
    }

    let iota = simd.load(&IOTA);
    let key_end = tile.key_end().min(tile.keys_to);
    let mut c0 = tile.keys_from;
    // The tile's next step, while this one computes; the last step fetches `next`, the item
    // this thread most likely takes after this one.
    let mut own: Ahead;
    while c0 < key_end {
        let n = STEP_KEYS.min(key_end - c0);
        let starts: [usize; STEP_KEYS] = chunk_starts(inp, tile, c0, n);
        if c0 == tile.keys_from {
            // Every line of the first step's K and V rows is asked for before the first score
            // (most are already on their way, fetched by the previous item): the loads below
            // then find them in flight, where on their own they waited on memory a few lines
            // at a time.
            prefetch_rows(inp, tile, &starts, n);
        }
        let rows = step_rows(inp, tile, &starts, n, k_stage, v_stage);
        let m_start = (tile.first_live_row(c0) - tile.row_begin) * per_row;
        let ahead = if c0 + n < key_end {
            own = Ahead::new(inp, tile, c0 + n, STEP_KEYS.min(key_end - c0 - n));
            &mut own
        } else {
            &mut *next
        };
        // One share per query vector for the scores (asked for in pieces, one per 16-key
        // chunk) and one for P·V: the next rows are read at a steady pace while this step
        // computes, where one burst of a step's lines (1,536 at 64 keys) held the core until
        // most of them had arrived. Pieces per chunk rather than a share per run of vectors
        // made a 64 x 64 decode step's attention from memory 1.1x faster.
        let share = ahead.remaining().div_ceil(2 * (vectors - m_start).max(1));
        // Runs of vectors that share a kv head (a whole tile of one head, else each group), one
        // after another: the raw scores of the step's keys, a few vectors at a time so that
        // each K row is loaded once for all of them (a GQA group of 3 scored 1.5x faster on
        // AVX2 than one vector at a time), then their softmax, then their P·V.
        let run = if heads == 1 { vectors } else { g };
        let chunks = n.div_ceil(LANES);
        let mut seg = m_start;
        while seg < vectors {
            let (end, head_at) = ((seg + run).min(vectors), (seg % per_row) / g * d);
            for_runs!(seg, end, SCORE_ROWS, |m0, r| {
                let piece = (share * r).div_ceil(chunks);
                for v in 0..chunks {
                    ahead.issue(inp, piece);
                    let k: [&[f32]; LANES] =
                        std::array::from_fn(|j| &rows.k[v * LANES + j][head_at..head_at + d]);
                    let at = m0 * STEP_KEYS + v * LANES;
                    match r {
                        3 => score_run::<S, 3>(simd, &q[m0 * d..], d, &k, &mut p[at..]),
                        2 => score_run::<S, 2>(simd, &q[m0 * d..], d, &k, &mut p[at..]),
                        _ => score_run::<S, 1>(simd, &q[m0 * d..], d, &k, &mut p[at..]),
                    }
                }
            });
            // The online softmax of each vector over the step, from its raw scores.
            for m in seg..end {
                let pos = tile.first_pos() + tile.row_begin + m / per_row;
                let valid = n.min(pos + 1 - c0);
                let pm = &mut p[m * STEP_KEYS..][..STEP_KEYS];
                // Lane l of vector v is key 16v + l; keys at or past `valid` are masked.
                let mut s = [simd.splat(MASKED); STEP_VECTORS];
                let mut last = [simd.splat(-1.0); STEP_VECTORS];
                for (v, (s, last)) in s.iter_mut().zip(&mut last).enumerate() {
                    if v * LANES >= valid {
                        break;
                    }
                    *last = simd.splat((valid - v * LANES) as f32 - 1.0);
                    *s = simd.select_le(
                        iota,
                        *last,
                        simd.load(&pm[v * LANES..]),
                        simd.splat(MASKED),
                    );
                }
                let mut step_max = s[0];
                for s in &s[1..] {
                    step_max = simd.max(step_max, *s);
                }
                let new_max = row_max[m].max(simd.reduce_max(step_max));
                let a = exp2_f32(simd, row_max[m] - new_max);
                let mut sum = simd.splat(0.0);
                for (v, (s, last)) in s.iter().zip(&last).enumerate() {
                    let e = exp2(simd, simd.sub(*s, simd.splat(new_max)));
                    let pv = simd.select_le(iota, *last, e, simd.splat(0.0));
                    sum = simd.add(sum, pv);
                    simd.store(&mut pm[v * LANES..], pv);
                }
                row_sum[m] = row_sum[m] * a + simd.reduce_add(sum);
                row_max[m] = new_max;
                alpha[m] = a;
            }
            // Then P·V for the run's vectors.
            for_runs!(seg, end, S::NARROW_ROWS, |m0, r| {
                ahead.issue(inp, share * r);
                let rows = PvRows {
                    o: &mut o[m0 * d..],
                    p: &p[m0 * STEP_KEYS..],
                    alpha: &alpha[m0..],
                    v: &rows.v,
                    n,
                    head_at,
                    d,
                };
                match r {
                    4 => pv_rows::<S, 4>(simd, rows),
                    3 => pv_rows::<S, 3>(simd, rows),
                    2 => pv_rows::<S, 2>(simd, rows),
                    _ => pv_rows::<S, 1>(simd, rows),
                }
            });
            seg += run;
        }
        ahead.issue(inp, usize::MAX);
        c0 += n;
    }

    if let Some(at) = tile.partial {
        // A split-K part: leave the unnormalized state for the merge.
        // SAFETY: this part alone owns its slot (see attend_tile).
        let slot = unsafe { out.partials.range_mut(at, vectors * (d + 2)) };
        let (slot_o, slot_stats) = slot.split_at_mut(vectors * d);
        slot_o.copy_from_slice(o);
        slot_stats[..vectors].copy_from_slice(row_max);
        slot_stats[vectors..].copy_from_slice(row_sum);
        return;
    }
    for (i, acc) in (tile.row_begin..tile.row_end).zip(o.chunks_exact(per_row * d)) {
        // SAFETY: this tile alone writes its rows' columns of its kv head group (see attend_tile).
        let dst = unsafe {
            out.out
                .range_mut(tile.group_offset(i, inp.num_heads, g, d), per_row * d)
        };
        let m0 = (i - tile.row_begin) * per_row;
        for (gi, (y, x)) in dst.chunks_exact_mut(d).zip(acc.chunks_exact(d)).enumerate() {
            let inv = 1.0 / row_sum[m0 + gi];
            for (y, &x) in y.iter_mut().zip(x) {
                *y = T::from_f32(x * inv);
            }
        }
    }
}

/// The K and V rows of some keys to come (every kv head of a tile), asked into L2 a few rows
/// at a time: the rows of keys `c0..c0 + n` of one tile, K first, then V.
pub(crate) struct Ahead {
    starts: [usize; STEP_KEYS],
    keys: usize,
    /// Elements per row (the tile's kv heads).
    width: usize,
    /// The next row to ask for, of `2 * keys` (K rows, then V rows).
    next: usize,
}

impl Ahead {
    /// Nothing to ask for.
    pub(crate) const NONE: Ahead = Ahead {
        starts: [0; STEP_KEYS],
        keys: 0,
        width: 0,
        next: 0,
    };

    /// The rows of keys `c0..c0 + n` of `tile`, none asked for yet.
    #[inline(always)]
    pub(crate) fn new<T: KvElem>(
        inp: &AttnInputs<'_, T>,
        tile: &Tile<'_>,
        c0: usize,
        n: usize,
    ) -> Self {
        Ahead {
            starts: chunk_starts(inp, tile, c0, n),
            keys: n,
            width: inp.layout.head_dim * tile.kv_heads,
            next: 0,
        }
    }

    /// Rows not yet asked for.
    #[inline(always)]
    pub(crate) fn remaining(&self) -> usize {
        2 * self.keys - self.next
    }

    /// Asks for every line of the next `count` rows (or of all that remain).
    #[inline(always)]
    pub(crate) fn issue<T: KvElem>(&mut self, inp: &AttnInputs<'_, T>, count: usize) {
        let end = self.next + count.min(self.remaining());
        for r in self.next..end {
            let (cache, st) = if r < self.keys {
                (inp.k_cache, self.starts[r])
            } else {
                (inp.v_cache, self.starts[r - self.keys])
            };
            prefetch_row(cache, st, self.width);
        }
        self.next = end;
    }
}

/// Asks for the first `n` K and V rows at `starts` (every kv head of the tile) to come into L2.
#[inline(always)]
fn prefetch_rows<T: KvElem>(
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    starts: &[usize; STEP_KEYS],
    n: usize,
) {
    let width = inp.layout.head_dim * tile.kv_heads;
    for cache in [inp.k_cache, inp.v_cache] {
        for &st in starts.iter().take(n) {
            prefetch_row(cache, st, width);
        }
    }
}

/// Asks for every cache line of the `width` elements at `st`: the dtype match once per row, the
/// loop in bytes by a constant line.
#[inline(always)]
fn prefetch_row<T: KvElem>(cache: KvRows<'_, T>, st: usize, width: usize) {
    let (base, size) = cache.bytes();
    let row = base.wrapping_add(st * size);
    for at in (0..width * size).step_by(64) {
        prefetch_l2(row.wrapping_add(at));
    }
}

/// Borrows the first `n` rows at `starts` (a step's keys) as f32: in place for an f32 cache,
/// converted into the stage buffers otherwise. Rows at `n` and beyond repeat the first.
#[inline(always)]
fn step_rows<'c, T: KvElem>(
    inp: &'c AttnInputs<'_, T>,
    tile: &Tile<'_>,
    starts: &[usize; STEP_KEYS],
    n: usize,
    k_stage: &'c mut Vec<f32>,
    v_stage: &'c mut Vec<f32>,
) -> StepRows<'c> {
    let width = inp.layout.head_dim * tile.kv_heads;
    StepRows {
        k: cache_rows(inp.k_cache, starts, n, width, k_stage),
        v: cache_rows(inp.v_cache, starts, n, width, v_stage),
    }
}

#[inline(always)]
fn cache_rows<'c, T: KvElem>(
    cache: KvRows<'c, T>,
    starts: &[usize; STEP_KEYS],
    n: usize,
    width: usize,
    stage: &'c mut Vec<f32>,
) -> [&'c [f32]; STEP_KEYS] {
    // Loops rather than `array::from_fn`, whose closures do not inline into the kernels.
    let mut rows: [&[f32]; STEP_KEYS] = [&[]; STEP_KEYS];
    if let Some(cache) = cache.as_f32() {
        // The `n` rows only, the rest copies of the first (their starts are the first's): each
        // slice costs a bounds check, and a decode step on a short context has few keys.
        for (row, &st) in rows.iter_mut().zip(starts).take(n) {
            *row = &cache[st..st + width];
        }
        let first = rows[0];
        rows[n..].fill(first);
        return rows;
    }
    if stage.len() < n * width {
        stage.resize(n * width, 0.0);
    }
    for (&st, dst) in starts.iter().zip(stage.chunks_exact_mut(width)).take(n) {
        cache.row_to_f32(st, dst);
    }
    let stage: &'c [f32] = stage;
    for (j, row) in rows.iter_mut().enumerate() {
        *row = &stage[j.min(n - 1) * width..][..width];
    }
    rows
}

/// The raw scores of `R` query vectors (`q`, `d` apart) against 16 K rows, into `p` (lane `j`
/// of vector `r` at `p[r * STEP_KEYS + j]`): together where the instruction set shares the row
/// loads ([`Simd::dot_group`]), else one vector at a time.
#[inline(always)]
fn score_run<S: Simd, const R: usize>(
    simd: S,
    q: &[f32],
    d: usize,
    k: &[&[f32]; LANES],
    p: &mut [f32],
) {
    let mut s = [simd.splat(0.0); R];
    if !simd.dot_group::<R>(q, d, k, &mut s) {
        for (r, s) in s.iter_mut().enumerate() {
            *s = chunk_scores(simd, &q[r * d..(r + 1) * d], k);
        }
    }
    for (r, s) in s.iter().enumerate() {
        simd.store(&mut p[r * STEP_KEYS..], *s);
    }
}

/// The scores of one query vector against 16 K rows (each `q.len()` long), one key per lane:
/// one accumulator per key along the head, then a single 16-way transpose-and-add.
#[inline(always)]
fn chunk_scores<S: Simd>(simd: S, q: &[f32], k: &[&[f32]; LANES]) -> S::V {
    let d = q.len();
    let full = d / LANES;
    let mut acc = [simd.splat(0.0); LANES];
    for_runs!(0, full, S::NARROW_SCORE_CHUNKS, |c0, c| match c {
        4 => score_pass::<S, 4>(simd, q, k, c0 * LANES, &mut acc),
        3 => score_pass::<S, 3>(simd, q, k, c0 * LANES, &mut acc),
        2 => score_pass::<S, 2>(simd, q, k, c0 * LANES, &mut acc),
        _ => score_pass::<S, 1>(simd, q, k, c0 * LANES, &mut acc),
    });
    let s = simd.reduce_add_16(&acc);
    let full = full * LANES;
    if full == d {
        return s;
    }
    let mut tail = [0.0f32; LANES];
    for (t, row) in tail.iter_mut().zip(k) {
        for (x, y) in q[full..d].iter().zip(&row[full..d]) {
            *t = simd.mul_add_f32(*x, *y, *t);
        }
    }
    simd.add(s, simd.load(&tail))
}

/// Adds `C` vectors of the head, from element `off`, to every key's score accumulator. The
/// query vectors stay in registers and each row is sliced once to a constant length, so the
/// loads carry no bounds checks.
#[inline(always)]
fn score_pass<S: Simd, const C: usize>(
    simd: S,
    q: &[f32],
    k: &[&[f32]; LANES],
    off: usize,
    acc: &mut [S::V; LANES],
) {
    let q = &q[off..off + C * LANES];
    let mut qv = [simd.splat(0.0); C];
    for (c, qv) in qv.iter_mut().enumerate() {
        *qv = simd.load(&q[c * LANES..]);
    }
    for (acc, row) in acc.iter_mut().zip(k) {
        let row = &row[off..off + C * LANES];
        // A local accumulator: the array may live in memory, this stays in a register.
        let mut a = *acc;
        for (c, qv) in qv.iter().enumerate() {
            a = simd.mul_add(*qv, simd.load(&row[c * LANES..]), a);
        }
        *acc = a;
    }
}

/// A run of query vectors' output rows, probabilities and rescale factors, and the step's
/// `n` V rows, whose `d` elements of the run's kv head start at `head_at`.
struct PvRows<'s> {
    o: &'s mut [f32],
    p: &'s [f32],
    alpha: &'s [f32],
    v: &'s [&'s [f32]; STEP_KEYS],
    n: usize,
    head_at: usize,
    d: usize,
}

/// `o[r] = o[r] * alpha[r] + sum_j p[r][j] * V[j]` for `R` query vectors at once.
#[inline(always)]
fn pv_rows<S: Simd, const R: usize>(simd: S, mut rows: PvRows<'_>) {
    let full = rows.d / LANES;
    for_runs!(0, full, S::NARROW_CHUNKS, |c0, c| match c {
        4 => pv_pass::<S, R, 4>(simd, &mut rows, c0 * LANES),
        3 => pv_pass::<S, R, 3>(simd, &mut rows, c0 * LANES),
        2 => pv_pass::<S, R, 2>(simd, &mut rows, c0 * LANES),
        _ => pv_pass::<S, R, 1>(simd, &mut rows, c0 * LANES),
    });
    let PvRows {
        o,
        p,
        alpha,
        v,
        n,
        head_at,
        d,
    } = rows;
    let full = full * LANES;
    if full < d {
        for r in 0..R {
            let row = &mut o[r * d + full..(r + 1) * d];
            for x in row.iter_mut() {
                *x *= alpha[r];
            }
            for (j, vj) in v.iter().enumerate().take(n) {
                let pj = p[r * STEP_KEYS + j];
                for (x, &y) in row.iter_mut().zip(&vj[head_at + full..head_at + d]) {
                    *x = simd.mul_add_f32(pj, y, *x);
                }
            }
        }
    }
}

/// `C` vectors of `head_dim` (from element `off`) of `R` output rows, kept in `R * C`
/// registers across the step's keys: each V vector loaded feeds `R` independent FMA chains.
#[inline(always)]
fn pv_pass<S: Simd, const R: usize, const C: usize>(simd: S, rows: &mut PvRows<'_>, off: usize) {
    let (d, width) = (rows.d, C * LANES);
    let mut acc = [[simd.splat(0.0); C]; R];
    let mut p = [&[0.0f32; STEP_KEYS]; R];
    for (r, (acc, p)) in acc.iter_mut().zip(&mut p).enumerate() {
        let o = &rows.o[r * d + off..][..width];
        let alpha = simd.splat(rows.alpha[r]);
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = simd.mul(simd.load(&o[c * LANES..]), alpha);
        }
        *p = rows.p[r * STEP_KEYS..][..STEP_KEYS]
            .try_into()
            .expect("a probability row holds STEP_KEYS entries");
    }
    for (j, vj) in rows.v.iter().enumerate().take(rows.n.min(STEP_KEYS)) {
        let vj = &vj[rows.head_at + off..rows.head_at + off + width];
        let mut vv = [simd.splat(0.0); C];
        for (c, vv) in vv.iter_mut().enumerate() {
            *vv = simd.load(&vj[c * LANES..]);
        }
        for (acc, p) in acc.iter_mut().zip(&p) {
            let pj = simd.splat(p[j]);
            for (acc, vv) in acc.iter_mut().zip(&vv) {
                *acc = simd.mul_add(pj, *vv, *acc);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut rows.o[r * d + off..][..width];
        for (c, acc) in acc.iter().enumerate() {
            simd.store(&mut o[c * LANES..], *acc);
        }
    }
}
