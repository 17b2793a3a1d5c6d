//! Paged KV storage: per layer, K and V of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
//!
//! It can export any set of blocks of one layer as contiguous bytes and import them back, with
//! a described layout, which is what KV transfer between nodes sends.
//!
//! Where a layer's KV lives follows the model (`Model::kv_device`): host vectors for the
//! host path, or one tensor per layer on the model's device for the tensor path, read and
//! written through `model::device_ops` (on the CPU, a CPU tensor: the same code a GPU runs).
//! The allocator, the prefix cache and the block tables stay on the host either way. A device
//! cache exports through a staging tensor (`device_ops::gather_blocks`, copied to host bytes)
//! and imports the other way (`device_ops::scatter_blocks`), in the byte layout the host
//! cache's exports have, so the push and the nodes do not know which one they hold. A
//! prefill step stages each finished layer ahead of its export ([`crate::kv::staging`]: on
//! a GPU, pinned memory filled on a copy stream while the next layer computes), and a GPU
//! import uploads from pinned memory.
//!
//! An int8 cache (`KvDtype::Int8`) also holds one f32 scale per token slot and kv head beside
//! each layer's K and V (see `kernels::quantize_row_int8` for why per row); its exports carry
//! the scales after the elements, as `KvLayout::layer_payload_bytes` counts them.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use kernels::{CacheShape, Int8KvMut, KvDtype, KvElem};
use kv_types::KvLayout;

use crate::error::{EngineError, Result};
use crate::ids::BlockId;
use crate::kv::groups::KvGroups;
use crate::kv::staging::{BlockBytes, PushStaging, StagingStats};
use crate::model::device_ops;

/// One layer's K or V storage, in the cache dtype.
#[derive(Debug)]
pub enum KvBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    /// Elements, and a scale per token slot and kv head.
    Int8 {
        data: Vec<i8>,
        scales: Vec<f32>,
    },
}

impl KvBuf {
    /// `n` elements (and, for int8, `scales` scales) of zeros, mapped in lazily like
    /// [`zeroed_u16_vec`]'s (`vec![0; n]` of a primitive is a `calloc`).
    fn zeros(dtype: KvDtype, n: usize, scales: usize) -> Self {
        match dtype {
            KvDtype::Int8 => KvBuf::Int8 {
                data: vec![0; n],
                scales: vec![0.0; scales],
            },
            KvDtype::F32 => KvBuf::F32(vec![0.0; n]),
            KvDtype::Bf16 => KvBuf::Bf16(zeroed_u16_vec::<bf16>(n)),
            KvDtype::F16 => KvBuf::F16(zeroed_u16_vec::<f16>(n)),
        }
    }
}

/// `n` zeros of a 16-bit float type, from zeroed memory the kernel maps in only when a page is
/// first written (`vec![0u16; n]` is a `calloc`; `vec![bf16::ZERO; n]` writes every byte). A
/// cache sized for a node's memory then costs the blocks in use, not its whole size, which
/// is what lets dozens of mock nodes share one machine.
/// Called with bf16 and f16 only.
fn zeroed_u16_vec<T: Copy>(n: usize) -> Vec<T> {
    assert_eq!(std::mem::size_of::<T>(), 2);
    assert_eq!(std::mem::align_of::<T>(), 2);
    let v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    // SAFETY: T is a 16-bit float (bf16 or f16: `repr(transparent)` over u16, size and
    // alignment checked above) whose all-zero bit pattern is +0.0; the allocation moves from
    // the u16 vector (never dropped) to the T vector with the same length and capacity.
    unsafe { Vec::from_raw_parts(v.as_ptr() as *mut T, v.len(), v.capacity()) }
}

/// Writes the first element of every 4 KiB page of `v` with the value it holds. A volatile
/// write, so the compiler cannot drop a store of an unchanged value.
fn touch_pages<T: Copy>(v: &mut [T]) {
    let step = (4096 / std::mem::size_of::<T>().max(1)).max(1);
    for x in v.iter_mut().step_by(step) {
        // SAFETY: `x` is a valid, aligned, exclusive reference.
        unsafe { std::ptr::write_volatile(x, *x) };
    }
}

/// A type-erased pair of mutable K and V slices, so callers dispatch on dtype once.
pub enum LayerKvMut<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    Bf16(&'a mut [bf16], &'a mut [bf16]),
    F16(&'a mut [f16], &'a mut [f16]),
    Int8(Int8KvMut<'a>, Int8KvMut<'a>),
}

