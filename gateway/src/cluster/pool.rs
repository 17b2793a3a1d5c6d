//! Live node pools, kept by applying discovery's [`ClusterChange`] stream: a gRPC client per
//! member, readiness, in-flight counts, published load and each node's prefix cache (followed
//! over its `CacheEvents` stream).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cluster::{ClusterChange, Loads, NodeLoad, NodeRecord};
use futures::StreamExt;
use identity::GrpcSecurity;
use proto::v1::decode_client::DecodeClient;
use proto::v1::node_client::NodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{CacheEventsRequest, InfoRequest, NodeInfo};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use super::discovery::{Discovery, NodeKey, Role};
use super::health::{answers, Health, CHECK_INTERVAL};
use super::pairs::{PairConfig, Pairs};
use super::prefix_index::{CacheEvent, PrefixIndex};

/// How long a node that failed a call is skipped: until discovery removes it, or it recovers.
const QUARANTINE: Duration = Duration::from_secs(3);
/// A static node that has not answered `Info` in this long is asked again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The pause between `Info` probes of a static node that has not answered.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// What the gateway knows of one node process beyond its record. It outlives record updates
/// (a node marked draining keeps its in-flight count and quarantine), and is replaced only
/// when the node moves to another endpoint, that is, when it is another process.
struct NodeState {
    /// Static members: what the node answered to `Info` (`None` until it answers).
    info: Mutex<Option<NodeInfo>>,
    in_flight: AtomicUsize,
    quarantined_until: Mutex<Option<Instant>>,
    /// Stops this node's cache-event follower and probes when the node leaves.
    follower: CancellationToken,
    /// Whether the node is suspect or lost its registration; see [`Health`].
    health: Health,
}

/// One member with its client and load.
pub struct Node {
    pub entry: NodeRecord,
    /// A registered node serves from the moment it appears; a static one once it answers
    /// `Info` (see [`Discovery::registered`]).
    pub registered: bool,
    pub channel: Channel,
    state: Arc<NodeState>,
    /// The node's key in the published loads and its name in the prefix index
    /// ([`index_key`]), made once: routing looks both up for every candidate of every request.
    key: NodeKey,
    index_key: String,
}

impl Node {
    pub fn is_ready(&self) -> bool {
        if self.entry.draining {
            return false;
        }
        let quarantined = self
            .state
            .quarantined_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|t| Instant::now() < t);
        if quarantined || self.state.health.is_suspect() {
            return false;
        }
        self.registered || self.info().is_some()
    }

    /// Takes the node out of routing until it answers a health check: it stalled or lost its
    /// connection, which a dead process and a hung one look alike in.
    pub fn suspect(&self, why: &str) {
        if self.state.health.mark_suspect() {
            tracing::warn!(node_id = %self.entry.node_id, role = self.entry.role.as_str(), why, "node suspect; no new work until it answers a health check");
            metrics::counter!("fission_gateway_suspect_nodes_total", "role" => self.entry.role.as_str()).increment(1);
            tokio::spawn(probe_until_healthy(
                self.entry.node_id.clone(),
                self.channel.clone(),
                Arc::clone(&self.state),
            ));
        }
    }

    pub fn info(&self) -> Option<NodeInfo> {
        self.state
            .info
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Requests the gateway is running on this node now.
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::Relaxed)
    }

    /// Skips this node for a while after a failed call: a dead node stays registered until its
    /// lease runs out, and requests must not keep landing on it meanwhile.
    pub fn quarantine(&self) {
        tracing::warn!(node_id = %self.entry.node_id, role = self.entry.role.as_str(), "node failed a call; skipping it for a while");
        *self
            .state
            .quarantined_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + QUARANTINE);
    }

    /// Tokens per KV block, from the registration or the `Info` answer.
    pub fn block_size(&self) -> usize {
        if self.entry.kv_layout.block_size > 0 {
            return self.entry.kv_layout.block_size as usize;
        }
        self.info()
            .and_then(|i| i.layout.map(|l| l.block_size as usize))
            .unwrap_or(0)
    }

    pub fn total_blocks(&self) -> u64 {
        if self.entry.total_kv_blocks > 0 {
            return self.entry.total_kv_blocks;
        }
        self.info().map_or(0, |i| u64::from(i.total_kv_blocks))
    }

    pub fn decode_client(&self) -> DecodeClient<Channel> {
        DecodeClient::new(self.channel.clone())
    }

    pub fn prefill_client(&self) -> PrefillClient<Channel> {
        PrefillClient::new(self.channel.clone())
    }
}

