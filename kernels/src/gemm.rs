//! `out = x @ W` with `W` packed at load ([`PackedWeight`]): every linear layer of the model,
//! at every batch size.
//!
//! A register-tiled micro-kernel computes `MR` rows × `NP` panels (`NP * 16` columns) over a
//! block of `KC` inputs: per input it loads `NP` panel vectors, broadcasts one `x` value per
//! row and issues `MR * NP` FMAs into accumulators that never leave registers. AVX-512 runs
//! 8 × 3 panels (24 of the 32 zmm: 3 loads and 8 broadcasts feed 24 FMAs, where 8 × 2 fed 16
//! with 10, and one decode step's products ran 4-6% faster at batch 32 and 64), AVX2 6 × 1
//! panel (12 of the 16 ymm, two per vector), the portable build 4 × 1. The `KC`-row slice of
//! the panels (36-108 KiB, in L1 and L2) stays close while every row block of the batch
//! passes over it, so at batch 32 each weight is read from memory once per step; at batch 1
//! the same loop is one sequential read of the whole matrix.
//!
//! A decode batch (one row block) walks each panel group front to back, and while the row tiles
//! of one input block run, they prefetch the next block's panel rows in equal shares. Without
//! that, the first row tile of every block waited on memory and the others on nothing: one
//! decode step's GEMMs at batch 32 ran at about 160 GFLOP/s against 210 with the weights in
//! cache, and about 180 with the shares (`fission bench limits`, "one step").
//!
//! A prefill (several row blocks) walks each input block's panel groups once per row block,
//! and fetches the next group's rows in the same shares: with the weights coming from memory
//! rather than from a cache, that made AVX2 prefill 512 1.2x faster (AVX-512 level).
//!
//! Threads split the panels into contiguous ranges: disjoint output columns, nothing to sum.
//! Products too small to repay a fork-join run on the calling thread.

use crate::error::KernelError;
use crate::packed::{check_len, PackedWeight, Panels, PANEL};
use crate::pool;
use crate::q8_simd::QIsa;
use crate::simd::{prefetch_l2, Isa, Portable, Simd, LANES};
#[cfg(target_arch = "x86_64")]
use crate::simd_x86::{Avx2Fma, Avx512};

/// Inputs per block, at most (blocks are cut evenly): `KC * PANEL * NP` f32 of panels (36 KiB
/// on AVX2, 108 KiB on AVX-512) stay in L1 and L2 while the row tiles pass. Every block loads
/// and stores each output tile once more, so k = 576 goes in one block rather than three of
/// 192: AVX-512 prefill 512 ran 1.08x faster and decode batch 64 1.04x, AVX2 batch 64 1.04x
/// (a cap of 768 measured level with 576).
const KC: usize = 576;
/// Outputs from which a product counts as wide, and the input block such products take.
const WIDE_N: usize = 8192;
const KC_WIDE: usize = 1024;
/// Rows per block: `MC * KC` f32 of `x` (up to 288 KiB) stay in L2 while the panels pass.
const MC: usize = 128;
/// Below this many multiply-adds a hand-off to the pool's threads costs more than it saves.
const PARALLEL_MIN_FMAS: usize = 1 << 16;
/// From this many multiply-adds (prefill chunks, big batches) a product is cut finer than one
/// task per thread: into this many per thread for a decode batch (one row block), and into
/// half as many for a prefill, whose tasks each bring every row block's `x` into L2 again.
const BALANCED_MIN_FMAS: usize = 1 << 24;
/// Tasks per thread of a big decode-batch product.
const TASKS_PER_THREAD: usize = 3;
/// Tasks per thread of a big prefill product.
const PREFILL_TASKS_PER_THREAD: usize = 2;
/// AVX-512's tile: panels (of 16 columns) by rows. Tasks split products in whole tiles.
const AVX512_PANELS: usize = 3;
const AVX512_ROWS: usize = 8;

/// `out[m, n] = x[m, k] @ W[k, n]` (row-major `x` and `out`), on every thread of the kernel pool.
pub fn packed_matmul(
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    out: &mut [f32],
) -> Result<(), KernelError> {
    packed_matmul_on(Isa::detect(), x, m, w, out, false)
}

/// `out[m, n] += x[m, k] @ W[k, n]`: a residual connection added in the same pass over `out`.
pub fn packed_matmul_add(
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    out: &mut [f32],
) -> Result<(), KernelError> {
    packed_matmul_on(Isa::detect(), x, m, w, out, true)
}

