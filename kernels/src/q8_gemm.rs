//! `out = x @ W` for Q8 weights ([`crate::q8`]): the activations are quantised per block of
//! 32, then every block is an exact int8 dot product in i32, scaled once in f32.
//!
//! The loop nest is the f32 GEMM's ([`crate::gemm`]): a register tile of `MR` rows × `NP`
//! panels over a run of `KB` blocks, whose weights (16 KiB per panel pair at most) stay in L1
//! while every row tile of the batch passes over them, so a step reads each weight byte from
//! memory once. Per group of 4 inputs the tile loads `NP` weight vectors and issues `MR * NP`
//! dot instructions; per block it widens `MR * NP` i32 accumulators to f32 and scales them.
//! VNNI runs 6 × 2 panels (24 accumulators of 32 zmm), AVX-512BW 4 × 2 (its dot takes more
//! temporaries), the portable build 2 × 1; AVX2 has a kernel of its own on i16
//! ([`crate::q8_avx2`]), 4 × 1.
//!
//! While a tile computes, it prefetches its share of the next panels' lines into L2, a few
//! per block (batch 8 1.3-1.5x, batch 32 1.1-1.2x on both ISAs).
//!
//! Threads split the panels as the f32 GEMM does; the activations are quantised first, on the
//! pool when there are many rows (a prefill chunk).

use std::cell::RefCell;

use crate::pool;
use crate::q8::{quantize_row, Q8Panels, QActs, QLayout, GROUPS, GROUP_INPUTS, Q8_BLOCK};
#[cfg(target_arch = "x86_64")]
use crate::q8_avx2::PairKernel;
use crate::q8_simd::{QDot, QIsa, QPortable};
#[cfg(target_arch = "x86_64")]
use crate::q8_simd_x86::{QAvx512Bw, QVnni};
use crate::q8_tile::{QTile, TileKernel};
use crate::simd::LANES;

/// Blocks per run: 24 blocks of two panels' weights (24 KiB) stay in L1.
const KB: usize = 24;
/// Rows per block: `MC` rows of a run's activations (96 KiB) stay in L2.
const MC: usize = 128;
/// As in the f32 GEMM: below this many multiply-adds a fork-join costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 16;
/// From this many multiply-adds a product is cut finer than one task per thread.
const BALANCED_MIN_MACS: usize = 1 << 24;
/// Activations from which quantising them is worth the pool.
const PARALLEL_QUANT_MIN: usize = 1 << 16;

thread_local! {
    /// The quantised activations, reused across calls: a fresh buffer of a prefill chunk's
    /// size would be page-faulted in on every call.
    static ACTS: RefCell<QActs> = RefCell::new(QActs::default());
}

/// `out[m, n] (+)= x[m, k] @ W[k, n]` for Q8 weights; lengths checked by the caller, `m`,
/// `n` and `k` non-zero.
pub(crate) fn q8_matmul(isa: QIsa, x: &[f32], m: usize, w: &Q8Panels, out: &mut [f32], add: bool) {
    ACTS.with(|acts| match acts.try_borrow_mut() {
        Ok(mut acts) => run_job(isa, x, m, w, out, add, &mut acts),
        // Only if a product were started from inside another on the same thread.
        Err(_) => run_job(isa, x, m, w, out, add, &mut QActs::default()),
    })
}

