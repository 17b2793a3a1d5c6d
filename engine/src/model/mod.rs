//! Model loading and the forward pass.

pub mod batch;
mod host;
mod linear;
pub mod llama;
mod ops;
pub mod rope;

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

pub use batch::{ForwardBatch, SeqSlice};
pub use llama::Llama;

use crate::config::{LlamaConfig, ModelConfig};
use crate::error::{EngineError, Result};
use crate::generation::GenerationConfig;
use crate::loader::{ModelFiles, ModelSource};

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

/// Everything loaded from one model directory: weights, tokenizer and generation defaults.
#[derive(Clone)]
pub struct LoadedModel {
    pub model_id: String,
    pub model: Arc<Llama>,
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    pub generation: GenerationConfig,
    pub files: ModelFiles,
}

impl LoadedModel {
    /// Loads a model. `dtype` defaults to f32 on CPU.
    pub fn load(source: &ModelSource, dtype: Option<DType>, device: &Device) -> Result<Self> {
        let files = ModelFiles::resolve(source)?;
        let cfg = LlamaConfig::from_file(&files.config)?.resolve()?;
        let dtype = dtype.unwrap_or(match device {
            Device::Cpu => DType::F32,
            _ => DType::BF16,
        });
        let model = load_weights(&files, &cfg, dtype, device)?;
        let tokenizer = tokenizers::Tokenizer::from_file(&files.tokenizer)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", files.tokenizer.display())))?;
        let generation = GenerationConfig::load(&files, &cfg)?;
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
}

fn load_weights(
    files: &ModelFiles,
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
) -> Result<Llama> {
    for p in &files.weights {
        if !p.is_file() {
            return Err(EngineError::MissingFile { path: p.clone() });
        }
    }
    // SAFETY: the files are mapped read-only and are not modified while mapped; a serving
    // process owns its model directory.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, device)? };
    Llama::load(vb, cfg)
}

/// Runs `f` over the f32 logits `[rows, vocab]` as one flat slice.
pub fn logits_rows<R>(logits: &candle_core::Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    ops::with_slice::<f32, R>(logits, f)
}
