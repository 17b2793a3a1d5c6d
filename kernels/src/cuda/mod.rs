//! CUDA kernels for one layer's paged KV cache on the GPU: attention, reshape-and-cache and
//! block copies, with the same contracts and layouts as the CPU functions of this crate.
//!
//! The CUDA C++ sources are in `kernels/cuda/`; build.rs compiles them to PTX when the `cuda`
//! feature is on, and [`CudaKernels::new`] loads that PTX into a context (the driver JITs it for
//! the GPU at hand). Every call checks its arguments on the host exactly as the CPU function
//! does and returns [`KernelError`] instead of launching on a bad shape; launches are
//! asynchronous on the kernels' stream. The CPU functions are the references the GPU tests
//! (`tests/cuda_kernels.rs`) compare against.

mod attention;
mod copy;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nvrtc::Ptx;

pub use attention::AttentionKernel;
pub use copy::PinnedStaging;

use crate::gpu_plan::{attention_smem_bytes, WARPS};
use crate::{KernelError, KvDtype, KvElem};

const PAGED_ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
const FLASH_PREFILL_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_prefill.ptx"));
const RESHAPE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/reshape_and_cache.ptx"));
const BLOCK_COPY_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/block_copy.ptx"));

const DTYPES: [&str; 3] = ["f32", "bf16", "f16"];
const HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];
/// Query vectors per warp of the decode instantiations (`_q1`, `_q2`, `_q4`).
const DECODE_QPW: [usize; 3] = [1, 2, 4];
/// Query vectors per warp of the prefill instantiations.
pub(crate) const PREFILL_QPW: usize = 8;

/// A KV element the CUDA kernels take: f32, bf16 or f16.
pub trait CudaKvElem: KvElem + DeviceRepr + ValidAsZeroBits {}
impl<T: KvElem + DeviceRepr + ValidAsZeroBits> CudaKvElem for T {}

/// The loaded kernels of one CUDA context, launching on one stream.
///
/// Cheap to clone; every function is resolved once here, so a launch does no lookup in the
/// driver.
#[derive(Clone)]
pub struct CudaKernels {
    stream: Arc<CudaStream>,
    functions: Arc<HashMap<String, CudaFunction>>,
    num_sms: usize,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("functions", &self.functions.len())
            .field("num_sms", &self.num_sms)
            .finish()
    }
}

impl CudaKernels {
    /// Loads every kernel into `stream`'s context. Fails when no CUDA driver or device is
    /// present, so a CUDA-less machine fails here and not at the first launch.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        let ctx = stream.context().clone();
        let mut functions = HashMap::new();
        let modules = [
            (PAGED_ATTENTION_PTX, decode_names()),
            (FLASH_PREFILL_PTX, prefill_names()),
            (
                RESHAPE_PTX,
                names(&["reshape_and_cache_b16", "reshape_and_cache_b32"]),
            ),
            (BLOCK_COPY_PTX, copy_names()),
        ];
        for (ptx, names) in modules {
            let module = ctx.load_module(Ptx::from_src(ptx))?;
            for (name, smem) in names {
                let f = module.load_function(&name)?;
                // Above 48 KiB a block's dynamic shared memory must be opted into per function.
                if smem > 48 * 1024 {
                    f.set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )?;
                }
                functions.insert(name, f);
            }
        }
        let num_sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        Ok(CudaKernels {
            stream,
            functions: Arc::new(functions),
            num_sms,
        })
    }

    /// Creates a context on device `ordinal` and loads the kernels on its default stream.
    pub fn on_device(ordinal: usize) -> Result<Self, KernelError> {
        let ctx = CudaContext::new(ordinal)?;
        Self::new(ctx.default_stream())
    }

    /// The same kernels launching on `stream`, another stream of their context (a copy
    /// stream beside the model's): nothing is loaded or JIT-compiled again.
    pub fn with_stream(&self, stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        if !Arc::ptr_eq(stream.context(), self.stream.context()) {
            return Err(KernelError::Invalid(
                "the kernels were loaded into another CUDA context than the stream's".into(),
            ));
        }
        Ok(CudaKernels {
            stream,
            functions: self.functions.clone(),
            num_sms: self.num_sms,
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions
            .get(name)
            .ok_or_else(|| KernelError::Invalid(format!("no CUDA kernel named {name}")))
    }
}

/// The kernels' dtype suffix.
pub(crate) fn dtype_name(dtype: KvDtype) -> &'static str {
    dtype.as_str()
}

fn names(list: &[&str]) -> Vec<(String, usize)> {
    list.iter().map(|n| (n.to_string(), 0)).collect()
}

fn decode_names() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for dt in DTYPES {
        for hd in HEAD_DIMS {
            for qpw in DECODE_QPW {
                let smem = attention_smem_bytes(WARPS * qpw, hd);
                for v in ["v1", "v2"] {
                    out.push((format!("paged_attention_{v}_{dt}_hd{hd}_q{qpw}"), smem));
                }
            }
        }
        out.push((format!("paged_attention_reduce_{dt}"), 0));
    }
    out
}

fn prefill_names() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for dt in DTYPES {
        for hd in HEAD_DIMS {
            let smem = attention_smem_bytes(WARPS * PREFILL_QPW, hd);
            out.push((format!("flash_prefill_{dt}_hd{hd}"), smem));
        }
    }
    out
}

fn copy_names() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for suffix in ["v16", "b16"] {
        for op in ["gather_blocks", "scatter_blocks", "copy_blocks"] {
            out.push((format!("{op}_{suffix}"), 0));
        }
    }
    out
}