/// [`packed_matmul`] (or, with `add`, [`packed_matmul_add`]) on a given instruction set (the
/// tests run every one this CPU has).
pub(crate) fn packed_matmul_on(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    out: &mut [f32],
    add: bool,
) -> Result<(), KernelError> {
    let (k, n) = (w.k(), w.n());
    check_len("x", m * k, x.len())?;
    check_len("out", m * n, out.len())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !add {
            out.fill(0.0);
        }
        return Ok(());
    }
    match w.data() {
        Panels::F32(rows) => run_job(isa, x, m, w, rows.as_ptr().cast::<f32>(), out, add),
        Panels::Bf16(rows) => run_job(isa, x, m, w, rows.as_ptr().cast::<u16>(), out, add),
        Panels::Q8(q) => crate::q8_gemm::q8_matmul(QIsa::detect(), x, m, q, out, add),
    }
    Ok(())
}

/// An element a packed panel may store, widened to f32 as the micro-kernel loads it.
pub(crate) trait WeightElem: Copy + 'static {
    /// # Safety
    /// `p` must be valid for reading `LANES` elements.
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::V;
}

impl WeightElem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f32) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { s.load_ptr(p) }
    }
}

/// bf16, as its bit pattern.
impl WeightElem for u16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const u16) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { s.load_bf16_ptr(p) }
    }
}

/// Splits one checked product over the pool. `b` points at `w`'s panels.
fn run_job<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    b: *const W,
    out: &mut [f32],
    add: bool,
) {
    let (k, n) = (w.k(), w.n());
    let job = Job {
        x: x.as_ptr(),
        m,
        k,
        n,
        b,
        out: OutPtr(out.as_mut_ptr()),
        add,
    };
    let panels = w.panels();
    let threads = pool::threads();
    // Big products get several tasks per thread: a thread the OS takes away for a while
    // (another process on the core) then holds up only a small share of the product. Three,
    // not more: each task starts its panels cold, and on AVX2 eight tasks of 4-5 panels ran
    // n = 576 about 10% slower than six of 6. A prefill's tasks also reload `x`, so a prefill
    // takes two per thread (prefill 1.01-1.03x on AVX2, 1.05-1.06x on AVX-512); decode keeps
    // three (two lost 2% at batch 64).
    let per_thread = if m > MC {
        PREFILL_TASKS_PER_THREAD
    } else {
        TASKS_PER_THREAD
    };
    let tasks = if m * k * n < PARALLEL_MIN_FMAS {
        1
    } else if m * k * n < BALANCED_MIN_FMAS {
        threads.min(panels)
    } else {
        (threads * per_thread).min(panels.div_ceil(2))
    };
    // Whole tiles' worth of panels per task (AVX-512's three), dealt evenly: on AVX2, 60
    // panels (the 960 QKV outputs) as 6 tasks of 10, where rounding every task up to a
    // multiple of 3 gave seven of 9 and one of 6, and two threads ran 33 and 27 panels (that
    // shape ran 10% under the others in `fission bench limits`).
    let unit = tile_panels(isa);
    let units = panels.div_ceil(unit);
    let tasks = tasks.min(units);
    let run = |t: usize| {
        let p0 = (t * units / tasks * unit).min(panels);
        let p1 = ((t + 1) * units / tasks * unit).min(panels);
        // SAFETY: tasks own disjoint panel ranges, so disjoint columns of `out`; `x` and `out`
        // were checked to hold m * k and m * n elements, `b` points at `w`'s panels; `isa` is
        // this CPU's or one it runs.
        unsafe { run_task(isa, &job, p0, p1) };
    };
    if tasks == 1 {
        run(0);
    } else {
        pool::run(tasks, &run);
    }
}

/// Panels of the widest tile `isa`'s micro-kernel runs (`NP` of [`task`]).
fn tile_panels(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => AVX512_PANELS,
        _ => 1,
    }
}

/// What every task of one product shares.
struct Job<W> {
    x: *const f32,
    m: usize,
    k: usize,
    n: usize,
    /// The panels: panel `p`, row `i` starts at `b + (p * k + i) * PANEL`.
    b: *const W,
    out: OutPtr,
    /// Add to `out` rather than overwrite it.
    add: bool,
}

/// The output, written by several tasks at disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the tasks of one product write disjoint columns of `out` (their own panels), and
// `x` and `W` are only read; the caller holds `&mut out`, `&x` and `&W` for the whole product.
unsafe impl<W> Sync for Job<W> {}

