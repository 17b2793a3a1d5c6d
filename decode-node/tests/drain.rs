//! A draining decode node refuses new work (Reserve, LocalGenerate) with Unavailable, still
//! serves the reservation it already holds (its KV, Done and token stream), and then exits
//! although a router still holds its never-ending CacheEvents stream open. A real decode node
//! over real sockets, in-process.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use decode_node::{DecodeConfig, DecodeListeners};
use kvtransfer::{KvConnection, KvDtype, KvLayout, KvTransport, LayerHeader, TcpTransport};
use proto::v1::decode_client::DecodeClient;
use proto::v1::{
    reserve_response, CacheEventsRequest, DoneRequest, DrainRequest, LocalGenerateRequest,
    ReserveRequest, StoppingCriteria, StreamRequest, Token,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    config: DecodeConfig,
}

fn stories_dir() -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    root.join("models/stories260K")
}

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

async fn get_metrics(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("response");
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// Sends every layer of `r`'s reservation, zeros: their content does not matter here.
async fn push_kv(r: &proto::v1::Reserved) {
    let l = r.layout.clone().expect("reserved layout");
    assert_eq!(l.dtype, "f32");
    let layout = KvLayout {
        dtype: KvDtype::F32,
        block_size: l.block_size,
        num_kv_heads: l.num_kv_heads,
        head_dim: l.head_dim,
    };
    let conn = TcpTransport::default()
        .connect(&r.kv_endpoint)
        .await
        .expect("kv connect");
    let payload = Bytes::from(vec![
        0u8;
        2 * r.block_ids.len() * layout.block_bytes() as usize
    ]);
    let block_ids: Arc<[u32]> = r.block_ids.clone().into();
    for layer in 0..l.num_layers {
        let header = LayerHeader {
            xfer_id: r.xfer_id,
            epoch: r.epoch,
            layer,
            num_layers: l.num_layers,
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
        xfer_id: 999,
        epoch: 1,
        layer: 0,
        num_layers: 1,
        layout: KvLayout {
            dtype: KvDtype::F32,
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
    let text = get_metrics(metrics_addr).await;
    for line in [
        "fission_decode_errors_total{error_type=\"kv_transfer\"} 1",
        "fission_decode_errors_total{error_type=\"unavailable\"} 2",
        "# TYPE fission_decode_prefix_cache_hit_blocks_total counter",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    if let Some(report) = testkit::promtool::check(&text).expect("promtool passes") {
        println!("promtool check metrics: ok {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_node_refuses_new_work_serves_what_it_holds_and_exits() {
    let dir = stories_dir();
    let args = Args::parse_from([
        "decode",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--num-kv-blocks",
        "32",
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
    ]);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let (addr, metrics_addr) = (
        grpc.local_addr().expect("addr"),
        metrics.local_addr().expect("addr"),
    );
    let shutdown = CancellationToken::new();
    let mut node = tokio::spawn(decode_node::run(
        args.config,
        DecodeListeners {
            grpc,
            metrics,
            kv_addr: "127.0.0.1:0".parse().expect("addr"),
        },
        shutdown.clone(),
    ));
    let mut client: DecodeClient<Channel> = loop {
        if let Ok(c) = DecodeClient::connect(format!("http://{addr}")).await {
            if c.clone().info(proto::v1::InfoRequest {}).await.is_ok() {
                break c;
            }
        }
        assert!(!node.is_finished(), "the node stopped during start-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    // A router follows the node's cache events for as long as it lives.
    let mut events = client
        .cache_events(CacheEventsRequest {})
        .await
        .expect("cache events")
        .into_inner();
    assert!(
        events
            .message()
            .await
            .expect("snapshot")
            .expect("snapshot")
            .snapshot
    );

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

    assert!(
        client
            .drain(DrainRequest {})
            .await
            .expect("drain")
            .into_inner()
            .started
    );
    let refused = client
        .reserve(reserve_request())
        .await
        .expect_err("no new reservation while draining");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("draining"),
        "{}",
        refused.message()
    );
    let refused = client
        .local_generate(LocalGenerateRequest {
            request_id: "late".into(),
            prompt_ids: vec![300, 301],
            sampling: None,
            stopping: None,
        })
        .await
        .expect_err("no new local generation while draining");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

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
    let mut finish = String::new();
    let mut generated = 0;
    while let Some(t) = tokens.message().await.expect("tokens flow while draining") {
        generated += 1;
        finish = t.finish_reason;
    }
    assert_eq!((generated, finish.as_str()), (3, "length"));

    drop(tokens);

    // With nothing left, the node exits, well within its gRPC stop grace, although the
    // CacheEvents stream was never closed by its follower.
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), &mut node)
        .await
        .expect("the drained node exits although a CacheEvents stream was open")
        .expect("join")
        .expect("clean shutdown");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Its follower gets what was published before the stop, then the end of the stream.
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = events.message().await {}
    })
    .await
    .expect("the cache events stream ends");
    assert!(shutdown.is_cancelled());
}
