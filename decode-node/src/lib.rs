//! The decode node: reserves KV blocks for prompts that prefill nodes push, receives the KV
//! layer by layer over the kvtransfer data plane, and generates in continuous batches; it can
//! also prefill locally (colocated mode).
//!
//! It must not route requests (the gateway does) and keeps all model state in its engine
//! thread.

mod actor;
mod metrics;
mod service;
mod sink;
mod spans;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvtransfer::{KvServer, QuicConfig, QuicServer, TcpConfig, TcpServer, TransferRegistry};
use node_common::engine_args::EngineArgs;
use node_common::engine_state::EngineState;
use node_common::grpc::{stop_server, GRPC_STOP_GRACE};
use node_common::kv::{KvArgs, KvBackend};
use node_common::membership::{node_record, ClusterArgs, Membership};
use node_common::NodeError;
use proto::v1::decode_server::DecodeServer;
use proto::ErrorCode;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::ERRORS;

pub use actor::EngineHandle;

#[derive(Args, Debug, Clone)]
pub struct DecodeConfig {
    /// Unique in the cluster; a random `decode-…` id by default.
    #[arg(long, env = "FISSION_NODE_ID")]
    pub node_id: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// How long a reservation waits for its KV before its blocks are freed.
    #[arg(long, env = "FISSION_KV_LEASE_MS", default_value_t = 10_000)]
    pub lease_ms: u64,
}

/// Sockets the node serves on, bound by the caller (tests bind port 0).
pub struct DecodeListeners {
    pub grpc: TcpListener,
    pub metrics: TcpListener,
    /// UDP (QUIC) or TCP address for the KV data plane.
    pub kv_addr: SocketAddr,
}

pub async fn run(
    config: DecodeConfig,
    listeners: DecodeListeners,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let metrics = node_common::metrics_http::install_recorder();
    crate::metrics::describe();
    let node_id = config
        .node_id
        .clone()
        .unwrap_or_else(|| node_common::membership::random_node_id("decode"));
    let started = config.engine.start_engine(&node_id, "decode").await?;
    let engine = started.engine;
    let mut info = started.info;
    let layout = engine.cache().desc();
    let (state, state_rx) = EngineState::new(layout.block_size);
    let handle = EngineHandle::spawn(engine, state);

    let registry = TransferRegistry::new(Default::default());
    let sink = Arc::new(sink::EngineSink {
        handle: handle.clone(),
    });
    // The data plane and /metrics outlive `shutdown`: a draining node still receives KV.
    let kv_shutdown = CancellationToken::new();
    // kvtransfer has no metrics of its own: a refused frame counts as this node's error.
    let count_refusal = |_: &kvtransfer::KvTransferError| ERRORS.count(ErrorCode::KvTransfer);
    let (kv_port, kv_task) = match config.kv.kv_transport {
        KvBackend::Quic => {
            let server =
                QuicServer::bind(listeners.kv_addr, &config.kv.tls()?, QuicConfig::default())?
                    .on_refusal(count_refusal);
            let port = server.local_addr()?.port();
            let task = tokio::spawn(server.serve(registry.clone(), sink, kv_shutdown.clone()));
            (port, task)
        }
        KvBackend::Tcp => {
            let server = TcpServer::bind(listeners.kv_addr, TcpConfig::default())
                .await?
                .on_refusal(count_refusal);
            let port = server.local_addr()?.port();
            let task = tokio::spawn(server.serve(registry.clone(), sink, kv_shutdown.clone()));
            (port, task)
        }
    };
    let kv_endpoint = format!("{}:{kv_port}", config.cluster.advertise_host);
    info.kv_endpoint = kv_endpoint.clone();
    // Cancelled once the drain is over: the server stops and the streams that never end by
    // themselves (CacheEvents) end.
    let server_stop = CancellationToken::new();
    let service = service::DecodeService::new(service::ServiceParts {
        handle,
        registry,
        layout,
        kv_endpoint: kv_endpoint.clone(),
        lease: Duration::from_millis(config.lease_ms),
        info: info.clone(),
        cache_log: Arc::clone(&state_rx.cache),
        drain: shutdown.clone(),
        stop_streams: server_stop.clone(),
    });
    let work = service.work.clone();
    let metrics_task = tokio::spawn(node_common::metrics_http::serve(
        listeners.metrics,
        metrics,
        kv_shutdown.clone(),
    ));
    let grpc_addr = listeners
        .grpc
        .local_addr()
        .map_err(|source| NodeError::Io {
            what: "grpc listener".into(),
            source,
        })?;
    tracing::info!(%node_id, %grpc_addr, %kv_endpoint, "decode node serving");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeServer::new(service))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listeners.grpc),
                server_stop.clone().cancelled_owned(),
            ),
    );
    let record = node_record(
        &info,
        cluster::Role::Decode,
        format!("{}:{}", config.cluster.advertise_host, grpc_addr.port()),
        kv_endpoint,
        config.kv.kv_transport,
    );
    let membership = Membership::join(&config.cluster, record, state_rx.load.clone()).await?;
    shutdown.cancelled().await;
    membership.drain(state_rx.load.clone(), &work).await;
    server_stop.cancel();
    stop_server(server, GRPC_STOP_GRACE).await?;
    kv_shutdown.cancel();
    let _ = kv_task.await;
    let _ = metrics_task.await;
    tracing::info!(%node_id, "decode node stopped");
    Ok(())
}
