//! Following the cluster's members (through [`follow_prefix`]): every registered record is
//! read, [`Admission`] decides which are members, and the members are published as a snapshot
//! and as a [`ClusterChange`] stream. The last known membership stays in place while etcd is
//! unreachable.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Event, EventType, KeyValue};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::admission::{Admission, Refusal};
use crate::error::ClusterError;
use crate::etcd::EtcdConfig;
use crate::prefix_watch::{follow_prefix, PrefixFollower};
use crate::record::{key_identity, nodes_prefix, NodeKey, NodeRecord, Role};

/// A membership snapshot, sorted by key (role, then node id).
pub type Members = Arc<Vec<NodeRecord>>;

/// One change to the membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterChange {
    Add(NodeRecord),
    /// Same node, new record (draining, capacity, endpoint).
    Update(NodeRecord),
    /// The node left in order (it drained and deregistered), or is no longer admitted.
    Remove {
        role: Role,
        node_id: String,
    },
    /// The node's registration vanished without a drain: its lease expired. Either it died,
    /// or etcd lost every lease at once (an outage); a follower should check it before it
    /// drops it.
    Lost {
        role: Role,
        node_id: String,
    },
}

/// What to follow: every node of the cluster, both roles.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    pub etcd: EtcdConfig,
    /// The model every member must serve, when the follower knows it (a gateway with the
    /// weights); otherwise the model most registered nodes serve. See [`crate::admission`].
    pub expected_fingerprint: Option<String>,
}

impl DiscoveryConfig {
    pub fn new(etcd: EtcdConfig) -> Self {
        DiscoveryConfig {
            etcd,
            expected_fingerprint: None,
        }
    }
}

/// The admitted members and the subscribers to their changes, updated together so that a new
/// subscriber's snapshot and the changes after it neither overlap nor leave a gap.
#[derive(Default)]
struct Published {
    members: BTreeMap<NodeKey, NodeRecord>,
    // Unbounded: membership changes are few and small, and a subscriber must never lose one
    // (a lost Remove would keep routing to a node that is gone).
    subscribers: Vec<mpsc::UnboundedSender<ClusterChange>>,
}

/// Follows the members in etcd. Dropping it stops the watch task.
pub struct EtcdDiscovery {
    published: Arc<Mutex<Published>>,
    members_rx: watch::Receiver<Members>,
    refused_rx: watch::Receiver<Arc<Vec<Refusal>>>,
    _task_guard: DropGuard,
}

impl EtcdDiscovery {
    /// Starts the watch task. Returns at once with an empty membership; the task fills it as
    /// soon as etcd answers, and keeps retrying while it does not.
    pub async fn start(config: DiscoveryConfig) -> Result<EtcdDiscovery, ClusterError> {
        let client = config.etcd.connect().await?;
        let (members_tx, members_rx) = watch::channel(Arc::new(Vec::new()));
        let (refused_tx, refused_rx) = watch::channel(Arc::new(Vec::new()));
        let published = Arc::new(Mutex::new(Published::default()));
        let cancel = CancellationToken::new();
        let prefix = nodes_prefix(&config.etcd.cluster);
        let follower = MemberFollower {
            registered: BTreeMap::new(),
            admission: Admission::new(config.expected_fingerprint),
            published: Arc::clone(&published),
            members_tx,
            refused_tx,
        };
        tokio::spawn(follow_prefix(
            client,
            config.etcd,
            prefix,
            follower,
            cancel.clone(),
        ));
        Ok(EtcdDiscovery {
            published,
            members_rx,
            refused_rx,
            _task_guard: cancel.drop_guard(),
        })
    }

    /// The whole membership, replaced on every change.
    pub fn members(&self) -> watch::Receiver<Members> {
        self.members_rx.clone()
    }

    /// The registered nodes that are not members, and why; replaced on every change.
    pub fn refused(&self) -> watch::Receiver<Arc<Vec<Refusal>>> {
        self.refused_rx.clone()
    }

