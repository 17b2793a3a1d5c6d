//! Model loading and the forward pass.

pub mod batch;
pub(crate) mod cpu_slice;
mod device_attn;
pub mod device_ops;
mod host;
mod linear;
pub mod llama;
mod mlp;
pub mod mock;
mod moe;
mod norm;
pub mod op_timing;
mod ops;
mod qk_norm;
pub mod rope;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub use batch::{ForwardBatch, SeqSlice};
pub use llama::Llama;
pub use mock::{MockModel, MockSpec};

use crate::config::{LlamaConfig, ModelConfig};
use crate::error::{EngineError, Result};
use crate::generation::GenerationConfig;
use crate::kv::cache::KvCache;
use crate::loader::{ModelFiles, ModelSource};
use crate::quantize::Quantize;

/// Parses a dtype name as used on the command line and in config.json.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" | "half" => Ok(DType::F16),
        other => Err(EngineError::UnsupportedDtype {
            dtype: other.to_string(),
        }),
    }
}

/// The forward pass a node runs: the real model, or the mock that spends a cost profile's time
/// (`--engine mock`, [`mock`]).
#[derive(Debug)]
pub enum Model {
    Llama(Llama),
    Mock(MockModel),
}

impl Model {
    /// Where this model reads its KV cache: the model's device when it runs the tensor path,
    /// `None` (host vectors) for the host path and the mock. An int8 cache on the CPU's tensor
    /// path stays on the host even so (`KvCache::with_groups_on` decides: the device ops have
    /// no int8 yet); on a GPU it is refused.
    pub fn kv_device(&self) -> Option<&Device> {
        match self {
            Model::Llama(m) if !m.runs_host_path() => Some(m.device()),
            _ => None,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Llama(m) => m.config(),
            Model::Mock(m) => m.config(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Model::Llama(m) => m.dtype(),
            Model::Mock(m) => m.dtype(),
        }
    }

    pub fn as_mock(&self) -> Option<&MockModel> {
        match self {
            Model::Mock(m) => Some(m),
            Model::Llama(_) => None,
        }
    }

    /// Runs one step and returns f32 logits `[batch.logits_rows.len(), vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        match self {
            Model::Llama(m) => m.forward(batch, cache),
            Model::Mock(m) => m.forward(batch),
        }
    }

    /// Like [`forward`](Self::forward), calling `on_layer` after each layer's KV is in the
    /// cache, so a prefill node can start pushing that layer while the next one computes.
    pub fn forward_with_layer_hook(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        on_layer: &mut dyn FnMut(usize, &mut KvCache) -> Result<()>,
    ) -> Result<Tensor> {
        match self {
            Model::Llama(m) => m.forward_with_layer_hook(batch, cache, on_layer),
            Model::Mock(m) => m.forward_with_layer_hook(batch, cache, on_layer),
        }
    }
}

/// Everything loaded from one model directory: weights, tokenizer and generation defaults.
#[derive(Clone)]
pub struct LoadedModel {
    pub model_id: String,
    pub model: Arc<Model>,
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    pub generation: GenerationConfig,
    pub files: ModelFiles,
}

impl LoadedModel {
    /// Loads a model. `dtype` defaults to f32 on CPU.
    pub fn load(source: &ModelSource, dtype: Option<DType>, device: &Device) -> Result<Self> {
        Self::load_quantized(source, dtype, Quantize::None, device)
    }

    /// [`load`](Self::load), its projections quantised as `quantize` says (`--quantize`).
    pub fn load_quantized(
        source: &ModelSource,
        dtype: Option<DType>,
        quantize: Quantize,
        device: &Device,
    ) -> Result<Self> {
        let files = ModelFiles::resolve(source)?;
        let cfg = LlamaConfig::from_file(&files.config)?.resolve()?;
        let dtype = dtype.unwrap_or(match device {
            Device::Cpu => DType::F32,
            _ => DType::BF16,
        });
        let model = load_weights(&files, &cfg, dtype, quantize, device)?;
        Self::assemble(source, files, &cfg, Model::Llama(model))
    }

    /// A mock of `spec`'s profiled model that speaks `source`'s tokenizer: no weights are read.
    pub fn load_mock(source: &ModelSource, spec: &MockSpec) -> Result<Self> {
        let files = ModelFiles::resolve(source)?;
        let cfg = LlamaConfig::from_file(&files.config)?.resolve()?;
        let tokenizer = load_tokenizer(&files)?;
        let produced = tokenizer
            .get_vocab(true)
            .into_iter()
            // `<0x0A>` byte pieces, `<s>`, `<|im_end|>`: not words.
            .filter(|(piece, _)| !(piece.starts_with('<') && piece.ends_with('>')))
            .map(|(_, id)| id)
            .filter(|id| tokenizer.decode(&[*id], true).is_ok_and(|t| !t.is_empty()))
            .collect();
        let mock = MockModel::new(spec, &cfg, produced)?;
        Self::assemble(source, files, &cfg, Model::Mock(mock))
    }

    fn assemble(
        source: &ModelSource,
        files: ModelFiles,
        cfg: &ModelConfig,
        model: Model,
    ) -> Result<Self> {
        let tokenizer = load_tokenizer(&files)?;
        let generation = GenerationConfig::load(&files, cfg)?;
        Ok(LoadedModel {
            model_id: source.model_id(),
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            generation,
            files,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The same model on the tensor path (what `FISSION_TENSOR_FORWARD=1` loads), sharing
    /// the tokenizer; a mock stays as it is.
    pub fn with_tensor_path(&self) -> Self {
        let model = match &*self.model {
            Model::Llama(m) => Arc::new(Model::Llama(m.with_tensor_path())),
            Model::Mock(_) => self.model.clone(),
        };
        LoadedModel {
            model,
            ..self.clone()
        }
    }
}

fn load_tokenizer(files: &ModelFiles) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(&files.tokenizer)
        .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", files.tokenizer.display())))
}

fn load_weights(
    files: &ModelFiles,
    cfg: &ModelConfig,
    dtype: DType,
    quantize: Quantize,
    device: &Device,
) -> Result<Llama> {
    if let Some(gguf) = crate::gguf_weights::gguf_file(&files.weights) {
        let keep = quantize == Quantize::None && matches!(device, Device::Cpu);
        let vb = crate::gguf_weights::var_builder(gguf, dtype, device, keep)?;
        let model = Llama::load_quantized(vb, cfg, quantize);
        crate::gguf_weights::release_kept();
        return model;
    }
    for p in &files.weights {
        if !p.is_file() {
            return Err(EngineError::MissingFile { path: p.clone() });
        }
    }
    // SAFETY: the files are mapped read-only and are not modified while mapped; a serving
    // process owns its model directory.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, device)? };
    Llama::load_quantized(vb, cfg, quantize)
}

/// Runs `f` over the f32 logits `[rows, vocab]` as one flat slice.
pub fn logits_rows<R>(logits: &candle_core::Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    ops::with_slice::<f32, R>(logits, f)
}
