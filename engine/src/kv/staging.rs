//! The push's staging of a device cache: a finished layer's pushed blocks gathered into a host
//! buffer ahead of the export that sends them, so a GPU copies layer N to the host while it
//! computes layer N + 1.
//!
//! The engine stages each finished layer ([`KvCache::stage_layer`], called by its layer
//! pipeline) and hands the previous layer to the prefill node's hook only then; the hook's
//! [`KvCache::export_blocks`] is served from the staged bytes. Two buffers alternate: layer
//! N + 1's gather goes to the buffer layer N does not hold, so it cannot overwrite what layer
//! N is still sending. A buffer names its layer and blocks, and an export of anything else
//! (another layer, a block it did not gather) falls back to the direct gather, so staging only
//! ever changes where bytes come from, never which bytes.
//!
//! - CUDA (`staging_cuda`): pinned host buffers, filled on a copy stream of their own that
//!   waits on an event recorded on the model's stream after the layer's reshape-and-cache;
//!   the export waits on the copy's event, so the send starts once the bytes are on the host.
//! - The CPU: the buffer is the host memory the push reads, filled by the same gather the
//!   direct export runs, in the same order, so the CPU tests run this control flow.
//!
//! A staged layer is valid until its blocks are written again: the engine clears the staging
//! when the step that staged it ends ([`KvCache::clear_staged`]), and an import clears it too.
//!
//! [`KvCache::stage_layer`]: super::cache::KvCache::stage_layer
//! [`KvCache::export_blocks`]: super::cache::KvCache::export_blocks
//! [`KvCache::clear_staged`]: super::cache::KvCache::clear_staged

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use kernels::CacheShape;

use crate::error::{EngineError, Result};
use crate::model::cpu_slice::with_slice;

/// How the exports of a device cache were served, since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Layers gathered into a staging buffer.
    pub staged: u64,
    /// Exports served from a staging buffer.
    pub served: u64,
    /// Exports of a device cache that gathered directly (nothing staged held their blocks).
    pub direct: u64,
}

/// One buffer's contents: which layer, and the blocks in the order they were gathered.
#[derive(Debug, Default)]
struct Slot {
    layer: Option<usize>,
    ids: Vec<u32>,
    /// Each id's first position in `ids`.
    position: HashMap<u32, usize>,
    /// The CPU's staged bytes.
    bytes: Vec<u8>,
    /// The bytes are in this slot's pinned buffer in `staging_cuda` instead.
    #[cfg(feature = "cuda")]
    pinned: bool,
}

/// The two alternating staging buffers of a device cache.
#[derive(Default)]
pub(crate) struct PushStaging {
    slots: [Slot; 2],
    /// The slot the next layer goes to: the one the last staged layer is not in.
    next: usize,
    stats: StagingStats,
    #[cfg(feature = "cuda")]
    cuda: Option<super::staging_cuda::CopyStager>,
    #[cfg(feature = "cuda")]
    upload: super::staging_cuda::PinnedUpload,
}

impl std::fmt::Debug for PushStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushStaging")
            .field("layers", &self.layers())
            .field("stats", &self.stats)
            .finish()
    }
}

/// Byte sizes of one block's parts in an export: its elements, then (int8) its scales.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockBytes {
    pub elems: usize,
    pub scales: usize,
}

impl PushStaging {
    /// Gathers blocks `ids` of `layer` (the `[2, layer_elems]` tensor `kv`) into the buffer
    /// the last staged layer is not in. On a GPU the copy is only queued here.
    pub(crate) fn stage(
        &mut self,
        layer: usize,
        kv: &Tensor,
        shape: &CacheShape,
        ids: &[u32],
    ) -> Result<()> {
        let index = self.next;
        let slot = &mut self.slots[index];
        slot.layer = None;
        match kv.device() {
            Device::Cpu => {
                let staged = super::super::model::device_ops::gather_blocks(kv, shape, ids)?;
                slot.bytes
                    .resize(staged.elem_count() * staged.dtype().size_in_bytes(), 0);
                copy_to_bytes(&staged, &mut slot.bytes)?;
                #[cfg(feature = "cuda")]
                {
                    slot.pinned = false;
                }
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let stager = match &mut self.cuda {
                    Some(s) => s,
                    none => none.insert(super::staging_cuda::CopyStager::new(kv)?),
                };
                stager.stage(index, kv, shape, ids)?;
                slot.bytes.clear();
                slot.pinned = true;
            }
            other => {
                return Err(crate::error::EngineError::InvalidConfig {
                    reason: format!("no push staging for a KV cache on {other:?}"),
                })
            }
        }
        slot.ids.clear();
        slot.ids.extend_from_slice(ids);
        slot.position.clear();
        for (i, &id) in ids.iter().enumerate().rev() {
            slot.position.insert(id, i);
        }
        slot.layer = Some(layer);
        self.next = 1 - index;
        self.stats.staged += 1;
        Ok(())
    }