    /// The members now, as `Add`s, then every later change in order. The stream ends when the
    /// discovery is dropped.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<ClusterChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut published = lock(&self.published);
        for r in published.members.values() {
            let _ = tx.send(ClusterChange::Add(r.clone()));
        }
        published.subscribers.push(tx);
        rx
    }
}

fn lock(p: &Mutex<Published>) -> std::sync::MutexGuard<'_, Published> {
    // Nothing panics while holding it; if something did, the map is still whole.
    p.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every registered record under the nodes prefix, and the members among them.
struct MemberFollower {
    registered: BTreeMap<NodeKey, NodeRecord>,
    admission: Admission,
    published: Arc<Mutex<Published>>,
    members_tx: watch::Sender<Members>,
    refused_tx: watch::Sender<Arc<Vec<Refusal>>>,
}

impl PrefixFollower for MemberFollower {
    fn reset(&mut self, kvs: &[KeyValue]) {
        self.registered = kvs
            .iter()
            .filter_map(|kv| parse(kv.key(), kv.value()))
            .map(|r| (r.key(), r))
            .collect();
        self.publish();
        tracing::debug!(registered = self.registered.len(), "etcd members loaded");
    }

    fn apply(&mut self, events: &[Event]) {
        for event in events {
            let Some(kv) = event.kv() else { continue };
            let Some(id) = key_identity(kv.key()) else {
                continue;
            };
            let record = match event.event_type() {
                EventType::Put => parse(kv.key(), kv.value()),
                EventType::Delete => None,
            };
            match record {
                Some(r) => self.registered.insert(id, r),
                None => self.registered.remove(&id),
            };
        }
        self.publish();
    }

    fn interrupted(&self, prefix: &str, error: &ClusterError, retry_in: Duration) {
        tracing::warn!(
            %prefix,
            %error,
            members = self.members_tx.borrow().len(),
            retry_in_ms = retry_in.as_millis() as u64,
            "etcd discovery interrupted, keeping the last known members"
        );
    }
}

/// One record; `None` (with a warning) when it does not parse.
fn parse(key: &[u8], value: &[u8]) -> Option<NodeRecord> {
    match serde_json::from_slice(value) {
        Ok(record) => Some(record),
        Err(error) => {
            let key = String::from_utf8_lossy(key);
            tracing::warn!(%key, %error, "node record does not parse, ignoring it");
            None
        }
    }
}

impl MemberFollower {
    /// Re-admits, then sends the members' changes to every subscriber.
    fn publish(&mut self) {
        let members = self.admission.admit(&self.registered);
        let refused: Vec<Refusal> = self.admission.refused().cloned().collect();
        if **self.refused_tx.borrow() != refused {
            self.refused_tx.send_replace(Arc::new(refused));
        }
        let mut published = lock(&self.published);
        let changes = diff(&published.members, &members, &self.registered);
        if changes.is_empty() {
            return;
        }
        published.members = members;
        self.members_tx
            .send_replace(Arc::new(published.members.values().cloned().collect()));
        for change in changes {
            tracing::info!(?change, "cluster membership changed");
            published
                .subscribers
                .retain(|tx| tx.send(change.clone()).is_ok());
        }
    }
}

/// The changes that turn `old` into `new`: adds and updates in key order, then removals. A
/// member gone from `registered` too, whose last record was not draining, is lost, not removed.
fn diff(
    old: &BTreeMap<NodeKey, NodeRecord>,
    new: &BTreeMap<NodeKey, NodeRecord>,
    registered: &BTreeMap<NodeKey, NodeRecord>,
) -> Vec<ClusterChange> {
    let mut changes = Vec::new();
    for (key, record) in new {
        match old.get(key) {
            None => changes.push(ClusterChange::Add(record.clone())),
            Some(prev) if prev != record => changes.push(ClusterChange::Update(record.clone())),
            Some(_) => {}
        }
    }
    for (key, last) in old {
        if new.contains_key(key) {
            continue;
        }
        let (role, node_id) = (key.0, key.1.clone());
        changes.push(if registered.contains_key(key) || last.draining {
            ClusterChange::Remove { role, node_id }
        } else {
            ClusterChange::Lost { role, node_id }
        });
    }
    changes
}

