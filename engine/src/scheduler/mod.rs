//! Continuous-batching scheduler with chunked prefill, recompute preemption and prefix
//! caching. It plans each forward step ([`Scheduler::schedule`]) and records its outcome
//! ([`Scheduler::commit`]); it never runs a model itself.
//!
//! Each step takes, in this order and within every budget of [`SchedulerConfig`]:
//! 1. running sequences that decode (one token: the last known one), oldest first;
//! 2. running sequences still prefilling, oldest first, each cut to a chunk that fits;
//! 3. waiting sequences, first in first out, while they fit without preempting anyone, and
//!    only when every running sequence got its turn and nothing was preempted this step.
//!
//! Blocks are allocated as the context grows. When a running sequence needs a block and none
//! is free, the youngest running sequence (by arrival; possibly the one asking) is preempted:
//! its blocks are freed, it goes to the front of the waiting queue and is later recomputed by
//! prefilling `prompt ++ output` before sampling resumes. A sequence that has already
//! generated `max_new_tokens` (and merely awaits [`Scheduler::finish`]) is preempted first.

mod batch;
mod commitment;
mod config;
mod prefilled;
#[cfg(test)]
mod proptests;
mod sequence;

use std::collections::{BTreeMap, HashMap, VecDeque};

pub use batch::{Batch, BatchItem};
pub use config::{SchedulerConfig, SchedulerStats};
pub use sequence::{NewSequence, Sequence, SequenceStatus};

use batch::Budget;

use crate::error::{EngineError, Result};
use crate::ids::SeqId;
use crate::kv::allocator::BlockAllocator;

/// Plans forward steps over the sequences it tracks; owns the block allocator.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    allocator: BlockAllocator,
    seqs: HashMap<SeqId, Sequence>,
    /// Admission order; preempted sequences go to the front.
    waiting: VecDeque<SeqId>,
    /// Running sequences by arrival: the last entry is the youngest.
    running: BTreeMap<u64, SeqId>,
    next_arrival: u64,
}

impl Scheduler {
    /// A scheduler over `allocator`'s blocks. A budget of 0 in `cfg` would stop every step,
    /// so it is raised to 1 with a warning; use [`try_new`](Self::try_new) to reject it.
    pub fn new(mut cfg: SchedulerConfig, allocator: BlockAllocator) -> Self {
        if let Err(err) = cfg.validate() {
            tracing::warn!(error = %err, "scheduler budgets of 0 raised to 1");
            for budget in [
                &mut cfg.max_batch_prefill_tokens,
                &mut cfg.max_batch_total_tokens,
                &mut cfg.max_num_seqs,
                &mut cfg.max_prefill_chunk_tokens,
            ] {
                *budget = (*budget).max(1);
            }
        }
        Self {
            cfg,
            allocator,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: BTreeMap::new(),
            next_arrival: 0,
        }
    }

