//! Routing to prefill and decode nodes over gRPC: discovery, live pools, routing policies and
//! the backend.

pub mod backend;
mod calls;
mod cancel;
pub mod discovery;
pub mod etcd_discovery;
#[cfg(test)]
mod fake_nodes;
pub mod pool;
pub mod prefix_index;
mod resume;
mod retry;
mod route;
pub mod routing;
mod wire;

pub use backend::{ClusterBackend, ClusterConfig};
pub use discovery::{Discovery, NodeEntry, Role, StaticDiscovery};
pub use etcd_discovery::EtcdMembers;
pub use pool::Pools;
pub use routing::{policy, PolicyKind, RoutingPolicy};
