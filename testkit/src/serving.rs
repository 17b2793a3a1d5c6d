//! Starting a service under test on real sockets: listeners on free ports of 127.0.0.1, and a
//! wait (on a condition, not a sleep) until it answers.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A node's gRPC and `/metrics` listeners, bound on free ports of 127.0.0.1.
pub struct NodeSockets {
    pub grpc: TcpListener,
    pub metrics: TcpListener,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
}

impl NodeSockets {
    pub async fn bind() -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let metrics = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        NodeSockets {
            grpc_addr: grpc.local_addr().expect("addr"),
            metrics_addr: metrics.local_addr().expect("addr"),
            grpc,
            metrics,
        }
    }
}

/// Tries `connect` every 20 ms until it gives a client that the service answered; fails the
/// test if the service's task ends first (it stopped during start-up).
pub async fn wait_until_serving<C, R, F, Fut>(service: &JoinHandle<R>, mut connect: F) -> C
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<C>>,
{
    loop {
        if let Some(client) = connect().await {
            return client;
        }
        assert!(!service.is_finished(), "the node stopped during start-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
