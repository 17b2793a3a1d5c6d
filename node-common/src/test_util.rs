//! For the nodes' tests only (the `test-util` feature, which only their dev-dependencies turn
//! on): a small real engine built from the same flags a node parses, a local Prometheus
//! recorder, and the checks of the drain contract both nodes keep.

use std::time::{Duration, Instant};

use clap::Parser;
use engine::engine::Engine;
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use proto::v1::{CacheEventBatch, DrainResponse};
use tokio::task::JoinHandle;
use tonic::codec::Streaming;

use crate::engine_args::EngineArgs;
use crate::error::NodeError;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
}

/// stories260K with 64 blocks of 4 and a prefill budget of 8 tokens per step.
pub fn stories_engine() -> Engine {
    let dir = testkit::shared_model("stories260K");
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
    Engine::new(model, args.engine.engine_config()).expect("engine starts")
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
