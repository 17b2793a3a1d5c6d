//! GGUF files as llama.cpp makes them: a transformers model directory converted the way its
//! `convert_hf_to_gguf.py` does (F32, or its own `--outtype q8_0`), or then quantised the way
//! `llama-quantize ... Q8_0` does. The engine's GGUF tests read files made here instead of
//! committed ones; `gguf/tests/fixtures/manifest.json` records the bytes llama.cpp's own tools
//! wrote for each, and `tests/gguf_fixtures.rs` checks that these are the same bytes, so the
//! greedy ids measured with llama.cpp on its files hold for these.
//!
//! What the converter decides, this does for the architectures the `gguf` crate reads
//! (llama, Mixtral as `llama`, qwen3moe, gemma2, gemma3, phi3): its metadata keys in its
//! order, tensors in the checkpoint's (sorted) order under llama.cpp's names (the `gguf`
//! crate's table, read backwards), q/k rows permuted for llama's rope layout, Gemma's norms
//! stored as `1 + w`, experts stacked into one tensor per projection, LongRoPE's factors as
//! tensors; the tokenizer as `tokenizer.ggml.*` arrays. Q8_0 rounds as ggml's
//! `quantize_row_q8_0_ref`.

mod container;
pub mod fixtures;
pub mod manifest;
mod meta;
mod quant;
mod tensors;
mod vocab;

use std::path::Path;

use anyhow::Context;

/// The file's weight type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    F32,
    Q8_0,
}

/// Which of llama.cpp's tools made a Q8_0 file: the converter itself
/// (`convert_hf_to_gguf.py --outtype q8_0`: tensors in its order, rows that are not whole
/// 32-blocks in F16), or `llama-quantize` from the F32 file (tensors sorted by layer, the
/// quantisation keys moved last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantizer {
    Converter,
    LlamaQuantize,
}

/// Where the converter took the vocabulary from: the directory's `tokenizer.json` (a Llama
/// BPE with byte fallback: no chat template written), or a SentencePiece `tokenizer.model`
/// holding the same pieces (what `gguf/tests/fixtures/arch/make.py` gives the converter for
/// Gemma, Phi-3 and Qwen; chat template written, and Gemma's `add_space_prefix = false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabSource {
    TokenizerJson,
    SentencePiece,
}

/// How to write one file.
#[derive(Debug, Clone)]
pub struct GgufOptions {
    pub ty: GgufType,
    pub quantizer: Quantizer,
    pub vocab: VocabSource,
    /// The model directory's name as the converter saw it: `general.name` and friends come
    /// from it (`tiny-random-2` is name `Tiny Random 2`, basename `tiny-random`, version `2`).
    pub dir_name: String,
}

/// The GGUF file llama.cpp's tools would make from the transformers model in `dir`.
pub fn convert(dir: &Path, opts: &GgufOptions) -> anyhow::Result<Vec<u8>> {
    let config: serde_json::Value = {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
    };
    let hp = meta::Hparams::from_config(&config)?;
    let converted = tensors::convert(dir, &hp)?;
    let tokens = vocab::vocab(dir, opts.vocab)?;
    let kv = meta::metadata(&hp, opts, &converted, &tokens)?;
    let tensors = match opts.ty {
        GgufType::F32 => converted,
        GgufType::Q8_0 => quant::quantize(converted, opts.quantizer),
    };
    Ok(container::to_bytes(&kv, &tensors))
}

/// [`convert`], written to `out`.
pub fn write_gguf(dir: &Path, out: &Path, opts: &GgufOptions) -> anyhow::Result<()> {
    let bytes = convert(dir, opts)?;
    std::fs::write(out, bytes).with_context(|| format!("writing {}", out.display()))
}
