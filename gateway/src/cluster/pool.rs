//! Live node pools: a gRPC client per member, readiness, in-flight counts, published load and
//! each node's prefix cache (followed over its `CacheEvents` stream).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cluster::{Loads, NodeLoad};
use futures::StreamExt;
use proto::v1::decode_client::DecodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{CacheEventsRequest, InfoRequest, NodeInfo};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::discovery::{Discovery, Members, NodeEntry, Role};
use super::prefix_index::{CacheEvent, PrefixIndex};

/// How long a node that failed a call is skipped: until discovery removes it, or it recovers.
const QUARANTINE: Duration = Duration::from_secs(3);
/// A static node that has not answered `Info` in this long is asked again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// One member with its client and load.
pub struct Node {
    pub entry: NodeEntry,
    pub channel: Channel,
    /// Static members: what the node answered to `Info` (`None` until it answers).
    pub info: Mutex<Option<NodeInfo>>,
    pub in_flight: AtomicUsize,
    quarantined_until: Mutex<Option<Instant>>,
    /// Stops this node's cache-event follower when the node leaves.
    follower: CancellationToken,
}

impl Node {
    pub fn is_ready(&self) -> bool {
        if self.entry.draining {
            return false;
        }
        let quarantined = self
            .quarantined_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|t| Instant::now() < t);
        if quarantined {
            return false;
        }
        self.entry.registered
            || self
                .info
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some()
    }

    /// Skips this node for a while after a failed call: a dead node stays registered until its
    /// lease runs out, and requests must not keep landing on it meanwhile.
    pub fn quarantine(&self) {
        tracing::warn!(node_id = %self.entry.node_id, "node failed a call; skipping it for a while");
        *self
            .quarantined_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + QUARANTINE);
    }

    /// Tokens per KV block, from the registration or the `Info` answer.
    pub fn block_size(&self) -> usize {
        if self.entry.block_size > 0 {
            return self.entry.block_size as usize;
        }
        self.info
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|i| i.layout.as_ref().map(|l| l.block_size as usize))
            .unwrap_or(0)
    }

    pub fn total_blocks(&self) -> u64 {
        if self.entry.total_kv_blocks > 0 {
            return self.entry.total_kv_blocks;
        }
        self.info
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |i| u64::from(i.total_kv_blocks))
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

pub struct Pools {
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    loads: Option<watch::Receiver<Loads>>,
    prefixes: Arc<Mutex<PrefixIndex>>,
}

