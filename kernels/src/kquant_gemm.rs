//! `out = x @ W` for weights kept in their GGUF block types ([`crate::kquant`]).
//!
//! The activations are quantised per 32 inputs as for the Q8 GEMM ([`crate::q8::quantize_row`],
//! llama.cpp's q8_0), with the sums of each 16 inputs beside them. A 32-input block of one
//! column is then `s * (dot(u, q) - z * sum(q)) - mn * sum(q)`, all scaled by the activations'
//! scale: the dot product and the zero point are exact in i32 (the zero point seeds the
//! accumulator), the scale and min are one f32 multiply-add each per block.
//!
//! The loop nest is the Q8 GEMM's: a register tile of `MR` rows × `NP` panels over a run of
//! `KB` blocks, whose records stay in L1 while every row tile of the batch passes over them.
//! Each group of weights is unpacked from its nibbles (and top bits) once per tile and used by
//! every row of it, so a batched step or a prefill unpacks each panel once per `MR` rows, not
//! once per row. Threads split the panels, per segment of one block type.

use std::cell::RefCell;

use crate::error::KernelError;
use crate::kquant::{KQuantType, KQuantWeight, KSegment};
#[cfg(target_arch = "x86_64")]
use crate::kquant_simd::{KAvx2, KAvx512Bw, KVnni};
use crate::kquant_simd::{KDot, KPortable};
use crate::pool;
use crate::q8::{quantize_row, GROUPS, GROUP_INPUTS, Q8_BLOCK};
use crate::q8_simd::QIsa;
use crate::simd::LANES;

// The weight's own entry points live beside the GEMM they run, so the weight's file
// (layout, decoding) does not import the kernels.
impl KQuantWeight {
    /// `out[m, n] = x[m, k] @ W` (or `+=` with `add`), on the best kernel this CPU runs.
    pub fn matmul(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        add: bool,
    ) -> Result<(), KernelError> {
        self.matmul_on(QIsa::detect(), x, m, out, add)
    }

    /// [`matmul`](Self::matmul) on a given instruction set (this CPU's or one it implies).
    pub(crate) fn matmul_on(
        &self,
        isa: QIsa,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        add: bool,
    ) -> Result<(), KernelError> {
        for (what, expected, given) in [
            ("x", m * self.k(), x.len()),
            ("out", m * self.n(), out.len()),
        ] {
            if expected != given {
                return Err(KernelError::BadLength {
                    what,
                    expected,
                    given,
                });
            }
        }
        if m > 0 {
            kquant_matmul(isa, x, m, self, out, add);
        }
        Ok(())
    }
}

/// Blocks per run: 24 records of two panels (at most 21 KiB) stay in L1.
const KB: usize = 24;
/// Rows per block of the batch.
const MC: usize = 128;
/// As in the Q8 GEMM: below this many multiply-adds a fork-join costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 16;
/// From this many a product is cut finer than one task per thread.
const BALANCED_MIN_MACS: usize = 1 << 24;
/// Activations from which quantising them is worth the pool.
const PARALLEL_QUANT_MIN: usize = 1 << 16;

/// `m` rows of activations quantised per 32 inputs.
#[derive(Default)]
struct KActs {
    q: Vec<i8>,
    /// Row `r`, block `b` at `r * blocks + b`.
    scale: Vec<f32>,
    /// The sums of `q` per 16 inputs: row `r`, block `b`, half `h` at `(r * blocks + b) * 2 + h`.
    sum16: Vec<i32>,
    /// `scale * sum(q)` per block, what a min multiplies.
    msum: Vec<f32>,
    /// Scratch for `quantize_row`'s compensation, unused here.
    comp: Vec<i32>,
}

thread_local! {
    static ACTS: RefCell<KActs> = RefCell::new(KActs::default());
}

