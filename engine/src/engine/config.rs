//! An engine's sizing and batching limits, and their defaults: the one source the node flags
//! and the simulator read.

use kernels::KvDtype;

/// Sizing and batching limits of one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks; when `None`, `kv_memory_fraction` of available memory is used.
    pub num_kv_blocks: Option<usize>,
    pub kv_memory_fraction: f64,
    pub max_batch_prefill_tokens: usize,
    /// Defaults to every token the cache can hold.
    pub max_batch_total_tokens: Option<usize>,
    pub max_num_seqs: usize,
    /// Chunked prefill: the most prompt tokens of one sequence computed in one step.
    pub max_prefill_chunk_tokens: usize,
    pub enable_prefix_caching: bool,
    /// Decode node: the share of KV blocks that reservations for incoming transfers may hold,
    /// so pushes in flight never starve the running batch.
    pub reservation_fraction: f64,
    /// Longest prompt accepted (TGI's `--max-input-tokens`); the model's context when `None`.
    pub max_input_tokens: Option<usize>,
    /// Longest prompt + max_new_tokens accepted (TGI's `--max-total-tokens`).
    pub max_total_tokens: Option<usize>,
    /// Touch every page of the KV cache at start. Untouched, the cache costs only the blocks in
    /// use (what lets many mock nodes share a machine), but each block's first use then pays
    /// page faults inside a step: 2% of a decode step at batch 64 on a fresh engine.
    pub prefault_kv: bool,
    /// Admit a prompt or a recompute only while the blocks hold every running sequence at its
    /// longest (prompt plus `max_new_tokens`): [`Scheduler::set_reserve_output`](crate::scheduler::Scheduler::set_reserve_output).
    pub reserve_output: bool,
    /// The KV cache's element type; `None` follows the model's dtype (f32, bf16 or f16).
    /// `Some(KvDtype::Int8)` halves the cache against bf16 (`--kv-cache-dtype int8`).
    pub kv_cache_dtype: Option<KvDtype>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_kv_blocks: None,
            kv_memory_fraction: 0.2,
            max_batch_prefill_tokens: 4096,
            max_batch_total_tokens: None,
            max_num_seqs: 256,
            // What the node flags have always served (`--max-prefill-chunk-tokens`), which
            // read this default.
            max_prefill_chunk_tokens: 2048,
            enable_prefix_caching: true,
            reservation_fraction: 0.5,
            max_input_tokens: None,
            max_total_tokens: None,
            prefault_kv: false,
            reserve_output: true,
            kv_cache_dtype: None,
        }
    }
}
