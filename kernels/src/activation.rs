//! The per-row elementwise steps of a decoder layer between its GEMMs: SwiGLU's `silu(gate) ·
//! up` and RMS norm, vectorised.
//!
//! Written as plain loops they cost more than their arithmetic: `exp` is a libm call per
//! element (1.5 million a step at batch 32 on the SmolLM2 shape), and the norm's sum of
//! squares is one serial chain of adds. Here both run 16 lanes at a time with the kernels'
//! own `exp2`, on whichever instruction set [`Isa::detect`] picks.

use crate::simd::{exp2, Isa, Portable, Simd, LANES};
#[cfg(target_arch = "x86_64")]
use crate::simd_x86::{Avx2Fma, Avx512};

/// `out[i] = silu(gate[i]) * up[i]`, with `silu(x) = x / (1 + e^-x)`; the three lengths must
/// match.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_on(Isa::detect(), gate, up, out)
}

/// `out = x / sqrt(mean(x²) + eps) * weight`, for one row; the three lengths must match.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_on(Isa::detect(), x, weight, eps, out)
}

pub(crate) fn silu_mul_on(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "silu_mul: gate {}, up {}, out {}",
        gate.len(),
        up.len(),
        out.len()
    );
    match isa {
        // SAFETY: `detect` (or the tests' `available`) returned this ISA on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { silu_mul_avx512(gate, up, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { silu_mul_avx2(gate, up, out) },
        _ => silu_mul_simd(Portable, gate, up, out),
    }
}

pub(crate) fn rms_norm_on(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == out.len() && weight.len() == out.len(),
        "rms_norm: x {}, weight {}, out {}",
        x.len(),
        weight.len(),
        out.len()
    );
    match isa {
        // SAFETY: `detect` (or the tests' `available`) returned this ISA on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rms_norm_avx512(x, weight, eps, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { rms_norm_avx2(x, weight, eps, out) },
        _ => rms_norm_simd(Portable, x, weight, eps, out),
    }
}

/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: this function's contract.
    silu_mul_simd(unsafe { Avx512::new_unchecked() }, gate, up, out)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: this function's contract.
    silu_mul_simd(unsafe { Avx2Fma::new_unchecked() }, gate, up, out)
}