impl Pools {
    /// Keeps the pools in step with discovery, probes static members until they answer `Info`,
    /// and follows every member's prefix cache.
    pub fn spawn(discovery: Arc<dyn Discovery>) -> Arc<Self> {
        let pools = Arc::new(Pools {
            nodes: Mutex::new(HashMap::new()),
            loads: discovery.loads(),
            prefixes: Arc::new(Mutex::new(PrefixIndex::new())),
        });
        let mut rx = discovery.watch();
        let p = Arc::clone(&pools);
        tokio::spawn(async move {
            // Owns the discovery: its watch tasks live as long as this loop.
            let _discovery = discovery;
            loop {
                let members: Members = rx.borrow_and_update().clone();
                p.apply(&members);
                p.probe().await;
                let waiting = p.all().iter().any(|n| !n.is_ready() && !n.entry.registered);
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    // Re-probe static nodes that have not answered yet.
                    _ = tokio::time::sleep(Duration::from_millis(200)), if waiting => {},
                }
            }
        });
        pools
    }

    fn apply(&self, members: &[NodeEntry]) {
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        nodes.retain(|id, n| {
            let keep = members.iter().any(|m| &m.node_id == id);
            if !keep {
                tracing::info!(node_id = %id, role = n.entry.role.as_str(), "node left the pool");
                n.follower.cancel();
                self.prefixes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove_node(id);
            }
            keep
        });
        for m in members {
            let old = nodes.get(&m.node_id).cloned();
            if old.as_ref().is_some_and(|n| n.entry == *m) {
                continue;
            }
            // Same endpoint: keep the connection, the follower and the counts' meaning.
            let (channel, info, follower) = match &old {
                Some(n) if n.entry.grpc_endpoint == m.grpc_endpoint => (
                    n.channel.clone(),
                    n.info
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone(),
                    n.follower.clone(),
                ),
                _ => {
                    if let Some(n) = &old {
                        n.follower.cancel();
                    }
                    let Ok(ep) = Endpoint::from_shared(format!("http://{}", m.grpc_endpoint))
                    else {
                        tracing::warn!(node_id = %m.node_id, endpoint = %m.grpc_endpoint, "bad endpoint");
                        continue;
                    };
                    let channel = ep
                        .connect_timeout(Duration::from_secs(2))
                        .tcp_nodelay(true)
                        .connect_lazy();
                    let follower = CancellationToken::new();
                    tokio::spawn(follow_cache(
                        m.node_id.clone(),
                        m.role,
                        channel.clone(),
                        Arc::clone(&self.prefixes),
                        follower.clone(),
                    ));
                    (channel, None, follower)
                }
            };
            if old.is_none() {
                tracing::info!(node_id = %m.node_id, role = m.role.as_str(), endpoint = %m.grpc_endpoint, registered = m.registered, "node joined the pool");
            } else if m.draining {
                tracing::info!(node_id = %m.node_id, role = m.role.as_str(), "node is draining");
            }
            let in_flight = old
                .as_ref()
                .map_or(0, |n| n.in_flight.load(Ordering::Relaxed));
            nodes.insert(
                m.node_id.clone(),
                Arc::new(Node {
                    entry: m.clone(),
                    channel,
                    info: Mutex::new(info),
                    in_flight: AtomicUsize::new(in_flight),
                    quarantined_until: Mutex::new(None),
                    follower,
                }),
            );
        }
    }

    /// Asks every static member that has not answered yet for its `Info`, all at once and each
    /// under a timeout: a node whose listener is bound but whose server is not up yet would
    /// otherwise hold the others up.
    async fn probe(&self) {
        let unprobed: Vec<Arc<Node>> = self
            .all()
            .into_iter()
            .filter(|n| {
                !n.entry.registered
                    && n.info
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_none()
            })
            .collect();
        let probes = unprobed.into_iter().map(|n| async move {
            let call = async {
                match n.entry.role {
                    Role::Decode => n.decode_client().info(InfoRequest {}).await,
                    Role::Prefill => n.prefill_client().info(InfoRequest {}).await,
                }
            };
            if let Ok(Ok(info)) = tokio::time::timeout(PROBE_TIMEOUT, call).await {
                let info = info.into_inner();
                tracing::info!(node_id = %n.entry.node_id, role = n.entry.role.as_str(), model = %info.model_id, "node ready");
                *n.info.lock().unwrap_or_else(PoisonError::into_inner) = Some(info);
            }
        });
        futures::future::join_all(probes).await;
    }

    pub fn all(&self) -> Vec<Arc<Node>> {
        let mut v: Vec<Arc<Node>> = self
            .nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.entry.node_id.cmp(&b.entry.node_id));
        v
    }

    /// Ready members of `role`, by node id.
    pub fn ready(&self, role: Role) -> Vec<Arc<Node>> {
        self.all()
            .into_iter()
            .filter(|n| n.entry.role == role && n.is_ready())
            .collect()
    }

    /// The node's last published load, if discovery carries load.
    pub fn load(&self, node_id: &str) -> Option<NodeLoad> {
        self.loads
            .as_ref()
            .and_then(|rx| rx.borrow().get(node_id).copied())
    }

    /// Block hashes `node_id` is known to hold in its prefix cache.
    pub fn cached_blocks(&self, node_id: &str) -> usize {
        self.prefixes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .num_blocks(node_id)
    }

    /// Leading blocks of `hashes` that `node_id` holds in its prefix cache.
    pub fn overlap_blocks(&self, node_id: &str, hashes: &[u64]) -> usize {
        self.prefixes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overlap_blocks(node_id, hashes)
    }
}

/// Follows one node's prefix cache until `stop`: a snapshot, then numbered batches. A gap or a
/// broken stream means a fresh call and a fresh snapshot.
async fn follow_cache(
    node_id: String,
    role: Role,
    channel: Channel,
    index: Arc<Mutex<PrefixIndex>>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let call = async {
            match role {
                Role::Decode => DecodeClient::new(channel.clone())
                    .cache_events(CacheEventsRequest {})
                    .await
                    .map(|r| r.into_inner().boxed()),
                Role::Prefill => PrefillClient::new(channel.clone())
                    .cache_events(CacheEventsRequest {})
                    .await
                    .map(|r| r.into_inner().boxed()),
            }
        };
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            s = call => s,
        };
        if let Ok(mut stream) = stream {
            loop {
                let msg = tokio::select! {
                    _ = stop.cancelled() => return,
                    m = stream.next() => m,
                };
                let Some(Ok(batch)) = msg else { break };
                backoff = Duration::from_millis(200);
                let mut index = index.lock().unwrap_or_else(PoisonError::into_inner);
                if batch.snapshot {
                    index.apply_snapshot(&node_id, batch.seq, batch.events.iter().map(|e| e.hash));
                    continue;
                }
                let events: Vec<CacheEvent> = batch
                    .events
                    .iter()
                    .map(|e| {
                        if e.stored {
                            CacheEvent::Stored(e.hash)
                        } else {
                            CacheEvent::Removed(e.hash)
                        }
                    })
                    .collect();
                if let Err(gap) = index.apply_events(&node_id, batch.seq, &events) {
                    tracing::info!(%gap, "cache events lost; resyncing from a snapshot");
                    metrics::counter!("fission_gateway_cache_event_resyncs_total").increment(1);
                    break;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
