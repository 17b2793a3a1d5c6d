//! The mixture-of-experts block of Mixtral and Qwen3-MoE, for both forward paths: a router
//! (`gate`, one logit per expert), a softmax over the experts in f32, the top-k of it
//! (renormalised to sum to 1 when [`MoeConfig::norm_topk_prob`] says), and each token's output
//! the weighted sum of its k experts' gated MLPs, added in expert order as transformers'
//! `index_add_` adds them.
//!
//! A step's rows are grouped by expert ([`Routes`]) and each expert runs once, on the
//! contiguous panel of its rows, through the same packed GEMM as the dense layers; its output
//! rows are then scaled and added into their tokens. No loop runs per token over experts, and
//! an expert no token chose costs nothing.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use super::linear::Linear;
use super::op_timing::{timed, Op};
use super::ops::{self, gate_act_rows};
use crate::config::{Activation, ModelConfig, MoeConfig, MoeLayout};
use crate::error::Result;
use crate::quantize::Quantize;

#[derive(Debug, Clone)]
struct Expert {
    /// gate and up, fused as the dense MLP's are.
    gate_up: Linear,
    down: Linear,
}

#[derive(Debug, Clone)]
pub(super) struct MoeBlock {
    /// `[experts, hidden]`: one logit per expert. Never quantised: a rounding there moves
    /// tokens between experts.
    router: Linear,
    experts: Vec<Expert>,
    top_k: usize,
    norm_topk_prob: bool,
    /// Each expert's intermediate size.
    ffn: usize,
}

