//! The cost model: how long a simulated node's forward step takes, and how long a prompt's KV
//! takes to cross the link from a prefill node to a decode node.
//!
//! A step is described by [`StepWork`], computed from the batch the engine's real scheduler
//! planned: the prefill tokens it computes (and `prefill_attn`, the sum over prefill items of
//! `chunk_tokens * context_tokens`, which is `tokens²` for a whole prompt computed at once: the
//! attention term), the sequences it decodes, and the context tokens those decodes attend over.
//! Two forms turn that into seconds:
//!
//! - `linear` (what [`super::fit`] fits from measurements):
//!   - `prefill_s = a + b * prefill_tokens + c * prefill_attn / 1e6`
//!   - `decode_s = a + b * decode_seqs + c * decode_context_tokens`
//!   - a step with both (colocated: chunked prefill mixed into decode steps) costs the sum less
//!     the smaller of the two `a`s: one forward pass pays its fixed cost (reading the weights,
//!     launching the step) once.
//! - `roofline` (what a GPU profile derives from physical limits): a step takes
//!   `overhead_s + max(flops / (peak_flops * mfu), bytes / (hbm_bytes_per_s * bw_efficiency))`,
//!   where `flops = 2 * matmul_params * (prefill_tokens + decode_seqs) + 4 * layers * heads *
//!   head_dim * attention_pairs` and `bytes = weight_bytes + kv_bytes_per_token * kv tokens read
//!   or written`. Compute and memory traffic overlap on a GPU, so the slower of the two sets the
//!   pace.
//!
//! KV bytes per token are `2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`. A
//! transfer goes over the prefill node's link, one transfer after another, at
//! `bandwidth_bytes_per_s` plus `latency_s` once per prompt. With `layerwise` push (Fission's:
//! the prefill node pushes each layer's KV as soon as the layer is computed), layer `l` of the
//! final prefill step is ready at `start + step_s * (l + 1) / layers`, so the transfer overlaps
//! the rest of the step; without it the whole prompt's KV leaves when the step ends.
//!
//! The file format is JSON ([`CostModel::load`]); `engine/profiles/` holds the shipped ones,
//! and `sources` maps each figure to where it comes from.
//!
//! It lives in the engine because two clients price the same steps with it: the simulator
//! (`fission-loadtest simulate`) and the mock engine, which spends a step's predicted time
//! instead of running the model (`--engine mock`).

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{EngineError, Result};
use crate::scheduler::Batch;
use serde::{Deserialize, Serialize};

pub mod profile;

/// A node's cost model and the hardware facts the simulator needs besides it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub model: ModelShape,
    pub step: StepCost,
    pub link: Link,
    pub node: NodeSpec,
    /// Cores a decode-only step keeps busy on a host whose cores several nodes share, as a
    /// prefill step beside one measures it (`simulate calibrate --node-gateway` with
    /// `--prefill-gateway`). A CPU decode step of a small batch leaves its threads waiting on
    /// memory and on its engine thread (sampling, scheduling, streaming), so it takes less
    /// than all of its threads' cores from the node beside it. `None`: all of them. Only a
    /// simulated cluster on one host (`simulate --shared-host-cores`) reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_step_cores: Option<f64>,
    /// Where each figure comes from, by field path (`"step.mfu"`, `"link.latency_s"`).
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
}

/// The served model's shape: KV bytes, FLOPs and weight bytes follow from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Untied input embedding and output head count separately.
    pub tie_word_embeddings: bool,
    /// Bytes per weight and per KV element (2 for bf16, 4 for f32).
    pub dtype_bytes: usize,
}

impl ModelShape {
    /// `2 * layers * kv_heads * head_dim * dtype_bytes`: K and V of every layer.
    pub fn kv_bytes_per_token(&self) -> u64 {
        (2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes) as u64
    }

