//! One UCP context and worker on a thread of their own, behind a cheap handle.
//!
//! UCX runs here in its single-thread mode: every UCP call is made on the thread that created
//! the context, which also progresses the worker. Async callers send it commands and await
//! the answers. While operations are in flight the thread progresses the worker; when idle it
//! arms the worker and sleeps in `poll` on the worker's event descriptor and its own wake-up
//! descriptor, so an idle node burns no CPU and a receiver still progresses the rendezvous
//! of the messages it waits for.
//!
//! The thread owns the registered regions: a region stays mapped and registered until the
//! worker itself goes, whatever happens to the connection that leased it, so a late message
//! from a peer can never land in freed memory. A receive still posted when its connection
//! goes is cancelled, and its region goes back to the free list only once UCX has finished
//! with every receive posted in it (a cancel cannot stop a rendezvous already under way).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::command::{ucx_error, Cmd, FreeRegions, RegionInfo, WorkerOptions};
use super::ffi;
use super::progress::Progress;
use crate::error::KvTransferError;

struct Shared {
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake: Arc<OwnedFd>,
    address: Arc<[u8]>,
    free_regions: FreeRegions,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The channel closes with this; wake the thread so it sees that and cleans up.
        signal(&self.wake);
    }
}

fn signal(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to an eventfd this process owns.
    let _ = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// A handle on the worker thread. Cheap to clone; the thread ends when the last one goes.
#[derive(Clone)]
pub(crate) struct UcxWorker {
    shared: Arc<Shared>,
}

impl UcxWorker {
    /// Starts the thread and waits for UCX to initialise (tens of milliseconds: call it
    /// off the async runtime, e.g. in `spawn_blocking`).
    pub(crate) fn spawn(options: WorkerOptions) -> Result<Self, KvTransferError> {
        let ucp = ffi::ucp().map_err(|reason| KvTransferError::Config {
            field: "kv_transport",
            reason,
        })?;
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(ucx_error(
                "eventfd",
                std::io::Error::last_os_error().to_string(),
            ));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_wake = wake.clone();
        let free_regions = FreeRegions::default();
        let thread_free = free_regions.clone();
        std::thread::Builder::new()
            .name("fission-ucx".to_owned())
            .spawn(move || match Progress::init(ucp, &options, thread_free) {
                Ok((mut progress, address)) => {
                    let _ = ready_tx.send(Ok(address));
                    progress.run(&rx, &thread_wake);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| ucx_error("spawn worker thread", e.to_string()))?;
        let address = ready_rx
            .recv()
            .map_err(|_| ucx_error("init", "the worker thread ended before answering"))??;
        Ok(Self {
            shared: Arc::new(Shared {
                tx: Mutex::new(tx),
                wake,
                address: address.into(),
                free_regions,
            }),
        })
    }

    /// How many registered regions are free to lease: no connection holds them and no
    /// receive is posted in them.
    pub(crate) fn free_regions(&self) -> usize {
        self.shared
            .free_regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// This worker's address, which a peer needs to open an endpoint to it.
    pub(crate) fn address(&self) -> &[u8] {
        &self.shared.address
    }

    fn send(&self, cmd: Cmd) -> Result<(), KvTransferError> {
        self.shared
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(cmd)
            .map_err(|_| ucx_error("command", "the worker thread has ended"))?;
        signal(&self.shared.wake);
        Ok(())
    }

    async fn ask<T>(
        &self,
        cmd: impl FnOnce(oneshot::Sender<Result<T, KvTransferError>>) -> Cmd,
    ) -> Result<T, KvTransferError> {
        self.post(cmd)?.wait().await
    }

    /// Hands the thread `cmd` now; its answer is the returned one's to wait for.
    fn post<T>(
        &self,
        cmd: impl FnOnce(oneshot::Sender<Result<T, KvTransferError>>) -> Cmd,
    ) -> Result<Answer<T>, KvTransferError> {
        let (reply, answer) = oneshot::channel();
        self.send(cmd(reply))?;
        Ok(Answer(answer))
    }

    /// A registered region of at least `len` bytes, taken from the free ones or registered
    /// now; it goes back when the lease drops.
    pub(crate) async fn lease_region(&self, len: usize) -> Result<RegionLease, KvTransferError> {
        let free = {
            let mut free = self
                .shared
                .free_regions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            free.iter()
                .position(|r| r.len >= len)
                .map(|i| free.swap_remove(i))
        };
        let info = match free {
            Some(info) => info,
            None => self.ask(|reply| Cmd::Region { len, reply }).await?,
        };
        Ok(RegionLease {
            info,
            worker: self.clone(),
        })
    }

    /// An endpoint to the worker at `address`; `rkey` is the peer region's packed key (unpacked,
    /// so a bad one fails here).
    pub(crate) async fn connect(
        &self,
        address: Vec<u8>,
        rkey: Vec<u8>,
    ) -> Result<Endpoint, KvTransferError> {
        let key = self
            .ask(|reply| Cmd::Connect {
                address,
                rkey,
                reply,
            })
            .await?;
        Ok(Endpoint {
            key,
            worker: self.clone(),
        })
    }
}

impl UcxWorker {
    /// Waits for the message tagged `tag` to land in `region`'s `len` bytes from `offset`; a
    /// dropped wait cancels the receive, and the region is not leased again while UCX may
    /// still write it.
    pub(crate) async fn recv(
        &self,
        region: &RegionLease,
        offset: usize,
        len: usize,
        tag: u64,
    ) -> Result<(), KvTransferError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > region.info.len)
        {
            return Err(ucx_error("ucx receive", "outside the connection's region"));
        }
        struct Cancel<'a>(&'a UcxWorker, u64, bool);
        impl Drop for Cancel<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    let _ = self.0.send(Cmd::CancelRecv { tag: self.1 });
                }
            }
        }
        let mut guard = Cancel(self, tag, false);
        let result = self
            .ask(|reply| Cmd::Recv {
                addr: region.info.addr + offset,
                len,
                tag,
                reply,
            })
            .await;
        guard.2 = true;
        result
    }
}

