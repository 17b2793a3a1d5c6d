//! Which registered nodes are members: nodes whose KV the others can read.
//!
//! A node is refused, with a log line saying why, when its model fingerprint, weight type (one
//! checkpoint loaded as f32 and as int8 computes different KV), KV layout (its dtype among
//! them) or KV transport differs from the cluster's, or, for the shared-memory transport, its host: KV
//! computed by one could not be read by another, or could not even reach it. The cluster's model is the expected fingerprint when the follower
//! was given one (a gateway that has the weights). The rest (and the model, when none is
//! expected) is the profile most registered nodes share; the current profile stays while any
//! node holds it and no other profile is held by more, so one misconfigured node can neither
//! take over a running cluster nor pin a fresh one for good.

use std::collections::BTreeMap;

use kv_types::KvLayout;

use crate::record::{NodeKey, NodeRecord};

/// What two nodes must share to exchange KV.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Profile {
    fingerprint: String,
    weight_dtype: String,
    layout: KvLayout,
    kv_transport: String,
    /// The host, for a transport that reaches only its own (shared memory): a node on another
    /// host could not be pushed to at all.
    host: Option<String>,
}

impl Profile {
    fn of(r: &NodeRecord) -> Profile {
        let same_host_only = r
            .kv_transport
            .parse::<kv_types::KvBackend>()
            .is_ok_and(|b| b.same_host_only());
        Profile {
            fingerprint: r.model_fingerprint.clone(),
            weight_dtype: r.weight_dtype.clone(),
            layout: r.kv_layout,
            kv_transport: r.kv_transport.clone(),
            host: same_host_only.then(|| r.host_id.clone()),
        }
    }

    /// Why a node with profile `other` cannot join a cluster with this one.
    /// The architecture is named, not compared: the fingerprint covers it (config.json is
    /// hashed).
    fn mismatch(&self, other: &Profile, model_id: &str, architecture: &str) -> String {
        let mut why = Vec::new();
        if other.fingerprint != self.fingerprint {
            why.push(format!(
                "model fingerprint {} (model {model_id}, {architecture}) differs from the cluster's {}",
                other.fingerprint, self.fingerprint
            ));
        }
        if other.weight_dtype != self.weight_dtype {
            why.push(format!(
                "weights in {:?} differ from the cluster's {:?}",
                other.weight_dtype, self.weight_dtype
            ));
        }
        if other.layout != self.layout {
            why.push(format!(
                "KV layout {} differs from the cluster's {}",
                other.layout, self.layout
            ));
        }
        if other.kv_transport != self.kv_transport {
            why.push(format!(
                "KV transport {:?} differs from the cluster's {:?}",
                other.kv_transport, self.kv_transport
            ));
        }
        if other.host != self.host && other.kv_transport == self.kv_transport {
            why.push(format!(
                "KV transport {:?} reaches only one host: host {:?} differs from the cluster's {:?}",
                other.kv_transport,
                other.host.as_deref().unwrap_or_default(),
                self.host.as_deref().unwrap_or_default()
            ));
        }
        why.join("; ")
    }
}

/// A registered node that is not a member, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub record: NodeRecord,
    pub reason: String,
}

/// Decides which registered nodes are members; see the module docs.
#[derive(Debug)]
pub(crate) struct Admission {
    fingerprint: Option<String>,
    profile: Option<Profile>,
    /// The refusals of the last call, so a refused node is logged once, not on every change.
    refused: BTreeMap<NodeKey, Refusal>,
}

impl Admission {
    pub(crate) fn new(expected_fingerprint: Option<String>) -> Self {
        Admission {
            fingerprint: expected_fingerprint,
            profile: None,
            refused: BTreeMap::new(),
        }
    }

    /// The members among `registered`, keyed like it.
    pub(crate) fn admit(
        &mut self,
        registered: &BTreeMap<NodeKey, NodeRecord>,
    ) -> BTreeMap<NodeKey, NodeRecord> {
        self.choose_profile(registered);
        let mut members = BTreeMap::new();
        let mut refused = BTreeMap::new();
        for (key, r) in registered {
            match self.check(r) {
                Ok(()) => {
                    members.insert(key.clone(), r.clone());
                }
                Err(reason) => {
                    if self.refused.get(key).map(|f| &f.reason) != Some(&reason) {
                        tracing::warn!(node_id = %r.node_id, role = %r.role, model_id = %r.model_id, why = %reason, "node refused: not a member of the cluster");
                    }
                    refused.insert(
                        key.clone(),
                        Refusal {
                            record: r.clone(),
                            reason,
                        },
                    );
                }
            }
        }
        self.refused = refused;
        members
    }

    /// The registered nodes the last [`Admission::admit`] refused.
    pub(crate) fn refused(&self) -> impl Iterator<Item = &Refusal> {
        self.refused.values()
    }

