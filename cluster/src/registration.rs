//! A node's registration: one actor task owns the lease, the record and the keep-alive; a cheap
//! `Clone` handle sends it commands.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{sleep, sleep_until, Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::error::ClusterError;
use crate::etcd::{call, EtcdConfig};
use crate::record::{NodeLoad, NodeRecord};

/// How a node registers itself.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    pub etcd: EtcdConfig,
    /// The lease's time to live. The record disappears this long after the node stops renewing.
    pub lease_ttl_s: i64,
    /// At most one load put per interval; the latest load wins.
    pub load_publish_interval_ms: u64,
    /// The longest wait between two registration attempts while etcd is unreachable. The
    /// wait doubles from the etcd config's `retry_min_ms` up to this: a node whose etcd is gone
    /// for hours must not knock every second, and a fleet of them must not knock together
    /// (each wait is spread by up to a fifth, by node).
    pub retry_max_ms: u64,
}

impl RegistrationConfig {
    pub fn new(etcd: EtcdConfig) -> Self {
        RegistrationConfig {
            etcd,
            lease_ttl_s: 5,
            load_publish_interval_ms: 500,
            retry_max_ms: 10_000,
        }
    }

    fn backoff(&self) -> Backoff {
        let min = Duration::from_millis(self.etcd.retry_min_ms.max(1));
        Backoff::new(min, Duration::from_millis(self.retry_max_ms).max(min))
    }
}

enum Command {
    SetDraining {
        draining: bool,
        reply_tx: oneshot::Sender<Result<(), ClusterError>>,
    },
    Revoke {
        reply_tx: oneshot::Sender<Result<(), ClusterError>>,
    },
}

/// Handle to a node's registration.
///
/// The actor keeps the record registered until [`Registration::revoke`] is called or every
/// handle is dropped. Dropping without revoking stops the keep-alive, and etcd removes the record
/// when the lease runs out, as it would if the process died.
#[derive(Clone)]
pub struct Registration {
    node_id: String,
    cmd_tx: mpsc::Sender<Command>,
    lease_rx: watch::Receiver<Option<i64>>,
    load_tx: Arc<watch::Sender<Option<NodeLoad>>>,
    failed_attempts: Arc<AtomicU64>,
}

impl Registration {
    /// Validates the config and starts the registration task. Returns at once: if etcd is down,
    /// the task keeps retrying; see [`Registration::lease_watch`] for when it is registered.
    pub async fn start(
        config: RegistrationConfig,
        record: NodeRecord,
    ) -> Result<Registration, ClusterError> {
        if config.lease_ttl_s < 2 {
            return Err(ClusterError::InvalidConfig {
                field: "lease_ttl_s",
                reason: "must be at least 2",
                value: config.lease_ttl_s.to_string(),
            });
        }
        if record.node_id.is_empty() || record.node_id.contains('/') {
            return Err(ClusterError::InvalidConfig {
                field: "node_id",
                reason: "must be non-empty and contain no '/'",
                value: record.node_id.clone(),
            });
        }
        let client = config.etcd.connect().await?;
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let (lease_tx, lease_rx) = watch::channel(None);
        let (load_tx, load_rx) = watch::channel(None);
        let cancel = CancellationToken::new();

        tokio::spawn(run_load_publisher_task(LoadPublisher {
            client: client.clone(),
            key: record.load_key(&config.etcd.cluster),
            interval: Duration::from_millis(config.load_publish_interval_ms),
            request_timeout: config.etcd.request_timeout(),
            load_rx,
            lease_rx: lease_rx.clone(),
            cancel: cancel.clone(),
        }));

        let node_id = record.node_id.clone();
        let failed_attempts = Arc::new(AtomicU64::new(0));
        let actor = RegistrationActor {
            failed_attempts: Arc::clone(&failed_attempts),
            key: record.etcd_key(&config.etcd.cluster),
            client,
            config,
            record,
            cmd_rx,
            lease_tx,
            _publisher_guard: cancel.drop_guard(),
        };
        tokio::spawn(run_registration_task(actor));
        Ok(Registration {
            node_id,
            cmd_tx,
            lease_rx,
            load_tx: Arc::new(load_tx),
            failed_attempts,
        })
    }

