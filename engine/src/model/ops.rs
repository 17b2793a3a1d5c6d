//! CPU operations that run on raw slices of candle tensors, where a fused loop beats a chain
//! of tensor ops: rope + KV write + paged attention, and SiLU-gated multiply.

use candle_core::{DType, Device, Tensor, WithDType};
use kernels::{AttnOptions, CacheShape, Int8Kv, Int8KvMut, KvElem, SeqAttn};

use super::batch::ForwardBatch;
use super::rope::RopeTables;
use crate::config::Activation;
use crate::error::{EngineError, Result};
use crate::kv::cache::LayerKvMut;

pub(crate) use super::cpu_slice::with_slice;

/// Token rows from which rope and the Q/K/V split run on every kernel thread.
const ROPE_PARALLEL_ROWS: usize = 16;
/// Token rows from which they are cut into several tasks per thread.
const ROPE_BALANCED_ROWS: usize = 64;

/// Attention dimensions of one model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Splits fused QKV rows, applies rope to Q and K, writes K and V into the paged cache and
/// attends as the layer's `opts` say. `qkv`: `[T, (H + 2 * Hkv) * D]`. Returns `[T, H * D]`.
pub(crate) fn attention(qkv: &Tensor, at: &LayerAttn<'_>, kv: LayerKvMut<'_>) -> Result<Tensor> {
    match kv {
        LayerKvMut::F32(k, v) => attention_typed::<f32>(qkv, at, k, v),
        LayerKvMut::Bf16(k, v) => attention_typed::<half::bf16>(qkv, at, k, v),
        LayerKvMut::F16(k, v) => attention_typed::<half::f16>(qkv, at, k, v),
        LayerKvMut::Int8(k, v) => attention_int8(qkv, at, k, v),
    }
}

/// [`attention`] over an int8 cache: Q and the output in f32 whatever the model's dtype, the
/// result converted back to `qkv`'s.
fn attention_int8(
    qkv: &Tensor,
    at: &LayerAttn<'_>,
    k: Int8KvMut<'_>,
    v: Int8KvMut<'_>,
) -> Result<Tensor> {
    let (t, width) = (at.batch.num_tokens(), at.dims.num_heads * at.dims.head_dim);
    let out = match qkv.dtype() {
        DType::BF16 => with_slice::<half::bf16, _>(qkv, |s| attention_rows_int8(s, at, k, v))??,
        DType::F16 => with_slice::<half::f16, _>(qkv, |s| attention_rows_int8(s, at, k, v))??,
        _ => with_slice::<f32, _>(&qkv.to_dtype(DType::F32)?, |s| {
            attention_rows_int8(s, at, k, v)
        })??,
    };
    Ok(Tensor::from_vec(out, (t, width), &Device::Cpu)?.to_dtype(qkv.dtype())?)
}

/// [`attention_rows`] over an int8 cache: rows are quantised as they are written, and
/// attention reads the int8 rows directly. Returns `[T, H * D]` in f32.
pub(crate) fn attention_rows_int8<S: KvElem>(
    src: &[S],
    at: &LayerAttn<'_>,
    mut k_cache: Int8KvMut<'_>,
    mut v_cache: Int8KvMut<'_>,
) -> Result<Vec<f32>> {
    let q = rope_and_cache_int8(src, at, &mut k_cache, &mut v_cache)?;
    let seqs = seq_attns(at.batch);
    attend_int8(&q, &seqs, at, k_cache.as_ref(), v_cache.as_ref())
}

/// [`rope_and_cache`] into an int8 cache. Returns Q in f32.
pub(crate) fn rope_and_cache_int8<S: KvElem>(
    src: &[S],
    at: &LayerAttn<'_>,
    k_cache: &mut Int8KvMut<'_>,
    v_cache: &mut Int8KvMut<'_>,
) -> Result<Vec<f32>> {
    let (q, k, v) = rope_split::<S, f32>(src, at);
    let kc = Int8KvMut {
        data: &mut *k_cache.data,
        scales: &mut *k_cache.scales,
    };
    let vc = Int8KvMut {
        data: &mut *v_cache.data,
        scales: &mut *v_cache.scales,
    };
    kernels::reshape_and_cache_int8(at.layout, kc, vc, &k, &v, &at.batch.slots)?;
    Ok(q)
}