    /// Parameters of a Llama-shaped decoder: per layer the q/o projections (hidden²
    /// each), k/v (hidden * kv_heads * head_dim each), gate/up/down (hidden * intermediate
    /// each) and two norms; plus the embedding, the head (unless tied) and the final norm.
    pub fn num_params(&self) -> f64 {
        let (h, kv) = (
            self.hidden_size as f64,
            (self.num_kv_heads * self.head_dim) as f64,
        );
        let q_dim = (self.num_heads * self.head_dim) as f64;
        let attn = 2.0 * h * q_dim + 2.0 * h * kv;
        let mlp = 3.0 * h * self.intermediate_size as f64;
        let per_layer = attn + mlp + 2.0 * h;
        let embed = self.vocab_size as f64 * h;
        let head = if self.tie_word_embeddings { 0.0 } else { embed };
        self.num_layers as f64 * per_layer + embed + head + h
    }

    /// Parameters a token is multiplied through: all but the embedding lookup (the output
    /// head is a matmul, tied or not).
    pub fn matmul_params(&self) -> f64 {
        let embed = self.vocab_size as f64 * self.hidden_size as f64;
        let head = if self.tie_word_embeddings { embed } else { 0.0 };
        self.num_params() - embed + head
    }

    pub fn weight_bytes(&self) -> f64 {
        self.num_params() * self.dtype_bytes as f64
    }

    /// FLOPs of attention per (query, key) pair: QKᵀ and AV, 2 FLOPs per multiply-add over
    /// `head_dim`, in every head of every layer.
    pub fn attn_flops_per_pair(&self) -> f64 {
        (4 * self.num_layers * self.num_heads * self.head_dim) as f64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepCost {
    Linear(LinearCost),
    Roofline(Roofline),
}

/// `a + b * x + c * y`: seconds from two work figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Linear3 {
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

impl Linear3 {
    pub fn eval(&self, x: f64, y: f64) -> f64 {
        self.a + self.b * x + self.c * y
    }
}

/// `prefill`: x = prefill tokens, y = prefill_attn / 1e6. `decode`: x = sequences, y = context
/// tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinearCost {
    pub prefill: Linear3,
    pub decode: Linear3,
}

impl LinearCost {
    /// A step that computes prompt tokens and decodes together: the two fits summed, less
    /// the smaller fixed cost (paid once). Timed mixed steps (`simulate calibrate`) differ
    /// from this by 9-12% rms on a 2-core CPU, mostly costing more; pricing every row at the
    /// prefill rate instead (one pass over the weights) did no better (11.6% against 11.7%).
    pub fn mixed_s(&self, w: &StepWork) -> f64 {
        self.prefill
            .eval(w.prefill_tokens as f64, w.prefill_attn / 1e6)
            + self
                .decode
                .eval(w.decode_seqs as f64, w.decode_context_tokens as f64)
            - self.prefill.a.min(self.decode.a)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    /// Dense peak of the datatype the model runs in.
    pub peak_flops: f64,
    /// Share of `peak_flops` reached by the step's matmuls.
    pub mfu: f64,
    pub hbm_bytes_per_s: f64,
    /// Share of `hbm_bytes_per_s` reached when streaming weights and KV.
    pub bw_efficiency: f64,
    /// Host time per step the GPU does not hide (scheduling, launches).
    pub overhead_s: f64,
}

/// The KV link from a prefill node to decode nodes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
    /// Push each layer as it completes (Fission) rather than after the whole prefill.
    pub layerwise: bool,
    /// Seconds a prefill step lengthens per byte of KV it pushes: a CPU engine's threads
    /// share their cores with the push (encryption, copies; the receiver's too on a one-host
    /// cluster), and a thread that loses its core stalls the step's other threads at the next
    /// op. `simulate calibrate --measure-link` measures it in one process (prefill steps timed
    /// beside a push against steps alone), `--node-gateway` with `--prefill-gateway` through
    /// running nodes (a prefill node's step against a colocated node's). 0 for a GPU engine,
    /// whose host cores are spare.
    #[serde(default)]
    pub push_step_s_per_byte: f64,
}

/// One node's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub kv_blocks: usize,
    pub block_size: usize,
}

/// What one forward step computes, from its batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    pub prefill_tokens: usize,
    /// Sum over prefill items of `chunk_tokens * context_tokens` (tokens²).
    pub prefill_attn: f64,
    /// (query, key) pairs of causal prefill attention: a chunk of `n` tokens after `start`
    /// cached ones attends over `n * start + n * (n + 1) / 2`.
    pub prefill_pairs: f64,
    /// Sum over prefill items of the KV tokens they read and write (`context_tokens`).
    pub prefill_context_tokens: usize,
    pub decode_seqs: usize,
    pub decode_context_tokens: usize,
}

