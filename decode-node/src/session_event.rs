//! What a session's RPC handlers (Done, Renew) ask of it: a leaf, so that the book of open
//! transfers (`transfers`), which routes these to their session, and the session itself
//! (`session`), which owns that book's entries, each import it without importing each other.

use node_common::failure::Failure;
use proto::v1;
use tokio::sync::oneshot;

/// A Done or Renew for one session's reservation, with where to send its answer.
pub(crate) enum SessionEvent {
    Renew {
        epoch: u64,
        reply: oneshot::Sender<Result<(), Failure>>,
    },
    Done {
        done: v1::DoneRequest,
        reply: oneshot::Sender<Result<(), Failure>>,
    },
}