/// [`attend`] over an int8 cache.
pub(crate) fn attend_int8(
    q: &[f32],
    seqs: &[SeqAttn<'_>],
    at: &LayerAttn<'_>,
    k_cache: Int8Kv<'_>,
    v_cache: Int8Kv<'_>,
) -> Result<Vec<f32>> {
    let h = at.dims.num_heads;
    let mut out = vec![0f32; q.len()];
    kernels::paged_attention_int8(at.layout, k_cache, v_cache, q, &mut out, h, seqs, at.opts)?;
    Ok(out)
}

fn seq_attns(batch: &ForwardBatch) -> Vec<SeqAttn<'_>> {
    batch
        .seqs
        .iter()
        .map(|s| SeqAttn {
            q_start: s.q_start,
            q_len: s.q_len,
            context_len: s.context_len,
            block_table: &s.block_table,
        })
        .collect()
}

/// What one layer's attention reads besides its rows and the cache: the step, the layer's rope
/// tables, the cache layout, and its scale, window and soft-cap.
pub(crate) struct LayerAttn<'a> {
    pub batch: &'a ForwardBatch,
    pub rope: &'a RopeTables,
    pub layout: &'a CacheShape,
    pub dims: AttnDims,
    pub opts: AttnOptions,
}

fn attention_typed<T: KvElem + WithDType>(
    qkv: &Tensor,
    at: &LayerAttn<'_>,
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> Result<Tensor> {
    let (batch, dims) = (at.batch, at.dims);
    let t = batch.num_tokens();
    let out = with_slice::<T, _>(qkv, |src| attention_rows(src, at, k_cache, v_cache))??;
    Ok(Tensor::from_vec(
        out,
        (t, dims.num_heads * dims.head_dim),
        &Device::Cpu,
    )?)
}

/// [`attention`] on raw rows: `qkv` is `[T, (H + 2 * Hkv) * D]`, the result `[T, H * D]`.
pub(crate) fn attention_rows<S: KvElem, T: KvElem>(
    src: &[S],
    at: &LayerAttn<'_>,
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> Result<Vec<T>> {
    let q = rope_and_cache(src, at, k_cache, v_cache)?;
    let seqs = seq_attns(at.batch);
    attend(&q, &seqs, at, k_cache, v_cache)
}

/// The first half of [`attention_rows`]: splits the fused rows, applies rope to Q and K, and
/// writes every row's K and V into the cache. Returns Q, `[T, H * D]`.
pub(crate) fn rope_and_cache<S: KvElem, T: KvElem>(
    src: &[S],
    at: &LayerAttn<'_>,
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> Result<Vec<T>> {
    let (q, k, v) = rope_split::<S, T>(src, at);
    kernels::reshape_and_cache(at.layout, k_cache, v_cache, &k, &v, &at.batch.slots)?;
    Ok(q)
}

/// Splits the fused rows and applies rope to Q and K: `(Q, K, V)`, each `[T, heads * D]`.
fn rope_split<S: KvElem, T: KvElem>(src: &[S], at: &LayerAttn<'_>) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (batch, rope, dims) = (at.batch, at.rope, at.dims);
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
    {
        let split = |tok: usize, qr: &mut [T], kr: &mut [T], vr: &mut [T], buf: &mut [f32]| {
            let s = &src[tok * row..(tok + 1) * row];
            for head in 0..h {
                let r = head * d..(head + 1) * d;
                rope_head(rope, tok, &s[r.clone()], &mut qr[r], buf);
            }
            let ks = &s[h * d..(h + hkv) * d];
            for head in 0..hkv {
                let r = head * d..(head + 1) * d;
                rope_head(rope, tok, &ks[r.clone()], &mut kr[r], buf);
            }
            for (o, x) in vr.iter_mut().zip(&s[(h + hkv) * d..]) {
                *o = T::from_f32(x.to_f32());
            }
        };
        let (qs, ks, vs) = (
            SharedRows::new(&mut q, h * d),
            SharedRows::new(&mut k, hkv * d),
            SharedRows::new(&mut v, hkv * d),
        );
        // Rope is cheap per token: a decode batch of a few dozen rows is worth one task per
        // thread, a prefill chunk several for balance, a handful of rows no hand-off at all.
        let tasks = match t {
            0..ROPE_PARALLEL_ROWS => 1,
            ROPE_PARALLEL_ROWS..ROPE_BALANCED_ROWS => kernels::pool_threads(),
            _ => kernels::pool_threads() * 4,
        };
        let per = t.div_ceil(tasks);
        kernels::parallel_for(tasks, &|task| {
            let mut buf = vec![0f32; d];
            for tok in task * per..((task + 1) * per).min(t) {
                // SAFETY: each task owns its own token rows of q, k and v.
                let (qr, kr, vr) = unsafe { (qs.row(tok), ks.row(tok), vs.row(tok)) };
                split(tok, qr, kr, vr, &mut buf);
            }
        });
    }
    (q, k, v)
}

/// The second half of [`attention_rows`]: the query rows `q` (`[rows, H * D]`) of `seqs`
/// against the cache, with the layer's scale, window and soft-cap. Returns `[rows, H * D]`.
pub(crate) fn attend<T: KvElem>(
    q: &[T],
    seqs: &[SeqAttn<'_>],
    at: &LayerAttn<'_>,
    k_cache: &[T],
    v_cache: &[T],
) -> Result<Vec<T>> {
    let h = at.dims.num_heads;
    let mut out = vec![T::default(); q.len()];
    kernels::paged_attention_with(at.layout, k_cache, v_cache, q, &mut out, h, seqs, at.opts)?;
    Ok(out)
}

/// Rows of a buffer that several tasks fill, each its own rows.
struct SharedRows<T> {
    ptr: *mut T,
    len: usize,
    width: usize,
}

// SAFETY: tasks only reach disjoint rows through `row`, whose contract says so.
unsafe impl<T: Send> Sync for SharedRows<T> {}

impl<T> SharedRows<T> {
    fn new(buf: &mut [T], width: usize) -> Self {
        SharedRows {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            width,
        }
    }

    /// # Safety
    /// No other task may use row `i` while this borrow lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, i: usize) -> &mut [T] {
        assert!((i + 1) * self.width <= self.len, "row {i} out of bounds");
        // SAFETY: in bounds (checked), and exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.width), self.width) }
    }
}

#[inline]
fn rope_head<S: KvElem, T: KvElem>(
    rope: &RopeTables,
    tok: usize,
    src: &[S],
    dst: &mut [T],
    buf: &mut [f32],
) {
    for (b, s) in buf.iter_mut().zip(src) {
        *b = s.to_f32();
    }
    rope.apply(tok, buf);
    for (o, b) in dst.iter_mut().zip(buf.iter()) {
        *o = T::from_f32(*b);
    }
}

/// `act(gate) * up` over fused `[T, 2F]` rows (gate first), giving `[T, F]`.
pub(crate) fn gate_mul(gate_up: &Tensor, act: Activation) -> Result<Tensor> {
    let (t, two_f) = gate_up.dims2()?;
    let f = two_f / 2;
    if !gate_up.device().is_cpu() {
        // Off the CPU, as tensor ops (the device's own rounding; the CPU keeps the loop
        // below, which is transformers' to the bit).
        let (g, u) = (gate_up.narrow(1, 0, f)?, gate_up.narrow(1, f, f)?);
        let a = match act {
            Activation::Silu => candle_nn::ops::silu(&g)?,
            Activation::GeluTanh => g.gelu()?,
        };
        return Ok((a * u)?);
    }
    match gate_up.dtype() {
        DType::F32 => gate_mul_typed::<f32>(gate_up, t, f, act),
        DType::BF16 => gate_mul_typed::<half::bf16>(gate_up, t, f, act),
        DType::F16 => gate_mul_typed::<half::f16>(gate_up, t, f, act),
        other => Err(EngineError::UnsupportedDtype {
            dtype: format!("{other:?}"),
        }),
    }
}

fn gate_mul_typed<T: KvElem + WithDType>(
    gate_up: &Tensor,
    t: usize,
    f: usize,
    act: Activation,
) -> Result<Tensor> {
    let mut out = vec![T::default(); t * f];
    with_slice::<T, _>(gate_up, |src| gate_mul_rows(src, t, f, act, &mut out))?;
    Ok(Tensor::from_vec(out, (t, f), &Device::Cpu)?)
}

/// [`gate_mul`] on raw rows: `src` is `[T, 2F]`, `out` `[T, F]`.
pub(crate) fn gate_mul_rows<T: KvElem>(
    src: &[T],
    t: usize,
    f: usize,
    act: Activation,
    out: &mut [T],
) {
    let body = |row: usize, o: &mut [T]| {
        let s = &src[row * 2 * f..(row + 1) * 2 * f];
        let (g, u) = s.split_at(f);
        for i in 0..f {
            let gv = g[i].to_f32();
            let a = match act {
                Activation::Silu => gv / (1.0 + (-gv).exp()),
                Activation::GeluTanh => gelu_tanh(gv),
            };
            o[i] = T::from_f32(a * u[i].to_f32());
        }
    };
    for_rows(out, t, f, 8, &body);
}

/// torch's `gelu(x, approximate="tanh")` in f32, as its CPU kernel writes it.
#[inline]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// Final-logit soft-capping, `cap * tanh(logit / cap)`, in place (Gemma 2); both paths.
pub(crate) fn softcap_logits(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        for l in logits {
            *l = (*l / cap).tanh() * cap;
        }
    }
}

/// Embedding rows times sqrt(hidden), the scale and each product rounded to the embedding
/// dtype `T`, as transformers' Gemma embedding does; `x` holds the rows widened to f32.
pub(crate) fn scale_embeddings<T: KvElem>(x: &mut [f32], hidden: usize) {
    let scale = T::from_f32((hidden as f64).sqrt() as f32).to_f32();
    for v in x {
        *v = T::from_f32(*v * scale).to_f32();
    }
}

/// Runs `body(row, out_row)` over the `t` rows of `out` (`width` wide), across the kernel
/// threads once there are `parallel_from` rows or more.
pub(crate) fn for_rows<T: Send>(
    out: &mut [T],
    t: usize,
    width: usize,
    parallel_from: usize,
    body: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    if t < parallel_from {
        for (row, o) in out.chunks_mut(width).enumerate().take(t) {
            body(row, o);
        }
        return;
    }
    let rows = SharedRows::new(out, width);
    let tasks = kernels::pool_threads().min(t);
    let per = t.div_ceil(tasks);
    kernels::parallel_for(tasks, &|task| {
        for row in task * per..((task + 1) * per).min(t) {
            // SAFETY: each task owns its own rows.
            body(row, unsafe { rows.row(row) });
        }
    });
}

/// `out = act(gate) * up` over `n` host rows of fused `[gate | up]`, `f` wide each: the host
/// path's gating, dense or expert.
pub(crate) fn gate_act_rows(gate_up: &[f32], n: usize, f: usize, act: Activation, out: &mut [f32]) {
    match act {
        Activation::Silu => {
            let body = |row: usize, o: &mut [f32]| {
                let (g, u) = gate_up[row * 2 * f..(row + 1) * 2 * f].split_at(f);
                kernels::silu_mul(g, u, o);
            };
            for_rows(out, n, f, 8, &body);
        }
        Activation::GeluTanh => gate_mul_rows(gate_up, n, f, act, out),
    }
}
