//! [`QDot`] for x86-64: AVX-512 with VNNI, and AVX-512BW. (AVX2's kernel is
//! [`crate::q8_avx2`].)
//!
//! Every method is `#[inline(always)]` so that it compiles, inside the `#[target_feature]`
//! wrapper of the GEMM task, to the few instructions it names. The tokens can only be made by
//! `unsafe fn new_unchecked`, whose contract is that the CPU has the features; that is the
//! invariant every `unsafe` block below relies on.

use std::arch::x86_64::*;

use crate::q8_simd::QDot;

/// AVX-512F/BW + VNNI token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QVnni {
    _detected: (),
}

impl QVnni {
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX512-VNNI.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Self {
        QVnni { _detected: () }
    }
}

// SAFETY (every `unsafe` block in this impl): a `QVnni` exists only on a CPU with AVX-512F,
// AVX-512BW and VNNI; pointer validity is the caller's contract on the unsafe methods.
impl QDot for QVnni {
    type I = __m512i;
    type F = __m512;
    type W = __m512i;

    #[inline(always)]
    fn zero_f(self) -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_scales(self, p: *const u16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_group(self, p: *const u8) -> __m512i {
        unsafe { _mm512_load_si512(p.cast()) }
    }
    #[inline(always)]
    fn seed(self, comp: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(comp) }
    }
    #[inline(always)]
    fn dot(self, acc: __m512i, w: __m512i, a: i32) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a)) }
    }
    #[inline(always)]
    fn fold(self, acc: __m512, dot: __m512i, w_scale: __m512, a_scale: f32) -> __m512 {
        unsafe {
            let s = _mm512_mul_ps(w_scale, _mm512_set1_ps(a_scale));
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc)
        }
    }
}

/// AVX-512F/BW token (no VNNI).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QAvx512Bw {
    _detected: (),
}

impl QAvx512Bw {
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512BW.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Self {
        QAvx512Bw { _detected: () }
    }
}

// SAFETY (every `unsafe` block in this impl): a `QAvx512Bw` exists only on a CPU with
// AVX-512F and AVX-512BW; pointer validity is the caller's contract on the unsafe methods.
impl QDot for QAvx512Bw {
    type I = __m512i;
    type F = __m512;
    /// Signed weights (the offset flipped back).
    type W = __m512i;

    #[inline(always)]
    fn zero_f(self) -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_scales(self, p: *const u16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_group(self, p: *const u8) -> __m512i {
        // w + 128 (mod 256) xor 0x80 is w.
        unsafe { _mm512_xor_si512(_mm512_load_si512(p.cast()), _mm512_set1_epi8(-128)) }
    }
    #[inline(always)]
    fn seed(self, _comp: i32) -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    fn dot(self, acc: __m512i, w: __m512i, a: i32) -> __m512i {
        unsafe {
            let a = _mm512_set1_epi32(a);
            // No vpsignb on zmm: negate the weights where the activation is negative.
            let neg = _mm512_movepi8_mask(a);
            let w = _mm512_mask_sub_epi8(w, neg, _mm512_setzero_si512(), w);
            let pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(a), w);
            _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
        }
    }
    #[inline(always)]
    fn fold(self, acc: __m512, dot: __m512i, w_scale: __m512, a_scale: f32) -> __m512 {
        unsafe {
            let s = _mm512_mul_ps(w_scale, _mm512_set1_ps(a_scale));
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc)
        }
    }
}
