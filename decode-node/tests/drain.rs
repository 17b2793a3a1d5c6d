//! A draining decode node refuses new work (remote or local Generate) with Unavailable, still
//! serves the reservation it already holds (its KV, Done and token stream), and then exits
//! although a router still holds its never-ending CacheEvents stream open. A real decode node
//! over real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kv_types::{KvLayout, TransferId};
use kvtransfer::{KvConnection, KvDtype, KvTransport, LayerHeader, TcpTransport};
use node_common::test_util::{
    assert_drain_started, assert_exits_with_cache_events_open, assert_refused_as_draining,
    follow_cache_events,
};
use proto::v1::{
    CacheEventsRequest, DoneRequest, DrainRequest, FinishReason, GenerateStart, Token,
};
use testkit::metrics::{assert_exposition, scrape};

/// While the node drains: a stray KV frame counts as an error, and the exposition passes
/// promtool.
async fn check_metrics_while_draining(
    kept: &proto::v1::Reserved,
    metrics_addr: std::net::SocketAddr,
) {
    // A frame for a transfer the node does not know is refused, and counted as its error.
    let conn = TcpTransport::default()
        .connect(&kept.kv_endpoint)
        .await
        .expect("kv connect");
    let stray = LayerHeader {
        xfer_id: TransferId(999),
        epoch: 1,
        layer: 0,
        layout: KvLayout {
            dtype: KvDtype::F32,
            num_layers: 1,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            windows: Default::default(),
        },
        block_ids: Arc::from(vec![0u32]),
        traceparent: None,
    };
    conn.send_layer(stray, Bytes::from(vec![0u8; 128]))
        .await
        .expect_err("refused");
    assert_exposition(
        &scrape(metrics_addr).await,
        &[
            "fission_decode_errors_total{error_type=\"kv_transfer\"} 1",
            "fission_decode_errors_total{error_type=\"unavailable\"} 2",
            "# TYPE fission_decode_prefix_cache_hit_blocks_total counter",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_node_refuses_new_work_serves_what_it_holds_and_exits() {
    let common::TestNode {
        mut client,
        node: mut node_client,
        metrics_addr,
        task: mut node,
        shutdown,
    } = common::start(&["--num-kv-blocks", "32"]).await;

    // A router follows the node's cache events for as long as it lives.
    let mut events =
        follow_cache_events(node_client.cache_events(CacheEventsRequest {}).await).await;

    // Work the node holds when the drain starts: a reservation with its stream open.
    let (mut kept_stream, kept) = common::reserve(&client, common::spec("kept", 6, 4), 1)
        .await
        .expect("the first reservation fits");

    assert_drain_started(node_client.drain(DrainRequest {}).await);
    let refused = common::reserve(&client, common::spec("late", 6, 4), 1)
        .await
        .err()
        .expect("no new reservation while draining");
    assert_refused_as_draining(&refused);
    let local = GenerateStart {
        spec: Some(common::spec("late", 2, 4)),
        local_prefill: true,
        epoch: 1,
    };
    let refused = common::generate(&client, local)
        .await
        .err()
        .expect("no new local generation while draining");
    assert_refused_as_draining(&refused);

    check_metrics_while_draining(&kept, metrics_addr).await;

    // The reservation it holds is still served: its KV lands, Done activates it, and its
    // stream runs to the end.
    common::push_kv(&kept).await;
    client
        .done(DoneRequest {
            xfer_id: kept.xfer_id,
            epoch: kept.epoch,
            first_token: Some(Token {
                token_id: 310,
                ..Default::default()
            }),
            checksums: Vec::new(),
        })
        .await
        .expect("done is served while draining");
    let tokens = common::read_tokens(&mut kept_stream.down)
        .await
        .expect("tokens flow while draining");
    // The prefill node's first token, then three from the engine.
    assert_eq!(tokens.len(), 4);
    assert_eq!(tokens[0].token_id, 310);
    assert_eq!(tokens[3].finish_reason(), FinishReason::Length);
    drop(kept_stream);

    // With nothing left, the node exits, well within its gRPC stop grace, although the
    // CacheEvents stream was never closed by its follower.
    assert_exits_with_cache_events_open(&mut node, Duration::from_secs(5), &mut events).await;
    assert!(shutdown.is_cancelled());
}
