//! Test only: what a server's refusal observer was given, for the backends' tests of
//! `on_refusal`, which check the same thing over QUIC and over TCP.

use std::sync::{Arc, Mutex};

use crate::error::KvTransferError;
use crate::verdict::Verdict;

/// The error types a server's refusal observer was given, in order.
#[derive(Clone, Default)]
pub(crate) struct RefusalLog(Arc<Mutex<Vec<&'static str>>>);

impl RefusalLog {
    /// An observer for a server's `on_refusal` that appends to this log.
    pub(crate) fn observer(&self) -> impl Fn(&KvTransferError) + Send + Sync + 'static {
        let log = Arc::clone(&self.0);
        move |e| log.lock().expect("refusal log").push(e.error_type())
    }

    /// Checks that the sender got `err`, the refusal of a frame for a transfer the server does
    /// not know, and that the observer saw that refusal and no other.
    pub(crate) fn assert_only_unknown_transfer(&self, err: &KvTransferError) {
        assert!(
            matches!(
                err,
                KvTransferError::Rejected {
                    verdict: Verdict::UnknownTransfer,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            *self.0.lock().expect("refusal log"),
            vec!["unknown_transfer"]
        );
    }
}