/// `out[m, n] (+)= x[m, k] @ W[k, n]`; lengths checked by the caller, `m` non-zero.
pub(crate) fn kquant_matmul(
    isa: QIsa,
    x: &[f32],
    m: usize,
    w: &KQuantWeight,
    out: &mut [f32],
    add: bool,
) {
    ACTS.with(|acts| match acts.try_borrow_mut() {
        Ok(mut acts) => run(isa, x, m, w, out, add, &mut acts),
        Err(_) => run(isa, x, m, w, out, add, &mut KActs::default()),
    })
}

fn run(
    isa: QIsa,
    x: &[f32],
    m: usize,
    w: &KQuantWeight,
    out: &mut [f32],
    add: bool,
    acts: &mut KActs,
) {
    quantize(isa, x, m, w.k, w.blocks, acts);
    for seg in &w.segments {
        let job = Job {
            a: acts.q.as_ptr(),
            a_scale: acts.scale.as_ptr(),
            sum16: acts.sum16.as_ptr(),
            msum: acts.msum.as_ptr(),
            m,
            blocks: w.blocks,
            ldc: w.n,
            seg,
            out: out.as_mut_ptr(),
            add,
        };
        let panels = seg.n.div_ceil(LANES);
        let threads = pool::threads();
        let macs = m * w.k * seg.n;
        let tasks = if macs < PARALLEL_MIN_MACS {
            1
        } else if macs < BALANCED_MIN_MACS {
            threads.min(panels)
        } else {
            (threads * 4).min(panels.div_ceil(2))
        };
        let per_task = panels.div_ceil(tasks).next_multiple_of(2);
        let job = &job;
        let one = |t: usize| {
            let p0 = (t * per_task).min(panels);
            let p1 = ((t + 1) * per_task).min(panels);
            // SAFETY: tasks own disjoint panels, so disjoint columns of `out`; the buffers
            // are sized as `Job` documents (checked by the caller); `isa` is this CPU's.
            unsafe { run_task(isa, job, p0, p1) };
        };
        if tasks == 1 {
            one(0);
        } else {
            pool::run(tasks, &one);
        }
    }
}

/// Quantises the rows of `x` into `acts`, on the pool when there are many.
fn quantize(isa: QIsa, x: &[f32], m: usize, k: usize, blocks: usize, acts: &mut KActs) {
    let row = blocks * Q8_BLOCK;
    acts.q.clear();
    acts.q.resize(m * row, 0);
    for v in [&mut acts.scale, &mut acts.msum] {
        v.clear();
        v.resize(m * blocks, 0.0);
    }
    acts.sum16.clear();
    acts.sum16.resize(m * blocks * 2, 0);
    acts.comp.clear();
    acts.comp.resize(m * blocks, 0);
    let ptrs = RowPtrs {
        q: acts.q.as_mut_ptr(),
        scale: acts.scale.as_mut_ptr(),
        sum16: acts.sum16.as_mut_ptr(),
        msum: acts.msum.as_mut_ptr(),
        comp: acts.comp.as_mut_ptr(),
    };
    let one = |r: usize| {
        let ptrs = ptrs.whole();
        // SAFETY: row `r` of each buffer, sized above for m rows; each row is written by one
        // task only, and the caller holds `&mut acts` throughout.
        unsafe {
            let q = std::slice::from_raw_parts_mut(ptrs.q.add(r * row), row);
            let scale = std::slice::from_raw_parts_mut(ptrs.scale.add(r * blocks), blocks);
            let comp = std::slice::from_raw_parts_mut(ptrs.comp.add(r * blocks), blocks);
            let sum16 = std::slice::from_raw_parts_mut(ptrs.sum16.add(r * blocks * 2), blocks * 2);
            let msum = std::slice::from_raw_parts_mut(ptrs.msum.add(r * blocks), blocks);
            quantize_row_on(isa, &x[r * k..(r + 1) * k], q, scale, comp);
            for (b, qb) in q.chunks_exact(Q8_BLOCK).enumerate() {
                let lo: i32 = qb[..16].iter().map(|&v| i32::from(v)).sum();
                let hi: i32 = qb[16..].iter().map(|&v| i32::from(v)).sum();
                sum16[2 * b] = lo;
                sum16[2 * b + 1] = hi;
                msum[b] = scale[b] * (lo + hi) as f32;
            }
        }
    };
    if m * k < PARALLEL_QUANT_MIN || m < 2 {
        (0..m).for_each(one);
    } else {
        let tasks = pool::threads().min(m);
        let per = m.div_ceil(tasks);
        pool::run(tasks, &|t| (t * per..((t + 1) * per).min(m)).for_each(one));
    }
}

