//! Membership from etcd: the `cluster` crate's [`ClusterChange`] stream, narrowed to the nodes
//! this gateway may route to, plus the nodes' published load.
//!
//! A node is refused, with a log line saying why, when its model fingerprint, KV layout, block
//! size or KV transport differs from the cluster's: KV computed by one could not be read by
//! another, or could not even reach it. The cluster's model is the gateway's own fingerprint
//! when it can compute one from its model directory. The rest (and the model, when the gateway
//! has no weights) is the profile most registered nodes share; the current profile stays while
//! any node holds it and no other profile is held by more, so one misconfigured node can
//! neither take over a running cluster nor pin a fresh one for good.

use std::collections::BTreeMap;
use std::sync::Arc;

use cluster::{
    ClusterChange, ClusterError, DiscoveryConfig, EtcdConfig, EtcdDiscovery, KvLayout, LoadWatch,
    Loads, NodeRecord,
};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::discovery::{diff, Discovery, MemberChange, NodeEntry, NodeKey, Role};

pub struct EtcdMembers {
    discovery: Arc<EtcdDiscovery>,
    loads: watch::Receiver<Loads>,
    expected_fingerprint: Option<String>,
    _load: LoadWatch,
    /// Stops the subscribers' admission tasks when the discovery is dropped.
    cancel: CancellationToken,
    _cancel_guard: DropGuard,
}

impl EtcdMembers {
    /// Starts following etcd. Returns at once; the members fill in when etcd answers.
    pub async fn start(
        etcd: EtcdConfig,
        expected_fingerprint: Option<String>,
    ) -> Result<EtcdMembers, ClusterError> {
        let discovery = EtcdDiscovery::start(DiscoveryConfig::new(etcd.clone())).await?;
        let load = LoadWatch::start(etcd).await?;
        let cancel = CancellationToken::new();
        Ok(EtcdMembers {
            discovery: Arc::new(discovery),
            loads: load.loads(),
            expected_fingerprint,
            _load: load,
            _cancel_guard: cancel.clone().drop_guard(),
            cancel,
        })
    }
}

impl Discovery for EtcdMembers {
    fn changes(&self) -> mpsc::UnboundedReceiver<MemberChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        // Subscribe before reading the snapshot: a change may then be seen twice (harmless,
        // records are keyed), never missed.
        let upstream = self.discovery.subscribe();
        let records: BTreeMap<NodeKey, NodeRecord> = keyed(&self.discovery.members().borrow());
        tokio::spawn(follow(
            Arc::clone(&self.discovery),
            upstream,
            records,
            Admission::new(self.expected_fingerprint.clone()),
            tx,
            self.cancel.clone(),
        ));
        rx
    }

    fn loads(&self) -> Option<watch::Receiver<Loads>> {
        Some(self.loads.clone())
    }
}

fn keyed(records: &[NodeRecord]) -> BTreeMap<NodeKey, NodeRecord> {
    records
        .iter()
        .map(|r| ((r.role, r.node_id.clone()), r.clone()))
        .collect()
}