#[cfg(test)]
mod tests {
    use kv_types::{KvDtype, KvLayout};

    use super::*;

    fn record(id: &str, fingerprint: &str) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            role: Role::Decode,
            version: "0.1.0".into(),
            grpc_endpoint: "127.0.0.1:1".into(),
            kv_endpoint: "127.0.0.1:2".into(),
            model_id: "m".into(),
            model_fingerprint: fingerprint.into(),
            kv_layout: KvLayout {
                dtype: KvDtype::F16,
                num_layers: 2,
                block_size: 16,
                num_kv_heads: 2,
                head_dim: 64,
                windows: Default::default(),
            },
            total_kv_blocks: 10,
            kv_transport: "tcp".into(),
            host_id: String::new(),
            architecture: String::new(),
            weight_dtype: String::new(),
            draining: false,
        }
    }

    fn map(rs: &[NodeRecord]) -> BTreeMap<NodeKey, NodeRecord> {
        rs.iter().map(|r| (r.key(), r.clone())).collect()
    }

    #[test]
    fn diff_reports_add_update_remove_and_lost() {
        let mut drained = record("d", "f");
        drained.draining = true;
        let old = map(&[
            record("a", "f"),
            record("b", "f"),
            drained,
            record("odd", "f"),
        ]);
        let mut b = record("b", "f");
        b.draining = true;
        let new = map(&[b.clone(), record("c", "f")]);
        // "odd" is still registered (no longer admitted); "a" and "d" are gone from etcd.
        let registered = map(&[b.clone(), record("c", "f"), record("odd", "g")]);
        let gone = |id: &str| (Role::Decode, id.to_string());
        assert_eq!(
            diff(&old, &new, &registered),
            vec![
                ClusterChange::Update(b),
                ClusterChange::Add(record("c", "f")),
                // No drain before its key vanished: a lapsed lease.
                ClusterChange::Lost {
                    role: gone("a").0,
                    node_id: gone("a").1
                },
                // Drained, then deregistered.
                ClusterChange::Remove {
                    role: gone("d").0,
                    node_id: gone("d").1
                },
                ClusterChange::Remove {
                    role: gone("odd").0,
                    node_id: gone("odd").1
                },
            ]
        );
        assert!(diff(&new, &new, &registered).is_empty());
    }

    #[test]
    fn a_subscriber_gets_the_members_then_each_change_once() {
        let (members_tx, _) = watch::channel(Arc::new(Vec::new()));
        let (refused_tx, _) = watch::channel(Arc::new(Vec::new()));
        let published = Arc::new(Mutex::new(Published::default()));
        let mut follower = MemberFollower {
            registered: map(&[record("a", "f"), record("odd", "g"), record("b", "f")]),
            admission: Admission::new(Some("f".into())),
            published: Arc::clone(&published),
            members_tx,
            refused_tx: refused_tx.clone(),
        };
        follower.publish();
        let (tx, mut rx) = mpsc::unbounded_channel();
        for r in lock(&published).members.values() {
            tx.send(ClusterChange::Add(r.clone())).unwrap();
        }
        lock(&published).subscribers.push(tx);
        follower.registered.remove(&(Role::Decode, "a".to_string()));
        follower.publish();
        let mut got = Vec::new();
        while let Ok(c) = rx.try_recv() {
            got.push(c);
        }
        assert_eq!(
            got,
            vec![
                ClusterChange::Add(record("a", "f")),
                ClusterChange::Add(record("b", "f")),
                ClusterChange::Lost {
                    role: Role::Decode,
                    node_id: "a".into()
                },
            ]
        );
        let refused = refused_tx.borrow();
        assert_eq!(refused.len(), 1);
        assert!(refused[0].reason.contains("fingerprint"), "{refused:?}");
    }
}
