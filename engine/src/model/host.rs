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
use kernels::{KvElem, SeqAttn};

use super::batch::ForwardBatch;
use super::llama::{Layer, Llama};
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::op_timing::{timed, Op};
use super::ops::{self, gate_act_rows, with_slice, AttnDims, LayerAttn};
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
        let scale = cfg.arch.embed_scale.then_some(hid);
        match table.dtype() {
            DType::F32 => {
                with_slice::<f32, _>(table, |t| gather_rows(t, &batch.token_ids, &mut x, scale))??
            }
            DType::BF16 => with_slice::<half::bf16, _>(table, |t| {
                gather_rows(t, &batch.token_ids, &mut x, scale)
            })??,
            other => {
                return Err(EngineError::UnsupportedDtype {
                    dtype: format!("{other:?}"),
                })
            }
        }
        let ropes = self.rope_tables(&batch.positions);
        let dims = AttnDims {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let f = cfg.intermediate_size;
        let mut h = vec![0f32; t * hid];
        let mut qkv = vec![0f32; t * (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim];
        let mut gate_up = vec![0f32; t * 2 * f];
        let mut act = vec![0f32; t * f];
        // Sandwich norms need the projections' output apart from the residual.
        // So do the experts' sums.
        let apart = cfg.arch.sandwich_norms || cfg.moe.is_some();
        let mut o = vec![0f32; if apart { t * hid } else { 0 }];
        let mut out_rows = None;
        let last_layer = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            // A sliding-window layer reads its own group's blocks (`kv::groups`).
            let (batch, layout) = (
                batch.for_group(cache.groups().group_of(i)),
                *cache.layer_shape(i),
            );
            rms_norm_rows(&layer.input_norm, &x, t, &mut h)?;
            timed(Op::Qkv, || layer.qkv.forward_host(&h, t, &mut qkv, false))?;
            if let Some(norm) = &layer.qk_norm {
                timed(Op::Norm, || norm.forward_host(&mut qkv, t, dims));
            }
            let at = LayerAt {
                index: i,
                attn: LayerAttn {
                    batch,
                    rope: ropes.for_layer(layer),
                    layout: &layout,
                    dims,
                    opts: layer.attn,
                },
            };
            let mlp = MlpBuffers {
                h: &mut h,
                gate_up: &mut gate_up,
                act: &mut act,
                o: &mut o,
            };
            if i == last_layer {
                // The last layer, in full only for the rows whose logits are wanted: every
                // row's K and V still go into the cache (later tokens attend to them), but the
                // other rows' attention, output projection and MLP feed nothing. That is 2.99 M
                // of SmolLM2's 3.54 M weights a layer, 2.8% of a prompt's projection FLOPs over
                // its 30 layers, and what llama.cpp skips too (prefill 512 ran 1.06x faster
                // under AVX2). Each wanted row attends as a sequence of its own, so its result
                // does not depend on how its prompt was chunked or batched.
                let seqs = wanted_rows(batch)?;
                let attn = layer_attention(cache, &at, &qkv, Some(&seqs))?;
                let mut rows = gather_logits_rows(&x, hid, &batch.logits_rows);
                self.mlp_half(layer, &attn, seqs.len(), &mut rows, mlp)?;
                out_rows = Some(rows);
                on_layer(i, cache)?;
                break;
            }
            let attn = layer_attention(cache, &at, &qkv, None)?;
            self.mlp_half(layer, &attn, t, &mut x, mlp)?;
            on_layer(i, cache)?;
        }
        let rows = batch.logits_rows.len();
        let last = match out_rows {
            Some(last) => last,
            None => gather_logits_rows(&x, hid, &batch.logits_rows),
        };
        let mut normed = vec![0f32; rows * hid];
        rms_norm_rows(&self.norm, &last, rows, &mut normed)?;
        let mut logits = vec![0f32; rows * cfg.vocab_size];
        timed(Op::LmHead, || {
            self.lm_head.forward_host(&normed, rows, &mut logits, false)
        })?;
        ops::softcap_logits(&mut logits, cfg.final_softcap);
        Ok(Tensor::from_vec(
            logits,
            (rows, cfg.vocab_size),
            &Device::Cpu,
        )?)
    }

    /// The layer after its attention, for `n` rows of `x` in place: the output projection with
    /// its residual, the norm before the MLP and the MLP with its residual (and, with sandwich
    /// norms, the norms on the projection's and the MLP's outputs before their residual adds).
    fn mlp_half(
        &self,
        layer: &Layer,
        attn: &[f32],
        n: usize,
        x: &mut [f32],
        bufs: MlpBuffers<'_>,
    ) -> Result<()> {
        let (hid, f) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let MlpBuffers { h, gate_up, act, o } = bufs;
        let (h, gate_up, act) = (
            &mut h[..n * hid],
            &mut gate_up[..n * 2 * f],
            &mut act[..n * f],
        );
        match &layer.post_attn_norm {
            None => timed(Op::OProj, || layer.o_proj.forward_host(attn, n, x, true))?,
            Some(norm) => {
                let o = &mut o[..n * hid];
                timed(Op::OProj, || layer.o_proj.forward_host(attn, n, o, false))?;
                rms_norm_rows(norm, o, n, h)?;
                add_rows(x, h);
            }
        }
        rms_norm_rows(&layer.post_norm, x, n, h)?;
        let activation = self.cfg.arch.activation;
        let (gate_up_w, down) = match &layer.mlp {
            Mlp::Dense { gate_up, down } => (gate_up, down),
            Mlp::Experts(moe) => {
                // The experts' sum lands apart from the residual and is added once, as
                // transformers adds it.
                let o = &mut o[..n * hid];
                moe.forward_host(h, n, activation, o)?;
                if let Some(norm) = &layer.post_ffn_norm {
                    rms_norm_rows(norm, o, n, h)?;
                    add_rows(x, h);
                } else {
                    add_rows(x, o);
                }
                return Ok(());
            }
        };
        timed(Op::GateUp, || gate_up_w.forward_host(h, n, gate_up, false))?;
        timed(Op::Silu, || gate_act_rows(gate_up, n, f, activation, act));
        match &layer.post_ffn_norm {
            None => timed(Op::Down, || down.forward_host(act, n, x, true)),
            Some(norm) => {
                let o = &mut o[..n * hid];
                timed(Op::Down, || down.forward_host(act, n, o, false))?;
                rms_norm_rows(norm, o, n, h)?;
                add_rows(x, h);
                Ok(())
            }
        }
    }

    /// Whether [`forward_host`](Self::forward_host) can run this model.
    pub(super) fn runs_on_host(&self) -> bool {
        matches!(self.dtype, DType::F32 | DType::BF16)
            && matches!(self.device, Device::Cpu)
            && self.lm_head.is_packed()
            && self
                .layers
                .iter()
                .all(|l| l.qkv.is_packed() && l.o_proj.is_packed() && l.mlp.is_packed())
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
    timed(Op::Norm, || ops::for_rows(out, t, n, PARALLEL_ROWS, &body));
    Ok(())
}

