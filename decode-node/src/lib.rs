//! The decode node: reserves KV blocks for prompts that prefill nodes push, receives the KV
//! layer by layer over the kvtransfer data plane, and generates in continuous batches; it can
//! also prefill locally (colocated mode).
//!
//! It must not route requests (the gateway does) and keeps all model state in its engine
//! thread.

mod actor;
mod service;
mod sink;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvtransfer::{KvServer, QuicConfig, QuicServer, TcpConfig, TcpServer, TransferRegistry};
use node_common::engine_args::EngineArgs;
use node_common::kv::{KvArgs, KvBackend};
use node_common::NodeError;
use proto::v1::decode_server::DecodeServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use actor::EngineHandle;

#[derive(Args, Debug, Clone)]
pub struct DecodeConfig {
    #[arg(long, env = "FISSION_NODE_ID", default_value = "decode-0")]
    pub node_id: String,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// How long a reservation waits for its KV before its blocks are freed.
    #[arg(long, env = "FISSION_KV_LEASE_MS", default_value_t = 10_000)]
    pub lease_ms: u64,
    /// Host put in the kv_endpoint given to prefill nodes.
    #[arg(long, env = "FISSION_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,
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
    let started = config
        .engine
        .start_engine(&config.node_id, "decode")
        .await?;
    let engine = started.engine;
    let mut info = started.info;
    let layout = engine.cache().desc();
    let handle = EngineHandle::spawn(engine);

    let registry = TransferRegistry::new(Default::default());
    let sink = Arc::new(sink::EngineSink {
        handle: handle.clone(),
    });
    let kv_shutdown = shutdown.child_token();
    let (kv_port, kv_task) = match config.kv.kv_transport {
        KvBackend::Quic => {
            let server =
                QuicServer::bind(listeners.kv_addr, &config.kv.tls()?, QuicConfig::default())?;
            let port = server.local_addr()?.port();
            let task = tokio::spawn(server.serve(registry.clone(), sink, kv_shutdown.clone()));
            (port, task)
        }
        KvBackend::Tcp => {
            let server = TcpServer::bind(listeners.kv_addr, TcpConfig::default()).await?;
            let port = server.local_addr()?.port();
            let task = tokio::spawn(server.serve(registry.clone(), sink, kv_shutdown.clone()));
            (port, task)
        }
    };
    let kv_endpoint = format!("{}:{kv_port}", config.advertise_host);
    info.kv_endpoint = kv_endpoint.clone();
    let service = service::DecodeService::new(
        handle,
        registry,
        layout,
        kv_endpoint.clone(),
        Duration::from_millis(config.lease_ms),
        info,
    );
    let metrics_task = tokio::spawn(node_common::metrics_http::serve(
        listeners.metrics,
        metrics,
        shutdown.clone(),
    ));
    let grpc_addr = listeners
        .grpc
        .local_addr()
        .map_err(|source| NodeError::Io {
            what: "grpc listener".into(),
            source,
        })?;
    tracing::info!(node_id = %config.node_id, %grpc_addr, %kv_endpoint, "decode node serving");
    tonic::transport::Server::builder()
        .add_service(DecodeServer::new(service))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listeners.grpc),
            shutdown.cancelled(),
        )
        .await
        .map_err(|e| NodeError::Grpc(e.to_string()))?;
    kv_shutdown.cancel();
    let _ = kv_task.await;
    let _ = metrics_task.await;
    tracing::info!(node_id = %config.node_id, "decode node stopped");
    Ok(())
}