#[derive(Debug)]
struct LayerKv {
    k: KvBuf,
    v: KvBuf,
}

/// Where the layers' K and V live.
#[derive(Debug)]
enum Layers {
    /// Host vectors, for the host path (and an int8 cache on the CPU's tensor path).
    Host(Vec<LayerKv>),
    /// One `[2, layer_elems]` tensor a layer (K then V) on the model's device, for the tensor
    /// path's device ops.
    Device(Vec<Tensor>),
}

/// The whole paged cache of one engine.
#[derive(Debug)]
pub struct KvCache {
    /// The model-wide geometry: what a node exchanging these blocks must share.
    layout: KvLayout,
    /// One layer's K (or V) storage, as the kernels index it.
    shape: CacheShape,
    layers: Layers,
    /// Which layers share a block table ([`crate::kv::groups`]), and each layer's storage:
    /// a sliding-window group's pool is smaller than `shape`'s.
    groups: KvGroups,
    layer_shapes: Vec<CacheShape>,
    /// A device cache's finished layers, gathered ahead for the push ([`crate::kv::staging`]).
    staging: PushStaging,
}

impl KvCache {
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let groups = KvGroups::single(layout.num_layers as usize);
        Self::with_groups(layout, groups, &[num_blocks])
    }

    /// A cache whose layers of group `g` hold `pool_blocks[g]` blocks; group 0's count is
    /// [`shape`](Self::shape)'s.
    pub fn with_groups(layout: KvLayout, groups: KvGroups, pool_blocks: &[usize]) -> Self {
        assert_eq!(pool_blocks.len(), groups.num_groups(), "one pool per group");
        let shape = CacheShape::new(&layout, pool_blocks[0]);
        let layer_shapes: Vec<CacheShape> = (0..layout.num_layers as usize)
            .map(|l| CacheShape::new(&layout, pool_blocks[groups.group_of(l)]))
            .collect();
        let layers = layer_shapes
            .iter()
            .map(|s| {
                let (n, scales) = (s.layer_elems(), s.num_slots() * s.num_kv_heads);
                LayerKv {
                    k: KvBuf::zeros(layout.dtype, n, scales),
                    v: KvBuf::zeros(layout.dtype, n, scales),
                }
            })
            .collect();
        KvCache {
            layout,
            shape,
            layers: Layers::Host(layers),
            groups,
            layer_shapes,
            staging: PushStaging::default(),
        }
    }

    /// [`with_groups`](Self::with_groups) with every layer a zeroed tensor on `device`.
    pub fn with_groups_on(
        layout: KvLayout,
        groups: KvGroups,
        pool_blocks: &[usize],
        device: &Device,
    ) -> Result<Self> {
        let Some(dtype) = device_dtype(layout.dtype, device.is_cpu())? else {
            return Ok(Self::with_groups(layout, groups, pool_blocks));
        };
        let mut cache = Self::with_groups(
            layout,
            groups,
            &vec![0; pool_blocks.len()], // no host storage; the shapes are set below
        );
        let shape = CacheShape::new(&layout, pool_blocks[0]);
        let layer_shapes: Vec<CacheShape> = (0..layout.num_layers as usize)
            .map(|l| CacheShape::new(&layout, pool_blocks[cache.groups.group_of(l)]))
            .collect();
        let layers = layer_shapes
            .iter()
            .map(|s| match device {
                // Zeros mapped in lazily, as the host cache's are: a cache sized for the
                // machine costs the blocks in use (candle writes every bf16 zero).
                Device::Cpu => lazy_zeros(layout.dtype, 2 * s.layer_elems()),
                _ => device_ops::layer_cache(s, dtype, device),
            })
            .collect::<Result<Vec<_>>>()?;
        cache.shape = shape;
        cache.layer_shapes = layer_shapes;
        cache.layers = Layers::Device(layers);
        Ok(cache)
    }

    /// Whether the layers live in device tensors ([`layer_tensor`](Self::layer_tensor)), not
    /// host vectors ([`layer_mut`](Self::layer_mut)).
    pub fn is_on_device(&self) -> bool {
        matches!(self.layers, Layers::Device(_))
    }

    /// `layer`'s `[2, layer_elems]` tensor (K then V) when the cache lives on a device.
    pub fn layer_tensor(&self, layer: usize) -> Option<&Tensor> {
        match &self.layers {
            Layers::Device(t) => t.get(layer),
            Layers::Host(_) => None,
        }
    }

    /// The storage shape of `layer`: its group's pool.
    pub fn layer_shape(&self, layer: usize) -> &CacheShape {
        &self.layer_shapes[layer]
    }

    /// Which layers share a block table.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// Maps in every page of the storage now, by writing the zero each page already holds.
    /// A device cache is left as it is: the device allocator zeroed it.
    pub fn prefault(&mut self) {
        let Layers::Host(layers) = &mut self.layers else {
            return;
        };
        for layer in layers {
            for buf in [&mut layer.k, &mut layer.v] {
                match buf {
                    KvBuf::F32(v) => touch_pages(v),
                    KvBuf::Bf16(v) => touch_pages(v),
                    KvBuf::F16(v) => touch_pages(v),
                    KvBuf::Int8 { data, scales } => {
                        touch_pages(data);
                        touch_pages(scales);
                    }
                }
            }
        }
    }

    /// How many blocks of `layout` fit in `kv_bytes`.
    pub fn blocks_for_bytes(kv_bytes: usize, layout: &KvLayout) -> usize {
        kv_bytes / (layout.bytes_per_block_all_layers() as usize).max(1)
    }

    /// The geometry a peer must share to read these blocks.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The full-attention group's storage shape (every layer's, without window groups).
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    pub fn dtype(&self) -> KvDtype {
        self.layout.dtype
    }

    pub fn num_layers(&self) -> usize {
        self.layer_shapes.len()
    }

    /// Total bytes held by the cache, scales included.
    pub fn kv_bytes(&self) -> usize {
        let layer_block = 2 * self.layout.block_bytes() as usize;
        self.layer_shapes
            .iter()
            .map(|s| s.num_blocks * layer_block)
            .sum()
    }

    /// `layer`'s host K and V. The host path's view: a cache it reads is made on the host
    /// (`Model::kv_device`), so a device cache here is a bug, not an input.
    pub fn layer_mut(&mut self, layer: usize) -> LayerKvMut<'_> {
        let Layers::Host(layers) = &mut self.layers else {
            panic!("the host view of a KV cache that lives on a device (see Model::kv_device)")
        };
        let l = &mut layers[layer];
        match (&mut l.k, &mut l.v) {
            (KvBuf::F32(k), KvBuf::F32(v)) => LayerKvMut::F32(k, v),
            (KvBuf::Bf16(k), KvBuf::Bf16(v)) => LayerKvMut::Bf16(k, v),
            (KvBuf::F16(k), KvBuf::F16(v)) => LayerKvMut::F16(k, v),
            (
                KvBuf::Int8 {
                    data: kd,
                    scales: ks,
                },
                KvBuf::Int8 {
                    data: vd,
                    scales: vs,
                },
            ) => LayerKvMut::Int8(
                Int8KvMut {
                    data: kd,
                    scales: ks,
                },
                Int8KvMut {
                    data: vd,
                    scales: vs,
                },
            ),
            _ => unreachable!("K and V of a layer are created with one dtype"),
        }
    }

    /// Bytes that `export_blocks` produces for `num_blocks` blocks of one layer (an int8
    /// cache's scales included).
    pub fn export_len(&self, num_blocks: usize) -> usize {
        2 * num_blocks * self.layout.block_bytes() as usize
    }

    /// Copies the given blocks of one layer into `dst` as `[K blocks..., V blocks...]` in
    /// `block_ids` order, native-endian elements of the cache dtype. An int8 cache writes each
    /// of K and V as its blocks' elements, then their scales (`kernels::gather_blocks_int8`).
    pub fn export_blocks(
        &mut self,
        layer: usize,
        block_ids: &[BlockId],
        dst: &mut [u8],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let ids = raw_ids(block_ids);
        let expected = self.export_len(ids.len());
        if dst.len() != expected {
            return Err(EngineError::InvalidParameter {
                field: "export buffer",
                reason: format!("must be {expected} bytes"),
                given: dst.len().to_string(),
            });
        }
        let shape = self.layer_shapes[layer];
        if let Layers::Device(t) = &self.layers {
            let block = BlockBytes {
                elems: shape.block_elems() * self.layout.dtype.size_bytes(),
                scales: self.layout.block_scale_bytes() as usize,
            };
            if self.staging.serve(layer, &ids, block, dst)? {
                return Ok(());
            }
            // Gathered on the device into one staging tensor, then copied to `dst`.
            let staging = device_ops::gather_blocks(&t[layer], &shape, &ids)?;
            return super::staging::copy_to_bytes(&staging.to_device(&Device::Cpu)?, dst);
        }
        match self.layer_mut(layer) {
            LayerKvMut::F32(k, v) => gather::<f32>(&shape, k, v, &ids, dst),
            LayerKvMut::Bf16(k, v) => gather::<bf16>(&shape, k, v, &ids, dst),
            LayerKvMut::F16(k, v) => gather::<f16>(&shape, k, v, &ids, dst),
            LayerKvMut::Int8(k, v) => Ok(kernels::gather_blocks_int8(
                &shape,
                k.as_ref(),
                v.as_ref(),
                &ids,
                dst,
            )?),
        }
    }

    /// The inverse of [`export_blocks`](Self::export_blocks).
    pub fn import_blocks(&mut self, layer: usize, block_ids: &[BlockId], src: &[u8]) -> Result<()> {
        self.check_layer(layer)?;
        let ids = raw_ids(block_ids);
        let expected = self.export_len(ids.len());
        if src.len() != expected {
            return Err(EngineError::InvalidParameter {
                field: "import buffer",
                reason: format!("must be {expected} bytes"),
                given: src.len().to_string(),
            });
        }
        let shape = self.layer_shapes[layer];
        if let Layers::Device(t) = &self.layers {
            // Blocks a staged layer holds may change now.
            self.staging.clear();
            // The bytes as one staging tensor on the device, scattered into the blocks.
            let kv = &t[layer];
            let staging = self.staging.upload(kv, src)?;
            return device_ops::scatter_blocks(kv, &staging, &shape, &ids);
        }
        match self.layer_mut(layer) {
            LayerKvMut::F32(k, v) => scatter::<f32>(&shape, k, v, &ids, src),
            LayerKvMut::Bf16(k, v) => scatter::<bf16>(&shape, k, v, &ids, src),
            LayerKvMut::F16(k, v) => scatter::<f16>(&shape, k, v, &ids, src),
            LayerKvMut::Int8(k, v) => Ok(kernels::scatter_blocks_int8(&shape, k, v, &ids, src)?),
        }
    }

    /// Prefill: gathers blocks `block_ids` of the finished `layer` into the push's staging, for
    /// [`export_blocks`](Self::export_blocks) to send from ([`crate::kv::staging`]). On a GPU
    /// the copy is queued on its own stream and this returns at once. A host cache has nothing
    /// to stage: its exports read the cache itself.
    pub fn stage_layer(&mut self, layer: usize, block_ids: &[BlockId]) -> Result<()> {
        self.check_layer(layer)?;
        let Layers::Device(t) = &self.layers else {
            return Ok(());
        };
        let shape = self.layer_shapes[layer];
        self.staging
            .stage(layer, &t[layer], &shape, &raw_ids(block_ids))
    }

    /// Forgets the staged layers: their blocks may be written from now on.
    pub fn clear_staged(&mut self) {
        self.staging.clear();
    }

    /// The layers the push's staging holds (at most two).
    pub fn staged_layers(&self) -> Vec<usize> {
        self.staging.layers()
    }

    /// How this cache's exports were served: from the staging, or gathered directly.
    pub fn staging_stats(&self) -> StagingStats {
        self.staging.stats()
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.num_layers() {
            return Err(EngineError::InvalidParameter {
                field: "layer",
                reason: format!("must be < {}", self.num_layers()),
                given: layer.to_string(),
            });
        }
        Ok(())
    }
}

