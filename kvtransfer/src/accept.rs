//! The accept loop both servers share. A permit is taken before each accept, so a server at
//! its connection limit stops completing handshakes instead of queueing connections it cannot
//! serve; each connection then runs on a task of its own until it ends or `shutdown` fires,
//! and finished tasks are reaped as the loop goes.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What one call of a server's accept gave.
pub(crate) enum Accepted<C> {
    Connection(C),
    /// A transient failure (out of file descriptors, say): try again.
    Retry,
    /// The listener is closed: stop.
    Closed,
}

/// Accepts connections with `accept` and runs `serve` on each, until `shutdown` or a closed
/// listener; then stops every connection task and returns.
pub(crate) async fn accept_loop<C, A, AF, S, SF>(
    max_connections: usize,
    shutdown: &CancellationToken,
    mut accept: A,
    serve: S,
) where
    C: Send + 'static,
    A: FnMut() -> AF,
    AF: Future<Output = Accepted<C>>,
    S: Fn(C, CancellationToken) -> SF,
    SF: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max_connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let conn = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = accept() => match accepted {
                Accepted::Connection(conn) => conn,
                Accepted::Retry => continue,
                Accepted::Closed => break,
            },
        };
        let task = serve(conn, shutdown.clone());
        connections.spawn(async move {
            task.await;
            drop(permit);
        });
        while connections.try_join_next().is_some() {}
    }
    connections.shutdown().await;
}
