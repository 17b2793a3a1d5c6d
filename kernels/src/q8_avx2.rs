//! The Q8 GEMM's micro-kernel for AVX2 without AVX-512: int8 × int8 products on i16.
//!
//! AVX2 has no int8 dot product that accumulates (VNNI's `vpdpbusd`). The `maddubs` route
//! llama.cpp takes costs an `abs` and two `sign`s per row and weight vector besides its two
//! multiplies, to keep `maddubs`' i16 sums from saturating. Widened to i16 instead, weights
//! (`+128`, as stored) and activations (widened once per product) meet in `vpmaddwd`, which
//! cannot saturate: each i32 lane gets one column's two products, so per row and group of 4
//! inputs the tile issues 4 `vpmaddwd` and 4 adds for 16 columns, 8 instructions where the
//! sign trick takes 11. The weights' offset is cancelled, as with VNNI, by seeding each
//! block's sums with `-128 * sum(activations)`. The weights are packed in
//! [`QLayout::Pairs`](crate::q8::QLayout::Pairs), so a 16-byte load widens straight into 8
//! columns' pairs; each group's 4 widened weight vectors serve the tile's 4 rows.
//!
//! Registers: 4 rows × 2 i32 sums, 4 weight vectors and 2 broadcasts; the f32 outputs (8)
//! are touched once per block, so they can live on the stack.

use std::arch::x86_64::*;

use crate::q8::{GROUPS, GROUP_INPUTS, Q8_BLOCK};
use crate::q8_tile::{QTile, TileKernel};
use crate::simd::LANES;

/// Rows per tile.
const MR: usize = 4;

/// AVX2 + FMA + F16C token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PairKernel {
    _detected: (),
}

impl PairKernel {
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Self {
        PairKernel { _detected: () }
    }
}

impl TileKernel for PairKernel {
    const NP: usize = 1;
    const MR: usize = MR;
    const LONE_TILE_PREFETCH: bool = true;

    #[inline(always)]
    unsafe fn tile(self, t: &QTile, rows: usize, _panels: usize) {
        // SAFETY (every arm): a `PairKernel` exists only on a CPU with AVX2, FMA and F16C; the
        // operands are the caller's contract, for `rows` rows.
        unsafe {
            match (rows, !t.pf.is_null()) {
                (1, false) => micro::<1, false>(t),
                (2, false) => micro::<2, false>(t),
                (3, false) => micro::<3, false>(t),
                (4, false) => micro::<4, false>(t),
                (1, true) => micro::<1, true>(t),
                (2, true) => micro::<2, true>(t),
                (3, true) => micro::<3, true>(t),
                (4, true) => micro::<4, true>(t),
                _ => unreachable!("{rows} rows in a tile of at most {MR}"),
            }
        }
    }
}

/// `c[R, 16] (+)= a[R, nb blocks] @ w[nb blocks, 16]`, one panel.
///
/// # Safety
/// AVX2, FMA and F16C; `t.a16` readable for `R` rows of `nb * 32` i16 at stride `lda`,
/// `a_scale` and `a_comp` for `R` rows of `nb` at stride `ldb`; `w` for `nb` blocks of one
/// panel in [`QLayout::Pairs`](crate::q8::QLayout::Pairs) (64-byte aligned groups) and
/// `w_scale` for their 16 scales each; `c` writable for `R` rows of `cols` at stride `ldc`.
#[inline(always)]
unsafe fn micro<const R: usize, const PF: bool>(t: &QTile) {
    // SAFETY (the whole body): the function's contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if t.accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                *row = load_c(t.c.add(r * t.ldc), t.cols);
            }
        }
        for b in 0..t.nb {
            if PF {
                t.prefetch(b, 1);
            }
            let mut dots = [[_mm256_setzero_si256(); 2]; R];
            for (r, row) in dots.iter_mut().enumerate() {
                *row = [_mm256_set1_epi32(*t.a_comp.add(r * t.ldb + b)); 2];
            }
            for g in 0..GROUPS {
                let w = t.w.add((b * GROUPS + g) * GROUP_INPUTS * LANES);
                // Columns 0..8 then 8..16: inputs 0-1, and inputs 2-3.
                let w01 = [widen(w), widen(w.add(32))];
                let w23 = [widen(w.add(16)), widen(w.add(48))];
                for (r, row) in dots.iter_mut().enumerate() {
                    let a = t
                        .a16
                        .add(r * t.lda + b * Q8_BLOCK + g * GROUP_INPUTS)
                        .cast::<i32>();
                    let a01 = _mm256_set1_epi32(std::ptr::read_unaligned(a));
                    let a23 = _mm256_set1_epi32(std::ptr::read_unaligned(a.add(1)));
                    for (h, v) in row.iter_mut().enumerate() {
                        *v = _mm256_add_epi32(*v, _mm256_madd_epi16(w01[h], a01));
                        *v = _mm256_add_epi32(*v, _mm256_madd_epi16(w23[h], a23));
                    }
                }
            }
            let s = t.w_scale.add(b * LANES);
            let sw = [
                _mm256_cvtph_ps(_mm_loadu_si128(s.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(s.add(8).cast())),
            ];
            for (r, (row, dots)) in acc.iter_mut().zip(&dots).enumerate() {
                let sa = _mm256_set1_ps(*t.a_scale.add(r * t.ldb + b));
                for ((v, d), s) in row.iter_mut().zip(dots).zip(&sw) {
                    *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*d), _mm256_mul_ps(*s, sa), *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            store_c(t.c.add(r * t.ldc), t.cols, *row);
        }
    }
}

/// 16 weight bytes (`+128`) zero-extended to i16.
///
/// # Safety
/// AVX2; `p` readable for 16 bytes, 16-byte aligned.
#[inline(always)]
unsafe fn widen(p: *const u8) -> __m256i {
    // SAFETY: the function's contract.
    unsafe { _mm256_cvtepu8_epi16(_mm_load_si128(p.cast())) }
}

/// The 16 columns of a tile row at `c`, of which `cols` exist; the rest read as zero.
///
/// # Safety
/// AVX2; `c` readable for `min(cols, 16)` f32.
#[inline(always)]
unsafe fn load_c(c: *const f32, cols: usize) -> [__m256; 2] {
    let mut buf = [0.0f32; LANES];
    let src = if cols >= LANES {
        c
    } else {
        // SAFETY: `cols` columns exist; `buf` holds 16.
        unsafe { std::ptr::copy_nonoverlapping(c, buf.as_mut_ptr(), cols) };
        buf.as_ptr()
    };
    // SAFETY: 16 f32 at `src`, either the row or `buf`.
    unsafe { [_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))] }
}

/// Writes the `cols` columns that exist of a tile row at `c`.
///
/// # Safety
/// AVX2; `c` writable for `min(cols, 16)` f32.
#[inline(always)]
unsafe fn store_c(c: *mut f32, cols: usize, v: [__m256; 2]) {
    let mut buf = [0.0f32; LANES];
    let dst = if cols >= LANES { c } else { buf.as_mut_ptr() };
    // SAFETY: 16 f32 at `dst`, either the row or `buf`; then `cols` of `buf` into the row.
    unsafe {
        _mm256_storeu_ps(dst, v[0]);
        _mm256_storeu_ps(dst.add(8), v[1]);
        if cols < LANES {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), c, cols);
        }
    }
}
