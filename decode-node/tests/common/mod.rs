//! What the decode node's component tests share: a real decode node on stories260K, in-process,
//! over real sockets on 127.0.0.1.

use std::net::SocketAddr;

use clap::Parser;
use decode_node::{DecodeConfig, DecodeListeners};
use node_common::NodeError;
use proto::v1::decode_client::DecodeClient;
use proto::v1::InfoRequest;
use testkit::serving::{wait_until_serving, NodeSockets};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    config: DecodeConfig,
}

pub struct TestNode {
    pub client: DecodeClient<Channel>,
    // Each test binary compiles this module; the lease test reads no metrics.
    #[allow(dead_code)]
    pub metrics_addr: SocketAddr,
    /// `decode_node::run`: ends when the node has stopped.
    pub task: JoinHandle<Result<(), NodeError>>,
    pub shutdown: CancellationToken,
}

/// Starts a decode node on stories260K with blocks of 4 and the TCP data plane, plus `flags`,
/// and returns once it answers Info.
pub async fn start(flags: &[&str]) -> TestNode {
    let dir = testkit::shared_model("stories260K");
    let mut argv = vec![
        "decode",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
    ];
    argv.extend_from_slice(flags);
    let args = Args::parse_from(argv);
    let sockets = NodeSockets::bind().await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(decode_node::run(
        args.config,
        DecodeListeners {
            grpc: sockets.grpc,
            metrics: sockets.metrics,
            kv_addr: "127.0.0.1:0".parse().expect("addr"),
        },
        shutdown.clone(),
    ));
    let addr = sockets.grpc_addr;
    let client = wait_until_serving(&task, || async move {
        let client = DecodeClient::connect(format!("http://{addr}")).await.ok()?;
        client.clone().info(InfoRequest {}).await.ok()?;
        Some(client)
    })
    .await;
    TestNode {
        client,
        metrics_addr: sockets.metrics_addr,
        task,
        shutdown,
    }
}
