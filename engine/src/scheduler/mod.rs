//! Continuous-batching scheduler with chunked prefill, recompute preemption and prefix
//! caching. It plans each forward step ([`Scheduler::schedule`]) and records its outcome
//! ([`Scheduler::commit`]); it never runs a model itself.
//!
//! Each step takes, in this order and within every budget of [`SchedulerConfig`]:
//! 1. running sequences that decode (one token: the last known one), oldest first;
//! 2. running sequences still prefilling, oldest first, each cut to a chunk that fits;
//! 3. waiting sequences, first in first out, while they fit without preempting anyone, and
//!    only when every running sequence got its turn and nothing was preempted this step;
//!    with [`Scheduler::set_reserve_output`], only while the blocks also hold every running
//!    sequence and the admitted one at their longest, so that growth preempts nobody.
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
#[cfg(test)]
mod reserve_output_tests;
mod sequence;
#[cfg(test)]
mod tests;
mod windows;
#[cfg(test)]
mod windows_tests;

use std::collections::{BTreeMap, HashMap, VecDeque};

pub use batch::{Batch, BatchItem};
pub use config::{SchedulerConfig, SchedulerStats};
pub use sequence::{NewSequence, Sequence, SequenceStatus};
pub use windows::GroupUsage;

use batch::Budget;

use crate::error::{EngineError, Result};
use crate::ids::SeqId;
use crate::kv::allocator::BlockAllocator;
use windows::WindowPool;

/// Plans forward steps over the sequences it tracks; owns the block allocators: the
/// full-attention group's, and one per sliding-window group ([`crate::kv::groups`]).
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    allocator: BlockAllocator,
    /// The sliding-window groups' pools, group 1 first; empty when every layer keeps every
    /// block.
    windows: Vec<WindowPool>,
    /// Each group's most blocks in use at a step's plan ([`GroupUsage::peak_blocks_used`]).
    peak_used: Vec<usize>,
    seqs: HashMap<SeqId, Sequence>,
    /// Admission order; preempted sequences go to the front.
    waiting: VecDeque<SeqId>,
    /// Running sequences by arrival: the last entry is the youngest.
    running: BTreeMap<u64, SeqId>,
    next_arrival: u64,
    /// See [`set_reserve_output`](Self::set_reserve_output); on by default.
    reserve_output: bool,
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
            windows: Vec::new(),
            peak_used: Vec::new(),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: BTreeMap::new(),
            next_arrival: 0,
            reserve_output: true,
        }
    }

    /// On (the default), a waiting sequence (a new one or a preempted one's recompute) is
    /// admitted only while the blocks hold every running sequence and it at their longest
    /// (prompt plus `max_new_tokens`), as TGI's `max_batch_total_tokens` counts outputs:
    /// admitting by the prompt alone ran out of blocks as sequences grew and preempted them in
    /// a storm (issue 31). Off, admission takes what fits now and growth preempts the youngest
    /// (vLLM's recompute).
    pub fn set_reserve_output(&mut self, on: bool) {
        self.reserve_output = on;
    }

    pub fn reserves_output(&self) -> bool {
        self.reserve_output
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
        self.note_peaks();
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
            let mut registered = 0..0;
            if self.cfg.enable_prefix_caching {
                seq.update_block_hashes(block_size);
                let num_full = seq.num_computed_tokens / block_size;
                for index in seq.num_registered_blocks..num_full {
                    self.allocator
                        .register_hash(seq.block_table[index], seq.block_hashes[index]);
                }
                registered = seq.num_registered_blocks..num_full.max(seq.num_registered_blocks);
                seq.num_registered_blocks = seq.num_registered_blocks.max(num_full);
            }
            Self::settle_windows(&mut self.windows, seq, registered, block_size);
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
        let mut seq = seq;
        Self::free_windows(&mut self.windows, &mut seq);
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

    /// Admits waiting sequences in order until one does not fit (with
    /// [`Scheduler::set_reserve_output`], at its longest beside the running ones).
    fn admit_waiting(&mut self, batch: &mut Batch, budget: &mut Budget) {
        // Nothing to admit (every decode step of a full batch): skip the commitment, whose
        // set of every running block was most of a small model's scheduling cost.
        if self.waiting.is_empty() {
            return;
        }
        let mut committed = self.running_commitment();
        let mut index = 0;
        while index < self.waiting.len() {
            let seq_id = self.waiting[index];
            let seq = &self.seqs[&seq_id];
            if seq.is_done() {
                // Preempted after its last token; it only awaits finish().
                index += 1;
                continue;
            }
            if !self.fits_at_longest(seq, committed.as_deref()) {
                break;
            }
            let Some(item) = self.try_admit(seq_id, budget) else {
                break;
            };
            committed = match committed {
                Some(mut c) => {
                    let added = self.at_longest_per_group(&self.seqs[&seq_id]);
                    for (c, n) in c.iter_mut().zip(added) {
                        *c += n;
                    }
                    Some(c)
                }
                // It was idle; now it runs this one.
                None => self.running_commitment(),
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
        let num_prompt = seq.prompt_ids.len();
        let mut reusable = seq.block_hashes[..num_reusable].to_vec();
        let num_hits = self.allocator.count_cached_prefix(&reusable);
        // The window groups must hold what the first computed token's windows read.
        let (num_hits, window_revived) = self.window_hits(&reusable, num_hits);
        reusable.truncate(num_hits);
        let num_revived = reusable
            .iter()
            .filter(|&&hash| {
                self.allocator
                    .lookup(hash)
                    .is_some_and(|id| self.allocator.ref_count(id) == 0)
            })
            .count();

        let start_pos = num_hits * block_size;
        let n = budget.chunk_len(start_pos, num_tokens, num_prompt);
        if n == 0 {
            return None;
        }
        let num_blocks = (start_pos + n).div_ceil(block_size);
        let num_new_blocks = num_blocks - num_hits;
        // Reviving cached blocks takes them out of the free count too.
        if num_new_blocks + num_revived > self.allocator.num_free() {
            return None;
        }
        let window_needs: Vec<usize> = window_revived.iter().map(|r| r + num_new_blocks).collect();
        if !self.windows_have(&window_needs) {
            return None;
        }
        let window_tables = self.admit_windows(&reusable, num_hits, num_blocks);
        let mut block_table = self.allocator.acquire_cached_prefix(&reusable);
        debug_assert_eq!(block_table.len(), num_hits);
        self.allocator.count_prefix_misses(num_reusable - num_hits);
        block_table.extend(
            self.allocator
                .allocate_n(num_new_blocks)
                .expect("checked against num_free"),
        );
        let seq = self.seqs.get_mut(&seq_id).expect("waiting ids are tracked");
        seq.block_table = block_table;
        seq.window_tables = window_tables;
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
            let window_needs = self.window_needs(seq, context_len);
            if needed <= self.allocator.num_free() && self.windows_have(&window_needs) {
                let new_blocks = self
                    .allocator
                    .allocate_n(needed)
                    .expect("checked against num_free");
                self.seqs
                    .get_mut(&seq_id)
                    .expect("running ids are tracked")
                    .block_table
                    .extend(new_blocks);
                self.grow_windows(seq_id, &window_needs);
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
        Self::free_windows(&mut self.windows, seq);
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
            window_tables: seq.window_tables.clone(),
            sample: context_len == seq.num_tokens(),
            is_prefill: n > 1 || start_pos < seq.prompt_ids.len(),
        }
    }
}
