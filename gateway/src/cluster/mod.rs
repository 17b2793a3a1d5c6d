//! Routing to prefill and decode nodes over gRPC: discovery, live pools, routing policies and
//! the backend.

pub mod backend;
mod config;
pub mod discovery;
mod driver;
#[cfg(test)]
mod driver_tests;
pub mod etcd_discovery;
#[cfg(test)]
mod fake_nodes;
#[cfg(test)]
mod first_token_tests;
mod health;
#[cfg(test)]
mod pair_tests;
pub mod pairs;
mod placement;
pub mod pool;
pub mod prefix_index;
mod rank;
mod retry;
mod route;
pub mod routing;
mod wire;

pub use backend::ClusterBackend;
pub use config::ClusterConfig;
pub use discovery::{Discovery, Role, StaticDiscovery};
pub use etcd_discovery::EtcdMembers;
pub use pool::Pools;
pub use routing::{policy, PolicyKind, RoutingPolicy};
