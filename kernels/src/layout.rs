//! The paged KV layout: per layer, K and V each of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
//!
//! Token slot `s = block_id * block_size + offset` lives at element `s * row_elems()`, so a slot
//! index is all a kernel needs to find a row.

use crate::KernelError;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    BF16,
    F16,
}

impl KvDtype {
    pub fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::BF16 | KvDtype::F16 => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::BF16 => "bf16",
            KvDtype::F16 => "f16",
        }
    }
}

/// Shape of one layer's K (or V) storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one token row: `num_kv_heads * head_dim`.
    pub fn row_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of one block of K (or of V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.row_elems()
    }

    /// Elements of one layer's K (or V) storage.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Number of blocks that hold `num_tokens` positions.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size.max(1))
    }

    /// Rejects layouts with a zero dimension, which would make every index computation meaningless.
    pub fn validate(&self) -> Result<(), KernelError> {
        if self.block_size == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(KernelError::Invalid(format!(
                "layout block_size {}, num_kv_heads {}, head_dim {}: each must be > 0",
                self.block_size, self.num_kv_heads, self.head_dim
            )));
        }
        Ok(())
    }

    /// Checks that one layer's K (or V) storage has exactly `layer_elems()` elements.
    pub(crate) fn check_cache(&self, what: &'static str, given: usize) -> Result<(), KernelError> {
        check_len(what, self.layer_elems(), given)
    }

    /// Checks that `block_id` names a block of this layout.
    pub(crate) fn check_block(&self, block_id: u32) -> Result<(), KernelError> {
        if block_id as usize >= self.num_blocks {
            return Err(KernelError::BlockOutOfRange {
                block_id,
                num_blocks: self.num_blocks,
            });
        }
        Ok(())
    }
}

/// Returns `BadLength` unless `given == expected`.
pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    given: usize,
) -> Result<(), KernelError> {
    if given != expected {
        return Err(KernelError::BadLength {
            what,
            expected,
            given,
        });
    }
    Ok(())
}