/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rms_norm_avx512(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // SAFETY: this function's contract.
    rms_norm_simd(unsafe { Avx512::new_unchecked() }, x, weight, eps, out)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_avx2(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // SAFETY: this function's contract.
    rms_norm_simd(unsafe { Avx2Fma::new_unchecked() }, x, weight, eps, out)
}

/// One vector of SwiGLU. `e^-|x|` is never above 1, so `exp2` (valid for arguments ≤ 0)
/// covers both signs: `silu(x) = x / (1 + t)` for `x ≥ 0` and `x · t / (1 + t)` below, with
/// `t = e^-|x|`.
#[inline(always)]
fn silu_mul_vec<S: Simd>(s: S, g: S::V, u: S::V) -> S::V {
    let zero = s.splat(0.0);
    let one = s.splat(1.0);
    let neg_abs = s.sub(zero, s.max(g, s.sub(zero, g)));
    let t = exp2(s, s.mul(neg_abs, s.splat(std::f32::consts::LOG2_E)));
    // Lanes with g <= 0 take t as the numerator's factor; g = 0 gives 0 either way.
    let factor = s.select_le(g, zero, t, one);
    s.mul(s.div(s.mul(g, factor), s.add(one, t)), u)
}

#[inline(always)]
fn silu_mul_simd<S: Simd>(s: S, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let full = out.len() / LANES * LANES;
    for ((o, g), u) in out[..full]
        .chunks_exact_mut(LANES)
        .zip(gate.chunks_exact(LANES))
        .zip(up.chunks_exact(LANES))
    {
        s.store(o, silu_mul_vec(s, s.load(g), s.load(u)));
    }
    let tail = out.len() - full;
    if tail > 0 {
        let (mut g, mut u, mut o) = ([0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES]);
        g[..tail].copy_from_slice(&gate[full..]);
        u[..tail].copy_from_slice(&up[full..]);
        s.store(&mut o, silu_mul_vec(s, s.load(&g), s.load(&u)));
        out[full..].copy_from_slice(&o[..tail]);
    }
}

#[inline(always)]
fn rms_norm_simd<S: Simd>(s: S, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let full = n / LANES * LANES;
    // Four vectors of partial sums: independent add chains, so the adds overlap.
    let mut acc = [s.splat(0.0); 4];
    let mut chunks = x[..full].chunks_exact(LANES);
    for (i, c) in chunks.by_ref().enumerate() {
        let v = s.load(c);
        acc[i % 4] = s.mul_add(v, v, acc[i % 4]);
    }
    let mut sum2 = s.reduce_add(s.add(s.add(acc[0], acc[1]), s.add(acc[2], acc[3])));
    sum2 += x[full..].iter().map(|v| v * v).sum::<f32>();
    let m = (sum2 / n.max(1) as f32 + eps).sqrt();
    let mv = s.splat(m);
    for ((o, xv), w) in out[..full]
        .chunks_exact_mut(LANES)
        .zip(x.chunks_exact(LANES))
        .zip(weight.chunks_exact(LANES))
    {
        s.store(o, s.mul(s.div(s.load(xv), mv), s.load(w)));
    }
    for ((o, xv), w) in out[full..].iter_mut().zip(&x[full..]).zip(&weight[full..]) {
        *o = xv / m * w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn silu_reference(g: f32, u: f32) -> f64 {
        let g = f64::from(g);
        g / (1.0 + (-g).exp()) * f64::from(u)
    }

    proptest! {
        #[test]
        fn silu_mul_matches_the_formula_on_every_isa(
            v in proptest::collection::vec((-30.0f32..30.0, -4.0f32..4.0), 0..100)
        ) {
            let gate: Vec<f32> = v.iter().map(|p| p.0).collect();
            let up: Vec<f32> = v.iter().map(|p| p.1).collect();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; v.len()];
                silu_mul_on(isa, &gate, &up, &mut out);
                for i in 0..v.len() {
                    let want = silu_reference(gate[i], up[i]);
                    let err = (f64::from(out[i]) - want).abs();
                    prop_assert!(
                        err <= 1e-5 * want.abs().max(1e-6),
                        "{isa:?} at {i}: silu({}) * {} = {} against {want}", gate[i], up[i], out[i]
                    );
                }
            }
        }

        #[test]
        fn rms_norm_matches_the_formula_on_every_isa(
            v in proptest::collection::vec((-8.0f32..8.0, -2.0f32..2.0), 1..200)
        ) {
            let x: Vec<f32> = v.iter().map(|p| p.0).collect();
            let w: Vec<f32> = v.iter().map(|p| p.1).collect();
            let eps = 1e-5f64;
            let mean2 = x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>() / x.len() as f64;
            let m = (mean2 + eps).sqrt();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; x.len()];
                rms_norm_on(isa, &x, &w, eps as f32, &mut out);
                for i in 0..x.len() {
                    let want = f64::from(x[i]) / m * f64::from(w[i]);
                    prop_assert!(
                        (f64::from(out[i]) - want).abs() <= 1e-5 * want.abs().max(1e-3),
                        "{isa:?} at {i}: {} against {want}", out[i]
                    );
                }
            }
        }
    }

    #[test]
    fn silu_of_extremes_stays_finite_and_signed() {
        let gate = [-200.0f32, -88.0, -0.0, 0.0, 88.0, 200.0, f32::MIN_POSITIVE];
        let up = [1.0f32; 7];
        for isa in Isa::available() {
            let mut out = [f32::NAN; 7];
            silu_mul_on(isa, &gate, &up, &mut out);
            assert!(out.iter().all(|v| v.is_finite()), "{isa:?}: {out:?}");
            assert!(out[0] <= 0.0 && out[0] > -1e-30, "{isa:?}: {out:?}");
            assert_eq!(out[2], 0.0);
            assert_eq!(out[3], 0.0);
            assert_eq!(out[5], 200.0, "{isa:?}");
        }
    }
}
