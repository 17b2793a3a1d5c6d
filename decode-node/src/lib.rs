//! The decode node: reserves KV blocks for prompts that prefill nodes push, receives the KV
//! layer by layer over the kvtransfer data plane, and generates in continuous batches; it can
//! also prefill locally (colocated mode).
//!
//! It must not route requests (the gateway does) and keeps all model state in its engine
//! thread. Its life (engine start-up, `/metrics`, membership, drain) is `node_common::node`'s;
//! this crate is the `Decode` service, its KV receiver and the engine thread behind them.

mod actor;
mod metrics;
mod service;
mod session;
mod session_event;
mod sink;
mod spans;
mod transfers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use cluster::Role;
use kvtransfer::{BackendConfig, BackendServer, KvServer, TransferRegistry};
use node_common::launch::NodeRole;
use node_common::node::{NodeArgs, NodeListeners, RoleService, Started};
use node_common::NodeError;
use proto::v1::decode_server::DecodeServer;
use proto::ErrorCode;
use tokio_util::sync::CancellationToken;

use crate::metrics::ERRORS;

pub use actor::EngineHandle;

#[derive(Args, Debug, Clone)]
pub struct DecodeConfig {
    #[command(flatten)]
    pub node: NodeArgs,
    /// UDP (QUIC) or TCP address the KV data plane listens on; port 0 picks a free one.
    #[arg(long, env = "FISSION_KV_ADDR", default_value = "127.0.0.1:7200")]
    pub kv_addr: SocketAddr,
    /// How long a reservation lives without a Renew from the prefill node filling it: how
    /// soon the blocks of a dead or hung prefill node's transfer are freed. A prompt waiting in
    /// a prefill queue is renewed, so this does not bound queueing.
    #[arg(long, env = "FISSION_KV_LEASE_MS", default_value_t = 5_000)]
    pub lease_ms: u64,
    /// A request's stream carries a heartbeat when nothing else was sent for this long, so the
    /// gateway tells a slow request from a hung node.
    #[arg(long, env = "FISSION_HEARTBEAT_MS", default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// Link the prompt blocks this node already holds in its prefix cache (an earlier turn of
    /// the conversation) into each reservation, so that the prefill node pushes only the
    /// blocks after them. `false` pushes every prompt in full (the A/B baseline).
    #[arg(long, env = "FISSION_KV_DELTA", default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_delta: bool,
}

/// The decode role, for [`node_common::launch::launch`].
pub struct DecodeNode;

impl NodeRole for DecodeNode {
    type Config = DecodeConfig;
    const ROLE: Role = Role::Decode;
    const DEFAULT_GRPC_ADDR: &'static str = "127.0.0.1:7100";
    const DEFAULT_METRICS_ADDR: &'static str = "127.0.0.1:9100";

    async fn run(
        config: DecodeConfig,
        listeners: NodeListeners,
        shutdown: CancellationToken,
    ) -> Result<(), NodeError> {
        run(config, listeners, shutdown).await
    }
}

/// Serves a decode node on `listeners` (and its KV receiver on `config.kv_addr`) until
/// `shutdown` and its drain end.
pub async fn run(
    config: DecodeConfig,
    listeners: NodeListeners,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    node_common::node::serve(Role::Decode, &config.node, listeners, shutdown, |s| async {
        build(s, &config).await
    })
    .await
}

async fn build(s: Started, config: &DecodeConfig) -> Result<RoleService, NodeError> {
    crate::metrics::describe();
    let handle = EngineHandle::spawn(s.engine, s.state);
    let registry = TransferRegistry::new(Default::default());
    let transfers = transfers::Transfers::default();
    let sink = Arc::new(sink::EngineSink {
        handle: handle.clone(),
        transfers: transfers.clone(),
    });
    // kvtransfer has no metrics of its own: a refused frame counts as this node's error.
    let count_refusal = |_: &kvtransfer::KvTransferError| ERRORS.count(ErrorCode::KvTransfer);
    // The data plane outlives the drain: a draining node still receives the KV of work it
    // accepted.
    let stop = s.data_plane_stop.clone();
    let server = BackendServer::bind(
        s.kv_backend,
        config.kv_addr,
        s.kv_identity.as_ref(),
        BackendConfig::default(),
    )
    .await?
    .on_refusal(count_refusal);
    let kv_endpoint = server.endpoint(&s.advertise_host)?;
    // Shared memory beside the network for prefill nodes on this host, into the same registry
    // (issue 34): each reservation names it and this host, and such a prefill node picks it.
    let (kv_shm_endpoint, shm_task) = if s.kv_same_host_shm {
        let shm = BackendServer::bind(
            kvtransfer::KvBackend::Shm,
            config.kv_addr,
            s.kv_identity.as_ref(),
            BackendConfig::default(),
        )
        .await?
        .on_refusal(count_refusal);
        let endpoint = shm.endpoint(&s.advertise_host)?;
        let task = tokio::spawn(shm.serve(registry.clone(), Arc::clone(&sink), stop.clone()));
        (endpoint, Some(task))
    } else {
        (String::new(), None)
    };
    let kv_task = tokio::spawn(server.serve(registry.clone(), sink, stop));
    let mut info = s.info;
    info.kv_endpoint = kv_endpoint.clone();
    let service = service::DecodeService {
        ctx: Arc::new(session::SessionCtx {
            handle,
            registry,
            transfers,
            layout: s.layout,
            kv_endpoint: kv_endpoint.clone(),
            kv_shm_endpoint,
            host_id: node_common::membership::host_id(),
            lease: Duration::from_millis(config.lease_ms),
            heartbeat: Duration::from_millis(config.heartbeat_ms.max(1)),
            kv_delta: config.kv_delta,
            stop: s.stop_streams,
        }),
        info: info.clone(),
        next_seq: Arc::new(std::sync::atomic::AtomicU64::new(1)),
        work: s.work,
        drain: s.drain,
    };
    let kv_task = tokio::spawn(async move {
        if let Ok(Err(error)) = kv_task.await {
            tracing::error!(%error, "kv receiver failed");
        }
        if let Some(Ok(Err(error))) = match shm_task {
            Some(task) => Some(task.await),
            None => None,
        } {
            tracing::error!(%error, "kv shm receiver failed");
        }
    });
    Ok(RoleService {
        routes: tonic::service::Routes::new(DecodeServer::new(service)),
        info,
        kv_endpoint,
        data_plane: vec![kv_task],
    })
}
