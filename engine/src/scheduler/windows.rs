//! The block tables of sliding-window layer groups (see [`crate::kv::groups`]).
//!
//! A sequence holds one table per window group beside its full-attention `block_table`, with
//! the same indices (block `i` holds tokens `i * block_size..`). After each step the blocks
//! wholly before the window of the sequence's next query go back to their group's pool and
//! become [`NO_BLOCK`]: no later query of the sequence reads them.
//!
//! The prefix cache stays exact: a window group registers its full blocks under the same
//! chained hashes as group 0, and a freed block that holds a hash stays cached in its pool
//! until evicted. A prefix hit of `h` blocks is taken only while every window group still holds
//! the blocks the first computed token's window reads (`first_live_block(h * block_size)..h`);
//! otherwise it shrinks to the longest hit that every group can serve (down to none), and the
//! rest is recomputed.

use super::sequence::Sequence;
use super::Scheduler;
use crate::ids::BlockId;
use crate::kv::allocator::BlockAllocator;
use crate::kv::groups::{first_live_block, KvGroups, NO_BLOCK};

/// The pool of one window group.
#[derive(Debug)]
pub(super) struct WindowPool {
    pub(super) window: usize,
    pub(super) allocator: BlockAllocator,
}

/// Blocks of one layer group, for the engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupUsage {
    /// `None` for the full-attention group.
    pub window: Option<usize>,
    pub num_blocks_total: usize,
    pub num_blocks_used: usize,
    pub num_blocks_cached: usize,
    /// The most blocks in use at once since start, counted when a step is planned (its
    /// blocks grown, before its end frees those the window passed).
    pub peak_blocks_used: usize,
}

impl Scheduler {
    /// Adds a sliding-window group per `(window, allocator)`, in group order (group 1 first).
    /// Each allocator must have the block size of the full-attention one.
    pub fn with_window_groups(mut self, groups: Vec<(usize, BlockAllocator)>) -> Self {
        for (window, allocator) in groups {
            assert!(window > 0, "a sliding window of 0 keys");
            assert_eq!(allocator.block_size(), self.allocator.block_size());
            self.windows.push(WindowPool { window, allocator });
        }
        self
    }

    /// Occupancy of every layer group, the full-attention group first.
    pub fn group_usage(&self) -> Vec<GroupUsage> {
        let usage = |window, a: &BlockAllocator, peak: usize| GroupUsage {
            window,
            num_blocks_total: a.num_total(),
            num_blocks_used: a.num_used(),
            num_blocks_cached: a.num_cached(),
            peak_blocks_used: peak.max(a.num_used()),
        };
        let peak = |g: usize| self.peak_used.get(g).copied().unwrap_or(0);
        std::iter::once(usage(None, &self.allocator, peak(0)))
            .chain(
                self.windows
                    .iter()
                    .enumerate()
                    .map(|(g, p)| usage(Some(p.window), &p.allocator, peak(g + 1))),
            )
            .collect()
    }

    /// Raises each group's high-water mark to its blocks in use now.
    pub(super) fn note_peaks(&mut self) {
        let used = std::iter::once(self.allocator.num_used())
            .chain(self.windows.iter().map(|p| p.allocator.num_used()));
        self.peak_used.resize(1 + self.windows.len(), 0);
        for (peak, n) in self.peak_used.iter_mut().zip(used) {
            *peak = (*peak).max(n);
        }
    }

    /// The pool of KV group `group` (1 for the first window group).
    pub fn window_allocator_mut(&mut self, group: usize) -> &mut BlockAllocator {
        &mut self.windows[group - 1].allocator
    }

    /// The most blocks one sequence holds at once in the window group of `window`.
    pub(super) fn window_cap(&self, window: usize) -> usize {
        let chunk = self
            .cfg
            .max_prefill_chunk_tokens
            .min(self.cfg.max_batch_prefill_tokens);
        KvGroups::window_blocks_per_seq(window, chunk, self.allocator.block_size())
    }

    /// Blocks each window group must add for `seq` to cover `context_len` tokens.
    pub(super) fn window_needs(&self, seq: &Sequence, context_len: usize) -> Vec<usize> {
        let num_blocks = context_len.div_ceil(self.allocator.block_size());
        seq.window_tables
            .iter()
            .map(|t| num_blocks.saturating_sub(t.len()))
            .collect()
    }

    /// Every window group has `needs` blocks free.
    pub(super) fn windows_have(&self, needs: &[usize]) -> bool {
        self.windows
            .iter()
            .zip(needs)
            .all(|(p, &n)| n <= p.allocator.num_free())
    }