/// The prefix index's name for a node: ids are unique per role only.
fn index_key(role: Role, node_id: &str) -> String {
    format!("{role}/{node_id}")
}

/// Counts a request against a node for as long as it lives.
pub struct InFlight(Arc<NodeState>);

impl InFlight {
    pub fn new(node: &Node) -> Self {
        node.state.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(&node.state))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct Pools {
    nodes: Mutex<HashMap<NodeKey, Arc<Node>>>,
    loads: Option<watch::Receiver<Loads>>,
    /// Whether discovery's members registered themselves ([`Discovery::registered`]).
    registered: bool,
    prefixes: Arc<Mutex<PrefixIndex>>,
    /// Nodes whose registration ended without a drain and that then failed a health check:
    /// the pool's loop removes them.
    dead_tx: mpsc::UnboundedSender<NodeKey>,
    /// How the gateway dials nodes: its certificate is what lets it call them.
    security: GrpcSecurity,
    /// Failures per prefill→decode pair, and the pairs routed around for now.
    pairs: Pairs,
}

impl Pools {
    /// Keeps the pools in step with discovery's changes, probes static members until they
    /// answer `Info`, and follows every member's prefix cache.
    pub fn spawn(discovery: Arc<dyn Discovery>, security: GrpcSecurity) -> Arc<Self> {
        Self::spawn_with(discovery, security, PairConfig::default())
    }

    /// As [`Pools::spawn`], marking pairs bad as `pairs` says.
    pub fn spawn_with(
        discovery: Arc<dyn Discovery>,
        security: GrpcSecurity,
        pairs: PairConfig,
    ) -> Arc<Self> {
        let (dead_tx, mut dead_rx) = mpsc::unbounded_channel();
        let pools = Arc::new(Pools {
            nodes: Mutex::new(HashMap::new()),
            loads: discovery.loads(),
            registered: discovery.registered(),
            prefixes: Arc::new(Mutex::new(PrefixIndex::new())),
            dead_tx,
            security,
            pairs: Pairs::new(pairs),
        });
        let mut changes = discovery.changes();
        let p = Arc::clone(&pools);
        tokio::spawn(async move {
            // Owns the discovery: its watch tasks live as long as this loop.
            let _discovery = discovery;
            loop {
                let change = tokio::select! {
                    change = changes.recv() => match change {
                        Some(change) => change,
                        None => return,
                    },
                    Some((role, node_id)) = dead_rx.recv() => {
                        ClusterChange::Remove { role, node_id }
                    }
                };
                p.apply(change);
            }
        });
        pools
    }

