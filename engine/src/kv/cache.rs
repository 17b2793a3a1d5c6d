//! Paged KV storage: per layer, K and V of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
//!
//! It can export any set of blocks of one layer as contiguous bytes and import them back, with
//! a described layout, which is what KV transfer between nodes sends.

use half::{bf16, f16};
use kernels::{KvDtype, KvElem, KvLayout};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::ids::BlockId;

/// One layer's K or V storage, in the cache dtype.
#[derive(Debug)]
pub enum KvBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl KvBuf {
    fn zeros(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => KvBuf::F32(vec![0.0; n]),
            KvDtype::BF16 => KvBuf::BF16(vec![bf16::ZERO; n]),
            KvDtype::F16 => KvBuf::F16(vec![f16::ZERO; n]),
        }
    }
}

/// A type-erased pair of mutable K and V slices, so callers dispatch on dtype once.
pub enum LayerKvMut<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    BF16(&'a mut [bf16], &'a mut [bf16]),
    F16(&'a mut [f16], &'a mut [f16]),
}

/// What a receiver must agree on before it accepts exported bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayoutDesc {
    pub dtype: KvDtypeName,
    pub num_layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Serializable dtype name (kernels stays serde-free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtypeName {
    F32,
    Bf16,
    F16,
}

impl From<KvDtype> for KvDtypeName {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => KvDtypeName::F32,
            KvDtype::BF16 => KvDtypeName::Bf16,
            KvDtype::F16 => KvDtypeName::F16,
        }
    }
}

impl KvLayoutDesc {
    /// Bytes of one block of one layer, K and V together.
    pub fn block_bytes(&self) -> usize {
        let elem = match self.dtype {
            KvDtypeName::F32 => 4,
            KvDtypeName::Bf16 | KvDtypeName::F16 => 2,
        };
        2 * self.block_size * self.num_kv_heads * self.head_dim * elem
    }
}

impl std::fmt::Display for KvLayoutDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} layers={} block_size={} kv_heads={} head_dim={}",
            self.dtype, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        )
    }
}

#[derive(Debug)]
struct LayerKv {
    k: KvBuf,
    v: KvBuf,
}

/// The whole paged cache of one engine.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    dtype: KvDtype,
    layers: Vec<LayerKv>,
}

impl KvCache {
    pub fn new(num_layers: usize, layout: KvLayout, dtype: KvDtype) -> Self {
        let n = layout.layer_elems();
        let layers = (0..num_layers)
            .map(|_| LayerKv {
                k: KvBuf::zeros(dtype, n),
                v: KvBuf::zeros(dtype, n),
            })
            .collect();
        KvCache {
            layout,
            dtype,
            layers,
        }
    }

    /// How many blocks fit in `kv_bytes`.
    pub fn blocks_for_bytes(
        kv_bytes: usize,
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> usize {
        let per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.size_bytes();
        kv_bytes / per_block.max(1)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn desc(&self) -> KvLayoutDesc {
        KvLayoutDesc {
            dtype: self.dtype.into(),
            num_layers: self.layers.len(),
            block_size: self.layout.block_size,
            num_kv_heads: self.layout.num_kv_heads,
            head_dim: self.layout.head_dim,
        }
    }

    /// Total bytes held by the cache.
    pub fn kv_bytes(&self) -> usize {
        2 * self.layers.len() * self.layout.layer_elems() * self.dtype.size_bytes()
    }

    pub fn layer_mut(&mut self, layer: usize) -> LayerKvMut<'_> {
        let l = &mut self.layers[layer];
        match (&mut l.k, &mut l.v) {
            (KvBuf::F32(k), KvBuf::F32(v)) => LayerKvMut::F32(k, v),
            (KvBuf::BF16(k), KvBuf::BF16(v)) => LayerKvMut::BF16(k, v),
            (KvBuf::F16(k), KvBuf::F16(v)) => LayerKvMut::F16(k, v),
            _ => unreachable!("K and V of a layer are created with one dtype"),
        }
    }

    /// Bytes that `export_blocks` produces for `num_blocks` blocks of one layer.
    pub fn export_len(&self, num_blocks: usize) -> usize {
        2 * num_blocks * self.layout.block_elems() * self.dtype.size_bytes()
    }

    /// Copies the given blocks of one layer into `dst` as `[K blocks..., V blocks...]` in
    /// `block_ids` order, native-endian elements of the cache dtype.
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
        let layout = self.layout;
        match self.layer_mut(layer) {
            LayerKvMut::F32(k, v) => gather::<f32>(&layout, k, v, &ids, dst),
            LayerKvMut::BF16(k, v) => gather::<bf16>(&layout, k, v, &ids, dst),
            LayerKvMut::F16(k, v) => gather::<f16>(&layout, k, v, &ids, dst),
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
        let layout = self.layout;
        match self.layer_mut(layer) {
            LayerKvMut::F32(k, v) => scatter::<f32>(&layout, k, v, &ids, src),
            LayerKvMut::BF16(k, v) => scatter::<bf16>(&layout, k, v, &ids, src),
            LayerKvMut::F16(k, v) => scatter::<f16>(&layout, k, v, &ids, src),
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.layers.len() {
            return Err(EngineError::InvalidParameter {
                field: "layer",
                reason: format!("must be < {}", self.layers.len()),
                given: layer.to_string(),
            });
        }
        Ok(())
    }
}

fn raw_ids(ids: &[BlockId]) -> Vec<u32> {
    ids.iter().map(|b| b.0).collect()
}

fn gather<T: KvElem + bytemuck::Pod>(
    layout: &KvLayout,
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
    layout: &KvLayout,
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
        let layout = KvLayout {
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 4,
        };
        for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
            let mut a = KvCache::new(2, layout, dtype);
            // Fill layer 1 with distinct values through the typed view.
            match a.layer_mut(1) {
                LayerKvMut::F32(k, v) => fill(k, v),
                LayerKvMut::BF16(k, v) => fill(k, v),
                LayerKvMut::F16(k, v) => fill(k, v),
            }
            let ids = [BlockId(5), BlockId(1), BlockId(6)];
            let mut bytes = vec![0u8; a.export_len(ids.len())];
            a.export_blocks(1, &ids, &mut bytes).expect("export");
            let mut b = KvCache::new(2, layout, dtype);
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

    fn fill<T: KvElem>(k: &mut [T], v: &mut [T]) {
        for (i, x) in k.iter_mut().enumerate() {
            *x = T::from_f32(i as f32 * 0.5);
        }
        for (i, x) in v.iter_mut().enumerate() {
            *x = T::from_f32(-(i as f32) * 0.25);
        }
    }
}
