//! A GGUF file's weights into the engine's model: the `gguf` crate dequantises each tensor
//! under transformers' name and the model loads them as it loads a safetensors checkpoint, in
//! the load dtype, or as the engine's int8 with `--quantize int8` (lossless for Q8_0 blocks:
//! both hold 32 inputs per scale). By default the projections stay in their stored blocks:
//! Q4_0, Q5_0, Q4_K, Q5_K and Q6_K run on the kernels crate's k-quant GEMM, Q8_0 on its int8 panels
//! (exact), while embeddings, norms and float tensors are dequantised (`--quantize dequant`
//! dequantises everything, the comparison path).
//!
//! The model builds its linear layers from the tensors a `VarBuilder` hands it, fusing some
//! (q/k/v, gate/up) by concatenating rows. Rather than teach every architecture's loader about
//! blocks, the blocks are kept aside here and each linear layer finds its own by the hashes of
//! the dequantised rows it receives ([`take_quantized`]): block quantisation never spans rows,
//! so a fused weight's blocks are its parts' blocks, row run after row run.
//!
//! The config, tokenizer and chat template reach the engine as JSON files in the model
//! directory that [`crate::loader`] writes for a GGUF file (`gguf::materialize`).

use std::path::{Path, PathBuf};

use std::cell::RefCell;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::error::{EngineError, Result};

/// The GGUF file a model's weight list names, if its weights are one. A leaf: the loader and
/// the model call down into this file, and it imports neither.
pub fn gguf_file(weights: &[PathBuf]) -> Option<&Path> {
    match weights {
        [one]
            if one
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf")) =>
        {
            Some(one)
        }
        _ => None,
    }
}

/// The error for a bad GGUF file, naming it.
pub(crate) fn gguf_error(path: &Path, e: gguf::GgufError) -> EngineError {
    EngineError::InvalidConfig {
        reason: format!("{}: {e}", path.display()),
    }
}

/// The tensors of the GGUF file at `path`, dequantised into `dtype` under transformers'
/// names, for the model to load as it loads a safetensors checkpoint. With `keep`, the stored
/// blocks of its block-quantised projections are also kept aside (on this thread) for
/// [`take_quantized`], which the linear layers call as the model is built.
pub fn var_builder(
    path: &Path,
    dtype: DType,
    device: &Device,
    keep: bool,
) -> Result<VarBuilder<'static>> {
    let started = std::time::Instant::now();
    let file = gguf::GgufFile::open(path).map_err(|e| gguf_error(path, e))?;
    let keep_type = |t: gguf::GgmlType| keep && kept_type(t).is_some();
    let (tensors, raw) = gguf::load_tensors_keeping(&file, dtype, device, keep_type)
        .map_err(|e| gguf_error(path, e))?;
    let mut kept = Vec::with_capacity(raw.len());
    for (name, raw) in raw {
        let Some(t) = tensors.get(&name) else {
            continue;
        };
        kept.push(Kept {
            hashes: row_hashes(t)?,
            raw,
        });
    }
    tracing::info!(
        path = %path.display(),
        weight_type = gguf::weight_type(&file),
        ?dtype,
        kept_quantized = kept.len(),
        load_ms = started.elapsed().as_millis() as u64,
        "read gguf weights"
    );
    KEPT.with(|k| *k.borrow_mut() = kept);
    Ok(VarBuilder::from_tensors(tensors, dtype, device))
}

/// The GGUF block types the engine runs as stored: the k-quant kernels' types, and Q8_0,
/// which the int8 panels hold exactly.
fn kept_type(t: gguf::GgmlType) -> Option<Option<kernels::KQuantType>> {
    use gguf::GgmlType as G;
    Some(match t {
        G::Q4_0 => Some(kernels::KQuantType::Q4_0),
        G::Q5_0 => Some(kernels::KQuantType::Q5_0),
        G::Q4K => Some(kernels::KQuantType::Q4K),
        G::Q5K => Some(kernels::KQuantType::Q5K),
        G::Q6K => Some(kernels::KQuantType::Q6K),
        G::Q8_0 => None,
        _ => return None,
    })
}

