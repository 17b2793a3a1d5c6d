//! How the gateway learns the cluster's members: static lists given on the command line, or
//! etcd ([`super::etcd_discovery`]). Either way the pools see one ordered stream of
//! [`MemberChange`]s, in the manner of quickwit's `ClusterChange` stream: the members present
//! at subscription arrive as `Add`s, then every later change follows.

use tokio::sync::mpsc;

/// A node's role, as the cluster crate names it (and etcd records spell it).
pub use cluster::Role;

/// A node's identity: ids are unique per role.
pub use cluster::NodeKey;

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

impl NodeEntry {
    pub fn key(&self) -> NodeKey {
        (self.role, self.node_id.clone())
    }
}

/// One change to the routable membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberChange {
    Add(NodeEntry),
    /// Same node, new record (draining, capacity, endpoint).
    Update(NodeEntry),
    Remove {
        role: Role,
        node_id: String,
    },
    /// The node's registration ended without a drain: its lease expired. It may be dead, or
    /// etcd may have lost it (an outage expires every lease at once); the pools keep it while
    /// it answers health checks.
    Lost {
        role: Role,
        node_id: String,
    },
}

pub trait Discovery: Send + Sync + 'static {
    /// Subscribes to the membership: the current members as `Add`s, then each change in
    /// order. The stream ends only when the discovery is dropped.
    fn changes(&self) -> mpsc::UnboundedReceiver<MemberChange>;

    /// The nodes' published load, when the discovery carries it.
    fn loads(&self) -> Option<tokio::sync::watch::Receiver<cluster::Loads>> {
        None
    }
}

/// A fixed membership given on the command line.
pub struct StaticDiscovery {
    nodes: Vec<NodeEntry>,
    // Subscribers' senders stay here: a closed stream would read as "the discovery is gone".
    subscribers: std::sync::Mutex<Vec<mpsc::UnboundedSender<MemberChange>>>,
}

impl StaticDiscovery {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        let entry = |role: Role, i: usize, ep: &String| NodeEntry {
            node_id: format!("{role}-{i}"),
            role,
            grpc_endpoint: ep.clone(),
            draining: false,
            registered: false,
            block_size: 0,
            total_kv_blocks: 0,
        };
        let nodes = prefill
            .iter()
            .enumerate()
            .map(|(i, ep)| entry(Role::Prefill, i, ep))
            .chain(
                decode
                    .iter()
                    .enumerate()
                    .map(|(i, ep)| entry(Role::Decode, i, ep)),
            )
            .collect();
        StaticDiscovery {
            nodes,
            subscribers: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Discovery for StaticDiscovery {
    fn changes(&self) -> mpsc::UnboundedReceiver<MemberChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        for n in &self.nodes {
            let _ = tx.send(MemberChange::Add(n.clone()));
        }
        self.subscribers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(tx);
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn static_members_arrive_as_adds_and_the_stream_stays_open() {
        let d = StaticDiscovery::new(&["p:1".into()], &["d:1".into(), "d:2".into()]);
        let mut rx = d.changes();
        let mut ids = Vec::new();
        for _ in 0..3 {
            match rx.recv().await.unwrap() {
                MemberChange::Add(e) => ids.push(e.key()),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            ids,
            vec![
                (Role::Prefill, "prefill-0".to_string()),
                (Role::Decode, "decode-0".to_string()),
                (Role::Decode, "decode-1".to_string()),
            ]
        );
        assert!(rx
            .try_recv()
            .is_err_and(|e| e == mpsc::error::TryRecvError::Empty));
    }
}
