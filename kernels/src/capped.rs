//! The paged-attention entry points, [`paged_attention`] and [`paged_attention_with`] (sliding
//! windows and soft-capping), above the tiled kernels of `attention.rs`, and the
//! exact per-row loop that runs what the SIMD tiles cannot yet (soft-capping, and a window on a
//! GQA group wide enough for the wide path).
//!
//! The loop computes each query row on its own, one head at a time, in f32 with a
//! max-subtracted softmax: what transformers' eager attention does, so a Gemma 2 layer matches
//! it as closely as the rest of the model does. Rows run in parallel on the kernel pool.

use crate::attention::AttentionArgs;
use crate::kv_rows::KvRows;
use crate::pool;
use crate::simd::Isa;
use crate::tile::{SharedOut, Tile};
use crate::{CacheShape, KernelError, KvElem, SeqAttn};

/// Paged attention for a ragged batch (prefill chunks and decode rows mixed, no padding).
///
/// `q` and `out` are `[num_tokens, num_heads, head_dim]`, where `num_tokens` is the sum of the
/// `q_len`s and sequence `s` owns rows `q_start..q_start + q_len`. Query row `i` of a sequence
/// sits at absolute position `p = context_len - q_len + i` and attends causally to keys
/// `0..=p`, read from `k_cache`/`v_cache` through the sequence's block table. Query head `h`
/// uses kv head `h / (num_heads / num_kv_heads)`. Softmax runs in f32 with scale `scale`.
///
/// Runs on the rayon pool with the best SIMD instruction set of this CPU. Every argument is
/// checked first; a bad one returns the matching [`KernelError`] and leaves `out` untouched.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: KvElem>(
    layout: &CacheShape,
    k_cache: &[T],
    v_cache: &[T],
    q: &[T],
    out: &mut [T],
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    scale: f32,
) -> Result<(), KernelError> {
    let opts = AttnOptions {
        scale,
        window: None,
        softcap: None,
    };
    paged_attention_with(layout, k_cache, v_cache, q, out, num_heads, seqs, opts)
}

/// What a layer's attention does beyond the causal softmax of [`paged_attention`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnOptions {
    /// Multiplies every q·k.
    pub scale: f32,
    /// A sliding-window layer's window: the query at position `p` sees keys `p + 1 - window..=p`
    /// only (transformers' `kv_idx > q_idx - sliding_window`).
    pub window: Option<usize>,
    /// Attention-logit soft-capping (Gemma 2): each scaled score `s` becomes
    /// `cap * tanh(s / cap)` before the softmax.
    pub softcap: Option<f32>,
}

/// [`crate::paged_attention`] with a sliding window and soft-capping as `opts` says.
///
/// A window runs on the fast kernels: rows whose window reaches back to key 0 tile as usual,
/// and each later row is a tile of its own whose keys start at its window (the narrow path
/// starts a tile anywhere), so keys before the window are never read. Soft-capping, and a
/// window where one row's query vectors would fill the wide path (a GQA group of 12 or more),
/// run on the exact per-row loop of `crate::capped` until the SIMD paths learn them.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with<T: KvElem>(
    layout: &CacheShape,
    k_cache: &[T],
    v_cache: &[T],
    q: &[T],
    out: &mut [T],
    num_heads: usize,
    seqs: &[SeqAttn<'_>],
    opts: AttnOptions,
) -> Result<(), KernelError> {
    let args = AttentionArgs {
        layout,
        k_cache: KvRows::Plain(k_cache),
        v_cache: KvRows::Plain(v_cache),
        q,
        num_heads,
        seqs,
        scale: opts.scale,
    };
    run_checked(&args, opts, out)
}

/// Validates `args` and `opts` and runs them on the fast tiles, or on the exact per-row loop
/// where the tiles lack a feature: the body of [`paged_attention_with`] for every cache dtype.
pub(crate) fn run_checked<T: KvElem>(
    args: &AttentionArgs<'_, T>,
    opts: AttnOptions,
    out: &mut [T],
) -> Result<(), KernelError> {
    let (layout, num_heads) = (args.layout, args.num_heads);
    args.validate(out.len())?;
    if opts.window == Some(0) {
        return Err(KernelError::Invalid("a sliding window of 0 keys".into()));
    }
    if let Some(cap) = opts.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
        return Err(KernelError::Invalid(format!("softcap {cap} is not > 0")));
    }
    let group = num_heads / layout.num_kv_heads;
    if opts.softcap.is_some() || (opts.window.is_some() && !Tile::narrow_rows(1, group)) {
        crate::capped::attend_exact(args, opts, out);
    } else {
        args.run_tiles(Isa::detect(), pool::threads(), opts.window, out);
    }
    Ok(())
}

