//! The scheduler's budgets, and the counters it exports.

use crate::error::{EngineError, Result};

/// Per-step budgets and features of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most prompt (prefill) tokens computed in one step.
    pub max_batch_prefill_tokens: usize,
    /// Most KV tokens the batch touches in one step: the sum of the items' context lengths.
    /// Also the longest sequence (prompt plus `max_new_tokens`) that
    /// [`Scheduler::add`](super::Scheduler::add) takes.
    pub max_batch_total_tokens: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens of one sequence's prefill chunk in one step.
    pub max_prefill_chunk_tokens: usize,
    /// Share full blocks between sequences with equal prefixes.
    pub enable_prefix_caching: bool,
}

impl SchedulerConfig {
    /// Every budget must allow at least one token or sequence per step, or nothing would run.
    pub fn validate(&self) -> Result<()> {
        let budgets = [
            ("max_batch_prefill_tokens", self.max_batch_prefill_tokens),
            ("max_batch_total_tokens", self.max_batch_total_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_prefill_chunk_tokens", self.max_prefill_chunk_tokens),
        ];
        for (field, value) in budgets {
            if value == 0 {
                return Err(EngineError::InvalidParameter {
                    field,
                    reason: "must be at least 1".to_owned(),
                    given: value.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// Counters for the engine's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_waiting: usize,
    pub num_running: usize,
    pub num_blocks_total: usize,
    pub num_blocks_used: usize,
    pub num_blocks_free: usize,
    pub num_blocks_cached: usize,
    pub prefix_hit_blocks: u64,
    pub prefix_queried_blocks: u64,
}
