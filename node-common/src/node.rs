//! One node's life, written once for both roles: the engine's start-up off the runtime, the
//! engine thread's published state, `/metrics`, the gRPC server (the role's service plus the
//! shared [`NodeService`]), membership in etcd, and the drain that ends it. A role only says
//! how to build its service on a started engine.

use std::future::Future;
use std::sync::Arc;

use clap::Args;
use cluster::Role;
use engine::engine::Engine;
use identity::{GrpcSecurity, PeerRole, TlsArgs, TlsIdentity};
use kv_types::KvLayout;
use proto::v1::NodeInfo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::access::AccessLayer;
use crate::engine_args::EngineArgs;
use crate::engine_state::EngineState;
use crate::error::NodeError;
use crate::etcd_status::EtcdStatus;
use crate::grpc::{stop_server, GRPC_STOP_GRACE};
use crate::kv::KvArgs;
use crate::membership::{node_record, random_node_id, ClusterArgs, Membership, WorkTracker};
use crate::node_service::NodeService;

/// The flags both roles take.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Unique in the cluster among nodes of its role; a random `{role}-…` id by default.
    #[arg(long, env = "FISSION_NODE_ID")]
    pub node_id: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Sockets every node serves on, bound by the caller (tests bind port 0).
pub struct NodeListeners {
    pub grpc: TcpListener,
    pub metrics: TcpListener,
}

/// A node whose engine is loaded, handed to its role to build the service on.
pub struct Started {
    pub node_id: String,
    pub engine: Engine,
    pub layout: KvLayout,
    /// What `Info` answers; the role may complete it (its KV endpoint).
    pub info: NodeInfo,
    /// The engine thread's publishing end: pass it to the thread.
    pub state: EngineState,
    /// Cancelled when the drain starts (SIGTERM or the Drain RPC): new work is refused.
    pub drain: CancellationToken,
    /// Work outside the engine (token streams, KV pushes) the drain must wait for.
    pub work: WorkTracker,
    /// Cancelled once the gRPC server has stopped: a draining node still receives KV and is
    /// still observed until then.
    pub data_plane_stop: CancellationToken,
    /// Cancelled once the drain is over (its work done, or its deadline passed): streams still
    /// open then end, so the gRPC server can stop.
    pub stop_streams: CancellationToken,
    /// Host put in the endpoints the node advertises.
    pub advertise_host: String,
    /// The address the node serves gRPC on: its outgoing KV connections leave from it too.
    pub listen_ip: std::net::IpAddr,
    /// How the node's gRPC channels are secured, for the clients it opens (prefill to decode).
    pub grpc: GrpcSecurity,
    /// The KV data plane (`--kv-transport`), for `kvtransfer`'s server and transport.
    pub kv_backend: kvtransfer::KvBackend,
    /// The identity the KV transport uses; `None` for the `--insecure` TCP backend.
    pub kv_identity: Option<TlsIdentity>,
    /// Shared memory for peers on this host beside `kv_backend` (`--kv-same-host-shm`), with
    /// `kv_identity` on its socket when there is one.
    pub kv_same_host_shm: bool,
}

/// What a role built on a [`Started`] node.
pub struct RoleService {
    /// The role's gRPC service.
    pub routes: tonic::service::Routes,
    pub info: NodeInfo,
    /// `host:port` of the node's KV receiver; empty for prefill nodes.
    pub kv_endpoint: String,
    /// Tasks that end after `data_plane_stop` (the KV receiver); awaited before exit.
    pub data_plane: Vec<JoinHandle<()>>,
}

