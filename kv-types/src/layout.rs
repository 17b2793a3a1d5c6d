//! A model's KV cache geometry.
//!
//! Per layer, K and V each have shape `[num_blocks, block_size, num_kv_heads, head_dim]`. A
//! layer's payload for a transfer of `n` blocks is `[K of the n blocks, V of the n blocks]`,
//! contiguous: `2 * n * block_bytes()` bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::KvDtype;

/// Largest value accepted for any one of `block_size`, `num_kv_heads` and `head_dim`.
pub const MAX_DIM: u32 = 1 << 16;
/// Largest `num_layers` accepted.
pub const MAX_NUM_LAYERS: u32 = 1 << 16;

/// What two nodes must agree on before one reads the other's KV blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub num_layers: u32,
    /// Tokens per block.
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

/// A layout field outside its range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidLayout {
    pub field: &'static str,
    pub value: u32,
    pub max: u32,
}

impl fmt::Display for InvalidLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is {}, must be in 1..={}",
            self.field, self.value, self.max
        )
    }
}

impl std::error::Error for InvalidLayout {}

impl KvLayout {
    /// SmolLM2-135M in f32 with 16-token blocks: 30 layers, 3 KV heads of 64, so 12,288 bytes
    /// per block for K and as much for V.
    pub const SMOLLM2_135M_F32: KvLayout = KvLayout {
        dtype: KvDtype::F32,
        num_layers: 30,
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    };

    /// Checks every dimension against its range, so the byte counts below cannot overflow.
    pub fn validate(&self) -> Result<(), InvalidLayout> {
        for (field, value, max) in [
            ("num_layers", self.num_layers, MAX_NUM_LAYERS),
            ("block_size", self.block_size, MAX_DIM),
            ("num_kv_heads", self.num_kv_heads, MAX_DIM),
            ("head_dim", self.head_dim, MAX_DIM),
        ] {
            if value == 0 || value > max {
                return Err(InvalidLayout { field, value, max });
            }
        }
        Ok(())
    }

    /// Elements of one token's row of K (or V) in one layer: `num_kv_heads * head_dim`.
    pub fn row_elems(&self) -> usize {
        self.num_kv_heads as usize * self.head_dim as usize
    }

    /// Elements of one block of K (or of V) in one layer.
    pub fn block_elems(&self) -> usize {
        self.block_size as usize * self.row_elems()
    }

    /// Bytes of K (or of V) in one block of one layer, its scales included (an int8 block is
    /// its elements, then one scale per token row and kv head).
    pub fn block_bytes(&self) -> u64 {
        self.block_elems() as u64 * self.dtype.size_bytes() as u64 + self.block_scale_bytes()
    }

    /// Bytes of the scales of K (or of V) in one block of one layer: 0 for the float dtypes.
    pub fn block_scale_bytes(&self) -> u64 {
        u64::from(self.block_size) * u64::from(self.num_kv_heads) * self.dtype.scale_bytes() as u64
    }

    /// Bytes of one layer's payload for `num_blocks` blocks (`2 * n * block_bytes`), or `None`
    /// on overflow.
    pub fn layer_payload_bytes(&self, num_blocks: usize) -> Option<u64> {
        u64::try_from(num_blocks)
            .ok()?
            .checked_mul(self.block_bytes())?
            .checked_mul(2)
    }

    /// Bytes of K and V for one token in one layer, scales included.
    pub fn token_bytes(&self) -> u64 {
        2 * (self.row_elems() as u64 * self.dtype.size_bytes() as u64
            + u64::from(self.num_kv_heads) * self.dtype.scale_bytes() as u64)
    }

    /// Bytes of one block across every layer, K and V: what one block of capacity costs.
    pub fn bytes_per_block_all_layers(&self) -> u64 {
        2 * u64::from(self.num_layers) * self.block_bytes()
    }

    /// Blocks that hold `num_tokens` positions.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil((self.block_size as usize).max(1))
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers={} block_size={} num_kv_heads={} head_dim={}",
            self.dtype, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        )
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
        assert_eq!(l.bytes_per_block_all_layers(), 2 * 30 * 12_288);
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(16), 1);
        assert_eq!(l.blocks_for(17), 2);
    }

    #[test]
    fn int8_counts_its_scales() {
        let l = KvLayout {
            dtype: KvDtype::Int8,
            ..KvLayout::SMOLLM2_135M_F32
        };
        let bf16 = KvLayout {
            dtype: KvDtype::Bf16,
            ..l
        };
        // Elements are half of bf16's; each token row of each kv head adds a 4-byte scale.
        assert_eq!(l.block_scale_bytes(), 16 * 3 * 4);
        assert_eq!(l.block_bytes(), 16 * 3 * 64 + 16 * 3 * 4);
        assert_eq!(bf16.block_scale_bytes(), 0);
        assert_eq!(
            2 * (l.block_bytes() - l.block_scale_bytes()),
            bf16.block_bytes()
        );
        assert_eq!(l.token_bytes(), 2 * (3 * 64 + 3 * 4));
        assert_eq!(l.token_bytes() * 16, 2 * l.block_bytes());
        assert_eq!(l.layer_payload_bytes(2), Some(4 * l.block_bytes()));
    }

    #[test]
    fn validate_rejects_zero_and_huge() {
        let mut l = KvLayout::SMOLLM2_135M_F32;
        assert!(l.validate().is_ok());
        l.head_dim = 0;
        assert_eq!(l.validate().unwrap_err().field, "head_dim");
        l.head_dim = MAX_DIM + 1;
        assert_eq!(l.validate().unwrap_err().field, "head_dim");
        l.head_dim = 64;
        l.num_layers = MAX_NUM_LAYERS + 1;
        assert_eq!(l.validate().unwrap_err().field, "num_layers");
    }

    #[test]
    fn serde_round_trip_uses_dtype_names() {
        let l = KvLayout::SMOLLM2_135M_F32;
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.contains("\"dtype\":\"f32\""), "{json}");
        assert_eq!(serde_json::from_str::<KvLayout>(&json).unwrap(), l);
    }
}