/// The tensor dtype of a device cache of `dtype`; `None` for an int8 cache on the CPU, which
/// stays in host vectors (the host kernels' int8 attention), and an error for int8 on any
/// other device: the device ops and the CUDA kernels have no int8 (a scale per token row and
/// head) yet, so a GPU node refuses it when its engine starts rather than at the first step.
fn device_dtype(dtype: KvDtype, on_cpu: bool) -> Result<Option<DType>> {
    Ok(Some(match dtype {
        KvDtype::F32 => DType::F32,
        KvDtype::Bf16 => DType::BF16,
        KvDtype::F16 => DType::F16,
        KvDtype::Int8 if on_cpu => return Ok(None),
        KvDtype::Int8 => {
            return Err(EngineError::InvalidConfig {
                reason: "an int8 KV cache has no device kernels yet: use --kv-cache-dtype \
                         bf16 (or f16, f32) on a GPU"
                    .into(),
            })
        }
    }))
}

/// A `[2, n / 2]` CPU tensor of zeros from lazily mapped memory ([`KvBuf::zeros`]).
fn lazy_zeros(dtype: KvDtype, n: usize) -> Result<Tensor> {
    let shape = (2, n / 2);
    Ok(match dtype {
        KvDtype::Bf16 => Tensor::from_vec(zeroed_u16_vec::<bf16>(n), shape, &Device::Cpu)?,
        KvDtype::F16 => Tensor::from_vec(zeroed_u16_vec::<f16>(n), shape, &Device::Cpu)?,
        _ => Tensor::from_vec(vec![0f32; n], shape, &Device::Cpu)?,
    })
}

