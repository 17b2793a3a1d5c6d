//! KV copies on the GPU: reshape-and-cache, block gather/scatter through a contiguous staging
//! buffer (on the device, or pinned host memory for the QUIC/TCP transports) and copy-on-write
//! block copies. Raw bits move, so every result is bit-exact with the CPU functions in
//! [`crate::copy`].
//!
//! The staging layout is the KV-transfer wire layout (K of every block, then V of every block),
//! so one launch per layer replaces a memcpy per block. With GPUDirect RDMA later, a transport
//! registers the device staging buffer and the pinned copy drops out.

use cudarc::driver::{
    CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::{CudaKernels, CudaKvElem};
use crate::copy::check_transfer;
use crate::gpu_plan::{copy_waves, last_wins_ids, last_wins_slots, SKIP_ID};
use crate::{CacheShape, KernelError};

const THREADS: u32 = 256;

/// Word size of a block copy: 16-byte words when every block starts 16-byte aligned.
fn block_words(block_bytes: usize, ptrs: &[u64]) -> (&'static str, u64) {
    if block_bytes.is_multiple_of(16) && ptrs.iter().all(|p| p % 16 == 0) {
        ("v16", (block_bytes / 16) as u64)
    } else {
        // Every dtype is 2 or 4 bytes, so a block is a whole number of 2-byte words.
        ("b16", (block_bytes / 2) as u64)
    }
}

fn grid_len(what: &str, n: usize) -> Result<u32, KernelError> {
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= i32::MAX as u32)
        .ok_or_else(|| KernelError::Invalid(format!("{what} {n} exceeds the CUDA grid limit")))
}

/// Rejects layouts whose last block id would collide with the scatter kernel's skip marker.
fn check_ids_fit(layout: &CacheShape) -> Result<(), KernelError> {
    if layout.num_blocks > SKIP_ID as usize {
        return Err(KernelError::Invalid(format!(
            "num_blocks {} exceeds {SKIP_ID}",
            layout.num_blocks
        )));
    }
    Ok(())
}

