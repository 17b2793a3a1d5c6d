//! Admission: a bounded FIFO queue in front of the backend, so overload waits before it is
//! refused.
//!
//! A request enters the queue if it has room (by requests and by prompt tokens), else it is
//! refused at once with 429. In the queue it waits, in arrival order, for two things: a slot
//! under `max_concurrent_requests`, then its placement on the nodes. While the nodes have room,
//! requests place themselves concurrently: a placement is an RPC round trip to a decode node,
//! and taking turns across it capped admission at one request per round trip (25 req/s with 48
//! mock nodes on a loaded 2-core host, whatever the cluster's size). Once a request finds no
//! room, requests take turns: only the one at the head tries to place itself, it keeps the
//! turn while the backend answers that no node has room (so later arrivals cannot overtake
//! it), and tries again whenever a request ends or a short pause passes; arrivals line up
//! behind it until no request is held back. A request that waits longer than
//! `max_queue_wait_ms` is refused with 429 and the time it waited.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::Instrument;

use crate::error::GatewayError;
use crate::metrics;

/// How long the head of the queue waits between placements when no request ends meanwhile:
/// room can also appear through published load (another gateway's requests ending).
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The queue's limits.
#[derive(Debug, Clone, Copy)]
pub struct QueueConfig {
    /// Requests placed on the nodes at once.
    pub max_concurrent_requests: usize,
    /// Requests waiting at once; one more is refused with 429.
    pub max_waiting_requests: usize,
    /// Prompt tokens of the waiting requests together; a request over it is refused with 429.
    pub max_queued_tokens: u64,
    /// The longest a request waits before it is refused with 429.
    pub max_queue_wait_ms: u64,
}

/// Counts a placed request until it ends, and wakes the queue's head when it does.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    ended: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        ::metrics::gauge!(metrics::IN_FLIGHT).decrement(1.0);
        self.ended.notify_waiters();
    }
}

pub struct Queue {
    config: QueueConfig,
    slots: Arc<Semaphore>,
    /// Held by the request whose turn it is to be placed. Tokio's mutex is fair: turns go in
    /// arrival order.
    turn: tokio::sync::Mutex<()>,
    /// Requests that found no room, or arrived after one did, taking turns: while there are
    /// any, arrivals take turns too.
    held_back: AtomicUsize,
    waiting: AtomicUsize,
    queued_tokens: AtomicU64,
    /// Notified when a placed request ends: room may have appeared.
    ended: Arc<Notify>,
}

/// A request in the queue, counted until it leaves it.
struct Waiting<'a> {
    queue: &'a Queue,
    tokens: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let q = self.queue;
        let waiting = q.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
        let tokens = q.queued_tokens.fetch_sub(self.tokens, Ordering::SeqCst) - self.tokens;
        ::metrics::gauge!(metrics::QUEUE_WAITING).set(waiting as f64);
        ::metrics::gauge!(metrics::QUEUE_TOKENS).set(tokens as f64);
    }
}

/// Counts a request in [`Queue::held_back`] until it leaves the turns.
struct HeldBack<'a>(&'a AtomicUsize);

impl<'a> HeldBack<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        HeldBack(count)
    }
}

