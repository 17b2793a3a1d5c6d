//! The FMA throughput of the instruction set the kernels run: the hardware ceiling that every
//! GEMM and attention figure is a share of.
//!
//! Each thread runs independent multiply-add chains on registers alone, with no loads:
//! enough chains (12) to cover the FMA latency on every FMA pipe of the CPUs this runs on.
//! The GEMM's best (`fission bench limits`) is then a measured share of this, not a guess.

use std::time::Instant;

use crate::pool;
use crate::simd::Isa;

/// Independent chains per thread: 12 vector registers of the 16 that AVX2 has.
const CHAINS: usize = 12;

/// GFLOP/s of every kernel thread running multiply-adds at once, `rounds` rounds of
/// [`CHAINS`] vector FMAs each per thread (2 FLOPs per lane).
pub fn fma_peak_gflops(rounds: usize) -> f64 {
    let isa = Isa::detect();
    let threads = pool::threads();
    let sink = |_: usize| {
        // SAFETY: `isa` is this CPU's ([`Isa::detect`]).
        std::hint::black_box(unsafe { chains(isa, rounds) });
    };
    // The first hand-off wakes the pool's threads, so that each then takes one task.
    pool::run(threads, &sink);
    let start = Instant::now();
    pool::run(threads, &sink);
    let secs = start.elapsed().as_secs_f64();
    (threads * rounds * CHAINS * lanes(isa) * 2) as f64 / secs / 1e9
}

/// f32 lanes of one FMA on `isa`.
fn lanes(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => 16,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => 8,
        // The baseline's multiply and add on 4-lane SSE vectors, as the compiler emits them.
        _ => 4,
    }
}

/// # Safety
/// The CPU must run `isa`.
unsafe fn chains(isa: Isa, rounds: usize) -> f32 {
    match isa {
        // SAFETY: the caller's contract.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { chains_avx512(rounds) },
        // SAFETY: the caller's contract.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { chains_avx2(rounds) },
        _ => chains_portable(rounds),
    }
}

/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chains_avx512(rounds: usize) -> f32 {
    use std::arch::x86_64::*;
    // a <- a * x + y converges to y / (1 - x): the values stay finite for any round count.
    let (x, y) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-3));
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..rounds {
        for a in &mut acc {
            *a = _mm512_fmadd_ps(*a, x, y);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains_avx2(rounds: usize) -> f32 {
    use std::arch::x86_64::*;
    let (x, y) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-3));
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..rounds {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, x, y);
        }
    }
    let mut lanes = [0f32; 8];
    let mut total = 0.0;
    for a in acc {
        // SAFETY: `lanes` holds the 8 f32 the store writes.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        total += lanes.iter().sum::<f32>();
    }
    total
}

/// The baseline: a multiply and an add per lane, on arrays the compiler vectorises.
fn chains_portable(rounds: usize) -> f32 {
    let mut acc = [[1.0f32; 4]; CHAINS];
    for _ in 0..rounds {
        for a in &mut acc {
            for l in a.iter_mut() {
                *l = *l * 0.999_9 + 1e-3;
            }
        }
    }
    acc.iter().flatten().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_isa_converges_to_the_same_fixed_point() {
        // 12 chains x lanes of y / (1 - x) = 10 each, after enough rounds.
        for isa in Isa::available() {
            // SAFETY: `available` lists only instruction sets this CPU runs.
            let total = unsafe { chains(isa, 200_000) };
            let want = (CHAINS * lanes(isa)) as f32 * 10.0;
            assert!(
                (total - want).abs() < want * 1e-3,
                "{isa:?}: {total} against {want}"
            );
        }
    }

    #[test]
    fn the_peak_is_a_positive_rate() {
        let g = fma_peak_gflops(10_000);
        assert!(g.is_finite() && g > 0.0, "{g}");
    }
}
