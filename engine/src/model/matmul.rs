//! `x @ w_t` for the model's linear layers.
//!
//! For few rows (decode at small batch) gemm takes its single-threaded gemv path at about a third
//! of memory bandwidth; there the kernels crate's bandwidth-shaped small-batch kernel runs
//! instead. For larger batches gemm's own parallel kernel is at its FLOP ceiling.

use candle_core::{DType, Device, Tensor};

use super::ops::with_slice;
use crate::error::Result;

/// Up to this many rows the small-batch kernel runs.
const SMALL_M: usize = 8;

pub(crate) fn matmul(x: &Tensor, w_t: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w_t.dim(1)?;
    if m > SMALL_M
        || x.dtype() != DType::F32
        || !matches!(x.device(), Device::Cpu)
        || std::env::var_os("FISSION_EXP_GEMM").is_some()
    {
        return Ok(x.matmul(w_t)?);
    }
    let mut out = vec![0f32; m * n];
    with_slice::<f32, _>(x, |xs| {
        with_slice::<f32, _>(w_t, |ws| {
            kernels::small_batch_matmul(xs, m, k, ws, n, &mut out)
        })
    })???;
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
