//! Following one etcd prefix: a get, then a watch from the next revision, and a fresh get and
//! watch (after a backoff) whenever the watch breaks. What the keys mean is the follower's
//! business; membership and load both ride on this loop.

use std::time::Duration;

use etcd_client::{Client, Event, GetOptions, KeyValue, WatchOptions};
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::error::ClusterError;
use crate::etcd::{call, EtcdConfig};

/// The state built from a prefix. Between a broken watch and the next get it keeps what it
/// had: callers rely on the last known view surviving an etcd outage.
pub(crate) trait PrefixFollower: Send + 'static {
    /// Replaces the state with a full read of the prefix.
    fn reset(&mut self, kvs: &[KeyValue]);
    /// Applies one watch response's events, in order.
    fn apply(&mut self, events: &[Event]);
    /// Says that following stopped and when it resumes (each follower logs at its own level).
    fn interrupted(&self, prefix: &str, error: &ClusterError, retry_in: Duration);
}

/// Follows `prefix` into `follower` until `cancel` fires.
pub(crate) async fn follow_prefix<F: PrefixFollower>(
    mut client: Client,
    etcd: EtcdConfig,
    prefix: String,
    mut follower: F,
    cancel: CancellationToken,
) {
    let mut backoff = etcd.backoff();
    loop {
        let attempt = sync_and_watch(
            &mut client,
            &etcd,
            &prefix,
            &mut follower,
            &cancel,
            &mut backoff,
        );
        match attempt.await {
            Ok(()) => return,
            Err(error) => {
                let delay = backoff.next_delay();
                follower.interrupted(&prefix, &error, delay);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = sleep(delay) => {}
                }
            }
        }
    }
}

/// Loads the prefix, then applies watch events until cancelled (`Ok`) or the watch breaks.
async fn sync_and_watch<F: PrefixFollower>(
    client: &mut Client,
    etcd: &EtcdConfig,
    prefix: &str,
    follower: &mut F,
    cancel: &CancellationToken,
    backoff: &mut Backoff,
) -> Result<(), ClusterError> {
    let timeout = etcd.request_timeout();
    let resp = call(
        "get",
        timeout,
        client.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    follower.reset(resp.kvs());

    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = call("watch", timeout, client.watch(prefix, Some(options))).await?;
    // A watch that was up and then broke retries from the shortest delay.
    backoff.reset();
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            msg = stream.message() => msg.map_err(ClusterError::etcd("watch"))?,
        };
        let Some(resp) = msg else {
            return Err(watch_error("watch stream closed".into()));
        };
        if resp.canceled() {
            return Err(watch_error(format!(
                "watch cancelled (compact revision {}): {}",
                resp.compact_revision(),
                resp.cancel_reason()
            )));
        }
        follower.apply(resp.events());
    }
}

fn watch_error(why: String) -> ClusterError {
    ClusterError::Etcd {
        op: "watch",
        source: etcd_client::Error::WatchError(why),
    }
}