/// A weight's stored blocks, and a hash of each of its dequantised rows by which the linear
/// layer that receives those rows (alone, or fused with others: q/k/v, gate/up) finds them.
struct Kept {
    hashes: Vec<u64>,
    raw: gguf::RawTensor,
}

thread_local! {
    /// The blocks [`var_builder`] kept, until the model built on this thread takes them (or
    /// the next GGUF load replaces them).
    static KEPT: RefCell<Vec<Kept>> = const { RefCell::new(Vec::new()) };
}

/// What the stored blocks of a `[n, k]` weight are, when every one of its rows came from a
/// block-quantised GGUF tensor kept by [`var_builder`] on this thread.
pub(crate) enum StoredBlocks {
    /// Every part Q8_0 (the int8 panels hold it exactly), or Q8_0 parts beside others (a
    /// Q4_K_M q/k/v with a Q8_0 v): the int8 panels hold the Q8_0 rows exactly and the rest
    /// within an 8-bit step of their dequantised values.
    Int8,
    /// Parts in k-quant kernel types, in row order.
    KQuant(kernels::KQuantWeight),
}

/// The stored blocks of `weight` (`[n, k]`, as the model hands it to a linear layer: one GGUF
/// tensor or several concatenated by rows), matched row by row against what [`var_builder`]
/// kept. `None` when nothing was kept or some row is not covered (a float tensor, a mix with
/// a tensor the model transformed): the layer then packs the dequantised weight.
pub(crate) fn take_quantized(weight: &Tensor) -> Result<Option<StoredBlocks>> {
    if KEPT.with(|k| k.borrow().is_empty()) {
        return Ok(None);
    }
    let (n, k) = weight.dims2()?;
    let hashes = row_hashes(weight)?;
    KEPT.with(|kept| {
        let kept = kept.borrow();
        let mut parts: Vec<&gguf::RawTensor> = Vec::new();
        let mut r = 0;
        while r < n {
            let Some(next) = kept.iter().find(|e| {
                e.raw.cols == k && r + e.raw.rows <= n && e.hashes[..] == hashes[r..r + e.raw.rows]
            }) else {
                return Ok(None);
            };
            parts.push(&next.raw);
            r += next.raw.rows;
        }
        // A part is not removed once used: a tied lm_head is the embedding's blocks again.

        let types: Vec<_> = parts.iter().map(|p| kept_type(p.ggml_type)).collect();
        if types.contains(&Some(None)) {
            return Ok(Some(StoredBlocks::Int8));
        }
        let mut list = Vec::with_capacity(parts.len());
        for (p, t) in parts.iter().zip(types) {
            let Some(Some(ty)) = t else {
                return Ok(None);
            };
            list.push(kernels::KQuantPart {
                ty,
                rows: p.rows,
                data: &p.data,
            });
        }
        Ok(Some(StoredBlocks::KQuant(
            kernels::KQuantWeight::from_gguf(k, &list)?,
        )))
    })
}

/// Drops the blocks kept for the model built on this thread, once it is built.
pub(crate) fn release_kept() {
    KEPT.with(|k| k.borrow_mut().clear());
}