/// Applies etcd's changes to the registered records, re-admits, and sends the admitted
/// membership's changes until the subscriber or the discovery goes away.
async fn follow(
    discovery: Arc<EtcdDiscovery>,
    mut upstream: broadcast::Receiver<ClusterChange>,
    mut records: BTreeMap<NodeKey, NodeRecord>,
    mut admission: Admission,
    tx: mpsc::UnboundedSender<MemberChange>,
    cancel: CancellationToken,
) {
    let mut admitted = BTreeMap::new();
    loop {
        let now = admission.admit(&records);
        for change in diff(&admitted, &now) {
            if tx.send(change).is_err() {
                return;
            }
        }
        admitted = now;
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tx.closed() => return,
            msg = upstream.recv() => msg,
        };
        match msg {
            Ok(ClusterChange::Add(r)) | Ok(ClusterChange::Update(r)) => {
                records.insert((r.role, r.node_id.clone()), r);
            }
            Ok(ClusterChange::Remove { role, node_id }) => {
                records.remove(&(role, node_id));
            }
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                tracing::info!(
                    missed,
                    "membership changes lagged; resyncing from the snapshot"
                );
                records = keyed(&discovery.members().borrow());
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// What two nodes must share to exchange KV.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Profile {
    fingerprint: String,
    layout: KvLayout,
    block_size: u32,
    kv_transport: String,
}

impl Profile {
    fn of(r: &NodeRecord) -> Profile {
        Profile {
            fingerprint: r.model_fingerprint.clone(),
            layout: r.kv_layout.clone(),
            block_size: r.block_size,
            kv_transport: r.kv_transport.clone(),
        }
    }

    /// Why a node with profile `other` cannot join a cluster with this one.
    fn mismatch(&self, other: &Profile, model_id: &str) -> String {
        let mut why = Vec::new();
        if other.fingerprint != self.fingerprint {
            why.push(format!(
                "model fingerprint {} (model {model_id}) differs from the cluster's {}",
                other.fingerprint, self.fingerprint
            ));
        }
        if other.layout != self.layout || other.block_size != self.block_size {
            why.push(format!(
                "KV layout {:?} with block size {} differs from the cluster's {:?} with block size {}",
                other.layout, other.block_size, self.layout, self.block_size
            ));
        }
        if other.kv_transport != self.kv_transport {
            why.push(format!(
                "KV transport {:?} differs from the cluster's {:?}",
                other.kv_transport, self.kv_transport
            ));
        }
        why.join("; ")
    }
}

/// Decides which registered nodes are members; see the module docs.
struct Admission {
    fingerprint: Option<String>,
    profile: Option<Profile>,
    /// Refusals already logged, so a refused node is reported once, not on every change.
    refused: BTreeMap<NodeKey, String>,
}

impl Admission {
    fn new(fingerprint: Option<String>) -> Self {
        Admission {
            fingerprint,
            profile: None,
            refused: BTreeMap::new(),
        }
    }

    fn admit(&mut self, records: &BTreeMap<NodeKey, NodeRecord>) -> BTreeMap<NodeKey, NodeEntry> {
        self.choose_profile(records);
        let mut out = BTreeMap::new();
        let mut refused_now = BTreeMap::new();
        for (key, r) in records {
            match self.check(r) {
                Ok(()) => {
                    out.insert(key.clone(), entry(r));
                }
                Err(why) => {
                    if self.refused.get(key) != Some(&why) {
                        tracing::warn!(node_id = %r.node_id, role = %r.role, model_id = %r.model_id, %why, "node refused by routing");
                        metrics::counter!("fission_gateway_nodes_refused_total", "role" => r.role.as_str()).increment(1);
                    }
                    refused_now.insert(key.clone(), why);
                }
            }
        }
        self.refused = refused_now;
        for role in [Role::Prefill, Role::Decode] {
            let (mut ready, mut draining) = (0, 0);
            for e in out.values().filter(|e| e.role == role) {
                if e.draining {
                    draining += 1;
                } else {
                    ready += 1;
                }
            }
            let refused = self.refused.keys().filter(|(r, _)| *r == role).count();
            for (state, n) in [
                ("serving", ready),
                ("draining", draining),
                ("refused", refused),
            ] {
                metrics::gauge!("fission_gateway_cluster_nodes", "role" => role.as_str(), "state" => state)
                    .set(n as f64);
            }
        }
        out
    }

    /// Keeps the current profile while a node holds it and no other is held by more nodes;
    /// otherwise takes the most common one (the first in key order on a tie).
    fn choose_profile(&mut self, records: &BTreeMap<NodeKey, NodeRecord>) {
        let mut counts: Vec<(Profile, usize)> = Vec::new();
        for r in records.values() {
            if self
                .fingerprint
                .as_ref()
                .is_some_and(|f| *f != r.model_fingerprint)
            {
                continue;
            }
            let p = Profile::of(r);
            match counts.iter_mut().find(|(q, _)| *q == p) {
                Some((_, n)) => *n += 1,
                None => counts.push((p, 1)),
            }
        }
        let held = |p: &Profile| counts.iter().find(|(q, _)| q == p).map_or(0, |(_, n)| *n);
        let mut best: Option<&(Profile, usize)> = None;
        for c in &counts {
            if best.is_none_or(|b| c.1 > b.1) {
                best = Some(c);
            }
        }
        let current = self.profile.as_ref().map_or(0, held);
        match best {
            Some((p, n)) if current == 0 || *n > current => {
                if let Some(old) = &self.profile {
                    if old != p && current > 0 {
                        tracing::warn!(nodes = n, was = ?old, now = ?p, "the cluster's KV profile changed: more nodes share another one");
                    }
                }
                self.profile = Some(p.clone());
            }
            Some(_) => {}
            None => self.profile = None,
        }
    }

    fn check(&self, r: &NodeRecord) -> Result<(), String> {
        if let Some(f) = &self.fingerprint {
            if *f != r.model_fingerprint {
                return Err(format!(
                    "model fingerprint {} (model {}) differs from the cluster's {f}",
                    r.model_fingerprint, r.model_id
                ));
            }
        }
        match &self.profile {
            Some(p) if *p != Profile::of(r) => Err(p.mismatch(&Profile::of(r), &r.model_id)),
            _ => Ok(()),
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
            kv_transport: "quic".into(),
            draining: false,
        }
    }

    fn records(rs: &[NodeRecord]) -> BTreeMap<NodeKey, NodeRecord> {
        rs.iter()
            .map(|r| ((r.role, r.node_id.clone()), r.clone()))
            .collect()
    }

    fn ids(m: &BTreeMap<NodeKey, NodeEntry>) -> Vec<&str> {
        m.keys().map(|(_, id)| id.as_str()).collect()
    }

    #[test]
    fn refuses_other_models_layouts_and_transports() {
        let mut a = Admission::new(Some("f".into()));
        let mut tcp = record("d", "f", 64);
        tcp.kv_transport = "tcp".into();
        let got = a.admit(&records(&[
            record("a", "f", 64),
            record("a2", "f", 64),
            record("b", "g", 64),
            record("c", "f", 128),
            tcp,
        ]));
        assert_eq!(ids(&got), vec!["a", "a2"]);
        let why = |id: &str| a.refused[&(Role::Decode, id.to_string())].clone();
        assert!(why("b").contains("fingerprint"), "{}", why("b"));
        assert!(why("c").contains("KV layout"), "{}", why("c"));
        assert!(why("d").contains("KV transport"), "{}", why("d"));
    }

    #[test]
    fn without_a_fingerprint_the_majority_defines_the_model() {
        let mut a = Admission::new(None);
        let got = a.admit(&records(&[
            record("a", "g", 64),
            record("b", "f", 64),
            record("c", "f", 64),
        ]));
        assert_eq!(ids(&got), vec!["b", "c"]);
        assert!(a.refused[&(Role::Decode, "a".into())].contains("fingerprint"));
    }

    #[test]
    fn one_odd_node_neither_takes_over_nor_pins_the_cluster_for_good() {
        let mut a = Admission::new(Some("f".into()));
        // The odd node comes first and is alone: it defines the profile for now.
        let odd = record("a-odd", "f", 128);
        assert_eq!(ids(&a.admit(&records(&[odd.clone()]))), vec!["a-odd"]);
        // Two good nodes outnumber it: the profile moves to theirs.
        let got = a.admit(&records(&[
            odd.clone(),
            record("b", "f", 64),
            record("c", "f", 64),
        ]));
        assert_eq!(ids(&got), vec!["b", "c"]);
        // A tie keeps the current profile: one more odd node does not flip the cluster back.
        let mut odd2 = odd.clone();
        odd2.node_id = "a-odd2".into();
        let got = a.admit(&records(&[
            odd.clone(),
            odd2,
            record("b", "f", 64),
            record("c", "f", 64),
        ]));
        assert_eq!(ids(&got), vec!["b", "c"]);
        // Once every node of the profile has left, the next node defines it again.
        assert!(a.admit(&records(&[])).is_empty());
        assert_eq!(ids(&a.admit(&records(&[record("d", "f", 32)]))), vec!["d"]);
    }

    #[test]
    fn a_prefill_and_a_decode_node_may_share_an_id() {
        let mut a = Admission::new(None);
        let mut p = record("n1", "f", 64);
        p.role = Role::Prefill;
        let got = a.admit(&records(&[p, record("n1", "f", 64)]));
        assert_eq!(got.len(), 2);
    }
}