/// Every query row of `args` on its own, as `opts` says. `args` is validated.
pub(crate) fn attend_exact<T: KvElem>(
    args: &AttentionArgs<'_, T>,
    opts: AttnOptions,
    out: &mut [T],
) {
    let layout = args.layout;
    let (h, d) = (args.num_heads, layout.head_dim);
    let group = h / layout.num_kv_heads;
    let rows: Vec<(usize, usize)> = args
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(si, s)| (0..s.q_len).map(move |i| (si, i)))
        .collect();
    let shared = SharedOut::new(out);
    pool::run(rows.len(), &|r| {
        let (si, i) = rows[r];
        let s = &args.seqs[si];
        let pos = s.context_len - s.q_len + i;
        let first = opts.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let token = s.q_start + i;
        // SAFETY: validation made the sequences' rows disjoint; each task owns one row.
        let dst = unsafe { shared.range_mut(token * h * d, h * d) };
        let mut scores = Vec::with_capacity(pos + 1 - first);
        let mut acc = vec![0f32; d];
        let mut q_row = vec![0f32; d];
        for head in 0..h {
            let kv_head = head / group;
            let at = (token * h + head) * d;
            for (x, y) in q_row.iter_mut().zip(&args.q[at..at + d]) {
                *x = y.to_f32();
            }
            scores.clear();
            for key in first..=pos {
                let k_at = row_offset(layout, s.block_table, key, kv_head);
                let dot: f32 = q_row
                    .iter()
                    .enumerate()
                    .map(|(j, a)| a * args.k_cache.get(k_at + j))
                    .sum();
                let score = dot * opts.scale;
                scores.push(match opts.softcap {
                    Some(cap) => (score / cap).tanh() * cap,
                    None => score,
                });
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            acc.fill(0.0);
            for (key, s) in (first..=pos).zip(&scores) {
                let w = (s - max).exp();
                total += w;
                let v_at = row_offset(layout, args.seqs[si].block_table, key, kv_head);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a += w * args.v_cache.get(v_at + j);
                }
            }
            for (o, a) in dst[head * d..(head + 1) * d].iter_mut().zip(&acc) {
                *o = T::from_f32(a / total);
            }
        }
    });
}

