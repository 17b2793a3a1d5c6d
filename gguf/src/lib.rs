//! GGUF, llama.cpp's model file, read into what the engine loads from a transformers
//! checkpoint (architectures llama (and Mistral, and Mixtral with experts), qwen2, qwen3,
//! qwen3moe, gemma2, gemma3 and phi3): `config.json` from llama.cpp's metadata keys, `tokenizer.json` rebuilt from
//! `tokenizer.ggml.*` (SentencePiece `llama` and byte-level BPE `gpt2` models),
//! `tokenizer_config.json` with `tokenizer.chat_template`, and every tensor under
//! transformers' name, dequantised (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to
//! Q6_K), with llama.cpp's q/k permutation undone.
//!
//! A GGUF file is untrusted input: [`check_header`] bounds every count, length and offset it
//! declares before candle's reader (`candle_core::quantized::gguf_file`) allocates anything.
//!
//! This crate knows files, not models: it must not depend on the engine, and does no
//! networking. Dequantising at load is this slice; kernels over the quantised blocks as stored
//! are a later step.

mod arch;
mod config;
mod error;
mod file;
mod header;
mod sidecar;
mod tensors;
#[doc(hidden)]
pub mod test_bytes;
mod tokenizer;
mod types;

pub use arch::{Arch, ExpertPart, Target};
pub use config::{arch, hf_config};
pub use error::{GgufError, Result};
pub use file::{read_header, GgufFile, Metadata};
pub use header::{check_header, Header, TensorEntry};
pub use sidecar::{default_cache_root, is_gguf, materialize, WEIGHTS_LINK};
pub use tensors::{
    hf_name, load_tensors, load_tensors_keeping, type_counts, weight_type, RawTensor,
};
pub use tokenizer::{generation_config, tokenizer, tokenizer_config, tokenizer_json};
pub use types::GgmlType;
