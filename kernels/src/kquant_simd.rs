//! The vocabulary of the k-quant GEMM ([`crate::kquant_gemm`]) for each instruction set: a
//! 64-byte line of packed nibbles unpacked into one group of unsigned weights (16 columns × 4
//! inputs), its four-way dot products against 4 signed activations, and the per-sub-block f32
//! scaling.
//!
//! The weights are unsigned (0..64), so unlike the Q8 GEMM no instruction set needs a sign
//! trick: VNNI's `vpdpbusd` takes them as they are, AVX-512BW and AVX2 use `maddubs` (u8 × i8
//! pairs, at most 2 · 63 · 128 < 2^15, so never saturating) then `madd` by ones. AVX2 holds
//! the 16 columns in two ymm halves. Shifts are on 16-bit lanes (x86 has no byte shifts); the
//! masks keep only bits no neighbouring byte reaches (see [`KDot::top`]), so the portable
//! byte-wise version computes the same bytes.

use crate::simd::LANES;

/// 16 columns' unsigned-by-signed int8 dot products and their f32 accumulation.
pub(crate) trait KDot: Copy {
    /// 64 bytes of weights.
    type W: Copy;
    /// 16 i32.
    type I: Copy;
    /// 16 f32.
    type F: Copy;

    /// # Safety
    /// `p` must be valid for reading 64 bytes.
    unsafe fn load_w(self, p: *const u8) -> Self::W;
    /// Each byte's low nibble.
    fn lo(self, w: Self::W) -> Self::W;
    /// Each byte's high nibble.
    fn hi(self, w: Self::W) -> Self::W;
    /// Each byte's `bits` bits from `shift`, moved to bits 4.. (`shift + bits <= 8`, `bits`
    /// 1 or 2): with 16-bit shifts, a right shift by `shift` brings the next byte's low bits
    /// only into bits `8 - shift..8`, above the kept ones.
    fn top(self, h: Self::W, shift: u32, bits: u32) -> Self::W;
    fn or(self, a: Self::W, b: Self::W) -> Self::W;
    fn seed(self, v: i32) -> Self::I;
    /// `acc + w · a` per column, `a` being 4 signed activations (little-endian bytes).
    fn dot(self, acc: Self::I, w: Self::W, a: i32) -> Self::I;
    fn zero_f(self) -> Self::F;
    /// # Safety
    /// `p` must be valid for reading 16 f32.
    unsafe fn load_f(self, p: *const f32) -> Self::F;
    /// # Safety
    /// `p` must be valid for writing 16 f32.
    unsafe fn store_f(self, p: *mut f32, v: Self::F);
    /// 16 f16, widened.
    ///
    /// # Safety
    /// `p` must be valid for reading 32 bytes.
    unsafe fn load_h(self, p: *const u8) -> Self::F;
    /// 16 u8, widened.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 bytes.
    unsafe fn load_u8(self, p: *const u8) -> Self::F;
    /// 16 i8, widened.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 bytes.
    unsafe fn load_i8(self, p: *const u8) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    /// `acc + f32(dot) * (s * a_scale)`.
    fn fold(self, acc: Self::F, dot: Self::I, s: Self::F, a_scale: f32) -> Self::F;
    /// `acc - mn * x`.
    fn sub_min(self, acc: Self::F, mn: Self::F, x: f32) -> Self::F;
}

/// Plain loops over arrays.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KPortable;

impl KDot for KPortable {
    type W = [u8; 64];
    type I = [i32; LANES];
    type F = [f32; LANES];

