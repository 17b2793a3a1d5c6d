//! The model's linear layers: `y = x @ W + b`.
//!
//! f32 and bf16 weights on CPU are packed once, at load, into the kernels crate's panel layout
//! ([`kernels::PackedWeight`], bf16 kept as bf16 and widened in registers), and every step
//! multiplies f32 activations against them with [`kernels::packed_matmul`] at any batch size. A general GEMM re-packs its operand on every
//! call (a quarter of a batch-32 step, measured) and runs its small-batch path on one core.
//! Other dtypes and devices keep candle's matmul.

use candle_core::{DType, Device, Tensor};

use super::ops::with_slice;
use crate::error::Result;

#[derive(Debug, Clone)]
enum Weight {
    /// f32 or bf16 on CPU, in panels.
    Packed(kernels::PackedWeight),
    /// `[in, out]`, contiguous: the transpose of what checkpoints store. gemm packs a
    /// row-major `[in, out]` operand cheaply, while a transposed view costs more than the
    /// multiply itself.
    Dense(Tensor),
}

#[derive(Debug, Clone)]
pub(crate) struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// The bias in f32, for the host path whatever the checkpoint's dtype.
    bias_host: Option<Vec<f32>>,
}

impl Linear {
    /// From a checkpoint's `[out, in]` weight.
    pub(crate) fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let on_cpu = matches!(weight.device(), Device::Cpu);
        let weight = match weight.dtype() {
            DType::F32 if on_cpu => {
                let (n, k) = weight.dims2()?;
                Weight::Packed(with_slice::<f32, _>(&weight, |w| {
                    kernels::PackedWeight::from_out_in(w, n, k)
                })??)
            }
            DType::BF16 if on_cpu => {
                let (n, k) = weight.dims2()?;
                Weight::Packed(with_slice::<half::bf16, _>(&weight, |w| {
                    kernels::PackedWeight::from_out_in_bf16(w, n, k)
                })??)
            }
            _ => Weight::Dense(weight.t()?.contiguous()?),
        };
        let bias_host = match (&weight, &bias) {
            (Weight::Packed(_), Some(b)) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            _ => None,
        };
        Ok(Linear {
            weight,
            bias,
            bias_host,
        })
    }

    /// Whether the weight is packed, so [`forward_host`](Self::forward_host) can run it.
    pub(crate) fn is_packed(&self) -> bool {
        matches!(self.weight, Weight::Packed(_))
    }

    /// `out = x @ W + b` on `m` host rows, or with `add`, `out += x @ W + b` (a residual
    /// connection in the same pass). Packed weights only.
    pub(crate) fn forward_host(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        add: bool,
    ) -> Result<()> {
        let Weight::Packed(w) = &self.weight else {
            return Err(crate::error::EngineError::InvalidConfig {
                reason: "the host forward pass needs packed f32 weights".into(),
            });
        };
        if add {
            kernels::packed_matmul_add(x, m, w, out)?;
        } else {
            kernels::packed_matmul(x, m, w, out)?;
        }
        if let Some(b) = &self.bias_host {
            for row in out.chunks_mut(w.n()) {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Packed(w) => {
                // The kernel takes f32 activations whatever the weights' dtype.
                let m = x.dim(0)?;
                let mut out = vec![0f32; m * w.n()];
                let xf = x.to_dtype(DType::F32)?;
                with_slice::<f32, _>(&xf, |xs| kernels::packed_matmul(xs, m, w, &mut out))??;
                Tensor::from_vec(out, (m, w.n()), &Device::Cpu)?.to_dtype(x.dtype())?
            }
            Weight::Dense(w_t) => x.matmul(w_t)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_and_dense_match_candle_matmul() {
        for (m, k, n) in [(1, 64, 1000), (3, 576, 1536), (8, 33, 130), (40, 16, 16)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).expect("w");
            let b = Tensor::randn(0f32, 1.0, n, &Device::Cpu).expect("b");
            let want: Vec<f32> = x
                .matmul(&w.t().expect("t"))
                .expect("mm")
                .broadcast_add(&b)
                .expect("bias")
                .flatten_all()
                .expect("f")
                .to_vec1()
                .expect("v");
            let packed = Linear::new(w.clone(), Some(b.clone())).expect("linear");
            assert!(matches!(packed.weight, Weight::Packed(_)));
            let dense = Linear {
                weight: Weight::Dense(w.t().expect("t").contiguous().expect("c")),
                bias: Some(b),
                bias_host: None,
            };
            for linear in [packed, dense] {
                let got: Vec<f32> = linear
                    .forward(&x)
                    .expect("forward")
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
}
