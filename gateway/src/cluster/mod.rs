//! Routing to prefill and decode nodes over gRPC: discovery, live pools, routing policies and
//! the backend.

pub mod backend;
pub mod discovery;
pub mod etcd_discovery;
pub mod pool;
pub mod prefix_index;
pub mod routing;

pub use backend::{ClusterBackend, ClusterConfig};
pub use discovery::{Discovery, NodeEntry, Role, StaticDiscovery};
pub use etcd_discovery::EtcdMembers;
pub use pool::Pools;
pub use routing::{policy, PolicyKind, RoutingPolicy};
