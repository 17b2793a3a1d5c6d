//! A GGUF file's weights into the engine's model: the `gguf` crate dequantises each tensor
//! under transformers' name and the model loads them as it loads a safetensors checkpoint, in
//! the load dtype, or as the engine's int8 with `--quantize int8` (lossless for Q8_0 blocks:
//! both hold 32 inputs per scale). Native kernels over the k-quant blocks are a later step.
//!
//! The config, tokenizer and chat template reach the engine as JSON files in the model
//! directory that [`crate::loader`] writes for a GGUF file (`gguf::materialize`).

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::loader::ModelFiles;
use crate::model::Llama;
use crate::quantize::Quantize;

/// The GGUF file `files` loads its weights from, if they are one.
pub fn gguf_file(files: &ModelFiles) -> Option<&Path> {
    match files.weights.as_slice() {
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

/// Loads the model in the GGUF file at `path`, whose config `cfg` was read from it.
pub fn load_llama(
    path: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    quantize: Quantize,
    device: &Device,
) -> Result<Llama> {
    let started = std::time::Instant::now();
    let file = gguf::GgufFile::open(path).map_err(|e| gguf_error(path, e))?;
    let tensors = gguf::load_tensors(&file, dtype, device).map_err(|e| gguf_error(path, e))?;
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let model = Llama::load_quantized(vb, cfg, quantize)?;
    tracing::info!(
        path = %path.display(),
        weight_type = gguf::weight_type(&file),
        ?dtype,
        %quantize,
        load_ms = started.elapsed().as_millis() as u64,
        "loaded gguf weights, dequantised"
    );
    Ok(model)
}