fn run_job(
    isa: QIsa,
    x: &[f32],
    m: usize,
    w: &Q8Panels,
    out: &mut [f32],
    add: bool,
    acts: &mut QActs,
) {
    let (k, n, blocks) = (w.k, w.n, w.blocks);
    // A mismatch would not fault, only give wrong sums.
    assert_eq!(
        w.layout,
        isa.layout(),
        "Q8 weights packed for another kernel"
    );
    quantize(isa, x, m, k, blocks, w.layout == QLayout::Pairs, acts);
    let job = Job {
        a: acts.q.as_ptr(),
        a16: acts.q16.as_ptr(),
        a_scale: acts.scale.as_ptr(),
        a_comp: acts.comp.as_ptr(),
        m,
        n,
        blocks,
        w: w.groups.as_ptr().cast(),
        w_scale: w.scales.as_ptr(),
        out: OutPtr(out.as_mut_ptr()),
        add,
    };
    let panels = n.div_ceil(LANES);
    let threads = pool::threads();
    let macs = m * k * n;
    let tasks = if macs < PARALLEL_MIN_MACS {
        1
    } else if macs < BALANCED_MIN_MACS {
        threads.min(panels)
    } else {
        (threads * 4).min(panels.div_ceil(2))
    };
    // Whole pairs of panels per task, so two-panel tiles stay whole.
    let per_task = panels.div_ceil(tasks).next_multiple_of(2);
    let run = |t: usize| {
        let p0 = (t * per_task).min(panels);
        let p1 = ((t + 1) * per_task).min(panels);
        // SAFETY: tasks own disjoint panel ranges, so disjoint columns of `out`; the
        // activations hold m rows of `blocks` blocks, `w` has `panels` panels of `blocks`
        // blocks, `out` m * n elements (checked by the caller); `isa` is this CPU's or below.
        unsafe { run_task(isa, &job, p0, p1) };
    };
    if tasks == 1 {
        run(0);
    } else {
        pool::run(tasks, &run);
    }
}

/// Quantises the `m` rows of `x` into `acts` (widened to i16 too where `wide`: each row
/// while it is in cache), on the pool when there are many.
fn quantize(isa: QIsa, x: &[f32], m: usize, k: usize, blocks: usize, wide: bool, acts: &mut QActs) {
    acts.resize(m, blocks, wide);
    let row_bytes = blocks * Q8_BLOCK;
    if m * k < PARALLEL_QUANT_MIN || m < 2 {
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let q = &mut acts.q[r * row_bytes..(r + 1) * row_bytes];
            quantize_row_on(
                isa,
                xr,
                q,
                &mut acts.scale[r * blocks..(r + 1) * blocks],
                &mut acts.comp[r * blocks..(r + 1) * blocks],
            );
            if wide {
                widen_row(q, &mut acts.q16[r * row_bytes..(r + 1) * row_bytes]);
            }
        }
        return;
    }
    let tasks = pool::threads().min(m);
    let per = m.div_ceil(tasks);
    let (q, scale, comp, q16) = (
        SyncPtr(acts.q.as_mut_ptr()),
        SyncPtr(acts.scale.as_mut_ptr()),
        SyncPtr(acts.comp.as_mut_ptr()),
        SyncPtr(acts.q16.as_mut_ptr()),
    );
    pool::run(tasks, &|t| {
        let rows = (t * per).min(m)..((t + 1) * per).min(m);
        for r in rows {
            // SAFETY: each task owns rows `t * per..`, disjoint slices of the four buffers,
            // which `resize` sized for m rows (`q16` only where `wide`); the caller holds
            // `&mut acts` throughout.
            unsafe {
                let qr = std::slice::from_raw_parts_mut(q.get().add(r * row_bytes), row_bytes);
                quantize_row_on(
                    isa,
                    &x[r * k..(r + 1) * k],
                    qr,
                    std::slice::from_raw_parts_mut(scale.get().add(r * blocks), blocks),
                    std::slice::from_raw_parts_mut(comp.get().add(r * blocks), blocks),
                );
                if wide {
                    let wr =
                        std::slice::from_raw_parts_mut(q16.get().add(r * row_bytes), row_bytes);
                    widen_row(qr, wr);
                }
            };
        }
    });
}

/// One row of quantised activations, widened for the [`QLayout::Pairs`] kernel.
fn widen_row(q: &[i8], q16: &mut [i16]) {
    for (w, &v) in q16.iter_mut().zip(q) {
        *w = i16::from(v);
    }
}

/// [`quantize_row`] compiled for `isa`, so that its max and rounding loops vectorise.
fn quantize_row_on(isa: QIsa, x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    match isa {
        // SAFETY (both arms): `isa` is this CPU's or one it runs.
        #[cfg(target_arch = "x86_64")]
        QIsa::Vnni | QIsa::Avx512Bw => unsafe { quantize_row_avx512(x, q, scale, comp) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx2 => unsafe { quantize_row_avx2(x, q, scale, comp) },
        _ => quantize_row(x, q, scale, comp),
    }
}

/// # Safety
/// The CPU must support AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn quantize_row_avx512(x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    quantize_row(x, q, scale, comp)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    quantize_row(x, q, scale, comp)
}