    #[inline(always)]
    unsafe fn load_w(self, p: *const u8) -> Self::W {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::read_unaligned(p.cast()) }
    }
    #[inline(always)]
    fn lo(self, w: Self::W) -> Self::W {
        w.map(|b| b & 0xF)
    }
    #[inline(always)]
    fn hi(self, w: Self::W) -> Self::W {
        w.map(|b| b >> 4)
    }
    #[inline(always)]
    fn top(self, h: Self::W, shift: u32, bits: u32) -> Self::W {
        h.map(|b| ((b >> shift) & ((1 << bits) - 1)) << 4)
    }
    #[inline(always)]
    fn or(self, a: Self::W, b: Self::W) -> Self::W {
        std::array::from_fn(|i| a[i] | b[i])
    }
    #[inline(always)]
    fn seed(self, v: i32) -> Self::I {
        [v; LANES]
    }
    #[inline(always)]
    fn dot(self, mut acc: Self::I, w: Self::W, a: i32) -> Self::I {
        let a = a.to_le_bytes();
        for (c, acc) in acc.iter_mut().enumerate() {
            for (j, &a) in a.iter().enumerate() {
                *acc += i32::from(w[c * 4 + j]) * i32::from(a as i8);
            }
        }
        acc
    }
    #[inline(always)]
    fn zero_f(self) -> Self::F {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> Self::F {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::read_unaligned(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: Self::F) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_unaligned(p.cast(), v) }
    }
    #[inline(always)]
    unsafe fn load_h(self, p: *const u8) -> Self::F {
        // SAFETY: the caller's contract.
        let bits: [u16; LANES] = unsafe { std::ptr::read_unaligned(p.cast()) };
        bits.map(|b| half::f16::from_bits(u16::from_le(b)).to_f32())
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> Self::F {
        // SAFETY: the caller's contract.
        let b: [u8; LANES] = unsafe { std::ptr::read_unaligned(p.cast()) };
        b.map(f32::from)
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const u8) -> Self::F {
        // SAFETY: the caller's contract.
        let b: [i8; LANES] = unsafe { std::ptr::read_unaligned(p.cast()) };
        b.map(f32::from)
    }
    #[inline(always)]
    fn mul(self, a: Self::F, b: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    fn fold(self, acc: Self::F, dot: Self::I, s: Self::F, a_scale: f32) -> Self::F {
        std::array::from_fn(|l| acc[l] + dot[l] as f32 * (s[l] * a_scale))
    }
    #[inline(always)]
    fn sub_min(self, acc: Self::F, mn: Self::F, x: f32) -> Self::F {
        std::array::from_fn(|l| acc[l] - mn[l] * x)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{KAvx2, KAvx512Bw, KVnni};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::KDot;

    /// The AVX-512 operations both zmm tokens share.
    macro_rules! zmm_common {
        () => {
            type W = __m512i;
            type I = __m512i;
            type F = __m512;

            #[inline(always)]
            unsafe fn load_w(self, p: *const u8) -> __m512i {
                unsafe { _mm512_loadu_si512(p.cast()) }
            }
            #[inline(always)]
            fn lo(self, w: __m512i) -> __m512i {
                unsafe { _mm512_and_si512(w, _mm512_set1_epi8(0xF)) }
            }
            #[inline(always)]
            fn hi(self, w: __m512i) -> __m512i {
                unsafe { _mm512_and_si512(_mm512_srli_epi16::<4>(w), _mm512_set1_epi8(0xF)) }
            }
            #[inline(always)]
            fn top(self, h: __m512i, shift: u32, bits: u32) -> __m512i {
                unsafe {
                    let s = _mm512_srl_epi16(h, _mm_cvtsi32_si128(shift as i32));
                    let m = _mm512_and_si512(s, _mm512_set1_epi8(((1u32 << bits) - 1) as i8));
                    _mm512_slli_epi16::<4>(m)
                }
            }
            #[inline(always)]
            fn or(self, a: __m512i, b: __m512i) -> __m512i {
                unsafe { _mm512_or_si512(a, b) }
            }
            #[inline(always)]
            fn seed(self, v: i32) -> __m512i {
                unsafe { _mm512_set1_epi32(v) }
            }
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
            unsafe fn load_h(self, p: *const u8) -> __m512 {
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
            }
            #[inline(always)]
            unsafe fn load_u8(self, p: *const u8) -> __m512 {
                unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))) }
            }
            #[inline(always)]
            unsafe fn load_i8(self, p: *const u8) -> __m512 {
                unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
            }
            #[inline(always)]
            fn mul(self, a: __m512, b: __m512) -> __m512 {
                unsafe { _mm512_mul_ps(a, b) }
            }
            #[inline(always)]
            fn fold(self, acc: __m512, dot: __m512i, s: __m512, a_scale: f32) -> __m512 {
                unsafe {
                    let s = _mm512_mul_ps(s, _mm512_set1_ps(a_scale));
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc)
                }
            }
            #[inline(always)]
            fn sub_min(self, acc: __m512, mn: __m512, x: f32) -> __m512 {
                unsafe { _mm512_fnmadd_ps(mn, _mm512_set1_ps(x), acc) }
            }
        };
    }

    /// AVX-512F/BW + VNNI token.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct KVnni {
        _detected: (),
    }

    impl KVnni {
        /// # Safety
        /// The CPU must support AVX-512F/BW, AVX512-VNNI, AVX2, FMA and F16C.
        #[inline(always)]
        pub(crate) unsafe fn new_unchecked() -> Self {
            KVnni { _detected: () }
        }
    }

    // SAFETY (every `unsafe` block): a `KVnni` exists only on a CPU with its features;
    // pointer validity is the caller's contract on the unsafe methods.
    impl KDot for KVnni {
        zmm_common!();

        #[inline(always)]
        fn dot(self, acc: __m512i, w: __m512i, a: i32) -> __m512i {
            unsafe { _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a)) }
        }
    }

    /// AVX-512F/BW token (no VNNI).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct KAvx512Bw {
        _detected: (),
    }

    impl KAvx512Bw {
        /// # Safety
        /// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
        #[inline(always)]
        pub(crate) unsafe fn new_unchecked() -> Self {
            KAvx512Bw { _detected: () }
        }
    }

    // SAFETY (every `unsafe` block): as for `KVnni`.
    impl KDot for KAvx512Bw {
        zmm_common!();

        #[inline(always)]
        fn dot(self, acc: __m512i, w: __m512i, a: i32) -> __m512i {
            unsafe {
                let pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(a));
                _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
            }
        }
    }

    /// AVX2 + FMA + F16C token: 16 columns in two ymm halves.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct KAvx2 {
        _detected: (),
    }

    impl KAvx2 {
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline(always)]
        pub(crate) unsafe fn new_unchecked() -> Self {
            KAvx2 { _detected: () }
        }
    }

    // SAFETY (every `unsafe` block): as for `KVnni`, with AVX2, FMA and F16C.
    impl KDot for KAvx2 {
        type W = [__m256i; 2];
        type I = [__m256i; 2];
        type F = [__m256; 2];

        #[inline(always)]
        unsafe fn load_w(self, p: *const u8) -> Self::W {
            unsafe {
                [
                    _mm256_loadu_si256(p.cast()),
                    _mm256_loadu_si256(p.add(32).cast()),
                ]
            }
        }
        #[inline(always)]
        fn lo(self, w: Self::W) -> Self::W {
            unsafe {
                let m = _mm256_set1_epi8(0xF);
                [_mm256_and_si256(w[0], m), _mm256_and_si256(w[1], m)]
            }
        }
        #[inline(always)]
        fn hi(self, w: Self::W) -> Self::W {
            unsafe {
                let m = _mm256_set1_epi8(0xF);
                [
                    _mm256_and_si256(_mm256_srli_epi16::<4>(w[0]), m),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(w[1]), m),
                ]
            }
        }
        #[inline(always)]
        fn top(self, h: Self::W, shift: u32, bits: u32) -> Self::W {
            unsafe {
                let count = _mm_cvtsi32_si128(shift as i32);
                let mask = _mm256_set1_epi8(((1u32 << bits) - 1) as i8);
                [
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(h[0], count), mask)),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(h[1], count), mask)),
                ]
            }
        }
        #[inline(always)]
        fn or(self, a: Self::W, b: Self::W) -> Self::W {
            unsafe { [_mm256_or_si256(a[0], b[0]), _mm256_or_si256(a[1], b[1])] }
        }
        #[inline(always)]
        fn seed(self, v: i32) -> Self::I {
            unsafe { [_mm256_set1_epi32(v); 2] }
        }
        #[inline(always)]
        fn dot(self, acc: Self::I, w: Self::W, a: i32) -> Self::I {
            unsafe {
                let a = _mm256_set1_epi32(a);
                let ones = _mm256_set1_epi16(1);
                [
                    _mm256_add_epi32(
                        acc[0],
                        _mm256_madd_epi16(_mm256_maddubs_epi16(w[0], a), ones),
                    ),
                    _mm256_add_epi32(
                        acc[1],
                        _mm256_madd_epi16(_mm256_maddubs_epi16(w[1], a), ones),
                    ),
                ]
            }
        }
        #[inline(always)]
        fn zero_f(self) -> Self::F {
            unsafe { [_mm256_setzero_ps(); 2] }
        }
        #[inline(always)]
        unsafe fn load_f(self, p: *const f32) -> Self::F {
            unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
        }
        #[inline(always)]
        unsafe fn store_f(self, p: *mut f32, v: Self::F) {
            unsafe {
                _mm256_storeu_ps(p, v[0]);
                _mm256_storeu_ps(p.add(8), v[1]);
            }
        }
        #[inline(always)]
        unsafe fn load_h(self, p: *const u8) -> Self::F {
            unsafe {
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                ]
            }
        }
        #[inline(always)]
        unsafe fn load_u8(self, p: *const u8) -> Self::F {
            unsafe {
                [
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast()))),
                ]
            }
        }
        #[inline(always)]
        unsafe fn load_i8(self, p: *const u8) -> Self::F {
            unsafe {
                [
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8).cast()))),
                ]
            }
        }
        #[inline(always)]
        fn mul(self, a: Self::F, b: Self::F) -> Self::F {
            unsafe { [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])] }
        }
        #[inline(always)]
        fn fold(self, acc: Self::F, dot: Self::I, s: Self::F, a_scale: f32) -> Self::F {
            unsafe {
                let a = _mm256_set1_ps(a_scale);
                [
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0]), _mm256_mul_ps(s[0], a), acc[0]),
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1]), _mm256_mul_ps(s[1], a), acc[1]),
                ]
            }
        }
        #[inline(always)]
        fn sub_min(self, acc: Self::F, mn: Self::F, x: f32) -> Self::F {
            unsafe {
                let x = _mm256_set1_ps(x);
                [
                    _mm256_fnmadd_ps(mn[0], x, acc[0]),
                    _mm256_fnmadd_ps(mn[1], x, acc[1]),
                ]
            }
        }
    }
}
