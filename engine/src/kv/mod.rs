//! The paged KV cache: storage, the block allocator with its prefix cache, and prefix hashing.

pub mod allocator;
pub mod cache;
pub mod groups;
pub mod prefix;
pub mod staging;
#[cfg(feature = "cuda")]
mod staging_cuda;
