//! For the nodes' tests only (the `test-util` feature, which only their dev-dependencies turn
//! on): a real node of either role started in-process on free ports, a small real engine built
//! from the same flags a node parses, a local Prometheus recorder, and the checks of the drain
//! contract both nodes keep.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;
use engine::engine::Engine;
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use proto::v1::{CacheEventBatch, DrainResponse};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::codec::Streaming;

use crate::engine_args::EngineArgs;
use crate::error::NodeError;
use crate::launch::NodeRole;
use crate::node::NodeListeners;

/// A node of some role running in this process.
pub struct SpawnedNode {
    /// The role's `run`: ends when the node has stopped.
    pub task: JoinHandle<Result<(), NodeError>>,
    pub shutdown: CancellationToken,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
}

#[derive(Parser)]
struct RoleFlags<C: clap::Args> {
    #[command(flatten)]
    config: C,
}

/// Starts a node of role `R` with `flags` (its role's flags, as on its command line) on free
/// ports of 127.0.0.1. It may not answer yet: wait for it (testkit's `wait_until_serving`).
pub async fn spawn<R: NodeRole>(flags: &[&str]) -> SpawnedNode {
    let argv = std::iter::once("node").chain(flags.iter().copied());
    let config = RoleFlags::<R::Config>::parse_from(argv).config;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let (grpc_addr, metrics_addr) = (
        grpc.local_addr().expect("addr"),
        metrics.local_addr().expect("addr"),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(R::run(
        config,
        NodeListeners { grpc, metrics },
        shutdown.clone(),
    ));
    SpawnedNode {
        task,
        shutdown,
        grpc_addr,
        metrics_addr,
    }
}

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
}

/// The model in `dir` (stories260K in the nodes' tests) with 64 blocks of 4 and a prefill
/// budget of 8 tokens per step.
pub fn stories_engine(dir: &std::path::Path) -> Engine {
    let args = Args::parse_from([
        "node",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--num-kv-blocks",
        "64",
        "--block-size",
        "4",
        "--max-batch-prefill-tokens",
        "8",
    ]);
    let model = args.engine.load_model().expect("stories260K loads");
    Engine::with_full_kv(model, args.engine.engine_config()).expect("engine starts")
}

/// A recorder with the buckets every component uses, for `metrics::with_local_recorder`, and
/// the handle that renders what it recorded.
pub fn local_recorder() -> (PrometheusRecorder, PrometheusHandle) {
    let recorder = telemetry::prometheus_builder()
        .expect("buckets")
        .build_recorder();
    let handle = recorder.handle();
    (recorder, handle)
}

/// Follows a node's CacheEvents, as a router does, from the answer to the call; its first
/// message is the snapshot.
pub async fn follow_cache_events(
    answer: Result<tonic::Response<Streaming<CacheEventBatch>>, tonic::Status>,
) -> Streaming<CacheEventBatch> {
    let mut events = answer.expect("cache events").into_inner();
    assert!(
        events
            .message()
            .await
            .expect("snapshot")
            .expect("snapshot")
            .snapshot
    );
    events
}

/// The answer to a Drain call that started the drain.
pub fn assert_drain_started(answer: Result<tonic::Response<DrainResponse>, tonic::Status>) {
    assert!(answer.expect("drain").into_inner().started);
}

/// What a draining node answers new work with: Unavailable, which the gateway takes as "try
/// another node", saying why.
pub fn assert_refused_as_draining(refused: &tonic::Status) {
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("draining"),
        "{}",
        refused.message()
    );
}

/// A drained node's task ends cleanly within `limit` although its follower never closed
/// `events`; the follower then gets what was published before the stop, and the end.
pub async fn assert_exits_with_cache_events_open(
    node: &mut JoinHandle<Result<(), NodeError>>,
    limit: Duration,
    events: &mut Streaming<CacheEventBatch>,
) {
    let started = Instant::now();
    tokio::time::timeout(limit, node)
        .await
        .expect("the drained node exits although a CacheEvents stream was open")
        .expect("join")
        .expect("clean shutdown");
    assert!(started.elapsed() < limit);
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = events.message().await {}
    })
    .await
    .expect("the cache events stream ends");
}
