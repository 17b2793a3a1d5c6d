//! Membership from etcd: the `cluster` crate's watch, narrowed to the nodes this gateway may
//! route to, plus the nodes' published load.
//!
//! A node is refused, with a log line saying why, when its model fingerprint differs from the
//! cluster's, or its KV layout or block size differs from the cluster's: KV computed by one
//! could not be read by another. The cluster's values are the gateway's own model fingerprint
//! when it can compute one from its model directory, and otherwise those of the first node
//! accepted; the layout is always pinned by the first node accepted.

use std::collections::HashMap;
use std::sync::Arc;

use cluster::{
    ClusterError, DiscoveryConfig, EtcdConfig, EtcdDiscovery, KvLayout, LoadWatch, Loads,
    NodeRecord,
};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::discovery::{Discovery, Members, NodeEntry, Role};

pub struct EtcdMembers {
    rx: watch::Receiver<Members>,
    loads: watch::Receiver<Loads>,
    _discovery: EtcdDiscovery,
    _load: LoadWatch,
    _task: DropGuard,
}

impl EtcdMembers {
    /// Starts following etcd. Returns at once; the members fill in when etcd answers.
    pub async fn start(
        etcd: EtcdConfig,
        expected_fingerprint: Option<String>,
    ) -> Result<EtcdMembers, ClusterError> {
        let discovery = EtcdDiscovery::start(DiscoveryConfig::new(etcd.clone())).await?;
        let load = LoadWatch::start(etcd).await?;
        let (tx, rx) = watch::channel(Members::default());
        let cancel = CancellationToken::new();
        let mut records = discovery.members();
        let task_cancel = cancel.clone();
        tokio::spawn(async move {
            let mut admission = Admission::new(expected_fingerprint);
            loop {
                let snapshot = records.borrow_and_update().clone();
                tx.send_replace(Arc::new(admission.admit(&snapshot)));
                tokio::select! {
                    _ = task_cancel.cancelled() => return,
                    changed = records.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(EtcdMembers {
            rx,
            loads: load.loads(),
            _discovery: discovery,
            _load: load,
            _task: cancel.drop_guard(),
        })
    }
}

impl Discovery for EtcdMembers {
    fn watch(&self) -> watch::Receiver<Members> {
        self.rx.clone()
    }

    fn loads(&self) -> Option<watch::Receiver<Loads>> {
        Some(self.loads.clone())
    }
}

/// Decides which registered nodes are members, pinning the cluster's model and layout.
struct Admission {
    fingerprint: Option<String>,
    layout: Option<(KvLayout, u32)>,
    /// Refusals already logged, so a refused node is reported once, not on every change.
    refused: HashMap<String, String>,
}

impl Admission {
    fn new(fingerprint: Option<String>) -> Self {
        Admission {
            fingerprint,
            layout: None,
            refused: HashMap::new(),
        }
    }

    fn admit(&mut self, records: &[NodeRecord]) -> Vec<NodeEntry> {
        let mut out = Vec::new();
        let mut refused_now = HashMap::new();
        for r in records {
            match self.check(r) {
                Ok(()) => out.push(entry(r)),
                Err(why) => {
                    if self.refused.get(&r.node_id) != Some(&why) {
                        tracing::warn!(node_id = %r.node_id, role = %r.role, model_id = %r.model_id, %why, "node refused by routing");
                        metrics::counter!("fission_gateway_nodes_refused_total", "role" => r.role.as_str()).increment(1);
                    }
                    refused_now.insert(r.node_id.clone(), why);
                }
            }
        }
        self.refused = refused_now;
        for role in [Role::Prefill, Role::Decode] {
            let (mut ready, mut draining) = (0, 0);
            for e in out.iter().filter(|e| e.role == role) {
                if e.draining {
                    draining += 1;
                } else {
                    ready += 1;
                }
            }
            metrics::gauge!("fission_gateway_cluster_nodes", "role" => role.as_str(), "state" => "serving").set(ready as f64);
            metrics::gauge!("fission_gateway_cluster_nodes", "role" => role.as_str(), "state" => "draining").set(draining as f64);
            let refused = self
                .refused
                .keys()
                .filter(|id| records.iter().any(|r| &r.node_id == *id && r.role == role))
                .count();
            metrics::gauge!("fission_gateway_cluster_nodes", "role" => role.as_str(), "state" => "refused").set(refused as f64);
        }
        out
    }

    fn check(&mut self, r: &NodeRecord) -> Result<(), String> {
        match &self.fingerprint {
            Some(f) if *f != r.model_fingerprint => {
                return Err(format!(
                    "model fingerprint {} (model {}) differs from the cluster's {f}",
                    r.model_fingerprint, r.model_id
                ))
            }
            Some(_) => {}
            None => self.fingerprint = Some(r.model_fingerprint.clone()),
        }
        let layout = (r.kv_layout.clone(), r.block_size);
        match &self.layout {
            Some(l) if *l != layout => Err(format!(
                "KV layout {:?} with block size {} differs from the cluster's {:?} with block size {}",
                r.kv_layout, r.block_size, l.0, l.1
            )),
            Some(_) => Ok(()),
            None => {
                self.layout = Some(layout);
                Ok(())
            }
        }
    }
}

fn entry(r: &NodeRecord) -> NodeEntry {
    NodeEntry {
        node_id: r.node_id.clone(),
        role: r.role,
        grpc_endpoint: r.grpc_endpoint.clone(),
        draining: r.draining,
        registered: true,
        block_size: r.block_size,
        total_kv_blocks: r.total_kv_blocks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, fingerprint: &str, head_dim: u32) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            role: cluster::Role::Decode,
            version: "0".into(),
            grpc_endpoint: "127.0.0.1:1".into(),
            kv_endpoint: "127.0.0.1:2".into(),
            model_id: "m".into(),
            model_fingerprint: fingerprint.into(),
            block_size: 16,
            kv_layout: KvLayout {
                dtype: "f32".into(),
                num_layers: 2,
                num_kv_heads: 2,
                head_dim,
            },
            total_kv_blocks: 10,
            draining: false,
        }
    }

    #[test]
    fn refuses_other_models_and_layouts() {
        let mut a = Admission::new(Some("f".into()));
        let got = a.admit(&[
            record("a", "f", 64),
            record("b", "g", 64),
            record("c", "f", 128),
        ]);
        let ids: Vec<&str> = got.iter().map(|e| e.node_id.as_str()).collect();
        assert_eq!(ids, vec!["a"]);
        assert!(a.refused["b"].contains("fingerprint"));
        assert!(a.refused["c"].contains("KV layout"));
    }

    #[test]
    fn without_a_fingerprint_the_first_node_pins_it() {
        let mut a = Admission::new(None);
        let got = a.admit(&[record("a", "f", 64), record("b", "g", 64)]);
        assert_eq!(got.len(), 1);
        assert_eq!(a.fingerprint.as_deref(), Some("f"));
    }
}
