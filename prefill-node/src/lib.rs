//! The prefill node: computes prompts (chunked prefill, prefix caching) and pushes each layer's
//! KV into the blocks a decode node reserved as soon as that layer is computed, then returns
//! the first token. It must not route requests or hold sequences past their first token.
//!
//! Its life (engine start-up, `/metrics`, membership, drain) is `node_common::node`'s; this
//! crate is the `Prefill` service and the engine thread behind it.

mod actor;
mod metrics;
mod prompt;
mod push;
mod service;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use clap::Args;
use cluster::Role;
use kvtransfer::{BackendConfig, BackendTransport};
use node_common::launch::NodeRole;
use node_common::node::{NodeArgs, NodeListeners, RoleService, Started};
use node_common::NodeError;
use proto::v1::prefill_server::PrefillServer;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug, Clone)]
pub struct PrefillConfig {
    #[command(flatten)]
    pub node: NodeArgs,
    /// A prompt's call carries a heartbeat when nothing else was sent for this long, so the
    /// gateway tells a long queue from a hung node.
    #[arg(long, env = "FISSION_HEARTBEAT_MS", default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// Hold every layer's KV until the whole prompt is computed, then push it: the baseline
    /// that layer-wise push (the default, each layer sent while the next computes) is
    /// measured against. For benchmarks.
    #[arg(long, env = "FISSION_PUSH_AFTER_PREFILL")]
    pub push_after_prefill: bool,
}

/// The prefill role, for [`node_common::launch::launch`].
pub struct PrefillNode;

impl NodeRole for PrefillNode {
    type Config = PrefillConfig;
    const ROLE: Role = Role::Prefill;
    const DEFAULT_GRPC_ADDR: &'static str = "127.0.0.1:7000";
    const DEFAULT_METRICS_ADDR: &'static str = "127.0.0.1:9000";

    async fn run(
        config: PrefillConfig,
        listeners: NodeListeners,
        shutdown: CancellationToken,
    ) -> Result<(), NodeError> {
        run(config, listeners, shutdown).await
    }
}

/// Serves a prefill node on `listeners` until `shutdown` and its drain end.
pub async fn run(
    config: PrefillConfig,
    listeners: NodeListeners,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let heartbeat = std::time::Duration::from_millis(config.heartbeat_ms.max(1));
    let push_after_prefill = config.push_after_prefill;
    node_common::node::serve(
        Role::Prefill,
        &config.node,
        listeners,
        shutdown,
        |s| async move { build(s, heartbeat, push_after_prefill) },
    )
    .await
}

fn build(
    s: Started,
    heartbeat: std::time::Duration,
    push_after_prefill: bool,
) -> Result<RoleService, NodeError> {
    crate::metrics::describe();
    // The certificate this node pushes KV with, by which a decode node admits its frames into
    // the reservations the gateway gives it (issue 31).
    let mut info = s.info;
    if let Some(der) = s.kv_identity.as_ref().and_then(|i| i.cert_der()) {
        info.kv_identity = kvtransfer::peer_fingerprint(der).to_vec();
    }
    // Pushes leave from the node's own address, not every interface.
    let transport = BackendTransport::new(
        s.kv_backend,
        s.kv_identity.as_ref(),
        BackendConfig::sender(
            s.listen_ip,
            // Nodes whose certificates share one name (a pool behind one Secret) are
            // checked by that name on the KV channel as on gRPC (`--tls-server-name`).
            match &s.grpc {
                identity::GrpcSecurity::Mtls { server_name, .. } => server_name.clone(),
                identity::GrpcSecurity::Insecure => None,
            },
        ),
    )?;
    // Shared memory to decode nodes on this host, the network to the others (issue 34).
    let mut transport =
        kvtransfer::PickingTransport::from(transport).on_host(node_common::membership::host_id());
    if s.kv_same_host_shm {
        let mut shm = BackendConfig::sender(s.listen_ip, None).shm;
        shm.server_name = match &s.grpc {
            identity::GrpcSecurity::Mtls { server_name, .. } => server_name.clone(),
            identity::GrpcSecurity::Insecure => None,
        };
        let shm = kvtransfer::ShmTransport::new(shm);
        let shm = match s.kv_identity.as_ref() {
            Some(identity) => shm.with_identity(identity)?,
            None => shm,
        };
        transport = transport.with_same_host_shm(shm, node_common::membership::host_id());
    }
    let service = service::PrefillService {
        handle: actor::EngineHandle::spawn(s.engine, s.state, push_after_prefill),
        transport: Arc::new(transport),
        clients: push::DecodeClients::new(s.grpc.clone()),
        layout: s.layout,
        info: info.clone(),
        next_seq: AtomicU64::new(1),
        work: s.work,
        drain: s.drain,
        stop_streams: s.stop_streams,
        heartbeat,
    };
    Ok(RoleService {
        routes: tonic::service::Routes::new(PrefillServer::new(service)),
        info,
        kv_endpoint: String::new(),
        data_plane: Vec::new(),
    })
}
