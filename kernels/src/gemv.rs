//! Small-batch matmul for decode: `out[m, n] = sum_k x[m, k] * w_t[k, n]` with `m <= 16`.
//!
//! At decode batch sizes the weights are read once per step and the arithmetic is cheap, so
//! the kernel is shaped for memory bandwidth: each task owns a range of rows of `w_t` (and a
//! wide column tile), reads it front to back (the hardware prefetcher's best case) and
//! accumulates into a cache-resident buffer; the partial sums are added at the end. gemm's own
//! m = 1 path runs on one core.

use rayon::prelude::*;

use crate::error::KernelError;
use crate::simd::Isa;

/// The most rows handled by [`small_batch_matmul`].
pub const MAX_SMALL_M: usize = 16;
/// Widest column tile: a task's accumulators (`m * tile` f32) stay in L2.
const MAX_TILE: usize = 8192;
/// Fewest rows per task, so the partial sums stay cheap next to the reads.
const MIN_ROWS: usize = 32;

/// `out = x @ w_t` for `x: [m, k]`, `w_t: [k, n]` (row-major), `out: [m, n]`.
pub fn small_batch_matmul(
    x: &[f32],
    m: usize,
    k: usize,
    w_t: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let check = |what: &'static str, expected: usize, given: usize| {
        if expected == given {
            Ok(())
        } else {
            Err(KernelError::BadLength {
                what,
                expected,
                given,
            })
        }
    };
    check("x", m * k, x.len())?;
    check("w_t", k * n, w_t.len())?;
    check("out", m * n, out.len())?;
    if m == 0 || m > MAX_SMALL_M {
        return Err(KernelError::Invalid(format!(
            "small_batch_matmul takes 1..={MAX_SMALL_M} rows, given {m}"
        )));
    }
    let threads = rayon::current_num_threads().max(1);
    // Tasks own (row range of w_t) x (column tile). Whole rows, or wide tiles of them, make
    // each task one long sequential read; splitting the rows (the reduction) instead of the
    // columns is what keeps the runs long, at the price of summing the partial results.
    // Accumulators for all m rows of a tile stay in L1 (32 KiB of the 48).
    let tile = n.min((MAX_TILE / m).next_multiple_of(16).max(256));
    let n_tiles = n.div_ceil(tile);
    let k_parts = (threads * 2)
        .div_ceil(n_tiles)
        .clamp(1, k.div_ceil(MIN_ROWS).max(1));
    let rows = k.div_ceil(k_parts);
    let partials: Vec<(usize, Vec<f32>)> = (0..n_tiles * k_parts)
        .into_par_iter()
        .filter_map(|t| {
            let (ti, kp) = (t / k_parts, t % k_parts);
            let (c0, k0) = (ti * tile, kp * rows);
            if k0 >= k {
                return None;
            }
            let w = tile.min(n - c0);
            let mut acc = vec![0f32; m * w];
            accumulate(x, m, k, k0..(k0 + rows).min(k), w_t, n, c0, w, &mut acc);
            Some((c0, acc))
        })
        .collect();
    out.fill(0.0);
    for (c0, acc) in partials {
        let w = acc.len() / m;
        for mi in 0..m {
            for (o, a) in out[mi * n + c0..mi * n + c0 + w]
                .iter_mut()
                .zip(&acc[mi * w..(mi + 1) * w])
            {
                *o += a;
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn accumulate(
    x: &[f32],
    m: usize,
    k: usize,
    ks: std::ops::Range<usize>,
    w_t: &[f32],
    n: usize,
    c0: usize,
    w: usize,
    acc: &mut [f32],
) {
    match Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: Isa::detect verified avx512f.
            unsafe { accumulate_avx512(x, m, k, ks, w_t, n, c0, w, acc) }
        }
        _ => accumulate_portable(x, m, k, ks, w_t, n, c0, w, acc),
    }
}

#[allow(clippy::too_many_arguments)]
fn accumulate_portable(
    x: &[f32],
    m: usize,
    k: usize,
    ks: std::ops::Range<usize>,
    w_t: &[f32],
    n: usize,
    c0: usize,
    w: usize,
    acc: &mut [f32],
) {
    for kk in ks {
        let row = &w_t[kk * n + c0..kk * n + c0 + w];
        for mi in 0..m {
            let xv = x[mi * k + kk];
            for (a, &b) in acc[mi * w..(mi + 1) * w].iter_mut().zip(row) {
                *a += xv * b;
            }
        }
    }
}

/// Dispatches on `m` so the row count is a constant: the broadcasts of `x` and the rows of
/// `w_t` applied per accumulator load/store then live in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_avx512(
    x: &[f32],
    m: usize,
    k: usize,
    ks: std::ops::Range<usize>,
    w_t: &[f32],
    n: usize,
    c0: usize,
    w: usize,
    acc: &mut [f32],
) {
    // SAFETY (all arms): the caller checked avx512f; shapes were validated by the entry point.
    unsafe {
        match m {
            1 => block_avx512::<1, 8>(x, k, ks, w_t, n, c0, w, acc),
            2 => block_avx512::<2, 8>(x, k, ks, w_t, n, c0, w, acc),
            3 => block_avx512::<3, 4>(x, k, ks, w_t, n, c0, w, acc),
            4 => block_avx512::<4, 4>(x, k, ks, w_t, n, c0, w, acc),
            5 => block_avx512::<5, 2>(x, k, ks, w_t, n, c0, w, acc),
            6 => block_avx512::<6, 2>(x, k, ks, w_t, n, c0, w, acc),
            7 => block_avx512::<7, 2>(x, k, ks, w_t, n, c0, w, acc),
            8 => block_avx512::<8, 2>(x, k, ks, w_t, n, c0, w, acc),
            _ => {
                // Wider batches: two passes of at most 8 rows each.
                let (m0, m1) = (8, m - 8);
                let (acc0, acc1) = acc.split_at_mut(m0 * w);
                accumulate_avx512(&x[..m0 * k], m0, k, ks.clone(), w_t, n, c0, w, acc0);
                accumulate_avx512(&x[m0 * k..], m1, k, ks, w_t, n, c0, w, acc1);
            }
        }
    }
}

