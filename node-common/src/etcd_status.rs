//! Whether a node is in etcd, as its `/health` and `/metrics` say it.
//!
//! A node keeps serving while etcd is gone (the gateway keeps its last membership and health
//! checks the nodes it knows), so losing etcd is not ill health: `/health` stays 200 and says
//! `"etcd": "unregistered"`, and `fission_{role}_etcd_registered` drops to 0, for an operator to
//! alert on. A probe that failed instead would restart every node of a cluster whose etcd
//! hiccuped.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cluster::Registration;

/// Names for [`EtcdStatus`]'s states, as `/health` writes them.
const STANDALONE: u8 = 0;
const UNREGISTERED: u8 = 1;
const REGISTERED: u8 = 2;

/// `fission_{role}_etcd_registered`: 1 while the node holds a lease, 0 while it does not.
pub fn registered_gauge(role: &str) -> String {
    format!("fission_{role}_etcd_registered")
}

/// `fission_{role}_etcd_registration_failures_total`: attempts that failed since start.
pub fn failures_counter(role: &str) -> String {
    format!("fission_{role}_etcd_registration_failures_total")
}

/// How often the failure counter is copied from the registration while it is unregistered.
const FAILURE_POLL: Duration = Duration::from_millis(500);

/// Shared between the registration's watcher and the `/health` handler.
#[derive(Clone, Debug)]
pub struct EtcdStatus {
    state: Arc<AtomicU8>,
    /// The metric names, under the node's role (`fission_prefill_...`, `fission_decode_...`).
    registered_gauge: String,
    failures_counter: String,
}

impl EtcdStatus {
    /// Standalone without etcd endpoints (a static cluster); unregistered until the first
    /// lease otherwise. `role` names the metrics (`prefill` or `decode`).
    pub fn new(role: &str, uses_etcd: bool) -> Self {
        let state = if uses_etcd { UNREGISTERED } else { STANDALONE };
        let status = EtcdStatus {
            state: Arc::new(AtomicU8::new(state)),
            registered_gauge: registered_gauge(role),
            failures_counter: failures_counter(role),
        };
        if uses_etcd {
            metrics::describe_gauge!(
                status.registered_gauge.clone(),
                "1 while the node is registered in etcd under a lease, 0 while etcd is unreachable (the node still serves)"
            );
            metrics::describe_counter!(
                status.failures_counter.clone(),
                "Registration attempts in etcd that failed since the node started"
            );
            metrics::gauge!(status.registered_gauge.clone()).set(0.0);
            metrics::counter!(status.failures_counter.clone()).absolute(0);
        }
        status
    }

    pub fn as_str(&self) -> &'static str {
        match self.state.load(Ordering::Relaxed) {
            REGISTERED => "registered",
            UNREGISTERED => "unregistered",
            _ => "standalone",
        }
    }

    /// The `/health` body.
    pub fn health_json(&self) -> String {
        format!(r#"{{"status":"ok","etcd":"{}"}}"#, self.as_str())
    }

    fn set_registered(&self, registered: bool) {
        let state = if registered { REGISTERED } else { UNREGISTERED };
        self.state.store(state, Ordering::Relaxed);
        metrics::gauge!(self.registered_gauge.clone()).set(if registered { 1.0 } else { 0.0 });
    }

    /// Follows `reg` until its task stops: the state on every lease change, and the failure
    /// count while unregistered.
    pub async fn follow(self, reg: Registration) {
        let mut lease = reg.lease_watch();
        loop {
            let registered = lease.borrow_and_update().is_some();
            self.set_registered(registered);
            metrics::counter!(self.failures_counter.clone()).absolute(reg.failed_attempts());
            if registered {
                if lease.changed().await.is_err() {
                    return;
                }
            } else {
                tokio::select! {
                    changed = lease.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(FAILURE_POLL) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_names_the_state() {
        let s = EtcdStatus::new("decode", true);
        assert_eq!(s.health_json(), r#"{"status":"ok","etcd":"unregistered"}"#);
        s.set_registered(true);
        assert_eq!(s.as_str(), "registered");
        assert_eq!(EtcdStatus::new("decode", false).as_str(), "standalone");
        assert_eq!(
            failures_counter("prefill"),
            "fission_prefill_etcd_registration_failures_total"
        );
    }
}
