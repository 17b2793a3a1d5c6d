//! Whether a node is in etcd, as its `/health` and `/metrics` say it.
//!
//! A node keeps serving while etcd is gone (the gateway keeps its last membership and health
//! checks the nodes it knows), so losing etcd is not ill health: `/health` stays 200 and says
//! `"etcd": "unregistered"`, and `fission_node_etcd_registered` drops to 0, for an operator to
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

pub const REGISTERED_GAUGE: &str = "fission_node_etcd_registered";
pub const FAILURES_COUNTER: &str = "fission_node_etcd_registration_failures_total";

/// How often the failure counter is copied from the registration while it is unregistered.
const FAILURE_POLL: Duration = Duration::from_millis(500);

/// Shared between the registration's watcher and the `/health` handler.
#[derive(Clone, Debug)]
pub struct EtcdStatus(Arc<AtomicU8>);

impl EtcdStatus {
    /// Standalone without etcd endpoints (a static cluster); unregistered until the first
    /// lease otherwise.
    pub fn new(uses_etcd: bool) -> Self {
        let state = if uses_etcd { UNREGISTERED } else { STANDALONE };
        if uses_etcd {
            metrics::gauge!(REGISTERED_GAUGE).set(0.0);
            metrics::counter!(FAILURES_COUNTER).absolute(0);
        }
        EtcdStatus(Arc::new(AtomicU8::new(state)))
    }

    pub fn as_str(&self) -> &'static str {
        match self.0.load(Ordering::Relaxed) {
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
        self.0.store(state, Ordering::Relaxed);
        metrics::gauge!(REGISTERED_GAUGE).set(if registered { 1.0 } else { 0.0 });
    }

    /// Follows `reg` until its task stops: the state on every lease change, and the failure
    /// count while unregistered.
    pub async fn follow(self, reg: Registration) {
        let mut lease = reg.lease_watch();
        loop {
            let registered = lease.borrow_and_update().is_some();
            self.set_registered(registered);
            metrics::counter!(FAILURES_COUNTER).absolute(reg.failed_attempts());
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
        let s = EtcdStatus::new(true);
        assert_eq!(s.health_json(), r#"{"status":"ok","etcd":"unregistered"}"#);
        s.set_registered(true);
        assert_eq!(s.as_str(), "registered");
        assert_eq!(EtcdStatus::new(false).as_str(), "standalone");
    }
}
