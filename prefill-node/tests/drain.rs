//! A draining prefill node refuses new prompts with Unavailable while the work it holds (a KV
//! push) keeps it draining, and exits at the drain deadline although a router still holds its
//! never-ending CacheEvents stream open; its exposition passes promtool. A real prefill node
//! over real sockets, in-process.

use std::time::Duration;

use clap::Parser;
use node_common::test_util::{
    assert_drain_started, assert_exits_with_cache_events_open, assert_refused_as_draining,
    follow_cache_events,
};
use prefill_node::{PrefillConfig, PrefillListeners};
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{
    CacheEventsRequest, DrainRequest, InfoRequest, KvDestination, PrefillRequest, StoppingCriteria,
};
use testkit::metrics::{assert_exposition, scrape};
use testkit::serving::{wait_until_serving, NodeSockets};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    config: PrefillConfig,
}

fn prompt(request_id: &str, dest: Option<KvDestination>) -> PrefillRequest {
    PrefillRequest {
        request_id: request_id.into(),
        prompt_ids: (0..8).map(|i| 300 + i).collect(),
        sampling: None,
        stopping: Some(StoppingCriteria {
            max_new_tokens: 4,
            ..Default::default()
        }),
        dest,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_node_refuses_prompts_and_exits_with_a_cache_events_stream_open() {
    let dir = testkit::shared_model("stories260K");
    let args = Args::parse_from([
        "prefill",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--num-kv-blocks",
        "32",
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
        "--drain-timeout-s",
        "2",
    ]);
    let sockets = NodeSockets::bind().await;
    let shutdown = CancellationToken::new();
    let mut node = tokio::spawn(prefill_node::run(
        args.config,
        PrefillListeners {
            grpc: sockets.grpc,
            metrics: sockets.metrics,
        },
        shutdown.clone(),
    ));
    let addr = sockets.grpc_addr;
    let mut client = wait_until_serving(&node, || async move {
        let client = PrefillClient::connect(format!("http://{addr}"))
            .await
            .ok()?;
        client.clone().info(InfoRequest {}).await.ok()?;
        Some(client)
    })
    .await;
    let info = client
        .info(InfoRequest {})
        .await
        .expect("info")
        .into_inner();

    // A decode node whose KV receiver accepts connections and never answers: the push of the
    // prompt below hangs, and with it the drain, until the drain deadline.
    let kv = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let kv_endpoint = kv.local_addr().expect("addr").to_string();
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = kv.accept().await {
            held.push(conn);
        }
    });
    client
        .prefill(prompt(
            "pushing",
            Some(KvDestination {
                kv_endpoint,
                xfer_id: 1,
                epoch: 1,
                block_ids: vec![0, 1],
                decode_endpoint: "127.0.0.1:1".into(),
                layout: info.layout.clone(),
            }),
        ))
        .await
        .expect("the prompt is computed; its push hangs");

    let mut events = follow_cache_events(client.cache_events(CacheEventsRequest {}).await).await;

    assert_drain_started(client.drain(DrainRequest {}).await);
    let refused = client
        .prefill(prompt("late", None))
        .await
        .expect_err("no new prompt while draining");
    assert_refused_as_draining(&refused);
    // The drain holds for its deadline (2 s): /metrics is still up.
    assert_exposition(
        &scrape(sockets.metrics_addr).await,
        &[
            "fission_prefill_errors_total{error_type=\"unavailable\"} 1",
            "fission_prefill_batch_size_count 1",
            "fission_prefill_queue_time_seconds_count 1",
            "# TYPE fission_prefill_prefix_cache_hit_blocks_total counter",
        ],
    );

    // The push never ends; the drain gives up after 2 s, and the open CacheEvents stream does
    // not hold the node past that.
    assert_exits_with_cache_events_open(&mut node, Duration::from_secs(6), &mut events).await;
}