    /// Registration attempts that failed since the node started (etcd unreachable, a lease
    /// that could not be granted, a record that could not be written).
    pub fn failed_attempts(&self) -> u64 {
        self.failed_attempts.load(Ordering::Relaxed)
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The lease the record is held under now; `None` while not registered.
    pub fn lease_id(&self) -> Option<i64> {
        *self.lease_rx.borrow()
    }

    /// Follows the lease: it changes when the node re-registers after losing etcd.
    pub fn lease_watch(&self) -> watch::Receiver<Option<i64>> {
        self.lease_rx.clone()
    }

    /// Marks the node draining (or not) and rewrites its record. When etcd is unreachable this
    /// returns [`ClusterError::NotRegistered`] or an etcd error, but the change is kept and
    /// written as soon as the node registers again.
    pub async fn set_draining(&self, draining: bool) -> Result<(), ClusterError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        self.send(Command::SetDraining { draining, reply_tx })
            .await?;
        reply_rx.await.map_err(|_| self.stopped())?
    }

    /// Publishes the node's load. Never blocks: the publisher writes at most once per interval,
    /// and only the latest load is written.
    pub fn publish_load(&self, load: NodeLoad) {
        self.load_tx.send_replace(Some(load));
    }

    /// Revokes the lease, which deletes the record and the load key, and stops the task. Call it
    /// at shutdown, after the node stops accepting work.
    pub async fn revoke(&self) -> Result<(), ClusterError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        self.send(Command::Revoke { reply_tx }).await?;
        reply_rx.await.map_err(|_| self.stopped())?
    }

    async fn send(&self, cmd: Command) -> Result<(), ClusterError> {
        self.cmd_tx.send(cmd).await.map_err(|_| self.stopped())
    }

    fn stopped(&self) -> ClusterError {
        ClusterError::RegistrationStopped {
            node_id: self.node_id.clone(),
        }
    }
}

struct RegistrationActor {
    key: String,
    client: Client,
    config: RegistrationConfig,
    record: NodeRecord,
    cmd_rx: mpsc::Receiver<Command>,
    lease_tx: watch::Sender<Option<i64>>,
    failed_attempts: Arc<AtomicU64>,
    _publisher_guard: tokio_util::sync::DropGuard,
}

/// Why the keep-alive loop ended.
enum KeepAliveEnd {
    /// Revoked, or every handle dropped: the task ends.
    Stopped,
    /// The lease is gone or cannot be renewed: register again with a new lease.
    Lost(String),
}

async fn run_registration_task(mut actor: RegistrationActor) {
    let mut backoff = actor.config.backoff();
    let mut old_lease: Option<i64> = None;
    // Failures since the last successful registration.
    let mut attempt: u32 = 0;
    loop {
        let lease_id = match actor.register().await {
            Ok(lease_id) => lease_id,
            Err(error) => {
                attempt = attempt.saturating_add(1);
                actor.failed_attempts.fetch_add(1, Ordering::Relaxed);
                let delay = spread(backoff.next_delay(), &actor.record.node_id, attempt);
                tracing::warn!(
                    node_id = %actor.record.node_id,
                    %error,
                    attempt,
                    retry_in_ms = delay.as_millis() as u64,
                    "etcd registration failed"
                );
                if actor.wait_unregistered(delay, &mut old_lease).await {
                    return;
                }
                continue;
            }
        };
        if let Some(old) = old_lease.take() {
            // The record now lives under the new lease, so revoking the old one deletes nothing
            // that matters; it only spares etcd a stale lease.
            let mut client = actor.client.clone();
            let timeout = actor.config.etcd.request_timeout();
            let _ = call("lease revoke", timeout, client.lease_revoke(old)).await;
        }
        actor.lease_tx.send_replace(Some(lease_id));
        tracing::info!(node_id = %actor.record.node_id, lease_id, key = %actor.key, failed_attempts = attempt, "registered in etcd");
        backoff.reset();
        attempt = 0;
        match actor.keep_alive(lease_id).await {
            KeepAliveEnd::Stopped => return,
            KeepAliveEnd::Lost(reason) => {
                tracing::warn!(node_id = %actor.record.node_id, lease_id, %reason, "etcd lease lost, registering again");
                actor.lease_tx.send_replace(None);
                old_lease = Some(lease_id);
            }
        }
    }
}

