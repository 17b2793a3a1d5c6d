//! The plan of one forward step, and the budgets it must stay within.

use crate::ids::{BlockId, SeqId};

use super::SchedulerConfig;

/// One forward step: which tokens of which sequences to run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub items: Vec<BatchItem>,
    /// Sequences preempted while planning this step: their blocks are already freed and they
    /// will be recomputed from scratch once readmitted.
    pub preempted: Vec<SeqId>,
}

/// The tokens of one sequence to feed in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchItem {
    pub seq_id: SeqId,
    /// `all_tokens[start_pos..start_pos + n]`.
    pub token_ids: Vec<u32>,
    /// Tokens whose KV is already cached; equals `num_computed_tokens` before the step.
    pub start_pos: usize,
    /// `start_pos + token_ids.len()`: the KV tokens this item attends over.
    pub context_len: usize,
    /// Covers `context_len` tokens.
    pub block_table: Vec<BlockId>,
    /// The sliding-window groups' tables, each as long as `block_table`, with
    /// [`NO_BLOCK`](crate::kv::groups::NO_BLOCK) before the window of `start_pos`.
    pub window_tables: Vec<Vec<BlockId>>,
    /// The chunk ends at the last known token, so the engine samples a new token for it.
    pub sample: bool,
    /// Counts against `max_batch_prefill_tokens`: more than one token, or still inside the
    /// prompt. A single-token step past the prompt is a decode.
    pub is_prefill: bool,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Tokens of prefill items, bounded by `max_batch_prefill_tokens`.
    pub fn num_prefill_tokens(&self) -> usize {
        self.items
            .iter()
            .filter(|item| item.is_prefill)
            .map(|item| item.token_ids.len())
            .sum()
    }

    /// Number of decode items (one token each).
    pub fn num_decode_tokens(&self) -> usize {
        self.items.iter().filter(|item| !item.is_prefill).count()
    }

    /// Sum of `context_len`, bounded by `max_batch_total_tokens`.
    pub fn num_context_tokens(&self) -> usize {
        self.items.iter().map(|item| item.context_len).sum()
    }
}

/// What is left of the step's budgets while a batch is planned.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    pub(super) prefill_tokens: usize,
    pub(super) context_tokens: usize,
    pub(super) num_seqs: usize,
    pub(super) max_chunk_tokens: usize,
}

impl Budget {
    pub(super) fn new(cfg: &SchedulerConfig) -> Self {
        Self {
            prefill_tokens: cfg.max_batch_prefill_tokens,
            context_tokens: cfg.max_batch_total_tokens,
            num_seqs: cfg.max_num_seqs,
            max_chunk_tokens: cfg.max_prefill_chunk_tokens,
        }
    }

    /// The largest number of tokens starting at `start_pos` (of `num_tokens` known, of which
    /// the first `num_prompt` are prompt) that fits; 0 when none does.
    pub(super) fn chunk_len(
        &self,
        start_pos: usize,
        num_tokens: usize,
        num_prompt: usize,
    ) -> usize {
        if self.num_seqs == 0 {
            return 0;
        }
        let remaining = num_tokens.saturating_sub(start_pos);
        let context_room = self.context_tokens.saturating_sub(start_pos);
        let n = remaining.min(context_room);
        if n == 0 {
            return 0;
        }
        if start_pos >= num_prompt && n == 1 {
            // A decode: one token, outside the prefill budget.
            return 1;
        }
        let n = n.min(self.max_chunk_tokens).min(self.prefill_tokens);
        if n == 0 && start_pos >= num_prompt {
            // No prefill room left, but one token past the prompt still runs as a decode.
            return 1;
        }
        n
    }

    pub(super) fn charge(&mut self, item: &BatchItem) {
        self.num_seqs -= 1;
        self.context_tokens -= item.context_len;
        if item.is_prefill {
            self.prefill_tokens -= item.token_ids.len();
        }
    }

    pub(super) fn refund(&mut self, item: &BatchItem) {
        self.num_seqs += 1;
        self.context_tokens += item.context_len;
        if item.is_prefill {
            self.prefill_tokens += item.token_ids.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(prefill: usize, context: usize) -> Budget {
        Budget {
            prefill_tokens: prefill,
            context_tokens: context,
            num_seqs: 4,
            max_chunk_tokens: 4,
        }
    }

    #[test]
    fn chunk_is_cut_by_every_budget() {
        assert_eq!(budget(100, 100).chunk_len(0, 10, 10), 4);
        assert_eq!(budget(3, 100).chunk_len(0, 10, 10), 3);
        assert_eq!(budget(100, 6).chunk_len(4, 10, 10), 2);
        assert_eq!(budget(100, 4).chunk_len(4, 10, 10), 0);
        assert_eq!(budget(0, 100).chunk_len(0, 10, 10), 0);
        assert_eq!(budget(100, 100).chunk_len(10, 10, 10), 0);
    }

    #[test]
    fn a_step_past_the_prompt_can_run_as_a_decode() {
        // Decode proper.
        assert_eq!(budget(0, 100).chunk_len(10, 11, 10), 1);
        // Recompute of outputs with no prefill room left: one token at a time.
        assert_eq!(budget(0, 100).chunk_len(10, 14, 10), 1);
        // The last prompt token is still prefill.
        assert_eq!(budget(0, 100).chunk_len(9, 11, 10), 0);
    }

    #[test]
    fn charge_and_refund_are_inverse() {
        let mut b = budget(10, 100);
        let item = BatchItem {
            seq_id: SeqId(1),
            token_ids: vec![1, 2, 3],
            start_pos: 2,
            context_len: 5,
            block_table: vec![],
            window_tables: vec![],
            sample: false,
            is_prefill: true,
        };
        b.charge(&item);
        assert_eq!((b.prefill_tokens, b.context_tokens, b.num_seqs), (7, 95, 3));
        b.refund(&item);
        assert_eq!(
            (b.prefill_tokens, b.context_tokens, b.num_seqs),
            (10, 100, 4)
        );
    }
}
