//! What the worker's handle ([`super::worker`]) tells the thread that owns UCX
//! ([`super::progress`]), and the few things both sides hold.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::error::KvTransferError;

/// A UCX failure, as the crate reports stream failures.
pub(super) fn ucx_error(what: &'static str, reason: impl Into<String>) -> KvTransferError {
    KvTransferError::Stream {
        endpoint: "ucx".to_owned(),
        what,
        reason: reason.into(),
    }
}

/// How a worker is set up.
#[derive(Clone, Debug, Default)]
pub(crate) struct WorkerOptions {
    /// `UCX_TLS` for this worker's context (e.g. `tcp`, `sm`); UCX's own choice when unset.
    pub transports: Option<String>,
}

pub(super) enum Cmd {
    /// Maps and registers a region of `len` bytes; answers its lease.
    Region {
        len: usize,
        reply: oneshot::Sender<Result<RegionInfo, KvTransferError>>,
    },
    /// An endpoint to a peer worker with the peer region's packed key.
    Connect {
        address: Vec<u8>,
        rkey: Vec<u8>,
        reply: oneshot::Sender<Result<u64, KvTransferError>>,
    },
    /// Sends `payload` with `tag` (eager or rendezvous, UCX's choice): answered once the
    /// send is complete.
    Send {
        ep: u64,
        payload: Bytes,
        tag: u64,
        reply: oneshot::Sender<Result<(), KvTransferError>>,
    },
    /// Posts a receive of at most `len` bytes at `addr` (a registered region) for `tag`:
    /// answered once a message has landed there.
    Recv {
        addr: usize,
        len: usize,
        tag: u64,
        reply: oneshot::Sender<Result<(), KvTransferError>>,
    },
    /// Cancels the receive posted for `tag`, if any is still pending.
    CancelRecv {
        tag: u64,
    },
    /// A region no connection holds any more: free once no receive is posted in it.
    Release {
        info: RegionInfo,
    },
    Close {
        ep: u64,
    },
}

/// A registered region, as the thread hands it out.
#[derive(Clone)]
pub(crate) struct RegionInfo {
    pub addr: usize,
    pub len: usize,
    pub rkey: Arc<[u8]>,
}

/// Regions the thread registered and no connection holds nor receive writes.
pub(super) type FreeRegions = Arc<Mutex<Vec<RegionInfo>>>;
