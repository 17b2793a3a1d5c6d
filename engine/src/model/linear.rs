//! The model's linear layers: `y = x @ W + b`.
//!
//! f32 and bf16 weights on CPU are packed once, at load, into the kernels crate's panel layout
//! ([`kernels::PackedWeight`], bf16 kept as bf16 and widened in registers), and every step
//! multiplies f32 activations against them with [`kernels::packed_matmul`] at any batch size. A general GEMM re-packs its operand on every
//! call (a quarter of a batch-32 step, measured) and runs its small-batch path on one core.
//! With `--quantize int8` the same panels hold int8 with a scale per 32 inputs (quantised here,
//! from f32 or bf16), and the kernel quantises the activations to match.
//! A GGUF file's Q4_0/Q5_0/Q4_K/Q5_K/Q6_K projections keep their blocks
//! ([`kernels::KQuantWeight`], found by `crate::gguf_weights::take_quantized`) and those with
//! Q8_0 rows go to the int8 panels, which hold Q8_0 exactly.
//! Other dtypes and devices keep candle's matmul.

use candle_core::{DType, Device, Tensor};

use super::ops::with_slice;
use crate::error::{EngineError, Result};
use crate::gguf_weights::StoredBlocks;
use crate::quantize::Quantize;

#[derive(Debug, Clone)]
enum Weight {
    /// f32 or bf16 on CPU, in panels.
    Packed(kernels::PackedWeight),
    /// A GGUF file's Q4_0/Q5_0/Q4_K/Q5_K/Q6_K blocks on CPU, in the k-quant GEMM's panels.
    KQuant(kernels::KQuantWeight),
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
    /// From a checkpoint's `[out, in]` weight, quantised as `quantize` says.
    pub(crate) fn quantized(
        weight: Tensor,
        bias: Option<Tensor>,
        quantize: Quantize,
    ) -> Result<Self> {
        let on_cpu = matches!(weight.device(), Device::Cpu);
        let stored = if on_cpu && quantize == Quantize::None {
            crate::gguf_weights::take_quantized(&weight)?
        } else {
            None
        };
        let weight = match weight.dtype() {
            _ if matches!(stored, Some(StoredBlocks::KQuant(_))) => {
                let Some(StoredBlocks::KQuant(w)) = stored else {
                    unreachable!("matched above")
                };
                Weight::KQuant(w)
            }
            _ if quantize == Quantize::Int8 || matches!(stored, Some(StoredBlocks::Int8)) => {
                if !on_cpu {
                    return Err(EngineError::InvalidConfig {
                        reason: format!(
                            "quantize int8 runs on the CPU only, the weights are on {:?}",
                            weight.device()
                        ),
                    });
                }
                let (n, k) = weight.dims2()?;
                // bf16 checkpoints too: each weight is quantised from its exact f32 value.
                let w = weight.to_dtype(DType::F32)?;
                Weight::Packed(with_slice::<f32, _>(&w, |w| {
                    kernels::PackedWeight::from_out_in_int8(w, n, k)
                })??)
            }
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
            (Weight::Packed(_) | Weight::KQuant(_), Some(b)) => {
                Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            }
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
        matches!(self.weight, Weight::Packed(_) | Weight::KQuant(_))
    }

    /// Outputs of a host weight.
    fn host_n(&self) -> Option<usize> {
        match &self.weight {
            Weight::Packed(w) => Some(w.n()),
            Weight::KQuant(w) => Some(w.n()),
            Weight::Dense(_) => None,
        }
    }

    /// `out (+)= x @ W` on `m` host rows, without the bias.
    fn matmul_host(&self, x: &[f32], m: usize, out: &mut [f32], add: bool) -> Result<()> {
        match &self.weight {
            Weight::Packed(w) if add => kernels::packed_matmul_add(x, m, w, out)?,
            Weight::Packed(w) => kernels::packed_matmul(x, m, w, out)?,
            Weight::KQuant(w) => w.matmul(x, m, out, add)?,
            Weight::Dense(_) => {
                return Err(EngineError::InvalidConfig {
                    reason: "the host forward pass needs packed weights".into(),
                })
            }
        }
        Ok(())
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
        self.matmul_host(x, m, out, add)?;
        if let (Some(b), Some(n)) = (&self.bias_host, self.host_n()) {
            for row in out.chunks_mut(n) {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match (&self.weight, self.host_n()) {
            (Weight::Dense(w_t), _) => x.matmul(w_t)?,
            (_, Some(n)) => {
                // The kernels take f32 activations whatever the weights' dtype.
                let m = x.dim(0)?;
                let mut out = vec![0f32; m * n];
                let xf = x.to_dtype(DType::F32)?;
                with_slice::<f32, _>(&xf, |xs| self.matmul_host(xs, m, &mut out, false))??;
                Tensor::from_vec(out, (m, n), &Device::Cpu)?.to_dtype(x.dtype())?
            }
            (_, None) => unreachable!("host weights have a width"),
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
            let packed =
                Linear::quantized(w.clone(), Some(b.clone()), Quantize::None).expect("linear");
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

    #[test]
    fn int8_is_close_to_f32_from_f32_and_bf16_checkpoints() {
        let (m, k, n) = (5, 200, 70);
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).expect("w");
        let want: Vec<f32> = x
            .matmul(&w.t().expect("t"))
            .expect("mm")
            .flatten_all()
            .expect("f")
            .to_vec1()
            .expect("v");
        let norm: f32 = want.iter().map(|v| v * v).sum();
        for w in [w.clone(), w.to_dtype(DType::BF16).expect("bf16")] {
            let linear = Linear::quantized(w, None, Quantize::Int8).expect("linear");
            let Weight::Packed(p) = &linear.weight else {
                panic!("int8 weights not packed");
            };
            assert_eq!(p.dtype(), kernels::WeightDtype::Int8);
            let mut got = vec![0f32; m * n];
            let xs: Vec<f32> = x.flatten_all().expect("f").to_vec1().expect("v");
            linear
                .forward_host(&xs, m, &mut got, false)
                .expect("forward");
            let err: f32 = got.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
            // Two 8-bit quantisations: a relative error of about 1% in the norm.
            assert!(err <= 1e-3 * norm, "error {err} of {norm}");
        }
    }
}
