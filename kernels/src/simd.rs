//! Runtime SIMD dispatch and the vector vocabulary the attention kernels are written in.
//!
//! The crate is compiled for baseline x86-64, so wide instructions may only run inside
//! functions marked `#[target_feature]`. The kernels are written once as `#[inline(always)]`
//! generic code over [`Simd`], a vector of [`LANES`] f32 with a dozen operations; each ISA's
//! `#[target_feature]` wrapper (in `tile_dispatch.rs`, `gemm.rs`, `activation.rs`) instantiates
//! them with its own implementation (x86's are in `simd_x86.rs`, which builds on this file), and
//! [`Isa::detect`] picks the wrapper once per process.
//!
//! Why explicit vectors rather than plain loops over `[f32; 16]`: LLVM's auto-vectorizer turned
//! the nested accumulator loops of the micro-kernels into gathers and scatters (measured: as
//! slow as the scalar reference). With one operation per vector instruction, the accumulators
//! provably live in registers and every FMA is one instruction.
//!
//! An implementation of [`Simd`] is a token: a value exists only once the CPU has been checked
//! for its features, which is what makes its safe methods sound.

use std::sync::OnceLock;

/// Lanes in one vector: 16 f32 is one AVX-512 register (two AVX2 registers).
pub(crate) const LANES: usize = 16;

/// Asks for the cache line at `p` to be brought into L2 ahead of its use. Any address is
/// allowed: a prefetch reads nothing architecturally and cannot fault. The T1 hint (L2) is
/// the one the GEMM measured best; T0 and T2 were slower there.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The widest instruction set an operator allows the kernels, from `FISSION_MAX_ISA`:
/// `avx512`, `avx2` or `portable` (unset, or any other value: no cap). It exists so that the
/// path a CPU without AVX-512 takes can be measured, and served, on one that has it, as
/// oneDNN's `ONEDNN_MAX_CPU_ISA` allows; the engine benchmark's `ISA=avx2` runs use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum IsaCap {
    Portable,
    Avx2,
    Avx512,
}

impl IsaCap {
    /// The cap this process runs under, read once.
    pub(crate) fn get() -> IsaCap {
        static CAP: OnceLock<IsaCap> = OnceLock::new();
        *CAP.get_or_init(|| IsaCap::parse(std::env::var("FISSION_MAX_ISA").ok().as_deref()))
    }

    fn parse(value: Option<&str>) -> IsaCap {
        match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            Some("avx2") => IsaCap::Avx2,
            Some("portable") => IsaCap::Portable,
            _ => IsaCap::Avx512,
        }
    }
}

/// Whether code outside the kernels may run AVX2 paths: the CPU has AVX2 and FMA and
/// `FISSION_MAX_ISA` allows them. Loops elsewhere (the sampler's pass over the vocabulary)
/// compile a copy for AVX2 and pick it with this, so one cap governs every vector path.
pub fn avx2_allowed() -> bool {
    Isa::detect() != Isa::Portable
}

/// Instruction sets the kernels have been instantiated for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F with FMA: 32 zmm registers.
    Avx512,
    /// AVX2 with FMA: 16 ymm registers.
    Avx2Fma,
    /// Whatever the compile target guarantees (SSE2 on x86-64, NEON on aarch64).
    Portable,
}

impl Isa {
    /// The best instruction set this CPU supports, detected once per process.
    pub(crate) fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let cap = IsaCap::get();
                let avx2_fma = cap >= IsaCap::Avx2
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma");
                if avx2_fma && cap >= IsaCap::Avx512 && is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if avx2_fma {
                    return Isa::Avx2Fma;
                }
            }
            Isa::Portable
        })
    }

    /// Every instruction set this CPU can run, best first; tests compare all of them.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let all = [Isa::Avx512, Isa::Avx2Fma, Isa::Portable];
        let best = all.iter().position(|&i| i == Isa::detect()).unwrap_or(2);
        all[best..].to_vec()
    }
}