/// The thread's answer to a command handed to it.
pub(crate) struct Answer<T>(oneshot::Receiver<Result<T, KvTransferError>>);

impl<T> Answer<T> {
    pub(crate) async fn wait(self) -> Result<T, KvTransferError> {
        self.0
            .await
            .map_err(|_| ucx_error("command", "the worker thread has ended"))?
    }
}

/// A region leased to one connection; back to the worker's free list on drop.
pub(crate) struct RegionLease {
    info: RegionInfo,
    worker: UcxWorker,
}

impl RegionLease {
    pub(crate) fn info(&self) -> &RegionInfo {
        &self.info
    }
}

/// The region's bytes. UCX writes them only through the receives the connection posts
/// ([`crate::slots`] says what a peer could still change).
impl AsRef<[u8]> for RegionLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the worker thread keeps this mapping alive until the worker ends, and the
        // lease holds the worker.
        unsafe { std::slice::from_raw_parts(self.info.addr as *const u8, self.info.len) }
    }
}

impl Drop for RegionLease {
    fn drop(&mut self) {
        // The thread frees it once no receive is posted in it; if the thread has ended, the
        // region is gone with it.
        let _ = self.worker.send(Cmd::Release {
            info: self.info.clone(),
        });
    }
}

/// An endpoint to a peer's region; closed on drop.
pub(crate) struct Endpoint {
    key: u64,
    worker: UcxWorker,
}

impl Endpoint {
    /// Starts sending `payload` tagged `tag` to the peer's posted receive, now; the answer
    /// comes once it is sent (the worker holds the payload until then).
    pub(crate) fn send(&self, payload: Bytes, tag: u64) -> Result<Answer<()>, KvTransferError> {
        self.worker.post(|reply| Cmd::Send {
            ep: self.key,
            payload,
            tag,
            reply,
        })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.worker.send(Cmd::Close { ep: self.key });
    }
}
