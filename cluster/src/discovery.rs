//! Following the cluster's members (through [`follow_prefix`]): the accepted records as a
//! snapshot and as a change stream. The last known membership stays in place while etcd is
//! unreachable.

use std::collections::BTreeMap;
use std::sync::Arc;

use std::time::Duration;

use etcd_client::{Event, EventType, KeyValue};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::error::ClusterError;
use crate::etcd::EtcdConfig;
use crate::prefix_watch::{follow_prefix, PrefixFollower};
use crate::record::{nodes_prefix, KvLayout, NodeRecord, Role};

/// A membership snapshot, sorted by key (role, then node id).
pub type Members = Arc<Vec<NodeRecord>>;

/// One change to the membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterChange {
    Add(NodeRecord),
    Update(NodeRecord),
    Remove { role: Role, node_id: String },
}

/// Which records count as members. A record that fails the filter is logged and left out.
#[derive(Debug, Clone, Default)]
pub struct MembershipFilter {
    pub expected_fingerprint: Option<String>,
    pub expected_layout: Option<KvLayout>,
}

impl MembershipFilter {
    /// Why `record` is not a member, or `None` when it is.
    pub fn rejects(&self, record: &NodeRecord) -> Option<String> {
        if let Some(expected) = &self.expected_fingerprint {
            if &record.model_fingerprint != expected {
                return Some(format!(
                    "model_fingerprint {:?} differs from expected {:?}",
                    record.model_fingerprint, expected
                ));
            }
        }
        if let Some(expected) = &self.expected_layout {
            if &record.kv_layout != expected {
                return Some(format!(
                    "kv_layout {:?} differs from expected {:?}",
                    record.kv_layout, expected
                ));
            }
        }
        None
    }
}

/// What to follow.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    pub etcd: EtcdConfig,
    /// Follow one role only; `None` follows both.
    pub role: Option<Role>,
    pub filter: MembershipFilter,
    /// Capacity of the change broadcast; a receiver that falls further behind gets `Lagged`
    /// and should re-read [`EtcdDiscovery::members`].
    pub change_capacity: usize,
}

impl DiscoveryConfig {
    pub fn new(etcd: EtcdConfig) -> Self {
        DiscoveryConfig {
            etcd,
            role: None,
            filter: MembershipFilter::default(),
            change_capacity: 256,
        }
    }
}

/// Follows the members in etcd. Dropping it stops the watch task.
pub struct EtcdDiscovery {
    members_rx: watch::Receiver<Members>,
    changes_tx: broadcast::Sender<ClusterChange>,
    _task_guard: DropGuard,
}

impl EtcdDiscovery {
    /// Starts the watch task. Returns at once with an empty membership; the task fills it as
    /// soon as etcd answers, and keeps retrying while it does not.
    pub async fn start(config: DiscoveryConfig) -> Result<EtcdDiscovery, ClusterError> {
        let client = config.etcd.connect().await?;
        let (members_tx, members_rx) = watch::channel(Arc::new(Vec::new()));
        let (changes_tx, _) = broadcast::channel(config.change_capacity.max(1));
        let cancel = CancellationToken::new();
        let prefix = nodes_prefix(&config.etcd.cluster, config.role);
        let follower = MemberFollower {
            filter: config.filter,
            known: BTreeMap::new(),
            members_tx,
            changes_tx: changes_tx.clone(),
        };
        tokio::spawn(follow_prefix(
            client,
            config.etcd,
            prefix,
            follower,
            cancel.clone(),
        ));
        Ok(EtcdDiscovery {
            members_rx,
            changes_tx,
            _task_guard: cancel.drop_guard(),
        })
    }

    /// The whole membership, replaced on every change.
    pub fn members(&self) -> watch::Receiver<Members> {
        self.members_rx.clone()
    }

    /// Changes from now on. To start from a consistent view, subscribe first and then read
    /// [`EtcdDiscovery::members`]: a change may then appear in both, never in neither.
    pub fn subscribe(&self) -> broadcast::Receiver<ClusterChange> {
        self.changes_tx.subscribe()
    }
}

/// The accepted members under the nodes prefix.
struct MemberFollower {
    filter: MembershipFilter,
    /// Accepted members by key.
    known: BTreeMap<String, NodeRecord>,
    members_tx: watch::Sender<Members>,
    changes_tx: broadcast::Sender<ClusterChange>,
}

impl PrefixFollower for MemberFollower {
    fn reset(&mut self, kvs: &[KeyValue]) {
        let mut fresh = BTreeMap::new();
        for kv in kvs {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            if let Some(record) = self.accept(&key, kv.value()) {
                fresh.insert(key, record);
            }
        }
        let changes = diff(&self.known, &fresh);
        self.known = fresh;
        self.publish(changes);
        tracing::debug!(members = self.known.len(), "etcd members loaded");
    }