/// A vector of [`LANES`] f32 and the operations the kernels need, for one instruction set.
pub(crate) trait Simd: Copy {
    type V: Copy;

    /// Keys whose score vectors the wide path accumulates in registers at once (16, 6 or 4).
    const KEYS: usize;
    /// Keys per chunk on the wide path (16, 24 or 4, a multiple of `KEYS`): one online-softmax
    /// rescale and one pass over the output accumulators per chunk.
    const WIDE_CHUNK: usize;
    /// Output dims the wide path's P·V updates at once (independent FMA chains per key).
    const WIDE_DIMS: usize;
    /// Query vectors the narrow path's P·V updates at once (at most 4).
    const NARROW_ROWS: usize;
    /// Vectors of `head_dim` the narrow path keeps per query vector at once (at most 4).
    const NARROW_CHUNKS: usize;
    /// Vectors of `head_dim` of the query the narrow path's scores keep in registers (at most 4).
    const NARROW_SCORE_CHUNKS: usize;

    fn splat(self, x: f32) -> Self::V;
    /// The first `LANES` elements of `src` (which must hold that many).
    fn load(self, src: &[f32]) -> Self::V;
    /// Into the first `LANES` elements of `dst` (which must hold that many).
    fn store(self, dst: &mut [f32], v: Self::V);
    /// [`Simd::load`] without the bounds check, for the GEMM's inner loop, where a check per
    /// load would cost as much front-end bandwidth as the FMAs themselves.
    ///
    /// # Safety
    /// `src` must be valid for reading `LANES` f32.
    unsafe fn load_ptr(self, src: *const f32) -> Self::V;
    /// [`Simd::store`] without the bounds check.
    ///
    /// # Safety
    /// `dst` must be valid for writing `LANES` f32.
    unsafe fn store_ptr(self, dst: *mut f32, v: Self::V);
    /// `LANES` bf16 (as their bit patterns) widened to f32: exact, a shift of each into the
    /// high half of an f32, so bf16 weights cost no accuracy beyond their own rounding.
    ///
    /// # Safety
    /// `src` must be valid for reading `LANES` u16.
    unsafe fn load_bf16_ptr(self, src: *const u16) -> Self::V;
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, fused where the ISA has FMA.
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise maximum (the scores are never NaN, so NaN rules do not matter).
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a <= b { x } else { y }`.
    fn select_le(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    fn reduce_add(self, v: Self::V) -> f32;
    fn reduce_max(self, v: Self::V) -> f32;
    /// Lane `j` of the result is the sum of the lanes of `v[j]`: sixteen horizontal sums for
    /// the price of about three shuffles and adds each.
    fn reduce_add_16(self, v: &[Self::V; LANES]) -> Self::V;
    /// `2^n` for lanes holding `n + EXP2_ROUND` (see [`exp2`]).
    fn pow2_rounded(self, rounded: Self::V) -> Self::V;
    /// Scalar `a * b + c` with the same fusing as [`Simd::mul_add`].
    fn mul_add_f32(self, a: f32, b: f32, c: f32) -> f32;
    /// Scores of `R` query vectors against 16 cache rows: lane `j` of `out[r]` is
    /// `q[r * d..(r + 1) * d] · rows[j][..d]`. An instruction set that loads each row once for
    /// all `R` vectors does so and returns true; false leaves the scores to the caller.
    #[inline(always)]
    fn dot_group<const R: usize>(
        self,
        q: &[f32],
        d: usize,
        rows: &[&[f32]; LANES],
        out: &mut [Self::V; R],
    ) -> bool {
        let _ = (q, d, rows, out);
        false
    }
}

/// The compile target's baseline: arrays and plain loops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    type V = [f32; LANES];

    const KEYS: usize = 4;
    const WIDE_CHUNK: usize = 4;
    const WIDE_DIMS: usize = 4;
    const NARROW_ROWS: usize = 2;
    const NARROW_CHUNKS: usize = 2;
    const NARROW_SCORE_CHUNKS: usize = 2;

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        [x; LANES]
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> Self::V {
        src[..LANES]
            .try_into()
            .expect("a slice of LANES elements converts to an array")
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: Self::V) {
        dst[..LANES].copy_from_slice(&v);
    }
    #[inline(always)]
    unsafe fn load_ptr(self, src: *const f32) -> Self::V {
        // SAFETY: the caller promises LANES readable f32 at `src`.
        unsafe { std::ptr::read_unaligned(src.cast::<Self::V>()) }
    }
    #[inline(always)]
    unsafe fn store_ptr(self, dst: *mut f32, v: Self::V) {
        // SAFETY: the caller promises LANES writable f32 at `dst`.
        unsafe { std::ptr::write_unaligned(dst.cast::<Self::V>(), v) }
    }
    #[inline(always)]
    unsafe fn load_bf16_ptr(self, src: *const u16) -> Self::V {
        // SAFETY: the caller promises LANES readable u16 at `src`.
        let bits: [u16; LANES] = unsafe { std::ptr::read_unaligned(src.cast()) };
        std::array::from_fn(|l| f32::from_bits(u32::from(bits[l]) << 16))
    }
    #[inline(always)]
    fn add(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    fn sub(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] - b[l])
    }
    #[inline(always)]
    fn mul(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    fn div(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] / b[l])
    }
    #[inline(always)]
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|l| self.mul_add_f32(a[l], b[l], c[l]))
    }
    #[inline(always)]
    fn max(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|l| if a[l] > b[l] { a[l] } else { b[l] })
    }
    #[inline(always)]
    fn select_le(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V {
        std::array::from_fn(|l| if a[l] <= b[l] { x[l] } else { y[l] })
    }
    #[inline(always)]
    fn reduce_add(self, v: Self::V) -> f32 {
        let h: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
        let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
        (q[0] + q[2]) + (q[1] + q[3])
    }
    #[inline(always)]
    fn reduce_max(self, v: Self::V) -> f32 {
        v.iter()
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
    }
    #[inline(always)]
    fn reduce_add_16(self, v: &[Self::V; LANES]) -> Self::V {
        let mut out = [0.0; LANES];
        for (o, x) in out.iter_mut().zip(v) {
            *o = self.reduce_add(*x);
        }
        out
    }
    #[inline(always)]
    fn pow2_rounded(self, rounded: Self::V) -> Self::V {
        std::array::from_fn(|l| pow2_rounded_f32(rounded[l]))
    }
    #[inline(always)]
    fn mul_add_f32(self, a: f32, b: f32, c: f32) -> f32 {
        // Without hardware FMA, `f32::mul_add` is a libm call.
        if cfg!(any(target_arch = "aarch64", target_feature = "fma")) {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
}

/// Adding this to `x` (|x| < 2^22) rounds it to an integer, ties to even, and leaves that
/// integer in the low mantissa bits: rounding without SSE4.1 and without a float-to-int
/// conversion.
pub(crate) const EXP2_ROUND: f32 = 12_582_912.0;

/// Smallest exponent [`exp2`] evaluates; below it the result is 2^-126 (callers zero masked
/// lanes themselves, and a probability below 1e-38 is as good as zero).
const EXP2_MIN: f32 = -126.0;

/// Taylor coefficients of 2^f = e^(f ln 2): (ln 2)^k / k! for k = 1..=7.
const EXP2_POLY: [f32; 7] = [
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    0.000_015_252_734,
];

/// `2^n` from `n + EXP2_ROUND`, by writing `n + 127` into the exponent field.
#[inline(always)]
pub(crate) fn pow2_rounded_f32(rounded: f32) -> f32 {
    let bits = rounded
        .to_bits()
        .wrapping_add(127u32.wrapping_sub(EXP2_ROUND.to_bits()));
    f32::from_bits(bits << 23)
}

/// `2^x` on every lane, for `x <= 0`: split `x = n + f` with `f` in [-0.5, 0.5], evaluate 2^f
/// by its degree-7 Taylor polynomial (relative error about 1e-7) and scale by 2^n exactly.
#[inline(always)]
pub(crate) fn exp2<S: Simd>(s: S, x: S::V) -> S::V {
    let x = s.max(x, s.splat(EXP2_MIN));
    let rounded = s.add(x, s.splat(EXP2_ROUND));
    let f = s.sub(x, s.sub(rounded, s.splat(EXP2_ROUND)));
    let mut p = s.splat(EXP2_POLY[6]);
    for &c in EXP2_POLY[..6].iter().rev() {
        p = s.mul_add(p, f, s.splat(c));
    }
    p = s.mul_add(p, f, s.splat(1.0));
    s.mul(p, s.pow2_rounded(rounded))
}

/// Scalar [`exp2`], for the one rescale factor per query vector of the narrow path.
#[inline(always)]
pub(crate) fn exp2_f32<S: Simd>(s: S, x: f32) -> f32 {
    let x = if x > EXP2_MIN { x } else { EXP2_MIN };
    let rounded = x + EXP2_ROUND;
    let f = x - (rounded - EXP2_ROUND);
    let mut p = EXP2_POLY[6];
    for &c in EXP2_POLY[..6].iter().rev() {
        p = s.mul_add_f32(p, f, c);
    }
    s.mul_add_f32(p, f, 1.0) * pow2_rounded_f32(rounded)
}

/// Lane indices as floats, to mask lanes at or past a count.
pub(crate) const IOTA: [f32; LANES] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_is_accurate_on_its_domain() {
        let mut worst = 0.0f64;
        let mut x = -125.0f32;
        while x <= 0.0 {
            let want = 2f64.powf(f64::from(x));
            let scalar = f64::from(exp2_f32(Portable, x));
            let lanes = f64::from(exp2(Portable, [x; LANES])[3]);
            assert_eq!(scalar, lanes);
            worst = worst.max(((scalar - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp2_f32(Portable, 0.0), 1.0);
        assert_eq!(exp2_f32(Portable, -1.0), 0.5);
    }

    #[test]
    fn exp2_of_huge_negatives_is_tiny() {
        for x in [f32::NEG_INFINITY, -1.0e30, -200.0] {
            let v = exp2_f32(Portable, x);
            assert!((0.0..1e-37).contains(&v), "{x}: {v}");
        }
    }

    #[test]
    fn reductions_match_scalar() {
        let v: [f32; LANES] = std::array::from_fn(|i| (i as f32 * 1.7).sin());
        let want: f32 = v.iter().sum();
        assert!((Portable.reduce_add(v) - want).abs() < 1e-5);
        let want_max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(Portable.reduce_max(v), want_max);
    }

    #[test]
    fn reduce_add_16_sums_each_vector() {
        let v: [[f32; LANES]; LANES] =
            std::array::from_fn(|j| std::array::from_fn(|l| (j * 100 + l) as f32));
        let got = Portable.reduce_add_16(&v);
        for (j, g) in got.iter().enumerate() {
            assert_eq!(*g, (0..LANES).map(|l| (j * 100 + l) as f32).sum::<f32>());
        }
    }

    #[test]
    fn the_isa_cap_reads_its_three_names_and_ignores_the_rest() {
        assert_eq!(IsaCap::parse(Some("avx2")), IsaCap::Avx2);
        assert_eq!(IsaCap::parse(Some(" AVX2 ")), IsaCap::Avx2);
        assert_eq!(IsaCap::parse(Some("portable")), IsaCap::Portable);
        assert_eq!(IsaCap::parse(Some("avx512")), IsaCap::Avx512);
        assert_eq!(IsaCap::parse(Some("sse9")), IsaCap::Avx512);
        assert_eq!(IsaCap::parse(None), IsaCap::Avx512);
        assert!(IsaCap::Portable < IsaCap::Avx2 && IsaCap::Avx2 < IsaCap::Avx512);
    }

    #[test]
    fn detection_is_stable() {
        assert_eq!(Isa::detect(), Isa::detect());
        assert!(Isa::available().contains(&Isa::Portable));
    }
}
