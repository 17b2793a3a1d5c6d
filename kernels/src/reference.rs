//! Slow, obviously correct paged attention: the yardstick for the fast CPU kernels and for
//! the GPU kernels' tests.
//!
//! One query head at a time, one key at a time, a textbook max-subtracted softmax in f32 and no
//! parallelism. It validates its arguments exactly as [`crate::paged_attention`] does.

use crate::attention::AttentionArgs;
use crate::{CacheShape, KernelError, KvElem, SeqAttn};

/// Same contract and signature as [`crate::paged_attention`].
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_reference<T: KvElem>(
    layout: &CacheShape,
    k_cache: &[T],
    v_cache: &[T],
    q: &[T],
    out: &mut [T],
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    scale: f32,
) -> Result<(), KernelError> {
    let args = AttentionArgs {
        layout,
        k_cache: crate::kv_rows::KvRows::Plain(k_cache),
        v_cache: crate::kv_rows::KvRows::Plain(v_cache),
        q,
        num_heads,
        seqs,
        scale,
    };
    args.validate(out.len())?;
    let d = layout.head_dim;
    let group = num_heads / layout.num_kv_heads;
    for s in seqs {
        for i in 0..s.q_len {
            let pos = s.context_len - s.q_len + i;
            let token = s.q_start + i;
            for h in 0..num_heads {
                let kv_head = h / group;
                let at = (token * num_heads + h) * d;
                let q_row: Vec<f32> = q[at..at + d].iter().map(|x| x.to_f32()).collect();
                let scores: Vec<f32> = (0..=pos)
                    .map(|key| {
                        let k_at = row_offset(layout, s.block_table, key, kv_head);
                        let k_row = &k_cache[k_at..k_at + d];
                        let dot: f32 = q_row.iter().zip(k_row).map(|(a, b)| a * b.to_f32()).sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                let mut acc = vec![0.0f32; d];
                for (key, w) in weights.iter().enumerate() {
                    let v_at = row_offset(layout, s.block_table, key, kv_head);
                    for (a, v) in acc.iter_mut().zip(&v_cache[v_at..v_at + d]) {
                        *a += w * v.to_f32();
                    }
                }
                for (o, a) in out[at..at + d].iter_mut().zip(&acc) {
                    *o = T::from_f32(a / total);
                }
            }
        }
    }
    Ok(())
}

/// Element offset of the K (or V) row of position `pos` for `kv_head`.
fn row_offset(layout: &CacheShape, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
    let block = block_table[pos / layout.block_size] as usize;
    let slot = block * layout.block_size + pos % layout.block_size;
    slot * layout.row_elems() + kv_head * layout.head_dim
}
