//! The prefix-cache event log a node serves to routers (the `CacheEvents` RPC).
//!
//! The engine thread appends one batch per step with changes; the log numbers batches and keeps
//! the replayed set of held hashes, so a new follower gets a snapshot that is exactly consistent
//! with the sequence number it carries, without asking the engine thread anything.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use futures::{Stream, StreamExt as _};
use proto::v1;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// Batches a slow follower may fall behind before it is cut off and must resync.
const FOLLOWER_LAG: usize = 1024;

pub struct CacheEventLog {
    state: Mutex<LogState>,
    tx: broadcast::Sender<Arc<v1::CacheEventBatch>>,
}

struct LogState {
    seq: u64,
    hashes: HashSet<u64>,
}

pub type CacheEventStream =
    Pin<Box<dyn Stream<Item = Result<v1::CacheEventBatch, tonic::Status>> + Send>>;

impl CacheEventLog {
    pub fn new() -> Arc<Self> {
        let (tx, _) = broadcast::channel(FOLLOWER_LAG);
        Arc::new(CacheEventLog {
            state: Mutex::new(LogState {
                seq: 0,
                hashes: HashSet::new(),
            }),
            tx,
        })
    }

    /// Appends one batch of `(hash, stored)` events, in the order they happened.
    pub fn publish(&self, events: impl IntoIterator<Item = (u64, bool)>) {
        let events: Vec<v1::CacheEvent> = events
            .into_iter()
            .map(|(hash, stored)| v1::CacheEvent { hash, stored })
            .collect();
        if events.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for e in &events {
            if e.stored {
                st.hashes.insert(e.hash);
            } else {
                st.hashes.remove(&e.hash);
            }
        }
        st.seq += 1;
        // Sent under the lock so a follower subscribing concurrently sees each batch either in
        // its snapshot or in its stream, never both and never neither.
        let _ = self.tx.send(Arc::new(v1::CacheEventBatch {
            seq: st.seq,
            snapshot: false,
            events,
        }));
    }

    /// A snapshot at the current sequence number, and the batches after it.
    pub fn follow(
        &self,
    ) -> (
        v1::CacheEventBatch,
        broadcast::Receiver<Arc<v1::CacheEventBatch>>,
    ) {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let rx = self.tx.subscribe();
        let snapshot = v1::CacheEventBatch {
            seq: st.seq,
            snapshot: true,
            events: st
                .hashes
                .iter()
                .map(|&hash| v1::CacheEvent { hash, stored: true })
                .collect(),
        };
        (snapshot, rx)
    }

    /// The RPC's response stream: the snapshot, then every batch. A follower that lags too far
    /// gets an error and resyncs with a fresh call.
    pub fn stream(self: &Arc<Self>) -> CacheEventStream {
        let (snapshot, rx) = self.follow();
        let first = futures::stream::once(async move { Ok(snapshot) });
        let rest = futures::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(batch) => Some((Ok((*batch).clone()), rx)),
                Err(broadcast::error::RecvError::Lagged(n)) => Some((
                    Err(tonic::Status::data_loss(format!(
                        "cache event follower fell {n} batches behind; resync"
                    ))),
                    rx,
                )),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        });
        Box::pin(first.chain(rest).take_while_ok())
    }

    /// [`stream`](Self::stream), ending when `stop` is cancelled. A router holds this stream
    /// open for as long as the node lives, and a gRPC server's graceful shutdown waits for
    /// every open stream: a node must end it to be able to stop.
    pub fn stream_until(self: &Arc<Self>, stop: CancellationToken) -> CacheEventStream {
        Box::pin(self.stream().take_until(stop.cancelled_owned()))
    }
}

/// Ends a stream after its first error (yielding that error).
trait TakeWhileOk: Stream + Sized {
    fn take_while_ok(self) -> futures::stream::BoxStream<'static, Self::Item>;
}

impl<S, T, E> TakeWhileOk for S
where
    S: Stream<Item = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    fn take_while_ok(self) -> futures::stream::BoxStream<'static, Self::Item> {
        use futures::StreamExt;
        self.scan(false, |failed, item| {
            if *failed {
                return futures::future::ready(None);
            }
            *failed = item.is_err();
            futures::future::ready(Some(item))
        })
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn snapshot_then_numbered_batches() {
        let log = CacheEventLog::new();
        log.publish([(1, true), (2, true)]);
        log.publish(Vec::new());
        let mut s = log.stream();
        log.publish([(1, false), (3, true)]);
        let snap = s.next().await.unwrap().unwrap();
        assert!(snap.snapshot);
        assert_eq!(snap.seq, 1);
        let mut held: Vec<u64> = snap.events.iter().map(|e| e.hash).collect();
        held.sort();
        assert_eq!(held, vec![1, 2]);
        let next = s.next().await.unwrap().unwrap();
        assert_eq!(next.seq, 2);
        assert!(!next.snapshot);
        assert_eq!(
            next.events,
            vec![
                v1::CacheEvent {
                    hash: 1,
                    stored: false
                },
                v1::CacheEvent {
                    hash: 3,
                    stored: true
                }
            ]
        );
    }

    #[tokio::test]
    async fn a_stopped_stream_ends_after_what_it_was_sent() {
        let log = CacheEventLog::new();
        let stop = CancellationToken::new();
        let mut s = log.stream_until(stop.clone());
        assert!(s.next().await.unwrap().unwrap().snapshot);
        log.publish([(1, true)]);
        assert_eq!(s.next().await.unwrap().unwrap().seq, 1);
        stop.cancel();
        let end = tokio::time::timeout(std::time::Duration::from_secs(5), s.next())
            .await
            .expect("the stream ends once stopped, with no event pending");
        assert!(end.is_none());
        // A follower that subscribes after the stop gets nothing at all.
        assert!(log.stream_until(stop).next().await.is_none());
    }

    #[tokio::test]
    async fn a_lagging_follower_gets_an_error_and_the_stream_ends() {
        let log = CacheEventLog::new();
        let mut s = log.stream();
        for i in 0..(FOLLOWER_LAG as u64 + 10) {
            log.publish([(i, true)]);
        }
        assert!(s.next().await.unwrap().unwrap().snapshot);
        let mut saw_error = false;
        while let Some(item) = s.next().await {
            if item.is_err() {
                saw_error = true;
            }
        }
        assert!(saw_error);
    }
}
