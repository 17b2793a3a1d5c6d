//! Sequences whose prompt KV was computed elsewhere (by a prefill node) and imported into
//! blocks this scheduler's allocator handed out: they skip the waiting queue and join the
//! running batch with their first token already sampled.

use super::sequence::{NewSequence, Sequence, SequenceStatus};
use super::Scheduler;
use crate::error::{EngineError, Result};
use crate::ids::BlockId;
use crate::kv::groups::{first_live_block, NO_BLOCK};

impl Scheduler {
    /// Adds a running sequence whose `prompt_ids` KV sits in `block_table` (blocks allocated
    /// from this scheduler's allocator, now owned by the sequence) and whose first generated
    /// token is `first_token`. The next step decodes it.
    pub fn add_prefilled(
        &mut self,
        seq: NewSequence,
        block_table: Vec<BlockId>,
        first_token: u32,
    ) -> Result<()> {
        self.add_prefilled_windows(seq, block_table, Vec::new(), first_token)
    }

    /// [`add_prefilled`](Self::add_prefilled) with a table per sliding-window group, each as
    /// long as `block_table`, holding this group's blocks from the window of the first decode
    /// query (at the prompt's length) on and [`NO_BLOCK`] before it.
    pub fn add_prefilled_windows(
        &mut self,
        seq: NewSequence,
        block_table: Vec<BlockId>,
        window_tables: Vec<Vec<BlockId>>,
        first_token: u32,
    ) -> Result<()> {
        if self.seqs.contains_key(&seq.seq_id) {
            return Err(EngineError::DuplicateSequence { seq_id: seq.seq_id });
        }
        let bs = self.allocator.block_size();
        let covered = window_tables.len() == self.windows.len()
            && window_tables.iter().zip(&self.windows).all(|(t, p)| {
                let from = first_live_block(seq.prompt_ids.len(), p.window, bs);
                t.len() == block_table.len()
                    && t[from.min(t.len())..].iter().all(|&b| b != NO_BLOCK)
            });
        if !covered {
            return Err(EngineError::InvalidParameter {
                field: "window_tables",
                reason: format!(
                    "must hold, for each of the {} sliding-window groups, the blocks of the \
                     first decode query's window",
                    self.windows.len()
                ),
                given: format!("{} tables", window_tables.len()),
            });
        }
        let needed = seq.prompt_ids.len().div_ceil(self.allocator.block_size());
        if seq.prompt_ids.is_empty() || block_table.len() < needed {
            return Err(EngineError::InvalidParameter {
                field: "block_table",
                reason: format!(
                    "must cover the prompt: {} tokens need {needed} blocks",
                    seq.prompt_ids.len()
                ),
                given: format!("{} blocks", block_table.len()),
            });
        }
        if seq.max_new_tokens < 2 {
            return Err(EngineError::InvalidParameter {
                field: "max_new_tokens",
                reason: "a prefilled sequence must have tokens left to decode".into(),
                given: seq.max_new_tokens.to_string(),
            });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let seq_id = seq.seq_id;
        let mut s = Sequence::new(seq, arrival);
        s.num_computed_tokens = s.prompt_ids.len();
        s.output_ids.push(first_token);
        s.block_table = block_table;
        s.window_tables = window_tables;
        s.status = SequenceStatus::Running;
        self.running.insert(arrival, seq_id);
        self.seqs.insert(seq_id, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SeqId;
    use crate::kv::allocator::BlockAllocator;
    use crate::scheduler::SchedulerConfig;

    #[test]
    fn prefilled_sequence_decodes_from_its_first_token_and_frees_its_blocks() {
        let cfg = SchedulerConfig {
            max_batch_prefill_tokens: 64,
            max_batch_total_tokens: 256,
            max_num_seqs: 8,
            max_prefill_chunk_tokens: 64,
            enable_prefix_caching: true,
        };
        let mut s = Scheduler::new(cfg, BlockAllocator::new(16, 4));
        let blocks = s.allocator_mut().allocate_n(2).expect("free blocks");
        let seq = NewSequence {
            seq_id: SeqId(7),
            prompt_ids: vec![1, 2, 3, 4, 5, 6],
            max_new_tokens: 4,
        };
        assert!(
            s.add_prefilled(seq.clone(), blocks[..1].to_vec(), 9)
                .is_err(),
            "too few blocks"
        );
        s.add_prefilled(seq, blocks.clone(), 9).expect("adds");
        let batch = s.schedule();
        assert_eq!(batch.items.len(), 1);
        let item = &batch.items[0];
        assert_eq!(
            (item.token_ids.as_slice(), item.start_pos, item.context_len),
            ([9u32].as_slice(), 6, 7)
        );
        assert!(item.sample);
        assert_eq!(&item.block_table[..2], blocks.as_slice());
        s.commit(&batch, &[(SeqId(7), 10)]);
        s.finish(SeqId(7)).expect("finishes");
        assert_eq!(s.allocator().num_used(), 0);
        assert_eq!(s.allocator().num_free(), 16);
    }
}