    fn apply(&mut self, events: &[Event]) {
        let mut changes = Vec::new();
        for event in events {
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let accepted = match event.event_type() {
                EventType::Put => self.accept(&key, kv.value()),
                EventType::Delete => None,
            };
            match (accepted, self.known.remove(&key)) {
                (Some(record), None) => {
                    changes.push(ClusterChange::Add(record.clone()));
                    self.known.insert(key, record);
                }
                (Some(record), Some(old)) => {
                    if record != old {
                        changes.push(ClusterChange::Update(record.clone()));
                    }
                    self.known.insert(key, record);
                }
                (None, Some(old)) => changes.push(ClusterChange::Remove {
                    role: old.role,
                    node_id: old.node_id,
                }),
                (None, None) => {}
            }
        }
        self.publish(changes);
    }

    fn interrupted(&self, prefix: &str, error: &ClusterError, retry_in: Duration) {
        tracing::warn!(
            %prefix,
            %error,
            members = self.known.len(),
            retry_in_ms = retry_in.as_millis() as u64,
            "etcd discovery interrupted, keeping the last known members"
        );
    }
}

impl MemberFollower {
    /// Parses and filters one record; `None` (with a warning) when it is not a member.
    fn accept(&self, key: &str, value: &[u8]) -> Option<NodeRecord> {
        let record: NodeRecord = match serde_json::from_slice(value) {
            Ok(record) => record,
            Err(error) => {
                tracing::warn!(%key, %error, "node record does not parse, ignoring it");
                return None;
            }
        };
        if let Some(why) = self.filter.rejects(&record) {
            tracing::warn!(node_id = %record.node_id, role = %record.role, %why, "node excluded from membership");
            return None;
        }
        Some(record)
    }

    fn publish(&self, changes: Vec<ClusterChange>) {
        if changes.is_empty() {
            return;
        }
        let members: Vec<NodeRecord> = self.known.values().cloned().collect();
        self.members_tx.send_replace(Arc::new(members));
        for change in changes {
            tracing::info!(?change, "cluster membership changed");
            // No receivers is fine: the snapshot above is the source of truth.
            let _ = self.changes_tx.send(change);
        }
    }
}

/// The changes that turn `old` into `new`.
fn diff(
    old: &BTreeMap<String, NodeRecord>,
    new: &BTreeMap<String, NodeRecord>,
) -> Vec<ClusterChange> {
    let mut changes = Vec::new();
    for (key, record) in new {
        match old.get(key) {
            None => changes.push(ClusterChange::Add(record.clone())),
            Some(prev) if prev != record => changes.push(ClusterChange::Update(record.clone())),
            Some(_) => {}
        }
    }
    for (key, record) in old {
        if !new.contains_key(key) {
            changes.push(ClusterChange::Remove {
                role: record.role,
                node_id: record.node_id.clone(),
            });
        }
    }
    changes
}

#[cfg(test)]
mod tests {
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
            block_size: 16,
            kv_layout: KvLayout {
                dtype: "f16".into(),
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 64,
            },
            total_kv_blocks: 10,
            kv_transport: "tcp".into(),
            draining: false,
        }
    }

    #[test]
    fn diff_reports_add_update_remove() {
        let mut old = BTreeMap::new();
        old.insert("a".to_string(), record("a", "f"));
        old.insert("b".to_string(), record("b", "f"));
        let mut new = BTreeMap::new();
        let mut b = record("b", "f");
        b.draining = true;
        new.insert("b".to_string(), b.clone());
        new.insert("c".to_string(), record("c", "f"));
        let changes = diff(&old, &new);
        assert_eq!(
            changes,
            vec![
                ClusterChange::Update(b),
                ClusterChange::Add(record("c", "f")),
                ClusterChange::Remove {
                    role: Role::Decode,
                    node_id: "a".into()
                },
            ]
        );
    }

    #[test]
    fn filter_names_the_mismatch() {
        let filter = MembershipFilter {
            expected_fingerprint: Some("f".into()),
            expected_layout: Some(record("x", "f").kv_layout),
        };
        assert!(filter.rejects(&record("a", "f")).is_none());
        let why = filter.rejects(&record("a", "g")).unwrap();
        assert!(why.contains("model_fingerprint"), "{why}");
        let mut other = record("a", "f");
        other.kv_layout.head_dim = 128;
        assert!(filter.rejects(&other).unwrap().contains("kv_layout"));
    }
}
