//! One generation request as the scheduler tracks it: its tokens, how many of them have KV
//! in the cache, and the blocks holding that KV.

use std::ops::Range;

use crate::ids::{BlockId, SeqId};
use crate::kv::prefix;

/// A validated request handed to [`Scheduler::add`](super::Scheduler::add).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSequence {
    pub seq_id: SeqId,
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Where a sequence is in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceStatus {
    /// Queued for admission; holds no blocks.
    Waiting,
    /// Admitted: holds blocks and is scheduled every step the budgets allow.
    Running,
}

/// A sequence inside the scheduler. Its tokens are `prompt_ids ++ output_ids`.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub seq_id: SeqId,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub max_new_tokens: usize,
    /// Leading tokens whose KV is in `block_table`.
    pub num_computed_tokens: usize,
    pub block_table: Vec<BlockId>,
    /// One table per sliding-window layer group, indexed as `block_table`; blocks wholly
    /// before the window are [`NO_BLOCK`](crate::kv::groups::NO_BLOCK). Empty while waiting.
    pub window_tables: Vec<Vec<BlockId>>,
    /// Admission order: smaller is older. Preemption picks the largest.
    pub arrival: u64,
    pub num_preemptions: u32,
    pub(super) status: SequenceStatus,
    /// Chained hashes of the full blocks of the known tokens (prefix caching only).
    pub(super) block_hashes: Vec<u64>,
    /// Leading blocks of `block_table` already registered in (or taken from) the prefix cache.
    pub(super) num_registered_blocks: usize,
    /// Admission may take cached blocks for the prompt. Off for a sequence that needs every
    /// prompt position computed (prompt logprobs); its blocks are still registered.
    pub(super) reuse_prefix: bool,
}

impl Sequence {
    pub(super) fn new(seq: NewSequence, arrival: u64) -> Self {
        Self {
            seq_id: seq.seq_id,
            prompt_ids: seq.prompt_ids,
            output_ids: Vec::new(),
            max_new_tokens: seq.max_new_tokens,
            num_computed_tokens: 0,
            block_table: Vec::new(),
            window_tables: Vec::new(),
            arrival,
            num_preemptions: 0,
            status: SequenceStatus::Waiting,
            block_hashes: Vec::new(),
            num_registered_blocks: 0,
            reuse_prefix: true,
        }
    }

    pub fn status(&self) -> SequenceStatus {
        self.status
    }

    /// Prompt plus generated tokens.
    pub fn num_tokens(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }

    /// The sequence has generated `max_new_tokens` and needs no more compute; the engine is
    /// expected to [`finish`](super::Scheduler::finish) it.
    pub fn is_done(&self) -> bool {
        self.output_ids.len() >= self.max_new_tokens
    }

    /// All tokens, `prompt_ids ++ output_ids`.
    pub fn all_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt_ids.iter().chain(&self.output_ids).copied()
    }

    /// The tokens at positions `range` of `prompt_ids ++ output_ids`.
    /// Positions past the end are left out.
    pub fn tokens(&self, range: Range<usize>) -> Vec<u32> {
        let num_prompt = self.prompt_ids.len();
        let end = range.end.min(self.num_tokens());
        let start = range.start.min(end);
        let mut out = Vec::with_capacity(end - start);
        if start < num_prompt {
            out.extend_from_slice(&self.prompt_ids[start..end.min(num_prompt)]);
        }
        if end > num_prompt {
            out.extend_from_slice(
                &self.output_ids[start.max(num_prompt) - num_prompt..end - num_prompt],
            );
        }
        out
    }

    /// Brings `block_hashes` up to date with every full block of the known tokens.
    pub(super) fn update_block_hashes(&mut self, block_size: usize) {
        let num_full = self.num_tokens() / block_size;
        while self.block_hashes.len() < num_full {
            let index = self.block_hashes.len();
            let parent = self
                .block_hashes
                .last()
                .copied()
                .unwrap_or(prefix::PREFIX_HASH_SEED);
            let block = self.tokens(index * block_size..(index + 1) * block_size);
            self.block_hashes.push(prefix::hash_block(parent, &block));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(prompt: &[u32]) -> Sequence {
        Sequence::new(
            NewSequence {
                seq_id: SeqId(1),
                prompt_ids: prompt.to_vec(),
                max_new_tokens: 2,
            },
            0,
        )
    }

    #[test]
    fn tokens_span_prompt_and_output() {
        let mut s = seq(&[1, 2, 3]);
        s.output_ids = vec![4, 5];
        assert_eq!(s.num_tokens(), 5);
        assert_eq!(s.tokens(2..4), vec![3, 4]);
        assert_eq!(s.tokens(0..5), vec![1, 2, 3, 4, 5]);
        assert!(s.is_done());
    }

    #[test]
    fn incremental_hashes_match_block_hashes() {
        let mut s = seq(&[1, 2, 3, 4, 5]);
        s.update_block_hashes(2);
        assert_eq!(s.block_hashes.len(), 2);
        s.output_ids = vec![6, 7, 8];
        s.update_block_hashes(2);
        let all: Vec<u32> = s.all_tokens().collect();
        assert_eq!(s.block_hashes, prefix::block_hashes(&all, 2));
    }
}