/// `x += y`, element by element.
fn add_rows(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// The step's MLP buffers, sized for all its rows, lent to [`Llama::mlp_half`].
struct MlpBuffers<'a> {
    h: &'a mut [f32],
    gate_up: &'a mut [f32],
    act: &'a mut [f32],
    /// A projection's output before its norm and residual add (empty without sandwich norms).
    o: &'a mut [f32],
}

/// A layer's place in the step: its index and what its attention needs.
struct LayerAt<'a> {
    index: usize,
    attn: LayerAttn<'a>,
}

/// A layer's attention over the cache's dtype, widened to f32: every row's K and V written,
/// then every row attending (`wanted` none), or only the logits rows, as `wanted`'s sequences.
fn layer_attention(
    cache: &mut KvCache,
    at: &LayerAt<'_>,
    qkv: &[f32],
    wanted: Option<&[SeqAttn<'_>]>,
) -> Result<Vec<f32>> {
    timed(Op::Attention, || {
        Ok(match cache.layer_mut(at.index) {
            LayerKvMut::F32(k, v) => attend_rows(qkv, at, wanted, k, v)?,
            LayerKvMut::Bf16(k, v) => to_f32(attend_rows(qkv, at, wanted, k, v)?),
            LayerKvMut::F16(k, v) => to_f32(attend_rows(qkv, at, wanted, k, v)?),
            LayerKvMut::Int8(k, v) => attend_rows_int8(qkv, at, wanted, k, v)?,
        })
    })
}

/// [`layer_attention`] on one cache dtype.
fn attend_rows<T: KvElem>(
    qkv: &[f32],
    at: &LayerAt<'_>,
    wanted: Option<&[SeqAttn<'_>]>,
    k: &mut [T],
    v: &mut [T],
) -> Result<Vec<T>> {
    let at = &at.attn;
    let Some(seqs) = wanted else {
        return ops::attention_rows(qkv, at, k, v);
    };
    let q = ops::rope_and_cache(qkv, at, k, v)?;
    let width = at.dims.num_heads * at.dims.head_dim;
    let mut rows = Vec::with_capacity(seqs.len() * width);
    for &r in &at.batch.logits_rows {
        let r = r as usize;
        rows.extend_from_slice(&q[r * width..(r + 1) * width]);
    }
    ops::attend(&rows, seqs, at, k, v)
}

/// [`attend_rows`] over an int8 cache.
fn attend_rows_int8(
    qkv: &[f32],
    at: &LayerAt<'_>,
    wanted: Option<&[SeqAttn<'_>]>,
    mut k: kernels::Int8KvMut<'_>,
    mut v: kernels::Int8KvMut<'_>,
) -> Result<Vec<f32>> {
    let at = &at.attn;
    let Some(seqs) = wanted else {
        return ops::attention_rows_int8(qkv, at, k, v);
    };
    let q = ops::rope_and_cache_int8(qkv, at, &mut k, &mut v)?;
    let width = at.dims.num_heads * at.dims.head_dim;
    let mut rows = Vec::with_capacity(seqs.len() * width);
    for &r in &at.batch.logits_rows {
        let r = r as usize;
        rows.extend_from_slice(&q[r * width..(r + 1) * width]);
    }
    ops::attend_int8(&rows, seqs, at, k.as_ref(), v.as_ref())
}

/// Each logits row as a sequence of one query row: it sees the keys up to its own position,
/// through its sequence's block table. Row `j` of the result is `logits_rows[j]`.
fn wanted_rows(batch: &ForwardBatch) -> Result<Vec<SeqAttn<'_>>> {
    batch
        .logits_rows
        .iter()
        .enumerate()
        .map(|(j, &r)| {
            let r = r as usize;
            // Sequences are pushed in row order.
            let s = batch.seqs.partition_point(|s| s.q_start + s.q_len <= r);
            let seq = batch
                .seqs
                .get(s)
                .filter(|s| s.q_start <= r)
                .ok_or_else(|| EngineError::InvalidConfig {
                    reason: format!("logits row {r} is in no sequence of the batch"),
                })?;
            Ok(SeqAttn {
                q_start: j,
                q_len: 1,
                context_len: seq.context_len - (seq.q_start + seq.q_len - 1 - r),
                block_table: &seq.block_table,
            })
        })
        .collect()
}

/// The rows of `x` (`hid` wide) that `rows` names, in that order.
fn gather_logits_rows(x: &[f32], hid: usize, rows: &[u32]) -> Vec<f32> {
    let mut out = vec![0f32; rows.len() * hid];
    for (dst, &r) in out.chunks_mut(hid).zip(rows) {
        let r = r as usize;
        dst.copy_from_slice(&x[r * hid..(r + 1) * hid]);
    }
    out
}

/// Copies the embedding rows of `ids` into `x`, widened to f32, and scaled by sqrt(`scale`)
/// in the table's dtype when the architecture scales its embeddings.
fn gather_rows<T: KvElem>(
    table: &[T],
    ids: &[u32],
    x: &mut [f32],
    scale: Option<usize>,
) -> Result<()> {
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
    if let Some(hidden) = scale {
        ops::scale_embeddings::<T>(x, hidden);
    }
    Ok(())
}

/// Attention output in a 16-bit KV cache's dtype, widened for the next projection.
fn to_f32<T: KvElem>(v: Vec<T>) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::ModelSource;
    use crate::model::{LoadedModel, Model};

    fn stories() -> Llama {
        let dir = testkit::shared_model("stories260K");
        let model = LoadedModel::load(&ModelSource::Local(dir), None, &Device::Cpu)
            .expect("stories260K loads");
        match &*model.model {
            Model::Llama(m) => m.clone(),
            Model::Mock(_) => panic!("stories260K loads as a Llama"),
        }
    }

    /// A 37-token prompt, then a 21-token chunk of another sequence after 19 cached tokens.
    fn step(cache: &mut KvCache, m: &Llama, logits: &[u32]) -> Vec<f32> {
        let cfg = m.config();
        let bs = cache.shape().block_size;
        let ids = |n: usize, salt: usize| -> Vec<u32> {
            (0..n)
                .map(|i| ((i * 31 + salt) % (cfg.vocab_size - 3) + 3) as u32)
                .collect()
        };
        // The second sequence's cached prefix first, as its own step.
        let mut prefix = ForwardBatch::default();
        prefix.push_seq(&ids(19, 5), 0, vec![3, 4], bs, false);
        m.forward(&prefix, cache).expect("prefix");
        let mut fb = ForwardBatch::default();
        fb.push_seq(&ids(37, 1), 0, vec![0, 1, 2], bs, false);
        fb.push_seq(&ids(21, 9), 19, vec![3, 4, 5], bs, false);
        fb.logits_rows = logits.to_vec();
        let out = m.forward(&fb, cache).expect("forward");
        out.flatten_all().and_then(|t| t.to_vec1()).expect("logits")
    }

    fn cache_for(m: &Llama) -> KvCache {
        let cfg = m.config();
        KvCache::new(
            kv_types::KvLayout {
                dtype: kv_types::KvDtype::F32,
                num_layers: cfg.num_layers as u32,
                block_size: 16,
                num_kv_heads: cfg.num_kv_heads as u32,
                head_dim: cfg.head_dim as u32,
                windows: Default::default(),
            },
            8,
        )
    }

    /// The last layer runs only the wanted rows: their logits are those of a full forward (the
    /// tensor path), a row's bits do not depend on which other rows are wanted, and the
    /// unwanted rows' K and V still reach the cache.
    #[test]
    fn the_output_layer_computes_only_the_wanted_rows_and_the_same_logits() {
        let host = stories();
        assert!(host.host, "stories260K runs on the host path");
        let mut tensor = host.clone();
        tensor.host = false;
        let vocab = host.config().vocab_size;
        let wanted = [36, 57];
        let every: Vec<u32> = (0..58).collect();
        let (mut a, mut b, mut c) = (cache_for(&host), cache_for(&host), cache_for(&host));
        let few = step(&mut a, &host, &wanted);
        let all = step(&mut b, &host, &every);
        let full = step(&mut c, &tensor, &wanted);
        for (j, &r) in wanted.iter().enumerate() {
            let row = |v: &[f32], i: usize| v[i * vocab..(i + 1) * vocab].to_vec();
            let (few, all, full) = (row(&few, j), row(&all, r as usize), row(&full, j));
            assert_eq!(few, all, "row {r}: the same bits whatever else is wanted");
            let worst = few
                .iter()
                .zip(&full)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-3, "row {r}: {worst} from the full forward");
        }
        // Every row's K and V of the last layer, wanted or not, are in the cache.
        let last = host.config().num_layers - 1;
        let (LayerKvMut::F32(ka, _), LayerKvMut::F32(kc, _)) =
            (a.layer_mut(last), c.layer_mut(last))
        else {
            panic!("f32 caches");
        };
        let (ka, kc) = (ka.to_vec(), kc.to_vec());
        let worst = ka
            .iter()
            .zip(&kc)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            ka.iter().any(|&x| x != 0.0) && worst < 1e-4,
            "last layer K: {worst}"
        );
    }

    /// With profiling on, every op of the host forward adds its time, nested in the forward's;
    /// off, nothing is added.
    #[test]
    fn profiling_times_each_op_inside_the_forward_and_nothing_when_off() {
        use crate::model::op_timing::{self, Op};
        let m = stories();
        let mut cache = cache_for(&m);
        // Off (the default; no other test switches it on): nothing accrues.
        let before = op_timing::snapshot();
        step(&mut cache, &m, &[36, 57]);
        let off = op_timing::snapshot().since(&before);
        for op in Op::ALL {
            assert!(off.get(op).is_zero(), "{} timed while off", op.name());
        }
        op_timing::enable(true);
        let before = op_timing::snapshot();
        step(&mut cache_for(&m), &m, &[36, 57]);
        let on = op_timing::snapshot().since(&before);
        op_timing::enable(false);
        // Each op on its own rather than their sum: a parallel test's forward may be part-way
        // through when profiling stops, with its ops counted and its whole not yet.
        for op in Op::ALL.into_iter().filter(|&op| op != Op::Forward) {
            assert!(!on.get(op).is_zero(), "{} not timed", op.name());
            assert!(
                on.get(op) <= on.get(Op::Forward),
                "{} {:?} outside the forward {:?}",
                op.name(),
                on.get(op),
                on.get(Op::Forward)
            );
        }
    }
}