impl Drop for HeldBack<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Queue {
    pub fn new(config: QueueConfig) -> Self {
        Queue {
            slots: Arc::new(Semaphore::new(config.max_concurrent_requests.max(1))),
            config,
            turn: tokio::sync::Mutex::new(()),
            held_back: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            queued_tokens: AtomicU64::new(0),
            ended: Arc::new(Notify::new()),
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Requests waiting now, and their prompt tokens.
    pub fn depth(&self) -> (usize, u64) {
        (
            self.waiting.load(Ordering::SeqCst),
            self.queued_tokens.load(Ordering::SeqCst),
        )
    }

    /// Requests placed and not yet ended.
    /// What `/info` shows of the queue.
    pub fn describe(&self) -> serde_json::Value {
        let (waiting, tokens) = self.depth();
        serde_json::json!({
            "waiting_requests": waiting,
            "queued_tokens": tokens,
            "in_flight": self.in_flight(),
            "max_concurrent_requests": self.config.max_concurrent_requests,
            "max_waiting_requests": self.config.max_waiting_requests,
            "max_queued_tokens": self.config.max_queued_tokens,
            "max_queue_wait_ms": self.config.max_queue_wait_ms,
        })
    }

    pub fn in_flight(&self) -> usize {
        self.config.max_concurrent_requests - self.slots.available_permits()
    }

    fn enter(&self, tokens: u64) -> Result<Waiting<'_>, GatewayError> {
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        let queued = self.queued_tokens.fetch_add(tokens, Ordering::SeqCst) + tokens;
        let entry = Waiting {
            queue: self,
            tokens,
        };
        let full = if waiting > self.config.max_waiting_requests {
            Some(format!(
                "{} requests are waiting (the limit, --max-waiting-requests)",
                waiting - 1
            ))
        } else if queued > self.config.max_queued_tokens {
            Some(format!(
                "{} prompt tokens are waiting with this request's {tokens} (the limit, --max-queued-tokens, is {})",
                queued, self.config.max_queued_tokens
            ))
        } else {
            None
        };
        if let Some(why) = full {
            ::metrics::counter!(metrics::QUEUE_REJECTED, "reason" => "full").increment(1);
            return Err(GatewayError::QueueFull { why });
        }
        ::metrics::gauge!(metrics::QUEUE_WAITING).set(waiting as f64);
        ::metrics::gauge!(metrics::QUEUE_TOKENS).set(queued as f64);
        Ok(entry)
    }

    /// Waits for this request's turn and places it with `place`, which fails with
    /// [`GatewayError::is_no_room`] while no node has room (it is then tried again). Gives the
    /// placed request and the slot it holds until it ends. `deadline` caps the wait below
    /// `max_queue_wait_ms` (the request's own timeout).
    pub async fn admit<T, F, Fut>(
        &self,
        prompt_tokens: usize,
        deadline: Instant,
        mut place: F,
    ) -> Result<(T, Slot), GatewayError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, GatewayError>>,
    {
        let entered = Instant::now();
        let waiting = self.enter(prompt_tokens as u64)?;
        let limit = entered + Duration::from_millis(self.config.max_queue_wait_ms);
        let span = tracing::info_span!(
            "queue_wait",
            position = self.depth().0 as i64,
            wait_ms = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        let wait = async {
            let permit = Arc::clone(&self.slots).acquire_owned().await.map_err(|_| {
                GatewayError::Unavailable {
                    reason: "the gateway is shutting down".into(),
                }
            })?;
            if self.held_back.load(Ordering::SeqCst) == 0 {
                tracing::Span::current().record("attempts", 1i64);
                match place().await {
                    Ok(placed) => return Ok((placed, permit)),
                    Err(e) if e.is_no_room() => {}
                    Err(e) => return Err(e),
                }
            }
            let _held = HeldBack::enter(&self.held_back);
            let _turn = self.turn.lock().await;
            let mut attempts = 0i64;
            loop {
                let ended = self.ended.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                attempts += 1;
                tracing::Span::current().record("attempts", attempts);
                match place().await {
                    Ok(placed) => return Ok((placed, permit)),
                    Err(e) if e.is_no_room() => {
                        tokio::select! {
                            () = ended => {}
                            () = tokio::time::sleep(RETRY_PAUSE) => {}
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let result =
            tokio::time::timeout_at(limit.min(deadline), wait.instrument(span.clone())).await;
        let waited = entered.elapsed();
        span.record("wait_ms", waited.as_secs_f64() * 1e3);
        ::metrics::histogram!(metrics::QUEUE_WAIT).record(waited.as_secs_f64());
        drop(waiting);
        match result {
            Ok(Ok((placed, permit))) => {
                ::metrics::gauge!(metrics::IN_FLIGHT).increment(1.0);
                Ok((
                    placed,
                    Slot {
                        _permit: permit,
                        ended: Arc::clone(&self.ended),
                    },
                ))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                ::metrics::counter!(metrics::QUEUE_REJECTED, "reason" => "timeout").increment(1);
                Err(GatewayError::QueueTimeout {
                    waited_ms: waited.as_millis() as u64,
                    max_queue_wait_ms: self.config.max_queue_wait_ms,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    fn queue(max_concurrent: usize, max_waiting: usize, wait_ms: u64) -> Arc<Queue> {
        Arc::new(Queue::new(QueueConfig {
            max_concurrent_requests: max_concurrent,
            max_waiting_requests: max_waiting,
            max_queued_tokens: 1000,
            max_queue_wait_ms: wait_ms,
        }))
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[tokio::test]
    async fn requests_wait_for_a_slot_in_arrival_order() {
        let q = queue(1, 10, 10_000);
        let (first, slot) = q
            .admit(5, far(), || async { Ok::<_, GatewayError>(1) })
            .await
            .unwrap();
        assert_eq!(first, 1);
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 2..=4 {
            let (qw, order) = (Arc::clone(&q), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let (_, slot) = qw
                    .admit(5, far(), || async { Ok::<_, GatewayError>(()) })
                    .await
                    .unwrap();
                order.lock().unwrap().push(i);
                drop(slot);
            }));
            // Arrival order is spawn order.
            testkit::wait_until_async("the request to queue", Duration::from_secs(5), || {
                let depth = q.depth().0;
                async move { depth == i - 1 }
            })
            .await;
        }
        assert_eq!(q.depth(), (3, 15));
        drop(slot);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![2, 3, 4]);
        assert_eq!(q.depth(), (0, 0));
        assert_eq!(q.in_flight(), 0);
    }

    /// While the nodes have room, placements overlap: eight that each take a round trip of
    /// 200 ms are all in flight at once (taking turns, the eighth would start after 1.4 s).
    #[tokio::test]
    async fn placements_overlap_while_there_is_room() {
        let q = queue(64, 64, 10_000);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (q, in_flight, most) = (Arc::clone(&q), Arc::clone(&in_flight), Arc::clone(&most));
            tasks.push(tokio::spawn(async move {
                q.admit(5, far(), || {
                    let (in_flight, most) = (Arc::clone(&in_flight), Arc::clone(&most));
                    async move {
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, GatewayError>(())
                    }
                })
                .await
                .map(|(_, slot)| drop(slot))
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 8);
        assert_eq!(q.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_a_long_wait_times_out() {
        let q = queue(1, 1, 200);
        let (_, _slot) = q
            .admit(5, far(), || async { Ok::<_, GatewayError>(()) })
            .await
            .unwrap();
        let waiter = {
            let q = Arc::clone(&q);
            tokio::spawn(async move {
                q.admit(5, far(), || async { Ok::<_, GatewayError>(()) })
                    .await
                    .map(|_| ())
            })
        };
        testkit::wait_until_async("one request to queue", Duration::from_secs(5), || {
            let depth = q.depth().0;
            async move { depth == 1 }
        })
        .await;
        let full = q
            .admit(5, far(), || async { Ok::<_, GatewayError>(()) })
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(full, GatewayError::QueueFull { .. }), "{full}");
        let timed_out = waiter.await.unwrap().unwrap_err();
        match timed_out {
            GatewayError::QueueTimeout { waited_ms, .. } => assert!(waited_ms >= 200),
            other => panic!("unexpected {other}"),
        }
        assert_eq!(q.depth(), (0, 0));
    }

    #[tokio::test]
    async fn the_head_keeps_its_turn_while_no_node_has_room() {
        let q = queue(8, 10, 10_000);
        let room = Arc::new(AtomicBool::new(false));
        let head = {
            let (q, room) = (Arc::clone(&q), Arc::clone(&room));
            tokio::spawn(async move {
                q.admit(5, far(), || {
                    let room = room.load(Ordering::SeqCst);
                    async move {
                        if room {
                            Ok("head")
                        } else {
                            Err(GatewayError::backend(proto::ErrorCode::Overloaded, "full"))
                        }
                    }
                })
                .await
                .map(|(p, _)| p)
            })
        };
        testkit::wait_until_async("the head to wait", Duration::from_secs(5), || {
            let depth = q.depth().0;
            async move { depth == 1 }
        })
        .await;
        // A later request would fit, but it must not overtake the head.
        let later = {
            let q = Arc::clone(&q);
            tokio::spawn(async move {
                q.admit(5, far(), || async { Ok("later") })
                    .await
                    .map(|(p, _)| p)
            })
        };
        testkit::wait_until_async("the later one to queue", Duration::from_secs(5), || {
            let depth = q.depth().0;
            async move { depth == 2 }
        })
        .await;
        assert!(!later.is_finished());
        room.store(true, Ordering::SeqCst);
        assert_eq!(head.await.unwrap().unwrap(), "head");
        assert_eq!(later.await.unwrap().unwrap(), "later");
    }
}
