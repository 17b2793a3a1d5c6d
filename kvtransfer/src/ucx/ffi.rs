//! The few UCP calls the UCX backend makes, loaded from `libucp.so.0` at run time.
//!
//! Loading at run time, not linking, keeps every build and every other backend free of UCX:
//! only a node started with `--kv-transport ucx` needs the library (Debian's `libucx0`), and
//! one without it fails at construction with the loader's message. The declarations are
//! written by hand against UCX 1.13's `ucp.h` (API 1.13); the tests at the end pin the struct
//! sizes and field offsets to the ones `sizeof`/`offsetof` gave for that header on x86-64
//! Linux (benchmarks/history/2026-11-29-ucx.md). Only what the backend uses is
//! declared: contexts and workers, endpoints to a worker address, memory registration and
//! remote keys, tagged sends and receives (and their cancellation), and the worker's wake-up
//! file descriptor.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

pub(crate) type Status = c_int;
pub(crate) type Context = *mut c_void;
pub(crate) type Worker = *mut c_void;
pub(crate) type Ep = *mut c_void;
pub(crate) type MemH = *mut c_void;
pub(crate) type RKey = *mut c_void;
pub(crate) type Config = *mut c_void;
/// A request pointer, `NULL` (done), or an error status cast to a pointer (`UCS_PTR_*`).
pub(crate) type StatusPtr = *mut c_void;

pub(crate) const UCS_OK: Status = 0;
pub(crate) const UCS_INPROGRESS: Status = 1;
pub(crate) const UCS_ERR_BUSY: Status = -15;
/// `UCS_ERR_LAST`: status pointers at or above `-100` as an address are errors.
const UCS_ERR_LAST: isize = -100;

pub(crate) const API_MAJOR: c_uint = 1;
pub(crate) const API_MINOR: c_uint = 13;

pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_FEATURE_TAG: u64 = 1 << 0;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;

/// `ucp_params_t` (80 bytes).
#[repr(C)]
pub(crate) struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (200 bytes): only the thread mode is set; the rest stays zero.
#[repr(C)]
pub(crate) struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub _rest: [u8; 188],
}

/// `ucp_err_handler_t`.
#[repr(C)]
pub(crate) struct ErrHandler {
    pub cb: Option<unsafe extern "C" fn(*mut c_void, Ep, Status)>,
    pub arg: *mut c_void,
}

/// `ucp_ep_params_t` (104 bytes): address, error mode and handler; the rest stays zero.
#[repr(C)]
pub(crate) struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler: ErrHandler,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub _rest: [u64; 6],
}

