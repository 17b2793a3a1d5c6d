//! A GGUF file's weights into the engine's model: the `gguf` crate dequantises each tensor
//! under transformers' name and the model loads them as it loads a safetensors checkpoint, in
//! the load dtype, or as the engine's int8 with `--quantize int8` (lossless for Q8_0 blocks:
//! both hold 32 inputs per scale). Native kernels over the k-quant blocks are a later step.
//!
//! The config, tokenizer and chat template reach the engine as JSON files in the model
//! directory that [`crate::loader`] writes for a GGUF file (`gguf::materialize`).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::error::{EngineError, Result};

/// The GGUF file a model's weight list names, if its weights are one. A leaf: the loader and
/// the model call down into this file, and it imports neither.
pub fn gguf_file(weights: &[PathBuf]) -> Option<&Path> {
    match weights {
        [one]
            if one
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf")) =>
        {
            Some(one)
        }
        _ => None,
    }
}

/// The error for a bad GGUF file, naming it.
pub(crate) fn gguf_error(path: &Path, e: gguf::GgufError) -> EngineError {
    EngineError::InvalidConfig {
        reason: format!("{}: {e}", path.display()),
    }
}

/// The tensors of the GGUF file at `path`, dequantised into `dtype` under transformers'
/// names, for the model to load as it loads a safetensors checkpoint.
pub fn var_builder(path: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let started = std::time::Instant::now();
    let file = gguf::GgufFile::open(path).map_err(|e| gguf_error(path, e))?;
    let tensors = gguf::load_tensors(&file, dtype, device).map_err(|e| gguf_error(path, e))?;
    tracing::info!(
        path = %path.display(),
        weight_type = gguf::weight_type(&file),
        ?dtype,
        load_ms = started.elapsed().as_millis() as u64,
        "read gguf weights, dequantised"
    );
    Ok(VarBuilder::from_tensors(tensors, dtype, device))
}
