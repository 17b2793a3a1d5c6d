//! Byte layout of one layer's KV payload.
//!
//! The decode node's paged cache holds, per layer, K and V of shape
//! `[num_blocks, block_size, num_kv_heads, head_dim]`. A layer payload for a transfer of `n`
//! blocks is `[K of block_ids[0..n], V of block_ids[0..n]]`, contiguous, so it is
//! `2 * n * block_bytes` bytes with `block_bytes = block_size * num_kv_heads * head_dim * elem`.

use std::fmt;
use std::sync::Arc;

use crate::error::KvTransferError;

/// Largest value accepted for any one of `block_size`, `num_kv_heads` and `head_dim`.
pub const MAX_DIM: u32 = 1 << 16;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvDtype {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

impl KvDtype {
    pub fn elem_bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    pub fn from_u8(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::Bf16),
            2 => Some(Self::F16),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Geometry of one cache block, shared by every layer of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

impl KvLayout {
    /// SmolLM2-135M in f32 with 16-token blocks: 3 KV heads of 64, so 12,288 bytes per block
    /// for K and as much for V.
    pub const SMOLLM2_135M_F32: KvLayout = KvLayout {
        dtype: KvDtype::F32,
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    };

    /// Checks that every dimension is in `1..=MAX_DIM`.
    pub fn validate(&self) -> Result<(), &'static str> {
        for (name, value) in [
            ("block_size", self.block_size),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if value == 0 || value > MAX_DIM {
                return Err(name);
            }
        }
        Ok(())
    }

    /// Bytes of K (or of V) in one block. Cannot overflow for dimensions within `MAX_DIM`.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.block_size)
            * u64::from(self.num_kv_heads)
            * u64::from(self.head_dim)
            * self.dtype.elem_bytes()
    }

    /// Bytes of one layer's payload for `num_blocks` blocks (`2 * n * block_bytes`), or `None`
    /// on overflow.
    pub fn layer_payload_bytes(&self, num_blocks: usize) -> Option<u64> {
        u64::try_from(num_blocks)
            .ok()?
            .checked_mul(self.block_bytes())?
            .checked_mul(2)
    }

    /// Bytes of K and V for one token in one layer.
    pub fn token_bytes(&self) -> u64 {
        2 * u64::from(self.num_kv_heads) * u64::from(self.head_dim) * self.dtype.elem_bytes()
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} block_size={} num_kv_heads={} head_dim={}",
            self.dtype, self.block_size, self.num_kv_heads, self.head_dim
        )
    }
}

/// What the sender says about one layer: everything in a frame header except the payload's
/// length and checksum, which are computed from the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerHeader {
    pub xfer_id: u64,
    pub epoch: u64,
    pub layer: u32,
    pub num_layers: u32,
    pub layout: KvLayout,
    /// Destination blocks on the decode node, shared by all layers of a transfer.
    pub block_ids: Arc<[u32]>,
    /// W3C `traceparent` of the sending span, so the receive span can join the trace.
    pub traceparent: Option<String>,
}

impl LayerHeader {
    /// The expected payload length for this header, checked against the frame limits.
    pub fn expected_payload_bytes(&self) -> Result<u64, KvTransferError> {
        self.layout
            .layer_payload_bytes(self.block_ids.len())
            .ok_or_else(|| KvTransferError::InvalidHeader {
                xfer_id: self.xfer_id,
                layer: self.layer,
                field: "block_ids",
                reason: format!("{} blocks overflow the payload size", self.block_ids.len()),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_sizes() {
        let l = KvLayout::SMOLLM2_135M_F32;
        assert_eq!(l.block_bytes(), 16 * 3 * 64 * 4);
        assert_eq!(l.token_bytes(), 1536);
        // 4,096 tokens = 256 blocks: 6 MiB per layer.
        assert_eq!(l.layer_payload_bytes(256), Some(6 * 1024 * 1024));
        assert_eq!(l.layer_payload_bytes(usize::MAX), None);
    }

    #[test]
    fn validate_rejects_zero_and_huge() {
        let mut l = KvLayout::SMOLLM2_135M_F32;
        assert!(l.validate().is_ok());
        l.head_dim = 0;
        assert_eq!(l.validate(), Err("head_dim"));
        l.head_dim = MAX_DIM + 1;
        assert_eq!(l.validate(), Err("head_dim"));
    }
}