/// Stretches `delay` by 0-20%, by node and attempt, so that nodes that lost etcd together do not
/// retry in lockstep. A hash rather than a random draw: no RNG for one spread, and a node's
/// schedule is reproducible from its log.
fn spread(delay: Duration, node_id: &str, attempt: u32) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (node_id, attempt).hash(&mut h);
    let fifth_permille = h.finish() % 201; // 0..=200 thousandths: up to a fifth
    delay + delay * (fifth_permille as u32) / 1000
}

impl RegistrationActor {
    async fn register(&mut self) -> Result<i64, ClusterError> {
        let timeout = self.config.etcd.request_timeout();
        let grant = call(
            "lease grant",
            timeout,
            self.client.lease_grant(self.config.lease_ttl_s, None),
        )
        .await?;
        if let Err(error) = self.put_record(grant.id()).await {
            // Without the record the lease holds nothing: give it back now rather than leave
            // it to run out.
            let _ = call(
                "lease revoke",
                timeout,
                self.client.lease_revoke(grant.id()),
            )
            .await;
            return Err(error);
        }
        Ok(grant.id())
    }

    async fn put_record(&mut self, lease_id: i64) -> Result<(), ClusterError> {
        let value =
            serde_json::to_vec(&self.record).map_err(|source| ClusterError::InvalidRecord {
                key: self.key.clone(),
                source,
            })?;
        let timeout = self.config.etcd.request_timeout();
        let options = PutOptions::new().with_lease(lease_id);
        call(
            "put",
            timeout,
            self.client.put(self.key.clone(), value, Some(options)),
        )
        .await?;
        Ok(())
    }

    /// Waits `delay` while unregistered, still answering commands. Returns true when the task
    /// must stop.
    async fn wait_unregistered(&mut self, delay: Duration, old_lease: &mut Option<i64>) -> bool {
        let deadline = Instant::now() + delay;
        loop {
            tokio::select! {
                _ = sleep_until(deadline) => return false,
                cmd = self.cmd_rx.recv() => match cmd {
                    None => return true,
                    Some(Command::SetDraining { draining, reply_tx }) => {
                        self.record.draining = draining;
                        let _ = reply_tx.send(Err(ClusterError::NotRegistered {
                            node_id: self.record.node_id.clone(),
                        }));
                    }
                    Some(Command::Revoke { reply_tx }) => {
                        if let Some(old) = old_lease.take() {
                            let timeout = self.config.etcd.request_timeout();
                            let _ = call("lease revoke", timeout, self.client.lease_revoke(old)).await;
                        }
                        let _ = reply_tx.send(Ok(()));
                        return true;
                    }
                },
            }
        }
    }

