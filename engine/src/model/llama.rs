//! The Llama family forward pass (every [`Architecture`](crate::config::Architecture)), over a
//! paged KV cache: the
//! tensor path, and the weights both paths share. What differs between architectures is read
//! from the config's [`ArchSpec`](crate::config::ArchSpec), never from its name.
//!
//! Weights are immutable and the KV cache lives outside them, so one `Llama` can be shared.
//! Q/K/V and gate/up projections are fused at load time to halve the matmul launches per layer.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use super::batch::ForwardBatch;
use super::device_attn::{self, DeviceRope};
use super::device_ops;
use super::linear::Linear;
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::op_timing::{timed, Op};
use super::ops::{self, AttnDims, LayerAttn};
use super::qk_norm::QkNorm;
use super::rope::{Rope, RopeTables};
use crate::config::ModelConfig;
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
    /// The norm on attention's output, before its residual add (Gemma's
    /// `post_attention_layernorm`), when the architecture has sandwich norms.
    pub(super) post_attn_norm: Option<RmsNorm>,
    /// The norm before the MLP: Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`.
    pub(super) post_norm: RmsNorm,
    /// The feed-forward: one MLP, or a mixture of experts.
    pub(super) mlp: Mlp,
    /// The norm on the MLP's output (Gemma's `post_feedforward_layernorm`).
    pub(super) post_ffn_norm: Option<RmsNorm>,
    /// The layer's attention scale, sliding window and soft-cap.
    pub(super) attn: kernels::AttnOptions,
    /// Whether the layer rotates with the model's local rope (Gemma 3's sliding layers).
    pub(super) local_rope: bool,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &ModelConfig, quantize: Quantize, index: usize) -> Result<Self> {
        let (h, hkv, d, hid) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let att = vb.pp("self_attn");
        let (weight, bias) = if cfg.arch.fused_checkpoint {
            // Phi-3: q, k, v already fused, in the engine's order.
            let qkv = att.pp("qkv_proj");
            let rows = (h + 2 * hkv) * d;
            (
                qkv.get((rows, hid), "weight")?,
                if cfg.arch.qkv_bias {
                    Some(qkv.get(rows, "bias")?)
                } else {
                    None
                },
            )
        } else {
            Self::fuse(&att, cfg)?
        };
        let norm = |name: &str| RmsNorm::load(vb.pp(name), hid, cfg);
        let (post_attn_norm, post_norm, post_ffn_norm) = if cfg.arch.sandwich_norms {
            (
                Some(norm("post_attention_layernorm")?),
                norm("pre_feedforward_layernorm")?,
                Some(norm("post_feedforward_layernorm")?),
            )
        } else {
            (None, norm("post_attention_layernorm")?, None)
        };
        let window = cfg.layer_windows.get(index).copied().flatten();
        Ok(Layer {
            input_norm: norm("input_layernorm")?,
            qkv: Linear::quantized(weight, bias, quantize)?,
            qk_norm: QkNorm::load(&att, cfg)?,
            o_proj: Linear::quantized(
                att.pp("o_proj").get((hid, h * d), "weight")?,
                None,
                quantize,
            )?,
            post_attn_norm,
            post_norm,
            mlp: Mlp::load(&vb, cfg, quantize, index)?,
            post_ffn_norm,
            attn: kernels::AttnOptions {
                scale: cfg.attn_scale,
                window,
                softcap: cfg.attn_softcap,
            },
            local_rope: window.is_some() && cfg.local_rope_theta.is_some(),
        })
    }

    /// Separate q/k/v tensors (and q/k/v biases) concatenated: the fused weights the layer
    /// runs.
    fn fuse(att: &VarBuilder, cfg: &ModelConfig) -> Result<(Tensor, Option<Tensor>)> {
        let (h, hkv, d, hid) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
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
        Ok((weight, bias))
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
    /// The sliding layers' rope, when they have their own (Gemma 3).
    pub(super) local_rope: Option<Rope>,
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
            .map(|i| Layer::load(vb.pp(format!("model.layers.{i}")), cfg, quantize, i))
            .collect::<Result<Vec<_>>>()?;
        let mut model = Llama {
            cfg: cfg.clone(),
            embed: candle_nn::Embedding::new(embed_w, cfg.hidden_size),
            layers,
            norm: RmsNorm::load(vb.pp("model.norm"), cfg.hidden_size, cfg)?,
            lm_head: Linear::quantized(lm_head, None, quantize)?,
            rope: Rope::new(cfg),
            local_rope: Rope::local(cfg),
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
        if self.cfg.arch.embed_scale {
            // transformers multiplies by sqrt(hidden) rounded to the embedding dtype.
            let scale = Tensor::new(&[(self.cfg.hidden_size as f64).sqrt() as f32], &self.device)?
                .to_dtype(x.dtype())?;
            x = x.broadcast_mul(&scale)?;
        }
        let ropes = self.rope_tables(&batch.positions);
        // A cache on the device (what `Model::kv_device` puts it on for this path) goes through
        // the device ops; an int8 cache on the CPU stays host slices (`ops::attention`).
        let device = match cache.is_on_device() {
            true => Some(DeviceStep::new(&ropes, batch, cache, &self.device)?),
            false => None,
        };
        let dims = AttnDims {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            // A sliding-window layer reads its own group's blocks (`kv::groups`).
            let (batch, layout) = (
                batch.for_group(cache.groups().group_of(i)),
                *cache.layer_shape(i),
            );
            let h = layer.input_norm.forward(&x)?;
            let mut qkv = layer.qkv.forward(&h)?;
            if let Some(norm) = &layer.qk_norm {
                qkv = norm.forward(&qkv, dims)?;
            }
            let at = LayerAttn {
                batch,
                rope: ropes.for_layer(layer),
                layout: &layout,
                dims,
                opts: layer.attn,
            };
            let attn = match (&device, cache.layer_tensor(i)) {
                (Some(step), Some(kv)) => {
                    let group = cache.groups().group_of(i);
                    let rope = step.rope(layer);
                    device_attn::attention(&qkv, &at, rope, &step.seqs[group], kv)?
                }
                _ => ops::attention(&qkv, &at, cache.layer_mut(i))?,
            };
            let mut o = layer.o_proj.forward(&attn)?;
            if let Some(norm) = &layer.post_attn_norm {
                o = norm.forward(&o)?;
            }
            x = (x + o)?;
            let h = layer.post_norm.forward(&x)?;
            let mut d = layer.mlp.forward(&h, self.cfg.arch.activation)?;
            if let Some(norm) = &layer.post_ffn_norm {
                d = norm.forward(&d)?;
            }
            x = (x + d)?;
            on_layer(i, cache)?;
        }
        // Logits go back on the host, where sampling reads them (`model::logits_rows`).
        if batch.logits_rows.is_empty() {
            return Ok(Tensor::zeros(
                (0, self.cfg.vocab_size),
                DType::F32,
                &Device::Cpu,
            )?);
        }
        let rows = Tensor::from_slice(&batch.logits_rows, batch.logits_rows.len(), &self.device)?;
        let last = self.norm.forward(&x.index_select(&rows, 0)?)?;
        let logits = self
            .lm_head
            .forward(&last)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?;
        if self.cfg.final_softcap.is_none() {
            return Ok(logits.contiguous()?);
        }
        let shape = logits.shape().clone();
        let mut flat = logits.flatten_all()?.to_vec1::<f32>()?;
        ops::softcap_logits(&mut flat, self.cfg.final_softcap);
        Ok(Tensor::from_vec(flat, shape, &Device::Cpu)?)
    }

    /// The step's rope tables: the model's, and the sliding layers' own when they have one.
    pub(super) fn rope_tables(&self, positions: &[u32]) -> StepRopes {
        StepRopes {
            global: self.rope.tables(positions),
            local: self.local_rope.as_ref().map(|r| r.tables(positions)),
        }
    }
}