/// `ucp_mem_map_params_t` (40 bytes).
#[repr(C)]
pub(crate) struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_request_param_t` (72 bytes): no callbacks; completion is polled.
#[repr(C)]
pub(crate) struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: MemH,
}

macro_rules! zeroed_default {
    ($($t:ty),*) => {$(
        impl Default for $t {
            fn default() -> Self {
                // SAFETY: a plain C struct of integers and nullable pointers, for which all
                // zeroes is the "no field set" value UCX documents.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed_default!(Params, WorkerParams, EpParams, MemMapParams, RequestParam);

/// The loaded library's entry points.
#[allow(clippy::type_complexity)]
pub(crate) struct Ucp {
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Config) -> Status,
    pub config_modify: unsafe extern "C" fn(Config, *const c_char, *const c_char) -> Status,
    pub config_release: unsafe extern "C" fn(Config),
    pub init_version:
        unsafe extern "C" fn(c_uint, c_uint, *const Params, Config, *mut Context) -> Status,
    pub cleanup: unsafe extern "C" fn(Context),
    pub worker_create: unsafe extern "C" fn(Context, *const WorkerParams, *mut Worker) -> Status,
    pub worker_destroy: unsafe extern "C" fn(Worker),
    pub worker_get_address: unsafe extern "C" fn(Worker, *mut *mut c_void, *mut usize) -> Status,
    pub worker_release_address: unsafe extern "C" fn(Worker, *mut c_void),
    pub worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> Status,
    pub worker_arm: unsafe extern "C" fn(Worker) -> Status,
    pub ep_create: unsafe extern "C" fn(Worker, *const EpParams, *mut Ep) -> Status,
    pub ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> StatusPtr,
    pub mem_map: unsafe extern "C" fn(Context, *const MemMapParams, *mut MemH) -> Status,
    pub mem_unmap: unsafe extern "C" fn(Context, MemH) -> Status,
    pub rkey_pack: unsafe extern "C" fn(Context, MemH, *mut *mut c_void, *mut usize) -> Status,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack: unsafe extern "C" fn(Ep, *const c_void, *mut RKey) -> Status,
    pub rkey_destroy: unsafe extern "C" fn(RKey),
    pub tag_send_nbx:
        unsafe extern "C" fn(Ep, *const c_void, usize, u64, *const RequestParam) -> StatusPtr,
    pub tag_recv_nbx: unsafe extern "C" fn(
        Worker,
        *mut c_void,
        usize,
        u64,
        u64,
        *const RequestParam,
    ) -> StatusPtr,
    pub request_cancel: unsafe extern "C" fn(Worker, *mut c_void),
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(Status) -> *const c_char,
}

// SAFETY: plain function pointers into a library that stays loaded for the process's life.
unsafe impl Send for Ucp {}
unsafe impl Sync for Ucp {}

/// The library, loaded once; `Err` is why it could not be (kept, so every caller sees it).
pub(crate) fn ucp() -> Result<&'static Ucp, String> {
    static UCP: OnceLock<Result<Ucp, String>> = OnceLock::new();
    UCP.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A symbol's address as the function pointer type `F` the caller declares it with.
///
/// # Safety
/// `F` must be an `extern "C" fn` type matching the symbol's C signature.
unsafe fn fn_from_symbol<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(
        std::mem::size_of::<F>(),
        std::mem::size_of::<*mut c_void>(),
        "a function pointer is one pointer wide"
    );
    // SAFETY: same size (checked above); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

fn load() -> Result<Ucp, String> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed, so the function
    // pointers taken from it stay valid.
    let handle =
        unsafe { libc::dlopen(c"libucp.so.0".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return Err(format!(
            "UCX is not installed (libucp.so.0: {}); on Debian, apt-get install libucx0",
            dl_error()
        ));
    }
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: a NUL-terminated symbol name in a live handle; dlsym searches libucp
            // and its dependencies (libucs for ucs_status_string).
            let p = unsafe { libc::dlsym(handle, concat!($name, "\0").as_ptr().cast()) };
            if p.is_null() {
                return Err(format!("libucp.so.0 has no {}: {}", $name, dl_error()));
            }
            // SAFETY: the symbol has the C signature declared for it in `Ucp` (ucp.h 1.13).
            unsafe { fn_from_symbol(p) }
        }};
    }
    Ok(Ucp {
        config_read: sym!("ucp_config_read"),
        config_modify: sym!("ucp_config_modify"),
        config_release: sym!("ucp_config_release"),
        init_version: sym!("ucp_init_version"),
        cleanup: sym!("ucp_cleanup"),
        worker_create: sym!("ucp_worker_create"),
        worker_destroy: sym!("ucp_worker_destroy"),
        worker_get_address: sym!("ucp_worker_get_address"),
        worker_release_address: sym!("ucp_worker_release_address"),
        worker_progress: sym!("ucp_worker_progress"),
        worker_get_efd: sym!("ucp_worker_get_efd"),
        worker_arm: sym!("ucp_worker_arm"),
        ep_create: sym!("ucp_ep_create"),
        ep_close_nbx: sym!("ucp_ep_close_nbx"),
        mem_map: sym!("ucp_mem_map"),
        mem_unmap: sym!("ucp_mem_unmap"),
        rkey_pack: sym!("ucp_rkey_pack"),
        rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
        rkey_destroy: sym!("ucp_rkey_destroy"),
        tag_send_nbx: sym!("ucp_tag_send_nbx"),
        tag_recv_nbx: sym!("ucp_tag_recv_nbx"),
        request_cancel: sym!("ucp_request_cancel"),
        request_check_status: sym!("ucp_request_check_status"),
        request_free: sym!("ucp_request_free"),
        status_string: sym!("ucs_status_string"),
    })
}

impl Ucp {
    /// UCX's name for `status`.
    pub(crate) fn describe(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any status.
        let s = unsafe { (self.status_string)(status) };
        if s.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null and static (above).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

/// What a `ucs_status_ptr_t` holds.
pub(crate) enum Pending {
    Done,
    Request(*mut c_void),
    Failed(Status),
}

/// Splits a status pointer as `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR` do.
pub(crate) fn pending(p: StatusPtr) -> Pending {
    let v = p as isize;
    if p.is_null() {
        Pending::Done
    } else if (UCS_ERR_LAST..0).contains(&v) {
        Pending::Failed(v as Status)
    } else {
        Pending::Request(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_have_ucp_h_sizes() {
        // The sizes ucp.h 1.13 gives on 64-bit Linux (`sizeof` in C).
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::size_of::<WorkerParams>(), 200);
        assert_eq!(std::mem::size_of::<EpParams>(), 104);
        assert_eq!(std::mem::size_of::<MemMapParams>(), 40);
        assert_eq!(std::mem::size_of::<RequestParam>(), 72);
        assert_eq!(std::mem::offset_of!(EpParams, err_handler), 24);
        assert_eq!(std::mem::offset_of!(EpParams, flags), 48);
        assert_eq!(std::mem::offset_of!(RequestParam, datatype), 24);
        assert_eq!(std::mem::offset_of!(RequestParam, memh), 64);
    }

    #[test]
    fn status_pointers_split_as_ucs_ptr_macros_do() {
        assert!(matches!(pending(std::ptr::null_mut()), Pending::Done));
        assert!(matches!(pending(-6isize as StatusPtr), Pending::Failed(-6)));
        assert!(matches!(pending(0x1000 as StatusPtr), Pending::Request(_)));
    }
}
