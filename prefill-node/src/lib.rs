//! The prefill node: computes prompts (chunked prefill, prefix caching) and pushes each layer's
//! KV into the blocks a decode node reserved as soon as that layer is computed, then returns
//! the first token. It must not route requests or hold sequences past their first token.

mod actor;
mod metrics;
mod push;
mod service;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use clap::Args;
use kvtransfer::{QuicConfig, QuicTransport, TcpConfig, TcpTransport};
use node_common::engine_args::EngineArgs;
use node_common::engine_state::EngineState;
use node_common::kv::{KvArgs, KvBackend};
use node_common::membership::{node_record, ClusterArgs, Membership, WorkTracker};
use node_common::NodeError;
use proto::v1::prefill_server::PrefillServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug, Clone)]
pub struct PrefillConfig {
    /// Unique in the cluster; a random `prefill-…` id by default.
    #[arg(long, env = "FISSION_NODE_ID")]
    pub node_id: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub kv: KvArgs,
}

pub struct PrefillListeners {
    pub grpc: TcpListener,
    pub metrics: TcpListener,
}

pub async fn run(
    config: PrefillConfig,
    listeners: PrefillListeners,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let metrics = node_common::metrics_http::install_recorder();
    crate::metrics::describe();
    let node_id = config
        .node_id
        .clone()
        .unwrap_or_else(|| node_common::membership::random_node_id("prefill"));
    let started = config.engine.start_engine(&node_id, "prefill").await?;
    let engine = started.engine;
    let info = started.info;
    let layout = engine.cache().desc();
    let (state, state_rx) = EngineState::new(layout.block_size);
    let handle = actor::EngineHandle::spawn(engine, state);
    let transport = match config.kv.kv_transport {
        KvBackend::Quic => push::Transport::Quic(QuicTransport::new(
            &config.kv.tls()?,
            QuicConfig::default(),
        )?),
        KvBackend::Tcp => push::Transport::Tcp(TcpTransport::new(TcpConfig::default())),
    };
    let service = service::PrefillService {
        handle,
        transport: Arc::new(transport),
        clients: push::DecodeClients::default(),
        layout,
        info: info.clone(),
        next_seq: AtomicU64::new(1),
        work: WorkTracker::default(),
        cache_log: Arc::clone(&state_rx.cache),
        drain: shutdown.clone(),
    };
    let work = service.work.clone();
    // /metrics outlives `shutdown`: a draining node is still observed.
    let metrics_stop = CancellationToken::new();
    let metrics_task = tokio::spawn(node_common::metrics_http::serve(
        listeners.metrics,
        metrics,
        metrics_stop.clone(),
    ));
    let grpc_addr = listeners
        .grpc
        .local_addr()
        .map_err(|source| NodeError::Io {
            what: "grpc listener".into(),
            source,
        })?;
    tracing::info!(%node_id, %grpc_addr, "prefill node serving");
    let server_stop = CancellationToken::new();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PrefillServer::new(service))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listeners.grpc),
                server_stop.clone().cancelled_owned(),
            ),
    );
    let record = node_record(
        &info,
        cluster::Role::Prefill,
        format!("{}:{}", config.cluster.advertise_host, grpc_addr.port()),
        String::new(),
    );
    let membership = Membership::join(&config.cluster, record, state_rx.load.clone()).await?;
    shutdown.cancelled().await;
    membership.drain(state_rx.load.clone(), &work).await;
    server_stop.cancel();
    server
        .await
        .map_err(|e| NodeError::Grpc(e.to_string()))?
        .map_err(|e| NodeError::Grpc(e.to_string()))?;
    metrics_stop.cancel();
    let _ = metrics_task.await;
    tracing::info!(%node_id, "prefill node stopped");
    Ok(())
}
