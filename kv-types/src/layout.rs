//! A model's KV cache geometry.
//!
//! Per layer, K and V each have shape `[num_blocks, block_size, num_kv_heads, head_dim]`. A
//! layer's payload for a transfer of `n` blocks is `[K of the n blocks, V of the n blocks]`,
//! contiguous: `2 * n * block_bytes()` bytes.
//!
//! A sliding-window layer's push carries only the blocks its window still reads at the
//! prompt's last position, so two nodes exchange KV only when they agree on which layers slide
//! and how far: [`LayerWindows`], a digest of each layer's window, is part of the layout. The
//! KV frames carry the geometry alone ([`KvLayout::same_geometry`]); the windows are agreed
//! on the control plane (registration, admission, the reservation's layout).

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
    /// Which layers keep (and push) only a sliding window of blocks. Absent from a record
    /// written before it existed, which then reads as [`LayerWindows::NONE`].
    #[serde(default, skip_serializing_if = "LayerWindows::is_none")]
    pub windows: LayerWindows,
}

/// A digest of a cache's per-layer sliding windows: [`NONE`](Self::NONE) when every layer
/// keeps every block of a sequence (full attention, or a node that does not free windows),
/// otherwise a 64-bit FNV-1a hash of each layer's window in layer order. Two nodes whose
/// digests differ would cut a sliding layer's push at different blocks, so they are refused
/// as any other layout mismatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LayerWindows(pub u64);

impl LayerWindows {
    /// Every layer keeps every block.
    pub const NONE: LayerWindows = LayerWindows(0);

    /// The digest of `windows`, one entry a layer (`None`: the layer keeps every block).
    pub fn of(windows: &[Option<usize>]) -> Self {
        if windows.iter().all(Option::is_none) {
            return Self::NONE;
        }
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for w in windows {
            // 0 for a full layer, so that no window's value stands for one.
            let v = w.map_or(0, |w| w as u64 + 1);
            for byte in v.to_le_bytes() {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        // 0 is NONE's; a sliding layout never digests to it.
        LayerWindows(hash.max(1))
    }

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }
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
        windows: LayerWindows::NONE,
    };

    /// Whether `other` has this layout's geometry (dtype and every dimension), its windows
    /// aside: what a KV frame, which carries no windows, is checked against.
    pub fn same_geometry(&self, other: &KvLayout) -> bool {
        KvLayout {
            windows: LayerWindows::NONE,
            ..*self
        } == KvLayout {
            windows: LayerWindows::NONE,
            ..*other
        }
    }

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
        )?;
        if !self.windows.is_none() {
            write!(f, " windows={:016x}", self.windows.0)?;
        }
        Ok(())
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
    fn differing_windows_are_different_layouts_of_one_geometry() {
        let full = KvLayout {
            num_layers: 6,
            ..KvLayout::SMOLLM2_135M_F32
        };
        let gemma3 = |window: usize| {
            let layers: Vec<Option<usize>> =
                (0..6).map(|l| (l % 6 != 5).then_some(window)).collect();
            KvLayout {
                windows: LayerWindows::of(&layers),
                ..full
            }
        };
        assert_eq!(LayerWindows::of(&[None; 6]), LayerWindows::NONE);
        assert_eq!(gemma3(512), gemma3(512));
        assert_ne!(gemma3(512), gemma3(1024));
        assert_ne!(gemma3(512), full);
        // Which layer slides counts, not only the windows.
        let mut moved = vec![Some(512); 6];
        moved[0] = None;
        assert_ne!(LayerWindows::of(&moved), gemma3(512).windows);
        assert!(gemma3(512).same_geometry(&full) && gemma3(512).same_geometry(&gemma3(1024)));
        assert!(!gemma3(512).same_geometry(&KvLayout {
            block_size: 32,
            ..gemma3(512)
        }));
        assert!(
            gemma3(512).to_string().contains(" windows="),
            "{}",
            gemma3(512)
        );
        assert!(!full.to_string().contains("windows"), "{full}");
        // A record without windows reads as NONE; one with them keeps them.
        let json = serde_json::to_string(&full).unwrap();
        assert!(!json.contains("windows"), "{json}");
        assert_eq!(serde_json::from_str::<KvLayout>(&json).unwrap(), full);
        let json = serde_json::to_string(&gemma3(512)).unwrap();
        assert_eq!(
            serde_json::from_str::<KvLayout>(&json).unwrap(),
            gemma3(512)
        );
    }

    #[test]
    fn serde_round_trip_uses_dtype_names() {
        let l = KvLayout::SMOLLM2_135M_F32;
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.contains("\"dtype\":\"f32\""), "{json}");
        assert_eq!(serde_json::from_str::<KvLayout>(&json).unwrap(), l);
    }
}
