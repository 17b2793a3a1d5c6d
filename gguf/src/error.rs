//! The crate's one error type. Messages name the key, tensor, limit and given value.

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("not a GGUF file: magic {:?} ({found:#010x}), expected \"GGUF\"", String::from_utf8_lossy(&found.to_le_bytes()))]
    BadMagic { found: u32 },
    #[error("GGUF version {version} is not supported (2 and 3 are)")]
    UnsupportedVersion { version: u32 },
    #[error("GGUF file truncated: {what} needs {needed} bytes at offset {offset}, the file has {file_len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    #[error("GGUF {what} {given} exceeds the limit of {max}")]
    TooLarge { what: String, given: u64, max: u64 },
    #[error("GGUF tensor {name:?}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("GGUF tensor {name:?} has type {type_name}, which is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K are)")]
    UnsupportedType {
        name: String,
        type_id: u32,
        type_name: String,
    },
    #[error("GGUF metadata {key:?}: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("GGUF metadata has no {key:?}")]
    MissingMetadata { key: String },
    #[error(
        "GGUF architecture {architecture:?} is not supported (llama, mistral, qwen2 and qwen3 are)"
    )]
    UnsupportedArchitecture { architecture: String },
    #[error("GGUF tokenizer: {0}")]
    Tokenizer(String),
    #[error("reading the GGUF file: {0}")]
    Read(#[source] std::io::Error),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("GGUF tensor data: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, GgufError>;