/// # Safety
/// Panels `p0..p1` are this task's alone; the job's lengths are checked; the CPU runs `isa`.
unsafe fn run_task<W: WeightElem>(isa: Isa, job: &Job<W>, p0: usize, p1: usize) {
    match isa {
        // SAFETY: the caller's contract.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { task_avx512(job, p0, p1) },
        // SAFETY: the caller's contract.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { task_avx2(job, p0, p1) },
        // SAFETY: the caller's contract.
        _ => unsafe { task::<Portable, W, 1, 4>(Portable, job, p0, p1) },
    }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn task_avx512<W: WeightElem>(job: &Job<W>, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { task::<Avx512, W, AVX512_PANELS, AVX512_ROWS>(Avx512::new_unchecked(), job, p0, p1) }
}

/// # Safety
/// As [`run_task`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<W: WeightElem>(job: &Job<W>, p0: usize, p1: usize) {
    // SAFETY: this function's contract.
    unsafe { task::<Avx2Fma, W, 1, 6>(Avx2Fma::new_unchecked(), job, p0, p1) }
}

/// One task: panels `p0..p1` for every row, blocked by `KC` inputs and `MC` rows.
///
/// # Safety
/// As [`run_task`].
#[inline(always)]
unsafe fn task<S: Simd, W: WeightElem, const NP: usize, const MR: usize>(
    s: S,
    job: &Job<W>,
    p0: usize,
    p1: usize,
) {
    let (m, k, n) = (job.m, job.k, job.n);
    // Wide outputs (the lm_head) take the inputs in one block up to KC_WIDE: their output is
    // too big for the caches, and each extra block reads and writes it again.
    let kc_max = if n >= WIDE_N { KC_WIDE } else { KC };
    // Input blocks of equal size: k = 1536 as 3 x 512, not 576 + 576 + 384, since a short
    // last block pays a full pass over the output tiles for less work (with a 256 cap, 3 x 192
    // rather than 256 + 256 + 64 made one decode step's products 3-5% faster at m = 32, 64).
    let kc_max = k.div_ceil(k.div_ceil(kc_max));
    if m <= MC {
        // One row block (decode batches): each panel group is read front to back, input block
        // after input block, before the next, so a task streams its panels in order rather
        // than coming back to each of them once per input block.
        let mut p = p0;
        while p < p1 {
            let np = if p1 - p >= NP { NP } else { 1 };
            let mut kb = 0;
            while kb < k {
                let kc = kc_max.min(k - kb);
                let next = if kb + kc < k {
                    job.b.wrapping_add((p * k + kb + kc) * PANEL)
                } else if p + np < p1 {
                    job.b.wrapping_add((p + np) * k * PANEL)
                } else {
                    std::ptr::null()
                };
                // SAFETY: the block lies inside the task's panels and the checked x and out.
                unsafe {
                    rows_block::<S, W, NP, MR>(
                        s,
                        job,
                        Block {
                            kb,
                            kc,
                            mb: 0,
                            mc: m,
                            p,
                            np,
                            next,
                        },
                    )
                };
                kb += kc;
            }
            p += np;
        }
        return;
    }
    let mut kb = 0;
    while kb < k {
        let kc = kc_max.min(k - kb);
        let mut mb = 0;
        while mb < m {
            let mc = MC.min(m - mb);
            let mut p = p0;
            while p < p1 {
                let np = if p1 - p >= NP { NP } else { 1 };
                // The next panel group's rows of this input block come in while these run,
                // as in the decode order above.
                let next = if p + np < p1 {
                    job.b.wrapping_add(((p + np) * k + kb) * PANEL)
                } else {
                    std::ptr::null()
                };
                // SAFETY: the block lies inside the task's panels and the checked x and out.
                unsafe {
                    rows_block::<S, W, NP, MR>(
                        s,
                        job,
                        Block {
                            kb,
                            kc,
                            mb,
                            mc,
                            p,
                            np,
                            next,
                        },
                    )
                };
                p += np;
            }
            mb += mc;
        }
        kb += kc;
    }
}

/// A block of one task's work: rows `mb..mb + mc` over inputs `kb..kb + kc` of panels
/// `p..p + np`.
struct Block<W> {
    kb: usize,
    kc: usize,
    mb: usize,
    mc: usize,
    p: usize,
    np: usize,
    /// The first panel row of the block after this one (null: none to prefetch).
    next: *const W,
}

