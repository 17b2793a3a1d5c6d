//! CPU operations that run on raw slices of candle tensors, where a fused loop beats a chain
//! of tensor ops: rope + KV write + paged attention, and SiLU-gated multiply.

use candle_core::{DType, Device, Storage, Tensor, WithDType};
use kernels::{CacheShape, KvElem, SeqAttn};
use rayon::prelude::*;

use super::batch::ForwardBatch;
use super::rope::RopeTables;
use crate::error::{EngineError, Result};
use crate::kv::cache::LayerKvMut;

/// Runs `f` on the contiguous CPU slice behind `t`.
pub(crate) fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let data = cpu.as_slice::<T>()?;
            let (a, b) = layout
                .contiguous_offsets()
                .expect("tensor was made contiguous above");
            Ok(f(&data[a..b]))
        }
        _ => Err(EngineError::InvalidConfig {
            reason: "the CPU attention path was given a non-CPU tensor".into(),
        }),
    }
}

/// Attention dimensions of one model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Splits fused QKV rows, applies rope to Q and K, writes K and V into the paged cache and
/// attends. `qkv`: `[T, (H + 2 * Hkv) * D]`. Returns `[T, H * D]`.
pub(crate) fn attention(
    qkv: &Tensor,
    batch: &ForwardBatch,
    rope: &RopeTables,
    layout: &CacheShape,
    kv: LayerKvMut<'_>,
    dims: AttnDims,
) -> Result<Tensor> {
    match kv {
        LayerKvMut::F32(k, v) => attention_typed::<f32>(qkv, batch, rope, layout, k, v, dims),
        LayerKvMut::Bf16(k, v) => {
            attention_typed::<half::bf16>(qkv, batch, rope, layout, k, v, dims)
        }
        LayerKvMut::F16(k, v) => attention_typed::<half::f16>(qkv, batch, rope, layout, k, v, dims),
    }
}

fn attention_typed<T: KvElem + WithDType>(
    qkv: &Tensor,
    batch: &ForwardBatch,
    rope: &RopeTables,
    layout: &CacheShape,
    k_cache: &mut [T],
    v_cache: &mut [T],
    dims: AttnDims,
) -> Result<Tensor> {
    let AttnDims {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
    } = dims;
    let t = batch.num_tokens();
    let row = (h + 2 * hkv) * d;
    let mut q = vec![T::default(); t * h * d];
    let mut k = vec![T::default(); t * hkv * d];
    let mut v = vec![T::default(); t * hkv * d];
    with_slice::<T, _>(qkv, |src| {
        let split = |tok: usize, (qr, (kr, vr)): (&mut [T], (&mut [T], &mut [T]))| {
            let s = &src[tok * row..(tok + 1) * row];
            let mut buf = vec![0f32; d];
            for head in 0..h {
                rope_head(
                    rope,
                    tok,
                    &s[head * d..(head + 1) * d],
                    &mut qr[head * d..(head + 1) * d],
                    &mut buf,
                );
            }
            let ks = &s[h * d..(h + hkv) * d];
            for head in 0..hkv {
                rope_head(
                    rope,
                    tok,
                    &ks[head * d..(head + 1) * d],
                    &mut kr[head * d..(head + 1) * d],
                    &mut buf,
                );
            }
            vr.copy_from_slice(&s[(h + hkv) * d..]);
        };
        let rows = q
            .chunks_mut(h * d)
            .zip(k.chunks_mut(hkv * d).zip(v.chunks_mut(hkv * d)));
        // Rope is cheap per token; only spread it over threads for long prefill chunks.
        if t >= 64 {
            rows.enumerate()
                .par_bridge()
                .for_each(|(tok, r)| split(tok, r));
        } else {
            rows.enumerate().for_each(|(tok, r)| split(tok, r));
        }
    })?;
    kernels::reshape_and_cache(layout, k_cache, v_cache, &k, &v, &batch.slots)?;
    let seqs: Vec<SeqAttn<'_>> = batch
        .seqs
        .iter()
        .map(|s| SeqAttn {
            q_start: s.q_start,
            q_len: s.q_len,
            context_len: s.context_len,
            block_table: &s.block_table,
        })
        .collect();
    let mut out = vec![T::default(); t * h * d];
    let scale = 1.0 / (d as f32).sqrt();
    kernels::paged_attention(layout, k_cache, v_cache, &q, &mut out, h, &seqs, scale)?;
    Ok(Tensor::from_vec(out, (t, h * d), &Device::Cpu)?)
}

#[inline]
fn rope_head<T: KvElem>(rope: &RopeTables, tok: usize, src: &[T], dst: &mut [T], buf: &mut [f32]) {
    for (b, s) in buf.iter_mut().zip(src) {
        *b = s.to_f32();
    }
    rope.apply(tok, buf);
    for (o, b) in dst.iter_mut().zip(buf.iter()) {
        *o = T::from_f32(*b);
    }
}

/// `silu(gate) * up` over fused `[T, 2F]` rows (gate first), giving `[T, F]`.
pub(crate) fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    let (t, two_f) = gate_up.dims2()?;
    let f = two_f / 2;
    match gate_up.dtype() {
        DType::F32 => silu_mul_typed::<f32>(gate_up, t, f),
        DType::BF16 => silu_mul_typed::<half::bf16>(gate_up, t, f),
        DType::F16 => silu_mul_typed::<half::f16>(gate_up, t, f),
        other => Err(EngineError::UnsupportedDtype {
            dtype: format!("{other:?}"),
        }),
    }
}

fn silu_mul_typed<T: KvElem + WithDType>(gate_up: &Tensor, t: usize, f: usize) -> Result<Tensor> {
    let mut out = vec![T::default(); t * f];
    with_slice::<T, _>(gate_up, |src| {
        let body = |(row, o): (usize, &mut [T])| {
            let s = &src[row * 2 * f..(row + 1) * 2 * f];
            let (g, u) = s.split_at(f);
            for i in 0..f {
                let gv = g[i].to_f32();
                o[i] = T::from_f32(gv / (1.0 + (-gv).exp()) * u[i].to_f32());
            }
        };
        if t >= 8 {
            out.par_chunks_mut(f).enumerate().for_each(body);
        } else {
            out.chunks_mut(f).enumerate().for_each(body);
        }
    })?;
    Ok(Tensor::from_vec(out, (t, f), &Device::Cpu)?)
}
