//! Routing to prefill and decode nodes over gRPC: discovery, live pools and the backend.

pub mod backend;
pub mod discovery;
pub mod pool;

pub use backend::{ClusterBackend, ClusterConfig};
pub use discovery::{Discovery, NodeEntry, Role, StaticDiscovery};
pub use pool::Pools;
