//! Live node pools: a gRPC client per member, readiness from its `Info`, in-flight counts for
//! load-aware picking, and the model fingerprint each node reported.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use proto::v1::decode_client::DecodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{InfoRequest, NodeInfo};
use tonic::transport::{Channel, Endpoint};

use super::discovery::{Discovery, Members, NodeEntry, Role};

/// One member with its client and load.
pub struct Node {
    pub entry: NodeEntry,
    pub channel: Channel,
    pub info: Mutex<Option<NodeInfo>>,
    pub in_flight: AtomicUsize,
}

impl Node {
    pub fn is_ready(&self) -> bool {
        self.info
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
            && !self.entry.draining
    }

    pub fn decode_client(&self) -> DecodeClient<Channel> {
        DecodeClient::new(self.channel.clone())
    }

    pub fn prefill_client(&self) -> PrefillClient<Channel> {
        PrefillClient::new(self.channel.clone())
    }
}

/// Counts a request against a node for as long as it lives.
pub struct InFlight(Arc<Node>);

impl InFlight {
    pub fn new(node: Arc<Node>) -> Self {
        node.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(node)
    }

    pub fn node(&self) -> &Arc<Node> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Default)]
pub struct Pools {
    nodes: Mutex<HashMap<String, Arc<Node>>>,
}

impl Pools {
    /// Keeps the pools in step with discovery and probes members until they answer `Info`.
    pub fn spawn(discovery: Arc<dyn Discovery>) -> Arc<Self> {
        let pools = Arc::new(Pools::default());
        let mut rx = discovery.watch();
        let p = Arc::clone(&pools);
        tokio::spawn(async move {
            loop {
                let members: Members = rx.borrow_and_update().clone();
                p.apply(&members);
                p.probe().await;
                // Re-probe nodes that were not ready yet, or wait for a membership change.
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {},
                }
            }
        });
        pools
    }

    fn apply(&self, members: &[NodeEntry]) {
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        nodes.retain(|id, _| members.iter().any(|m| &m.node_id == id));
        for m in members {
            let fresh = nodes.get(&m.node_id).is_none_or(|n| n.entry != *m);
            if fresh {
                let Ok(ep) = Endpoint::from_shared(format!("http://{}", m.grpc_endpoint)) else {
                    tracing::warn!(node_id = %m.node_id, endpoint = %m.grpc_endpoint, "bad endpoint");
                    continue;
                };
                let ep = ep.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true);
                let old_info = nodes.get(&m.node_id).and_then(|n| {
                    n.info
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone()
                });
                nodes.insert(
                    m.node_id.clone(),
                    Arc::new(Node {
                        entry: m.clone(),
                        channel: ep.connect_lazy(),
                        info: Mutex::new(old_info),
                        in_flight: AtomicUsize::new(0),
                    }),
                );
            }
        }
    }

    async fn probe(&self) {
        let unprobed: Vec<Arc<Node>> = self
            .all()
            .into_iter()
            .filter(|n| {
                n.info
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_none()
            })
            .collect();
        for n in unprobed {
            let info = match n.entry.role {
                Role::Decode => n.decode_client().info(InfoRequest {}).await,
                Role::Prefill => n.prefill_client().info(InfoRequest {}).await,
            };
            if let Ok(info) = info {
                let info = info.into_inner();
                tracing::info!(node_id = %n.entry.node_id, role = n.entry.role.as_str(), model = %info.model_id, "node ready");
                *n.info.lock().unwrap_or_else(PoisonError::into_inner) = Some(info);
            }
        }
    }

    pub fn all(&self) -> Vec<Arc<Node>> {
        self.nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Ready members of `role`, least loaded first (ties by id, so picks are stable).
    pub fn ready(&self, role: Role) -> Vec<Arc<Node>> {
        let mut v: Vec<Arc<Node>> = self
            .all()
            .into_iter()
            .filter(|n| n.entry.role == role && n.is_ready())
            .collect();
        v.sort_by(|a, b| {
            a.in_flight
                .load(Ordering::Relaxed)
                .cmp(&b.in_flight.load(Ordering::Relaxed))
                .then_with(|| a.entry.node_id.cmp(&b.entry.node_id))
        });
        v
    }
}
