//! The paged KV cache: storage, the block allocator with its prefix cache, and prefix hashing.

pub mod cache;