    /// Keeps the current profile while a node holds it and no other is held by more nodes;
    /// otherwise takes the most common one (the first in key order on a tie).
    fn choose_profile(&mut self, registered: &BTreeMap<NodeKey, NodeRecord>) {
        let mut counts: Vec<(Profile, usize)> = Vec::new();
        for r in registered.values() {
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
            Some(p) if *p != Profile::of(r) => {
                Err(p.mismatch(&Profile::of(r), &r.model_id, &r.architecture))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use kv_types::KvDtype;

    use super::*;
    use crate::record::Role;

    fn record(id: &str, fingerprint: &str, head_dim: u32) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            role: Role::Decode,
            version: "0".into(),
            grpc_endpoint: "127.0.0.1:1".into(),
            kv_endpoint: "127.0.0.1:2".into(),
            model_id: "m".into(),
            model_fingerprint: fingerprint.into(),
            kv_layout: KvLayout {
                dtype: KvDtype::F32,
                num_layers: 2,
                block_size: 16,
                num_kv_heads: 2,
                head_dim,
                windows: Default::default(),
            },
            total_kv_blocks: 10,
            kv_transport: "quic".into(),
            host_id: String::new(),
            architecture: String::new(),
            weight_dtype: String::new(),
            draining: false,
        }
    }

    fn records(rs: &[NodeRecord]) -> BTreeMap<NodeKey, NodeRecord> {
        rs.iter().map(|r| (r.key(), r.clone())).collect()
    }

    fn ids(m: &BTreeMap<NodeKey, NodeRecord>) -> Vec<&str> {
        m.keys().map(|(_, id)| id.as_str()).collect()
    }

    fn why(a: &Admission, id: &str) -> String {
        a.refused
            .get(&(Role::Decode, id.to_string()))
            .map(|r| r.reason.clone())
            .unwrap_or_default()
    }

    #[test]
    fn refuses_other_models_layouts_and_transports() {
        let mut a = Admission::new(Some("f".into()));
        let mut tcp = record("d", "f", 64);
        tcp.kv_transport = "tcp".into();
        let mut blocks = record("e", "f", 64);
        blocks.kv_layout.block_size = 32;
        let got = a.admit(&records(&[
            record("a", "f", 64),
            record("a2", "f", 64),
            record("b", "g", 64),
            record("c", "f", 128),
            tcp,
            blocks,
        ]));
        assert_eq!(ids(&got), vec!["a", "a2"]);
        assert!(why(&a, "b").contains("fingerprint"), "{}", why(&a, "b"));
        assert!(why(&a, "c").contains("KV layout"), "{}", why(&a, "c"));
        assert!(why(&a, "d").contains("KV transport"), "{}", why(&a, "d"));
        assert!(why(&a, "e").contains("block_size=32"), "{}", why(&a, "e"));
        assert_eq!(a.refused().count(), 4);
    }

    /// Issues 32, 33: the same checkpoint loaded in another weight type, or with another KV
    /// cache dtype, computes KV the cluster's nodes cannot use; the refusal names the types
    /// and the architecture.
    #[test]
    fn other_weight_and_kv_types_are_refused_by_name() {
        let typed = |id: &str, weights: &str, kv: kv_types::KvDtype| NodeRecord {
            architecture: "Qwen3ForCausalLM".into(),
            weight_dtype: weights.into(),
            kv_layout: KvLayout {
                dtype: kv,
                ..record(id, "f", 64).kv_layout
            },
            ..record(id, "f", 64)
        };
        use kv_types::KvDtype::{Bf16, Int8};
        let mut a = Admission::new(Some("f".into()));
        let got = a.admit(&records(&[
            typed("a", "q4_k", Bf16),
            typed("b", "q4_k", Bf16),
            typed("c", "f32", Bf16),
            typed("d", "q4_k", Int8),
        ]));
        assert_eq!(ids(&got), vec!["a", "b"]);
        assert!(
            why(&a, "c").contains(r#"weights in "f32" differ from the cluster's "q4_k""#),
            "{}",
            why(&a, "c")
        );
        assert!(why(&a, "d").contains("KV layout int8"), "{}", why(&a, "d"));
        let mut other = typed("e", "q4_k", Bf16);
        other.model_fingerprint = "g".into();
        let mut a = Admission::new(None);
        a.admit(&records(&[
            typed("a", "q4_k", Bf16),
            typed("b", "q4_k", Bf16),
            other,
        ]));
        assert!(
            why(&a, "e").contains("Qwen3ForCausalLM"),
            "{}",
            why(&a, "e")
        );
    }

    #[test]
    fn shared_memory_nodes_on_another_host_are_refused() {
        let shm = |id: &str, host: &str| NodeRecord {
            kv_transport: "shm".into(),
            host_id: host.into(),
            ..record(id, "f", 64)
        };
        let mut a = Admission::new(Some("f".into()));
        let got = a.admit(&records(&[shm("a", "h1"), shm("b", "h1"), shm("c", "h2")]));
        assert_eq!(ids(&got), vec!["a", "b"]);
        assert!(why(&a, "c").contains("one host"), "{}", why(&a, "c"));
        // The network transports do not care where a node runs.
        let mut a = Admission::new(Some("f".into()));
        let mut elsewhere = record("c", "f", 64);
        elsewhere.host_id = "h2".into();
        let got = a.admit(&records(&[record("a", "f", 64), elsewhere]));
        assert_eq!(ids(&got), vec!["a", "c"]);
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
        assert!(why(&a, "a").contains("fingerprint"));
    }

    #[test]
    fn one_odd_node_neither_takes_over_nor_pins_the_cluster_for_good() {
        let mut a = Admission::new(Some("f".into()));
        // The odd node comes first and is alone: it defines the profile for now.
        let odd = record("a-odd", "f", 128);
        assert_eq!(
            ids(&a.admit(&records(std::slice::from_ref(&odd)))),
            vec!["a-odd"]
        );
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