    /// Writes blocks `ids` of `layer` into `dst` (the export layout) from a staging buffer
    /// that holds them all; `false` when none does, and the caller gathers directly.
    pub(crate) fn serve(
        &mut self,
        layer: usize,
        ids: &[u32],
        block: BlockBytes,
        dst: &mut [u8],
    ) -> Result<bool> {
        let Some(index) = (0..2).find(|&i| {
            let s = &self.slots[i];
            s.layer == Some(layer) && ids.iter().all(|id| s.position.contains_key(id))
        }) else {
            self.stats.direct += 1;
            return Ok(false);
        };
        let slot = &self.slots[index];
        #[cfg(feature = "cuda")]
        let staged: &[u8] = match (&mut self.cuda, slot.pinned) {
            // Waits for the copy into pinned memory to finish.
            (Some(stager), true) => stager.host_bytes(index)?,
            _ => &slot.bytes,
        };
        #[cfg(not(feature = "cuda"))]
        let staged: &[u8] = &slot.bytes;
        copy_staged(staged, &slot.ids, &slot.position, ids, block, dst);
        self.stats.served += 1;
        Ok(true)
    }

    /// Decode: a received layer's bytes (`src`, in `kv`'s dtype) as a 1-D tensor on `kv`'s
    /// device, for the scatter into its blocks. On a GPU they go through pinned memory.
    pub(crate) fn upload(&mut self, kv: &Tensor, src: &[u8]) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if kv.device().is_cuda() {
            return self.upload.upload(kv, src);
        }
        let n = src.len() / kv.dtype().size_in_bytes();
        Ok(Tensor::from_raw_buffer(src, kv.dtype(), &[n], kv.device())?)
    }

    /// Forgets every staged layer (their blocks may be written from now on).
    pub(crate) fn clear(&mut self) {
        for slot in &mut self.slots {
            slot.layer = None;
        }
    }

    /// The layers the buffers hold.
    pub(crate) fn layers(&self) -> Vec<usize> {
        self.slots.iter().filter_map(|s| s.layer).collect()
    }

    pub(crate) fn stats(&self) -> StagingStats {
        self.stats
    }
}

/// Copies blocks `want` from `staged` (blocks `have` in the export layout: K's elements, K's
/// scales, V's elements, V's scales) into `dst` in the same layout.
fn copy_staged(
    staged: &[u8],
    have: &[u32],
    position: &HashMap<u32, usize>,
    want: &[u32],
    block: BlockBytes,
    dst: &mut [u8],
) {
    if want == have {
        dst.copy_from_slice(&staged[..dst.len()]);
        return;
    }
    let (n, m) = (have.len(), want.len());
    let whole = block.elems + block.scales;
    for half in 0..2 {
        let src = &staged[half * n * whole..(half + 1) * n * whole];
        let out = &mut dst[half * m * whole..(half + 1) * m * whole];
        for (j, id) in want.iter().enumerate() {
            let p = position[id];
            let e = block.elems;
            out[j * e..(j + 1) * e].copy_from_slice(&src[p * e..(p + 1) * e]);
            let (s, base_out, base_src) = (block.scales, m * e, n * e);
            out[base_out + j * s..base_out + (j + 1) * s]
                .copy_from_slice(&src[base_src + p * s..base_src + (p + 1) * s]);
        }
    }
}

/// Copies a contiguous CPU tensor's elements into `dst` as native-endian bytes.
pub(super) fn copy_to_bytes(t: &Tensor, dst: &mut [u8]) -> Result<()> {
    fn copy<T: candle_core::WithDType + bytemuck::Pod>(t: &Tensor, dst: &mut [u8]) -> Result<()> {
        with_slice::<T, _>(t, |s| {
            dst.copy_from_slice(bytemuck::cast_slice(s));
        })
    }
    match t.dtype() {
        DType::F32 => copy::<f32>(t, dst),
        DType::BF16 => copy::<bf16>(t, dst),
        DType::F16 => copy::<f16>(t, dst),
        other => Err(EngineError::UnsupportedDtype {
            dtype: format!("{other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subset in another order, with scales, comes out as a gather of it would.
    #[test]
    fn serving_a_subset_reorders_elements_and_scales() {
        let block = BlockBytes {
            elems: 3,
            scales: 2,
        };
        let have = [7u32, 2, 9];
        // Block b's element bytes are 10 * b + i, its scale bytes 100 + 10 * b + i; V's + 1.
        let half = |v: u8| {
            let mut out: Vec<u8> = have
                .iter()
                .flat_map(|&b| (0..3).map(move |i| 10 * b as u8 + i + v))
                .collect();
            out.extend(
                have.iter()
                    .flat_map(|&b| (0..2).map(move |i| 100 + 10 * b as u8 + i + v)),
            );
            out
        };
        let staged = [half(0), half(1)].concat();
        let position = have.iter().enumerate().map(|(i, &b)| (b, i)).collect();
        let want = [9u32, 7];
        let mut dst = vec![0u8; 2 * want.len() * 5];
        copy_staged(&staged, &have, &position, &want, block, &mut dst);
        let expect: Vec<u8> = (0..2u8)
            .flat_map(|v| {
                let elems = want
                    .iter()
                    .flat_map(move |&b| (0..3).map(move |i| 10 * b as u8 + i + v));
                let scales = want
                    .iter()
                    .flat_map(move |&b| (0..2).map(move |i| 100 + 10 * b as u8 + i + v));
                elems.chain(scales).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(dst, expect);
    }
}