/// Runs a node of `role` until `shutdown` and its drain are over.
pub async fn serve<F, Fut>(
    role: Role,
    args: &NodeArgs,
    listeners: NodeListeners,
    shutdown: CancellationToken,
    build: F,
) -> Result<(), NodeError>
where
    F: FnOnce(Started) -> Fut,
    Fut: Future<Output = Result<RoleService, NodeError>>,
{
    // A CUDA request in a CPU build fails first, before certificates, etcd or weights.
    args.engine.device.check_compiled()?;
    let metrics = crate::metrics_http::install_recorder();
    // The identity is checked before the engine loads: a wrong certificate fails in
    // milliseconds, not after the weights.
    let grpc_security = args.tls.grpc(match role {
        Role::Prefill => PeerRole::Prefill,
        Role::Decode => PeerRole::Decode,
    })?;
    let kv_identity = args.kv.identity(&args.tls)?;
    // So is etcd's password.
    if let Some(etcd) = args.cluster.etcd_config()? {
        etcd.check_access()
            .await
            .map_err(|e| NodeError::Config(format!("etcd: {e}")))?;
    }
    let grpc_addr = listeners
        .grpc
        .local_addr()
        .map_err(|source| NodeError::Io {
            what: "grpc listener".into(),
            source,
        })?;
    let node_id = args
        .node_id
        .clone()
        .unwrap_or_else(|| random_node_id(role.as_str()));
    let loaded = args.engine.start_engine(&node_id, role.as_str()).await?;
    let layout = loaded.engine.cache().layout();
    let (state, state_rx) = EngineState::new();
    let work = WorkTracker::default();
    let data_plane_stop = CancellationToken::new();
    // /metrics outlives `shutdown`: a draining node is still observed.
    let etcd_status = EtcdStatus::new(role.as_str(), !args.cluster.etcd.is_empty());
    let metrics_task = tokio::spawn(crate::metrics_http::serve(
        listeners.metrics,
        metrics,
        etcd_status.clone(),
        data_plane_stop.clone(),
    ));
    // Cancelled once the drain is over: the server stops and the streams that never end by
    // themselves (CacheEvents, requests still open at the drain deadline) end.
    let server_stop = CancellationToken::new();
    let service = build(Started {
        node_id: node_id.clone(),
        engine: loaded.engine,
        layout,
        info: loaded.info,
        state,
        drain: shutdown.clone(),
        work: work.clone(),
        data_plane_stop: data_plane_stop.clone(),
        stop_streams: server_stop.clone(),
        advertise_host: args.cluster.advertise_host.clone(),
        listen_ip: grpc_addr.ip(),
        grpc: grpc_security.clone(),
        kv_backend: args.kv.kv_transport,
        kv_identity,
        kv_same_host_shm: args.kv.same_host_shm(),
    })
    .await?;
    let node_service = NodeService {
        info: service.info.clone(),
        cache_log: Arc::clone(&state_rx.cache),
        drain: shutdown.clone(),
        stop_streams: server_stop.clone(),
    };
    tracing::info!(%node_id, role = role.as_str(), %grpc_addr, kv_endpoint = %service.kv_endpoint, "node serving");
    let server = tokio::spawn(
        grpc_security
            .server()?
            .layer(AccessLayer::new(&grpc_security))
            .add_routes(service.routes)
            .add_service(node_service.into_server())
            .serve_with_incoming_shutdown(
                // Tokens and heartbeats are small writes: without TCP_NODELAY each waits for
                // the peer's delayed ACK (about 40 ms), the floor of every TTFT and TPOT.
                tonic::transport::server::TcpIncoming::from(listeners.grpc)
                    .with_nodelay(Some(true)),
                server_stop.clone().cancelled_owned(),
            ),
    );
    let record = node_record(
        &service.info,
        layout,
        role,
        format!("{}:{}", args.cluster.advertise_host, grpc_addr.port()),
        service.kv_endpoint,
        args.kv.kv_transport,
    );
    let membership =
        Membership::join(&args.cluster, record, state_rx.load.clone(), etcd_status).await?;
    shutdown.cancelled().await;
    membership.drain(state_rx.load.clone(), &work).await;
    server_stop.cancel();
    stop_server(server, GRPC_STOP_GRACE).await?;
    data_plane_stop.cancel();
    for task in service.data_plane {
        let _ = task.await;
    }
    let _ = metrics_task.await;
    tracing::info!(%node_id, role = role.as_str(), "node stopped");
    Ok(())
}
