//! The mock model (`--engine mock`): a forward pass that spends the time a cost profile
//! predicts for the step instead of computing it, and produces deterministic tokens.
//!
//! Everything around the forward pass stays real: the scheduler, the KV block accounting,
//! chunked prefill, the prefix cache, the layer-by-layer push of KV bytes to a decode node. So a
//! cluster of mock nodes exercises the production paths at the speed of hardware it does not
//! have (an H100 profile on a laptop), and dozens of them fit on one machine: a step sleeps,
//! it does not spin.
//!
//! The KV layout keeps the profile's layer count (the push is per layer) and KV heads, with
//! `head_dim` scaled by `kv_scale`, so the bytes moved are real and proportional to the
//! profiled model's without 128 KiB per token of RAM for each of 48 processes.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use crate::config::{ArchSpec, ModelConfig, RopeScaling};
use crate::cost::{causal_pairs, CostModel, StepWork};
use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;
use crate::model::ForwardBatch;

/// The longest context a mock node serves: Llama-3-8B's.
pub const MOCK_MAX_CONTEXT: usize = 8192;
/// The logit of the chosen token; every other logit is 0, so any temperature picks it
/// (e^-30 against 1 per other token).
const CHOSEN_LOGIT: f32 = 30.0;

/// How a mock node is built: its cost profile and how much of the profiled KV it really moves.
#[derive(Debug, Clone)]
pub struct MockSpec {
    pub cost: CostModel,
    /// The share of the profiled model's `head_dim` the KV cache really holds, in (0, 1].
    pub kv_scale: f64,
}

#[derive(Debug, Clone)]
pub struct MockModel {
    cfg: ModelConfig,
    cost: CostModel,
    /// The ids it produces: the vocabulary less EOS (so a request runs to its `max_tokens`),
    /// special tokens and byte-fallback pieces (so the text reads as words).
    produced: Vec<u32>,
}

