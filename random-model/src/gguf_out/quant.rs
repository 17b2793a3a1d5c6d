//! Q8_0 and F16 as llama.cpp writes them, and which tensors each tool quantises.

use half::f16;

use super::container::{OutTensor, Stored};
use super::Quantizer;

/// Q8_0 blocks of 32 values: `d = amax / 127` in f32, stored as f16, and each value
/// `round(x * (1 / d))` (half away from zero), as ggml's `quantize_row_q8_0_ref` and gguf-py's
/// `Q8_0.quantize_blocks` compute it.
pub(crate) fn q8_0_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
    }
    out
}

/// IEEE half, round to nearest even (numpy's `astype(np.float16)`, ggml's FP32_TO_FP16).
pub(crate) fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

/// The converter's F32 tensors, quantised as `quantizer` does for Q8_0.
pub(crate) fn quantize(mut tensors: Vec<OutTensor>, quantizer: Quantizer) -> Vec<OutTensor> {
    for t in &mut tensors {
        // Vectors (norms, biases, rope factors) and the router stay F32 with both tools.
        if t.shape.len() < 2 || t.name.contains("ffn_gate_inp") {
            continue;
        }
        // Rows that are not whole 32-blocks fall back to F16 (gguf-py's rule; stories260K's
        // `ffn_down`, 172 wide, is one).
        let whole_blocks = t.shape.last().is_some_and(|&n| n % 32 == 0);
        t.stored = if whole_blocks {
            Stored::Q8_0
        } else {
            Stored::F16
        };
    }
    if quantizer == Quantizer::LlamaQuantize {
        // llama-quantize writes the tensors outside the layers first, then layer by layer,
        // each group by name.
        tensors.sort_by(|a, b| layer_key(&a.name).cmp(&layer_key(&b.name)));
    }
    tensors
}

fn layer_key(name: &str) -> (Option<usize>, &str) {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok());
    (layer, name)
}
