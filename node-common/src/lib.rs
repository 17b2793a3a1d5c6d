//! What prefill and decode nodes share: the node skeleton ([`node::serve`]) and its process
//! entry ([`launch`]), engine flags and loading (the embedded default model among them), the
//! engine thread's loop, the `Node` gRPC service (Info, Drain, CacheEvents), who may call
//! which method ([`access`]), the Prometheus endpoint, KV-transfer set-up, the conversions
//! between engine and wire types, membership and draining, how a failure is counted and
//! marked on its span, and the bounded stop of the gRPC server.
//!
//! Nothing here routes requests: that is the gateway's. Nothing here computes: that is the
//! engine's. A role crate only says what its service does.

pub mod access;
pub mod cache_events;
pub mod convert;
pub mod default_model;
pub mod engine_args;
pub mod engine_state;
pub mod engine_thread;
pub mod error;
pub mod etcd_status;
pub mod failure;
pub mod grpc;
pub mod kv;
pub mod launch;
pub mod membership;
pub mod metrics_http;
pub mod model_types;
pub mod node;
pub mod node_service;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;

pub use error::NodeError;
