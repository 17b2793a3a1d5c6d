//! A draining decode node refuses new work (Reserve, LocalGenerate) with Unavailable, still
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
    reserve_response, CacheEventsRequest, DoneRequest, DrainRequest, FinishReason,
    LocalGenerateRequest, ReserveRequest, StoppingCriteria, StreamRequest, Token,
};
use testkit::metrics::{assert_exposition, scrape};

fn reserve_request() -> ReserveRequest {
    ReserveRequest {
        request_id: "kept".into(),
        prompt_ids: (0..6).map(|i| 300 + i).collect(),
        sampling: None,
        stopping: Some(StoppingCriteria {
            max_new_tokens: 4,
            ignore_eos: true,
            ..Default::default()
        }),
    }
}

/// Sends every layer of `r`'s reservation, zeros: their content does not matter here.
async fn push_kv(r: &proto::v1::Reserved) {
    let layout = proto::convert::layout(r.layout.as_ref()).expect("reserved layout");
    assert_eq!(layout.dtype, KvDtype::F32);
    let conn = TcpTransport::default()
        .connect(&r.kv_endpoint)
        .await
        .expect("kv connect");
    let payload = Bytes::from(vec![
        0u8;
        2 * r.block_ids.len() * layout.block_bytes() as usize
    ]);
    let block_ids: Arc<[u32]> = r.block_ids.clone().into();
    for layer in 0..layout.num_layers {
        let header = LayerHeader {
            xfer_id: TransferId(r.xfer_id),
            epoch: r.epoch,
            layer,
            layout,
            block_ids: Arc::clone(&block_ids),
            traceparent: None,
        };
        conn.send_layer(header, payload.clone())
            .await
            .expect("layer accepted");
    }
}

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
    let Some(reserve_response::Result::Reserved(kept)) = client
        .reserve(reserve_request())
        .await
        .expect("reserve")
        .into_inner()
        .result
    else {
        panic!("the first reservation fits");
    };
    let mut tokens = client
        .stream(StreamRequest {
            xfer_id: kept.xfer_id,
        })
        .await
        .expect("stream")
        .into_inner();

    assert_drain_started(node_client.drain(DrainRequest {}).await);
    let refused = client
        .reserve(reserve_request())
        .await
        .expect_err("no new reservation while draining");
    assert_refused_as_draining(&refused);
    let refused = client
        .local_generate(LocalGenerateRequest {
            request_id: "late".into(),
            prompt_ids: vec![300, 301],
            sampling: None,
            stopping: None,
        })
        .await
        .expect_err("no new local generation while draining");
    assert_refused_as_draining(&refused);

    check_metrics_while_draining(&kept, metrics_addr).await;

    // The reservation it holds is still served: its KV lands, Done activates it, and its
    // stream runs to the end.
    push_kv(&kept).await;
    client
        .done(DoneRequest {
            xfer_id: kept.xfer_id,
            epoch: kept.epoch,
            first_token: Some(Token {
                token_id: 310,
                ..Default::default()
            }),
            num_tokens: 6,
            checksums: Vec::new(),
        })
        .await
        .expect("done is served while draining");
    let mut finish = FinishReason::Unspecified;
    let mut generated = 0;
    while let Some(t) = tokens.message().await.expect("tokens flow while draining") {
        generated += 1;
        finish = t.finish_reason();
    }
    assert_eq!((generated, finish), (3, FinishReason::Length));

    drop(tokens);

    // With nothing left, the node exits, well within its gRPC stop grace, although the
    // CacheEvents stream was never closed by its follower.
    assert_exits_with_cache_events_open(&mut node, Duration::from_secs(5), &mut events).await;
    assert!(shutdown.is_cancelled());
}
