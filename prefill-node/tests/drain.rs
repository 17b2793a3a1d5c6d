//! A draining prefill node refuses new prompts with Unavailable while the work it holds (a KV
//! push) keeps it draining, and exits at the drain deadline although a router still holds its
//! never-ending CacheEvents stream open; its exposition passes promtool. A real prefill node
//! over real sockets, in-process.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use prefill_node::{PrefillConfig, PrefillListeners};
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{
    CacheEventsRequest, DrainRequest, KvDestination, PrefillRequest, StoppingCriteria,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    config: PrefillConfig,
}

fn stories_dir() -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    root.join("models/stories260K")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_node_refuses_prompts_and_exits_with_a_cache_events_stream_open() {
    let dir = stories_dir();
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
    let mut node = tokio::spawn(prefill_node::run(
        args.config,
        PrefillListeners { grpc, metrics },
        shutdown.clone(),
    ));
    let mut client: PrefillClient<Channel> = loop {
        if let Ok(c) = PrefillClient::connect(format!("http://{addr}")).await {
            if c.clone().info(proto::v1::InfoRequest {}).await.is_ok() {
                break c;
            }
        }
        assert!(!node.is_finished(), "the node stopped during start-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let info = client
        .info(proto::v1::InfoRequest {})
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

    assert!(
        client
            .drain(DrainRequest {})
            .await
            .expect("drain")
            .into_inner()
            .started
    );
    let refused = client
        .prefill(prompt("late", None))
        .await
        .expect_err("no new prompt while draining");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("draining"),
        "{}",
        refused.message()
    );
    // The drain holds for its deadline (2 s): /metrics is still up.
    let text = get_metrics(metrics_addr).await;
    for line in [
        "fission_prefill_errors_total{error_type=\"unavailable\"} 1",
        "fission_prefill_batch_size_count 1",
        "fission_prefill_queue_time_seconds_count 1",
        "# TYPE fission_prefill_prefix_cache_hit_blocks_total counter",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    if let Some(report) = testkit::promtool::check(&text).expect("promtool passes") {
        println!("promtool check metrics: ok {report}");
    }

    // The push never ends; the drain gives up after 2 s, and the open CacheEvents stream does
    // not hold the node past that.
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(6), &mut node)
        .await
        .expect("the drained node exits although a CacheEvents stream was open")
        .expect("join")
        .expect("clean shutdown");
    assert!(started.elapsed() < Duration::from_secs(6));
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = events.message().await {}
    })
    .await
    .expect("the cache events stream ends");
}
