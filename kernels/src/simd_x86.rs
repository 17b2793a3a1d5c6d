//! [`Simd`] for x86-64: AVX-512F (one zmm per vector) and AVX2+FMA (two ymm per vector).
//!
//! Every method is `#[inline(always)]` so that it lands inside the `#[target_feature]`
//! wrapper that instantiates the kernels and compiles to the single instruction it names.
//! The tokens can only be made by `unsafe fn new_unchecked`, whose contract is that the CPU
//! has the features; that is the invariant every `unsafe` block below relies on.

use std::arch::x86_64::*;

use crate::simd::{Simd, EXP2_ROUND, LANES};

/// AVX-512F + AVX2 + FMA token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512 {
    _detected: (),
}

impl Avx512 {
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Self {
        Avx512 { _detected: () }
    }
}

// SAFETY (for every `unsafe` block in this impl): an `Avx512` exists only on a CPU with
// AVX-512F, AVX2 and FMA (`new_unchecked`'s contract); loads and stores are bounds-checked
// against `LANES` first.
impl Simd for Avx512 {
    type V = __m512;

    // 16 score accumulators + 1 query vector, 16 probability vectors + 8 output
    // accumulators, or 4 x 4 output accumulators + 4 V vectors fit the 32 zmm registers.
    const KEYS: usize = 16;
    const WIDE_CHUNK: usize = 16;
    const WIDE_DIMS: usize = 8;
    const NARROW_ROWS: usize = 4;
    const NARROW_CHUNKS: usize = 4;
    const NARROW_SCORE_CHUNKS: usize = 4;

    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> __m512 {
        let src = &src[..LANES];
        unsafe { _mm512_loadu_ps(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: __m512) {
        let dst = &mut dst[..LANES];
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) }
    }
    #[inline(always)]
    unsafe fn load_ptr(self, src: *const f32) -> __m512 {
        // SAFETY: the caller promises LANES readable f32 at `src`.
        unsafe { _mm512_loadu_ps(src) }
    }
    #[inline(always)]
    unsafe fn store_ptr(self, dst: *mut f32, v: __m512) {
        // SAFETY: the caller promises LANES writable f32 at `dst`.
        unsafe { _mm512_storeu_ps(dst, v) }
    }
    #[inline(always)]
    unsafe fn load_bf16_ptr(self, src: *const u16) -> __m512 {
        // SAFETY: the caller promises LANES readable u16 at `src`; AVX-512F is this type's
        // invariant.
        unsafe {
            let h = _mm256_loadu_si256(src.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn select_le(self, a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, b), y, x) }
    }
    #[inline(always)]
    fn reduce_add(self, v: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(v) }
    }
    #[inline(always)]
    fn reduce_add_16(self, v: &[__m512; LANES]) -> __m512 {
        unsafe {
            // Pairs: each 128-bit lane of r[k] holds [a0+a2, b0+b2, a1+a3, b1+b3] of that
            // lane of a = v[2k], b = v[2k+1].
            let mut r = [_mm512_setzero_ps(); 8];
            for (k, r) in r.iter_mut().enumerate() {
                let (a, b) = (v[2 * k], v[2 * k + 1]);
                *r = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            }
            // Quads: each 128-bit lane of s[k] holds that lane's sums of v[4k..4k + 4].
            let mut s = [_mm512_setzero_ps(); 4];
            for (k, s) in s.iter_mut().enumerate() {
                let (c, d) = (r[2 * k], r[2 * k + 1]);
                let lo = _mm512_shuffle_ps::<0b01_00_01_00>(c, d);
                let hi = _mm512_shuffle_ps::<0b11_10_11_10>(c, d);
                *s = _mm512_add_ps(lo, hi);
            }
            // Fold the four 128-bit lanes: twice, pairing lanes (0, 1) and (2, 3).
            let (a, b) = (fold_lanes_512(s[0], s[1]), fold_lanes_512(s[2], s[3]));
            fold_lanes_512(a, b)
        }
    }
    #[inline(always)]
    fn pow2_rounded(self, rounded: __m512) -> __m512 {
        let bias = 127i32.wrapping_sub(EXP2_ROUND.to_bits() as i32);
        unsafe {
            let bits = _mm512_add_epi32(_mm512_castps_si512(rounded), _mm512_set1_epi32(bias));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits))
        }
    }
    #[inline(always)]
    fn mul_add_f32(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// AVX2 + FMA token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2Fma {
    _detected: (),
}

