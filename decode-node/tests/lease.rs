//! A reservation whose KV never arrives expires: its blocks are freed and its token stream
//! ends with a timeout error. A real decode node over real sockets, in-process.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use decode_node::{DecodeConfig, DecodeListeners};
use proto::v1::decode_client::DecodeClient;
use proto::v1::{reserve_response, ReserveRequest, StoppingCriteria, StreamRequest};
use tokio_util::sync::CancellationToken;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfilled_reservation_expires_and_frees_its_blocks() {
    let dir = stories_dir();
    let args = Args::parse_from([
        "decode",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--num-kv-blocks",
        "8",
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
        "--lease-ms",
        "300",
    ]);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = grpc.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let node = tokio::spawn(decode_node::run(
        args.config,
        DecodeListeners {
            grpc,
            metrics,
            kv_addr: "127.0.0.1:0".parse().expect("addr"),
        },
        shutdown.clone(),
    ));
    let mut client = loop {
        if let Ok(c) = DecodeClient::connect(format!("http://{addr}")).await {
            if c.clone().info(proto::v1::InfoRequest {}).await.is_ok() {
                break c;
            }
        }
        assert!(!node.is_finished(), "the node stopped during start-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let reserve = |client: &mut DecodeClient<tonic::transport::Channel>| {
        let mut c = client.clone();
        async move {
            c.reserve(ReserveRequest {
                request_id: "r".into(),
                prompt_ids: (0..12).map(|i| 300 + i).collect(),
                sampling: None,
                stopping: Some(StoppingCriteria {
                    max_new_tokens: 4,
                    ..Default::default()
                }),
            })
            .await
            .expect("reserve answers")
            .into_inner()
            .result
        }
    };
    // 12 tokens in blocks of 4 = 3 blocks; the pool holds half of 8 = 4 blocks.
    let Some(reserve_response::Result::Reserved(r)) = reserve(&mut client).await else {
        panic!("the first reservation fits");
    };
    assert_eq!(r.block_ids.len(), 3);
    assert!(
        matches!(
            reserve(&mut client).await,
            Some(reserve_response::Result::Busy(_))
        ),
        "a second one does not fit while the first holds its blocks"
    );
    let started = Instant::now();
    let mut stream = client
        .stream(StreamRequest { xfer_id: r.xfer_id })
        .await
        .expect("stream")
        .into_inner();
    let err = stream
        .message()
        .await
        .expect_err("the stream ends with an error, not silently");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("lease"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(5));
    // The blocks are back: a new reservation fits again.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(reserve_response::Result::Reserved(_)) = reserve(&mut client).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "blocks were not freed after the lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
