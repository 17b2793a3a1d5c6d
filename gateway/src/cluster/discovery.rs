//! How the gateway learns the cluster's members: static lists given on the command line, or
//! etcd ([`super::etcd_discovery`]). Consumers watch whole membership snapshots, so a slow
//! reader never misses a removal.

use std::sync::Arc;

use tokio::sync::watch;

/// A node's role, as the cluster crate names it (and etcd records spell it).
pub use cluster::Role;

/// One node as discovery knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry {
    pub node_id: String,
    pub role: Role,
    /// `host:port` of the node's gRPC server.
    pub grpc_endpoint: String,
    /// A draining node takes no new requests.
    pub draining: bool,
    /// A registered node (etcd) serves from the moment it appears; a static one is probed
    /// with `Info` until it answers.
    pub registered: bool,
    /// Tokens per KV block and total blocks, when the registration says (0 when unknown).
    pub block_size: u32,
    pub total_kv_blocks: u64,
}

pub type Members = Arc<Vec<NodeEntry>>;

pub trait Discovery: Send + Sync + 'static {
    /// The current members, updated in place as the cluster changes.
    fn watch(&self) -> watch::Receiver<Members>;

    /// The nodes' published load by node id, when the discovery carries it.
    fn loads(&self) -> Option<watch::Receiver<cluster::Loads>> {
        None
    }
}

/// A fixed membership given on the command line.
pub struct StaticDiscovery {
    rx: watch::Receiver<Members>,
    // Keeps the channel open: a closed channel would read as "no more updates" forever.
    _tx: watch::Sender<Members>,
}

impl StaticDiscovery {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        let mut nodes = Vec::new();
        for (i, ep) in prefill.iter().enumerate() {
            nodes.push(NodeEntry {
                node_id: format!("prefill-{i}"),
                role: Role::Prefill,
                grpc_endpoint: ep.clone(),
                draining: false,
                registered: false,
                block_size: 0,
                total_kv_blocks: 0,
            });
        }
        for (i, ep) in decode.iter().enumerate() {
            nodes.push(NodeEntry {
                node_id: format!("decode-{i}"),
                role: Role::Decode,
                grpc_endpoint: ep.clone(),
                draining: false,
                registered: false,
                block_size: 0,
                total_kv_blocks: 0,
            });
        }
        let (tx, rx) = watch::channel(Arc::new(nodes));
        StaticDiscovery { rx, _tx: tx }
    }
}

impl Discovery for StaticDiscovery {
    fn watch(&self) -> watch::Receiver<Members> {
        self.rx.clone()
    }
}