impl StepWork {
    pub fn of(batch: &Batch) -> Self {
        let mut w = StepWork::default();
        for item in &batch.items {
            let n = item.context_len - item.start_pos;
            if item.is_prefill {
                w.prefill_tokens += n;
                w.prefill_attn += n as f64 * item.context_len as f64;
                w.prefill_pairs += causal_pairs(n, item.start_pos);
                w.prefill_context_tokens += item.context_len;
            } else {
                w.decode_seqs += 1;
                w.decode_context_tokens += item.context_len;
            }
        }
        w
    }

    /// One prompt of `tokens` computed in one step.
    pub fn prefill(tokens: usize) -> Self {
        StepWork {
            prefill_tokens: tokens,
            prefill_attn: tokens as f64 * tokens as f64,
            prefill_pairs: causal_pairs(tokens, 0),
            prefill_context_tokens: tokens,
            ..Default::default()
        }
    }

    /// `seqs` decodes over `context_tokens` in all.
    pub fn decode(seqs: usize, context_tokens: usize) -> Self {
        StepWork {
            decode_seqs: seqs,
            decode_context_tokens: context_tokens,
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

impl CostModel {
    /// A profile by built-in name (`h100-llama8b`) or a path to a JSON file.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some(text) = profile::builtin(name_or_path) {
            return Self::from_json(text, name_or_path);
        }
        let path = Path::new(name_or_path);
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::CostProfile {
            origin: name_or_path.to_string(),
            reason: format!(
                "neither a built-in profile ({}) nor a readable file: {e}",
                profile::BUILTIN.join(", ")
            ),
        })?;
        Self::from_json(&text, name_or_path)
    }

    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let m: CostModel = serde_json::from_str(text).map_err(|e| EngineError::CostProfile {
            origin: origin.to_string(),
            reason: e.to_string(),
        })?;
        m.validate(origin)?;
        Ok(m)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a cost model is plain data") + "\n"
    }

    pub fn validate(&self, origin: &str) -> Result<()> {
        let bad = |what: &str| {
            Err(EngineError::CostProfile {
                origin: origin.to_string(),
                reason: format!("{what} must be positive"),
            })
        };
        if self.model.num_layers == 0 || self.model.kv_bytes_per_token() == 0 {
            return bad("model.num_layers, num_kv_heads, head_dim and dtype_bytes");
        }
        if self.node.kv_blocks == 0 || self.node.block_size == 0 {
            return bad("node.kv_blocks and node.block_size");
        }
        if !(self.link.bandwidth_bytes_per_s > 0.0 && self.link.latency_s >= 0.0) {
            return bad("link.bandwidth_bytes_per_s");
        }
        // NaN is refused too.
        if self.link.push_step_s_per_byte.is_nan() || self.link.push_step_s_per_byte < 0.0 {
            return Err(EngineError::CostProfile {
                origin: origin.to_string(),
                reason: "link.push_step_s_per_byte must not be negative".into(),
            });
        }
        if let StepCost::Roofline(r) = &self.step {
            if !(r.peak_flops > 0.0
                && r.mfu > 0.0
                && r.hbm_bytes_per_s > 0.0
                && r.bw_efficiency > 0.0)
            {
                return bad("step.peak_flops, mfu, hbm_bytes_per_s and bw_efficiency");
            }
        }
        Ok(())
    }

    /// Seconds one forward step takes; 0 for no work.
    pub fn step_s(&self, w: &StepWork) -> f64 {
        if w.is_empty() {
            return 0.0;
        }
        match &self.step {
            StepCost::Linear(l) => {
                let prefill = l
                    .prefill
                    .eval(w.prefill_tokens as f64, w.prefill_attn / 1e6);
                let decode = l
                    .decode
                    .eval(w.decode_seqs as f64, w.decode_context_tokens as f64);
                let s = match (w.prefill_tokens > 0, w.decode_seqs > 0) {
                    (true, false) => prefill,
                    (false, true) => decode,
                    _ => l.mixed_s(w),
                };
                // A fit may dip below zero far outside its data; time never runs backwards.
                s.max(1e-9)
            }
            StepCost::Roofline(r) => {
                let m = &self.model;
                let tokens = (w.prefill_tokens + w.decode_seqs) as f64;
                let pairs = w.prefill_pairs + w.decode_context_tokens as f64;
                let flops = 2.0 * m.matmul_params() * tokens + m.attn_flops_per_pair() * pairs;
                let kv_tokens = (w.prefill_context_tokens + w.decode_context_tokens) as f64;
                let bytes = m.weight_bytes() + m.kv_bytes_per_token() as f64 * kv_tokens;
                let compute_s = flops / (r.peak_flops * r.mfu);
                let memory_s = bytes / (r.hbm_bytes_per_s * r.bw_efficiency);
                r.overhead_s + compute_s.max(memory_s)
            }
        }
    }

    /// Seconds for one prompt of `tokens` computed alone.
    pub fn prefill_s(&self, tokens: usize) -> f64 {
        self.step_s(&StepWork::prefill(tokens))
    }

    /// Seconds for one decode step of `seqs` sequences over `context_tokens`.
    pub fn decode_s(&self, seqs: usize, context_tokens: usize) -> f64 {
        self.step_s(&StepWork::decode(seqs, context_tokens))
    }

    pub fn kv_bytes(&self, tokens: usize) -> f64 {
        self.model.kv_bytes_per_token() as f64 * tokens as f64
    }
}