/// One hash per row of a 2-D tensor's values in f32 (FNV-style over the bits; a match also
/// needs the shape and every row of a part to agree).
fn row_hashes(t: &Tensor) -> Result<Vec<u64>> {
    let (rows, cols) = t.dims2()?;
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok((0..rows)
        .map(|r| {
            v[r * cols..(r + 1) * cols]
                .iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                    (h ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
                })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    /// `rows x k` random weights quantised by candle (ggml's reference quantisers), as the
    /// file would store them, and the same dequantised by candle.
    fn quantized(ty: GgmlDType, rows: usize, k: usize) -> (gguf::RawTensor, Tensor) {
        let w = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu).expect("w");
        let q = QTensor::quantize(&w, ty).expect("quantize");
        let ggml_type = match ty {
            GgmlDType::Q4_0 => gguf::GgmlType::Q4_0,
            GgmlDType::Q5_0 => gguf::GgmlType::Q5_0,
            GgmlDType::Q4K => gguf::GgmlType::Q4K,
            GgmlDType::Q5K => gguf::GgmlType::Q5K,
            GgmlDType::Q6K => gguf::GgmlType::Q6K,
            GgmlDType::Q8_0 => gguf::GgmlType::Q8_0,
            _ => unreachable!("a type the test uses"),
        };
        let raw = gguf::RawTensor {
            ggml_type,
            rows,
            cols: k,
            data: q.data().expect("data").into_owned(),
        };
        (raw, q.dequantize(&Device::Cpu).expect("dequantize"))
    }

    fn keep(parts: &[(gguf::RawTensor, Tensor)]) {
        let kept = parts
            .iter()
            .map(|(raw, t)| Kept {
                hashes: row_hashes(t).expect("hashes"),
                raw: raw.clone(),
            })
            .collect();
        KEPT.with(|k| *k.borrow_mut() = kept);
    }

    #[test]
    fn stored_blocks_decode_as_candle_dequantises_them() {
        for ty in [
            GgmlDType::Q4_0,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let (rows, k) = (19, 512);
            let (raw, deq) = quantized(ty, rows, k);
            keep(&[(raw, deq.clone())]);
            let Some(StoredBlocks::KQuant(w)) = take_quantized(&deq).expect("take") else {
                panic!("{ty:?} not kept");
            };
            let want = deq.to_vec2::<f32>().expect("v");
            for (j, row) in want.iter().enumerate() {
                for (i, &v) in row.iter().enumerate() {
                    // The panels fold d and the sub-scale (and dmin and the sub-min) into one
                    // f16 each: 2^-11 of `15 s` plus 2^-11 of `mn`, at most 3 * 2^-11 of the
                    // block's largest |w| (a 4-bit step is 1/15 of its span).
                    let block = &row[i / 32 * 32..i / 32 * 32 + 32];
                    let range = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let got = w.get(i, j);
                    let tol = 1.5e-3 * range + 1e-6;
                    assert!((got - v).abs() <= tol, "{ty:?} ({i}, {j}): {got} vs {v}");
                }
            }
        }
        release_kept();
    }

    #[test]
    fn fused_weights_find_their_parts_and_q8_0_parts_go_to_int8() {
        let k = 256;
        let q = quantized(GgmlDType::Q4K, 64, k);
        let kk = quantized(GgmlDType::Q4K, 16, k);
        let v = quantized(GgmlDType::Q6K, 16, k);
        let q8 = quantized(GgmlDType::Q8_0, 32, k);
        let floats = Tensor::randn(0f32, 1.0, (8, k), &Device::Cpu).expect("f");
        keep(&[q.clone(), kk.clone(), v.clone(), q8.clone()]);
        let fused = Tensor::cat(&[&q.1, &kk.1, &v.1], 0).expect("cat");
        let Some(StoredBlocks::KQuant(w)) = take_quantized(&fused).expect("take") else {
            panic!("fused q/k/v not found");
        };
        use kernels::KQuantType as T;
        assert_eq!(w.types(), vec![T::Q4K, T::Q4K, T::Q6K]);
        // The product against the dequantised weights: activations quantised to 8 bits.
        let x = Tensor::randn(0f32, 1.0, (3, k), &Device::Cpu).expect("x");
        let want = x
            .matmul(&fused.t().expect("t"))
            .expect("mm")
            .flatten_all()
            .expect("f")
            .to_vec1::<f32>()
            .expect("v");
        let mut got = vec![0f32; 3 * 96];
        let xs = x.flatten_all().expect("f").to_vec1::<f32>().expect("v");
        w.matmul(&xs, 3, &mut got, false).expect("matmul");
        let err: f32 = got.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
        let norm: f32 = want.iter().map(|v| v * v).sum();
        assert!(err <= 1e-3 * norm, "error {err} of {norm}");
        assert!(matches!(
            take_quantized(&q8.1).expect("take"),
            Some(StoredBlocks::Int8)
        ));
        // A Q8_0 part beside k-quants: int8 panels; rows no kept tensor holds: dequantised.
        let mixed = Tensor::cat(&[&q8.1, &v.1], 0).expect("cat");
        assert!(matches!(
            take_quantized(&mixed).expect("take"),
            Some(StoredBlocks::Int8)
        ));
        assert!(take_quantized(&floats).expect("take").is_none());
        release_kept();
        assert!(take_quantized(&q.1).expect("take").is_none());
    }
}
