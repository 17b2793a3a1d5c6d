//! The engine's one error type. Variants carry the ids and values involved so
//! messages name the field, the limit and the given value.

use std::path::PathBuf;

use crate::ids::{BlockId, SeqId};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("model file missing: {path}")]
    MissingFile { path: PathBuf },
    /// `supported` is the list the config module knows, given by it so that this module
    /// depends on no model types.
    #[error("unsupported architecture {architecture:?}: supported are {}", supported.join(", "))]
    UnsupportedArchitecture {
        architecture: String,
        supported: &'static [&'static str],
    },
    #[error(
        "unsupported rope_scaling type {rope_type:?}: supported are llama3, linear, longrope and default"
    )]
    UnsupportedRopeScaling { rope_type: String },
    #[error("unsupported dtype {dtype:?}: supported are f32, bf16 and f16")]
    UnsupportedDtype { dtype: String },
    #[error("invalid model config: {reason}")]
    InvalidConfig { reason: String },
    #[error("could not fetch {repo_id}@{revision} from the hub: {reason}")]
    Hub {
        repo_id: String,
        revision: String,
        reason: String,
    },
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("io error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("json error in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("kernel error: {0}")]
    Kernel(#[from] kernels::KernelError),
    #[error("out of KV blocks: needed {needed}, free {free}")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    #[error("sequence {seq_id} already exists")]
    DuplicateSequence { seq_id: SeqId },
    #[error("block {block_id} is not allocated")]
    BlockNotAllocated { block_id: BlockId },
    #[error("prompt of {num_tokens} tokens exceeds the limit of {limit} tokens")]
    PromptTooLong { num_tokens: usize, limit: usize },
    #[error("invalid parameter {field}: {reason} (given {given})")]
    InvalidParameter {
        field: &'static str,
        reason: String,
        given: String,
    },
    #[error("invalid cost profile {origin}: {reason}")]
    CostProfile { origin: String, reason: String },
    /// A constrained sequence's grammar failed mid-generation (its matcher hit a limit, or
    /// could not admit the sampled token): the sequence ends with this error, never with a
    /// token outside the grammar.
    #[error("sequence {seq_id}: the output can no longer follow the grammar: {reason}")]
    Grammar { seq_id: SeqId, reason: String },
    #[error("KV layout mismatch: expected {expected}, given {given}")]
    LayoutMismatch { expected: String, given: String },
    /// `--device cuda` in a build without the `cuda` feature; raised before any weight loads.
    #[error(
        "NotCompiledWithCuda: --device {device} needs a binary built with `--features cuda` \
         (this one runs on the CPU only; use --device cpu)"
    )]
    NotCompiledWithCuda { device: String },
}

pub type Result<T> = std::result::Result<T, EngineError>;
