//! The end of a node's gRPC server: a graceful stop, bounded.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::error::NodeError;

/// How long a stopping gRPC server may wait for its connections to end before they are cut:
/// a stream the node does not know how to end must not keep the process alive.
pub const GRPC_STOP_GRACE: Duration = Duration::from_secs(10);

/// Waits for the gRPC server's graceful stop for at most `grace`, then cuts the connections
/// left.
pub async fn stop_server(
    mut server: JoinHandle<Result<(), tonic::transport::Error>>,
    grace: Duration,
) -> Result<(), NodeError> {
    match tokio::time::timeout(grace, &mut server).await {
        Ok(joined) => joined
            .map_err(|e| NodeError::Grpc(e.to_string()))?
            .map_err(|e| NodeError::Grpc(e.to_string())),
        Err(_) => {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "grpc server still had open connections after the grace period; closing them"
            );
            server.abort();
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_server_that_does_not_stop_is_cut_after_the_grace() {
        let server = tokio::spawn(std::future::pending());
        let abort = server.abort_handle();
        tokio::time::timeout(
            Duration::from_secs(5),
            stop_server(server, Duration::from_millis(20)),
        )
        .await
        .expect("bounded by the grace")
        .expect("a cut server is not an error");
        tokio::task::yield_now().await;
        assert!(abort.is_finished(), "the server task is aborted");
    }
}