/// Element offset of the K (or V) row of position `pos` for `kv_head`.
fn row_offset(layout: &CacheShape, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
    let block = block_table[pos / layout.block_size] as usize;
    let slot = block * layout.block_size + pos % layout.block_size;
    slot * layout.row_elems() + kv_head * layout.head_dim
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::reference::paged_attention_reference;

    /// Caches, queries and block tables for `shapes` ((q_len, context_len) per sequence).
    struct Case {
        layout: CacheShape,
        heads: usize,
        k: Vec<f32>,
        v: Vec<f32>,
        q: Vec<f32>,
        tables: Vec<Vec<u32>>,
        shapes: Vec<(usize, usize)>,
    }

    impl Case {
        fn new(
            seed: u64,
            kv_heads: usize,
            group: usize,
            block_size: usize,
            shapes: &[(usize, usize)],
        ) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            let blocks: usize = shapes.iter().map(|s| s.1.div_ceil(block_size)).sum();
            let layout = CacheShape {
                num_blocks: blocks + 1,
                block_size,
                num_kv_heads: kv_heads,
                head_dim: 16,
            };
            // Tables in reverse block order, so no sequence reads its blocks in cache order.
            let mut next = blocks as u32;
            let tables = shapes
                .iter()
                .map(|s| {
                    (0..s.1.div_ceil(block_size))
                        .map(|_| {
                            next -= 1;
                            next
                        })
                        .collect()
                })
                .collect();
            let mut fill = |n: usize| (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let heads = kv_heads * group;
            let rows: usize = shapes.iter().map(|s| s.0).sum();
            Case {
                layout,
                heads,
                k: fill(layout.layer_elems()),
                v: fill(layout.layer_elems()),
                q: fill(rows * heads * 16),
                tables,
                shapes: shapes.to_vec(),
            }
        }

        fn seqs(&self) -> Vec<SeqAttn<'_>> {
            let mut q_start = 0;
            self.shapes
                .iter()
                .zip(&self.tables)
                .map(|(&(q_len, context_len), t)| {
                    q_start += q_len;
                    SeqAttn {
                        q_start: q_start - q_len,
                        q_len,
                        context_len,
                        block_table: t,
                    }
                })
                .collect()
        }

        fn args(&self) -> (AttentionArgs<'_, f32>, Vec<SeqAttn<'_>>) {
            let seqs = self.seqs();
            let args = AttentionArgs {
                layout: &self.layout,
                k_cache: KvRows::Plain(&self.k),
                v_cache: KvRows::Plain(&self.v),
                q: &self.q,
                num_heads: self.heads,
                seqs: &[],
                scale: 0.3,
            };
            (args, seqs)
        }

        fn exact(&self, opts: AttnOptions) -> Vec<f32> {
            let (args, seqs) = self.args();
            let args = AttentionArgs {
                seqs: &seqs,
                ..args
            };
            let mut out = vec![0f32; self.q.len()];
            args.validate(out.len()).expect("valid");
            attend_exact(&args, opts, &mut out);
            out
        }

        fn tiled(&self, isa: Isa, window: Option<usize>) -> Vec<f32> {
            let (args, seqs) = self.args();
            let args = AttentionArgs {
                seqs: &seqs,
                ..args
            };
            let mut out = vec![0f32; self.q.len()];
            args.validate(out.len()).expect("valid");
            args.run_tiles(isa, 4, window, &mut out);
            out
        }
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what} element {i}: {g} vs {w}"
            );
        }
    }

    const PLAIN: AttnOptions = AttnOptions {
        scale: 0.3,
        window: None,
        softcap: None,
    };

    #[test]
    fn the_exact_loop_is_the_reference_without_window_or_cap() {
        let c = Case::new(1, 2, 3, 4, &[(5, 9), (1, 30), (12, 12)]);
        let mut want = vec![0f32; c.q.len()];
        paged_attention_reference(
            &c.layout,
            &c.k,
            &c.v,
            &c.q,
            &mut want,
            c.heads,
            &c.seqs(),
            0.3,
        )
        .expect("valid");
        assert_close(&c.exact(PLAIN), &want, "exact");
    }

    /// Windows of 1, 5 and 13 keys over prefill chunks, decode rows, a long lone decode that
    /// split-K cuts, and many sequences (tiles over all kv heads): the tiles skip exactly the
    /// keys the exact loop skips, on every ISA.
    #[test]
    fn windowed_tiles_match_the_exact_loop() {
        let mut shapes: Vec<(usize, usize)> = vec![(20, 20), (7, 40), (1, 3), (1, 2600)];
        shapes.extend((0..20).map(|i| (1 + i % 2, 10 + 7 * i)));
        for (seed, group) in [(2, 1), (3, 4)] {
            let c = Case::new(seed, 2, group, 5, &shapes);
            for window in [1, 5, 13] {
                let want = c.exact(AttnOptions {
                    window: Some(window),
                    ..PLAIN
                });
                assert_ne!(want, c.exact(PLAIN), "window {window} changes nothing");
                for isa in Isa::available() {
                    let got = c.tiled(isa, Some(window));
                    assert_close(
                        &got,
                        &want,
                        &format!("{isa:?} window {window} group {group}"),
                    );
                }
            }
        }
    }

    #[test]
    fn softcap_bounds_every_score() {
        // With one key per row the output is that key's V whatever the score: a second key
        // whose score the cap pulls down shows the cap applies before the softmax.
        let c = Case::new(4, 1, 1, 4, &[(3, 3)]);
        let capped = c.exact(AttnOptions {
            softcap: Some(0.5),
            ..PLAIN
        });
        assert_eq!(capped[..16], c.exact(PLAIN)[..16], "row 0 sees one key");
        assert_ne!(capped[16..], c.exact(PLAIN)[16..]);
        let mut out = vec![0f32; c.q.len()];
        let bad = AttnOptions {
            softcap: Some(0.0),
            ..PLAIN
        };
        let err = paged_attention_with(&c.layout, &c.k, &c.v, &c.q, &mut out, 1, &c.seqs(), bad);
        assert!(err.is_err());
    }
}
