//! Layer groups of the KV cache: the layers that share one block table per sequence.
//!
//! Group 0 holds the full-attention layers (possibly none, as in Mistral where every layer
//! slides): its blocks cover a sequence's every token, and it is the group the rest of the
//! engine has always known (the prefix-cache events, reservations, `max_sequence_tokens`).
//! Every other group holds the sliding-window layers of one window. A block of such a group
//! that lies wholly before the window of the sequence's next query is never read again (the
//! windowed kernel starts each row at its window), so the scheduler frees it and leaves
//! [`NO_BLOCK`] in its place; positions stay index-based. Each group's storage is sized by
//! what its sequences can hold at once ([`KvGroups::window_pool_blocks`]), so a sliding group
//! costs about a window per sequence, not the whole context.

use crate::ids::BlockId;

/// A block-table entry freed because the window has passed it. The kernels read block ids
/// through the table only from a row's window on, so this entry is never read; it is handed to
/// them as block 0, which every pool has.
pub const NO_BLOCK: BlockId = BlockId(u32::MAX);

/// The id the kernels get for a table entry: [`NO_BLOCK`] as block 0.
pub fn kernel_block(id: BlockId) -> u32 {
    if id == NO_BLOCK {
        0
    } else {
        id.0
    }
}

/// Which layers share a block table, and each group's window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Group of each layer.
    layer_group: Vec<usize>,
    /// Window of each group after group 0 (the full-attention group), ascending.
    windows: Vec<usize>,
}

impl KvGroups {
    /// Groups the layers by their windows (`None`: full attention). With `per_window` false
    /// every layer is in group 0 and keeps every block, as a node that pushes or imports KV
    /// still needs.
    pub fn new(layer_windows: &[Option<usize>], per_window: bool) -> Self {
        let mut windows: Vec<usize> = if per_window {
            layer_windows.iter().flatten().copied().collect()
        } else {
            Vec::new()
        };
        windows.sort_unstable();
        windows.dedup();
        let layer_group = layer_windows
            .iter()
            .map(|w| match w {
                Some(w) if per_window => 1 + windows.binary_search(w).expect("collected above"),
                _ => 0,
            })
            .collect();
        KvGroups {
            layer_group,
            windows,
        }
    }

    /// Every layer in group 0.
    pub fn single(num_layers: usize) -> Self {
        KvGroups {
            layer_group: vec![0; num_layers],
            windows: Vec::new(),
        }
    }

    pub fn num_groups(&self) -> usize {
        1 + self.windows.len()
    }

    /// The group of `layer`.
    pub fn group_of(&self, layer: usize) -> usize {
        self.layer_group[layer]
    }

    /// The windows of groups 1.., in group order.
    pub fn windows(&self) -> &[usize] {
        &self.windows
    }

    /// Each layer's window as this cache keeps it (`None`: every block), for the layout's
    /// digest ([`kv_types::LayerWindows`]): an engine that keeps one group reports none.
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layer_group
            .iter()
            .map(|&g| g.checked_sub(1).map(|g| self.windows[g]))
            .collect()
    }

    /// Layers in `group`.
    pub fn num_layers_in(&self, group: usize) -> usize {
        self.layer_group.iter().filter(|&&g| g == group).count()
    }

    /// The most blocks one sequence holds at once in a group of `window`, with chunks of at
    /// most `max_chunk` tokens: a step's table runs from the block of its first query's window
    /// start, `start + 1 - window`, to the block of its last token, `start + chunk - 1`, and a
    /// span of `window - 1 + chunk` tokens touches at most `ceil(span / block_size) + 1` blocks.
    pub fn window_blocks_per_seq(window: usize, max_chunk: usize, block_size: usize) -> usize {
        (window - 1 + max_chunk.max(1)).div_ceil(block_size) + 1
    }

    /// Blocks of a sliding group's pool: what `max_num_seqs` sequences hold at once, or the
    /// full-attention pool's `num_blocks` where that is less.
    pub fn window_pool_blocks(
        window: usize,
        max_chunk: usize,
        block_size: usize,
        max_num_seqs: usize,
        num_blocks: usize,
    ) -> usize {
        Self::window_blocks_per_seq(window, max_chunk, block_size)
            .saturating_mul(max_num_seqs)
            .min(num_blocks)
    }
}

