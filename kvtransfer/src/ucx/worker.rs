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

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use memmap2::MmapMut;
use tokio::sync::oneshot;

use super::ffi::{self, pending, Pending, Ucp};
use crate::error::KvTransferError;

/// A UCX failure, as the crate reports stream failures.
fn ucx_error(what: &'static str, reason: impl Into<String>) -> KvTransferError {
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

/// UCX settings this backend changes from UCX's defaults, unless the environment sets them
/// (`UCX_` and the first name); the last field says whether only for TCP. A context takes a
/// transport's setting by its name without the transport's prefix.
/// - TCP segments of 512 KiB instead of 8 KiB move a layer in far fewer active messages (2.4
///   against 0.6 GB/s for a 64 MiB put on loopback, benchmarks/history/2026-11-29-ucx.md).
/// - Indirect request ids make UCX track each endpoint's requests, so that a failed peer
///   fails the sends and receives in flight to it; by default only peer-failure mode does,
///   which endpoints here do without ([`Progress::create_ep`]).
/// - One rail per rendezvous. Split over two TCP devices (here `lo` and `eth0`), UCX 1.13's
///   TCP put receive crashed the decode node (SIGSEGV in `libuct`'s put-receive path,
///   releasing a receive buffer already released) in 4 of 8 runs of the fault suite's UCX
///   test, and in none of 24 with one rail. Over several RDMA devices, where more rails add
///   bandwidth, set `UCX_MAX_RNDV_RAILS`.
const TUNING: [(&str, &str, &str, bool); 4] = [
    ("TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "512k", true),
    ("TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "512k", true),
    ("PROTO_INDIRECT_ID", "PROTO_INDIRECT_ID", "on", false),
    ("MAX_RNDV_RAILS", "MAX_RNDV_RAILS", "1", false),
];

enum Cmd {
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
type FreeRegions = Arc<Mutex<Vec<RegionInfo>>>;

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

/// Peer failures UCX reports on an endpoint: the requests on it fail on their own, so this
/// only logs.
unsafe extern "C" fn on_peer_error(_arg: *mut c_void, _ep: ffi::Ep, status: ffi::Status) {
    tracing::debug!(status, "kv ucx endpoint failed");
}

struct Ep {
    ep: ffi::Ep,
    rkey: ffi::RKey,
}

struct InFlight {
    request: *mut c_void,
    /// The tag and address of a posted receive, which a cancel names and which keeps its
    /// region from the free list; `None` for sends.
    recv: Option<(u64, usize)>,
    /// A send's payload, kept alive until the send is done with it.
    _payload: Bytes,
    reply: oneshot::Sender<Result<(), KvTransferError>>,
}

/// The thread's state: everything UCX hands out lives and dies here.
struct Progress {
    ucp: &'static Ucp,
    context: ffi::Context,
    worker: ffi::Worker,
    efd: c_int,
    regions: Vec<(MmapMut, ffi::MemH)>,
    eps: HashMap<u64, Ep>,
    next_ep: u64,
    in_flight: Vec<InFlight>,
    closing: Vec<*mut c_void>,
    /// Regions whose leases ended, kept from the free list until no receive is posted in them.
    releasing: Vec<RegionInfo>,
    free_regions: FreeRegions,
}

impl Progress {
    fn init(
        ucp: &'static Ucp,
        options: &WorkerOptions,
        free_regions: FreeRegions,
    ) -> Result<(Self, Vec<u8>), KvTransferError> {
        let fail = |what: &'static str, status: ffi::Status| ucx_error(what, ucp.describe(status));
        let mut config: ffi::Config = std::ptr::null_mut();
        // SAFETY: NULL prefix and file read the environment; `config` receives the object.
        let status = unsafe { (ucp.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        if status != ffi::UCS_OK {
            return Err(fail("ucp_config_read", status));
        }
        // The TCP settings only where TCP may run: UCX warns of settings no transport took.
        let tls = options
            .transports
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok());
        let tcp = tls
            .as_deref()
            .is_none_or(|t| t.contains("tcp") || t.contains("all") || t.starts_with("^"));
        let mut settings: Vec<(String, String)> = TUNING
            .iter()
            .filter(|(_, _, _, tcp_only)| tcp || !tcp_only)
            .filter(|(env, _, _, _)| std::env::var_os(format!("UCX_{env}")).is_none())
            .map(|(_, n, v, _)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
        match (&options.transports, &tls) {
            (Some(chosen), _) => settings.push(("TLS".to_owned(), chosen.clone())),
            // UCX would pick its shared-memory transports for a peer on this host: they
            // cannot tell a dead peer (a receive would wait for its timeout) and ran slower
            // than TCP here (benchmarks/history/2026-11-29-ucx.md), and this host's peers
            // are the shm backend's anyway.
            (None, None) => settings.push(("TLS".to_owned(), "^sm".to_owned())),
            (None, Some(_)) => {}
        }
        for (name, value) in settings {
            let (Ok(n), Ok(v)) = (CString::new(name.clone()), CString::new(value.clone())) else {
                continue;
            };
            // SAFETY: a live config and NUL-terminated strings.
            let status = unsafe { (ucp.config_modify)(config, n.as_ptr(), v.as_ptr()) };
            if status != ffi::UCS_OK {
                tracing::warn!(
                    name,
                    value,
                    error = ucp.describe(status),
                    "kv ucx setting refused"
                );
            }
        }
        let params = ffi::Params {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES,
            features: ffi::UCP_FEATURE_RMA | ffi::UCP_FEATURE_TAG | ffi::UCP_FEATURE_WAKEUP,
            ..Default::default()
        };
        let mut context: ffi::Context = std::ptr::null_mut();
        // SAFETY: valid params and config; the config is released after init as ucp.h allows.
        let status = unsafe {
            let s = (ucp.init_version)(
                ffi::API_MAJOR,
                ffi::API_MINOR,
                &params,
                config,
                &mut context,
            );
            (ucp.config_release)(config);
            s
        };
        if status != ffi::UCS_OK {
            return Err(fail("ucp_init", status));
        }
        let wparams = ffi::WorkerParams {
            field_mask: ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: ffi::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker: ffi::Worker = std::ptr::null_mut();
        // SAFETY: a live context; on failure the context is cleaned up.
        let status = unsafe { (ucp.worker_create)(context, &wparams, &mut worker) };
        if status != ffi::UCS_OK {
            // SAFETY: the context was created above and nothing else uses it.
            unsafe { (ucp.cleanup)(context) };
            return Err(fail("ucp_worker_create", status));
        }
        let mut progress = Progress {
            ucp,
            context,
            worker,
            efd: -1,
            regions: Vec::new(),
            eps: HashMap::new(),
            next_ep: 0,
            in_flight: Vec::new(),
            closing: Vec::new(),
            releasing: Vec::new(),
            free_regions,
        };
        // From here `progress`'s Drop cleans up on any failure.
        // SAFETY: a live worker.
        let status = unsafe { (ucp.worker_get_efd)(worker, &mut progress.efd) };
        if status != ffi::UCS_OK {
            return Err(fail("ucp_worker_get_efd", status));
        }
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut addr_len = 0usize;
        // SAFETY: a live worker; the address is copied and released at once.
        let address = unsafe {
            let status = (ucp.worker_get_address)(worker, &mut addr, &mut addr_len);
            if status != ffi::UCS_OK {
                return Err(fail("ucp_worker_get_address", status));
            }
            let copy = std::slice::from_raw_parts(addr as *const u8, addr_len).to_vec();
            (ucp.worker_release_address)(worker, addr);
            copy
        };
        Ok((progress, address))
    }

    fn run(&mut self, rx: &mpsc::Receiver<Cmd>, wake: &OwnedFd) {
        loop {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            let mut progressed = false;
            // SAFETY: the worker is live and used only on this thread.
            while unsafe { (self.ucp.worker_progress)(self.worker) } != 0 {
                progressed = true;
            }
            self.reap();
            if progressed {
                continue;
            }
            // SAFETY: as above.
            let armed = unsafe { (self.ucp.worker_arm)(self.worker) };
            if armed == ffi::UCS_ERR_BUSY {
                continue;
            }
            // The timeout is a safety net for transports that cannot signal: short while
            // operations are in flight, longer when idle.
            let busy = !self.in_flight.is_empty() || !self.closing.is_empty();
            let timeout_ms = if armed != ffi::UCS_OK || busy { 1 } else { 50 };
            let mut fds = [
                libc::pollfd {
                    fd: self.efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
            let mut buf = [0u8; 8];
            // SAFETY: a nonblocking 8-byte read of this thread's eventfd.
            let _ = unsafe { libc::read(wake.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Region { len, reply } => {
                let _ = reply.send(self.region(len));
            }
            Cmd::Connect {
                address,
                rkey,
                reply,
            } => {
                let _ = reply.send(self.connect(&address, &rkey));
            }
            Cmd::Send {
                ep,
                payload,
                tag,
                reply,
            } => self.tag_send(ep, payload, tag, reply),
            Cmd::Recv {
                addr,
                len,
                tag,
                reply,
            } => self.tag_recv(addr, len, tag, reply),
            Cmd::CancelRecv { tag } => {
                if let Some(f) = self
                    .in_flight
                    .iter()
                    .find(|f| f.recv.is_some_and(|(t, _)| t == tag))
                {
                    // SAFETY: a live receive request; it completes (cancelled) and is reaped.
                    unsafe { (self.ucp.request_cancel)(self.worker, f.request) };
                }
            }
            Cmd::Close { ep } => self.close(ep),
            Cmd::Release { info } => self.releasing.push(info),
        }
    }

    /// Answers `reply` now, or once the request `p` completes.
    fn track(
        &mut self,
        what: &'static str,
        p: ffi::StatusPtr,
        recv: Option<(u64, usize)>,
        payload: Bytes,
        reply: oneshot::Sender<Result<(), KvTransferError>>,
    ) {
        match pending(p) {
            Pending::Done => {
                let _ = reply.send(Ok(()));
            }
            Pending::Failed(status) => {
                let _ = reply.send(Err(ucx_error(what, self.ucp.describe(status))));
            }
            Pending::Request(request) => self.in_flight.push(InFlight {
                request,
                recv,
                _payload: payload,
                reply,
            }),
        }
    }

    fn tag_send(
        &mut self,
        key: u64,
        payload: Bytes,
        tag: u64,
        reply: oneshot::Sender<Result<(), KvTransferError>>,
    ) {
        let Some(ep) = self.eps.get(&key) else {
            let _ = reply.send(Err(ucx_error("send", "endpoint closed")));
            return;
        };
        let param = ffi::RequestParam::default();
        // SAFETY: a live endpoint; the payload stays alive in `in_flight` until the send
        // completes.
        let p = unsafe {
            (self.ucp.tag_send_nbx)(ep.ep, payload.as_ptr().cast(), payload.len(), tag, &param)
        };
        self.track("ucp_tag_send_nbx", p, None, payload, reply);
    }

    fn tag_recv(
        &mut self,
        addr: usize,
        len: usize,
        tag: u64,
        reply: oneshot::Sender<Result<(), KvTransferError>>,
    ) {
        let param = ffi::RequestParam::default();
        // SAFETY: `addr..addr + len` is a region this thread mapped and keeps until the
        // worker ends; a receive still pending when its connection goes is cancelled.
        let p = unsafe {
            (self.ucp.tag_recv_nbx)(self.worker, addr as *mut c_void, len, tag, u64::MAX, &param)
        };
        self.track(
            "ucp_tag_recv_nbx",
            p,
            Some((tag, addr)),
            Bytes::new(),
            reply,
        );
    }

    fn region(&mut self, len: usize) -> Result<RegionInfo, KvTransferError> {
        let mut map = MmapMut::map_anon(len).map_err(|e| ucx_error("map region", e.to_string()))?;
        let params = ffi::MemMapParams {
            field_mask: ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            address: map.as_mut_ptr().cast(),
            length: len,
            ..Default::default()
        };
        let mut memh: ffi::MemH = std::ptr::null_mut();
        // SAFETY: a live context and a mapping this thread owns for the worker's life.
        let status = unsafe { (self.ucp.mem_map)(self.context, &params, &mut memh) };
        if status != ffi::UCS_OK {
            return Err(ucx_error("ucp_mem_map", self.ucp.describe(status)));
        }
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: a live registration; the packed key is copied and released at once.
        let rkey = unsafe {
            let status = (self.ucp.rkey_pack)(self.context, memh, &mut buf, &mut size);
            if status != ffi::UCS_OK {
                (self.ucp.mem_unmap)(self.context, memh);
                return Err(ucx_error("ucp_rkey_pack", self.ucp.describe(status)));
            }
            let copy: Arc<[u8]> = std::slice::from_raw_parts(buf as *const u8, size).into();
            (self.ucp.rkey_buffer_release)(buf);
            copy
        };
        let info = RegionInfo {
            addr: map.as_ptr() as usize,
            len,
            rkey,
        };
        self.regions.push((map, memh));
        Ok(info)
    }

    /// An endpoint without UCX's peer-failure mode, but with an error handler. The mode would
    /// take away the TCP transport's RMA lane, so a rendezvous would arrive as active messages
    /// copied by this thread (3.6x slower in `ucx_perftest`); without it the TCP transport
    /// receives a rendezvous straight into the posted region. A failed peer is still handled:
    /// with a handler installed UCX 1.13 fails the endpoint and its requests and calls the
    /// handler (`ucp_ep_set_failed`), where with no handler it would leave the error unhandled.
    /// A peer that stops without closing its socket is the control socket's and the timeouts'
    /// to catch, as UCX's keep-alive runs only in peer-failure mode.
    fn create_ep(&self, address: &[u8]) -> Result<ffi::Ep, ffi::Status> {
        let mut params = ffi::EpParams {
            field_mask: ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: ffi::UCP_ERR_HANDLING_MODE_NONE,
            ..Default::default()
        };
        params.err_handler.cb = Some(on_peer_error);
        let mut ep: ffi::Ep = std::ptr::null_mut();
        // SAFETY: a live worker; UCX copies what it needs from the address during the call.
        let status = unsafe { (self.ucp.ep_create)(self.worker, &params, &mut ep) };
        if status == ffi::UCS_OK {
            Ok(ep)
        } else {
            Err(status)
        }
    }

    fn connect(&mut self, address: &[u8], rkey: &[u8]) -> Result<u64, KvTransferError> {
        let ep = self
            .create_ep(address)
            .map_err(|status| ucx_error("ucp_ep_create", self.ucp.describe(status)))?;
        let mut handle: ffi::RKey = std::ptr::null_mut();
        // SAFETY: a live endpoint and the peer's packed key bytes.
        let status = unsafe { (self.ucp.ep_rkey_unpack)(ep, rkey.as_ptr().cast(), &mut handle) };
        if status != ffi::UCS_OK {
            self.close_ep(ep);
            return Err(ucx_error("ucp_ep_rkey_unpack", self.ucp.describe(status)));
        }
        let key = self.next_ep;
        self.next_ep += 1;
        self.eps.insert(key, Ep { ep, rkey: handle });
        Ok(key)
    }

    /// Answers the sends and receives that finished, frees finished close requests, and
    /// frees the released regions no receive is posted in any more.
    fn reap(&mut self) {
        let ucp = self.ucp;
        let mut i = 0;
        while i < self.in_flight.len() {
            // SAFETY: a request UCX returned and not yet freed.
            let status = unsafe { (ucp.request_check_status)(self.in_flight[i].request) };
            if status == ffi::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            let done = self.in_flight.swap_remove(i);
            // SAFETY: complete, so freed exactly once here.
            unsafe { (ucp.request_free)(done.request) };
            let _ = done.reply.send(if status == ffi::UCS_OK {
                Ok(())
            } else {
                Err(ucx_error("ucx request", ucp.describe(status)))
            });
        }
        let in_flight = &self.in_flight;
        let free_regions = &self.free_regions;
        self.releasing.retain(|region| {
            let range = region.addr..region.addr + region.len;
            let written = in_flight
                .iter()
                .any(|f| f.recv.is_some_and(|(_, at)| range.contains(&at)));
            if !written {
                free_regions
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(region.clone());
            }
            written
        });
        self.closing.retain(|&r| {
            // SAFETY: as above.
            let status = unsafe { (ucp.request_check_status)(r) };
            if status == ffi::UCS_INPROGRESS {
                return true;
            }
            // SAFETY: as above.
            unsafe { (ucp.request_free)(r) };
            false
        });
    }

    fn close(&mut self, key: u64) {
        if let Some(ep) = self.eps.remove(&key) {
            // SAFETY: the key was unpacked on this endpoint and is destroyed once.
            unsafe { (self.ucp.rkey_destroy)(ep.rkey) };
            self.close_ep(ep.ep);
        }
    }

    fn close_ep(&mut self, ep: ffi::Ep) {
        let param = ffi::RequestParam {
            op_attr_mask: ffi::UCP_OP_ATTR_FIELD_FLAGS,
            // Not forced: ucp.h allows a forced close only with peer-failure handling, and
            // in UCX 1.13 it purges queued wire-up messages into an assertion. A failed
            // endpoint's close completes with the failure.
            flags: 0,
            ..Default::default()
        };
        // SAFETY: a live endpoint, closed once.
        if let Pending::Request(r) = pending(unsafe { (self.ucp.ep_close_nbx)(ep, &param) }) {
            self.closing.push(r);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let keys: Vec<u64> = self.eps.keys().copied().collect();
        for key in keys {
            self.close(key);
        }
        // Let forced closes and failing flushes finish before the worker goes.
        for _ in 0..1000 {
            if self.closing.is_empty() && self.in_flight.is_empty() {
                break;
            }
            // SAFETY: the worker is still live.
            unsafe { (self.ucp.worker_progress)(self.worker) };
            self.reap();
            if !self.closing.is_empty() || !self.in_flight.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // SAFETY: every registration was made on this context; the mappings are unmapped
        // after their registrations (the Vec drops after this loop), then the worker and the
        // context go, in the order ucp.h requires.
        unsafe {
            for (_, memh) in &self.regions {
                (self.ucp.mem_unmap)(self.context, *memh);
            }
            (self.ucp.worker_destroy)(self.worker);
            (self.ucp.cleanup)(self.context);
        }
    }
}
