//! Runtime SIMD dispatch and the vector primitives the attention tile is built from.
//!
//! The crate is compiled for baseline x86-64, so wide instructions only appear inside functions
//! marked `#[target_feature]`. The kernels are written once as `#[inline(always)]` generic code
//! over [`Simd`]; each ISA gets a thin `#[target_feature]` wrapper that instantiates them, and
//! [`Isa::detect`] picks one wrapper per process. The primitives here work on [`Vf`], a fixed
//! array of [`LANES`] f32 with independent lanes, which LLVM turns into one zmm or two ymm
//! registers. No primitive relies on fast-math: every reduction is spelled out as a tree, so
//! the vectorizer never has to reorder additions on its own.

use std::sync::OnceLock;

/// Lanes in one vector of the kernels: 16 f32 is one AVX-512 register.
pub(crate) const LANES: usize = 16;

/// One vector of f32 lanes.
pub(crate) type Vf = [f32; LANES];

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
                let avx2_fma =
                    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
                if avx2_fma && is_x86_feature_detected!("avx512f") {
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

/// Compile-time description of one instantiation of the kernels.
pub(crate) trait Simd {
    /// Query rows a micro-kernel keeps in registers at once: enough independent FMA chains to
    /// hide FMA latency, few enough that the accumulators fit the register file.
    const ROWS: usize;

    /// `a * b + c`, fused when the ISA has FMA (without FMA, `f32::mul_add` is a libm call).
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// AVX-512F: 8 rows of one zmm accumulator each.
pub(crate) struct Avx512;

impl Simd for Avx512 {
    const ROWS: usize = 8;

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// AVX2 + FMA: 4 rows of two ymm accumulators each.
pub(crate) struct Avx2Fma;

impl Simd for Avx2Fma {
    const ROWS: usize = 4;

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// The compile target's baseline.
pub(crate) struct Portable;

impl Simd for Portable {
    const ROWS: usize = 4;

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        if cfg!(any(target_arch = "aarch64", target_feature = "fma")) {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
}

/// `acc += a * b`, lane by lane.
#[inline(always)]
pub(crate) fn fma_lanes<S: Simd>(acc: &mut Vf, a: f32, b: &Vf) {
    for (c, &x) in acc.iter_mut().zip(b) {
        *c = S::mul_add(a, x, *c);
    }
}

/// Views the first `LANES` elements of `s` as a vector; `s` must be at least that long.
#[inline(always)]
pub(crate) fn lanes(s: &[f32]) -> &Vf {
    s[..LANES]
        .try_into()
        .expect("a slice of exactly LANES elements converts to an array")
}

/// Mutable form of [`lanes`].
#[inline(always)]
pub(crate) fn lanes_mut(s: &mut [f32]) -> &mut Vf {
    (&mut s[..LANES])
        .try_into()
        .expect("a slice of exactly LANES elements converts to an array")
}

/// Sum of the lanes, as a tree of halving adds.
#[inline(always)]
pub(crate) fn hsum(v: &Vf) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

/// Maximum of the lanes (NaN-oblivious, which the scores never are), as a tree.
#[inline(always)]
pub(crate) fn hmax(v: &Vf) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| max(v[i], v[i + 8]));
    let b: [f32; 4] = std::array::from_fn(|i| max(a[i], a[i + 4]));
    max(max(b[0], b[2]), max(b[1], b[3]))
}

/// A plain compare-and-select, which lowers to one `maxps` (unlike `f32::max`'s NaN rules).
#[inline(always)]
pub(crate) fn max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Dot product of two equally long slices with two vector accumulators.
#[inline(always)]
pub(crate) fn dot<S: Simd>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [[0.0f32; LANES]; 2];
    let mut pairs = a.chunks_exact(2 * LANES).zip(b.chunks_exact(2 * LANES));
    for (x, y) in &mut pairs {
        for (k, acc) in acc.iter_mut().enumerate() {
            let (x, y) = (lanes(&x[k * LANES..]), lanes(&y[k * LANES..]));
            for l in 0..LANES {
                acc[l] = S::mul_add(x[l], y[l], acc[l]);
            }
        }
    }
    let mut done = n - n % (2 * LANES);
    if n - done >= LANES {
        let (x, y) = (lanes(&a[done..]), lanes(&b[done..]));
        for l in 0..LANES {
            acc[0][l] = S::mul_add(x[l], y[l], acc[0][l]);
        }
        done += LANES;
    }
    let mut sum = hsum(&std::array::from_fn(|l| acc[0][l] + acc[1][l]));
    for (x, y) in a[done..].iter().zip(&b[done..]) {
        sum = S::mul_add(*x, *y, sum);
    }
    sum
}

/// Smallest exponent [`exp2`] evaluates; anything lower comes out as 2^-126 (the callers zero
/// masked lanes themselves, and a probability below 1e-38 is as good as zero).
const EXP2_MIN: f32 = -126.0;

/// `2^x` for `x <= 0`, vectorizable: split `x = n + f` with `f` in [-0.5, 0.5], evaluate 2^f
/// by its degree-7 Taylor polynomial (relative error below 1e-8 + rounding), and put `n`
/// straight into the exponent bits.
#[inline(always)]
pub(crate) fn exp2<S: Simd>(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer (ties to even) and leaves it in the low mantissa
    // bits, so the rounding needs neither SSE4.1 nor a float-to-int conversion.
    const ROUND: f32 = 12_582_912.0;
    const C: [f32; 7] = [
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
        0.000_015_252_734,
    ];
    let x = max(x, EXP2_MIN);
    let shifted = x + ROUND;
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let f = x - (shifted - ROUND);
    let mut p = C[6];
    for &c in C[..6].iter().rev() {
        p = S::mul_add(p, f, c);
    }
    p = S::mul_add(p, f, 1.0);
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    p * scale
}

/// [`exp2`] on every lane.
#[inline(always)]
pub(crate) fn exp2_lanes<S: Simd>(x: &Vf) -> Vf {
    std::array::from_fn(|l| exp2::<S>(x[l]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_is_accurate_on_its_domain() {
        let mut worst = 0.0f64;
        let mut x = -125.0f32;
        while x <= 0.0 {
            let got = f64::from(exp2::<Portable>(x));
            let want = 2f64.powf(f64::from(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp2::<Portable>(0.0), 1.0);
        assert_eq!(exp2::<Portable>(-1.0), 0.5);
    }

    #[test]
    fn exp2_of_minus_infinity_is_tiny() {
        let v = exp2::<Portable>(f32::NEG_INFINITY);
        assert!((0.0..1e-37).contains(&v));
    }

    #[test]
    fn reductions_match_scalar() {
        let v: Vf = std::array::from_fn(|i| (i as f32 * 1.7).sin());
        let want: f32 = v.iter().sum();
        assert!((hsum(&v) - want).abs() < 1e-5);
        let want_max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(hmax(&v), want_max);
    }

    #[test]
    fn dot_matches_scalar_for_every_tail() {
        for n in 0..100 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin()).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let got = dot::<Portable>(&a, &b);
            assert!((got - want).abs() < 1e-4, "n {n}: {got} vs {want}");
        }
    }

    #[test]
    fn detection_is_stable() {
        assert_eq!(Isa::detect(), Isa::detect());
        assert!(Isa::available().contains(&Isa::Portable));
    }
}
