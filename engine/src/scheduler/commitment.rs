//! How many blocks the tracked sequences will hold at their longest: what a node that admits
//! more work must leave room for, so that growing sequences do not preempt each other.

use std::collections::HashSet;

use super::sequence::Sequence;
use super::Scheduler;

impl Scheduler {
    /// Blocks the sequences this scheduler tracks (running or waiting) hold once each has its
    /// prompt and `max_new_tokens` outputs, or hold now where that is more. Admission that
    /// keeps this plus its new work within the pool never preempts (as TGI's
    /// `max_batch_total_tokens` counts `max_new_tokens`); shared prefix blocks count once per
    /// sequence, which errs on the side of room.
    pub fn num_committed_blocks(&self) -> usize {
        let block_size = self.allocator.block_size();
        self.seqs
            .values()
            .map(|seq| at_longest(seq, block_size))
            .sum()
    }

    /// What admission must leave room for before it takes a waiting sequence, per layer group
    /// (the full-attention group first): the running sequences at their longest, plus the
    /// blocks held by no sequence of this scheduler (a decode node's reservations, whose own
    /// growth its admission counts). `None` while nothing runs: an idle scheduler admits
    /// whatever fits now, so a sequence never waits on blocks nobody here will free.
    pub(super) fn running_commitment(&self) -> Option<Vec<usize>> {
        if !self.reserve_output || self.running.is_empty() {
            return None;
        }
        let mut held = HashSet::new();
        let mut committed = vec![0; 1 + self.windows.len()];
        let mut window_held = vec![0; self.windows.len()];
        for seq in self.running.values().map(|id| &self.seqs[id]) {
            for (c, n) in committed.iter_mut().zip(self.at_longest_per_group(seq)) {
                *c += n;
            }
            held.extend(seq.block_table.iter().copied());
            for (h, n) in window_held.iter_mut().zip(Self::live_window_blocks(seq)) {
                *h += n;
            }
        }
        committed[0] += self.allocator.num_used().saturating_sub(held.len());
        for ((c, pool), h) in committed[1..]
            .iter_mut()
            .zip(&self.windows)
            .zip(window_held)
        {
            *c += pool.allocator.num_used().saturating_sub(h);
        }
        Some(committed)
    }

    /// `seq` fits at its longest beside `committed` blocks of each group (see
    /// [`running_commitment`](Self::running_commitment)); always when that is `None`.
    pub(super) fn fits_at_longest(&self, seq: &Sequence, committed: Option<&[usize]>) -> bool {
        let Some(committed) = committed else {
            return true;
        };
        let totals = std::iter::once(self.allocator.num_total())
            .chain(self.windows.iter().map(|p| p.allocator.num_total()));
        self.at_longest_per_group(seq)
            .into_iter()
            .zip(committed)
            .zip(totals)
            .all(|((need, c), total)| c + need <= total)
    }

    /// [`at_longest`] in every layer group: a sliding group's table never holds more than
    /// its window's blocks ([`Scheduler::window_cap`]).
    pub(super) fn at_longest_per_group(&self, seq: &Sequence) -> Vec<usize> {
        let full = at_longest(seq, self.allocator.block_size());
        let live: Vec<usize> = Self::live_window_blocks(seq).collect();
        std::iter::once(full)
            .chain(self.windows.iter().enumerate().map(|(g, p)| {
                let now = live.get(g).copied().unwrap_or(0);
                full.min(self.window_cap(p.window)).max(now)
            }))
            .collect()
    }
}

/// Blocks `seq` holds with its prompt and every output, or holds now where that is more.
pub(super) fn at_longest(seq: &Sequence, block_size: usize) -> usize {
    let longest = (seq.prompt_ids.len() + seq.max_new_tokens).div_ceil(block_size);
    longest.max(seq.block_table.len())
}

#[cfg(test)]
mod tests {
    use crate::ids::SeqId;
    use crate::kv::allocator::BlockAllocator;
    use crate::scheduler::{NewSequence, Scheduler, SchedulerConfig};

    #[test]
    fn committed_blocks_count_each_sequence_at_its_longest() {
        let cfg = SchedulerConfig {
            max_batch_prefill_tokens: 64,
            max_batch_total_tokens: 256,
            max_num_seqs: 8,
            max_prefill_chunk_tokens: 64,
            enable_prefix_caching: false,
        };
        let mut s = Scheduler::new(cfg, BlockAllocator::new(32, 4));
        assert_eq!(s.num_committed_blocks(), 0);
        // 6 + 10 tokens in blocks of 4: 4 blocks, though admission takes 2.
        s.add(NewSequence {
            seq_id: SeqId(1),
            prompt_ids: (0..6).collect(),
            max_new_tokens: 10,
        })
        .expect("adds");
        // A waiting one counts too: 3 + 2 tokens, 2 blocks.
        s.add(NewSequence {
            seq_id: SeqId(2),
            prompt_ids: (0..3).collect(),
            max_new_tokens: 2,
        })
        .expect("adds");
        assert_eq!(s.num_committed_blocks(), 6);
        let batch = s.schedule();
        assert!(!batch.items.is_empty());
        assert_eq!(s.num_committed_blocks(), 6);
        s.finish(SeqId(1)).expect("tracked");
        assert_eq!(s.num_committed_blocks(), 2);
    }
}
