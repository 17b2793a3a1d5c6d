//! The paged cache's storage shape: per layer, K and V each of shape
//! `[num_blocks, block_size, num_kv_heads, head_dim]`. The model-wide geometry (dtype, layers,
//! block size, heads) is `kv_types::KvLayout`; this adds how many blocks one layer holds, which
//! is all the kernels index by.
//!
//! Token slot `s = block_id * block_size + offset` lives at element `s * row_elems()`, so a slot
//! index is all a kernel needs to find a row.

use crate::KernelError;

/// Shape of one layer's K (or V) storage.
///
/// The element counts saturate instead of overflowing: a saturated count never equals the
/// length of a real slice, so an absurd layout fails the kernels' length checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// The storage of `num_blocks` blocks of `layout`.
    pub fn new(layout: &kv_types::KvLayout, num_blocks: usize) -> Self {
        CacheShape {
            num_blocks,
            block_size: layout.block_size as usize,
            num_kv_heads: layout.num_kv_heads as usize,
            head_dim: layout.head_dim as usize,
        }
    }

    /// Elements of one token row: `num_kv_heads * head_dim`.
    pub fn row_elems(&self) -> usize {
        self.num_kv_heads.saturating_mul(self.head_dim)
    }

    /// Elements of one block of K (or of V).
    pub fn block_elems(&self) -> usize {
        self.block_size.saturating_mul(self.row_elems())
    }

    /// Elements of one layer's K (or V) storage.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_elems())
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_shape() {
        let l = CacheShape {
            num_blocks: 10,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(l.row_elems(), 192);
        assert_eq!(l.block_elems(), 16 * 192);
        assert_eq!(l.layer_elems(), 10 * 16 * 192);
        assert_eq!(l.num_slots(), 160);
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(16), 1);
        assert_eq!(l.blocks_for(17), 2);
        assert!(l.validate().is_ok());
        assert!(l.check_block(9).is_ok());
        assert!(matches!(
            l.check_block(10),
            Err(KernelError::BlockOutOfRange {
                block_id: 10,
                num_blocks: 10
            })
        ));
    }

    #[test]
    fn absurd_layouts_saturate_instead_of_overflowing() {
        let l = CacheShape {
            num_blocks: usize::MAX / 2,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(l.layer_elems(), usize::MAX);
        assert!(matches!(
            l.check_cache("k_cache", 1024),
            Err(KernelError::BadLength {
                what: "k_cache",
                ..
            })
        ));
        let zero = CacheShape { head_dim: 0, ..l };
        assert!(matches!(zero.validate(), Err(KernelError::Invalid(_))));
    }
}
