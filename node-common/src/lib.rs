//! What prefill and decode nodes share: engine flags and loading, the Prometheus endpoint,
//! KV-transfer set-up, the conversions between engine and wire types, how a failure is counted
//! and marked on its span, and the bounded stop of the gRPC server.
//!
//! Nothing here routes requests: that is the gateway's. Nothing here computes: that is the
//! engine's.

pub mod cache_events;
pub mod convert;
pub mod engine_args;
pub mod engine_state;
pub mod error;
pub mod failure;
pub mod grpc;
pub mod kv;
pub mod membership;
pub mod metrics_http;
mod process;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;

pub use error::NodeError;
pub use process::{init_process, spawn_signal_handler};
