//! What a node says about itself, and where it says it.

use std::fmt;

use kv_types::KvLayout;
use serde::{Deserialize, Serialize};

/// The part a node plays in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One node's membership record, stored as JSON under [`NodeRecord::key`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    pub role: Role,
    /// The node binary's version.
    pub version: String,
    /// `host:port` of the node's gRPC server.
    pub grpc_endpoint: String,
    /// `host:port` of the node's KV transfer endpoint.
    pub kv_endpoint: String,
    pub model_id: String,
    /// Identifies the exact weights; nodes with different fingerprints must not share KV.
    pub model_fingerprint: String,
    /// The KV cache geometry (block size included): nodes exchange KV only when theirs match.
    pub kv_layout: KvLayout,
    pub total_kv_blocks: u64,
    /// The KV-transfer backend the node speaks (`quic` or `tcp`): a prefill node can only push
    /// into a decode node that speaks its own. Empty in records written before the field existed.
    #[serde(default)]
    pub kv_transport: String,
    /// Which host the node runs on (`/etc/machine-id` and the boot id): the shared-memory
    /// KV transport reaches only nodes on the same one. Empty in records written before the
    /// field existed.
    #[serde(default)]
    pub host_id: String,
    /// The architecture served (config.json's `architectures[0]`). Empty in records written
    /// before the field existed.
    #[serde(default)]
    pub architecture: String,
    /// The weights' type as they run (`f32`, `bf16`, `int8`, `q4_k`, ...): nodes that load one
    /// checkpoint in different types compute different KV. Empty in records written before
    /// the field existed.
    #[serde(default)]
    pub weight_dtype: String,
    /// A draining node takes no new requests.
    pub draining: bool,
}

impl NodeRecord {
    /// The node's identity: its role and id.
    pub fn key(&self) -> NodeKey {
        (self.role, self.node_id.clone())
    }

    /// Where the record lives in etcd.
    pub fn etcd_key(&self, cluster: &str) -> String {
        node_key(cluster, self.role, &self.node_id)
    }

    pub fn load_key(&self, cluster: &str) -> String {
        load_key(cluster, self.role, &self.node_id)
    }
}

/// A node's identity in the cluster: ids are unique per role, not across roles.
pub type NodeKey = (Role, String);

/// A node's current load, stored as JSON under a key apart from its record so that membership
/// watches do not wake up on every load change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLoad {
    pub free_blocks: u64,
    pub queued_prefill_tokens: u64,
    pub running_sequences: u64,
}

/// Every key of the cluster: what an etcd role for it must cover.
pub(crate) fn cluster_prefix(cluster: &str) -> String {
    format!("/fission/{cluster}/")
}

/// Every node's record, both roles.
pub(crate) fn nodes_prefix(cluster: &str) -> String {
    format!("/fission/{cluster}/nodes/")
}

pub(crate) fn node_key(cluster: &str, role: Role, node_id: &str) -> String {
    format!("/fission/{cluster}/nodes/{role}/{node_id}")
}

pub(crate) fn load_prefix(cluster: &str) -> String {
    format!("/fission/{cluster}/load/")
}

pub(crate) fn load_key(cluster: &str, role: Role, node_id: &str) -> String {
    format!("/fission/{cluster}/load/{role}/{node_id}")
}

/// The role and node id that end a node or load key (`.../{role}/{node_id}`).
pub(crate) fn key_identity(key: &[u8]) -> Option<NodeKey> {
    let key = std::str::from_utf8(key).ok()?;
    let mut parts = key.rsplit('/');
    let node_id = parts.next().filter(|id| !id.is_empty())?;
    let role = match parts.next()? {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        _ => return None,
    };
    Some((role, node_id.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_without_a_transport_still_parse() {
        let json = r#"{"node_id":"n","role":"decode","version":"0","grpc_endpoint":"a:1",
            "kv_endpoint":"a:2","model_id":"m","model_fingerprint":"f",
            "kv_layout":{"dtype":"f32","num_layers":2,"block_size":16,"num_kv_heads":2,"head_dim":8},
            "total_kv_blocks":10,"draining":false}"#;
        let r: NodeRecord = serde_json::from_str(json).unwrap();
        assert_eq!(r.kv_transport, "");
    }

    #[test]
    fn keys_and_role_spelling() {
        assert_eq!(
            node_key("c1", Role::Prefill, "n1"),
            "/fission/c1/nodes/prefill/n1"
        );
        assert_eq!(
            load_key("c1", Role::Decode, "n2"),
            "/fission/c1/load/decode/n2"
        );
        assert_eq!(nodes_prefix("c1"), "/fission/c1/nodes/");
        assert_eq!(
            key_identity(b"/fission/c/load/decode/d-1"),
            Some((Role::Decode, "d-1".to_string()))
        );
        assert_eq!(key_identity(b"/fission/c/load/other/d-1"), None);
        assert_eq!(key_identity(b"/fission/c/load/decode/"), None);
        assert_eq!(
            serde_json::to_string(&Role::Decode).unwrap(),
            "\"decode\"".to_string()
        );
    }
}