impl Avx2Fma {
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Self {
        Avx2Fma { _detected: () }
    }
}

/// Applies a two-operand ymm intrinsic to both halves.
macro_rules! halves {
    ($f:ident, $a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        unsafe { [$f(a[0], b[0]), $f(a[1], b[1])] }
    }};
}

// SAFETY (for every `unsafe` block in this impl): an `Avx2Fma` exists only on a CPU with AVX2
// and FMA (`new_unchecked`'s contract); loads and stores are bounds-checked first.
impl Simd for Avx2Fma {
    type V = [__m256; 2];

    // With two ymm per vector, 6 keys (12 ymm of scores) + a query vector, 6 dims of P·V
    // (12 ymm) + a probability vector + a broadcast, or 2 x 2 output accumulators + 2 V
    // vectors fit the 16 ymm registers. A chunk is 24 keys, scored 6 at a time and kept in
    // L1, so the output accumulators are rescaled, loaded and stored once per 24 keys. Against
    // 4-key chunks scored in registers (4 dims of P·V), AVX2 prefill attention ran 1.15-1.19x
    // faster (`attn` rows of `cargo bench -p kernels --bench paged_attention`).
    const KEYS: usize = 6;
    const WIDE_CHUNK: usize = 24;
    const WIDE_DIMS: usize = 6;
    const NARROW_ROWS: usize = 2;
    const NARROW_CHUNKS: usize = 2;
    // The query's 4 vectors (8 ymm) + a score accumulator fit: one pass over each K row, not
    // two that reload and store every key's accumulator (decode attention 1.03-1.05x).
    const NARROW_SCORE_CHUNKS: usize = 4;

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        let v = unsafe { _mm256_set1_ps(x) };
        [v, v]
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> Self::V {
        let src = &src[..LANES];
        unsafe {
            [
                _mm256_loadu_ps(src.as_ptr()),
                _mm256_loadu_ps(src[8..].as_ptr()),
            ]
        }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: Self::V) {
        let dst = &mut dst[..LANES];
        unsafe {
            _mm256_storeu_ps(dst.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(dst[8..].as_mut_ptr(), v[1]);
        }
    }
    #[inline(always)]
    unsafe fn load_ptr(self, src: *const f32) -> Self::V {
        // SAFETY: the caller promises LANES readable f32 at `src`.
        unsafe { [_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))] }
    }
    #[inline(always)]
    unsafe fn store_ptr(self, dst: *mut f32, v: Self::V) {
        // SAFETY: the caller promises LANES writable f32 at `dst`.
        unsafe {
            _mm256_storeu_ps(dst, v[0]);
            _mm256_storeu_ps(dst.add(8), v[1]);
        }
    }
    #[inline(always)]
    unsafe fn load_bf16_ptr(self, src: *const u16) -> Self::V {
        // SAFETY: the caller promises LANES readable u16 at `src`; AVX2 is this type's
        // invariant.
        unsafe {
            let lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.cast()));
            let hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.add(8).cast()));
            [
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo)),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi)),
            ]
        }
    }
    #[inline(always)]
    fn add(self, a: Self::V, b: Self::V) -> Self::V {
        halves!(_mm256_add_ps, a, b)
    }
    #[inline(always)]
    fn sub(self, a: Self::V, b: Self::V) -> Self::V {
        halves!(_mm256_sub_ps, a, b)
    }
    #[inline(always)]
    fn mul(self, a: Self::V, b: Self::V) -> Self::V {
        halves!(_mm256_mul_ps, a, b)
    }
    #[inline(always)]
    fn div(self, a: Self::V, b: Self::V) -> Self::V {
        halves!(_mm256_div_ps, a, b)
    }
    #[inline(always)]
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        unsafe {
            [
                _mm256_fmadd_ps(a[0], b[0], c[0]),
                _mm256_fmadd_ps(a[1], b[1], c[1]),
            ]
        }
    }
    #[inline(always)]
    fn max(self, a: Self::V, b: Self::V) -> Self::V {
        halves!(_mm256_max_ps, a, b)
    }
    #[inline(always)]
    fn select_le(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V {
        unsafe {
            let lo = _mm256_cmp_ps::<_CMP_LE_OQ>(a[0], b[0]);
            let hi = _mm256_cmp_ps::<_CMP_LE_OQ>(a[1], b[1]);
            [
                _mm256_blendv_ps(y[0], x[0], lo),
                _mm256_blendv_ps(y[1], x[1], hi),
            ]
        }
    }
    #[inline(always)]
    fn reduce_add(self, v: Self::V) -> f32 {
        unsafe {
            let v = _mm256_add_ps(v[0], v[1]);
            let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps::<0b01>(d, d)))
        }
    }
    #[inline(always)]
    fn dot_group<const R: usize>(
        self,
        q: &[f32],
        d: usize,
        rows: &[&[f32]; LANES],
        out: &mut [Self::V; R],
    ) -> bool {
        if !(1..=3).contains(&R)
            || !d.is_multiple_of(8)
            || q.len() < R * d
            || rows.iter().any(|r| r.len() < d)
        {
            return false;
        }
        // Every (vector, key) sum takes the same steps whatever R is, so a vector's scores do
        // not depend on which others it was scored with (a seeded request gives the same
        // tokens alone and in any batch).
        if R == 1 {
            // One vector: eight keys at a time, for eight FMA chains rather than four.
            // SAFETY: q holds d elements and every row d (checked), read in whole ymm.
            unsafe {
                out[0] = [dot_8(q, d, &rows[..8]), dot_8(q, d, &rows[8..])];
            }
            return true;
        }
        // SAFETY: q holds R vectors of d and every row d elements (checked), read in whole ymm.
        unsafe {
            let mut quads = [[_mm_setzero_ps(); 4]; R];
            for (g, four) in rows.chunks_exact(4).enumerate() {
                let p = [
                    four[0].as_ptr(),
                    four[1].as_ptr(),
                    four[2].as_ptr(),
                    four[3].as_ptr(),
                ];
                let mut acc = [[_mm256_setzero_ps(); 4]; R];
                let mut c = 0;
                while c < d {
                    for (j, p) in p.iter().enumerate() {
                        let k = _mm256_loadu_ps(p.add(c));
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let qv = _mm256_loadu_ps(q.as_ptr().add(r * d + c));
                            acc[j] = _mm256_fmadd_ps(qv, k, acc[j]);
                        }
                    }
                    c += 8;
                }
                for (quad, acc) in quads.iter_mut().zip(&acc) {
                    quad[g] = reduce_add_4_256(acc);
                }
            }
            for (o, quad) in out.iter_mut().zip(&quads) {
                *o = [
                    _mm256_set_m128(quad[1], quad[0]),
                    _mm256_set_m128(quad[3], quad[2]),
                ];
            }
        }
        true
    }
    #[inline(always)]
    fn reduce_add_16(self, v: &[Self::V; LANES]) -> Self::V {
        unsafe {
            // Sum the halves, then reduce eight ymm vectors to one, twice.
            let h: [__m256; LANES] = [
                _mm256_add_ps(v[0][0], v[0][1]),
                _mm256_add_ps(v[1][0], v[1][1]),
                _mm256_add_ps(v[2][0], v[2][1]),
                _mm256_add_ps(v[3][0], v[3][1]),
                _mm256_add_ps(v[4][0], v[4][1]),
                _mm256_add_ps(v[5][0], v[5][1]),
                _mm256_add_ps(v[6][0], v[6][1]),
                _mm256_add_ps(v[7][0], v[7][1]),
                _mm256_add_ps(v[8][0], v[8][1]),
                _mm256_add_ps(v[9][0], v[9][1]),
                _mm256_add_ps(v[10][0], v[10][1]),
                _mm256_add_ps(v[11][0], v[11][1]),
                _mm256_add_ps(v[12][0], v[12][1]),
                _mm256_add_ps(v[13][0], v[13][1]),
                _mm256_add_ps(v[14][0], v[14][1]),
                _mm256_add_ps(v[15][0], v[15][1]),
            ];
            [reduce_add_8_256(&h[..8]), reduce_add_8_256(&h[8..])]
        }
    }
    #[inline(always)]
    fn reduce_max(self, v: Self::V) -> f32 {
        unsafe {
            let v = _mm256_max_ps(v[0], v[1]);
            let q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let d = _mm_max_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_max_ss(d, _mm_shuffle_ps::<0b01>(d, d)))
        }
    }
    #[inline(always)]
    fn pow2_rounded(self, rounded: Self::V) -> Self::V {
        let bias = 127i32.wrapping_sub(EXP2_ROUND.to_bits() as i32);
        unsafe {
            let bias = _mm256_set1_epi32(bias);
            let lo = _mm256_add_epi32(_mm256_castps_si256(rounded[0]), bias);
            let hi = _mm256_add_epi32(_mm256_castps_si256(rounded[1]), bias);
            [
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(lo)),
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(hi)),
            ]
        }
    }
    #[inline(always)]
    fn mul_add_f32(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// Lanes `[a0 + a1, a2 + a3, b0 + b1, b2 + b3]` of 128-bit lanes `a0..a3` of `a` and
/// `b0..b3` of `b`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline(always)]
unsafe fn fold_lanes_512(a: __m512, b: __m512) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    }
}

