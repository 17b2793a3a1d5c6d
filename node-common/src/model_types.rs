//! What a node reports it serves besides the model's identity (issues 32, 33): the
//! architecture, and the weights' type as loaded, so that `/info`, `fission nodes list` and a
//! refusal can say "Qwen3ForCausalLM in q4_k" rather than only a fingerprint. The KV cache's
//! type is the KV layout's.

use engine::model::LoadedModel;
use engine::quantize::Quantize;

/// The GGUF block types the engine runs as stored (the others are dequantised at load).
const RUN_AS_STORED: [&str; 5] = ["q4_0", "q4_k", "q5_k", "q6_k", "q8_0"];

/// `config.json`'s `architectures[0]` (transformers' class name, e.g. `Qwen3ForCausalLM`),
/// else its `model_type`; empty when neither is there.
pub fn architecture(model: &LoadedModel) -> String {
    let config = read_config(model);
    config["architectures"][0]
        .as_str()
        .or_else(|| config["model_type"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The projections' type as they run: `int8` when quantised at load, a GGUF file's block
/// type when the engine runs it as stored (`q4_k`, `q8_0`, ...), else the load dtype (`f32`,
/// `bf16`, `f16`).
pub fn weight_dtype(model: &LoadedModel, quantize: Quantize) -> String {
    if quantize == Quantize::Int8 {
        return "int8".into();
    }
    let config = read_config(model);
    let gguf = config["fission_gguf"]["weight_type"]
        .as_str()
        .map(str::to_ascii_lowercase)
        .filter(|t| quantize == Quantize::None && RUN_AS_STORED.contains(&t.as_str()));
    gguf.unwrap_or_else(|| model.model.dtype().as_str().to_string())
}

fn read_config(model: &LoadedModel) -> serde_json::Value {
    std::fs::read(&model.files.config)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::loader::ModelSource;

    #[test]
    fn stories260k_is_a_llama_in_f32_or_int8() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/models/stories260K"
        );
        let source = ModelSource::Local(dir.into());
        let model = LoadedModel::load(&source, None, &candle_core::Device::Cpu).unwrap();
        assert_eq!(architecture(&model), "LlamaForCausalLM");
        assert_eq!(weight_dtype(&model, Quantize::None), "f32");
        assert_eq!(weight_dtype(&model, Quantize::Int8), "int8");
        assert_eq!(weight_dtype(&model, Quantize::Dequant), "f32");
    }
}
