//! Which tensors each tool quantises, and to what (the bytes are the container's).

use super::container::{OutTensor, Stored};
use super::Quantizer;

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
