//! Following the nodes' published load, and one-shot reads of the whole cluster for operators.
//!
//! Load lives under its own prefix so that membership watchers do not wake on every load put;
//! a router that wants both runs an [`EtcdDiscovery`](crate::EtcdDiscovery) and a [`LoadWatch`].

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Duration;

use etcd_client::{Event, EventType, GetOptions, KeyValue};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::error::ClusterError;
use crate::etcd::{call, EtcdConfig};
use crate::prefix_watch::{follow_prefix, PrefixFollower};
use crate::record::{key_identity, load_prefix, nodes_prefix, NodeKey, NodeLoad, NodeRecord};

/// Latest load by node (role and id).
pub type Loads = Arc<HashMap<NodeKey, NodeLoad>>;

/// Follows `/fission/{cluster}/load/`. Dropping it stops the watch task. While etcd is down the
/// last loads stay in place: stale load only skews a routing cost, it never routes to a node
/// that membership has removed.
pub struct LoadWatch {
    rx: watch::Receiver<Loads>,
    _task_guard: DropGuard,
}

impl LoadWatch {
    pub async fn start(etcd: EtcdConfig) -> Result<LoadWatch, ClusterError> {
        let client = etcd.connect().await?;
        let (tx, rx) = watch::channel(Loads::default());
        let cancel = CancellationToken::new();
        let prefix = load_prefix(&etcd.cluster);
        let follower = LoadFollower {
            loads: HashMap::new(),
            tx,
        };
        tokio::spawn(follow_prefix(
            client,
            etcd,
            prefix,
            follower,
            cancel.clone(),
        ));
        Ok(LoadWatch {
            rx,
            _task_guard: cancel.drop_guard(),
        })
    }

    pub fn loads(&self) -> watch::Receiver<Loads> {
        self.rx.clone()
    }
}

/// The loads under the load prefix, republished whole after every change.
struct LoadFollower {
    loads: HashMap<NodeKey, NodeLoad>,
    tx: watch::Sender<Loads>,
}

impl PrefixFollower for LoadFollower {
    fn reset(&mut self, kvs: &[KeyValue]) {
        self.loads = loads_of(kvs);
        self.tx.send_replace(Arc::new(self.loads.clone()));
    }

    fn apply(&mut self, events: &[Event]) {
        for event in events {
            let Some(kv) = event.kv() else { continue };
            let Some(id) = key_identity(kv.key()) else {
                continue;
            };
            match event.event_type() {
                EventType::Put => {
                    if let Ok(load) = serde_json::from_slice::<NodeLoad>(kv.value()) {
                        self.loads.insert(id, load);
                    }
                }
                EventType::Delete => {
                    self.loads.remove(&id);
                }
            }
        }
        self.tx.send_replace(Arc::new(self.loads.clone()));
    }

    fn interrupted(&self, prefix: &str, error: &ClusterError, retry_in: Duration) {
        tracing::debug!(%prefix, %error, retry_in_ms = retry_in.as_millis() as u64, "etcd load watch interrupted");
    }
}

/// The loads in a prefix read, by node; values that do not parse are skipped.
fn loads_of(kvs: &[KeyValue]) -> HashMap<NodeKey, NodeLoad> {
    kvs.iter()
        .filter_map(|kv| {
            Some((
                key_identity(kv.key())?,
                serde_json::from_slice(kv.value()).ok()?,
            ))
        })
        .collect()
}

/// One member as an operator sees it: the record and its last published load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    pub record: NodeRecord,
    pub load: Option<NodeLoad>,
    /// The lease the record lives under: it changes when the node registers again (after an
    /// etcd outage), which is how an operator tells a fresh registration from a stale one.
    pub lease_id: i64,
}

/// Reads every registered node and its load once, sorted by role then node id. Records that do
/// not parse are skipped with a warning.
pub async fn list_nodes(etcd: &EtcdConfig) -> Result<Vec<NodeStatus>, ClusterError> {
    let mut client = etcd.connect().await?;
    let timeout = etcd.request_timeout();
    let nodes = call(
        "get",
        timeout,
        client.get(
            nodes_prefix(&etcd.cluster),
            Some(GetOptions::new().with_prefix()),
        ),
    )
    .await?;
    let loads = call(
        "get",
        timeout,
        client.get(
            load_prefix(&etcd.cluster),
            Some(GetOptions::new().with_prefix()),
        ),
    )
    .await?;
    let loads = loads_of(loads.kvs());
    let mut out = Vec::new();
    for kv in nodes.kvs() {
        match serde_json::from_slice::<NodeRecord>(kv.value()) {
            Ok(record) => {
                let load = loads.get(&(record.role, record.node_id.clone())).copied();
                out.push(NodeStatus {
                    record,
                    load,
                    lease_id: kv.lease(),
                });
            }
            Err(error) => {
                tracing::warn!(key = %String::from_utf8_lossy(kv.key()), %error, "node record does not parse")
            }
        }
    }
    out.sort_by(|a, b| (a.record.role, &a.record.node_id).cmp(&(b.record.role, &b.record.node_id)));
    Ok(out)
}
