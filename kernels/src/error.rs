//! Errors for kernel calls whose arguments do not fit the cache layout.
//!
//! Every kernel validates all of its arguments before it touches memory, so a bad call returns
//! one of these (naming the values involved) and leaves the cache unchanged instead of panicking.

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    #[error("{what}: expected {expected} elements, given {given}")]
    BadLength {
        what: &'static str,
        expected: usize,
        given: usize,
    },
    #[error("block id {block_id} out of range: the cache has {num_blocks} blocks")]
    BlockOutOfRange { block_id: u32, num_blocks: usize },
    #[error("slot {slot} out of range: the cache has {num_slots} slots")]
    SlotOutOfRange { slot: u32, num_slots: usize },
    #[error("num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")]
    HeadsNotDivisible {
        num_heads: usize,
        num_kv_heads: usize,
    },
    #[error("sequence {seq}: q_len {q_len} exceeds context_len {context_len}")]
    QueryLongerThanContext {
        seq: usize,
        q_len: usize,
        context_len: usize,
    },
    #[error(
        "sequence {seq}: block_table has {given} blocks, context_len {context_len} needs {needed}"
    )]
    BlockTableTooShort {
        seq: usize,
        context_len: usize,
        needed: usize,
        given: usize,
    },
    #[error(
        "sequence {seq}: query rows {q_start}..{q_end} fall outside the {num_tokens} query tokens"
    )]
    QueryRowsOutOfRange {
        seq: usize,
        q_start: usize,
        q_end: usize,
        num_tokens: usize,
    },
    #[error("sequences {first} and {second} claim overlapping query rows")]
    OverlappingQueryRows { first: usize, second: usize },
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A CUDA driver call failed: no device, out of memory, a failed launch.
    #[cfg(feature = "cuda")]
    #[error("cuda: {0}")]
    Cuda(#[from] cudarc::driver::DriverError),
}