/// One step's inputs to the device ops, uploaded once and shared by every layer: the rope
/// tables, and each KV group's sequences.
struct DeviceStep {
    global: DeviceRope,
    local: Option<DeviceRope>,
    seqs: Vec<Vec<device_ops::SeqRows>>,
}

impl DeviceStep {
    fn new(
        ropes: &StepRopes,
        batch: &ForwardBatch,
        cache: &KvCache,
        device: &Device,
    ) -> Result<Self> {
        Ok(DeviceStep {
            global: DeviceRope::new(&ropes.global, device)?,
            local: match &ropes.local {
                Some(t) => Some(DeviceRope::new(t, device)?),
                None => None,
            },
            seqs: (0..cache.groups().num_groups())
                .map(|g| device_attn::seq_rows(batch.for_group(g)))
                .collect(),
        })
    }

    fn rope(&self, layer: &Layer) -> &DeviceRope {
        match (&self.local, layer.local_rope) {
            (Some(local), true) => local,
            _ => &self.global,
        }
    }
}

/// One step's rope tables, for every layer to pick its own.
pub(super) struct StepRopes {
    global: RopeTables,
    local: Option<RopeTables>,
}

impl StepRopes {
    pub(super) fn for_layer(&self, layer: &Layer) -> &RopeTables {
        match (&self.local, layer.local_rope) {
            (Some(local), true) => local,
            _ => &self.global,
        }
    }
}