    /// Like [`new`](Self::new), but fails when a budget in `cfg` is 0.
    pub fn try_new(cfg: SchedulerConfig, allocator: BlockAllocator) -> Result<Self> {
        cfg.validate()?;
        Ok(Self::new(cfg, allocator))
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The longest sequence, prompt plus `max_new_tokens`, that can ever run: it must fit in
    /// the whole cache and in one step's `max_batch_total_tokens`.
    pub fn max_sequence_tokens(&self) -> usize {
        let cache_tokens = self.allocator.num_total() * self.allocator.block_size();
        cache_tokens.min(self.cfg.max_batch_total_tokens)
    }

    /// Queues a sequence for admission.
    pub fn add(&mut self, seq: NewSequence) -> Result<()> {
        if self.seqs.contains_key(&seq.seq_id) {
            return Err(EngineError::DuplicateSequence { seq_id: seq.seq_id });
        }
        if seq.prompt_ids.is_empty() {
            return Err(EngineError::InvalidParameter {
                field: "prompt_ids",
                reason: "must hold at least one token".to_owned(),
                given: "0 tokens".to_owned(),
            });
        }
        if seq.max_new_tokens == 0 {
            return Err(EngineError::InvalidParameter {
                field: "max_new_tokens",
                reason: "must be at least 1".to_owned(),
                given: "0".to_owned(),
            });
        }
        let num_tokens = seq.prompt_ids.len().saturating_add(seq.max_new_tokens);
        let limit = self.max_sequence_tokens();
        if num_tokens > limit {
            return Err(EngineError::PromptTooLong { num_tokens, limit });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.waiting.push_back(seq.seq_id);
        self.seqs.insert(seq.seq_id, Sequence::new(seq, arrival));
        Ok(())
    }

    /// Plans one forward step, allocating the blocks it needs and preempting when it must.
    pub fn schedule(&mut self) -> Batch {
        let mut batch = Batch::default();
        let mut budget = Budget::new(&self.cfg);
        // Some running sequence that still needs compute got no turn this step.
        let mut any_running_left_out = false;

        let (decodes, prefills): (Vec<SeqId>, Vec<SeqId>) =
            self.running.values().copied().partition(|id| {
                let seq = &self.seqs[id];
                seq.num_computed_tokens >= seq.prompt_ids.len()
                    && seq.num_computed_tokens + 1 == seq.num_tokens()
            });
        for seq_id in decodes.into_iter().chain(prefills) {
            let Some(seq) = self.seqs.get(&seq_id) else {
                continue;
            };
            if seq.status != SequenceStatus::Running || seq.is_done() {
                // Preempted earlier in this step, or awaiting finish().
                continue;
            }
            let start_pos = seq.num_computed_tokens;
            let n = budget.chunk_len(start_pos, seq.num_tokens(), seq.prompt_ids.len());
            if n == 0 {
                any_running_left_out = true;
                continue;
            }
            if !self.grow_blocks(seq_id, start_pos + n, &mut batch, &mut budget) {
                continue;
            }
            let item = self.make_item(seq_id, n);
            budget.charge(&item);
            batch.items.push(item);
        }

        if batch.preempted.is_empty() && !any_running_left_out {
            self.admit_waiting(&mut batch, &mut budget);
        }
        batch
    }

    /// Records the outcome of `batch`: every item's tokens now have KV, and items with
    /// `sample` get their token from `sampled`. Items of sequences finished or preempted since
    /// the batch was planned are ignored.
    pub fn commit(&mut self, batch: &Batch, sampled: &[(SeqId, u32)]) {
        let sampled: HashMap<SeqId, u32> = sampled.iter().copied().collect();
        let block_size = self.allocator.block_size();
        for item in &batch.items {
            let Some(seq) = self.seqs.get_mut(&item.seq_id) else {
                continue;
            };
            if seq.status != SequenceStatus::Running
                || seq.num_computed_tokens != item.start_pos
                || seq.block_table.len() * block_size < item.context_len
            {
                tracing::debug!(seq_id = %item.seq_id, "commit skips a stale batch item");
                continue;
            }
            seq.num_computed_tokens = item.context_len;
            if item.sample {
                match sampled.get(&item.seq_id) {
                    Some(&token_id) => seq.output_ids.push(token_id),
                    None => {
                        // Without a token the last position must be fed again to sample.
                        tracing::warn!(seq_id = %item.seq_id, "no sampled token for a sampling item");
                        seq.num_computed_tokens -= 1;
                    }
                }
            }
            if self.cfg.enable_prefix_caching {
                seq.update_block_hashes(block_size);
                let num_full = seq.num_computed_tokens / block_size;
                for index in seq.num_registered_blocks..num_full {
                    self.allocator
                        .register_hash(seq.block_table[index], seq.block_hashes[index]);
                }
                seq.num_registered_blocks = seq.num_registered_blocks.max(num_full);
            }
        }
    }

    /// Forgets a finished or cancelled sequence in any state and frees its blocks at once.
    pub fn finish(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .remove(&seq_id)
            .ok_or(EngineError::UnknownSequence(seq_id))?;
        match seq.status {
            SequenceStatus::Running => {
                self.running.remove(&seq.arrival);
            }
            SequenceStatus::Waiting => self.waiting.retain(|&id| id != seq_id),
        }
        for block_id in seq.block_table {
            self.allocator
                .free(block_id)
                .expect("a sequence holds one reference to each block of its table");
        }
        Ok(())
    }

    /// Makes waiting `seq_id` compute its whole prompt instead of taking cached blocks: a
    /// sequence that needs every prompt position's logits. False when it is not waiting.
    pub fn compute_whole_prompt(&mut self, seq_id: SeqId) -> bool {
        match self.seqs.get_mut(&seq_id) {
            Some(seq) if seq.status == SequenceStatus::Waiting => {
                seq.reuse_prefix = false;
                true
            }
            _ => false,
        }
    }

    pub fn sequence(&self, seq_id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&seq_id)
    }

    /// Some tracked sequence still needs compute.
    pub fn has_work(&self) -> bool {
        self.waiting
            .iter()
            .chain(self.running.values())
            .any(|id| !self.seqs[id].is_done())
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }

    pub fn allocator_mut(&mut self) -> &mut BlockAllocator {
        &mut self.allocator
    }

    pub fn stats(&self) -> SchedulerStats {
        let (prefix_hit_blocks, prefix_queried_blocks) = self.allocator.prefix_stats();
        SchedulerStats {
            num_waiting: self.num_waiting(),
            num_running: self.num_running(),
            num_blocks_total: self.allocator.num_total(),
            num_blocks_used: self.allocator.num_used(),
            num_blocks_free: self.allocator.num_free(),
            num_blocks_cached: self.allocator.num_cached(),
            prefix_hit_blocks,
            prefix_queried_blocks,
        }
    }

    /// Admits waiting sequences in order until one does not fit.
    fn admit_waiting(&mut self, batch: &mut Batch, budget: &mut Budget) {
        let mut index = 0;
        while index < self.waiting.len() {
            let seq_id = self.waiting[index];
            if self.seqs[&seq_id].is_done() {
                // Preempted after its last token; it only awaits finish().
                index += 1;
                continue;
            }
            let Some(item) = self.try_admit(seq_id, budget) else {
                break;
            };
            self.waiting.remove(index);
            budget.charge(&item);
            batch.items.push(item);
        }
    }

    /// Admits `seq_id` with its first chunk when that fits in `budget` and the free blocks,
    /// reusing its cached prefix.
    fn try_admit(&mut self, seq_id: SeqId, budget: &Budget) -> Option<BatchItem> {
        let block_size = self.allocator.block_size();
        let seq = self.seqs.get_mut(&seq_id).expect("waiting ids are tracked");
        let num_tokens = seq.num_tokens();
        // Reuse at most (len - 1) / block_size blocks, so at least one token is computed.
        let num_reusable = if self.cfg.enable_prefix_caching && seq.reuse_prefix {
            seq.update_block_hashes(block_size);
            (num_tokens - 1) / block_size
        } else {
            0
        };
        let reusable = &seq.block_hashes[..num_reusable];
        let mut num_hits = 0;
        let mut num_revived = 0;
        for &hash in reusable {
            let Some(block_id) = self.allocator.lookup(hash) else {
                break;
            };
            num_hits += 1;
            num_revived += usize::from(self.allocator.ref_count(block_id) == 0);
        }

        let start_pos = num_hits * block_size;
        let n = budget.chunk_len(start_pos, num_tokens, seq.prompt_ids.len());
        if n == 0 {
            return None;
        }
        let num_new_blocks = (start_pos + n).div_ceil(block_size) - num_hits;
        // Reviving cached blocks takes them out of the free count too.
        if num_new_blocks + num_revived > self.allocator.num_free() {
            return None;
        }
        let mut block_table = self.allocator.acquire_cached_prefix(reusable);
        debug_assert_eq!(block_table.len(), num_hits);
        block_table.extend(
            self.allocator
                .allocate_n(num_new_blocks)
                .expect("checked against num_free"),
        );
        seq.block_table = block_table;
        seq.num_computed_tokens = start_pos;
        seq.num_registered_blocks = num_hits;
        seq.status = SequenceStatus::Running;
        self.running.insert(seq.arrival, seq_id);
        Some(self.make_item(seq_id, n))
    }

    /// Makes the block table of running `seq_id` cover `context_len` tokens, preempting the
    /// youngest running sequences while blocks are short. False when `seq_id` itself was
    /// preempted.
    fn grow_blocks(
        &mut self,
        seq_id: SeqId,
        context_len: usize,
        batch: &mut Batch,
        budget: &mut Budget,
    ) -> bool {
        let num_blocks = context_len.div_ceil(self.allocator.block_size());
        loop {
            let seq = &self.seqs[&seq_id];
            let needed = num_blocks.saturating_sub(seq.block_table.len());
            if needed <= self.allocator.num_free() {
                let new_blocks = self
                    .allocator
                    .allocate_n(needed)
                    .expect("checked against num_free");
                self.seqs
                    .get_mut(&seq_id)
                    .expect("running ids are tracked")
                    .block_table
                    .extend(new_blocks);
                return true;
            }
            let victim = self.pick_victim();
            self.preempt(victim, batch, budget);
            if victim == seq_id {
                return false;
            }
        }
    }

    /// A running sequence that only awaits finish(), else the youngest running one.
    fn pick_victim(&self) -> SeqId {
        self.running
            .values()
            .rev()
            .find(|id| self.seqs[id].is_done())
            .or_else(|| self.running.values().next_back())
            .copied()
            .expect("the sequence asking for blocks is running")
    }

    /// Frees every block of running `seq_id` and queues it first for recompute.
    fn preempt(&mut self, seq_id: SeqId, batch: &mut Batch, budget: &mut Budget) {
        if let Some(pos) = batch.items.iter().position(|item| item.seq_id == seq_id) {
            let item = batch.items.remove(pos);
            budget.refund(&item);
        }
        let seq = self.seqs.get_mut(&seq_id).expect("running ids are tracked");
        for block_id in seq.block_table.drain(..) {
            self.allocator
                .free(block_id)
                .expect("a sequence holds one reference to each block of its table");
        }
        seq.num_computed_tokens = 0;
        seq.num_registered_blocks = 0;
        seq.num_preemptions += 1;
        seq.status = SequenceStatus::Waiting;
        self.running.remove(&seq.arrival);
        self.waiting.push_front(seq_id);
        batch.preempted.push(seq_id);
        tracing::debug!(seq_id = %seq_id, num_preemptions = seq.num_preemptions, "preempted sequence");
    }

    fn make_item(&self, seq_id: SeqId, n: usize) -> BatchItem {
        let seq = &self.seqs[&seq_id];
        let start_pos = seq.num_computed_tokens;
        let context_len = start_pos + n;
        BatchItem {
            seq_id,
            token_ids: seq.tokens(start_pos..context_len),
            start_pos,
            context_len,
            block_table: seq.block_table.clone(),
            sample: context_len == seq.num_tokens(),
            is_prefill: n > 1 || start_pos < seq.prompt_ids.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(caching: bool) -> SchedulerConfig {
        SchedulerConfig {
            max_batch_prefill_tokens: 64,
            max_batch_total_tokens: 64,
            max_num_seqs: 8,
            max_prefill_chunk_tokens: 4,
            enable_prefix_caching: caching,
        }
    }

    fn scheduler(cfg: SchedulerConfig, num_blocks: usize, block_size: usize) -> Scheduler {
        Scheduler::try_new(cfg, BlockAllocator::new(num_blocks, block_size)).unwrap()
    }

    fn new_seq(id: u64, prompt_ids: Vec<u32>, max_new_tokens: usize) -> NewSequence {
        NewSequence {
            seq_id: SeqId(id),
            prompt_ids,
            max_new_tokens,
        }
    }

    /// Schedules and commits one step, sampling `token_id` for every sampling item.
    fn step(s: &mut Scheduler, token_id: u32) -> Batch {
        let batch = s.schedule();
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|item| item.sample)
            .map(|item| (item.seq_id, token_id))
            .collect();
        s.commit(&batch, &sampled);
        batch
    }

    fn chunks(batch: &Batch, seq_id: u64) -> Vec<u32> {
        batch
            .items
            .iter()
            .find(|item| item.seq_id == SeqId(seq_id))
            .map(|item| item.token_ids.clone())
            .unwrap_or_default()
    }

    #[test]
    fn chunked_prefill_splits_ten_tokens_into_4_4_2() {
        let mut s = scheduler(config(false), 16, 4);
        let prompt: Vec<u32> = (100..110).collect();
        s.add(new_seq(1, prompt.clone(), 3)).unwrap();

        let lens: Vec<(usize, usize, bool)> = (0..3)
            .map(|_| {
                let batch = step(&mut s, 7);
                let item = &batch.items[0];
                assert_eq!(item.token_ids, prompt[item.start_pos..item.context_len]);
                assert!(item.block_table.len() * 4 >= item.context_len);
                (item.start_pos, item.token_ids.len(), item.sample)
            })
            .collect();
        assert_eq!(lens, vec![(0, 4, false), (4, 4, false), (8, 2, true)]);

        // Then one decode token at a time: the last known token.
        let batch = step(&mut s, 8);
        let item = &batch.items[0];
        assert_eq!((item.token_ids.clone(), item.start_pos), (vec![7], 10));
        assert!(item.sample && !item.is_prefill);
        assert_eq!(s.sequence(SeqId(1)).unwrap().output_ids, vec![7, 8]);
    }

    #[test]
    fn decodes_come_first_and_prefill_budget_cuts_chunks() {
        let mut cfg = config(false);
        cfg.max_batch_prefill_tokens = 6;
        let mut s = scheduler(cfg, 32, 4);
        s.add(new_seq(1, vec![1; 3], 4)).unwrap();
        step(&mut s, 9);
        s.add(new_seq(2, vec![2; 10], 4)).unwrap();
        s.add(new_seq(3, vec![3; 10], 4)).unwrap();
        let batch = step(&mut s, 9);
        let ids: Vec<u64> = batch.items.iter().map(|item| item.seq_id.0).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(chunks(&batch, 1), vec![9]);
        assert_eq!((chunks(&batch, 2).len(), chunks(&batch, 3).len()), (4, 2));
        assert_eq!(batch.num_prefill_tokens(), 6);
        // The partially prefilled sequences continue before anything new is admitted.
        s.add(new_seq(4, vec![4; 2], 4)).unwrap();
        let batch = step(&mut s, 9);
        assert_eq!(chunks(&batch, 2).len(), 4);
        assert_eq!(chunks(&batch, 3).len(), 2);
        assert!(chunks(&batch, 4).is_empty());
    }

    #[test]
    fn total_tokens_and_num_seqs_are_respected() {
        let mut cfg = config(false);
        cfg.max_batch_total_tokens = 12;
        cfg.max_num_seqs = 2;
        let mut s = scheduler(cfg, 32, 4);
        for id in 0..3 {
            s.add(new_seq(id, vec![5; 4], 4)).unwrap();
        }
        for _ in 0..20 {
            let batch = step(&mut s, 1);
            assert!(batch.items.len() <= 2);
            assert!(batch.num_context_tokens() <= 12);
            for seq_id in (0..3).map(SeqId) {
                if s.sequence(seq_id).is_some_and(Sequence::is_done) {
                    s.finish(seq_id).unwrap();
                }
            }
        }
        assert!(!s.has_work());
        assert_eq!(s.allocator().num_free(), 32);
    }

    #[test]
    fn preempted_sequence_resumes_with_identical_history() {
        // 4 blocks of 2 tokens: two 3-token prompts fit, but not both as they grow.
        let mut s = scheduler(config(false), 4, 2);
        s.add(new_seq(1, vec![10, 11, 12], 5)).unwrap();
        s.add(new_seq(2, vec![20, 21, 22], 5)).unwrap();
        let mut fed: HashMap<u64, Vec<(usize, Vec<u32>)>> = HashMap::new();
        let mut preempted = Vec::new();
        let mut next_token = 0;
        while s.has_work() {
            next_token += 1;
            let batch = step(&mut s, next_token);
            preempted.extend(batch.preempted.iter().map(|id| id.0));
            for item in &batch.items {
                fed.entry(item.seq_id.0)
                    .or_default()
                    .push((item.start_pos, item.token_ids.clone()));
            }
            for id in [1, 2] {
                if s.sequence(SeqId(id)).is_some_and(Sequence::is_done) {
                    let seq = s.sequence(SeqId(id)).unwrap();
                    let all: Vec<u32> = seq.all_tokens().collect();
                    // Whatever was fed at a position, before or after preemption, is the
                    // token the history holds there.
                    for (start_pos, tokens) in &fed[&id] {
                        assert_eq!(tokens[..], all[*start_pos..start_pos + tokens.len()]);
                    }
                    s.finish(SeqId(id)).unwrap();
                }
            }
        }
        // The younger sequence was preempted, recomputed from position 0, and went on.
        assert!(preempted.contains(&2) && !preempted.contains(&1));
        assert!(
            fed[&2]
                .iter()
                .filter(|(start_pos, _)| *start_pos == 0)
                .count()
                >= 2
        );
        assert_eq!(s.allocator().num_used(), 0);
    }

    #[test]
    fn recompute_keeps_outputs_and_continues_sampling() {
        let mut s = scheduler(config(false), 4, 2);
        s.add(new_seq(1, vec![1, 2, 3], 5)).unwrap();
        s.add(new_seq(2, vec![4, 5, 6], 5)).unwrap();
        let mut outputs_at_preemption = None;
        for token_id in 50.. {
            let batch = step(&mut s, token_id);
            if batch.preempted.contains(&SeqId(2)) {
                let seq = s.sequence(SeqId(2)).unwrap();
                assert_eq!((seq.num_computed_tokens, seq.num_preemptions), (0, 1));
                assert!(seq.block_table.is_empty());
                outputs_at_preemption = Some(seq.output_ids.clone());
                break;
            }
        }
        let outputs = outputs_at_preemption.expect("sequence 2 was preempted");
        assert_eq!(s.num_waiting(), 1);
        s.finish(SeqId(1)).unwrap();
        // Recompute: prompt ++ outputs, in chunks, then sampling resumes at the end.
        let mut recomputed = Vec::new();
        loop {
            let batch = step(&mut s, 99);
            let item = &batch.items[0];
            recomputed.extend(item.token_ids.clone());
            if item.sample {
                break;
            }
        }
        let expected: Vec<u32> = [4, 5, 6].into_iter().chain(outputs.clone()).collect();
        assert_eq!(recomputed, expected);
        let seq = s.sequence(SeqId(2)).unwrap();
        assert_eq!(seq.output_ids[..outputs.len()], outputs[..]);
        assert_eq!(seq.output_ids.last(), Some(&99));
    }

    #[test]
    fn admission_never_preempts() {
        let mut s = scheduler(config(false), 4, 2);
        s.add(new_seq(1, vec![1; 4], 4)).unwrap();
        step(&mut s, 0);
        step(&mut s, 0);
        // Three blocks held; a 4-token prompt needs two and must wait.
        s.add(new_seq(2, vec![2; 4], 2)).unwrap();
        let batch = step(&mut s, 0);
        assert!(batch.preempted.is_empty());
        assert_eq!(chunks(&batch, 1).len(), 1);
        assert!(chunks(&batch, 2).is_empty());
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn prefix_cache_reuses_full_blocks_but_computes_the_last_token() {
        let mut s = scheduler(config(true), 16, 4);
        let prompt: Vec<u32> = (0..9).collect();
        s.add(new_seq(1, prompt.clone(), 1)).unwrap();
        while !s.sequence(SeqId(1)).unwrap().is_done() {
            step(&mut s, 42);
        }
        let first_table = s.sequence(SeqId(1)).unwrap().block_table.clone();
        s.finish(SeqId(1)).unwrap();
        assert_eq!(s.allocator().num_cached(), 2);

        s.add(new_seq(2, prompt.clone(), 1)).unwrap();
        let batch = s.schedule();
        let item = &batch.items[0];
        assert_eq!((item.start_pos, item.token_ids.clone()), (8, vec![8]));
        assert_eq!(item.block_table[..2], first_table[..2]);
        assert_eq!(s.allocator().prefix_stats(), (2, 4));

        // A prompt of exactly two blocks reuses only the first, so one token remains.
        s.add(new_seq(3, prompt[..8].to_vec(), 1)).unwrap();
        let batch = s.schedule();
        let item = batch
            .items
            .iter()
            .find(|item| item.seq_id == SeqId(3))
            .unwrap();
        assert_eq!(item.start_pos, 4);
        assert_eq!(s.allocator().ref_count(first_table[0]), 2);
    }

    #[test]
    fn a_sequence_computing_its_whole_prompt_skips_the_prefix_cache() {
        let mut s = scheduler(config(true), 16, 4);
        let prompt: Vec<u32> = (0..9).collect();
        s.add(new_seq(1, prompt.clone(), 1)).unwrap();
        while !s.sequence(SeqId(1)).unwrap().is_done() {
            step(&mut s, 42);
        }
        s.finish(SeqId(1)).unwrap();
        assert_eq!(s.allocator().num_cached(), 2);

        s.add(new_seq(2, prompt.clone(), 1)).unwrap();
        assert!(s.compute_whole_prompt(SeqId(2)));
        let batch = s.schedule();
        // From the first token (the cached run above started at 8), in this config's chunks.
        assert_eq!(batch.items[0].start_pos, 0);
        assert_eq!(batch.items[0].token_ids, prompt[..4]);
        assert_eq!(
            s.allocator().prefix_stats().0,
            0,
            "no block taken from the cache"
        );
        // Once admitted, the choice is made.
        assert!(!s.compute_whole_prompt(SeqId(2)));
    }

    #[test]
    fn generated_tokens_fill_and_register_blocks() {
        let mut s = scheduler(config(true), 16, 2);
        s.add(new_seq(1, vec![1, 2, 3], 4)).unwrap();
        while !s.sequence(SeqId(1)).unwrap().is_done() {
            step(&mut s, 5);
        }
        // Tokens 1 2 3 5 5 5 (+ the last 5, never fed): three full blocks computed.
        let hashes = crate::kv::prefix::block_hashes(&[1, 2, 3, 5, 5, 5], 2);
        assert_eq!(s.allocator().count_cached_prefix(&hashes), 3);
    }

    #[test]
    fn cancel_in_any_state_frees_blocks_and_commit_ignores_it() {
        let mut s = scheduler(config(true), 8, 2);
        s.add(new_seq(1, vec![1; 6], 3)).unwrap();
        s.add(new_seq(2, vec![2; 3], 3)).unwrap();
        let batch = s.schedule();
        assert_eq!(s.num_running(), 2);
        s.finish(SeqId(1)).unwrap();
        s.commit(&batch, &[(SeqId(2), 7)]);
        assert!(s.sequence(SeqId(1)).is_none());
        assert_eq!(s.allocator().num_used(), 2);
        s.add(new_seq(3, vec![3; 3], 3)).unwrap();
        s.finish(SeqId(3)).unwrap();
        s.finish(SeqId(2)).unwrap();
        assert!(matches!(
            s.finish(SeqId(2)),
            Err(EngineError::UnknownSequence(SeqId(2)))
        ));
        assert_eq!((s.num_waiting(), s.num_running()), (0, 0));
        assert_eq!(s.allocator().num_free(), 8);
        assert!(!s.has_work());
    }

    #[test]
    fn add_validates_its_input() {
        let mut s = scheduler(config(false), 4, 4);
        s.add(new_seq(1, vec![1], 1)).unwrap();
        assert!(matches!(
            s.add(new_seq(1, vec![1], 1)),
            Err(EngineError::DuplicateSequence { seq_id: SeqId(1) })
        ));
        assert!(matches!(
            s.add(new_seq(2, vec![], 1)),
            Err(EngineError::InvalidParameter {
                field: "prompt_ids",
                ..
            })
        ));
        assert!(matches!(
            s.add(new_seq(2, vec![1], 0)),
            Err(EngineError::InvalidParameter {
                field: "max_new_tokens",
                ..
            })
        ));
        assert!(matches!(
            s.add(new_seq(2, vec![1; 10], 7)),
            Err(EngineError::PromptTooLong {
                num_tokens: 17,
                limit: 16
            })
        ));
        s.add(new_seq(2, vec![1; 10], 6)).unwrap();
    }

    #[test]
    fn zero_budgets_are_rejected_or_raised() {
        let mut cfg = config(false);
        cfg.max_num_seqs = 0;
        assert!(matches!(
            Scheduler::try_new(cfg.clone(), BlockAllocator::new(4, 4)),
            Err(EngineError::InvalidParameter {
                field: "max_num_seqs",
                ..
            })
        ));
        let s = Scheduler::new(cfg, BlockAllocator::new(4, 4));
        assert_eq!(s.config().max_num_seqs, 1);
    }

    #[test]
    fn stats_report_blocks_and_prefix_hits() {
        let mut s = scheduler(config(true), 8, 2);
        s.add(new_seq(1, vec![1; 4], 2)).unwrap();
        step(&mut s, 3);
        let stats = s.stats();
        assert_eq!(stats.num_running, 1);
        assert_eq!(stats.num_blocks_used + stats.num_blocks_free, 8);
        assert_eq!(stats.num_blocks_used, 2);
    }
}