    /// Appends `needs` new blocks to each window table of `seq_id`; checked by
    /// [`windows_have`](Self::windows_have).
    pub(super) fn grow_windows(&mut self, seq_id: crate::ids::SeqId, needs: &[usize]) {
        let seq = self.seqs.get_mut(&seq_id).expect("running ids are tracked");
        for ((pool, table), &n) in self
            .windows
            .iter_mut()
            .zip(&mut seq.window_tables)
            .zip(needs)
        {
            table.extend(
                pool.allocator
                    .allocate_n(n)
                    .expect("checked against num_free"),
            );
        }
    }

    /// Gives back every block `seq` holds in the window groups.
    pub(super) fn free_windows(pools: &mut [WindowPool], seq: &mut Sequence) {
        for (pool, table) in pools.iter_mut().zip(&mut seq.window_tables) {
            for block_id in table.drain(..).filter(|&b| b != NO_BLOCK) {
                pool.allocator
                    .free(block_id)
                    .expect("a sequence holds one reference to each block of its tables");
            }
        }
    }

    /// Registers `seq`'s full blocks `from..to` in every window group that still holds them,
    /// then frees the blocks wholly before the window of its next query (at
    /// `num_computed_tokens`).
    pub(super) fn settle_windows(
        pools: &mut [WindowPool],
        seq: &mut Sequence,
        registered: std::ops::Range<usize>,
        block_size: usize,
    ) {
        for (pool, table) in pools.iter_mut().zip(&mut seq.window_tables) {
            for index in registered.clone() {
                if table[index] != NO_BLOCK {
                    pool.allocator
                        .register_hash(table[index], seq.block_hashes[index]);
                }
            }
            let first = first_live_block(seq.num_computed_tokens, pool.window, block_size);
            for entry in table.iter_mut().take(first) {
                if *entry != NO_BLOCK {
                    pool.allocator
                        .free(*entry)
                        .expect("a sequence holds one reference to each block of its tables");
                    *entry = NO_BLOCK;
                }
            }
        }
    }

    /// The longest prefix hit of at most `hits` blocks of `hashes` that every window group can
    /// serve: each holds (used or cached) the blocks its window reads from the first computed
    /// token on. With it, the blocks those groups must revive.
    pub(super) fn window_hits(&self, hashes: &[u64], hits: usize) -> (usize, Vec<usize>) {
        let bs = self.allocator.block_size();
        let mut h = hits;
        loop {
            let mut revived = Vec::with_capacity(self.windows.len());
            let served = self.windows.iter().all(|p| {
                let from = first_live_block(h * bs, p.window, bs);
                let mut n = 0;
                let all = hashes[from..h].iter().all(|&hash| {
                    p.allocator.lookup(hash).is_some_and(|id| {
                        n += usize::from(p.allocator.ref_count(id) == 0);
                        true
                    })
                });
                revived.push(n);
                all
            });
            if served || h == 0 {
                return (
                    h,
                    if served {
                        revived
                    } else {
                        vec![0; self.windows.len()]
                    },
                );
            }
            h -= 1;
        }
    }

    /// Window tables for a sequence admitted with `hits` cached blocks and `num_blocks` in
    /// all: [`NO_BLOCK`] before each window, the cached blocks of the window, then new blocks.
    /// The caller checked the free counts ([`window_hits`](Self::window_hits)).
    pub(super) fn admit_windows(
        &mut self,
        hashes: &[u64],
        hits: usize,
        num_blocks: usize,
    ) -> Vec<Vec<BlockId>> {
        let bs = self.allocator.block_size();
        self.windows
            .iter_mut()
            .map(|p| {
                let from = first_live_block(hits * bs, p.window, bs);
                let mut table = vec![NO_BLOCK; from];
                let cached = p.allocator.acquire_cached_prefix(&hashes[from..hits]);
                debug_assert_eq!(cached.len(), hits - from);
                table.extend(cached);
                table.extend(
                    p.allocator
                        .allocate_n(num_blocks - hits)
                        .expect("checked against num_free"),
                );
                table
            })
            .collect()
    }

    /// Blocks each window group holds for `seq` now.
    pub(super) fn live_window_blocks(seq: &Sequence) -> impl Iterator<Item = usize> + '_ {
        seq.window_tables
            .iter()
            .map(|t| t.iter().filter(|&&b| b != NO_BLOCK).count())
    }
}