/// Every row tile of one block. A function, not a closure: closures do not inherit the
/// caller's target features, and the micro-kernel would lose its vector instructions.
///
/// # Safety
/// As [`run_task`], for a block inside the task's panels.
#[inline(always)]
unsafe fn rows_block<S: Simd, W: WeightElem, const NP: usize, const MR: usize>(
    s: S,
    job: &Job<W>,
    blk: Block<W>,
) {
    let (k, n) = (job.k, job.n);
    let Block {
        kb,
        kc,
        mb,
        mc,
        p,
        np,
        next,
    } = blk;
    let cols = (n - p * PANEL).min(np * PANEL);
    // The first row tile reads this block's panel rows from memory, the others from L1; the
    // next block's rows are fetched in shares across all the row tiles, so memory is read
    // evenly instead of in a burst that stalls the first tile.
    let tiles = mc.div_ceil(MR);
    let share = kc.div_ceil(tiles);
    // Rows dealt evenly over the tiles (32 on AVX2's 6-row tiles: 6, 6, 5, 5, 5, 5, not five
    // 6s and a 2): a short tile has too few FMA chains to hide the FMA latency.
    let (base, extra) = (mc / tiles, mc % tiles);
    let mut r = mb;
    for tile in 0..tiles {
        let rows = base + usize::from(tile < extra);
        let t = Tile {
            // SAFETY (all three): r < m, kb < k, p * PANEL < n: in bounds.
            a: unsafe { job.x.add(r * k + kb) },
            lda: k,
            // SAFETY: p < panels and kb < k: inside the panels.
            b: unsafe { job.b.add((p * k + kb) * PANEL) },
            panel_stride: k * PANEL,
            kc,
            c: unsafe { job.out.0.add(r * n + p * PANEL) },
            ldc: n,
            cols,
            accumulate: kb > 0 || job.add,
            pf: if next.is_null() {
                next
            } else {
                next.wrapping_add(tile * share * PANEL)
            },
            pf_every: tiles,
        };
        // SAFETY: the tile lies inside x, W and this task's columns of out.
        unsafe {
            // The tasks step a tail shorter than a full group one panel at a time.
            if np == NP {
                tile_rows::<S, W, NP, MR>(s, &t, rows)
            } else {
                tile_rows::<S, W, 1, MR>(s, &t, rows)
            }
        };
        r += rows;
    }
}

/// One micro-tile's operands: `a` at `x[row, kb]`, `b` at row `kb` of its first panel, `c` at
/// `out[row, panel * PANEL]`, `cols` of whose columns are real.
struct Tile<W> {
    a: *const f32,
    lda: usize,
    b: *const W,
    panel_stride: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    accumulate: bool,
    /// Where this tile prefetches its share of the next block's panel rows (null: nowhere),
    /// one row of each panel every `pf_every` inputs.
    pf: *const W,
    pf_every: usize,
}

/// Runs the micro-kernel for `rows` (1..=MAX) rows: the row count is a const generic so the
/// accumulators are a fixed set of registers.
///
/// # Safety
/// As [`micro`].
#[inline(always)]
unsafe fn tile_rows<S: Simd, W: WeightElem, const NP: usize, const MAX: usize>(
    s: S,
    t: &Tile<W>,
    rows: usize,
) {
    // SAFETY (every arm): the caller's contract, for `rows` rows.
    unsafe {
        match rows {
            1 => micro::<S, W, NP, 1>(s, t),
            2 if MAX >= 2 => micro::<S, W, NP, 2>(s, t),
            3 if MAX >= 3 => micro::<S, W, NP, 3>(s, t),
            4 if MAX >= 4 => micro::<S, W, NP, 4>(s, t),
            5 if MAX >= 5 => micro::<S, W, NP, 5>(s, t),
            6 if MAX >= 6 => micro::<S, W, NP, 6>(s, t),
            7 if MAX >= 7 => micro::<S, W, NP, 7>(s, t),
            8 if MAX >= 8 => micro::<S, W, NP, 8>(s, t),
            _ => unreachable!("{rows} rows in a tile of at most {MAX}"),
        }
    }
}