    async fn keep_alive(&mut self, lease_id: i64) -> KeepAliveEnd {
        let timeout = self.config.etcd.request_timeout();
        let ttl = Duration::from_secs(u64::try_from(self.config.lease_ttl_s).unwrap_or(1));
        let (mut keeper, mut stream) = match call(
            "lease keep-alive",
            timeout,
            self.client.lease_keep_alive(lease_id),
        )
        .await
        {
            Ok(pair) => pair,
            Err(error) => return KeepAliveEnd::Lost(error.to_string()),
        };
        let mut tick = tokio::time::interval(ttl / 3);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        tick.tick().await;
        let mut last_ack = Instant::now();
        loop {
            tokio::select! {
                cmd = self.cmd_rx.recv() => match cmd {
                    None => {
                        tracing::info!(node_id = %self.record.node_id, lease_id, "registration handles dropped, lease left to expire");
                        return KeepAliveEnd::Stopped;
                    }
                    Some(Command::SetDraining { draining, reply_tx }) => {
                        self.record.draining = draining;
                        let result = self.put_record(lease_id).await;
                        tracing::info!(node_id = %self.record.node_id, draining, ok = result.is_ok(), "draining flag updated");
                        let _ = reply_tx.send(result);
                    }
                    Some(Command::Revoke { reply_tx }) => {
                        let result = call("lease revoke", timeout, self.client.lease_revoke(lease_id))
                            .await
                            .map(|_| ());
                        tracing::info!(node_id = %self.record.node_id, lease_id, ok = result.is_ok(), "lease revoked");
                        self.lease_tx.send_replace(None);
                        let _ = reply_tx.send(result);
                        return KeepAliveEnd::Stopped;
                    }
                },
                _ = tick.tick() => {
                    if let Err(error) = keeper.keep_alive().await {
                        return KeepAliveEnd::Lost(error.to_string());
                    }
                }
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if resp.ttl() > 0 => last_ack = Instant::now(),
                    Ok(Some(_)) => return KeepAliveEnd::Lost("lease expired".into()),
                    Ok(None) => return KeepAliveEnd::Lost("keep-alive stream closed".into()),
                    Err(error) => return KeepAliveEnd::Lost(error.to_string()),
                },
                _ = sleep_until(last_ack + ttl) => {
                    return KeepAliveEnd::Lost("no keep-alive answer within the lease ttl".into());
                }
            }
        }
    }
}

struct LoadPublisher {
    client: Client,
    key: String,
    interval: Duration,
    request_timeout: Duration,
    load_rx: watch::Receiver<Option<NodeLoad>>,
    lease_rx: watch::Receiver<Option<i64>>,
    cancel: CancellationToken,
}

/// Writes the latest load at most once per interval, and again after each re-registration
/// (a new lease means the old load key is gone).
async fn run_load_publisher_task(mut p: LoadPublisher) {
    let mut dirty = false;
    loop {
        if !dirty {
            tokio::select! {
                _ = p.cancel.cancelled() => return,
                changed = p.load_rx.changed() => if changed.is_err() { return },
                changed = p.lease_rx.changed() => if changed.is_err() { return },
            }
        }
        dirty = false;
        let load = *p.load_rx.borrow_and_update();
        let lease = *p.lease_rx.borrow_and_update();
        if let (Some(load), Some(lease_id)) = (load, lease) {
            match serde_json::to_vec(&load) {
                Ok(value) => {
                    let options = PutOptions::new().with_lease(lease_id);
                    let put = p.client.put(p.key.clone(), value, Some(options));
                    if let Err(error) = call("put load", p.request_timeout, put).await {
                        tracing::debug!(key = %p.key, %error, "load publish failed, retrying");
                        dirty = true;
                    }
                }
                Err(error) => tracing::warn!(key = %p.key, %error, "load does not serialize"),
            }
        }
        tokio::select! {
            _ = p.cancel.cancelled() => return,
            _ = sleep(p.interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spread_stays_within_a_fifth_and_differs_by_node() {
        let base = Duration::from_secs(10);
        let a: Vec<Duration> = (1..20).map(|i| spread(base, "decode-a", i)).collect();
        let b: Vec<Duration> = (1..20).map(|i| spread(base, "decode-b", i)).collect();
        for d in a.iter().chain(&b) {
            assert!(*d >= base && *d <= base + base / 5, "{d:?}");
        }
        assert_ne!(a, b, "two nodes retry on different schedules");
    }

    #[test]
    fn registration_backs_off_to_its_own_cap_not_the_call_retry_cap() {
        let etcd = EtcdConfig::new(vec!["http://127.0.0.1:1".into()], "c");
        let config = RegistrationConfig::new(etcd);
        let mut backoff = config.backoff();
        let waits: Vec<u128> = (0..12).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(waits[0], 100);
        assert_eq!(*waits.last().expect("12 waits"), 10_000);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
    }
}
