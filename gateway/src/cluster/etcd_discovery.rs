//! Membership from etcd: the `cluster` crate follows the registered nodes, decides which are
//! members (same model, KV layout and transport) and streams their changes, which the pools
//! read as they are; this adds the membership's gauges and the nodes' published load.

use std::collections::BTreeSet;
use std::sync::Arc;

use cluster::{
    ClusterChange, ClusterError, DiscoveryConfig, EtcdConfig, EtcdDiscovery, LoadWatch, Loads,
    Refusal,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::discovery::{Discovery, Role};

pub struct EtcdMembers {
    discovery: EtcdDiscovery,
    loads: watch::Receiver<Loads>,
    _load: LoadWatch,
    /// Stops the gauges' task when the discovery is dropped.
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
        let discovery = EtcdDiscovery::start(config).await?;
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
            _cancel_guard: cancel.drop_guard(),
        })
    }
}

impl Discovery for EtcdMembers {
    fn changes(&self) -> mpsc::UnboundedReceiver<ClusterChange> {
        self.discovery.subscribe()
    }

    fn registered(&self) -> bool {
        true
    }

    fn loads(&self) -> Option<watch::Receiver<Loads>> {
        Some(self.loads.clone())
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
