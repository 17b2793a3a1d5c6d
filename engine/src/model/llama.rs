//! The Llama family forward pass (Llama, Mistral, Qwen2, Qwen3), over a paged KV cache: the
//! tensor path, and the weights both paths share. What differs between architectures is read
//! from the config's [`ArchSpec`](crate::config::ArchSpec), never from its name.
//!
//! Weights are immutable and the KV cache lives outside them, so one `Llama` can be shared.
//! Q/K/V and gate/up projections are fused at load time to halve the matmul launches per layer.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use super::batch::ForwardBatch;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::op_timing::{timed, Op};
use super::ops::{self, AttnDims};
use super::qk_norm::QkNorm;
use super::rope::Rope;
use crate::config::{Activation, ModelConfig};
use crate::error::Result;
use crate::kv::cache::KvCache;
use crate::quantize::Quantize;

#[derive(Debug, Clone)]
pub(super) struct Layer {
    pub(super) input_norm: RmsNorm,
    pub(super) qkv: Linear,
    /// Per-head norms on q and k, when the architecture has them.
    pub(super) qk_norm: Option<QkNorm>,
    pub(super) o_proj: Linear,
    pub(super) post_norm: RmsNorm,
    pub(super) gate_up: Linear,
    pub(super) down: Linear,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &ModelConfig, quantize: Quantize) -> Result<Self> {
        let (h, hkv, d, hid) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let att = vb.pp("self_attn");
        let q = att.pp("q_proj");
        let k = att.pp("k_proj");
        let v = att.pp("v_proj");
        let weight = Tensor::cat(
            &[
                q.get((h * d, hid), "weight")?,
                k.get((hkv * d, hid), "weight")?,
                v.get((hkv * d, hid), "weight")?,
            ],
            0,
        )?;
        let bias = if cfg.arch.qkv_bias {
            Some(Tensor::cat(
                &[
                    q.get(h * d, "bias")?,
                    k.get(hkv * d, "bias")?,
                    v.get(hkv * d, "bias")?,
                ],
                0,
            )?)
        } else {
            None
        };
        let mlp = vb.pp("mlp");
        let f = cfg.intermediate_size;
        let gate_up = Tensor::cat(
            &[
                mlp.pp("gate_proj").get((f, hid), "weight")?,
                mlp.pp("up_proj").get((f, hid), "weight")?,
            ],
            0,
        )?;
        Ok(Layer {
            input_norm: RmsNorm::load(vb.pp("input_layernorm"), hid, cfg)?,
            qkv: Linear::quantized(weight, bias, quantize)?,
            qk_norm: QkNorm::load(&att, cfg)?,
            o_proj: Linear::quantized(
                att.pp("o_proj").get((hid, h * d), "weight")?,
                None,
                quantize,
            )?,
            post_norm: RmsNorm::load(vb.pp("post_attention_layernorm"), hid, cfg)?,
            gate_up: Linear::quantized(gate_up, None, quantize)?,
            down: Linear::quantized(mlp.pp("down_proj").get((hid, f), "weight")?, None, quantize)?,
        })
    }
}

/// A loaded Llama-family model.
#[derive(Debug, Clone)]
pub struct Llama {
    pub(super) cfg: ModelConfig,
    pub(super) embed: candle_nn::Embedding,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: RmsNorm,
    pub(super) lm_head: Linear,
    pub(super) rope: Rope,
    pub(super) dtype: DType,
    pub(super) device: Device,
    /// f32 or bf16 weights on the CPU, every projection packed: [`Llama::forward_host`] runs it.
    pub(super) host: bool,
}

impl Llama {
    pub fn load(vb: VarBuilder, cfg: &ModelConfig) -> Result<Self> {
        Self::load_quantized(vb, cfg, Quantize::None)
    }

    /// [`load`](Self::load) with every projection and the lm_head quantised as `quantize`
    /// says; the embeddings and norms keep the load dtype.
    pub fn load_quantized(vb: VarBuilder, cfg: &ModelConfig, quantize: Quantize) -> Result<Self> {
        let embed_w = vb
            .pp("model.embed_tokens")
            .get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let lm_head = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            embed_w.clone()
        } else {
            vb.pp("lm_head")
                .get((cfg.vocab_size, cfg.hidden_size), "weight")?
        };
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(vb.pp(format!("model.layers.{i}")), cfg, quantize))
            .collect::<Result<Vec<_>>>()?;
        let mut model = Llama {
            cfg: cfg.clone(),
            embed: candle_nn::Embedding::new(embed_w, cfg.hidden_size),
            layers,
            norm: RmsNorm::load(vb.pp("model.norm"), cfg.hidden_size, cfg)?,
            lm_head: Linear::quantized(lm_head, None, quantize)?,
            rope: Rope::new(cfg),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            host: false,
        };
        model.host = model.runs_on_host() && std::env::var_os("FISSION_TENSOR_FORWARD").is_none();
        Ok(model)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether steps run on the host path ([`forward_host`](Self::forward_host)) rather than
    /// the tensor path.
    pub fn runs_host_path(&self) -> bool {
        self.host
    }

    /// This model on the tensor path, as `FISSION_TENSOR_FORWARD=1` loads it: lets one
    /// process check both paths against the same reference.
    pub fn with_tensor_path(&self) -> Self {
        Llama {
            host: false,
            ..self.clone()
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs one step and returns f32 logits `[batch.logits_rows.len(), vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_with_layer_hook(batch, cache, &mut |_, _| Ok(()))
    }

    /// Like [`forward`](Self::forward), calling `on_layer` after each layer's KV is in the
    /// cache, so a prefill node can start pushing that layer while the next one computes.
    pub fn forward_with_layer_hook(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        on_layer: &mut dyn FnMut(usize, &mut KvCache) -> Result<()>,
    ) -> Result<Tensor> {
        if self.host {
            return timed(Op::Forward, || self.forward_host(batch, cache, on_layer));
        }
        let t = batch.num_tokens();
        let ids = Tensor::from_slice(&batch.token_ids, t, &self.device)?;
        let mut x = self.embed.forward(&ids)?;
        let rope = self.rope.tables(&batch.positions);
        let dims = AttnDims {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        let layout = *cache.shape();
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            let mut qkv = layer.qkv.forward(&h)?;
            if let Some(norm) = &layer.qk_norm {
                qkv = norm.forward(&qkv, dims)?;
            }
            let attn = ops::attention(&qkv, batch, &rope, &layout, cache.layer_mut(i), dims)?;
            x = (x + layer.o_proj.forward(&attn)?)?;
            let h = layer.post_norm.forward(&x)?;
            let act = match self.cfg.arch.activation {
                Activation::Silu => ops::silu_mul(&layer.gate_up.forward(&h)?)?,
            };
            x = (x + layer.down.forward(&act)?)?;
            on_layer(i, cache)?;
        }
        if batch.logits_rows.is_empty() {
            return Ok(Tensor::zeros(
                (0, self.cfg.vocab_size),
                DType::F32,
                &self.device,
            )?);
        }
        let rows = Tensor::from_slice(&batch.logits_rows, batch.logits_rows.len(), &self.device)?;
        let last = self.norm.forward(&x.index_select(&rows, 0)?)?;
        let logits = self.lm_head.forward(&last)?;
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }
}
