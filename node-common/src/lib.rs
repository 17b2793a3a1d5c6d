//! What prefill and decode nodes share: engine flags and loading, the Prometheus endpoint,
//! KV-transfer set-up and the conversions between engine and wire types.
//!
//! Nothing here routes requests: that is the gateway's. Nothing here computes: that is the
//! engine's.

pub mod cache_events;
pub mod convert;
pub mod engine_args;
pub mod engine_state;
pub mod error;
pub mod kv;
pub mod membership;
pub mod metrics_http;
mod process;

pub use error::NodeError;
pub use process::{init_process, spawn_signal_handler};
