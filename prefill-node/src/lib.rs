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
use node_common::grpc::{stop_server, GRPC_STOP_GRACE};
use node_common::kv::{KvArgs, KvBackend};
use node_common::membership::{node_record, ClusterArgs, Membership, WorkTracker};
use node_common::NodeError;
use proto::v1::prefill_server::PrefillServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Target of events that belong in a trace but not in the log (one per layer per request):
/// [`LOG_FILTER`] turns it off, while the trace filter (`info` by default) keeps it.
pub const TRACE_EVENTS_TARGET: &str = "fission_trace_events";

/// The log filter when `RUST_LOG` is unset.
pub const LOG_FILTER: &str = "info,fission_trace_events=off";

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
    // Cancelled once the drain is over: the server stops and the streams that never end by
    // themselves (CacheEvents) end.
    let server_stop = CancellationToken::new();
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
        stop_streams: server_stop.clone(),
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
        config.kv.kv_transport,
    );
    let membership = Membership::join(&config.cluster, record, state_rx.load.clone()).await?;
    shutdown.cancelled().await;
    membership.drain(state_rx.load.clone(), &work).await;
    server_stop.cancel();
    stop_server(server, GRPC_STOP_GRACE).await?;
    metrics_stop.cancel();
    let _ = metrics_task.await;
    tracing::info!(%node_id, "prefill node stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use testkit::span_capture::Captured;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::EnvFilter;

    use super::*;

    /// Events seen inside a span under `filter`, by message.
    fn seen_under(filter: &str) -> Vec<String> {
        let capture = Captured::default();
        let subscriber = tracing_subscriber::registry()
            .with(EnvFilter::new(filter))
            .with(capture.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("kv_transfer");
            let _in = span.enter();
            tracing::info!(target: TRACE_EVENTS_TARGET, layer = 0i64, "layer sent");
            tracing::info!("kv push failed");
        });
        capture.named("kv_transfer")[0]
            .1
            .events
            .iter()
            .filter_map(|e| Some(e.get("message")?.as_str()?.to_owned()))
            .collect()
    }

    #[test]
    fn trace_events_stay_out_of_the_default_log_but_not_the_trace() {
        assert_eq!(seen_under(LOG_FILTER), vec!["kv push failed"]);
        // The trace filter's default.
        assert_eq!(seen_under("info"), vec!["layer sent", "kv push failed"]);
    }
}
