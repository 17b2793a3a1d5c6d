//! The inference engine: Llama-family models on candle, a paged KV cache with prefix caching,
//! a continuous-batching scheduler with chunked prefill, sampling and detokenization.
//!
//! The core is synchronous and does no networking (hub downloads at load time aside): services
//! drive [`Engine::step`] from their own thread. It must not depend on tonic, quinn or axum.

pub mod config;
pub mod cost;
pub mod detokenize;
pub mod device;
pub mod engine;
pub mod error;
pub mod generation;
pub mod gguf_weights;
pub mod ids;
pub mod kv;
pub mod loader;
pub mod model;
pub mod quantize;
pub mod sampling;
pub mod scheduler;
pub mod stopping;

pub use engine::{Completion, Engine, EngineConfig, EngineStats, Request, TokenEvent};