fn raw_ids(ids: &[BlockId]) -> Vec<u32> {
    ids.iter().map(|b| b.0).collect()
}

fn gather<T: KvElem + bytemuck::Pod>(
    layout: &CacheShape,
    k: &[T],
    v: &[T],
    ids: &[u32],
    dst: &mut [u8],
) -> Result<()> {
    // Byte buffers from the network are not aligned for T, so stage through a typed buffer
    // when the cast is not possible.
    match bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        Ok(typed) => kernels::gather_blocks(layout, k, v, ids, typed)?,
        Err(_) => {
            let mut tmp = vec![T::default(); dst.len() / std::mem::size_of::<T>()];
            kernels::gather_blocks(layout, k, v, ids, &mut tmp)?;
            dst.copy_from_slice(bytemuck::cast_slice(&tmp));
        }
    }
    Ok(())
}

fn scatter<T: KvElem + bytemuck::Pod>(
    layout: &CacheShape,
    k: &mut [T],
    v: &mut [T],
    ids: &[u32],
    src: &[u8],
) -> Result<()> {
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(typed) => kernels::scatter_blocks(layout, k, v, ids, typed)?,
        Err(_) => {
            let tmp: Vec<T> = bytemuck::pod_collect_to_vec(src);
            kernels::scatter_blocks(layout, k, v, ids, &tmp)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_import_round_trip_is_bit_exact() {
        for dtype in KvDtype::ALL {
            let layout = KvLayout {
                dtype,
                num_layers: 2,
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 4,
                windows: Default::default(),
            };
            let mut a = KvCache::new(layout, 8);
            // Fill layer 1 with distinct values through the typed view.
            match a.layer_mut(1) {
                LayerKvMut::F32(k, v) => fill(k, v),
                LayerKvMut::Bf16(k, v) => fill(k, v),
                LayerKvMut::F16(k, v) => fill(k, v),
                LayerKvMut::Int8(k, v) => {
                    for (i, x) in k.data.iter_mut().chain(v.data.iter_mut()).enumerate() {
                        *x = (i % 251) as i8;
                    }
                    for (i, s) in k.scales.iter_mut().chain(v.scales.iter_mut()).enumerate() {
                        *s = 0.01 * (i + 1) as f32;
                    }
                }
            }
            let ids = [BlockId(5), BlockId(1), BlockId(6)];
            let mut bytes = vec![0u8; a.export_len(ids.len())];
            a.export_blocks(1, &ids, &mut bytes).expect("export");
            let mut b = KvCache::new(layout, 8);
            let dst = [BlockId(0), BlockId(2), BlockId(3)];
            b.import_blocks(1, &dst, &bytes).expect("import");
            let mut again = vec![0u8; b.export_len(dst.len())];
            b.export_blocks(1, &dst, &mut again).expect("export");
            assert_eq!(bytes, again, "{dtype:?}");
            assert!(bytes.iter().any(|&x| x != 0));
            // A wrong-sized buffer is refused, not truncated.
            assert!(b.import_blocks(1, &dst, &bytes[1..]).is_err());
            assert!(b.import_blocks(2, &dst, &bytes).is_err());
        }
    }

    /// Int8 stays on the host on the CPU and is refused, naming the way out, anywhere else.
    #[test]
    fn an_int8_cache_is_refused_off_the_cpu() {
        assert_eq!(device_dtype(KvDtype::Int8, true).unwrap(), None);
        let e = device_dtype(KvDtype::Int8, false).unwrap_err().to_string();
        assert!(
            e.contains("int8") && e.contains("--kv-cache-dtype bf16"),
            "{e}"
        );
        assert_eq!(
            device_dtype(KvDtype::Bf16, false).unwrap(),
            Some(DType::BF16)
        );
        assert_eq!(device_dtype(KvDtype::F32, true).unwrap(), Some(DType::F32));
    }

    fn fill<T: KvElem>(k: &mut [T], v: &mut [T]) {
        for (i, x) in k.iter_mut().enumerate() {
            *x = T::from_f32(i as f32 * 0.5);
        }
        for (i, x) in v.iter_mut().enumerate() {
            *x = T::from_f32(-(i as f32) * 0.25);
        }
    }
}