/// `M` rows of `x`, `KB` rows of `w_t` per pass: each 16-lane accumulator is loaded and stored
/// once per `KB` FMAs, and the `M * KB` broadcasts stay in registers (at most 16 of the 32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx512<const M: usize, const KB: usize>(
    x: &[f32],
    k: usize,
    ks: std::ops::Range<usize>,
    w_t: &[f32],
    n: usize,
    c0: usize,
    w: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let full = w / 16 * 16;
    let mut kk = ks.start;
    while kk < ks.end {
        let kb = KB.min(ks.end - kk);
        let mut xb = [[_mm512_setzero_ps(); KB]; M];
        for (mi, row) in xb.iter_mut().enumerate() {
            for (b, v) in row.iter_mut().enumerate().take(kb) {
                *v = _mm512_set1_ps(x[mi * k + kk + b]);
            }
        }
        let base = w_t.as_ptr();
        let mut j = 0;
        while j < full {
            // SAFETY: rows kk..kk+kb < k and columns c0+j..c0+j+16 <= c0+w <= n are in w_t;
            // acc has M * w elements.
            unsafe {
                let mut wv = [_mm512_setzero_ps(); KB];
                for (b, v) in wv.iter_mut().enumerate().take(kb) {
                    *v = _mm512_loadu_ps(base.add((kk + b) * n + c0 + j));
                }
                for (mi, xr) in xb.iter().enumerate() {
                    let p = acc.as_mut_ptr().add(mi * w + j);
                    let mut a = _mm512_loadu_ps(p);
                    for b in 0..kb {
                        a = _mm512_fmadd_ps(xr[b], wv[b], a);
                    }
                    _mm512_storeu_ps(p, a);
                }
            }
            j += 16;
        }
        for b in 0..kb {
            let row = &w_t[(kk + b) * n + c0..(kk + b) * n + c0 + w];
            for j in full..w {
                for mi in 0..M {
                    acc[mi * w + j] += x[mi * k + kk + b] * row[j];
                }
            }
        }
        kk += kb;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for mi in 0..m {
            for kk in 0..k {
                for j in 0..n {
                    out[mi * n + j] += x[mi * k + kk] * w[kk * n + j];
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_on_awkward_shapes() {
        for (m, k, n) in [
            (1, 7, 5),
            (1, 64, 1000),
            (3, 576, 1536),
            (8, 33, 130),
            (16, 16, 17),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let w: Vec<f32> = (0..k * n)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
                .collect();
            let mut out = vec![0f32; m * n];
            small_batch_matmul(&x, m, k, &w, n, &mut out).expect("valid shapes");
            for (a, b) in out.iter().zip(naive(&x, m, k, &w, n)) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{m}x{k}x{n}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut out = vec![0f32; 4];
        assert!(small_batch_matmul(&[0.0; 3], 1, 2, &[0.0; 8], 4, &mut out).is_err());
        assert!(small_batch_matmul(&[0.0; 17 * 2], 17, 2, &[0.0; 8], 4, &mut [0.0; 68]).is_err());
    }
}