    fn apply(&self, change: ClusterChange) {
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        let m = match change {
            ClusterChange::Remove { role, node_id } => {
                if let Some(n) = nodes.remove(&(role, node_id.clone())) {
                    tracing::info!(%node_id, role = role.as_str(), "node left the pool");
                    n.state.follower.cancel();
                    self.prefixes
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove_node(&index_key(role, &node_id));
                    self.pairs.forget(role, &node_id);
                }
                return;
            }
            ClusterChange::Lost { role, node_id } => {
                // A lease expired without a drain: the node died, or etcd lost it (an outage
                // ends every lease at once). Keep routing to it while it answers.
                if let Some(n) = nodes.get(&(role, node_id.clone())) {
                    if n.state.health.mark_unregistered() {
                        tracing::warn!(%node_id, role = role.as_str(), "node's registration ended without a drain; keeping it while it answers health checks");
                        tokio::spawn(check_while_unregistered(
                            n.key.clone(),
                            n.channel.clone(),
                            Arc::clone(&n.state),
                            self.dead_tx.clone(),
                        ));
                    }
                }
                return;
            }
            ClusterChange::Add(m) | ClusterChange::Update(m) => m,
        };
        let old = nodes.get(&m.key()).cloned();
        if let Some(o) = &old {
            o.state.health.clear_unregistered();
        }
        if old.as_ref().is_some_and(|n| n.entry == m) {
            return;
        }
        // Same endpoint: the same process, so keep its connection, follower and counts.
        let (channel, state) = match &old {
            Some(n) if n.entry.grpc_endpoint == m.grpc_endpoint => {
                (n.channel.clone(), Arc::clone(&n.state))
            }
            _ => {
                if let Some(n) = &old {
                    n.state.follower.cancel();
                }
                let ep = match self.security.endpoint(&m.grpc_endpoint) {
                    Ok(ep) => ep,
                    Err(e) => {
                        tracing::warn!(node_id = %m.node_id, endpoint = %m.grpc_endpoint, error = %e, "bad endpoint");
                        return;
                    }
                };
                let channel = ep
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .connect_lazy();
                let state = Arc::new(NodeState {
                    info: Mutex::new(None),
                    in_flight: AtomicUsize::new(0),
                    quarantined_until: Mutex::new(None),
                    follower: CancellationToken::new(),
                    health: Health::default(),
                });
                tokio::spawn(follow_cache(
                    index_key(m.role, &m.node_id),
                    channel.clone(),
                    Arc::clone(&self.prefixes),
                    Arc::clone(&state),
                ));
                // Registered members too: their `Info` carries the context the gateway's
                // limits must not exceed, which the registration does not.
                tokio::spawn(probe_until_answered(
                    m.clone(),
                    channel.clone(),
                    Arc::clone(&state),
                ));
                (channel, state)
            }
        };
        match &old {
            None => {
                tracing::info!(node_id = %m.node_id, role = m.role.as_str(), endpoint = %m.grpc_endpoint, registered = self.registered, "node joined the pool")
            }
            Some(o) if m.draining && !o.entry.draining => {
                tracing::info!(node_id = %m.node_id, role = m.role.as_str(), "node is draining")
            }
            Some(_) => {}
        }
        nodes.insert(
            m.key(),
            Arc::new(Node {
                key: m.key(),
                index_key: index_key(m.role, &m.node_id),
                entry: m,
                registered: self.registered,
                channel,
                state,
            }),
        );
    }

    pub fn all(&self) -> Vec<Arc<Node>> {
        let mut v: Vec<Arc<Node>> = self
            .nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.key.cmp(&b.key));
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
    pub fn load(&self, node: &Node) -> Option<NodeLoad> {
        self.loads
            .as_ref()
            .and_then(|rx| rx.borrow().get(&node.key).copied())
    }

    /// The failure records of prefill→decode pairs.
    pub fn pairs(&self) -> &Pairs {
        &self.pairs
    }

    /// Block hashes `node` is known to hold in its prefix cache.
    pub fn cached_blocks(&self, node: &Node) -> usize {
        self.prefixes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .num_blocks(&node.index_key)
    }

