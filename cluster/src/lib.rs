//! Cluster membership over etcd.
//!
//! A node keeps a [`NodeRecord`] alive under a lease through a [`Registration`] handle and
//! publishes its load under a separate key prefix; the gateway follows the members through
//! [`EtcdDiscovery`], as whole snapshots and as a [`ClusterChange`] stream. Which registered
//! nodes are members (same model, KV layout and transport) is decided here, once, for every
//! consumer.
//!
//! Key layout, for a cluster named `c`:
//! - `/fission/c/nodes/{role}/{node_id}`: the JSON [`NodeRecord`], attached to the node's lease.
//! - `/fission/c/load/{role}/{node_id}`: the JSON [`NodeLoad`], attached to the same lease.
//!
//! The connection to etcd can be TLS, with a client certificate, and authenticated as an etcd
//! user ([`EtcdSecurity`]); [`EtcdSecurityArgs`] are the flags for it that every process takes.
//!
//! This crate knows etcd and the record format only. It must not touch models, KV blocks or
//! request routing: consumers decide what a member means.

mod admission;
mod backoff;
mod discovery;
mod error;
mod etcd;
mod etcd_args;
mod etcd_security;
mod etcd_users;
mod fingerprint;
mod load;
mod local_etcd;
mod prefix_watch;
mod record;
mod registration;

pub use admission::Refusal;
pub use discovery::{ClusterChange, DiscoveryConfig, EtcdDiscovery, Members};
pub use error::ClusterError;
pub use etcd::EtcdConfig;
pub use etcd_args::EtcdSecurityArgs;
pub use etcd_security::{EtcdClientCert, EtcdCredentials, EtcdPassword, EtcdSecurity, EtcdTls};
pub use etcd_users::enable_etcd_auth;
pub use fingerprint::model_fingerprint;
pub use load::{list_nodes, LoadWatch, Loads, NodeStatus};
pub use local_etcd::{EtcdServerTls, LocalEtcd};
pub use record::{NodeKey, NodeLoad, NodeRecord, Role};
pub use registration::{Registration, RegistrationConfig};
