//! The UCX worker thread's side: the UCP context and worker, the requests in flight, the
//! registered regions and the endpoints, driven by the commands of [`super::worker`]'s
//! handle.

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use memmap2::MmapMut;
use tokio::sync::oneshot;

use super::command::{ucx_error, Cmd, FreeRegions, RegionInfo, WorkerOptions};
use super::ffi::{self, pending, Pending, Ucp};
use crate::error::KvTransferError;

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

/// Polls a millisecond apart with nothing to do before a worker is destroyed.
const QUIET_POLLS: u32 = 20;

/// How long the thread polls UCX for the next event of a request in flight before it sleeps.
/// `fission bench kvtransfer`, 3 alternating rounds: a 1K-token transfer over UCX took 14-16 ms
/// without it, 10-13 ms with 50 µs, at the same CPU per byte (0.39-0.43 ms/MB);
/// benchmarks/history/2026-11-29-ucx-rma.md.
const SPIN: Duration = Duration::from_micros(50);

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
pub(super) struct Progress {
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
    pub(super) fn init(
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

    pub(super) fn run(&mut self, rx: &mpsc::Receiver<Cmd>, wake: &OwnedFd) {
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
            // With requests in flight, their next event is usually microseconds away: poll
            // for it a moment before sleeping, which saves two context switches a message.
            if !self.in_flight.is_empty() && self.spin(SPIN) {
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

    /// Progresses the worker for up to `budget`; whether anything happened.
    fn spin(&mut self, budget: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < budget {
            // SAFETY: the worker is live and used only on this thread.
            if unsafe { (self.ucp.worker_progress)(self.worker) } != 0 {
                return true;
            }
            std::hint::spin_loop();
        }
        false
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
        // Receives nobody will answer now: cancel them, so that they complete.
        for f in &self.in_flight {
            if f.recv.is_some() {
                // SAFETY: a live receive request; it completes (cancelled) and is reaped.
                unsafe { (self.ucp.request_cancel)(self.worker, f.request) };
            }
        }
        let keys: Vec<u64> = self.eps.keys().copied().collect();
        for key in keys {
            self.close(key);
        }
        // Let closes and sends finish, then let the worker go quiet: UCX 1.13 asserts when
        // the worker is destroyed with a wire-up message still queued (its purge expects none
        // but EP_REMOVED, EP_CHECK and ACK), which a connection set up moments before can
        // leave. Bounded, for a peer that never answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        let mut quiet = 0;
        while std::time::Instant::now() < deadline && quiet < QUIET_POLLS {
            // SAFETY: the worker is still live.
            let progressed = unsafe { (self.ucp.worker_progress)(self.worker) } != 0;
            self.reap();
            let busy = !self.closing.is_empty() || !self.in_flight.is_empty();
            if progressed || busy {
                quiet = 0;
            } else {
                quiet += 1;
            }
            if !progressed {
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