/// A buffer that several tasks write at disjoint places.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);

impl<T> SyncPtr<T> {
    /// A method, so closures capture the whole (`Sync`) wrapper rather than its raw field.
    fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the tasks write disjoint rows (see `quantize`).
unsafe impl<T> Sync for SyncPtr<T> {}

/// What every task of one product shares.
struct Job {
    /// Quantised activations: row `r` at `a + r * blocks * 32`.
    a: *const i8,
    /// The same widened to i16 for [`QLayout::Pairs`]; dangling otherwise.
    a16: *const i16,
    a_scale: *const f32,
    a_comp: *const i32,
    m: usize,
    n: usize,
    blocks: usize,
    /// Panel `p`, block `b` starts at `w + (p * blocks + b) * 512`.
    w: *const u8,
    /// Panel `p`, block `b` at `w_scale + (p * blocks + b) * 16`.
    w_scale: *const u16,
    out: OutPtr,
    add: bool,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the tasks of one product write disjoint columns of `out` (their own panels) and only
// read the rest; the caller holds `&mut out`, the activations and `&W` for the whole product.
unsafe impl Sync for Job {}

/// # Safety
/// Panels `p0..p1` are this task's alone; the job's buffers are as documented; the CPU runs
/// `isa`.
unsafe fn run_task(isa: QIsa, job: &Job, p0: usize, p1: usize) {
    match isa {
        // SAFETY (each arm): the caller's contract.
        #[cfg(target_arch = "x86_64")]
        QIsa::Vnni => unsafe { task_vnni(job, p0, p1) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx512Bw => unsafe { task_avx512bw(job, p0, p1) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx2 => unsafe { task_avx2(job, p0, p1) },
        _ => unsafe { task(Quads::<QPortable, 1, 2>(QPortable), job, p0, p1) },
    }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX-512F/BW and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn task_vnni(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { task(Quads::<_, 2, 6>(QVnni::new_unchecked()), job, p0, p1) }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn task_avx512bw(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { task(Quads::<_, 2, 4>(QAvx512Bw::new_unchecked()), job, p0, p1) }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { task(PairKernel::new_unchecked(), job, p0, p1) }
}

/// The kernels on [`QLayout::Quads`], one per [`QDot`].
#[derive(Clone, Copy)]
struct Quads<D, const NP: usize, const MR: usize>(D);

impl<D: QDot, const NP: usize, const MR: usize> TileKernel for Quads<D, NP, MR> {
    const NP: usize = NP;
    const MR: usize = MR;
    const LONE_TILE_PREFETCH: bool = false;

    #[inline(always)]
    unsafe fn tile(self, t: &QTile, rows: usize, panels: usize) {
        // SAFETY (both): the caller's contract.
        unsafe {
            if panels == NP {
                tile_rows::<D, NP, MR>(self.0, t, rows)
            } else {
                tile_rows::<D, 1, MR>(self.0, t, rows)
            }
        }
    }
}

/// One task: panels `p0..p1` for every row, in runs of `KB` blocks and `MC` rows.
///
/// # Safety
/// As [`run_task`].
#[inline(always)]
unsafe fn task<K: TileKernel>(kernel: K, job: &Job, p0: usize, p1: usize) {
    let (m, n, blocks) = (job.m, job.n, job.blocks);
    let lda = blocks * Q8_BLOCK;
    let panel_bytes = blocks * Q8_BLOCK * LANES;
    let mut b0 = 0;
    while b0 < blocks {
        let nb = KB.min(blocks - b0);
        let mut mb = 0;
        while mb < m {
            let mc = MC.min(m - mb);
            // As in the f32 GEMM: the first row tile reads this run of the panels from
            // memory and the rest from L1, so every tile fetches a share of the next panels'
            // lines into L2 while it computes, instead of the next first tile stalling on
            // them all. Rows are dealt evenly (a short tile has too few chains in flight).
            // Worked out once per row block, not per tile: a batch-1 tile on VNNI is only 16
            // dot instructions a block, and a few divisions would be a visible share of it.
            let tiles = mc.div_ceil(K::MR);
            let (base, extra) = (mc / tiles, mc % tiles);
            let lines = nb * Q8_BLOCK * LANES / 64;
            let share = lines.div_ceil(tiles);
            let per_block = share.div_ceil(nb);
            let mut p = p0;
            while p < p1 {
                let np = K::NP.min(p1 - p);
                let cols = (n - p * LANES).min(np * LANES);
                let next = if p + np < p1 && (tiles > 1 || K::LONE_TILE_PREFETCH) {
                    job.w
                        .wrapping_add((p + np) * panel_bytes + b0 * Q8_BLOCK * LANES)
                } else {
                    std::ptr::null()
                };
                let mut r = mb;
                for tile in 0..tiles {
                    let rows = base + usize::from(tile < extra);
                    let pf_lines = share.min(lines.saturating_sub(tile * share));
                    // SAFETY (the pointers): r < m, b0 < blocks, p < panels: all in bounds.
                    let t = unsafe {
                        QTile {
                            a: job.a.add(r * lda + b0 * Q8_BLOCK),
                            a16: job.a16.wrapping_add(r * lda + b0 * Q8_BLOCK),
                            lda,
                            a_scale: job.a_scale.add(r * blocks + b0),
                            a_comp: job.a_comp.add(r * blocks + b0),
                            ldb: blocks,
                            w: job.w.add(p * panel_bytes + b0 * Q8_BLOCK * LANES),
                            w_scale: job.w_scale.add((p * blocks + b0) * LANES),
                            panel_bytes,
                            panel_scales: blocks * LANES,
                            nb,
                            c: job.out.0.add(r * n + p * LANES),
                            ldc: n,
                            cols,
                            accumulate: b0 > 0 || job.add,
                            pf: if next.is_null() || pf_lines == 0 {
                                std::ptr::null()
                            } else {
                                next.wrapping_add(tile * share * 64)
                            },
                            pf_per_block: per_block,
                            pf_lines,
                        }
                    };
                    // SAFETY: the tile lies inside the activations, W and this task's columns.
                    unsafe { kernel.tile(&t, rows, np) };
                    r += rows;
                }
                p += np;
            }
            mb += mc;
        }
        b0 += nb;
    }
}

/// The micro-kernel for `rows` (1..=MAX) rows, as a const generic so the accumulators are a
/// fixed set of registers.
///
/// # Safety
/// As [`micro`].
#[inline(always)]
unsafe fn tile_rows<D: QDot, const NP: usize, const MAX: usize>(d: D, t: &QTile, rows: usize) {
    // SAFETY (both): the caller's contract.
    unsafe {
        if t.pf.is_null() {
            tile_rows_pf::<D, NP, MAX, false>(d, t, rows)
        } else {
            tile_rows_pf::<D, NP, MAX, true>(d, t, rows)
        }
    }
}

/// [`tile_rows`] with or without prefetches.
///
/// # Safety
/// As [`micro`].
#[inline(always)]
unsafe fn tile_rows_pf<D: QDot, const NP: usize, const MAX: usize, const PF: bool>(
    d: D,
    t: &QTile,
    rows: usize,
) {
    // SAFETY (every arm): the caller's contract, for `rows` rows.
    unsafe {
        match rows {
            1 => micro::<D, NP, 1, PF>(d, t),
            2 if MAX >= 2 => micro::<D, NP, 2, PF>(d, t),
            3 if MAX >= 3 => micro::<D, NP, 3, PF>(d, t),
            4 if MAX >= 4 => micro::<D, NP, 4, PF>(d, t),
            5 if MAX >= 5 => micro::<D, NP, 5, PF>(d, t),
            6 if MAX >= 6 => micro::<D, NP, 6, PF>(d, t),
            _ => unreachable!("{rows} rows in a tile of at most {MAX}"),
        }
    }
}

/// `c[MR, NP * 16] (+)= a[MR, nb blocks] @ w[nb blocks, NP * 16]`.
///
/// # Safety
/// `a` must be readable for `MR` rows of `nb * 32` bytes at stride `lda`, `a_scale` and
/// `a_comp` for `MR` rows of `nb` at stride `ldb`; `w` for `nb` blocks in each of `NP` panels
/// `panel_bytes` apart (scales likewise); `c` writable for `MR` rows of `cols` at stride `ldc`.
#[inline(always)]
unsafe fn micro<D: QDot, const NP: usize, const MR: usize, const PF: bool>(d: D, t: &QTile) {
    let mut acc = [[d.zero_f(); NP]; MR];
    if t.accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (q, v) in row.iter_mut().enumerate() {
                // SAFETY: the caller's contract for c.
                *v = unsafe { load_c(d, t.c.add(r * t.ldc + q * LANES), t.cols, q) };
            }
        }
    }
    for b in 0..t.nb {
        if PF {
            t.prefetch(b, NP);
        }
        let mut sw = [d.zero_f(); NP];
        for (q, s) in sw.iter_mut().enumerate() {
            // SAFETY: the caller's contract for the weights' scales.
            *s = unsafe { d.load_scales(t.w_scale.add(q * t.panel_scales + b * LANES)) };
        }
        let mut dots = [[d.seed(0); NP]; MR];
        for (r, row) in dots.iter_mut().enumerate() {
            // SAFETY: the caller's contract for a_comp.
            let comp = unsafe { *t.a_comp.add(r * t.ldb + b) };
            *row = [d.seed(comp); NP];
        }
        for g in 0..GROUPS {
            let at = (b * GROUPS + g) * GROUP_INPUTS * LANES;
            // SAFETY (both): the caller's contract for w; groups are 64-byte aligned.
            let mut wv = [unsafe { d.load_group(t.w.add(at)) }; NP];
            for (q, v) in wv.iter_mut().enumerate().skip(1) {
                *v = unsafe { d.load_group(t.w.add(q * t.panel_bytes + at)) };
            }
            for (r, row) in dots.iter_mut().enumerate() {
                // SAFETY: the caller's contract for a: 4 bytes of row r, block b, group g.
                let a = unsafe {
                    std::ptr::read_unaligned(
                        t.a.add(r * t.lda + b * Q8_BLOCK + g * GROUP_INPUTS)
                            .cast::<i32>(),
                    )
                };
                for (v, w) in row.iter_mut().zip(&wv) {
                    *v = d.dot(*v, *w, a);
                }
            }
        }
        for (r, (row, dots)) in acc.iter_mut().zip(&dots).enumerate() {
            // SAFETY: the caller's contract for a_scale.
            let sa = unsafe { *t.a_scale.add(r * t.ldb + b) };
            for ((v, dot), s) in row.iter_mut().zip(dots).zip(&sw) {
                *v = d.fold(*v, *dot, *s, sa);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, v) in row.iter().enumerate() {
            // SAFETY: the caller's contract for c.
            unsafe { store_c(d, t.c.add(r * t.ldc + q * LANES), t.cols, q, *v) };
        }
    }
}

/// Vector `q` of a tile row at `c`, of which `cols` columns exist; the rest read as zero.
///
/// # Safety
/// `c` must be readable for `min(cols - q * 16, 16)` f32.
#[inline(always)]
unsafe fn load_c<D: QDot>(d: D, c: *const f32, cols: usize, q: usize) -> D::F {
    let live = cols.saturating_sub(q * LANES);
    if live >= LANES {
        // SAFETY: 16 columns exist.
        unsafe { d.load_f(c) }
    } else {
        let mut buf = [0.0f32; LANES];
        // SAFETY: `live` columns exist; `buf` holds 16.
        unsafe {
            std::ptr::copy_nonoverlapping(c, buf.as_mut_ptr(), live);
            d.load_f(buf.as_ptr())
        }
    }
}

/// Writes vector `q` of a tile row at `c`, only the `cols` columns that exist.
///
/// # Safety
/// `c` must be writable for `min(cols - q * 16, 16)` f32.
#[inline(always)]
unsafe fn store_c<D: QDot>(d: D, c: *mut f32, cols: usize, q: usize, v: D::F) {
    let live = cols.saturating_sub(q * LANES);
    if live >= LANES {
        // SAFETY: 16 columns exist.
        unsafe { d.store_f(c, v) }
    } else if live > 0 {
        let mut buf = [0.0f32; LANES];
        // SAFETY: `buf` holds 16; `live` columns exist.
        unsafe {
            d.store_f(buf.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), c, live);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PackedWeight;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    /// The simplest statement of the product: each activation row quantised per 32 (scale
    /// `max|x| / 127`, ties to even), then `sum over blocks of (sum q_x * q_w) * s_x * s_w`
    /// in f64 over the dequantised weights. Also returns the sum of the terms' magnitudes,
    /// which bounds the f32 rounding the kernels may add.
    fn reference(x: &[f32], m: usize, w: &PackedWeight) -> (Vec<f64>, Vec<f64>) {
        let (k, n) = (w.k(), w.n());
        let mut out = vec![0f64; m * n];
        let mut mag = vec![0f64; m * n];
        for r in 0..m {
            for b0 in (0..k).step_by(32) {
                let block = &x[r * k + b0..r * k + (b0 + 32).min(k)];
                let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                for j in 0..n {
                    let mut s = 0f64;
                    for (i, v) in block.iter().enumerate() {
                        let q = f64::from((v * inv).round_ties_even());
                        s += q * f64::from(d) * f64::from(w.get(b0 + i, j));
                    }
                    out[r * n + j] += s;
                    mag[r * n + j] += s.abs();
                }
            }
        }
        (out, mag)
    }

    fn check(m: usize, k: usize, n: usize, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let packed = PackedWeight::from_out_in_int8(&w, n, k).expect("pack");
        let crate::packed::Panels::Q8(q) = packed.data() else {
            panic!("int8 weights packed as another dtype");
        };
        let (want, mag) = reference(&x, m, &packed);
        let base: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        for isa in QIsa::available() {
            for add in [false, true] {
                let mut out = if add {
                    base.clone()
                } else {
                    vec![f32::NAN; m * n]
                };
                q8_matmul(isa, &x, m, &q.with_layout(isa.layout()), &mut out, add);
                for (i, g) in out.iter().enumerate() {
                    let w = want[i] + if add { f64::from(base[i]) } else { 0.0 };
                    let tol = 2e-6 * (mag[i] + 1.0);
                    assert!(
                        (f64::from(*g) - w).abs() <= tol,
                        "{isa:?} add={add} {m}x{k}x{n} at {i}: {g} vs {w}"
                    );
                }
            }
        }
        // And the whole thing approximates the f32 product: about 0.5% of its size here.
        let mut out = vec![0f32; m * n];
        crate::packed_matmul(&x, m, &packed, &mut out).expect("shapes");
        let (mut err, mut norm) = (0f64, 0f64);
        for r in 0..m {
            for j in 0..n {
                let exact: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i]))
                    .sum();
                err += (f64::from(out[r * n + j]) - exact).powi(2);
                norm += exact.powi(2);
            }
        }
        assert!(
            err <= 1e-4 * norm + 1e-9,
            "{m}x{k}x{n}: error {err} of {norm}"
        );
    }

    #[test]
    fn model_shapes_and_edges() {
        for (m, k, n) in [
            (1, 576, 960),
            (32, 576, 192),
            (3, 64, 33),
            (7, 1536, 48),
            (13, 31, 16),
            (6, 33, 17),
            (1, 1, 1),
            (2, 800, 64),
            (130, 40, 48),
        ] {
            check(m, k, n, (m * 1000 + k + n) as u64);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_shapes_match_the_reference(
            m in 1usize..40, k in 1usize..300, n in 1usize..100, seed in any::<u64>()
        ) {
            check(m, k, n, seed);
        }
    }

    #[test]
    fn many_rows_quantise_on_the_pool() {
        // m * k past PARALLEL_QUANT_MIN: the activations are quantised by several tasks.
        check(300, 256, 20, 7);
    }

    #[test]
    fn zero_rows_and_extreme_values() {
        let (m, k, n) = (3, 64, 16);
        let mut x = vec![0f32; m * k];
        x[k..2 * k].fill(1e30);
        x[2 * k..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = if i % 2 == 0 { -3.0 } else { 3.0 });
        let w = vec![0.25f32; n * k];
        let packed = PackedWeight::from_out_in_int8(&w, n, k).expect("pack");
        let mut out = vec![f32::NAN; m * n];
        crate::packed_matmul(&x, m, &packed, &mut out).expect("shapes");
        assert!(out[..n].iter().all(|&v| v == 0.0));
        // The f16 weight scale is within 2^-11 of 0.25 / 127.
        assert!(out[n..2 * n]
            .iter()
            .all(|&v| (v / (64.0 * 0.25e30) - 1.0).abs() < 1e-3));
        assert!(out[2 * n..].iter().all(|&v| v == 0.0));
    }
}
