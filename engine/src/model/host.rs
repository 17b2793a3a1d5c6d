//! The forward pass on the CPU, on plain f32 slices, over f32 or bf16 weights.
//!
//! candle's tensor ops allocate, dispatch and (for norms over more than 32 rows) fork rayon
//! tasks per op, which on a small model costs more than the arithmetic: stories260K spent
//! 0.9 ms a token on it. Here a step is the packed matmuls, the fused attention and a few row
//! loops over buffers allocated once per step, and the two residual adds ride along with the
//! matmuls that produce them (`packed_matmul_add`). Every parallel loop runs on the kernels'
//! spinning pool. Activations stay f32 whatever the weights' dtype (bf16 weights are widened in
//! the matmul's registers; a bf16 KV cache is rounded on the way in). f16 and other devices
//! take the tensor path in `llama.rs`.

use candle_core::{DType, Device, Tensor};
use kernels::KvElem;

use super::batch::ForwardBatch;
use super::llama::{Llama, RmsNorm};
use super::ops::{self, with_slice, AttnDims};
use crate::error::{EngineError, Result};
use crate::kv::cache::{KvCache, LayerKvMut};

/// Rows of a norm below which one thread is quicker than a hand-off.
const PARALLEL_ROWS: usize = 32;

impl Llama {
    /// The slice path's forward: the same contract as
    /// [`forward_with_layer_hook`](Llama::forward_with_layer_hook).
    pub(super) fn forward_host(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        on_layer: &mut dyn FnMut(usize, &mut KvCache) -> Result<()>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (t, hid) = (batch.num_tokens(), cfg.hidden_size);
        let mut x = vec![0f32; t * hid];
        let table = self.embed.embeddings();
        match table.dtype() {
            DType::F32 => {
                with_slice::<f32, _>(table, |t| gather_rows(t, &batch.token_ids, &mut x))??
            }
            DType::BF16 => {
                with_slice::<half::bf16, _>(table, |t| gather_rows(t, &batch.token_ids, &mut x))??
            }
            other => {
                return Err(EngineError::UnsupportedDtype {
                    dtype: format!("{other:?}"),
                })
            }
        }
        let rope = self.rope.tables(&batch.positions);
        let dims = AttnDims {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let layout = *cache.shape();
        let f = cfg.intermediate_size;
        let mut h = vec![0f32; t * hid];
        let mut qkv = vec![0f32; t * (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim];
        let mut gate_up = vec![0f32; t * 2 * f];
        let mut act = vec![0f32; t * f];
        for (i, layer) in self.layers.iter().enumerate() {
            rms_norm_rows(&layer.input_norm, &x, t, &mut h)?;
            layer.qkv.forward_host(&h, t, &mut qkv, false)?;
            let attn = match cache.layer_mut(i) {
                LayerKvMut::F32(k, v) => {
                    ops::attention_rows(&qkv, batch, &rope, &layout, k, v, dims)?
                }
                LayerKvMut::Bf16(k, v) => to_f32(ops::attention_rows(
                    &qkv, batch, &rope, &layout, k, v, dims,
                )?),
                LayerKvMut::F16(k, v) => to_f32(ops::attention_rows(
                    &qkv, batch, &rope, &layout, k, v, dims,
                )?),
            };
            layer.o_proj.forward_host(&attn, t, &mut x, true)?;
            rms_norm_rows(&layer.post_norm, &x, t, &mut h)?;
            layer.gate_up.forward_host(&h, t, &mut gate_up, false)?;
            silu_mul_rows(&gate_up, t, f, &mut act);
            layer.down.forward_host(&act, t, &mut x, true)?;
            on_layer(i, cache)?;
        }
        let rows = batch.logits_rows.len();
        let mut last = vec![0f32; rows * hid];
        for (dst, &r) in last.chunks_mut(hid).zip(&batch.logits_rows) {
            let r = r as usize;
            dst.copy_from_slice(&x[r * hid..(r + 1) * hid]);
        }
        let mut normed = vec![0f32; rows * hid];
        rms_norm_rows(&self.norm, &last, rows, &mut normed)?;
        let mut logits = vec![0f32; rows * cfg.vocab_size];
        self.lm_head
            .forward_host(&normed, rows, &mut logits, false)?;
        Ok(Tensor::from_vec(
            logits,
            (rows, cfg.vocab_size),
            &Device::Cpu,
        )?)
    }

    /// Whether [`forward_host`](Self::forward_host) can run this model.
    pub(super) fn runs_on_host(&self) -> bool {
        matches!(self.dtype, DType::F32 | DType::BF16)
            && matches!(self.device, Device::Cpu)
            && self.lm_head.is_packed()
            && self
                .layers
                .iter()
                .all(|l| l.qkv.is_packed() && l.o_proj.is_packed() && l.gate_up.is_packed())
            && self.layers.iter().all(|l| l.down.is_packed())
    }
}

/// `out = x / rms(x) * weight`, row by row: the sum of squares in f32 (in 16 lanes), divide,
/// then scale, as candle rounds it.
fn rms_norm_rows(norm: &RmsNorm, x: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
    let w = &norm.host;
    let n = w.len();
    let body = |row: usize, o: &mut [f32]| {
        kernels::rms_norm(&x[row * n..(row + 1) * n], w, norm.eps, o);
    };
    ops::for_rows(out, t, n, PARALLEL_ROWS, &body);
    Ok(())
}

/// `out = silu(gate) * up`, row by row; each row of `gate_up` holds its gate, then its up.
fn silu_mul_rows(gate_up: &[f32], t: usize, f: usize, out: &mut [f32]) {
    let body = |row: usize, o: &mut [f32]| {
        let (g, u) = gate_up[row * 2 * f..(row + 1) * 2 * f].split_at(f);
        kernels::silu_mul(g, u, o);
    };
    ops::for_rows(out, t, f, 8, &body);
}

/// Copies the embedding rows of `ids` into `x`, widened to f32.
fn gather_rows<T: KvElem>(table: &[T], ids: &[u32], x: &mut [f32]) -> Result<()> {
    let hid = x.len() / ids.len().max(1);
    for (row, &id) in x.chunks_mut(hid.max(1)).zip(ids) {
        let id = id as usize;
        let src =
            table
                .get(id * hid..(id + 1) * hid)
                .ok_or_else(|| EngineError::InvalidConfig {
                    reason: format!("token id {id} is outside the vocabulary"),
                })?;
        for (d, s) in row.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    Ok(())
}

/// Attention output in a 16-bit KV cache's dtype, widened for the next projection.
fn to_f32<T: KvElem>(v: Vec<T>) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
