//! Waiting on a condition, the one way tests wait: poll it until it holds or a deadline
//! passes, then fail saying what was awaited. Never a bare sleep.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is checked.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The condition did not hold in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOut {
    pub what: String,
    pub after: Duration,
}

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}",
            self.after, self.what
        )
    }
}

impl std::error::Error for TimedOut {}

/// Polls `cond` until it returns true, for at most `deadline`; returns how long it took, or
/// [`TimedOut`]. Blocks the calling thread: use [`wait_until_async`] on a runtime thread.
pub fn try_wait_until(
    what: &str,
    deadline: Duration,
    mut cond: impl FnMut() -> bool,
) -> Result<Duration, TimedOut> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= deadline {
            return Err(TimedOut {
                what: what.to_string(),
                after: start.elapsed(),
            });
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// [`try_wait_until`], panicking with what was awaited when it times out.
pub fn wait_until(what: &str, deadline: Duration, cond: impl FnMut() -> bool) -> Duration {
    try_wait_until(what, deadline, cond).unwrap_or_else(|e| panic!("{e}"))
}

/// The async form of [`try_wait_until`]: `cond` is awaited on each poll.
pub async fn try_wait_until_async<F, Fut>(
    what: &str,
    deadline: Duration,
    mut cond: F,
) -> Result<Duration, TimedOut>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= deadline {
            return Err(TimedOut {
                what: what.to_string(),
                after: start.elapsed(),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// [`try_wait_until_async`], panicking with what was awaited when it times out.
pub async fn wait_until_async<F, Fut>(what: &str, deadline: Duration, cond: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    try_wait_until_async(what, deadline, cond)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_once_the_condition_holds_and_times_out_otherwise() {
        let mut n = 0;
        let took = wait_until("three polls", Duration::from_secs(5), || {
            n += 1;
            n == 3
        });
        assert_eq!(n, 3);
        assert!(took >= 2 * POLL_INTERVAL);
        let err = try_wait_until("never", Duration::from_millis(50), || false).unwrap_err();
        assert_eq!(err.what, "never");
        assert!(err.after >= Duration::from_millis(50));
        assert!(err.to_string().contains("waiting for never"));
    }

    #[tokio::test]
    async fn the_async_form_awaits_its_condition() {
        let mut n = 0;
        wait_until_async("two polls", Duration::from_secs(5), || {
            n += 1;
            let done = n == 2;
            async move { done }
        })
        .await;
        assert_eq!(n, 2);
        assert!(
            try_wait_until_async("never", Duration::from_millis(30), || async { false })
                .await
                .is_err()
        );
    }
}