/// `c[MR, NP * 16] (+)= a[MR, kc] @ b[kc, NP * 16]` with the accumulators in registers.
///
/// # Safety
/// `a` must be readable for `MR` rows of `kc` at stride `lda`; `b` for `kc` vectors in each
/// of `NP` panels `panel_stride` apart; `c` writable for `MR` rows of `cols` at stride `ldc`.
#[inline(always)]
unsafe fn micro<S: Simd, W: WeightElem, const NP: usize, const MR: usize>(s: S, t: &Tile<W>) {
    let zero = s.splat(0.0);
    let mut acc = [[zero; NP]; MR];
    if t.accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (q, v) in row.iter_mut().enumerate() {
                // SAFETY: the caller's contract for c.
                *v = unsafe { load_c(s, t.c.add(r * t.ldc + q * LANES), t.cols, q) };
            }
        }
    }
    let (mut a, mut b) = (t.a, t.b);
    let mut pf = t.pf;
    if pf.is_null() {
        for _ in 0..t.kc {
            // SAFETY: the caller's contract, for input `a - t.a`.
            unsafe { fma_input(s, &mut acc, a, t.lda, b, t.panel_stride) };
            // SAFETY: stays within (or one past) the rows and panels read above.
            (a, b) = unsafe { (a.add(1), b.add(PANEL)) };
        }
    } else if t.pf_every <= 1 {
        // The only tile of its block (batch 1): one prefetch per input, in the input loop
        // itself rather than in runs of one, whose bookkeeping doubled the loop's instructions.
        for _ in 0..t.kc {
            for q in 0..NP {
                prefetch_l2(pf.wrapping_add(q * t.panel_stride));
            }
            pf = pf.wrapping_add(PANEL);
            // SAFETY: as above.
            unsafe { fma_input(s, &mut acc, a, t.lda, b, t.panel_stride) };
            // SAFETY: as above.
            (a, b) = unsafe { (a.add(1), b.add(PANEL)) };
        }
    } else {
        // Runs of `pf_every` inputs, each after one prefetch: no `i % pf_every` per input, for
        // which LLVM kept a `div` in the loop that a 2-row AVX2 tile (4 FMAs an input) waited
        // on.
        let mut done = 0;
        while done < t.kc {
            for q in 0..NP {
                prefetch_l2(pf.wrapping_add(q * t.panel_stride));
            }
            pf = pf.wrapping_add(PANEL);
            let inputs = t.pf_every.min(t.kc - done);
            done += inputs;
            for _ in 0..inputs {
                // SAFETY: as above.
                unsafe { fma_input(s, &mut acc, a, t.lda, b, t.panel_stride) };
                // SAFETY: as above.
                (a, b) = unsafe { (a.add(1), b.add(PANEL)) };
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, v) in row.iter().enumerate() {
            // SAFETY: the caller's contract for c.
            unsafe { store_c(s, t.c.add(r * t.ldc + q * LANES), t.cols, q, *v) };
        }
    }
}

/// One input of a tile: `NP` panel vectors at `b`, one `x` value per row at `a` (rows `lda`
/// apart), `MR * NP` FMAs.
///
/// # Safety
/// `a` must be readable for `MR` rows at stride `lda`, `b` for one vector in each of `NP`
/// panels `panel_stride` apart.
#[inline(always)]
unsafe fn fma_input<S: Simd, W: WeightElem, const NP: usize, const MR: usize>(
    s: S,
    acc: &mut [[S::V; NP]; MR],
    a: *const f32,
    lda: usize,
    b: *const W,
    panel_stride: usize,
) {
    let mut bv = [s.splat(0.0); NP];
    for (q, v) in bv.iter_mut().enumerate() {
        // SAFETY: the caller's contract for b.
        *v = unsafe { W::load(s, b.add(q * panel_stride)) };
    }
    for (r, row) in acc.iter_mut().enumerate() {
        // SAFETY: the caller's contract for a.
        let av = s.splat(unsafe { *a.add(r * lda) });
        for (v, bq) in row.iter_mut().zip(&bv) {
            *v = s.mul_add(av, *bq, *v);
        }
    }
}

/// Vector `q` of a tile row at `c`, of which `cols` columns exist; the rest read as zero.
///
/// # Safety
/// `c` must be readable for `min(cols - q * 16, 16)` f32.
#[inline(always)]
unsafe fn load_c<S: Simd>(s: S, c: *const f32, cols: usize, q: usize) -> S::V {
    let live = cols.saturating_sub(q * LANES);
    if live >= LANES {
        // SAFETY: 16 columns exist.
        unsafe { s.load_ptr(c) }
    } else {
        let mut buf = [0.0f32; LANES];
        // SAFETY: `live` columns exist.
        unsafe { std::ptr::copy_nonoverlapping(c, buf.as_mut_ptr(), live) };
        s.load(&buf)
    }
}