pub(crate) fn causal_pairs(n: usize, start: usize) -> f64 {
    let n = n as f64;
    n * start as f64 + n * (n + 1.0) / 2.0
}

/// Fixtures for the tests of the cost model's clients (the simulator, the mock engine).
pub mod testing {
    use super::*;

    /// A tiny model's linear cost model: the fixture the simulator's tests build on.
    pub fn tiny_linear(prefill: Linear3, decode: Linear3) -> CostModel {
        CostModel {
            name: "test".into(),
            description: String::new(),
            model: ModelShape {
                name: "tiny".into(),
                num_layers: 4,
                hidden_size: 64,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                intermediate_size: 128,
                vocab_size: 1000,
                tie_word_embeddings: true,
                dtype_bytes: 4,
            },
            step: StepCost::Linear(LinearCost { prefill, decode }),
            link: Link {
                bandwidth_bytes_per_s: 1e6,
                latency_s: 0.001,
                layerwise: true,
                push_step_s_per_byte: 0.0,
            },
            node: NodeSpec {
                kv_blocks: 1000,
                block_size: 16,
            },
            decode_step_cores: None,
            sources: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::tiny_linear as linear;
    use super::*;

    #[test]
    fn linear_steps_pay_the_fixed_cost_once() {
        let m = linear(
            Linear3 {
                a: 0.010,
                b: 0.001,
                c: 0.5,
            },
            Linear3 {
                a: 0.004,
                b: 0.0002,
                c: 1e-6,
            },
        );
        assert!((m.prefill_s(100) - (0.010 + 0.1 + 0.5 * 0.01)).abs() < 1e-12);
        assert!((m.decode_s(10, 1000) - (0.004 + 0.002 + 0.001)).abs() < 1e-12);
        let mixed = StepWork {
            decode_seqs: 10,
            decode_context_tokens: 1000,
            ..StepWork::prefill(100)
        };
        let want = m.prefill_s(100) + m.decode_s(10, 1000) - 0.004;
        assert!((m.step_s(&mixed) - want).abs() < 1e-12);
        assert_eq!(m.step_s(&StepWork::default()), 0.0);
    }

    #[test]
    fn kv_bytes_follow_the_shape() {
        let m = linear(
            Linear3 {
                a: 0.0,
                b: 0.0,
                c: 0.0,
            },
            Linear3 {
                a: 0.0,
                b: 0.0,
                c: 0.0,
            },
        );
        assert_eq!(m.model.kv_bytes_per_token(), 2 * 4 * 2 * 16 * 4);
        assert_eq!(m.kv_bytes(10), 10.0 * 1024.0);
    }
}
