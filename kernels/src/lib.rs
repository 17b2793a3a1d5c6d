//! Paged attention and KV block copies, in portable Rust for CPU (CUDA comes behind the `cuda` feature).
//!
//! This crate knows byte layouts and block ids only: it must not depend on models, tokenizers or networking.

mod error;
mod layout;

pub use error::KernelError;
pub use layout::{KvDtype, KvLayout};