/// The activation buffers, written by several tasks at disjoint rows.
#[derive(Clone, Copy)]
struct RowPtrs {
    q: *mut i8,
    scale: *mut f32,
    sum16: *mut i32,
    msum: *mut f32,
    comp: *mut i32,
}

// SAFETY: the tasks of `quantize` write disjoint rows.
unsafe impl Sync for RowPtrs {}

impl RowPtrs {
    /// A method, so closures capture the whole (`Sync`) struct rather than its raw fields.
    fn whole(&self) -> RowPtrs {
        *self
    }
}

/// [`quantize_row`] compiled for `isa`, so that its loops vectorise.
fn quantize_row_on(isa: QIsa, x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    match isa {
        // SAFETY (both arms): `isa` is this CPU's or one it runs.
        #[cfg(target_arch = "x86_64")]
        QIsa::Vnni | QIsa::Avx512Bw => unsafe { quantize_avx512(x, q, scale, comp) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx2 => unsafe { quantize_avx2(x, q, scale, comp) },
        _ => quantize_row(x, q, scale, comp),
    }
}

/// # Safety
/// The CPU must support AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn quantize_avx512(x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    quantize_row(x, q, scale, comp)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    quantize_row(x, q, scale, comp)
}

/// What every task of one segment's product shares.
struct Job<'a> {
    a: *const i8,
    a_scale: *const f32,
    sum16: *const i32,
    msum: *const f32,
    m: usize,
    blocks: usize,
    /// Row stride of `out`: the whole weight's outputs.
    ldc: usize,
    seg: &'a KSegment,
    out: *mut f32,
    add: bool,
}

