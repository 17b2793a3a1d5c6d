//! What the gateway knows of a node's health beyond its registration: whether it is suspect
//! (it stalled a request, or its connection broke) and whether it lost its registration without
//! a drain (its lease expired: it died, or etcd lost it). Either way a health check decides:
//! a node that answers `Info` is healthy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proto::v1::node_client::NodeClient;
use proto::v1::InfoRequest;
use tonic::transport::Channel;

/// How often a suspect or unregistered node is checked.
pub(crate) const CHECK_INTERVAL: Duration = Duration::from_millis(500);
/// A check the node does not answer within this long fails: a hung process accepts
/// connections but answers nothing.
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub(crate) struct Health {
    suspect: AtomicBool,
    unregistered: AtomicBool,
}

impl Health {
    pub(crate) fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::SeqCst)
    }

    /// Marks the node suspect; true when it was not already.
    pub(crate) fn mark_suspect(&self) -> bool {
        !self.suspect.swap(true, Ordering::SeqCst)
    }

    pub(crate) fn clear_suspect(&self) {
        self.suspect.store(false, Ordering::SeqCst);
    }

    pub(crate) fn is_unregistered(&self) -> bool {
        self.unregistered.load(Ordering::SeqCst)
    }

    /// Marks the node's registration lost; true when it was not already.
    pub(crate) fn mark_unregistered(&self) -> bool {
        !self.unregistered.swap(true, Ordering::SeqCst)
    }

    /// The node registered again.
    pub(crate) fn clear_unregistered(&self) {
        self.unregistered.store(false, Ordering::SeqCst);
    }
}

/// One health check: whether the node answers `Info` within [`CHECK_TIMEOUT`].
pub(crate) async fn answers(channel: &Channel) -> bool {
    let mut client = NodeClient::new(channel.clone());
    matches!(
        tokio::time::timeout(CHECK_TIMEOUT, client.info(InfoRequest {})).await,
        Ok(Ok(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_report_whether_they_changed_anything() {
        let h = Health::default();
        assert!(h.mark_suspect());
        assert!(!h.mark_suspect());
        assert!(h.is_suspect());
        h.clear_suspect();
        assert!(!h.is_suspect());
        assert!(h.mark_unregistered());
        assert!(!h.mark_unregistered());
        h.clear_unregistered();
        assert!(!h.is_unregistered());
    }
}
