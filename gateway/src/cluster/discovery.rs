//! How the gateway learns the cluster's members: static lists given on the command line, or
//! etcd ([`super::etcd_discovery`]). Either way the pools read the `cluster` crate's one
//! ordered stream of [`ClusterChange`]s, in the manner of quickwit's `ClusterChange` stream:
//! the members present at subscription arrive as `Add`s, then every later change follows.

use cluster::{ClusterChange, Loads, NodeRecord};
use kv_types::{KvDtype, KvLayout};
use tokio::sync::{mpsc, watch};

/// A node's role and identity (ids are unique per role), as the cluster crate names them.
pub use cluster::{NodeKey, Role};

pub trait Discovery: Send + Sync + 'static {
    /// Subscribes to the membership: the current members as `Add`s, then each change in
    /// order. The stream ends only when the discovery is dropped.
    fn changes(&self) -> mpsc::UnboundedReceiver<ClusterChange>;

    /// Whether the members registered themselves (etcd): such a node serves from the moment
    /// it appears. Other members are probed with `Info` until they answer.
    fn registered(&self) -> bool;

    /// The nodes' published load, when the discovery carries it.
    fn loads(&self) -> Option<watch::Receiver<Loads>> {
        None
    }
}

/// A fixed membership given on the command line.
pub struct StaticDiscovery {
    nodes: Vec<NodeRecord>,
    // Subscribers' senders stay here: a closed stream would read as "the discovery is gone".
    subscribers: std::sync::Mutex<Vec<mpsc::UnboundedSender<ClusterChange>>>,
}

impl StaticDiscovery {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        let nodes = prefill
            .iter()
            .enumerate()
            .map(|(i, ep)| static_record(Role::Prefill, i, ep))
            .chain(
                decode
                    .iter()
                    .enumerate()
                    .map(|(i, ep)| static_record(Role::Decode, i, ep)),
            )
            .collect();
        StaticDiscovery {
            nodes,
            subscribers: std::sync::Mutex::new(Vec::new()),
        }
    }
}

/// What the command line says of a static member: its role and endpoint, under an id made
/// from its place in the list. The rest is unknown (empty, and zero blocks of zero tokens)
/// until the node answers `Info`, which the pools read it from.
fn static_record(role: Role, i: usize, grpc_endpoint: &str) -> NodeRecord {
    NodeRecord {
        node_id: format!("{role}-{i}"),
        role,
        version: String::new(),
        grpc_endpoint: grpc_endpoint.to_string(),
        kv_endpoint: String::new(),
        model_id: String::new(),
        model_fingerprint: String::new(),
        kv_layout: KvLayout {
            dtype: KvDtype::F32,
            num_layers: 0,
            block_size: 0,
            num_kv_heads: 0,
            head_dim: 0,
            windows: Default::default(),
        },
        total_kv_blocks: 0,
        kv_transport: String::new(),
        host_id: String::new(),
        architecture: String::new(),
        weight_dtype: String::new(),
        draining: false,
    }
}

impl Discovery for StaticDiscovery {
    fn changes(&self) -> mpsc::UnboundedReceiver<ClusterChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        for n in &self.nodes {
            let _ = tx.send(ClusterChange::Add(n.clone()));
        }
        self.subscribers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(tx);
        rx
    }

    fn registered(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn static_members_arrive_as_adds_and_the_stream_stays_open() {
        let d = StaticDiscovery::new(&["p:1".into()], &["d:1".into(), "d:2".into()]);
        let mut rx = d.changes();
        let mut got = Vec::new();
        for _ in 0..3 {
            match rx.recv().await.unwrap() {
                ClusterChange::Add(r) => got.push((r.key(), r.grpc_endpoint)),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            got,
            vec![
                ((Role::Prefill, "prefill-0".to_string()), "p:1".to_string()),
                ((Role::Decode, "decode-0".to_string()), "d:1".to_string()),
                ((Role::Decode, "decode-1".to_string()), "d:2".to_string()),
            ]
        );
        assert!(rx
            .try_recv()
            .is_err_and(|e| e == mpsc::error::TryRecvError::Empty));
        assert!(!d.registered());
    }
}