/// Lane `j` of the result is the sum of the lanes of `h[j]`, for eight ymm vectors.
///
/// # Safety
/// The CPU must support AVX; `h` must hold eight vectors.
#[inline(always)]
unsafe fn reduce_add_8_256(h: &[__m256]) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        let u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        )
    }
}

/// Lane `j` is `q[..d] · rows[j][..d]` for 8 rows, summed in the same steps as each
/// (vector, key) of [`Avx2Fma::dot_group`] with several vectors: an FMA chain along `d` from
/// zero, then the lanes pairwise.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `d` is a multiple of 8 and `q` and the 8 rows hold `d`.
#[inline(always)]
unsafe fn dot_8(q: &[f32], d: usize, rows: &[&[f32]]) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < d {
            let qv = _mm256_loadu_ps(q.as_ptr().add(c));
            for (a, row) in acc.iter_mut().zip(rows) {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(row.as_ptr().add(c)), *a);
            }
            c += 8;
        }
        reduce_add_8_256(&acc)
    }
}

/// Lane `j` of the result is the sum of the lanes of `h[j]`.
///
/// # Safety
/// The CPU must support AVX.
#[inline(always)]
unsafe fn reduce_add_4_256(h: &[__m256; 4]) -> __m128 {
    // SAFETY: the caller's contract.
    unsafe {
        let u = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{exp2, pow2_rounded_f32, Isa, Portable, IOTA};

    /// Every operation of `s` against the portable implementation, lane by lane.
    fn matches_portable<S: Simd>(s: S) {
        let a: [f32; LANES] = std::array::from_fn(|i| (i as f32 * 0.9).sin() * 3.0);
        let b: [f32; LANES] = std::array::from_fn(|i| (i as f32 * 0.4).cos() * 3.0);
        let c: [f32; LANES] = std::array::from_fn(|i| i as f32 - 7.5);
        let p = Portable;
        let unload = |v: S::V| {
            let mut out = [0.0f32; LANES];
            s.store(&mut out, v);
            out
        };
        let (va, vb, vc) = (s.load(&a), s.load(&b), s.load(&c));
        assert_eq!(unload(s.add(va, vb)), p.add(a, b));
        assert_eq!(unload(s.sub(va, vb)), p.sub(a, b));
        assert_eq!(unload(s.mul(va, vb)), p.mul(a, b));
        assert_eq!(unload(s.max(va, vb)), p.max(a, b));
        assert_eq!(unload(s.splat(2.5)), [2.5; LANES]);
        assert_eq!(
            unload(s.select_le(s.load(&IOTA), s.splat(6.0), va, vb)),
            p.select_le(IOTA, [6.0; LANES], a, b)
        );
        let fused: [f32; LANES] = std::array::from_fn(|l| a[l].mul_add(b[l], c[l]));
        assert_eq!(unload(s.mul_add(va, vb, vc)), fused);
        assert!((s.reduce_add(va) - p.reduce_add(a)).abs() < 1e-5);
        assert_eq!(s.reduce_max(va), p.reduce_max(a));
        let many: [[f32; LANES]; LANES] =
            std::array::from_fn(|j| std::array::from_fn(|l| ((j * 37 + l * 11) % 23) as f32));
        let vs: [S::V; LANES] = std::array::from_fn(|j| s.load(&many[j]));
        assert_eq!(unload(s.reduce_add_16(&vs)), p.reduce_add_16(&many));
        let x: [f32; LANES] = std::array::from_fn(|i| -(i as f32) * 7.3 - 0.3);
        let got = unload(exp2(s, s.load(&x)));
        let want = exp2(p, x);
        for l in 0..LANES {
            assert!(
                (got[l] - want[l]).abs() <= 1e-6 * want[l],
                "lane {l}: {} vs {}",
                got[l],
                want[l]
            );
        }
    }

    #[test]
    fn avx512_matches_portable() {
        if Isa::available().contains(&Isa::Avx512) {
            // SAFETY: detected above.
            matches_portable(unsafe { Avx512::new_unchecked() });
        } else {
            eprintln!("skipping: this CPU has no AVX-512F");
        }
    }

    #[test]
    fn avx2_matches_portable() {
        if Isa::available().contains(&Isa::Avx2Fma) {
            // SAFETY: detected above.
            matches_portable(unsafe { Avx2Fma::new_unchecked() });
        } else {
            eprintln!("skipping: this CPU has no AVX2+FMA");
        }
    }

    /// AVX2's grouped scores: right, and the same bits for a vector whatever group it is in.
    #[test]
    fn avx2_group_scores_do_not_depend_on_the_group() {
        if !Isa::available().contains(&Isa::Avx2Fma) {
            return;
        }
        // SAFETY: detected above.
        let s = unsafe { Avx2Fma::new_unchecked() };
        for d in [8, 64, 72] {
            let val = |i: usize| ((i * 7919) % 1000) as f32 / 333.0 - 1.4;
            let q: Vec<f32> = (0..3 * d).map(val).collect();
            let keys: Vec<Vec<f32>> = (0..LANES)
                .map(|j| (0..d + 5).map(|i| val(i * 31 + j * 17 + 3)).collect())
                .collect();
            let rows: [&[f32]; LANES] = std::array::from_fn(|j| &keys[j][..]);
            let bits = |v: [__m256; 2]| -> Vec<u32> {
                let mut out = [0.0f32; LANES];
                s.store(&mut out, v);
                out.iter().map(|x| x.to_bits()).collect()
            };
            let mut three = [s.splat(0.0); 3];
            assert!(s.dot_group::<3>(&q, d, &rows, &mut three));
            for r in 0..3 {
                let mut one = [s.splat(0.0); 1];
                assert!(s.dot_group::<1>(&q[r * d..], d, &rows, &mut one));
                assert_eq!(bits(one[0]), bits(three[r]), "d {d}, vector {r} alone");
                if r < 2 {
                    let mut two = [s.splat(0.0); 2];
                    assert!(s.dot_group::<2>(&q[r * d..], d, &rows, &mut two));
                    assert_eq!(bits(two[0]), bits(three[r]), "d {d}, vector {r} of two");
                }
                let mut got = [0.0f32; LANES];
                s.store(&mut got, three[r]);
                for (j, g) in got.iter().enumerate() {
                    let want: f64 = (0..d)
                        .map(|i| f64::from(q[r * d + i]) * f64::from(keys[j][i]))
                        .sum();
                    assert!((f64::from(*g) - want).abs() < 1e-4, "d {d}: {g} vs {want}");
                }
            }
            // Head dims that are not whole ymm are left to the caller.
            let mut one = [s.splat(0.0); 1];
            assert!(!s.dot_group::<1>(&q, 20, &rows, &mut one));
        }
    }

    #[test]
    fn pow2_encoding_is_exact() {
        for n in -126..=0 {
            assert_eq!(pow2_rounded_f32(n as f32 + EXP2_ROUND), 2f32.powi(n));
        }
    }
}