    /// Leading blocks of `hashes` that `node` holds in its prefix cache.
    pub fn overlap_blocks(&self, node: &Node, hashes: &[u64]) -> usize {
        self.prefixes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overlap_blocks(&node.index_key, hashes)
    }
}

/// Asks a member for its `Info` until it answers (a static member is routable from then on;
/// every member's context bounds the gateway's limits) or it leaves the pool. Each probe runs under a timeout: a node whose listener is bound but whose
/// server is not up yet must not hold the probe forever.
async fn probe_until_answered(entry: NodeRecord, channel: Channel, state: Arc<NodeState>) {
    loop {
        let mut client = NodeClient::new(channel.clone());
        let call = client.info(InfoRequest {});
        let answered = tokio::select! {
            _ = state.follower.cancelled() => return,
            r = tokio::time::timeout(PROBE_TIMEOUT, call) => r,
        };
        if let Ok(Ok(info)) = answered {
            let info = info.into_inner();
            tracing::info!(node_id = %entry.node_id, role = entry.role.as_str(), model = %info.model_id, "node ready");
            *state.info.lock().unwrap_or_else(PoisonError::into_inner) = Some(info);
            return;
        }
        tokio::select! {
            _ = state.follower.cancelled() => return,
            _ = tokio::time::sleep(PROBE_INTERVAL) => {}
        }
    }
}

/// Follows one node's prefix cache (under `key` in the index) until `stop`: a snapshot, then numbered batches. A gap or a
/// broken stream means a fresh call and a fresh snapshot.
async fn follow_cache(
    key: String,
    channel: Channel,
    index: Arc<Mutex<PrefixIndex>>,
    state: Arc<NodeState>,
) {
    let stop = state.follower.clone();
    let mut backoff = Duration::from_millis(200);
    loop {
        let call = async {
            NodeClient::new(channel.clone())
                .cache_events(CacheEventsRequest {})
                .await
                .map(|r| r.into_inner())
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
                let batch = match msg {
                    Some(Ok(batch)) => batch,
                    Some(Err(status)) => {
                        // The connection died under it, as it does at once when the process
                        // is killed: no new work until it answers again.
                        tracing::debug!(node = %key, %status, "cache-event stream broke");
                        if state.health.mark_suspect() {
                            tracing::warn!(node = %key, "connection to the node broke; no new work until it answers a health check");
                            tokio::spawn(probe_until_healthy(
                                key.clone(),
                                channel.clone(),
                                Arc::clone(&state),
                            ));
                        }
                        break;
                    }
                    // A clean end: the node shut down after finishing its work.
                    None => break,
                };
                backoff = Duration::from_millis(200);
                let mut index = index.lock().unwrap_or_else(PoisonError::into_inner);
                if batch.snapshot {
                    index.apply_snapshot(&key, batch.seq, batch.events.iter().map(|e| e.hash));
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
                if let Err(gap) = index.apply_events(&key, batch.seq, &events) {
                    tracing::info!(node = %key, %gap, "cache events lost; resyncing from a snapshot");
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

/// Checks a suspect node until it answers, then routes to it again.
async fn probe_until_healthy(node: String, channel: Channel, state: Arc<NodeState>) {
    loop {
        tokio::select! {
            _ = state.follower.cancelled() => return,
            _ = tokio::time::sleep(CHECK_INTERVAL) => {}
        }
        if answers(&channel).await {
            state.health.clear_suspect();
            tracing::info!(%node, "suspect node answered a health check; routing to it again");
            return;
        }
    }
}

/// Checks a node whose registration ended without a drain until it registers again (kept) or
/// fails a check (removed).
async fn check_while_unregistered(
    key: NodeKey,
    channel: Channel,
    state: Arc<NodeState>,
    dead_tx: mpsc::UnboundedSender<NodeKey>,
) {
    loop {
        if !state.health.is_unregistered() {
            return;
        }
        if !answers(&channel).await {
            if state.health.is_unregistered() {
                tracing::info!(node_id = %key.1, role = key.0.as_str(), "unregistered node failed a health check; removing it");
                let _ = dead_tx.send(key);
            }
            return;
        }
        tokio::select! {
            _ = state.follower.cancelled() => return,
            _ = tokio::time::sleep(CHECK_INTERVAL) => {}
        }
    }
}