// SAFETY: the tasks write disjoint columns of `out` and only read the rest.
unsafe impl Sync for Job<'_> {}

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
        _ => unsafe { by_type::<_, 2, 2>(KPortable, job, p0, p1) },
    }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX-512F/BW, VNNI, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn task_vnni(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { by_type::<_, 6, 4>(KVnni::new_unchecked(), job, p0, p1) }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX-512F/BW, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn task_avx512bw(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { by_type::<_, 4, 4>(KAvx512Bw::new_unchecked(), job, p0, p1) }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(job: &Job, p0: usize, p1: usize) {
    // SAFETY: this function's contract. Two ymm per vector: half the rows.
    unsafe { by_type::<_, 3, 2>(KAvx2::new_unchecked(), job, p0, p1) }
}

/// The task instantiated for the segment's block type: `MR` rows a tile, `MR2` where each
/// row holds two sub-block accumulators (Q6_K).
///
/// # Safety
/// As [`run_task`].
#[inline(always)]
unsafe fn by_type<D: KDot, const MR: usize, const MR2: usize>(
    d: D,
    job: &Job,
    p0: usize,
    p1: usize,
) {
    // SAFETY (each arm): the caller's contract.
    unsafe {
        match job.seg.ty {
            KQuantType::Q4_0 => task::<D, MR, 0, 1, false>(d, job, p0, p1),
            KQuantType::Q5_0 => task::<D, MR, 1, 1, false>(d, job, p0, p1),
            KQuantType::Q4K => task::<D, MR, 0, 1, true>(d, job, p0, p1),
            KQuantType::Q5K => task::<D, MR, 1, 1, true>(d, job, p0, p1),
            KQuantType::Q6K => task::<D, MR2, 2, 2, false>(d, job, p0, p1),
        }
    }
}

/// Two panels a tile.
const NP: usize = 2;

/// One micro-tile's operands, each at its first row, block and panel.
struct KTile {
    a: *const i8,
    lda: usize,
    a_scale: *const f32,
    sum16: *const i32,
    msum: *const f32,
    /// Stride of `a_scale` and `msum` (and half that of `sum16`).
    ldb: usize,
    w: *const u8,
    panel_bytes: usize,
    nb: usize,
    zero: i32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    accumulate: bool,
    /// Whether this tile prefetches the blocks [`PF`] ahead (the first of its row block).
    prefetch: bool,
}

/// Blocks ahead a tile prefetches, into L1: a batch-1 product streaming whole columns ran
/// 1.6x slower without it, 1.1x with the L2 hint, the same 16 ahead (history
/// 2026-11-29-kquant-b1).
const PF: usize = 8;

/// Asks for the line at `p` in L1 (any address: a prefetch cannot fault).
#[inline(always)]
fn prefetch_l1(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One task: panels `p0..p1` of the segment for every row, in runs of `KB` blocks and `MC`
/// rows.
///
/// # Safety
/// As [`run_task`].
#[inline(always)]
unsafe fn task<D: KDot, const MR: usize, const HB: usize, const SUB: usize, const MIN: bool>(
    d: D,
    job: &Job,
    p0: usize,
    p1: usize,
) {
    let (m, blocks, seg) = (job.m, job.blocks, job.seg);
    let lda = blocks * Q8_BLOCK;
    let panel_bytes = seg.ty.panel_bytes(blocks);
    debug_assert!(KB.is_multiple_of(seg.ty.group()) && blocks.is_multiple_of(seg.ty.group()));
    // A batch of one tile reuses nothing from L1: it reads each column's blocks in one run,
    // so a task streams its panels front to back (1.2x at batch 1, measured: history
    // 2026-11-29-kquant-b1).
    let kb = if m <= MR { blocks } else { KB };
    let mut b0 = 0;
    while b0 < blocks {
        let nb = kb.min(blocks - b0);
        let mut mb = 0;
        while mb < m {
            let mc = MC.min(m - mb);
            let tiles = mc.div_ceil(MR);
            let (base, extra) = (mc / tiles, mc % tiles);
            let mut p = p0;
            while p < p1 {
                let np = NP.min(p1 - p);
                let cols = (seg.n - p * LANES).min(np * LANES);
                let mut r = mb;
                for tile in 0..tiles {
                    let rows = base + usize::from(tile < extra);
                    // SAFETY (the pointers): r < m, b0 < blocks, p < panels.
                    let t = unsafe {
                        KTile {
                            a: job.a.add(r * lda + b0 * Q8_BLOCK),
                            lda,
                            a_scale: job.a_scale.add(r * blocks + b0),
                            sum16: job.sum16.add((r * blocks + b0) * 2),
                            msum: job.msum.add(r * blocks + b0),
                            ldb: blocks,
                            w: seg
                                .data
                                .as_ptr()
                                .add(p * panel_bytes + seg.ty.offsets(b0).0),
                            panel_bytes,
                            nb,
                            zero: seg.ty.zero(),
                            c: job.out.add(r * job.ldc + seg.col0 + p * LANES),
                            ldc: job.ldc,
                            cols,
                            accumulate: b0 > 0 || job.add,
                            prefetch: tile == 0,
                        }
                    };
                    // SAFETY: the tile lies inside the activations, W and this task's columns.
                    unsafe {
                        if np == NP {
                            tile_rows::<D, NP, MR, HB, SUB, MIN>(d, &t, rows)
                        } else {
                            tile_rows::<D, 1, MR, HB, SUB, MIN>(d, &t, rows)
                        }
                    };
                    r += rows;
                }
                p += np;
            }
            mb += mc;
        }
        b0 += nb;
    }
}

/// The micro-kernel for `rows` (1..=MAX) rows, as a const generic.
///
/// # Safety
/// As [`micro`].
#[inline(always)]
unsafe fn tile_rows<
    D: KDot,
    const P: usize,
    const MAX: usize,
    const HB: usize,
    const SUB: usize,
    const MIN: bool,
>(
    d: D,
    t: &KTile,
    rows: usize,
) {
    // SAFETY (every arm): the caller's contract, for `rows` rows.
    unsafe {
        match rows {
            1 => micro::<D, P, 1, HB, SUB, MIN>(d, t),
            2 if MAX >= 2 => micro::<D, P, 2, HB, SUB, MIN>(d, t),
            3 if MAX >= 3 => micro::<D, P, 3, HB, SUB, MIN>(d, t),
            4 if MAX >= 4 => micro::<D, P, 4, HB, SUB, MIN>(d, t),
            5 if MAX >= 5 => micro::<D, P, 5, HB, SUB, MIN>(d, t),
            6 if MAX >= 6 => micro::<D, P, 6, HB, SUB, MIN>(d, t),
            _ => unreachable!("{rows} rows in a tile of at most {MAX}"),
        }
    }
}

/// `c[MR, P * 16] (+)= a[MR, nb blocks] @ w[nb blocks, P * 16]`.
///
/// # Safety
/// `a` readable for `MR` rows of `nb * 32` bytes at stride `lda`, the per-block activation
/// values for `MR` rows of `nb` at stride `ldb`; `w` for `nb` records in each of `P` panels
/// `panel_bytes` apart; `c` writable for `MR` rows of `cols` at stride `ldc`.
#[inline(always)]
unsafe fn micro<
    D: KDot,
    const P: usize,
    const MR: usize,
    const HB: usize,
    const SUB: usize,
    const MIN: bool,
>(
    d: D,
    t: &KTile,
) {
    // The layout of `KQuantType::offsets`, from the type's constants.
    let sup = MIN || SUB == 2;
    let group = if sup { 8 } else { 1 };
    let qb = 256 + 64 * HB;
    let gb = group * (qb + 32)
        + if MIN {
            64
        } else if sup {
            32
        } else {
            0
        };
    let mut acc = [[d.zero_f(); P]; MR];
    if t.accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (q, v) in row.iter_mut().enumerate() {
                // SAFETY: the caller's contract for c.
                *v = unsafe { load_c(d, t.c.add(r * t.ldc + q * LANES), t.cols, q) };
            }
        }
    }
    for b in 0..t.nb {
        let at = b / group * gb;
        let (qo, so, go) = (
            at + b % group * qb,
            at + group * qb + b % group * 32,
            at + group * (qb + 32),
        );
        if t.prefetch {
            // About one block's bytes, PF blocks ahead (past the panel's end: harmless).
            let ahead = (b + PF) * gb / group;
            for q in 0..P {
                for line in 0..=gb / group / 64 {
                    prefetch_l1(t.w.wrapping_add(q * t.panel_bytes + ahead + line * 64));
                }
            }
        }
        let mut dots = [[[d.seed(0); SUB]; P]; MR];
        for (r, row) in dots.iter_mut().enumerate() {
            // SAFETY: the caller's contract for the activations' sums.
            let (lo, hi) = unsafe {
                let s = t.sum16.add((r * t.ldb + b) * 2);
                (*s, *s.add(1))
            };
            // No closures in this body: one would be compiled without the wrapper's target
            // features, and every intrinsic in it would become a call (3x slower, measured).
            let seeds = if SUB == 2 {
                [d.seed(-t.zero * lo), d.seed(-t.zero * hi)]
            } else {
                [d.seed(-t.zero * (lo + hi)); 2]
            };
            for v in row.iter_mut() {
                for (h, x) in v.iter_mut().enumerate() {
                    *x = seeds[h];
                }
            }
        }
        for v in 0..4 {
            // SAFETY (both): the caller's contract for w.
            let mut lines = [unsafe { d.load_w(t.w.add(qo + v * 64)) }; P];
            for (q, l) in lines.iter_mut().enumerate().skip(1) {
                *l = unsafe { d.load_w(t.w.add(q * t.panel_bytes + qo + v * 64)) };
            }
            for half in 0..2 {
                let g = v + 4 * half;
                let mut wv = lines;
                for (q, w) in wv.iter_mut().enumerate() {
                    let mut u = if half == 0 { d.lo(*w) } else { d.hi(*w) };
                    if let Some(per) = 8usize.checked_div(HB) {
                        // SAFETY: the caller's contract for w.
                        let h = unsafe {
                            d.load_w(t.w.add(q * t.panel_bytes + qo + 256 + (g / per) * 64))
                        };
                        u = d.or(u, d.top(h, (HB * (g % per)) as u32, HB as u32));
                    }
                    *w = u;
                }
                let sub = if SUB == 2 { half } else { 0 };
                for (r, row) in dots.iter_mut().enumerate() {
                    // SAFETY: the caller's contract for a: 4 bytes of row r, block b, group g.
                    let a = unsafe {
                        std::ptr::read_unaligned(
                            t.a.add(r * t.lda + b * Q8_BLOCK + g * GROUP_INPUTS)
                                .cast::<i32>(),
                        )
                    };
                    for (v, w) in row.iter_mut().zip(&wv) {
                        v[sub] = d.dot(v[sub], *w, a);
                    }
                }
            }
        }
        let mut s = [[d.zero_f(); SUB]; P];
        let mut mn = [d.zero_f(); P];
        for q in 0..P {
            let p = t.w.wrapping_add(q * t.panel_bytes);
            // SAFETY (each load): the caller's contract for w.
            unsafe {
                if MIN {
                    s[q][0] = d.mul(d.load_h(p.add(go)), d.load_u8(p.add(so)));
                    mn[q] = d.mul(d.load_h(p.add(go + 32)), d.load_u8(p.add(so + 16)));
                } else if SUB == 2 {
                    let dd = d.load_h(p.add(go));
                    for (h, sv) in s[q].iter_mut().enumerate() {
                        *sv = d.mul(dd, d.load_i8(p.add(so + 16 * h)));
                    }
                } else {
                    s[q][0] = d.load_h(p.add(so));
                }
            }
        }
        for (r, (row, dots)) in acc.iter_mut().zip(&dots).enumerate() {
            // SAFETY: the caller's contract for the activations' scales.
            let (sa, ms) = unsafe { (*t.a_scale.add(r * t.ldb + b), *t.msum.add(r * t.ldb + b)) };
            for (q, v) in row.iter_mut().enumerate() {
                for h in 0..SUB {
                    *v = d.fold(*v, dots[q][h], s[q][h], sa);
                }
                if MIN {
                    *v = d.sub_min(*v, mn[q], ms);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, v) in row.iter().enumerate() {
            // SAFETY: the caller's contract for c.
            unsafe { store_c(d, t.c.add(r * t.ldc + q * LANES), t.cols, q, *v) };
        }
    }
    debug_assert_eq!(GROUPS, 8);
}

/// Vector `q` of a tile row at `c`, of which `cols` columns exist; the rest read as zero.
///
/// # Safety
/// `c` must be readable for `min(cols - q * 16, 16)` f32.
#[inline(always)]
unsafe fn load_c<D: KDot>(d: D, c: *const f32, cols: usize, q: usize) -> D::F {
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
unsafe fn store_c<D: KDot>(d: D, c: *mut f32, cols: usize, q: usize, v: D::F) {
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
#[path = "kquant_gemm_tests.rs"]
mod tests;
