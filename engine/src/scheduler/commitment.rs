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

    /// What admission must leave room for before it takes a waiting sequence: the running
    /// sequences at their longest, plus the blocks held by no sequence of this scheduler (a
    /// decode node's reservations, whose own growth its admission counts). `None` while
    /// nothing runs: an idle scheduler admits whatever fits now, so a sequence never waits on
    /// blocks nobody here will free.
    pub(super) fn running_commitment(&self) -> Option<usize> {
        if !self.reserve_output || self.running.is_empty() {
            return None;
        }
        let block_size = self.allocator.block_size();
        let mut held = HashSet::new();
        let mut committed = 0;
        for seq in self.running.values().map(|id| &self.seqs[id]) {
            committed += at_longest(seq, block_size);
            held.extend(seq.block_table.iter().copied());
        }
        Some(committed + self.allocator.num_used().saturating_sub(held.len()))
    }

    /// `seq` fits at its longest beside `committed` blocks (see
    /// [`running_commitment`](Self::running_commitment)); always when that is `None`.
    pub(super) fn fits_at_longest(&self, seq: &Sequence, committed: Option<usize>) -> bool {
        committed.is_none_or(|committed| {
            committed + at_longest(seq, self.allocator.block_size()) <= self.allocator.num_total()
        })
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
