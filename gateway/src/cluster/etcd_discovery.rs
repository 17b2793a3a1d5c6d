//! Membership from etcd: the `cluster` crate follows the registered nodes, decides which are
//! members (same model, KV layout and transport) and streams their changes; this adapter maps
//! each change to the pools' [`MemberChange`], publishes the membership's gauges, and follows
//! the nodes' published load.

use std::collections::BTreeSet;
use std::sync::Arc;

use cluster::{
    ClusterChange, ClusterError, DiscoveryConfig, EtcdConfig, EtcdDiscovery, LoadWatch, Loads,
    NodeRecord, Refusal,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::discovery::{Discovery, MemberChange, NodeEntry, Role};

pub struct EtcdMembers {
    discovery: Arc<EtcdDiscovery>,
    loads: watch::Receiver<Loads>,
    _load: LoadWatch,
    /// Stops the subscribers' forwarding tasks when the discovery is dropped.
    cancel: CancellationToken,
    _cancel_guard: DropGuard,
}

impl EtcdMembers {
    /// Starts following etcd. Returns at once; the members fill in when etcd answers.
    /// `expected_fingerprint` is the gateway's own model's, when it can compute one: nodes
    /// serving other weights are then never members.
    pub async fn start(
        etcd: EtcdConfig,
        expected_fingerprint: Option<String>,
    ) -> Result<EtcdMembers, ClusterError> {
        let mut config = DiscoveryConfig::new(etcd.clone());
        config.expected_fingerprint = expected_fingerprint;
        let discovery = Arc::new(EtcdDiscovery::start(config).await?);
        let load = LoadWatch::start(etcd).await?;
        let cancel = CancellationToken::new();
        tokio::spawn(count_nodes(
            discovery.members(),
            discovery.refused(),
            cancel.clone(),
        ));
        Ok(EtcdMembers {
            discovery,
            loads: load.loads(),
            _load: load,
            _cancel_guard: cancel.clone().drop_guard(),
            cancel,
        })
    }
}

impl Discovery for EtcdMembers {
    fn changes(&self) -> mpsc::UnboundedReceiver<MemberChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut upstream = self.discovery.subscribe();
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            loop {
                let change = tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tx.closed() => return,
                    change = upstream.recv() => change,
                };
                let Some(change) = change else { return };
                if tx.send(member_change(change)).is_err() {
                    return;
                }
            }
        });
        rx
    }

    fn loads(&self) -> Option<watch::Receiver<Loads>> {
        Some(self.loads.clone())
    }
}

fn member_change(change: ClusterChange) -> MemberChange {
    match change {
        ClusterChange::Add(r) => MemberChange::Add(entry(&r)),
        ClusterChange::Update(r) => MemberChange::Update(entry(&r)),
        ClusterChange::Remove { role, node_id } => MemberChange::Remove { role, node_id },
        ClusterChange::Lost { role, node_id } => MemberChange::Lost { role, node_id },
    }
}

fn entry(r: &NodeRecord) -> NodeEntry {
    NodeEntry {
        node_id: r.node_id.clone(),
        role: r.role,
        grpc_endpoint: r.grpc_endpoint.clone(),
        draining: r.draining,
        registered: true,
        block_size: r.kv_layout.block_size,
        total_kv_blocks: r.total_kv_blocks,
    }
}

/// Keeps `fission_gateway_cluster_nodes{role,state}` and
/// `fission_gateway_nodes_refused_total{role}` in step with the membership.
async fn count_nodes(
    mut members: watch::Receiver<cluster::Members>,
    mut refused: watch::Receiver<Arc<Vec<Refusal>>>,
    cancel: CancellationToken,
) {
    let mut counted: BTreeSet<(Role, String, String)> = BTreeSet::new();
    loop {
        let now: BTreeSet<(Role, String, String)> = refused
            .borrow_and_update()
            .iter()
            .map(|r| (r.record.role, r.record.node_id.clone(), r.reason.clone()))
            .collect();
        for (role, _, _) in now.difference(&counted) {
            metrics::counter!("fission_gateway_nodes_refused_total", "role" => role.as_str())
                .increment(1);
        }
        let members_now = members.borrow_and_update().clone();
        for role in [Role::Prefill, Role::Decode] {
            let of_role = members_now.iter().filter(|r| r.role == role);
            let draining = of_role.clone().filter(|r| r.draining).count();
            let serving = of_role.count() - draining;
            let refused_n = now.iter().filter(|(r, _, _)| *r == role).count();
            for (state, n) in [
                ("serving", serving),
                ("draining", draining),
                ("refused", refused_n),
            ] {
                metrics::gauge!("fission_gateway_cluster_nodes", "role" => role.as_str(), "state" => state)
                    .set(n as f64);
            }
        }
        counted = now;
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = members.changed() => if changed.is_err() { return },
            changed = refused.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use kv_types::{KvDtype, KvLayout};

    use super::*;

    #[test]
    fn changes_map_one_to_one_with_the_record_capacity() {
        let r = NodeRecord {
            node_id: "d".into(),
            role: Role::Decode,
            version: "0".into(),
            grpc_endpoint: "127.0.0.1:1".into(),
            kv_endpoint: "127.0.0.1:2".into(),
            model_id: "m".into(),
            model_fingerprint: "f".into(),
            kv_layout: KvLayout {
                dtype: KvDtype::F32,
                num_layers: 2,
                block_size: 16,
                num_kv_heads: 2,
                head_dim: 8,
            },
            total_kv_blocks: 10,
            kv_transport: "tcp".into(),
            draining: true,
        };
        match member_change(ClusterChange::Update(r)) {
            MemberChange::Update(e) => {
                assert_eq!((e.block_size, e.total_kv_blocks), (16, 10));
                assert!(e.draining && e.registered);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            member_change(ClusterChange::Remove {
                role: Role::Prefill,
                node_id: "p".into()
            }),
            MemberChange::Remove {
                role: Role::Prefill,
                node_id: "p".into()
            }
        );
    }
}
