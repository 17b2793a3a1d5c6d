//! The CUDA side of the push's staging ([`super::staging`]): a copy stream of its own, and two
//! pinned host buffers ([`kernels::cuda::PinnedStaging`]) that a layer's blocks are gathered
//! into (`CudaKernels::gather_blocks_to_host`: one gather launch into the buffer's device half,
//! then one asynchronous copy to its pinned half).
//!
//! Ordering: the copy stream waits on an event recorded on the model's stream when the layer
//! is staged, which is after that layer's reshape-and-cache was queued, so the gather reads
//! the layer's finished blocks while the model's stream goes on with the next layer. The
//! export waits on the copy's own event (`PinnedStaging::host`) before it reads the bytes.
//! The buffer a gather writes is never the one the previous layer's export reads
//! (`PushStaging` alternates them), and a buffer is only replaced (grown) after its last copy.
//!
//! The decode side uploads a received layer from pinned memory ([`PinnedUpload`]) on the
//! model's stream, where the scatter into its blocks runs.
//!
//! Not yet run on a GPU: `deploy/gpu-check.sh` runs the 1P+1D cluster on the device, whose
//! push goes through here.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use half::{bf16, f16};
use kernels::cuda::{CudaKernels, CudaKvElem, PinnedStaging};
use kernels::{CacheShape, KernelError};

use crate::error::{EngineError, Result};

/// A slot's pinned buffer, in the cache's dtype.
enum Pinned {
    F32(PinnedStaging<f32>),
    Bf16(PinnedStaging<bf16>),
    F16(PinnedStaging<f16>),
}

/// The element types a device cache holds, and their [`Pinned`] variant.
trait StagedElem: CudaKvElem + CudaDType + bytemuck::Pod {
    fn buffer(p: &mut Option<Pinned>) -> Option<&mut PinnedStaging<Self>>;
    fn wrap(p: PinnedStaging<Self>) -> Pinned;
}

macro_rules! staged_elem {
    ($t:ty, $variant:ident) => {
        impl StagedElem for $t {
            fn buffer(p: &mut Option<Pinned>) -> Option<&mut PinnedStaging<Self>> {
                match p {
                    Some(Pinned::$variant(s)) => Some(s),
                    _ => None,
                }
            }
            fn wrap(p: PinnedStaging<Self>) -> Pinned {
                Pinned::$variant(p)
            }
        }
    };
}
staged_elem!(f32, F32);
staged_elem!(bf16, Bf16);
staged_elem!(f16, F16);

/// The copy stream and the two pinned buffers of one device cache.
pub(crate) struct CopyStager {
    /// The stream the model (and its reshape-and-cache) runs on.
    model: Arc<CudaStream>,
    /// Loaded on the copy stream: every gather and copy here runs on it.
    kernels: CudaKernels,
    buffers: [Option<Pinned>; 2],
    /// Bytes staged in each buffer.
    lens: [usize; 2],
}

fn cuda_err(e: impl Into<KernelError>) -> EngineError {
    EngineError::Kernel(e.into())
}

impl CopyStager {
    /// A copy stream beside the stream of `kv`'s device.
    pub(crate) fn new(kv: &Tensor) -> Result<Self> {
        let Device::Cuda(device) = kv.device() else {
            return Err(EngineError::InvalidConfig {
                reason: "CUDA push staging for a cache that is not on a CUDA device".into(),
            });
        };
        let model = device.cuda_stream();
        // A second stream puts the context in cudarc's multi-stream mode: from now on every
        // buffer records its reads and writes as events, which also orders the next step's
        // writes into a layer after the gather that reads it.
        let copy = model.context().new_stream().map_err(cuda_err)?;
        // The model's kernels, launched on the copy stream: loaded (JIT-compiled) once.
        let kernels = crate::model::device_ops::kernels_for(&model)?.with_stream(copy)?;
        Ok(CopyStager {
            model,
            kernels,
            buffers: [None, None],
            lens: [0; 2],
        })
    }

    /// Queues the gather of blocks `ids` of the layer tensor `kv` into buffer `index`.
    pub(crate) fn stage(
        &mut self,
        index: usize,
        kv: &Tensor,
        shape: &CacheShape,
        ids: &[u32],
    ) -> Result<()> {
        // Everything queued on the model's stream so far, the layer's reshape-and-cache
        // included, comes before the gather.
        let ready = self.model.record_event(None).map_err(cuda_err)?;
        self.kernels.stream().wait(&ready).map_err(cuda_err)?;
        match kv.dtype() {
            DType::F32 => self.stage_typed::<f32>(index, kv, shape, ids),
            DType::BF16 => self.stage_typed::<bf16>(index, kv, shape, ids),
            DType::F16 => self.stage_typed::<f16>(index, kv, shape, ids),
            other => Err(EngineError::UnsupportedDtype {
                dtype: format!("{other:?}"),
            }),
        }
    }