impl MockModel {
    /// A mock of `spec`'s model, speaking the tokenizer of `tokenizer_cfg` (vocabulary, EOS),
    /// that produces only ids of `produced` (all ids but EOS when empty).
    pub fn new(spec: &MockSpec, tokenizer_cfg: &ModelConfig, produced: Vec<u32>) -> Result<Self> {
        if !(spec.kv_scale > 0.0 && spec.kv_scale <= 1.0) {
            return Err(EngineError::InvalidParameter {
                field: "mock_kv_scale",
                reason: "must be in (0, 1]".into(),
                given: spec.kv_scale.to_string(),
            });
        }
        let shape = &spec.cost.model;
        let head_dim = ((shape.head_dim as f64 * spec.kv_scale).round() as usize).max(1);
        let cfg = ModelConfig {
            arch: ArchSpec::llama(),
            vocab_size: tokenizer_cfg.vocab_size,
            hidden_size: shape.hidden_size,
            intermediate_size: shape.intermediate_size,
            num_layers: shape.num_layers,
            num_heads: shape.num_heads,
            num_kv_heads: shape.num_kv_heads,
            head_dim,
            rotary_dim: head_dim,
            max_context: MOCK_MAX_CONTEXT,
            rms_norm_eps: tokenizer_cfg.rms_norm_eps,
            rope_theta: tokenizer_cfg.rope_theta,
            rope_scaling: RopeScaling::None,
            local_rope_theta: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            layer_windows: vec![None; shape.num_layers],
            tie_word_embeddings: shape.tie_word_embeddings,
            bos_token_id: tokenizer_cfg.bos_token_id,
            eos_token_ids: tokenizer_cfg.eos_token_ids.clone(),
            checkpoint_dtype: None,
            moe: None,
        };
        let vocab = cfg.vocab_size as u32;
        let mut produced: Vec<u32> = produced
            .into_iter()
            .filter(|t| *t < vocab && !cfg.eos_token_ids.contains(t))
            .collect();
        if produced.is_empty() {
            produced = (0..vocab)
                .filter(|t| !cfg.eos_token_ids.contains(t))
                .collect();
        }
        if produced.is_empty() {
            return Err(EngineError::InvalidConfig {
                reason: "the mock needs a vocabulary with a token besides EOS".into(),
            });
        }
        produced.sort_unstable();
        produced.dedup();
        Ok(MockModel {
            produced,
            cfg,
            cost: spec.cost.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// The profile's KV element size: 2 bytes is bf16, anything else f32.
    pub fn dtype(&self) -> DType {
        if self.cost.model.dtype_bytes == 2 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// The step's work as the cost model counts it. A sequence computing one token over a
    /// longer context is a decode; anything else is a prefill chunk (a chunked prompt's last
    /// single token counts as a decode, a negligible error).
    pub fn work(batch: &ForwardBatch) -> StepWork {
        let mut w = StepWork::default();
        for s in &batch.seqs {
            let start = s.context_len - s.q_len;
            if s.q_len == 1 && start > 0 {
                w.decode_seqs += 1;
                w.decode_context_tokens += s.context_len;
            } else {
                let (n, ctx) = (s.q_len as f64, s.context_len as f64);
                w.prefill_tokens += s.q_len;
                w.prefill_attn += n * ctx;
                w.prefill_pairs += causal_pairs(s.q_len, start);
                w.prefill_context_tokens += s.context_len;
            }
        }
        w
    }

    /// The token that follows `token` at `position`: a hash of the two, so the same sequence
    /// gets the same continuation on any node, in any batch, alone or not.
    pub fn next_token(&self, token: u32, position: u32) -> u32 {
        let h = splitmix64(((token as u64) << 32) | position as u64);
        self.produced[(h % self.produced.len() as u64) as usize]
    }

    /// Sleeps the step's predicted time in one go and returns one-hot logits for the rows that
    /// sample: a step nobody pushes layers from (a decode step) wakes its thread once, not once
    /// per layer (32 decode nodes stepping every 7 ms would otherwise wake 150,000 times a
    /// second, which is the emulating machine's CPU, not the emulated cluster's).
    pub fn forward(&self, batch: &ForwardBatch) -> Result<Tensor> {
        std::thread::sleep(self.step_time(batch));
        self.logits(batch)
    }

    /// Like [`forward`](Self::forward), a layer's share at a time with `on_layer` after each,
    /// so a prefill node pushes each layer's KV as the real model lets it.
    pub fn forward_with_layer_hook(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        on_layer: &mut dyn FnMut(usize, &mut KvCache) -> Result<()>,
    ) -> Result<Tensor> {
        let step = self.step_time(batch);
        let per_layer = step / self.cfg.num_layers as u32;
        let started = std::time::Instant::now();
        for layer in 0..self.cfg.num_layers {
            // Sleep to the layer's deadline rather than for its share, so the oversleep of
            // each call does not add up over the layers.
            let due = per_layer * (layer as u32 + 1);
            if let Some(left) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(left);
            }
            on_layer(layer, cache)?;
        }
        self.logits(batch)
    }

    fn step_time(&self, batch: &ForwardBatch) -> Duration {
        Duration::from_secs_f64(self.cost.step_s(&Self::work(batch)))
    }

    fn logits(&self, batch: &ForwardBatch) -> Result<Tensor> {
        let vocab = self.cfg.vocab_size;
        let mut logits = vec![0f32; batch.logits_rows.len() * vocab];
        for (i, &row) in batch.logits_rows.iter().enumerate() {
            let row = row as usize;
            let next = self.next_token(batch.token_ids[row], batch.positions[row]);
            logits[i * vocab + next as usize] = CHOSEN_LOGIT;
        }
        Ok(Tensor::from_vec(
            logits,
            (batch.logits_rows.len(), vocab),
            &Device::Cpu,
        )?)
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::testing::tiny_linear;
    use crate::cost::Linear3;

    fn model() -> MockModel {
        let l = |a: f64| Linear3 { a, b: 0.0, c: 0.0 };
        let spec = MockSpec {
            cost: tiny_linear(l(0.002), l(0.001)),
            kv_scale: 0.5,
        };
        // Produces 3..512 as if 0-2 were special; 2 (EOS) is dropped anyway.
        MockModel::new(&spec, &spec_cfg(), (2..512).collect()).expect("valid spec")
    }

    fn spec_cfg() -> ModelConfig {
        ModelConfig {
            arch: ArchSpec::llama(),
            vocab_size: 512,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 5,
            num_heads: 8,
            num_kv_heads: 4,
            head_dim: 8,
            rotary_dim: 8,
            max_context: 512,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            local_rope_theta: None,
            attn_scale: 1.0 / 8f32.sqrt(),
            attn_softcap: None,
            final_softcap: None,
            layer_windows: vec![None; 5],
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            checkpoint_dtype: None,
            moe: None,
        }
    }

    #[test]
    fn the_layout_is_the_profiles_with_head_dim_scaled() {
        let m = model();
        // tiny_linear: 4 layers, 2 KV heads of 16; half of 16 is 8.
        assert_eq!(
            (m.cfg.num_layers, m.cfg.num_kv_heads, m.cfg.head_dim),
            (4, 2, 8)
        );
        assert_eq!(m.cfg.vocab_size, 512);
        assert_eq!(m.dtype(), DType::F32);
        let bad = MockSpec {
            kv_scale: 0.0,
            ..MockSpec {
                cost: m.cost.clone(),
                kv_scale: 1.0,
            }
        };
        assert!(MockModel::new(&bad, &spec_cfg(), Vec::new()).is_err());
    }

    #[test]
    fn tokens_are_deterministic_and_never_eos_or_reserved() {
        let m = model();
        let mut seen = std::collections::HashSet::new();
        for pos in 0..5000u32 {
            let t = m.next_token(pos % 97, pos);
            assert_eq!(t, m.next_token(pos % 97, pos));
            assert!(t >= 3 && (t as usize) < 512 && t != 2, "{t}");
            seen.insert(t);
        }
        // Spread over the vocabulary, not stuck on a few ids.
        assert!(seen.len() > 400, "{}", seen.len());
    }

    #[test]
    fn work_counts_prefill_chunks_and_decodes() {
        let mut fb = ForwardBatch::default();
        fb.push_seq(&[5; 10], 0, vec![0], 16, true); // a 10-token prompt
        fb.push_seq(&[7], 20, vec![1, 2], 16, true); // a decode at context 21
        fb.push_seq(&[9; 4], 16, vec![3, 4], 16, false); // a chunk after 16 cached
        let w = MockModel::work(&fb);
        assert_eq!(w.prefill_tokens, 14);
        assert_eq!(w.prefill_context_tokens, 10 + 20);
        assert_eq!((w.decode_seqs, w.decode_context_tokens), (1, 21));
        assert_eq!(w.prefill_pairs, 55.0 + (4.0 * 16.0 + 10.0));
    }

    #[test]
    fn a_step_takes_the_profiles_time_and_calls_every_layer() {
        let m = model();
        let layout = kv_types::KvLayout {
            dtype: kv_types::KvDtype::F32,
            num_layers: 4,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
            windows: Default::default(),
        };
        let mut cache = KvCache::new(layout, 4);
        let mut fb = ForwardBatch::default();
        fb.push_seq(&[5, 6, 7], 0, vec![0], 16, true);
        let mut layers = Vec::new();
        let started = std::time::Instant::now();
        let logits = m
            .forward_with_layer_hook(&fb, &mut cache, &mut |l, _| {
                layers.push(l);
                Ok(())
            })
            .expect("forward");
        let took = started.elapsed();
        assert_eq!(layers, vec![0, 1, 2, 3]);
        // Prefill-only step: the fit's a = 2 ms.
        assert!(took >= Duration::from_millis(2), "{took:?}");
        let row: Vec<f32> = logits.get(0).and_then(|r| r.to_vec1()).expect("row");
        let argmax = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32);
        assert_eq!(argmax, Some(m.next_token(7, 2)));
        // Without a hook: one sleep of the same step time, the same logits.
        let started = std::time::Instant::now();
        let again = m.forward(&fb).expect("forward");
        assert!(started.elapsed() >= Duration::from_millis(2));
        let again: Vec<f32> = again.get(0).and_then(|r| r.to_vec1()).expect("row");
        assert_eq!(again, row);
    }
}