impl MoeBlock {
    /// Under the layer's `vb`: the per-expert tensors real checkpoints (and transformers 5's
    /// `save_pretrained`) store, or the 3-D `experts.gate_up_proj`/`experts.down_proj` that
    /// transformers 5 holds in memory, under `mlp` (where transformers 5 renames Mixtral's
    /// `block_sparse_moe` to).
    pub(super) fn load(
        vb: &VarBuilder,
        cfg: &ModelConfig,
        moe: &MoeConfig,
        quantize: Quantize,
    ) -> Result<Self> {
        let (e, hid, f) = (moe.num_experts, cfg.hidden_size, moe.expert_ffn);
        let (block, [w_gate, w_up, w_down]) = match moe.layout {
            MoeLayout::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            MoeLayout::Qwen => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let b = if vb.contains_tensor(&format!("{block}.gate.weight")) {
            vb.pp(block)
        } else {
            vb.pp("mlp")
        };
        let router =
            Linear::quantized(b.pp("gate").get((e, hid), "weight")?, None, Quantize::None)?;
        let packed = if b.contains_tensor("experts.gate_up_proj") {
            Some((
                b.get((e, 2 * f, hid), "experts.gate_up_proj")?,
                b.get((e, hid, f), "experts.down_proj")?,
            ))
        } else {
            None
        };
        let experts = (0..e)
            .map(|i| {
                let (gate_up, down) = match &packed {
                    Some((gu, d)) => (gu.get(i)?, d.get(i)?),
                    None => {
                        let x = b.pp(format!("experts.{i}"));
                        let gate_up = Tensor::cat(
                            &[
                                x.pp(w_gate).get((f, hid), "weight")?,
                                x.pp(w_up).get((f, hid), "weight")?,
                            ],
                            0,
                        )?;
                        (gate_up, x.pp(w_down).get((hid, f), "weight")?)
                    }
                };
                Ok(Expert {
                    gate_up: Linear::quantized(gate_up, None, quantize)?,
                    down: Linear::quantized(down, None, quantize)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MoeBlock {
            router,
            experts,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            ffn: f,
        })
    }

    pub(super) fn is_packed(&self) -> bool {
        self.router.is_packed()
            && self
                .experts
                .iter()
                .all(|x| x.gate_up.is_packed() && x.down.is_packed())
    }

    /// The host path: `out = moe(h)` for `n` rows of `h` (`out` is overwritten).
    pub(super) fn forward_host(
        &self,
        h: &[f32],
        n: usize,
        act: Activation,
        out: &mut [f32],
    ) -> Result<()> {
        let (e, f) = (self.experts.len(), self.ffn);
        let hid = h.len() / n.max(1);
        let mut logits = vec![0f32; n * e];
        timed(Op::GateUp, || {
            self.router.forward_host(h, n, &mut logits, false)
        })?;
        let routes = Routes::new(&logits, n, e, self.top_k, self.norm_topk_prob);
        let m = routes.rows.len();
        // Every routed row, grouped by expert: expert i's panel is rows offsets[i]..offsets[i+1].
        let mut panel = vec![0f32; m * hid];
        for (dst, &r) in panel.chunks_mut(hid).zip(&routes.rows) {
            let r = r as usize;
            dst.copy_from_slice(&h[r * hid..(r + 1) * hid]);
        }
        let (mut gate_up, mut a, mut y) = (
            vec![0f32; m * 2 * f],
            vec![0f32; m * f],
            vec![0f32; m * hid],
        );
        for (i, x) in self.experts.iter().enumerate() {
            let (s, t) = (routes.offsets[i], routes.offsets[i + 1]);
            if s == t {
                continue;
            }
            let rows = t - s;
            let gu = &mut gate_up[s * 2 * f..t * 2 * f];
            timed(Op::GateUp, || {
                x.gate_up
                    .forward_host(&panel[s * hid..t * hid], rows, gu, false)
            })?;
            let a = &mut a[s * f..t * f];
            timed(Op::Silu, || gate_act_rows(gu, rows, f, act, a));
            timed(Op::Down, || {
                x.down
                    .forward_host(a, rows, &mut y[s * hid..t * hid], false)
            })?;
        }
        out[..n * hid].fill(0.0);
        timed(Op::Down, || {
            for ((src, &r), &w) in y.chunks(hid).zip(&routes.rows).zip(&routes.weights) {
                let r = r as usize;
                for (o, v) in out[r * hid..(r + 1) * hid].iter_mut().zip(src) {
                    *o += v * w;
                }
            }
        });
        Ok(())
    }

    /// The tensor path: `moe(h)` for every row of `h`, in `h`'s dtype. The router's logits are
    /// rounded to that dtype before the f32 softmax, and each expert's output is scaled in f32,
    /// as transformers does.
    pub(super) fn forward(&self, h: &Tensor, act: Activation) -> Result<Tensor> {
        let (n, e) = (h.dim(0)?, self.experts.len());
        let logits = self
            .router
            .forward(h)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let routes = Routes::new(&logits, n, e, self.top_k, self.norm_topk_prob);
        let mut out = h.zeros_like()?;
        for (i, x) in self.experts.iter().enumerate() {
            let (s, t) = (routes.offsets[i], routes.offsets[i + 1]);
            if s == t {
                continue;
            }
            let rows = Tensor::from_slice(&routes.rows[s..t], t - s, h.device())?;
            let y = x.down.forward(&ops::gate_mul(
                &x.gate_up.forward(&h.index_select(&rows, 0)?)?,
                act,
            )?)?;
            let w = Tensor::from_slice(&routes.weights[s..t], (t - s, 1), h.device())?;
            let y = y
                .to_dtype(DType::F32)?
                .broadcast_mul(&w)?
                .to_dtype(h.dtype())?;
            out = out.index_add(&rows, &y, 0)?;
        }
        Ok(out)
    }
}

/// A step's routing: each token's top-k experts and weights, grouped by expert. Expert `i`'s
/// rows (ascending) and weights are `rows[offsets[i]..offsets[i + 1]]` and the same range of
/// `weights`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Routes {
    pub offsets: Vec<usize>,
    pub rows: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// From `n` rows of `e` router logits: softmax in f32, the `k` largest (ties to the lower
    /// expert), divided by their sum when `renormalise`.
    pub(super) fn new(logits: &[f32], n: usize, e: usize, k: usize, renormalise: bool) -> Self {
        let mut chosen = Vec::with_capacity(n * k);
        let mut probs = vec![0f32; e];
        let mut top: Vec<(usize, f32)> = Vec::with_capacity(k);
        for row in logits.chunks(e).take(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, &l) in probs.iter_mut().zip(row) {
                *p = (l - max).exp();
                sum += *p;
            }
            for p in probs.iter_mut() {
                *p /= sum;
            }
            top.clear();
            for _ in 0..k {
                let best = (0..e)
                    .filter(|i| top.iter().all(|&(j, _)| j != *i))
                    .fold(None, |b: Option<usize>, i| match b {
                        Some(j) if probs[j] >= probs[i] => Some(j),
                        _ => Some(i),
                    })
                    .expect("k <= experts");
                top.push((best, probs[best]));
            }
            if renormalise {
                let s: f32 = top.iter().map(|&(_, p)| p).sum();
                for t in top.iter_mut() {
                    t.1 /= s;
                }
            }
            chosen.push(top.clone());
        }
        // Counting sort by expert: rows stay ascending within each expert.
        let mut offsets = vec![0usize; e + 1];
        for &(i, _) in chosen.iter().flatten() {
            offsets[i + 1] += 1;
        }
        for i in 0..e {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets.clone();
        let total = offsets[e];
        let (mut rows, mut weights) = (vec![0u32; total], vec![0f32; total]);
        for (r, top) in chosen.iter().enumerate() {
            for &(i, w) in top {
                rows[next[i]] = r as u32;
                weights[next[i]] = w;
                next[i] += 1;
            }
        }
        Routes {
            offsets,
            rows,
            weights,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_take_the_top_k_of_the_softmax_grouped_by_expert() {
        // Two tokens over three experts.
        let logits = [0.0, 2.0, 1.0, 3.0, 0.0, 3.5];
        let r = Routes::new(&logits, 2, 3, 2, false);
        assert_eq!(r.offsets, vec![0, 1, 2, 4]);
        assert_eq!(r.rows, vec![1, 0, 0, 1]);
        let soft = |row: &[f32]| {
            let s: f32 = row.iter().map(|x| x.exp()).sum();
            row.iter().map(|x| x.exp() / s).collect::<Vec<_>>()
        };
        let (p0, p1) = (soft(&logits[..3]), soft(&logits[3..]));
        let want = [p1[0], p0[1], p0[2], p1[2]];
        for (g, w) in r.weights.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
        // Renormalised, each token's weights sum to 1.
        let r = Routes::new(&logits, 2, 3, 2, true);
        let token0: f32 = r.weights[1] + r.weights[2];
        let token1: f32 = r.weights[0] + r.weights[3];
        assert!((token0 - 1.0).abs() < 1e-6 && (token1 - 1.0).abs() < 1e-6);
        assert!((r.weights[1] - p0[1] / (p0[1] + p0[2])).abs() < 1e-6);
    }
}
