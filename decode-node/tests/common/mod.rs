//! What the decode node's component tests share: a real decode node on stories260K, in-process,
//! over real sockets on 127.0.0.1.

use std::net::SocketAddr;

use decode_node::DecodeNode;
use node_common::NodeError;
use proto::v1::decode_client::DecodeClient;
use proto::v1::node_client::NodeClient;
use proto::v1::InfoRequest;
use testkit::serving::wait_until_serving;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub struct TestNode {
    pub client: DecodeClient<Channel>,
    // Each test binary compiles this module; the lease test reads neither.
    #[allow(dead_code)]
    pub node: NodeClient<Channel>,
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
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
        "--kv-addr",
        "127.0.0.1:0",
    ];
    argv.extend_from_slice(flags);
    let spawned = node_common::test_util::spawn::<DecodeNode>(&argv).await;
    let addr = spawned.grpc_addr;
    let channel = wait_until_serving(&spawned.task, || async move {
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
    TestNode {
        client: DecodeClient::new(channel.clone()),
        node: NodeClient::new(channel),
        metrics_addr: spawned.metrics_addr,
        task: spawned.task,
        shutdown: spawned.shutdown,
    }
}