/// Index of the first block a query at `pos` can read in a group of `window`: every block
/// before it lies wholly before the window.
pub fn first_live_block(pos: usize, window: usize, block_size: usize) -> usize {
    (pos + 1).saturating_sub(window) / block_size
}

/// Index of the first block a sliding layer's push carries for a prompt of `prompt_len`
/// tokens: the first block the first decode query (at `prompt_len`) reads, and never past
/// the prompt's last block, so that every layer carries one. The decode node reserves the
/// blocks from it on; the prefill node exports them.
pub fn first_pushed_block(prompt_len: usize, window: usize, block_size: usize) -> usize {
    first_live_block(prompt_len, window, block_size).min(prompt_len.saturating_sub(1) / block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_group_by_window_with_full_attention_first() {
        let g = KvGroups::new(&[Some(512), Some(4), None, Some(512), None], true);
        assert_eq!(g.windows(), &[4, 512]);
        let groups: Vec<usize> = (0..5).map(|l| g.group_of(l)).collect();
        assert_eq!(groups, vec![2, 1, 0, 2, 0]);
        assert_eq!(
            (g.num_layers_in(0), g.num_layers_in(1), g.num_layers_in(2)),
            (2, 1, 2)
        );
        let off = KvGroups::new(&[Some(512), None], false);
        assert_eq!((off.num_groups(), off.group_of(0)), (1, 0));
        // Every layer sliding: group 0 holds no layer.
        let all = KvGroups::new(&[Some(8), Some(8)], true);
        assert_eq!((all.num_groups(), all.num_layers_in(0)), (2, 0));
        assert_eq!(
            g.layer_windows(),
            vec![Some(512), Some(4), None, Some(512), None]
        );
        assert_eq!(off.layer_windows(), vec![None, None]);
    }

    #[test]
    fn a_push_carries_the_first_decode_querys_window_and_at_least_the_last_block() {
        // 4,096 tokens, window 512, blocks of 16: the query at 4,096 reads keys 3,585.. .
        assert_eq!(first_pushed_block(4096, 512, 16), 224);
        for bs in [1, 4, 16] {
            for window in [1, 2, 5, 16, 40] {
                for len in 1..120 {
                    let from = first_pushed_block(len, window, bs);
                    let last = (len - 1) / bs;
                    assert!(from <= last, "bs {bs} w {window} len {len}");
                    // Every prompt key the next query reads is in a pushed block.
                    let first_key = (len + 1).saturating_sub(window);
                    assert!(first_key >= len || from * bs <= first_key);
                }
            }
        }
    }

    #[test]
    fn the_live_blocks_of_a_window_cover_every_key_a_query_reads() {
        for bs in [1, 4, 16] {
            for window in [1, 3, 16, 37] {
                for pos in 0..200 {
                    let first = first_live_block(pos, window, bs);
                    let first_key = (pos + 1).saturating_sub(window);
                    // The key the query reads first is in the first live block, and the
                    // block before it ends before that key.
                    assert!(first * bs <= first_key && first_key < (first + 1) * bs);
                }
                // A step of `chunk` tokens from any start touches at most the bound.
                for chunk in [1, 5, 64] {
                    let bound = KvGroups::window_blocks_per_seq(window, chunk, bs);
                    for start in 0..200 {
                        let held =
                            (start + chunk).div_ceil(bs) - first_live_block(start, window, bs);
                        assert!(
                            held <= bound,
                            "bs {bs} w {window} chunk {chunk} start {start}"
                        );
                    }
                }
            }
        }
    }
}