    fn stage_typed<T: StagedElem>(
        &mut self,
        index: usize,
        kv: &Tensor,
        shape: &CacheShape,
        ids: &[u32],
    ) -> Result<()> {
        self.lens[index] = 0;
        if ids.is_empty() {
            return Ok(());
        }
        let elems = 2 * ids.len() * shape.block_elems();
        let capacity = T::buffer(&mut self.buffers[index]).map_or(0, |p| p.len());
        if capacity < elems {
            // Grown geometrically: pinned allocations are slow. The old buffer's last copy
            // finishes before it is freed (waited on here, and on drop).
            if let Some(old) = T::buffer(&mut self.buffers[index]) {
                old.host()?;
            }
            let blocks = ids
                .len()
                .max(2 * capacity / (2 * shape.block_elems()).max(1));
            self.buffers[index] = Some(T::wrap(PinnedStaging::new(&self.kernels, shape, blocks)?));
        }
        let staging =
            T::buffer(&mut self.buffers[index]).ok_or_else(|| EngineError::InvalidConfig {
                reason: "a staging buffer of another dtype than its cache".into(),
            })?;
        let (storage, layout) = kv.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(EngineError::InvalidConfig {
                reason: "a CUDA staging for a cache off the GPU".into(),
            });
        };
        let (a, b) = layout
            .contiguous_offsets()
            .ok_or_else(|| EngineError::InvalidConfig {
                reason: "a non-contiguous layer cache".into(),
            })?;
        let cache = storage.as_cuda_slice::<T>()?;
        let half = (b - a) / 2;
        let (k, v) = (cache.slice(a..a + half), cache.slice(a + half..b));
        let len = self
            .kernels
            .gather_blocks_to_host(shape, &k, &v, ids, staging)?;
        self.lens[index] = len * size_of::<T>();
        Ok(())
    }

    /// Buffer `index`'s staged bytes, once its copy to the host has finished.
    pub(crate) fn host_bytes(&mut self, index: usize) -> Result<&[u8]> {
        let len = self.lens[index];
        if len == 0 {
            return Ok(&[]);
        }
        let bytes: &[u8] = match &mut self.buffers[index] {
            Some(Pinned::F32(p)) => bytemuck::cast_slice(p.host()?),
            Some(Pinned::Bf16(p)) => bytemuck::cast_slice(p.host()?),
            Some(Pinned::F16(p)) => bytemuck::cast_slice(p.host()?),
            None => &[],
        };
        Ok(&bytes[..len])
    }
}

/// The decode side: a received layer's bytes are copied into pinned host memory and uploaded
/// from there on the model's stream (an asynchronous copy, where pageable memory would make
/// the driver stage it again), then scattered into the blocks by the device op, on the same
/// stream. The buffer is write-combined: the host only writes it, the device reads it.
#[derive(Default)]
pub(crate) struct PinnedUpload {
    /// Bytes, as u32 words so any element type's bytes fit aligned.
    host: Option<PinnedHostSlice<u32>>,
    /// The last upload from `host`: it is not written again before this completes.
    in_flight: Option<CudaEvent>,
}

impl PinnedUpload {
    /// `src` (a layer payload in the cache's dtype) as a 1-D tensor on `kv`'s device.
    pub(crate) fn upload(&mut self, kv: &Tensor, src: &[u8]) -> Result<Tensor> {
        let Device::Cuda(device) = kv.device() else {
            return Err(EngineError::InvalidConfig {
                reason: "a pinned upload to a cache that is not on a CUDA device".into(),
            });
        };
        let stream = device.cuda_stream();
        if let Some(event) = self.in_flight.take() {
            event.synchronize().map_err(cuda_err)?;
        }
        let words = src.len().div_ceil(4);
        if self.host.as_ref().is_none_or(|h| h.len() < words) {
            let grown = words.max(2 * self.host.as_ref().map_or(0, |h| h.len()));
            // SAFETY: written below before any read, and only the written part is read.
            self.host =
                Some(unsafe { stream.context().alloc_pinned::<u32>(grown) }.map_err(cuda_err)?);
        }
        let host = self.host.as_mut().expect("allocated above");
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(host.as_mut_slice().map_err(cuda_err)?);
        bytes[..src.len()].copy_from_slice(src);
        let n = src.len() / kv.dtype().size_in_bytes();
        let storage = match kv.dtype() {
            DType::F32 => upload_typed::<f32>(&stream, bytes, n, device)?,
            DType::BF16 => upload_typed::<bf16>(&stream, bytes, n, device)?,
            DType::F16 => upload_typed::<f16>(&stream, bytes, n, device)?,
            other => {
                return Err(EngineError::UnsupportedDtype {
                    dtype: format!("{other:?}"),
                })
            }
        };
        self.in_flight = Some(stream.record_event(None).map_err(cuda_err)?);
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            n,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

/// Queues the copy of the first `n` elements of `bytes` to a new device buffer on `stream`.
fn upload_typed<T: StagedElem>(
    stream: &Arc<CudaStream>,
    bytes: &[u8],
    n: usize,
    device: &candle_core::CudaDevice,
) -> Result<CudaStorage> {
    let host: &[T] = bytemuck::cast_slice(&bytes[..n * size_of::<T>()]);
    // SAFETY: the copy below writes all n elements before anything reads them.
    let mut dev = unsafe { stream.alloc::<T>(n) }.map_err(cuda_err)?;
    stream.memcpy_htod(host, &mut dev).map_err(cuda_err)?;
    Ok(CudaStorage::wrap_cuda_slice(dev, device.clone()))
}
