//! A draining prefill node refuses new prompts with Unavailable while the work it holds (a KV
//! push) keeps it draining, and exits at the drain deadline although a router still holds its
//! never-ending CacheEvents stream open; its exposition passes promtool. A real prefill node
//! over real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use node_common::test_util::{
    assert_drain_started, assert_exits_with_cache_events_open, assert_refused_as_draining,
    follow_cache_events,
};
use prefill_node::PrefillNode;
use proto::v1::node_client::NodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{
    prefill_event, CacheEventsRequest, DrainRequest, GenerationSpec, InfoRequest, KvDestination,
    PrefillRequest, Reserved, StoppingCriteria,
};
use testkit::metrics::{assert_exposition, scrape};
use testkit::serving::wait_until_serving;
use tonic::transport::Channel;

fn prompt(request_id: &str, dest: Option<KvDestination>) -> PrefillRequest {
    PrefillRequest {
        spec: Some(GenerationSpec {
            request_id: request_id.into(),
            prompt_ids: (0..8).map(|i| 300 + i).collect(),
            stopping: Some(StoppingCriteria {
                max_new_tokens: 4,
                ..Default::default()
            }),
            ..Default::default()
        }),
        dest,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_node_refuses_prompts_and_exits_with_a_cache_events_stream_open() {
    let dir = testkit::shared_model("stories260K");
    let spawned = node_common::test_util::spawn::<PrefillNode>(&[
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--num-kv-blocks",
        "32",
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
        "--insecure",
        "--drain-timeout-s",
        "2",
    ])
    .await;
    let mut node = spawned.task;
    let addr = spawned.grpc_addr;
    let channel = wait_until_serving(&node, || async move {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .ok()?
            .connect()
            .await
            .ok()?;
        NodeClient::new(channel.clone())
            .info(InfoRequest {})
            .await
            .ok()?;
        Some(channel)
    })
    .await;
    let mut client = PrefillClient::new(channel.clone());
    let mut node_client = NodeClient::new(channel);
    let info = node_client
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
    let mut pushing = client
        .prefill(prompt(
            "pushing",
            Some(KvDestination {
                decode_endpoint: "127.0.0.1:1".into(),
                reserved: Some(Reserved {
                    kv_endpoint,
                    xfer_id: 1,
                    epoch: 1,
                    block_ids: vec![0, 1],
                    layout: info.layout,
                    lease_ms: 10_000,
                    ..Default::default()
                }),
            }),
        ))
        .await
        .expect("the prompt is taken")
        .into_inner();
    // The prompt is computed; its push hangs.
    loop {
        let event = pushing.message().await.expect("events").expect("an event");
        match event.event {
            Some(prefill_event::Event::First(_)) => break,
            Some(prefill_event::Event::Heartbeat(_)) => continue,
            other => panic!("expected the first token, got {other:?}"),
        }
    }

    let mut events =
        follow_cache_events(node_client.cache_events(CacheEventsRequest {}).await).await;

    assert_drain_started(node_client.drain(DrainRequest {}).await);
    let refused = client
        .prefill(prompt("late", None))
        .await
        .expect_err("no new prompt while draining");
    assert_refused_as_draining(&refused);
    // The drain holds for its deadline (2 s): /metrics is still up.
    assert_exposition(
        &scrape(spawned.metrics_addr).await,
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