/// Writes vector `q` of a tile row at `c`, only the `cols` columns that exist.
///
/// # Safety
/// `c` must be writable for `min(cols - q * 16, 16)` f32.
#[inline(always)]
unsafe fn store_c<S: Simd>(s: S, c: *mut f32, cols: usize, q: usize, v: S::V) {
    let live = cols.saturating_sub(q * LANES);
    if live >= LANES {
        // SAFETY: 16 columns exist.
        unsafe { s.store_ptr(c, v) }
    } else if live > 0 {
        let mut buf = [0.0f32; LANES];
        s.store(&mut buf, v);
        // SAFETY: `live` columns exist.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), c, live) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(x: &[f32], m: usize, w_t: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for kk in 0..k {
                for j in 0..n {
                    out[i * n + j] += x[i * k + kk] as f64 * w_t[kk * n + j] as f64;
                }
            }
        }
        out.into_iter().map(|v| v as f32).collect()
    }

    fn check(m: usize, k: usize, n: usize, seed: u64) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w_t: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let want = reference(&x, m, &w_t, k, n);
        let packed = PackedWeight::from_in_out(&w_t, k, n).expect("pack");
        let base: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        check_packed(&x, m, &packed, &want, &base);
        // bf16 weights: the same product over the bf16-rounded matrix, packed from `[n, k]`.
        let w16: Vec<half::bf16> = (0..n * k)
            .map(|i| half::bf16::from_f32(w_t[(i % k) * n + i / k]))
            .collect();
        let rounded: Vec<f32> = (0..k * n)
            .map(|i| w16[(i % n) * k + i / n].to_f32())
            .collect();
        let want16 = reference(&x, m, &rounded, k, n);
        let packed16 = PackedWeight::from_out_in_bf16(&w16, n, k).expect("pack bf16");
        check_packed(&x, m, &packed16, &want16, &base);
    }

    fn check_packed(x: &[f32], m: usize, packed: &PackedWeight, want: &[f32], base: &[f32]) {
        let (k, n) = (packed.k(), packed.n());
        for isa in Isa::available() {
            for add in [false, true] {
                let mut out = if add {
                    base.to_vec()
                } else {
                    vec![f32::NAN; m * n]
                };
                packed_matmul_on(isa, x, m, packed, &mut out, add).expect("shapes");
                for (i, (g, w)) in out.iter().zip(want).enumerate() {
                    let w = if add { w + base[i] } else { *w };
                    let tol = 1e-5 * (k as f32).sqrt() * (1.0 + w.abs());
                    assert!(
                        (g - w).abs() <= tol,
                        "{isa:?} {:?} add={add} {m}x{k}x{n} at {i}: {g} vs {w}",
                        packed.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn model_shapes_and_edges() {
        for (m, k, n) in [
            (1, 576, 960),
            (3, 64, 192),
            (8, 300, 33),
            (9, 17, 16),
            (17, 513, 100),
            (32, 64, 512),
            (130, 40, 48),
            // Several row blocks, each dealt unevenly over its tiles, across panel groups.
            (300, 200, 200),
            // Panel counts that leave tails short of a full group: 2, and 3 + 2.
            (5, 70, 32),
            (64, 576, 80),
            // Several input blocks (the down projection's 1536 is three of 512), in the decode
            // order and the prefill order.
            (5, 1536, 64),
            (140, 1200, 48),
            (1, 1, 1),
            (2, 0, 5),
            // Wide outputs take the deeper input block, and past it a second one.
            (1, 576, 8192),
            (3, 1100, 8193),
        ] {
            check(m, k, n, (m * 1000 + k + n) as u64);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_shapes_match_the_reference(
            m in 1usize..70, k in 1usize..600, n in 1usize..150, seed in any::<u64>()
        ) {
            check(m, k, n, seed);
        }
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let w = PackedWeight::from_in_out(&[1.0; 6], 2, 3).expect("pack");
        let mut out = vec![0.0; 3];
        assert!(packed_matmul(&[1.0; 3], 1, &w, &mut out).is_err());
        assert!(packed_matmul(&[1.0; 2], 1, &w, &mut out[..2]).is_err());
        packed_matmul(&[1.0, 2.0], 1, &w, &mut out).expect("ok");
        assert_eq!(out, [3.0, 3.0, 3.0]);
    }
}