impl CudaKernels {
    /// [`crate::reshape_and_cache`] on the device: token `t`'s K/V rows go to slot `slots[t]`,
    /// and the last token wins when a slot repeats.
    pub fn reshape_and_cache<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &mut impl DevicePtrMut<T>,
        v_cache: &mut impl DevicePtrMut<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        slots: &[u32],
    ) -> Result<(), KernelError> {
        crate::copy::check_reshape(
            layout,
            [k_cache.len(), v_cache.len()],
            [k.len(), v.len()],
            slots,
        )?;
        let row = layout.row_elems();
        if slots.is_empty() {
            return Ok(());
        }
        let num_tokens = grid_len("tokens", slots.len())? as i32;
        let row_elems = grid_len("row elements", row)? as i32;
        let stream = &self.stream;
        let slots = stream.clone_htod(&last_wins_slots(slots))?;
        let name = match size_of::<T>() {
            2 => "reshape_and_cache_b16",
            _ => "reshape_and_cache_b32",
        };
        let (kc, _g1) = k_cache.device_ptr_mut(stream);
        let (vc, _g2) = v_cache.device_ptr_mut(stream);
        let (kp, _g3) = k.device_ptr(stream);
        let (vp, _g4) = v.device_ptr(stream);
        let cfg = LaunchConfig {
            grid_dim: ((num_tokens as u32).min(1 << 16), 1, 1),
            block_dim: ((row as u32).next_multiple_of(32).min(THREADS), 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(name)?;
        // SAFETY: every slot is below num_slots and k/v hold num_tokens rows, as checked above.
        unsafe {
            stream
                .launch_builder(f)
                .arg(&kc)
                .arg(&vc)
                .arg(&kp)
                .arg(&vp)
                .arg(&slots)
                .arg(&num_tokens)
                .arg(&row_elems)
                .launch(cfg)?
        };
        Ok(())
    }

    /// [`crate::gather_blocks`] on the device: `dst` gets K of every id, then V of every id.
    pub fn gather_blocks<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &impl DevicePtr<T>,
        v_cache: &impl DevicePtr<T>,
        block_ids: &[u32],
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), KernelError> {
        let (k_len, v_len) = (k_cache.len(), v_cache.len());
        check_transfer(layout, k_len, v_len, block_ids, "dst", dst.len())?;
        check_ids_fit(layout)?;
        if block_ids.is_empty() {
            return Ok(());
        }
        let stream = &self.stream;
        let ids = stream.clone_htod(block_ids)?;
        let (kc, _g1) = k_cache.device_ptr(stream);
        let (vc, _g2) = v_cache.device_ptr(stream);
        let (to, _g3) = dst.device_ptr_mut(stream);
        self.launch_block_copy("gather_blocks", layout, size_of::<T>(), &ids, [kc, vc, to])
    }

    /// [`crate::scatter_blocks`] on the device: `src` laid out as [`Self::gather_blocks`]
    /// writes it; the last copy wins when an id repeats.
    pub fn scatter_blocks<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &mut impl DevicePtrMut<T>,
        v_cache: &mut impl DevicePtrMut<T>,
        block_ids: &[u32],
        src: &impl DevicePtr<T>,
    ) -> Result<(), KernelError> {
        let (k_len, v_len) = (k_cache.len(), v_cache.len());
        check_transfer(layout, k_len, v_len, block_ids, "src", src.len())?;
        check_ids_fit(layout)?;
        if block_ids.is_empty() {
            return Ok(());
        }
        let stream = &self.stream;
        let ids = stream.clone_htod(&last_wins_ids(block_ids))?;
        let (kc, _g1) = k_cache.device_ptr_mut(stream);
        let (vc, _g2) = v_cache.device_ptr_mut(stream);
        let (from, _g3) = src.device_ptr(stream);
        self.launch_block_copy(
            "scatter_blocks",
            layout,
            size_of::<T>(),
            &ids,
            [kc, vc, from],
        )
    }

    /// One gather or scatter launch: grid (ids, K/V).
    fn launch_block_copy(
        &self,
        op: &str,
        layout: &CacheShape,
        elem_bytes: usize,
        ids: &CudaSlice<u32>,
        [kc, vc, buf]: [u64; 3],
    ) -> Result<(), KernelError> {
        let n = grid_len("block ids", ids.len())?;
        let (suffix, words) = block_words(layout.block_elems() * elem_bytes, &[kc, vc, buf]);
        let f = self.function(&format!("{op}_{suffix}"))?;
        let cfg = LaunchConfig {
            grid_dim: (n, 2, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n as i32;
        // SAFETY: the ids are checked blocks of this layout (or the skip marker) and the
        // buffer holds 2 * n blocks, as check_transfer verified.
        unsafe {
            self.stream
                .launch_builder(f)
                .arg(&kc)
                .arg(&vc)
                .arg(ids)
                .arg(&n)
                .arg(&buf)
                .arg(&words)
                .launch(cfg)?
        };
        Ok(())
    }

    /// [`crate::copy_blocks`] on the device, with its in-order semantics: pairs that touch a
    /// block another pair writes go to a later launch.
    pub fn copy_blocks<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &mut impl DevicePtrMut<T>,
        v_cache: &mut impl DevicePtrMut<T>,
        pairs: &[(u32, u32)],
    ) -> Result<(), KernelError> {
        layout.validate()?;
        layout.check_cache("k_cache", k_cache.len())?;
        layout.check_cache("v_cache", v_cache.len())?;
        for &(src, dst) in pairs {
            layout.check_block(src)?;
            layout.check_block(dst)?;
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let waves = copy_waves(pairs);
        let flat: Vec<u32> = waves.iter().flatten().flat_map(|&(s, d)| [s, d]).collect();
        let stream = &self.stream;
        let flat = stream.clone_htod(&flat)?;
        let (kc, _g1) = k_cache.device_ptr_mut(stream);
        let (vc, _g2) = v_cache.device_ptr_mut(stream);
        let (pairs_ptr, _g3) = flat.device_ptr(stream);
        let (suffix, words) = block_words(layout.block_elems() * size_of::<T>(), &[kc, vc]);
        let f = self.function(&format!("copy_blocks_{suffix}"))?;
        let mut offset = 0u64;
        for wave in &waves {
            let cfg = LaunchConfig {
                grid_dim: (grid_len("block pairs", wave.len())?, 2, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let wave_pairs = pairs_ptr + offset * 8;
            // SAFETY: every id was checked above; waves run in stream order and no two pairs of
            // one wave touch a block another of them writes.
            unsafe {
                stream
                    .launch_builder(f)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&wave_pairs)
                    .arg(&words)
                    .launch(cfg)?
            };
            offset += wave.len() as u64;
        }
        Ok(())
    }

    /// Gathers blocks into `staging`'s device buffer and copies them to its pinned host
    /// buffer, for a transport to send. Returns the number of elements staged; read them with
    /// [`PinnedStaging::host`], which waits for the copy.
    pub fn gather_blocks_to_host<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &impl DevicePtr<T>,
        v_cache: &impl DevicePtr<T>,
        block_ids: &[u32],
        staging: &mut PinnedStaging<T>,
    ) -> Result<usize, KernelError> {
        let len = staging.check_fits(layout, block_ids.len())?;
        staging.wait()?;
        let mut dst = staging.device.slice_mut(..len);
        self.gather_blocks(layout, k_cache, v_cache, block_ids, &mut dst)?;
        let host = &mut staging.host.as_mut_slice()?[..len];
        self.stream
            .memcpy_dtoh(&staging.device.slice(..len), host)?;
        staging.in_flight = Some(self.stream.record_event(None)?);
        Ok(len)
    }

    /// Copies the first `2 * block_ids.len()` blocks of `staging`'s pinned host buffer (filled
    /// through [`PinnedStaging::host_mut`], laid out as a gather writes it) to the device and
    /// scatters them into the named blocks.
    pub fn scatter_blocks_from_host<T: CudaKvElem>(
        &self,
        layout: &CacheShape,
        k_cache: &mut impl DevicePtrMut<T>,
        v_cache: &mut impl DevicePtrMut<T>,
        block_ids: &[u32],
        staging: &mut PinnedStaging<T>,
    ) -> Result<(), KernelError> {
        let len = staging.check_fits(layout, block_ids.len())?;
        staging.wait()?;
        let host = &staging.host.as_slice()?[..len];
        let mut dev = staging.device.slice_mut(..len);
        self.stream.memcpy_htod(host, &mut dev)?;
        self.scatter_blocks(layout, k_cache, v_cache, block_ids, &dev)?;
        // The host buffer must not change until the copy has read it.
        staging.in_flight = Some(self.stream.record_event(None)?);
        Ok(())
    }
}

/// A device staging buffer and a pinned host buffer of the same length, for moving a layer's
/// blocks between the GPU cache and a host transport.
///
/// The host side is ordinary (cached, not write-combined) page-locked memory, because the send
/// path reads it from the CPU.
pub struct PinnedStaging<T> {
    device: CudaSlice<T>,
    host: PinnedHostSlice<T>,
    /// The last copy that uses the host buffer; host access waits for it.
    in_flight: Option<CudaEvent>,
}

impl<T: CudaKvElem> PinnedStaging<T> {
    /// Staging for up to `max_blocks` blocks of `layout` (K and V).
    pub fn new(
        kernels: &CudaKernels,
        layout: &CacheShape,
        max_blocks: usize,
    ) -> Result<Self, KernelError> {
        let len = max_blocks
            .saturating_mul(layout.block_elems())
            .saturating_mul(2);
        let stream = kernels.stream();
        let device = stream.alloc_zeros::<T>(len)?;
        // SAFETY: the memory is filled below before anything reads it.
        let mut host = unsafe { stream.context().alloc_pinned_with_flags::<T>(len, 0)? };
        host.as_mut_slice()?.fill(T::default());
        Ok(PinnedStaging {
            device,
            host,
            in_flight: None,
        })
    }

    /// Capacity in elements.
    pub fn len(&self) -> usize {
        self.device.len()
    }

    pub fn is_empty(&self) -> bool {
        self.device.len() == 0
    }

    /// The host buffer, once the last copy into it has finished.
    pub fn host(&mut self) -> Result<&[T], KernelError> {
        self.wait()?;
        Ok(self.host.as_slice()?)
    }

    /// The host buffer for writing, once the last copy out of it has finished.
    pub fn host_mut(&mut self) -> Result<&mut [T], KernelError> {
        self.wait()?;
        Ok(self.host.as_mut_slice()?)
    }

    fn wait(&mut self) -> Result<(), KernelError> {
        if let Some(event) = self.in_flight.take() {
            event.synchronize()?;
        }
        Ok(())
    }

    fn check_fits(&self, layout: &CacheShape, num_blocks: usize) -> Result<usize, KernelError> {
        let len = num_blocks
            .saturating_mul(layout.block_elems())
            .saturating_mul(2);
        if len > self.len() {
            return Err(KernelError::BadLength {
                what: "staging",
                expected: len,
                given: self.len(),
            });
        }
        Ok(len)
    }
}
