//! `x @ w_t` for the model's linear layers.
//!
//! For few rows (decode at small batch) gemm takes its single-threaded gemv path, so one core
//! streams all the weights while the other idles, and decode is bandwidth-bound. There we split
//! the output columns across the thread pool and run one single-threaded gemm per slice; for
//! larger batches gemm's own parallel kernel is already at its FLOP ceiling.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::ops::with_slice;
use crate::error::Result;

/// Up to this many rows, columns are split across threads.
const SMALL_M: usize = 8;
/// Column slices are multiples of this (a cache line of f32 and the gemm micro-tile width).
const COL_ALIGN: usize = 64;

/// Raw output pointer that may cross threads: every slice writes a disjoint column range.
#[derive(Clone, Copy)]
struct DstPtr(*mut f32);
// SAFETY: threads write disjoint column ranges of one buffer that outlives the parallel loop.
unsafe impl Send for DstPtr {}
unsafe impl Sync for DstPtr {}

pub(crate) fn matmul(x: &Tensor, w_t: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w_t.dim(1)?;
    let threads = rayon::current_num_threads();
    if m > SMALL_M || threads < 2 || x.dtype() != DType::F32 || !matches!(x.device(), Device::Cpu) {
        return Ok(x.matmul(w_t)?);
    }
    let mut out = vec![0f32; m * n];
    let dst = DstPtr(out.as_mut_ptr());
    // A few slices per thread balance uneven progress without shrinking slices below a tile.
    let slice = n
        .div_ceil(threads * 4)
        .next_multiple_of(COL_ALIGN)
        .max(COL_ALIGN);
    with_slice::<f32, _>(x, |xs| {
        with_slice::<f32, _>(w_t, |ws| {
            (0..n.div_ceil(slice)).into_par_iter().for_each(|i| {
                let dst = dst;
                let c0 = i * slice;
                let cols = slice.min(n - c0);
                // SAFETY: dst has m*n elements, ws has k*n, xs has m*k; the column range
                // c0..c0+cols is in bounds and disjoint from every other iteration's range.
                unsafe {
                    gemm::gemm(
                        m,
                        cols,
                        k,
                        dst.0.add(c0),
                        1,
                        n as isize,
                        false,
                        xs.as_ptr(),
                        1,
                        k as isize,
                        ws.as_ptr().add(c0),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            });
        })
    })??;
    Ok(Tensor::from_vec(out, (m, n), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_columns_match_candle_matmul() {
        for (m, k, n) in [(1, 64, 1000), (3, 576, 1536), (8, 33, 130), (9, 16, 16)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
            let w = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu).expect("w");
            let got: Vec<f32> = matmul(&x, &w)
                .expect("mm")
                .flatten_all()
                .expect("f")
                .to_vec1()
                .expect("v");
            let want: Vec<f32> = x
                .matmul(&w)
                .expect("mm")
                .flatten_all()
                .expect("f")
                .to_vec1()
                .expect("v");
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{m}x{k}x{n}: {a} vs {b}"
                );
            }
        }
    }
}
