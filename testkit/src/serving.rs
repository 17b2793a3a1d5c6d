//! Waiting for a service under test to answer: on a condition, never a sleep.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;

/// How long a service under test may take to start answering.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Tries `connect` until it gives a client that the service answered; fails the test if the
/// service's task ends first (it stopped during start-up) or [`START_TIMEOUT`] passes.
pub async fn wait_until_serving<C, R, F, Fut>(service: &JoinHandle<R>, mut connect: F) -> C
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<C>>,
{
    let client = std::cell::RefCell::new(None);
    crate::wait_until_async("the service to answer", START_TIMEOUT, || {
        assert!(
            !service.is_finished(),
            "the service stopped during start-up"
        );
        let attempt = connect();
        let slot = &client;
        async move {
            let answered = attempt.await;
            let ok = answered.is_some();
            *slot.borrow_mut() = answered;
            ok
        }
    })
    .await;
    client.into_inner().expect("the wait ends once connected")
}
